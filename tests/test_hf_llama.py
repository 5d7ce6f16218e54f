"""rung vs HF transformers on the same weights: Llama and Qwen3, batched with chunked prefill."""

import pytest
import torch
from helpers import assert_matches_hf, random_prompts, run_greedy, save_hf_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rung.runtime import LLM, SamplingParams

NUM_TOKENS = 32
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1, rms_norm_eps=1e-6)


def _llama():
    return LlamaForCausalLM(LlamaConfig(**COMMON, attn_implementation="eager"))


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True,
                                        attn_implementation="eager"))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_model_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = {"llama": _llama, "qwen3": _qwen3}[request.param]().eval()
    folder = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    return model, folder


def test_eager_matches_hf(hf_model_dir):
    hf_model, folder = hf_model_dir
    prompts = random_prompts(COMMON["vocab_size"])
    _, outs = run_greedy(folder, prompts, NUM_TOKENS, enforce_eager=True)
    assert_matches_hf(hf_model, outs, prompts, NUM_TOKENS)


@torch.no_grad()
def test_prompt_logprobs_match_hf(hf_model_dir):
    """prompt_logprobs under chunked prefill (a 32-token budget): None, then each prompt
    token's logprob, rank and the top 2, as HF's logits give them; a second run of the
    same prompt (its prefix cached) still reports every position."""
    hf_model, folder = hf_model_dir
    prompts = random_prompts(COMMON["vocab_size"], lens=[7, 51, 60])
    llm = LLM(folder, dtype="float32", device="cpu", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs):
            lp = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
            got = out.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None
            for t in range(1, len(prompt)):
                entry, want = got[t], lp[t - 1]
                assert abs(entry[prompt[t]].logprob - float(want[prompt[t]])) <= 1e-4
                assert entry[prompt[t]].rank == int((want > want[prompt[t]]).sum()) + 1
                assert set(want.topk(2).indices.tolist()) <= set(entry)
    assert llm.generate([{"prompt_token_ids": [5, 6]}],
                        SamplingParams(max_tokens=1))[0].prompt_logprobs is None
