"""HF transformers as the numerical oracle: tiny random models saved to a folder."""

from __future__ import annotations

import torch

PROMPT_LENS = [1, 7, 13, 22, 31, 40, 51, 60]


def save_hf_model(model, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


def random_prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of one prompt and each token's raw logprob."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_matches_hf(hf_model, outputs, prompts, num_tokens: int, atol: float = 1e-4) -> None:
    for prompt, out in zip(prompts, outputs):
        want_tokens, want_lps = hf_greedy(hf_model, prompt, num_tokens)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, (
            f"prompt of {len(prompt)} tokens: rung {got.token_ids} != HF {want_tokens}")
        got_lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                   for d, t in zip(got.logprobs, got.token_ids)]
        diff = max(abs(a - b) for a, b in zip(got_lps, want_lps))
        assert diff <= atol, f"prompt of {len(prompt)} tokens: logprob diff {diff:.2e} > {atol}"
