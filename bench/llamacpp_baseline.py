"""llama.cpp (llama-cpp-python) on the same GGUF file: a baseline of the latency harness.

Requests decode as one llama.cpp batch with a sequence id each (llama.cpp's own way of
serving several requests, as its `llama-batched` example does), so a decode step of
``num_reqs`` requests is one ``llama_decode`` of ``num_reqs`` tokens, followed by the
greedy pick from their logits: the same work as one rung engine step. Steps are timed
one by one, like rung's ``engine.step()`` and HF's per-token clock; the prefill (every
prompt in one batch) is the time to the first token.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from rung.bench.hf_baseline import HFRound


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("--baseline llama.cpp needs llama-cpp-python: pip install "
                         "'rung[llamacpp]' (it builds llama.cpp from source, ~10 minutes "
                         "on 2 cores)") from None
    return llama_cpp


class LlamaCppModel:
    """One llama.cpp model and context sized for ``max_num_reqs`` sequences."""

    def __init__(self, path: str, max_num_reqs: int, max_model_len: int,
                 num_threads: int) -> None:
        lc = self.lc = require_llama_cpp()
        lc.llama_backend_init()
        # NOTE: the callback is kept on self: llama.cpp calls it for the process' lifetime
        self._silent = lc.llama_log_callback(_silent)
        lc.llama_log_set(self._silent, ctypes.c_void_p(0))
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {path!r}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max_num_reqs * max_model_len
        cparams.n_batch = cparams.n_ubatch = max(cparams.n_ctx, 512)
        cparams.n_seq_max = max_num_reqs
        cparams.n_threads = cparams.n_threads_batch = num_threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab_size = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, max_num_reqs)

    def _decode(self, rows: list[tuple[int, int, int]]) -> None:
        """rows: (token, position, sequence id); logits for every row."""
        b = self.batch
        for i, (token, pos, seq) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, True
        b.n_tokens = len(rows)
        status = self.lc.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _greedy(self, rows: list[int]) -> list[int]:
        """The argmax token of each batch row in ``rows``."""
        picks = []
        for i in rows:
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i),
                                           shape=(self.vocab_size,))
            picks.append(int(logits.argmax()))
        return picks

    def generate_round(self, prompts: list[list[int]], output_len: int) -> HFRound:
        """Greedy ``output_len`` tokens for each prompt, all in one llama.cpp batch."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        rows = [(t, pos, seq) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        self._decode(rows)
        last_rows = np.cumsum([len(p) for p in prompts]) - 1
        tokens = [[t] for t in self._greedy(last_rows.tolist())]
        ttft = time.perf_counter() - start
        steps = []
        for step in range(1, output_len):
            t0 = time.perf_counter()
            self._decode([(out[-1], len(p) + step - 1, seq)
                          for seq, (p, out) in enumerate(zip(prompts, tokens))])
            for out, t in zip(tokens, self._greedy(list(range(len(prompts))))):
                out.append(t)
            steps.append(time.perf_counter() - t0)
        return HFRound(ttft, steps, tokens)


def _silent(level: int, text: bytes, user_data: int) -> None:
    """llama.cpp's log callback: its load and per-context messages would drown the table."""
