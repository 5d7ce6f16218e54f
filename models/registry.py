"""HF architecture / model_type -> rung model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("rung.models.llama", "LlamaForCausalLM"),
    "mistral": ("rung.models.llama", "LlamaForCausalLM"),
    "qwen3": ("rung.models.llama", "Qwen3ForCausalLM"),
    "gemma4_text": ("rung.models.gemma4", "Gemma4ForCausalLM"),
    "gemma4": ("rung.models.gemma4", "Gemma4ForCausalLM"),
    "gemma4_assistant": ("rung.models.gemma4_mtp", "Gemma4AssistantModel"),
}


def model_class(cfg: dict) -> type[nn.Module]:
    model_type = cfg.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; rung supports "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    module, name = _ARCHITECTURES[model_type]
    return getattr(importlib.import_module(module), name)


def register_model(model_type: str, module: str, class_name: str) -> None:
    """Map an HF ``model_type`` to a rung model class (``module``.``class_name``)."""
    _ARCHITECTURES[model_type] = (module, class_name)
