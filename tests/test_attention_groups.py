"""Attention groups: layers with one KV spec but different query head counts get their own
metadata builder (failure class 2), from the unit up to a running engine."""

import json

import torch

from rung.kernels.attention import Attention
from rung.kernels.torch_backend import TorchBackend
from rung.models import registry
from rung.models.llama import LlamaAttention, LlamaForCausalLM
from rung.models.presets import PRESETS
from rung.runtime import LLM, SamplingParams
from rung.runtime.worker.attention_groups import build_attention_groups

BLOCK_SIZE = 16


def test_query_heads_split_attention_groups_not_kv_groups():
    layers = {"a": Attention("a", 8, 2, 16, scale=0.25),      # 8 query heads
              "b": Attention("b", 4, 2, 16, scale=0.25),      # 4 query heads, same KV
              "c": Attention("c", 8, 2, 16, scale=0.25)}
    spec = layers["a"].kv_spec(BLOCK_SIZE, torch.float32)
    assert all(layer.kv_spec(BLOCK_SIZE, torch.float32) == spec for layer in layers.values())
    groups = build_attention_groups(layers, dict.fromkeys(layers, 0), {0: spec},
                                    TorchBackend, torch.device("cpu"))
    by_heads = {g.key.num_heads_q: g for g in groups}
    assert sorted(by_heads) == [4, 8]
    assert by_heads[8].layer_names == ["a", "c"] and by_heads[4].layer_names == ["b"]
    assert {g.kv_group_id for g in groups} == {0}
    assert [g.builder.num_heads_q for g in groups] == [g.key.num_heads_q for g in groups]


class MixedHeadsLlama(LlamaForCausalLM):
    """tiny-llama whose layer 1 has half the query heads of layer 0 (same KV heads/dim),
    as a draft model next to its target would."""

    def __init__(self, cfg: dict) -> None:
        super().__init__(cfg)
        fewer = {**cfg, "num_attention_heads": cfg["num_attention_heads"] // 2}
        self.model.layers[1].self_attn = LlamaAttention(fewer, "model.layers.1.self_attn.attn",
                                                        qk_norm=False)


def _mixed_heads_llm(tmp_path) -> LLM:
    registry.register_model("mixed_heads_llama", __name__, "MixedHeadsLlama")
    (tmp_path / "config.json").write_text(
        json.dumps({**PRESETS["tiny-llama"], "model_type": "mixed_heads_llama"}))
    return LLM(str(tmp_path), dtype="float32", device="cpu", max_num_seqs=4,
               max_num_batched_tokens=16, max_model_len=64, enforce_eager=True,
               load_format="dummy")


def test_engine_runs_layers_with_different_query_heads(tmp_path):
    llm = _mixed_heads_llm(tmp_path)
    runner = llm.engine.runner
    assert len(runner.kv_groups) == 1
    assert sorted(g.key.num_heads_q for g in runner.attn_groups) == [2, 4]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 20, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    batched = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    for b, a in zip(batched, alone):
        assert len(b.outputs[0].token_ids) == 8
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
