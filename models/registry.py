"""HF architecture / model_type -> rung model class, imported lazily."""

from __future__ import annotations

import importlib

import torch
from torch import nn

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("rung.models.llama", "LlamaForCausalLM"),
    "mistral": ("rung.models.llama", "LlamaForCausalLM"),
    "qwen2": ("rung.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("rung.models.qwen3", "Qwen3ForCausalLM"),
    "phi3": ("rung.models.phi3", "Phi3ForCausalLM"),
    "gemma3_text": ("rung.models.gemma3", "Gemma3ForCausalLM"),
    "gemma4_text": ("rung.models.gemma4", "Gemma4ForCausalLM"),
    "gemma4": ("rung.models.gemma4", "Gemma4ForCausalLM"),
    "gemma4_assistant": ("rung.models.gemma4_mtp", "Gemma4AssistantModel"),
}
# llama.cpp's GGUF architecture -> HF model_type (the model class declares the rest)
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma3": "gemma3_text", "gemma4": "gemma4_text",
}


class DraftModel:
    """A model that drafts for a target (MTP) and is never served on its own: it reads the
    target's KV and input embeddings, so ``bind_target`` runs before the runtime binds KV
    caches, and its forward takes the target's hidden states.

    forward(input_ids [R], target_hidden [R, backbone], positions [R])
        -> (last_hidden [R, hidden], next target_hidden [R, backbone])
    """

    def bind_target(self, target: nn.Module) -> None:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def greedy_round(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy draft round: (token [R] int64, next target_hidden [R, backbone]),
        what the next round takes. Compiled CPU graphs compile this (its source is in the
        artifact key) and call it once per round."""
        last_hidden, target_hidden = self(input_ids, target_hidden, positions)
        return self.compute_logits(last_hidden).argmax(dim=-1), target_hidden

    def greedy_drafts(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                      positions: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """``num_drafts`` greedy rounds at the constant ``positions`` -> drafts
        [R, num_drafts] int64 (what a CUDA graph captures, or eager runs)."""
        drafts = []
        for _ in range(num_drafts):
            input_ids, target_hidden = self.greedy_round(input_ids, target_hidden, positions)
            drafts.append(input_ids)
        return torch.stack(drafts, dim=1)


def model_class(cfg: dict) -> type[nn.Module]:
    model_type = cfg.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; rung supports "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    module, name = _ARCHITECTURES[model_type]
    return getattr(importlib.import_module(module), name)


def register_model(model_type: str, module: str, class_name: str,
                   gguf_arch: str | None = None) -> None:
    """Map an HF ``model_type`` (and llama.cpp's ``gguf_arch``, if any) to a rung model
    class (``module``.``class_name``)."""
    _ARCHITECTURES[model_type] = (module, class_name)
    if gguf_arch is not None:
        GGUF_ARCHITECTURES[gguf_arch] = model_type
