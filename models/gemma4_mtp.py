"""Gemma 4 assistant (MTP drafter): a small Gemma 4 decoder that reads its target's KV.

Every draft round turns (last token, target hidden state) into the next token at one fixed
position p, the position of the last verified token: all rounds of a step attend to the
target's KV of positions 0..p-1 (the token at p is not cached yet), and drafts never enter
any cache. Config and weight facts follow HF transformers' `Gemma4AssistantConfig` /
`Gemma4AssistantForCausalLM`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rung.kernels.attention import Attention
from rung.models.gemma4 import (
    Gemma4LayerSpec,
    Gemma4Model,
    check_gemma4_loaded,
    check_supported,
    layer_specs,
    rope_inv_freqs,
    text_config,
)
from rung.models.layers import STACKED_PARAMS, RotaryEmbedding, decoder_layers
from rung.models.registry import DraftModel
from rung.models.weights import WeightStream, load_named_weights

# HF Gemma4AssistantConfig defaults for the fields config.json may omit.
_ASSISTANT_DEFAULTS: dict = {"backbone_hidden_size": 1536, "use_ordered_embeddings": False,
                             "num_centroids": 2048, "centroid_intermediate_top_k": 32,
                             "tie_word_embeddings": True}
_DRAFT_PREFIX = "draft."      # keeps draft layer names apart from the target's
_TOKEN_ORDERING = "masked_embedding.token_ordering"
# HF stores no K/V for assistant layers; a checkpoint that has them is ignored as HF does.
_UNUSED_KV = ("k_proj", "v_proj", "k_norm", "v_norm")


# --- config ------------------------------------------------------------------------------
def assistant_config(cfg: dict) -> tuple[dict, dict]:
    """(top-level config with defaults, its text decoder config with defaults)."""
    top = {**_ASSISTANT_DEFAULTS, **cfg}
    text = text_config({**(top.get("text_config") or {}), "model_type": "gemma4_text"})
    _check_assistant(top, text)
    return top, text


def _check_assistant(top: dict, text: dict) -> None:
    """ValueError naming the field for what HF's assistant or rung does not support."""
    num_layers, shared = text["num_hidden_layers"], text["num_kv_shared_layers"]
    # NOTE: HF turns a missing num_kv_shared_layers into num_hidden_layers: every layer
    # reads the target's KV, none has K/V projections.
    if shared not in (0, None, num_layers):
        raise ValueError(f"gemma4_assistant text_config num_kv_shared_layers={shared} must "
                         f"equal num_hidden_layers={num_layers} (every layer reads shared KV)")
    for field in ("vocab_size_per_layer_input", "use_double_wide_mlp"):
        if text[field]:
            raise ValueError(f"gemma4_assistant text_config {field}={text[field]!r} is not "
                             "supported (HF requires 0 / False)")
    check_supported({**text, "num_kv_shared_layers": 0})
    if top["use_ordered_embeddings"]:
        _check_centroids(top, text["vocab_size"])


def _check_centroids(top: dict, vocab_size: int) -> None:
    num_centroids, top_k = top["num_centroids"], top["centroid_intermediate_top_k"]
    if num_centroids < 1 or vocab_size % num_centroids:
        raise ValueError(f"num_centroids={num_centroids} must divide vocab_size={vocab_size}")
    if not 1 <= top_k <= num_centroids:
        raise ValueError(f"centroid_intermediate_top_k={top_k} must be in [1, num_centroids="
                         f"{num_centroids}]")


def draft_sliding_window(window: int) -> int:
    """The window rung's Attention needs to see the keys HF's assistant sees.

    HF flips the KV axis and masks |q - kv| <= W with q at flipped index 0: the draft query
    sees the last W + 1 target keys (positions p-1-W .. p-1), one more than a target query.
    rung's rule with seq_len p shows keys j > p - 1 - window, so window = W + 1.
    """
    return window + 1


# --- model -------------------------------------------------------------------------------
class MaskedEmbedding(nn.Module):
    """HF's ordered-embedding head: logits only for the tokens of the top-k centroids."""

    def __init__(self, hidden: int, vocab_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        self.num_centroids, self.top_k = num_centroids, top_k
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        # NOTE: identity until loaded, so random-weight presets get a valid permutation.
        self.register_buffer("token_ordering", torch.arange(vocab_size))   # [vocab] int64

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] in hidden's dtype."""
        num_rows, vocab_size = hidden.shape[0], self.token_ordering.shape[0]
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices        # [R, top_k]
        clusters = self.token_ordering.view(self.num_centroids, -1)          # [C, V / C]
        selected = clusters[top].reshape(num_rows, -1)                       # [R, top_k*V/C]
        embeds = lm_head_weight[selected]                                    # [R, S, hidden]
        selected_logits = torch.einsum("rh,rsh->rs", hidden, embeds)         # [R, S]
        # NOTE: graph-safe fill: HF uses min(selected) - 1 through a host sync; the min is
        # taken per row here, on device (equal to HF's for one row, and argmax unchanged).
        fill = selected_logits.amin(dim=-1, keepdim=True) - 1.0              # [R, 1]
        logits = fill.expand(num_rows, vocab_size).contiguous()              # [R, vocab]
        return logits.scatter(-1, selected, selected_logits)


class Gemma4AssistantModel(nn.Module, DraftModel):
    """The MTP drafter. `bind_target` must run before the runtime binds KV caches."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        top, text = assistant_config(cfg)
        self.config = cfg
        self.text = text
        self.backbone_hidden_size = top["backbone_hidden_size"]
        self.specs = layer_specs({**text, "num_kv_shared_layers": 0})   # own KV shapes
        hidden, vocab_size = text["hidden_size"], text["vocab_size"]
        self.model = Gemma4Model(text, [dataclasses.replace(s, kv_source=i)
                                        for i, s in enumerate(self.specs)])
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn = self._draft_attention(text, self.specs[i], i)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(f)
                                     for t, f in rope_inv_freqs(text, self.specs).items()})
        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, hidden, bias=False)
        self.post_projection = nn.Linear(hidden, self.backbone_hidden_size, bias=False)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.tied = bool(top["tie_word_embeddings"])
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.masked_embedding = (MaskedEmbedding(hidden, vocab_size, top["num_centroids"],
                                                 top["centroid_intermediate_top_k"])
                                 if top["use_ordered_embeddings"] else None)
        # random weights (presets): embeddings only feed the output head, so fan-in scale
        self.embed_init_std = hidden ** -0.5
        self._target: nn.Module | None = None

    @staticmethod
    def _draft_attention(text: dict, spec: Gemma4LayerSpec, index: int) -> Attention:
        """A layer that reads (never writes) KV; its target layer is set by bind_target."""
        window = spec.sliding_window
        # NOTE: kv_sharing_target is a placeholder (the layer type) so writes_kv is False
        # from the start; bind_target replaces it with the target layer's name.
        return Attention(f"{_DRAFT_PREFIX}model.layers.{index}.self_attn.attn",
                         text["num_attention_heads"], spec.num_kv_heads, spec.head_dim,
                         scale=1.0,
                         sliding_window=None if window is None else draft_sliding_window(window),
                         kv_sharing_target=spec.layer_type)

    # --- target ----------------------------------------------------------------------------
    def bind_target(self, target: nn.Module) -> None:
        """Point every draft layer at the target layer whose KV it reads, and keep the target
        (unregistered) for its input embeddings. Raises ValueError on mismatched models."""
        target_cfg = target.config
        self._check_target_sizes(target_cfg)
        sources = _kv_producers(target)
        for i, layer in enumerate(self.model.layers):
            spec = self.specs[i]
            if spec.layer_type not in sources:
                raise ValueError(f"assistant layer {i} is {spec.layer_type}; the target has "
                                 f"no non-shared layer of that type (has {sorted(sources)})")
            index, source = sources[spec.layer_type]
            if (source.head_dim, source.num_kv_heads) != (spec.head_dim, spec.num_kv_heads):
                raise ValueError(
                    f"assistant layer {i} ({spec.layer_type}) has head_dim {spec.head_dim} and "
                    f"{spec.num_kv_heads} KV heads; target layer {index} it reads has head_dim "
                    f"{source.head_dim} and {source.num_kv_heads} KV heads")
            layer.self_attn.attn.kv_sharing_target = (
                target.model.layers[index].self_attn.attn.layer_name)
        # NOTE: a plain attribute, not a submodule: the target's parameters and attention
        # layers must not appear in the drafter's (find_attention_layers, state_dict, .to()).
        self.__dict__["_target"] = target

    def _check_target_sizes(self, target_cfg: dict) -> None:
        if self.backbone_hidden_size != target_cfg["hidden_size"]:
            raise ValueError(f"assistant backbone_hidden_size={self.backbone_hidden_size} != "
                             f"target hidden_size={target_cfg['hidden_size']}")
        if self.text["vocab_size"] != target_cfg["vocab_size"]:
            raise ValueError(f"assistant vocab_size={self.text['vocab_size']} != target "
                             f"vocab_size={target_cfg['vocab_size']}")

    # --- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [R] int64, target_hidden [R, backbone], positions [R]
        -> (last_hidden [R, hidden] after the final norm, next target_hidden [R, backbone])."""
        if self._target is None:
            raise RuntimeError("call bind_target(target) before running the drafter")
        embeds = self._target.embed_input_ids(input_ids)                     # [R, backbone]
        # NOTE: the layers start from the projection as is: no sqrt(hidden) scaling.
        hidden = self.pre_projection(torch.cat((embeds, target_hidden), dim=-1))  # [R, hidden]
        last_hidden = decoder_layers(self.model.layers, self.model.norm, self.rotary, hidden,
                                     positions)                      # [R, hidden]
        return last_hidden, self.post_projection(last_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] fp32 (HF applies no softcap here)."""
        if self.masked_embedding is not None:
            return self.masked_embedding(hidden, self.lm_head.weight).float()
        return self.lm_head(hidden).float()

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: WeightStream) -> None:
        ordering: list[torch.Tensor] = []
        loaded = load_named_weights(self, _take(weights, _TOKEN_ORDERING, ordering),
                                    STACKED_PARAMS, skip_prefixes=self._unused_kv_weights())
        self._load_token_ordering(ordering)
        check_gemma4_loaded(self, loaded, len(self.specs), self.tied)

    def _load_token_ordering(self, ordering: list[torch.Tensor]) -> None:
        if self.masked_embedding is None:
            return
        if not ordering:
            raise ValueError(f"use_ordered_embeddings=True but the checkpoint lacks "
                             f"{_TOKEN_ORDERING!r}")
        buffer = self.masked_embedding.token_ordering
        if ordering[0].shape != buffer.shape:
            raise ValueError(f"checkpoint {_TOKEN_ORDERING!r} has shape "
                             f"{tuple(ordering[0].shape)}, expected {tuple(buffer.shape)}")
        buffer.copy_(ordering[0].long())

    def _unused_kv_weights(self) -> tuple[str, ...]:
        return tuple(f"model.layers.{i}.self_attn.{name}"
                     for i in range(len(self.specs)) for name in _UNUSED_KV)


def _kv_producers(target: nn.Module) -> dict[str, tuple[int, Gemma4LayerSpec]]:
    """layer type -> (index, spec) of the target's last layer of that type with its own KV
    (HF: the layer that stores `shared_kv_states[layer_type]`)."""
    specs = getattr(target, "specs", None)
    if specs is None:
        raise ValueError(f"target {type(target).__name__} is not a Gemma 4 model "
                         "(no per-layer specs): the assistant reads Gemma 4 KV")
    return {s.layer_type: (i, s) for i, s in enumerate(specs) if s.kv_source is None}


def _take(weights: WeightStream, name: str, out: list[torch.Tensor]) -> WeightStream:
    """The stream without ``name``, whose tensor goes to ``out`` (a buffer, not a param)."""
    for hf_name, tensor in weights:
        if hf_name == name:
            out.append(tensor)
        else:
            yield hf_name, tensor
