"""Quality of a GGUF file served quantized: greedy text against llama.cpp on the same file,
and per-token logprobs against rung's dequantized fp32 model.

On the quickstart's three chat prompts (same prompt ids for every model), greedy
``--max-tokens`` tokens from rung ``quantization="gguf"``, rung dequantized fp32 and
llama.cpp (when installed). Then the fp32 model scores the quantized model's tokens
(teacher forcing, ``prompt_logprobs``), so each token's logprob under both models can be
compared (the largest and mean absolute difference); llama.cpp's own tokens are scored
the same way, so its deviation from fp32 on the same file is the yardstick. Where the
greedy texts part, each model is scored on contexts of its own; so both are also scored
on the same contexts: fp32's greedy tokens teacher-forced through rung's quantized model
and through llama.cpp, each against fp32's own logprobs of them.

    OMP_NUM_THREADS=1 python -m rung.bench.gguf_quality --model smollm2-135m

``--text FILE`` adds one long set of shared contexts: the file's first ``--text-tokens``
tokens teacher-forced through all three models (mean, p99 and max of the per-token
difference).

A model without a chat template (a base model: Gemma 3 270M) gets the prompts as plain
text (``--prompt-format plain``, what "auto" picks for it); llama.cpp sees the same ids.
"""

from __future__ import annotations

import argparse

import torch

from rung.models.chat_template import apply_chat_template
from rung.models.loader import resolve_model_path
from rung.runtime.api.llm import LLM
from rung.runtime.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "What is 7 times 8?"]


def _llm(model: str, quantization: str | None, max_model_len: int) -> LLM:
    return LLM(model, device="cpu", dtype="float32", max_model_len=max_model_len,
               max_num_seqs=1, enforce_eager=True, quantization=quantization)


def _greedy(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their own logprobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def _scored(llm: LLM, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Logprobs ``llm`` gives ``tokens`` after ``prompt_ids`` (teacher forcing)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt_ids + tokens}], params, use_tqdm=False)[0]
    scored = out.prompt_logprobs[len(prompt_ids):]
    return [lp[t].logprob for lp, t in zip(scored, tokens)]


def _llamacpp_logits(lcpp, row: int):
    """llama.cpp's logits of batch row ``row`` of its last decode, as fp64 numpy."""
    import numpy as np

    return np.ctypeslib.as_array(lcpp.lc.llama_get_logits_ith(lcpp.ctx, row),
                                 shape=(lcpp.vocab_size,)).astype(np.float64)


def _logprob(logits, token: int) -> float:
    """log softmax(logits)[token], computed from the maximum."""
    import numpy as np

    top = logits.max()
    return float(logits[token] - top - np.log(np.exp(logits - top).sum()))


def _llamacpp_greedy(lcpp, prompt_ids: list[int],
                     max_tokens: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy tokens on one sequence (up to its end-of-generation token, as
    rung stops at EOS) and its own logprobs of them."""
    lc = lcpp.lc
    vocab = lc.llama_model_get_vocab(lcpp.model)
    lc.llama_memory_clear(lc.llama_get_memory(lcpp.ctx), True)
    rows = [(t, pos, 0) for pos, t in enumerate(prompt_ids)]
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        lcpp._decode(rows)
        logits = _llamacpp_logits(lcpp, len(rows) - 1)
        token = int(logits.argmax())
        logprobs.append(_logprob(logits, token))
        tokens.append(token)
        if lc.llama_vocab_is_eog(vocab, token):
            break
        rows = [(token, len(prompt_ids) + len(tokens) - 1, 0)]
    return tokens, logprobs


def _llamacpp_scored(lcpp, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Logprobs llama.cpp gives ``tokens`` after ``prompt_ids`` (teacher forcing, one batch)."""
    lc = lcpp.lc
    lc.llama_memory_clear(lc.llama_get_memory(lcpp.ctx), True)
    lcpp._decode([(t, pos, 0) for pos, t in enumerate(prompt_ids + tokens)])
    return [_logprob(_llamacpp_logits(lcpp, row), token)
            for row, token in enumerate(tokens, start=len(prompt_ids) - 1)]


def _diff(own: list[float], scored: list[float]) -> str:
    diffs = sorted(abs(a - b) for a, b in zip(own, scored))
    text = f"max {diffs[-1]:.4f}, mean {sum(diffs) / len(diffs):.4f}"
    if len(diffs) >= 100:
        text += f", p99 {diffs[int(0.99 * (len(diffs) - 1))]:.4f}"
    return text


def _text_quality(quant: LLM, fp32: LLM, lcpp, tokenizer, path: str, num_tokens: int) -> None:
    """Every token of a text after its first, teacher-forced through each model: one long
    set of contexts shared by all, so the mean and the tail compare like for like."""
    with open(path, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())[:num_tokens]
    first, tokens = ids[:1], ids[1:]
    f_scores = _scored(fp32, first, tokens)
    print(f"--- {path}: {len(tokens)} tokens teacher-forced")
    print(f"  |logprob rung gguf - rung fp32| {_diff(_scored(quant, first, tokens), f_scores)}")
    if lcpp is not None:
        print(f"  |logprob llama.cpp - rung fp32| "
              f"{_diff(_llamacpp_scored(lcpp, first, tokens), f_scores)}")


def _prompt_ids(tokenizer, prompt: str, prompt_format: str, model: str) -> list[int]:
    if prompt_format == "auto":
        prompt_format = "chat" if tokenizer.chat_template else "plain"
    if prompt_format == "plain":
        return tokenizer.encode(prompt)
    return apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], None,
                               True, model)["prompt_token_ids"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-format", choices=("auto", "chat", "plain"), default="auto",
                   help="chat template or plain text; auto: chat where the model has one")
    p.add_argument("--text", default=None,
                   help="also teacher-force this text file's first --text-tokens tokens")
    p.add_argument("--text-tokens", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(1)
    max_model_len = max(256, args.text_tokens + 16) if args.text else 256
    quant, fp32 = _llm(args.model, "gguf", max_model_len), _llm(args.model, None, max_model_len)
    tokenizer = fp32.get_tokenizer()
    try:
        from rung.bench.llamacpp_baseline import LlamaCppModel

        lcpp = LlamaCppModel(resolve_model_path(args.model), 1, max_model_len, 1)
    except ValueError as e:
        print(f"llama.cpp skipped: {e}")
        lcpp = None
    for prompt in PROMPTS:
        ids = _prompt_ids(tokenizer, prompt, args.prompt_format, args.model)
        q_tokens, q_logprobs = _greedy(quant, ids, args.max_tokens)
        f_tokens, f_logprobs = _greedy(fp32, ids, args.max_tokens)
        f_scores = _scored(fp32, ids, q_tokens)
        print(f"--- {prompt!r}")
        print(f"  rung gguf : {tokenizer.decode(q_tokens)!r}")
        print(f"  rung fp32 : {tokenizer.decode(f_tokens)!r}  "
              f"(same tokens: {q_tokens == f_tokens})")
        print(f"  |logprob rung gguf - rung fp32| over rung gguf's tokens: "
              f"{_diff(q_logprobs, f_scores)}")
        if lcpp is not None:
            l_tokens, l_logprobs = _llamacpp_greedy(lcpp, ids, args.max_tokens)
            print(f"  llama.cpp : {tokenizer.decode(l_tokens)!r}  "
                  f"(same tokens as rung gguf: {l_tokens == q_tokens})")
            print(f"  |logprob llama.cpp - rung fp32| over llama.cpp's tokens: "
                  f"{_diff(l_logprobs, _scored(fp32, ids, l_tokens))}")
        # the same contexts for both: fp32's greedy tokens, teacher-forced
        print(f"  over rung fp32's tokens: |logprob rung gguf - rung fp32| "
              f"{_diff(_scored(quant, ids, f_tokens), f_logprobs)}")
        if lcpp is not None:
            print(f"  over rung fp32's tokens: |logprob llama.cpp - rung fp32| "
                  f"{_diff(_llamacpp_scored(lcpp, ids, f_tokens), f_logprobs)}")
    if args.text:
        _text_quality(quant, fp32, lcpp, tokenizer, args.text, args.text_tokens)


if __name__ == "__main__":
    main()
