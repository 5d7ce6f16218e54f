"""rung vs HF transformers on the same weights: Llama and Qwen3, batched with chunked prefill."""

import pytest
import torch
from helpers import assert_matches_hf, random_prompts, save_hf_model
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


def _run(folder, prompts, **kwargs):
    llm = LLM(folder, dtype="float32", device="cpu", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    return outs


def test_eager_matches_hf(hf_model_dir):
    hf_model, folder = hf_model_dir
    prompts = random_prompts(COMMON["vocab_size"])
    outs = _run(folder, prompts, enforce_eager=True)
    assert_matches_hf(hf_model, outs, prompts, NUM_TOKENS)
