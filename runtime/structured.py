"""Structured outputs: a request's grammar spec, its compilation off the serving path, and
the per-request matcher that masks the sampler and advances on commit.

The engine is llguidance (the ``structured`` extra). Chosen over xgrammar because its
wheel is one abi3 binary with no Python dependencies (xgrammar 0.2.9 pulls in
apache-tvm-ffi and builds on torch's version), it builds its tokenizer from the same
`tokenizers` JSON rung loads (or from a byte list for the byte-level presets), and its
matcher computes a request's mask straight into a row of the step's int32 bitmask and
rolls back tokens, which speculation needs (`fill_along`).

Flow: `GrammarCompiler.submit` compiles a spec on one worker thread and caches the
result by the spec (the same schema compiles once); the engine holds a request out of the
scheduler until its grammar is ready (`RequestGrammar.ready`), so a compiling request
never blocks the others. Each step `fill_bitmask` writes the constrained rows of the
sampling batch's mask [num_rows, ceil(vocab / 32)] (every bit set on a free row); the
sampler applies it on the device (`apply_bitmask`). ``commit`` feeds each kept token to
the matcher; a grammar that has ended ends the request ("stop"). A preempted request keeps
its output tokens, so its matcher state stays valid.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:       # NOTE: SamplingParams imports this module: it stays torch-free
    import numpy as np
    import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's shape: exactly one of the fields is set. ``json``: a JSON schema (dict or its
    text); ``regex``; ``choice``: the output is one of these strings; ``grammar``: a Lark
    grammar (llguidance's dialect); ``json_object``: any JSON object."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}"
                             f"; got {set_ or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            elif not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs.json={self.json!r} is invalid: must be a "
                                 "JSON schema (a dict or its text)")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice={self.choice!r} is invalid: must be a "
                             "non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name}={value!r} is invalid: must be a "
                                 "non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What the compile cache is keyed by (a schema's text and its dict: one key)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        return self.kind, str(value)

    def to_grammar(self) -> str:
        """llguidance's grammar text (not yet checked: `GrammarCompiler` does that)."""
        from llguidance import LLMatcher

        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      defaults=_JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


# NOTE: compact JSON (no free whitespace): a small model otherwise spends its tokens on
# newlines inside an object
_JSON_OPTIONS = {"whitespace_flexible": False}


def llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of rung's tokenizer over the model's ``vocab_size`` rows; a grammar
    that may end allows any of ``eos_token_ids`` (EOS and the model's generation stops)."""
    import llguidance

    eos = eos_token_ids or [getattr(tokenizer, "eos_token_id", None) or 0]
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None:                                  # HFTokenizer: `tokenizers` JSON
        return llguidance.LLTokenizer(inner.to_str(), n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(_ByteWrapper(tokenizer, vocab_size, eos),
                                  n_vocab=vocab_size, eos_token=eos)


class _ByteWrapper:
    """llguidance's TokenizerWrapper protocol over `ByteTokenizer` (ids past its 259 are
    never produced: empty tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        off = tokenizer._OFFSET
        specials = {i: f"<special_{i}>".encode() for i in range(off)}
        self.tokens = [specials.get(i, bytes([i - off]) if off <= i < off + 256 else b"")
                       for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self.special_token_ids = list(range(off))
        self.is_tokenizer_wrapper = True
        self._tok = tokenizer

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles specs on one worker thread, each distinct spec once (cached by its key,
    the ``max_cached`` most recent: a server's clients choose the specs).
    ``compile`` (blocking; for a caller already off the event loop, e.g. the server's
    request preparation) raises ValueError naming what is wrong."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 max_cached: int = 256) -> None:
        self.max_cached = max_cached
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._llg_tok = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "rung-grammar")
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict())

    @property
    def llg_tokenizer(self) -> Any:
        with self._lock:
            if self._llg_tok is None:
                self._llg_tok = llg_tokenizer(*self._args)
            return self._llg_tok

    def submit(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the checked grammar text (its exception: ValueError)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, spec)
                if len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)   # its requests keep their future
            else:
                self._cache.move_to_end(key)
            return future

    def compile(self, spec: StructuredOutputsParams) -> str:
        return self.submit(spec).result()

    def _compile(self, spec: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher

        try:
            grammar = spec.to_grammar()
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.llg_tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {error}")
        return grammar

    def request_grammar(self, spec: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self, self.submit(spec))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's matcher, built once its grammar has compiled."""

    def __init__(self, compiler: GrammarCompiler, future: concurrent.futures.Future) -> None:
        self._compiler = compiler
        self.future = future
        self.matcher = None

    @property
    def ready(self) -> bool:
        return self.future.done()

    @property
    def error(self) -> str | None:
        """Why the grammar failed to compile (once ready), else None."""
        exc = self.future.exception() if self.future.done() else None
        return str(exc) if exc is not None else None

    def start(self, output_token_ids: list[int]) -> None:
        """Build the matcher (the grammar is ready and valid), advanced over any output the
        request already has."""
        from llguidance import LLMatcher

        self.matcher = LLMatcher(self._compiler.llg_tokenizer, self.future.result(),
                                 log_level=0)
        for token in output_token_ids:
            self.accept(token)

    def accept(self, token: int) -> bool:
        """Advance over a committed token; True when the grammar has ended (the request
        stops here)."""
        m = self.matcher
        if not m.consume_token(token) or m.is_error():
            raise RuntimeError(f"structured outputs: token {token} was sampled outside the "
                               f"grammar ({m.get_error()})")
        return m.is_stopped()

    def fill_along(self, bitmask: np.ndarray, row: int, drafts: list[int]) -> None:
        """Rows ``row .. row + k`` of a request verifying ``drafts``: row i masked with the
        matcher advanced over drafts[:i], then rolled back (commit advances it over what
        is accepted). Past the first draft the grammar refuses, rows stay all-set: that
        draft is rejected (the target's masked token differs from it), so no later row
        is read."""
        num_valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for i in range(num_valid + 1):
            self.fill(bitmask, row + i)
            if i < num_valid and not self.matcher.consume_token(drafts[i]):
                raise RuntimeError(f"structured outputs: draft {drafts[i]} validated but "
                                   f"was refused ({self.matcher.get_error()})")
        if num_valid and not self.matcher.rollback(num_valid):
            raise RuntimeError(f"structured outputs: rollback of {num_valid} drafts failed "
                               f"({self.matcher.get_error()})")

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """This step's allowed tokens into ``bitmask[row]`` (int32 words, bit t % 32 of
        word t // 32)."""
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is clear in ``bitmask`` [R, ceil(V / 32)]
    int32 at -inf: one batched pass on the device, no host round trip."""
    import torch

    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                   # [R, W, 32]
    allowed = bits.flatten(1)[:, :logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
