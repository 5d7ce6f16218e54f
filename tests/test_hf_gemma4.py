"""rung vs HF transformers on the same weights: Gemma 4 text decoder, sliding + full layers,
batched with chunked prefill; multimodal folders; rejected configs."""

import json

import pytest
import torch
from helpers import assert_matches_hf, random_prompts, save_hf_model
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)

from rung.models.gemma4 import Gemma4ForCausalLM as RungGemma4
from rung.runtime import LLM, SamplingParams

NUM_TOKENS = 48
VOCAB = 512
# The issue's test config: 5 sliding layers (head_dim 32, window 16), then 1 full (head_dim 64).
ISSUE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, global_head_dim=64,
             sliding_window=16, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
             initializer_range=0.1)
# Two full layers, and everything else the dense path does: the last 2 layers read earlier
# layers' KV (layer 4 <- 3 sliding, layer 5 <- 1 full) with double-wide MLPs; full layers
# use keys as values with 1 KV head; final logit softcap; untied lm_head; own RoPE settings.
SHARED_KV = dict(ISSUE, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                     "sliding_attention", "sliding_attention", "full_attention"],
                 num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
                 num_global_key_value_heads=1, final_logit_softcapping=30.0,
                 tie_word_embeddings=False,
                 rope_parameters={"sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1000.0},
                                  "full_attention": {"rope_type": "proportional",
                                                     "partial_rotary_factor": 0.5,
                                                     "rope_theta": 10000.0}})
# The MoE block in every layer: 8 experts, top 2, a routed branch beside the dense MLP.
MOE = dict(ISSUE, enable_moe_block=True, num_experts=8, top_k_experts=2,
           moe_intermediate_size=64)
CONFIGS = {"issue": ISSUE, "shared_kv": SHARED_KV, "moe": MOE}


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights, layer scalars and router scales away from 1, so a mis-loaded one shows."""
    gen = torch.Generator().manual_seed(1)
    for name, tensor in model.state_dict().items():
        if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
            tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))


def _hf_text_model(kwargs: dict) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kwargs, attn_implementation="eager")).eval()
    _randomize_norms(model)
    # NOTE: HF 5.24 crashes slicing per_layer_inputs (None without PLE) when it skips
    # prompt tokens in KV-shared layers; recording hidden states turns that shortcut off.
    model.config.output_hidden_states = bool(kwargs.get("num_kv_shared_layers"))
    return model


def _llm(folder, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", max_num_seqs=4,
               max_num_batched_tokens=32, max_model_len=160, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], num_tokens: int = NUM_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    # every KV cache group's pool (block 0 is the null block) is all free again
    assert [p.num_free for p in llm.engine.kv.pools] == \
        [p.num_blocks - 1 for p in llm.engine.kv.pools]
    return outs


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def eager_run(request, tmp_path_factory):
    """(HF model, folder, prompts, eager LLM, its outputs) for one config."""
    model = _hf_text_model(CONFIGS[request.param])
    folder = save_hf_model(model, tmp_path_factory.mktemp(request.param))
    prompts = random_prompts(VOCAB)
    llm = _llm(folder, enforce_eager=True)
    return model, folder, prompts, llm, _generate(llm, prompts)


def test_eager_matches_hf(eager_run):
    hf_model, _, prompts, llm, outs = eager_run
    # NOTE: sliding and full layers differ in head_dim, so they cannot share a block table.
    assert len(llm.engine.runner.kv_groups) == 2
    assert_matches_hf(hf_model, outs, prompts, NUM_TOKENS)


def test_shared_kv_layers_write_no_cache(tmp_path):
    folder = save_hf_model(_hf_text_model(SHARED_KV), tmp_path)
    runner = _llm(folder, enforce_eager=True).engine.runner
    owned = {n for g in runner.kv_groups for n in g.layer_names}
    assert owned == {f"model.layers.{i}.self_attn.attn" for i in range(4)}
    layers = runner.layers
    assert layers["model.layers.4.self_attn.attn"].kv_cache is \
        layers["model.layers.3.self_attn.attn"].kv_cache
    assert layers["model.layers.5.self_attn.attn"].kv_cache is \
        layers["model.layers.1.self_attn.attn"].kv_cache


def test_graphs_match_eager(eager_run):
    _, folder, prompts, _, eager = eager_run
    llm = _llm(folder, enforce_eager=False,
               compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    graphs = _generate(llm, prompts)
    assert llm.engine.stats()["graph_replays"], "no step replayed a graph"
    for want, got in zip(eager, graphs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_multimodal_folder_matches_hf(tmp_path):
    torch.manual_seed(0)
    text = dict(ISSUE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    hf_model = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, attn_implementation="eager")).eval()
    _randomize_norms(hf_model)
    folder = save_hf_model(hf_model, tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "gemma4"
    prompts = random_prompts(VOCAB, lens=[5, 30])
    outs = _generate(_llm(folder, enforce_eager=True), prompts, num_tokens=8)
    assert_matches_hf(hf_model, outs, prompts, 8)


def test_text_config_fills_hf_defaults():
    cfg = RungGemma4.text_config({"model_type": "gemma4", "tie_word_embeddings": False,
                                  "text_config": {"num_hidden_layers": 7}})
    assert cfg["model_type"] == "gemma4_text" and not cfg["tie_word_embeddings"]
    assert cfg["max_position_embeddings"] == 131_072 and cfg["sliding_window"] == 512
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] * 2
    assert cfg["rope_parameters"]["full_attention"]["rope_type"] == "proportional"


@pytest.mark.parametrize("field, value", [("hidden_size_per_layer_input", 256),
                                          ("use_bidirectional_attention", "all")])
def test_unsupported_config_rejected(field, value):
    cfg = {"model_type": "gemma4_text", **ISSUE, field: value}
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        RungGemma4(cfg)


def test_preset_tiny_gemma4_is_not_degenerate():
    llm = LLM("tiny-gemma4", dtype="float32", device="cpu", max_model_len=128,
              enforce_eager=True)
    assert len(llm.engine.runner.kv_groups) == 2
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=0)
    out = llm.generate("the sliding window is sixteen tokens wide", params)[0].outputs[0]
    # NOTE: std-1 embeddings times sqrt(hidden) would drown every layer and make greedy
    # copy the last token with probability ~1; embed_init_std keeps logits spread out.
    greedy = [next(iter(d.values())).logprob for d in out.logprobs]
    assert max(greedy) < -0.1, greedy


@pytest.mark.parametrize("field, value", [("num_experts", None), ("top_k_experts", 9),
                                          ("moe_intermediate_size", 0)])
def test_bad_moe_config_rejected(field, value):
    cfg = {"model_type": "gemma4_text", **MOE, field: value}
    with pytest.raises(ValueError, match=f"{field}"):
        RungGemma4(cfg)


def test_moe_presets_draft_and_verify():
    """tiny-gemma4-moe with its MoE MTP drafter: drafting never changes greedy tokens."""
    kwargs = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4,
                  enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(VOCAB, lens=[3, 9])]
    plain = LLM("tiny-gemma4-moe", **kwargs).generate(prompts, params)
    spec = LLM("tiny-gemma4-moe", speculative_config={
        "method": "mtp", "model": "tiny-gemma4-moe-mtp", "num_speculative_tokens": 3},
        **kwargs)
    drafted = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats()["spec"]["num_drafts"] > 0
