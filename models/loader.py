"""Model loading: presets, local HF folders, dummy weights."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import nn

from rung.models.layers import init_random_weights
from rung.models.presets import PRESETS
from rung.models.registry import model_class
from rung.models.tokenizer import ByteTokenizer, load_tokenizer
from rung.models.weights import iterate_safetensors

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module
    config: dict          # HF-style config (text part for multimodal folders)
    tokenizer: Any        # None when the folder has no tokenizer.json
    name: str


def resolve_config(model: str) -> tuple[dict, str | None]:
    """(config dict, folder or None for presets); clear errors for bad names."""
    if model in PRESETS:
        return dict(PRESETS[model]), None
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a built-in preset "
                         f"({', '.join(sorted(PRESETS))}) nor a local folder")
    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"model folder {model!r} has no config.json")
    with open(path) as f:
        return json.load(f), model


def load_model(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               load_format: str = "auto", seed: int = 0) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} not in {LOAD_FORMATS}")
    cfg, folder = resolve_config(model)
    cls = model_class(cfg)
    cfg = getattr(cls, "text_config", lambda c: c)(cfg)
    with torch.device("cpu"):
        net = cls(cfg)
    if folder is None or load_format == "dummy":
        init_random_weights(net, seed)
    else:
        net.load_weights(iterate_safetensors(folder))
    net = net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    tokenizer = ByteTokenizer() if folder is None else load_tokenizer(folder, cfg)
    return LoadedModel(net, cfg, tokenizer, model)
