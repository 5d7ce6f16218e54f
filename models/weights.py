"""Weight loading from local HF folders."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rung.kernels.gguf_cpu import GGUFBlockWeight

# (HF name, tensor); a ``GGUFBlockWeight`` goes to the ``load_quantized`` of its layer
WeightStream = Iterable[tuple[str, "torch.Tensor | GGUFBlockWeight"]]


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"model folder {folder!r} has no *.safetensors weight files")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_named_weights(model: nn.Module, weights: WeightStream,
                       stacked: list[tuple[str, str, int]],
                       rename: dict[str, str] | None = None,
                       skip_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Copy HF tensors into ``model``; returns the parameter names loaded.

    ``stacked``: (merged param suffix, HF suffix, shard index), e.g.
    ("qkv_proj", "q_proj", 0). ``rename``: HF prefix -> rung prefix.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = hf_name
        for old, new in (rename or {}).items():
            if name.startswith(old):
                name = new + name[len(old):]
        if any(name.startswith(p) for p in skip_prefixes) or "rotary_emb.inv_freq" in name:
            continue
        shard = None
        for merged, hf_part, idx in stacked:
            if f".{hf_part}." in name:
                name, shard = name.replace(f".{hf_part}.", f".{merged}."), idx
                break
        if isinstance(tensor, GGUFBlockWeight):
            _load_quantized(model, hf_name, name, tensor, shard)
            loaded.add(name)
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of "
                             f"{type(model).__name__}")
        param = params[name]
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}"
                                 f", parameter expects {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            owner.load_shard(param, tensor.to(param.dtype), shard)
        loaded.add(name)
    return loaded


def _load_quantized(model: nn.Module, hf_name: str, name: str, weight: GGUFBlockWeight,
                    shard: int | None) -> None:
    try:
        owner = model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        owner = None
    if owner is None or not hasattr(owner, "load_quantized"):
        raise ValueError(f"checkpoint tensor {hf_name!r} is block-quantized, but its layer "
                         f"in {type(model).__name__} is not a quantized layer")
    owner.load_quantized(weight, shard)


def check_all_loaded(model: nn.Module, loaded: set[str], tied: dict[str, str]) -> None:
    """Tie what is tied; every other parameter must have come from the checkpoint."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for dst in tied:
        if dst in params and dst not in loaded:
            loaded.add(dst)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:4]}")
