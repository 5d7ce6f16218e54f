"""HF transformers `generate` on rung's own weights: the baseline of the latency harness.
A GGUF model is loaded by HF's own GGUF reader from the same file instead.

Per-token decode latency is read from a logits processor that stamps the clock once per
generated token: the gap between two stamps is exactly one decode step of `generate`
(forward with past_key_values, logits processing, greedy pick, stopping checks), so
p50 / p90 / p99 come from the same kind of samples as rung's `engine.step()` timings,
and the prefill (time to the first stamp) is kept out of them.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
from torch import nn

from rung.bench.stats import sync
from rung.models.layers import STACKED_PARAMS


@dataclasses.dataclass
class HFRound:
    ttft_s: float                  # generate() start -> first token's logits processed
    step_s: list[float]            # [output_len - 1] decode steps
    token_ids: list[list[int]]     # [num_reqs][output_len] greedy continuations


def hf_model_from_rung(model: nn.Module, config: dict) -> nn.Module:
    """An HF ``*ForCausalLM`` built from rung's config, holding a copy of rung's weights.

    rung fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; they are split
    back by each ``MergedLinear``'s shard sizes.
    """
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError("--baseline hf needs transformers: pip install 'rung[test]'") from None
    raw = dict(config)
    model_type = raw.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **raw)
    except ValueError as e:
        raise ValueError(f"--baseline hf: transformers has no config for {model_type!r}: {e}"
                         ) from None
    param = next(model.parameters())
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=param.dtype)
    _load_split_weights(hf, model)
    return _for_benchmark(hf, param.device)


def hf_model_from_gguf(path: str, model: nn.Module) -> nn.Module:
    """HF's own GGUF loader (``gguf_file=``) on the file rung loaded, in rung's dtype and
    device: the same dequantized weights, read by independent code."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError("--baseline hf needs transformers: pip install 'rung[test]'") from None
    param = next(model.parameters())
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".",
                                              gguf_file=os.path.basename(path),
                                              dtype=param.dtype)
    return _for_benchmark(hf, param.device)


def _for_benchmark(hf: nn.Module, device: torch.device) -> nn.Module:
    hf.generation_config.eos_token_id = None     # never stop early: exactly output_len tokens
    hf.generation_config.pad_token_id = 0
    return hf.to(device).eval()


def _split_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    stacked = _stacked_names()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module_path, _, leaf = name.rpartition(".")
        fused = module_path.rpartition(".")[2]
        if fused not in stacked:
            state[name] = tensor
            continue
        sizes = model.get_submodule(module_path).shard_sizes
        for shard_name, part in zip(stacked[fused], tensor.split(sizes, dim=0)):
            state[f"{module_path.rpartition('.')[0]}.{shard_name}.{leaf}"] = part
    return state


def _stacked_names() -> dict[str, list[str]]:
    """fused module name -> HF shard names in shard order (every rung model fuses alike)."""
    out: dict[str, list[str]] = {}
    for fused, shard, _ in sorted(STACKED_PARAMS, key=lambda t: (t[0], t[2])):
        out.setdefault(fused, []).append(shard)
    return out


def _load_split_weights(hf: nn.Module, model: nn.Module) -> None:
    state = _split_state_dict(model)
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"--baseline hf: rung's weights do not map onto "
                         f"{type(hf).__name__}: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}")


class _StepClock:
    """A logits processor that only reads the clock: called once per generated token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


@torch.inference_mode()
def hf_generate_round(hf: nn.Module, prompts: list[list[int]], output_len: int) -> HFRound:
    """One greedy `generate` of ``output_len`` tokens for a batch of equal-length prompts."""
    from transformers import LogitsProcessorList

    device = next(hf.parameters()).device
    input_ids = torch.tensor(prompts, device=device)               # [num_reqs, input_len]
    clock = _StepClock(device)
    sync(device)
    start = time.perf_counter()
    out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                      max_new_tokens=output_len, do_sample=False,
                      logits_processor=LogitsProcessorList([clock]))
    stamps = clock.stamps
    assert len(stamps) == output_len, f"HF generated {len(stamps)} tokens, not {output_len}"
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return HFRound(stamps[0] - start, steps, out[:, input_ids.shape[1]:].tolist())
