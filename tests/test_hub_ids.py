"""Hugging Face hub ids resolve through the local cache, offline: a tiny model saved in the
cache's layout loads by its id; a missing id says where rung looked and how to fetch it."""

import pytest
import torch
from helpers import assert_matches_hf, random_prompts
from transformers import LlamaConfig, LlamaForCausalLM

from rung.runtime import LLM, SamplingParams

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline hub whose cache (HF_HUB_CACHE) holds REPO_ID as a tiny random Llama."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, attn_implementation="eager")).eval()
    model.save_pretrained(repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # NOTE: huggingface_hub reads both variables once, at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return model, cache


def test_hub_id_loads_from_the_cache_offline(hub_cache):
    model, _ = hub_cache
    llm = LLM(REPO_ID, dtype="float32", device="cpu", max_model_len=128, enforce_eager=True)
    prompts = random_prompts(256, lens=[4, 17])
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_matches_hf(model, outs, prompts, 6)


def test_missing_hub_id_says_where_and_how(hub_cache):
    _, cache = hub_cache
    with pytest.raises(ValueError) as err:
        LLM("HuggingFaceTB/no-such-model", dtype="float32", device="cpu", enforce_eager=True)
    message = str(err.value)
    assert "HuggingFaceTB/no-such-model" in message and str(cache) in message
    assert "hf download HuggingFaceTB/no-such-model" in message and "HF_HUB_OFFLINE" in message
