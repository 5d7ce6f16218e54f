"""What a per-layer compiled graph is built from: one artifact per decoder-layer kind and
one per epilogue range (see per_layer.py), each with its named inputs, the dims it traces
symbolic and its cache key.

A layer's inputs are named relative to the layer (``param.mlp.down_proj.weight``,
``kv.self_attn.attn``, ``meta.self_attn.attn.seq_lens``, ``rotary.cos_table``,
``hidden``, ``positions``), so the artifact traced on layer 0 binds to layer 29 by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch
from torch import nn

from rung.core.forward_context import ForwardContext
from rung.graphs.cpu_compiled.artifacts import (
    MAX_DYNAMIC_SIZE,
    MIN_DYNAMIC_SIZE,
    ArtifactCompiler,
)
from rung.kernels.attention import Attention


class DecoderParts(Protocol):
    """What a model's ``decoder_parts()`` returns (models.layers.DecoderParts): its forward
    is ``norm(layer_n(...layer_1(rope, embed(input_ids))))``, each layer with the rope of
    its ``layer_type``; ``logits(hidden[rows])`` its lm head, reading ``head``'s tensors and
    taking another path past each row count of ``logits_splits``."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: nn.ModuleList
    rotaries: Mapping[str, nn.Module]
    norm: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    head: nn.Module
    logits_splits: tuple[int, ...]


class ArtifactSpec(NamedTuple):
    """One artifact of a per-layer graph: a decoder layer's, or an epilogue's."""

    fn: Callable[..., Any]
    example: list[torch.Tensor]              # what the trace calls ``fn`` with
    named: dict[str, torch.Tensor]
    dynamic: dict[str, tuple[int, ...]]      # name -> dims traced symbolic
    rows: tuple[int, int] | None             # an epilogue's range of row counts; None: a layer
    key: str                                 # NOTE: last: callers read spec[-1]

    @property
    def ranges(self) -> dict[str, tuple[int, int]]:
        """An epilogue's row symbol, traced with its range as bounds (so a branch of the
        head on the row count is decided by the range); none for a layer."""
        if self.rows is None:
            return {}
        return {"rows": (max(self.rows[0], MIN_DYNAMIC_SIZE), self.rows[1])}


_METADATA = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
# NOTE: per-layer names (which KV cache, which metadata a layer reads); what they select
# comes in as inputs, so two layers that differ only in them share code.
_PER_LAYER_ATTRIBUTES = frozenset({"layer_name", "kv_sharing_target", "training"})


def build_layer_artifacts(backend: ArtifactCompiler, specs: list[ArtifactSpec]) -> float:
    """Compile (or load) every artifact in ``specs`` (one per layer kind, the epilogues),
    binding nothing; the seconds spent compiling."""
    seen: set[str] = set()
    compile_s = 0.0
    for spec in specs:
        if spec.key not in seen:
            seen.add(spec.key)
            compile_s += backend.layer_artifact(spec.key, spec.fn, spec.example, spec.named,
                                                spec.dynamic, spec.ranges)[2] or 0.0
    return compile_s


def _layer_fn(layer: nn.Module, rotary: nn.Module) -> Callable[..., torch.Tensor]:
    def run_layer(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # NOTE: the rope's gather from the positions, inside the artifact (fused into the
        # rotation), not once per replay in Python
        return layer((rotary, *rotary.cos_sin(positions, hidden.dtype)), hidden)
    return run_layer


def _epilogue_fn(parts: DecoderParts) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def run_epilogue(hidden: torch.Tensor, rows: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = parts.norm(hidden)
        return hidden, parts.logits(hidden[rows])
    return run_epilogue


def layer_specs(backend: ArtifactCompiler, parts: DecoderParts, ctx: ForwardContext,
                ids: torch.Tensor, positions: torch.Tensor, graph_key: dict[str, Any],
                symbolic: bool) -> list[ArtifactSpec]:
    """The artifact of every decoder layer, then of each epilogue a graph of this many
    tokens may call, on the capture batch ``ids`` / ``positions`` in ``ctx``."""
    hidden = parts.embed(ids)                                            # [T, H]
    specs = []
    for layer in parts.layers:
        rotary = parts.rotaries[layer.layer_type]
        named = layer_tensors(layer, ctx, hidden, positions, rotary)
        dynamic = _layer_dynamic(named, symbolic)
        key = backend.key(named, dynamic, {**graph_key, "per_layer": layer_signature(layer)})
        specs.append(ArtifactSpec(_layer_fn(layer, rotary), [hidden, positions], named,
                                  dynamic, None, key))
    return specs + _epilogue_specs(backend, parts, hidden, graph_key, symbolic)


def _epilogue_specs(backend: ArtifactCompiler, parts: DecoderParts, hidden: torch.Tensor,
                    graph_key: dict[str, Any], symbolic: bool) -> list[ArtifactSpec]:
    """One epilogue per range of logits rows between ``parts.logits_splits`` that a graph
    of ``hidden``'s T tokens may sample (1..T rows).

    NOTE: the rows are traced symbolic WITH the range as the symbol's bounds, so a branch
    of the lm head on the row count is decided by the range (no guard, no specialisation
    at the example size); the range is in the key.
    """
    specs = []
    bounds = [0, *parts.logits_splits, MAX_DYNAMIC_SIZE]
    for lo, hi in zip([b + 1 for b in bounds[:-1]], bounds[1:]):
        if lo > hidden.shape[0]:
            break
        example = max(lo, MIN_DYNAMIC_SIZE)      # NOTE: a trace of 1 row would specialise
        if example > hi:
            raise ValueError(f"logits_splits {parts.logits_splits} leave a range of one row")
        rows = torch.arange(example, device=hidden.device) % hidden.shape[0]     # [N] int64
        named = {"hidden": hidden, "rows": rows, **_module_tensors("norm", parts.norm),
                 **_module_tensors("head", parts.head)}
        dynamic = {"rows": (0,), **({"hidden": (0,)} if symbolic else {})}
        key = backend.key(named, dynamic, {**graph_key, "epilogue_rows": [lo, hi],
                                           "norm": layer_signature(parts.norm),
                                           "head": layer_signature(parts.head)})
        specs.append(ArtifactSpec(_epilogue_fn(parts), [hidden, rows], named, dynamic,
                                  (lo, hi), key))
    return specs


def _module_tensors(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    named = {f"param.{prefix}.{n}": p for n, p in module.named_parameters()}
    named.update({f"buffer.{prefix}.{n}": b for n, b in module.named_buffers()})
    return named


def layer_tensors(layer: nn.Module, ctx: ForwardContext, hidden: torch.Tensor,
                  positions: torch.Tensor, rotary: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a decoder layer may read, by a name relative to the layer."""
    named = {"hidden": hidden, "positions": positions}
    named.update({f"param.{n}": p for n, p in layer.named_parameters()})
    named.update({f"buffer.{n}": b for n, b in layer.named_buffers()})
    named.update({f"rotary.{n}": b for n, b in rotary.named_buffers()})
    for path, module in layer.named_modules():
        if isinstance(module, Attention):
            if module.kv_cache is not None:
                named[f"kv.{path}"] = module.kv_cache
            meta = ctx.attn_metadata[module.layer_name].common
            named.update({f"meta.{path}.{f}": getattr(meta, f) for f in _METADATA})
    return named


def _layer_dynamic(named: dict[str, torch.Tensor], symbolic: bool
                   ) -> dict[str, tuple[int, ...]]:
    """Dims traced as symbols: each KV cache's block count and each block table's width
    (as whole-forward graphs do) and, when ``symbolic``, the token / request dimension."""
    dims: dict[str, tuple[int, ...]] = {}
    for name, t in named.items():
        wide = t.dim() > 1 and t.shape[1] >= MIN_DYNAMIC_SIZE
        if name.startswith("kv.") and wide:
            dims[name] = (1,)
        elif name in ("hidden", "positions") or name.startswith("meta."):
            dims[name] = (((0,) if symbolic else ())
                          + ((1,) if name.endswith(".block_table") and wide else ()))
    return {name: d for name, d in dims.items() if d}


def layer_signature(layer: nn.Module) -> list:
    """What a layer's traced code depends on besides its tensors' shapes: each submodule's
    class and plain attributes (head counts, eps, sliding window, activation...)."""
    return [[path, type(m).__qualname__,
             {k: _describe(v) for k, v in sorted(vars(m).items())
              if not k.startswith("_") and k not in _PER_LAYER_ATTRIBUTES
              and not isinstance(v, torch.Tensor)}]
            for path, m in layer.named_modules()]


def _describe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if dataclasses.is_dataclass(value):
        return repr(value)
    return getattr(value, "__qualname__", type(value).__qualname__)
