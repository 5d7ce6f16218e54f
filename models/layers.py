"""Building blocks shared by rung's model definitions."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Mapping

import torch
from torch import nn

from rung.kernels.batch_invariant import is_batch_invariant
from rung.kernels.gguf_cpu import (
    GGUFBlockWeight,
    f32_linear,
    gguf_embed,
    gguf_gemm,
    load_kernel,
    rows_in_one_buffer,
    stack_rows,
)
from rung.kernels.gguf_cpu import available as gguf_cpu_available
from rung.kernels.int4 import ACTIVATION_DTYPE, Int4Weight, int4_mm, pack_int4

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in fp32, scale by ``weight + weight_offset``."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0,
                 cast_before_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - weight_offset))   # identity
        self.eps = eps
        self.weight_offset = weight_offset
        self.cast_before_scale = cast_before_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight + self.weight_offset if self.weight_offset else self.weight
        if self.cast_before_scale:   # Llama / Qwen: scale in the input dtype
            return weight * xf.to(dtype)
        return (xf * weight.float()).to(dtype)   # Gemma: scale in fp32


class MergedLinear(nn.Linear):
    """One matmul for several HF projections (q/k/v, gate/up); shards load by index."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"checkpoint shard {shard} of a fused projection has "
                             f"{loaded.shape[0]} rows, the model expects {size}")
        param.data[start:start + size].copy_(loaded)


class QuantLinear(nn.Module):
    """A linear layer (no bias) whose weight stays in a GGUF file's blocks.

    Stands in for ``nn.Linear`` / ``MergedLinear`` when a checkpoint holds the weight as
    GGUF blocks (any type of ``KERNEL_TYPES``): each shard arrives as a ``GGUFBlockWeight`` through
    ``load_quantized``, and ``pack`` readies the whole [out, in] weight for the device's
    kernel once every shard is in. On an AVX2 CPU that is rung's own kernel
    (``kernels/gguf_cpu.py``: the blocks as they are, fp32 activations in and out);
    elsewhere torch's int4 kernel (4-bit blocks only, bfloat16 activations). No
    dequantized copy is ever made.
    """

    def __init__(self, in_features: int, shard_sizes: list[int]) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(shard_sizes)
        self.shard_sizes = shard_sizes
        self._pending: dict[int, GGUFBlockWeight] = {}
        self._whole = False                             # one tensor held every shard
        self.type_name = ""                             # its GGUF type(s) ("Q4_K", "Q5_0+Q8_0")
        self.kernel = ""                                # "rung" or "torch_int4" once packed
        # mixed-type shards (rung's kernel): (type, rows, row bytes) of each run in ``rows``
        self.segments: list[tuple[str, int, int]] = []
        # rung's kernel: the file's blocks, per row; torch's: (packed, scales_and_zeros)
        self.register_buffer("rows", None)              # [out, in // 32 * block bytes] uint8
        self.register_buffer("packed", None)            # torch's int4 layout
        self.register_buffer("scales_and_zeros", None)  # [in // 32, out, 2] bf16

    @classmethod
    def replacing(cls, linear: nn.Linear) -> QuantLinear:
        if linear.bias is not None:
            raise ValueError("QuantLinear replaces linear layers without bias only")
        sizes = getattr(linear, "shard_sizes", [linear.out_features])
        return cls(linear.in_features, list(sizes))

    def load_quantized(self, weight: GGUFBlockWeight, shard: int | None) -> None:
        if shard is None and weight.shape == (self.out_features, self.in_features):
            # every shard in one checkpoint tensor (Phi-3's qkv and gate_up in a GGUF)
            self._pending = {i: weight for i in range(len(self.shard_sizes))}
            self._whole = True
            return
        index = 0 if shard is None else shard
        want = (self.shard_sizes[index], self.in_features)
        if weight.shape != want:
            raise ValueError(f"quantized checkpoint shard {index} has shape {weight.shape}, "
                             f"the layer expects {want}")
        self._pending[index] = weight

    def pack(self, device: torch.device, kernel: str | None = None) -> None:
        """Ready the weight for ``kernel`` (default: ``quant_kernel(device)``)."""
        missing = sorted(set(range(len(self.shard_sizes))) - set(self._pending))
        if missing:
            raise ValueError(f"quantized layer lacks checkpoint shards {missing}")
        shards = [self._pending[0]] if self._whole else \
            [self._pending[i] for i in range(len(self.shard_sizes))]
        self._pending.clear()
        self.kernel = kernel or quant_kernel(torch.device(device))
        # runs of consecutive shards of one type stack into one weight (one kernel call)
        runs: list[list[GGUFBlockWeight]] = []
        for shard in shards:
            if runs and runs[-1][0].type_name == shard.type_name:
                runs[-1].append(shard)
            else:
                runs.append([shard])
        weights = [stack_rows(run) for run in runs]
        self.type_name = "+".join(w.type_name for w in weights)
        if self.kernel == "rung":
            load_kernel()       # NOTE: before any graph runs: it registers the op's CPU kernel
            if len(weights) == 1:
                self.rows = weights[0].rows
            else:
                # NOTE: a fused layer of mixed types (llama.cpp's K-quant mixes give q/k and
                # v their own types): one flat buffer, each type's rows a view of it
                self.segments = [(w.type_name, *w.rows.shape) for w in weights]
                self.rows = torch.cat([w.rows.reshape(-1) for w in weights])
            return
        if len(weights) != 1 or weights[0].type_name not in ("Q4_0", "Q4_1"):
            raise ValueError(f"torch's int4 kernel on {device} cannot run "
                             f"{'mixed' if len(weights) > 1 else weights[0].bits}-bit blocks "
                             f"of {self.type_name} (it runs Q4_0 and Q4_1)")
        weight = weights[0]
        scale = weight.scale()
        int4 = Int4Weight(weight.values().to(torch.uint8), scale,
                          weight.offset() + 8.0 * scale)          # (q - 8) s + z = s q + o
        self.packed, self.scales_and_zeros = pack_int4([int4], torch.device(device))

    @property
    def rounds_activations(self) -> bool:
        """Whether the input is rounded to int8 (per group of 32) before the matmul: rung's
        kernel does, torch's int4 kernel takes bfloat16 as it is."""
        return self.kernel == "rung"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)                          # [M, in]
        if self.kernel == "rung" and self.segments:
            outs, start = [], 0
            for type_name, num_rows, row_bytes in self.segments:
                part = self.rows[start:start + num_rows * row_bytes].view(num_rows, row_bytes)
                outs.append(gguf_gemm(rows, GGUFBlockWeight(part, type_name)))
                start += num_rows * row_bytes
            out = torch.cat(outs, dim=1)                                # [M, out] fp32
        elif self.kernel == "rung":
            out = gguf_gemm(rows, GGUFBlockWeight(self.rows, self.type_name))  # [M, out] fp32
        else:
            if x.dtype != ACTIVATION_DTYPE:
                raise ValueError(f"torch's int4 kernel takes {ACTIVATION_DTYPE} "
                                 f"activations, got {x.dtype}")
            out = int4_mm(rows, self.packed, self.scales_and_zeros)    # [M, out] bf16
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class QuantEmbedding(nn.Module):
    """An embedding whose table stays in a GGUF file's blocks (rung's CPU kernel's row
    layout, any type of ``KERNEL_TYPES``): a lookup gathers the ids' block rows and decodes
    only those (``gguf_embed``), so no float [vocab, hidden] copy exists. Under a tied head
    its ``rows`` are the head's (``pack_quant_linears`` points them at the head's buffer)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.type_name = ""
        self.register_buffer("rows", None)              # [vocab, row bytes] uint8
        # NOTE: follows model.to(dtype): lookups come in that dtype, as nn.Embedding's would
        self.register_buffer("dtype_like", torch.empty(0), persistent=False)

    @classmethod
    def replacing(cls, embedding: nn.Embedding) -> QuantEmbedding:
        return cls(embedding.num_embeddings, embedding.embedding_dim)

    def load_quantized(self, weight: GGUFBlockWeight, shard: int | None) -> None:
        want = (self.num_embeddings, self.embedding_dim)
        if shard is not None or weight.shape != want:
            raise ValueError(f"quantized embedding has shape {weight.shape}, the model "
                             f"expects {want}")
        self.rows, self.type_name = weight.rows, weight.type_name

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = gguf_embed(input_ids.reshape(-1), GGUFBlockWeight(self.rows, self.type_name))
        return flat.to(self.dtype_like.dtype).reshape(*input_ids.shape, self.embedding_dim)


def quant_kernel(device: torch.device) -> str:
    """Which kernel a ``QuantLinear`` on ``device`` runs: "rung" (kernels/gguf_cpu.py,
    every type of ``KERNEL_TYPES``, any activation dtype) or "torch_int4" (4-bit, bfloat16)."""
    return "rung" if device.type == "cpu" and gguf_cpu_available() is None else "torch_int4"


def use_quant_linears(model: nn.Module, names: set[str]) -> int:
    """Replace the linear modules ``names`` of ``model`` by ``QuantLinear`` and the
    embeddings among them by ``QuantEmbedding``; how many. A tied ``lm_head`` among them is
    untied: the embedding keeps the float weight unless it is among ``names`` too."""
    for name in sorted(names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        quant = QuantEmbedding if isinstance(module, nn.Embedding) else QuantLinear
        setattr(parent, child, quant.replacing(module))
    return len(names)


def tied_head_fp32_t(model: nn.Module) -> torch.Tensor | None:
    """W^T [hidden, vocab] fp32 of a tied ``lm_head``, taken before the model is cast to
    bf16 (``lm_head_logits`` then computes fp32 logits from it: bf16 logits round 16-32
    to steps of 0.125 and tie greedy choices, and torch's bf16 GEMV on AVX2 is no faster
    than fp32; docs/performance.md)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not embed.weight:
        return None
    return head.weight.detach().float().t().contiguous()


def pack_quant_linears(model: nn.Module, device: torch.device | str) -> None:
    """Pack every ``QuantLinear`` of ``model`` for ``device`` once its weights are loaded;
    the rows of rung's CPU kernel go into one buffer in module order (a forward's call
    order, the tied head last; see ``rows_in_one_buffer``), a tied ``QuantEmbedding``'s
    with its head's."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.pack(torch.device(device))
    cpu = [layer for layer in layers if layer.kernel == "rung"]
    loaded = [layer.rows for layer in cpu]      # alive till the end: their ids stay theirs
    moved = {}                                  # id(rows loaded) -> their view in the buffer
    for layer, old, rows in zip(cpu, loaded, rows_in_one_buffer(loaded)):
        moved[id(old)] = rows
        layer.rows = rows
    for embedding in model.modules():
        # a tied embedding was loaded with the head's very rows: it follows them
        if isinstance(embedding, QuantEmbedding) and id(embedding.rows) in moved:
            embedding.rows = moved[id(embedding.rows)]


class _F32Gemv:
    """Mixed into a float32 ``nn.Linear`` class on CPU (see `use_f32_gemv`): the forward
    is ``rung::f32_linear`` on the row-major weight (one streaming pass for a few rows,
    BLAS's GEMM for more), then the bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = f32_linear(x.reshape(-1, self.in_features), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


_GEMV_CLASSES: dict[type, type] = {}


def is_f32_gemv(module: nn.Module) -> bool:
    return isinstance(module, _F32Gemv)


def use_f32_gemv(model: nn.Module) -> int:
    """Every float32 ``nn.Linear`` of ``model`` (a tied head included: it reads the
    embedding's rows, no copy) computes through ``rung::f32_linear``; how many. BLAS's GEMV
    reads a decode step's weights well under the memory bandwidth in either layout
    (docs/performance.md); the weights stay row-major, as loaded."""
    changed = 0
    for module in model.modules():
        cls = type(module)
        if (not isinstance(module, nn.Linear) or module.weight.dtype != torch.float32
                or module.weight.device.type != "cpu" or issubclass(cls, _F32Gemv)):
            continue
        if not module.weight.is_contiguous():
            module.weight = nn.Parameter(module.weight.detach().contiguous(),
                                         requires_grad=False)
        if cls not in _GEMV_CLASSES:
            _GEMV_CLASSES[cls] = type(f"F32Gemv{cls.__name__}", (_F32Gemv, cls), {})
        module.__class__ = _GEMV_CLASSES[cls]
        changed += 1
    _weights_in_one_buffer(model)
    return changed


def _weights_in_one_buffer(model: nn.Module) -> None:
    """The GEMV layers' weights into one buffer in call order (the head last), on huge
    pages where the system grants them (``rows_in_one_buffer``: a decode step streams them
    all, and its prefetch then runs from one into the next); a tied embedding keeps
    sharing its head's weight."""
    layers = [m for m in model.modules() if is_f32_gemv(m)]
    head = getattr(model, "lm_head", None)
    if head in layers:
        layers.remove(head)
        layers.append(head)
    weights = list({id(m.weight): m.weight for m in layers}.values())
    moved = {id(w): nn.Parameter(view, requires_grad=False)
             for w, view in zip(weights, rows_in_one_buffer([w.detach() for w in weights]))}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and id(weight) in moved:
            module.weight = moved[id(weight)]


def lay_out_cpu_linears(model: nn.Module) -> None:
    """A CPU model's float linears: float32 ones through rung's GEMV kernel where it
    builds (`use_f32_gemv`), the rest (bfloat16, or no C compiler) as W^T for BLAS
    (`pretranspose_linear_weights`)."""
    if gguf_cpu_available() is None:
        try:
            load_kernel()
        except RuntimeError as e:      # a compiler that fails: BLAS serves, slower
            logger.warning("float32 linears run on BLAS: %s", str(e).splitlines()[0])
        else:
            use_f32_gemv(model)
    pretranspose_linear_weights(model)


def pretranspose_linear_weights(model: nn.Module) -> int:
    """Store every untied ``nn.Linear`` weight as W^T in memory; returns how many changed.

    The parameter keeps HF's name and shape [out, in] (loading and state dicts are
    unchanged) but becomes the transposed view of a contiguous [in, out] tensor, so
    ``F.linear`` calls the CPU GEMM on ``x @ Wt`` with no transpose: the layout the
    matmul floor uses. Weights tied to an embedding keep their row-major layout, which
    the embedding's row gather needs; a model with ``transposed_tied_head`` also gets a
    W^T copy of its tied ``lm_head`` (``weight_t``) for ``lm_head_logits``.
    """
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    changed = 0
    head = getattr(model, "lm_head", None)
    if (getattr(model, "transposed_tied_head", False) and isinstance(head, nn.Linear)
            and not is_f32_gemv(head) and id(head.weight) in tied
            and head.weight.numel() <= MAX_TRANSPOSED_HEAD_NUMEL
            and getattr(head, "weight_t", None) is None):
        head.register_buffer("weight_t", head.weight.detach().t().contiguous(),
                             persistent=False)                  # [hidden, vocab]
    for module in model.modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in tied or \
                is_f32_gemv(module):
            continue
        weight = module.weight.detach()
        if weight.t().is_contiguous():
            continue
        module.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
        changed += 1
    return changed


# NOTE: on MKL a tied head's W^T copy (x @ W^T) is a GEMV at 1 row, the fastest kernel
# for a few rows; past them the tall GEMM (W @ x^T)^T on the row-major weight streams it
# once for every row count, faster than x @ W^T or F.linear(x, W) (docs/performance.md,
# "The lm head's kernels by row count"; ``python dev/bench/head_kernels.py``).
# NOTE: 3, not 2: the compiled epilogue of rows 1-2 does not stay symbolic (torch 2.13's
# inductor specialised it to its 2-row example), and 3 rows lose little.
MAX_ROWS_TRANSPOSED_HEAD = 3
MAX_TRANSPOSED_HEAD_NUMEL = 1 << 25      # the copy costs memory: 128 MiB in fp32 at most


def lm_head_logits(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [num_rows, hidden] -> logits [num_rows, vocab] fp32 through ``head``: its
    W^T copy (``weight_t``, see ``pretranspose_linear_weights``) for a few rows, else on
    CPU a row-major weight as the tall GEMM W @ hidden^T (the table above)."""
    if isinstance(head, QuantLinear) or is_batch_invariant(head) or is_f32_gemv(head):
        return head(hidden).float()
    weight_t = getattr(head, "weight_t", None)
    if weight_t is not None and weight_t.dtype != hidden.dtype:
        return hidden.to(weight_t.dtype) @ weight_t      # an fp32 head under int4 layers
    if weight_t is not None and hidden.shape[0] <= MAX_ROWS_TRANSPOSED_HEAD:
        return (hidden @ weight_t).float()
    weight = head.weight
    if hidden.device.type == "cpu" and head.bias is None and weight.is_contiguous() and \
            weight.dtype == hidden.dtype:      # NOTE: measured for MKL only
        return (weight @ hidden.t()).t().contiguous().float()
    return head(hidden).float()


def lm_head_row_splits(head: nn.Module, dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts past which ``lm_head_logits(head, hidden)`` of ``dtype`` hidden
    states takes another kernel (``DecoderParts.logits_splits``): the transposed head's
    limit where it has one it takes for few rows."""
    weight_t = getattr(head, "weight_t", None)
    if isinstance(head, QuantLinear) or weight_t is None or weight_t.dtype != dtype:
        return ()
    return (MAX_ROWS_TRANSPOSED_HEAD,)


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """inv_freq [rotary_dim // 2] fp32, HF's default, linear and llama3 rope types."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                               / rotary_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":                     # positions divided by the factor
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")


def proportional_inv_freq(head_dim: int, base: float, partial_rotary_factor: float,
                          factor: float = 1.0) -> torch.Tensor:
    """inv_freq [head_dim // 2] fp32 of HF's "proportional" RoPE (Gemma 4 full layers).

    The first ``int(partial_rotary_factor * head_dim // 2)`` frequencies follow the default
    schedule with exponents over the WHOLE head_dim; the rest are 0 (cos 1, sin 0).
    NOTE: use it with rotary_dim == head_dim: dim i still pairs with i + head_dim // 2,
    unlike partial RoPE over a prefix of the head.
    """
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)                                   # [rope_angles]
    zeros = torch.zeros(head_dim // 2 - rope_angles, dtype=torch.float32)
    return torch.cat((inv_freq, zeros)) / factor


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary over the first ``rotary_dim = 2 * len(inv_freq)`` dims of a head.

    With ``max_position``, cos/sin come from a table of that many rows (a gather per
    forward); without, they are computed per forward from the fp32 frequencies, as HF does
    (Gemma 4's full layers: a table of 128k positions would take hundreds of MiB). Both
    give the same values: the angles are fp32 either way.
    """

    def __init__(self, inv_freq: torch.Tensor, max_position: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = 2 * inv_freq.shape[0]
        # NOTE: kept as int32 bits so model.to(dtype) cannot round the frequencies; HF
        # computes the angles in fp32 whatever the model dtype.
        self.register_buffer("inv_freq_bits", inv_freq.float().view(torch.int32),
                             persistent=False)             # [rotary_dim // 2]
        cos, sin = (self._angles_cos_sin(torch.arange(max_position))
                    if max_position is not None else (None, None))
        self.register_buffer("cos_table", cos, persistent=False)    # [max_pos, 1, rd] or None
        self.register_buffer("sin_table", sin, persistent=False)    # [max_pos, 1, rd] or None

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rotary_dim] in ``dtype``; once per forward."""
        if self.cos_table is not None:
            return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)
        cos, sin = self._angles_cos_sin(positions)
        return cos.to(dtype), sin.to(dtype)

    def _angles_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> fp32 cos, sin [T, 1, rotary_dim]."""
        inv_freq = self.inv_freq_bits.view(torch.float32)
        freqs = positions.float()[:, None] * inv_freq[None, :]      # [T, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]          # [T, 1, rotary_dim]
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by ``cos_sin`` of its positions."""
        rd = self.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rd == x.shape[-1] else torch.cat((out, rest), dim=-1)


# (the rotary module, cos, sin [T, 1, rotary_dim]) of one layer type, once per forward
Rope = tuple[RotaryEmbedding, torch.Tensor, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class DecoderParts:
    """A decoder's forward in the pieces ``forward`` runs them in, for callers that run the
    layers one by one (compiled CPU graphs compile one layer and call it per layer):
    ``embed(input_ids)`` [T, H], each layer with the rope of its ``layer_type``, ``norm``;
    then ``logits`` (the model's ``compute_logits``) of the sampled rows."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: nn.ModuleList
    rotaries: Mapping[str, RotaryEmbedding]
    norm: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]    # hidden [N, H] -> [N, vocab] fp32
    head: nn.Module                                    # the module whose tensors it reads
    # NOTE: row counts past which ``logits`` takes another path (see lm_head_row_splits):
    # a caller that compiles it compiles it once per range between them
    logits_splits: tuple[int, ...] = ()


class ScaledSoftcappedLM(nn.Module):
    """The Gemma families' causal-LM shell around a decoder ``model`` (``embed_tokens``,
    ``embed_scale``, ``layers``, ``norm``): embeddings scaled by ``embed_scale``, the shared
    decoder loop with a rope per layer type (``rotary``), and logits soft-capped at
    ``softcap`` (none when 0 or None); ``lm_head``, tied to the embeddings when ``tied``."""

    def init_head(self, cfg: dict) -> None:
        """The head, the softcap and the tie from ``cfg``, once ``self.model`` exists."""
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.softcap = cfg["final_logit_softcapping"]
        self.tied = bool(cfg["tie_word_embeddings"])
        # random weights (presets): unit-scale embeddings after the sqrt(hidden) scaling
        self.embed_init_std = cfg["hidden_size"] ** -0.5
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> scaled embeddings [T, hidden] (what layer 0 and MTP drafters see)."""
        embeds = self.model.embed_tokens(input_ids)
        return embeds * self.model.embed_scale.to(embeds.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens_padded] -> hidden [num_tokens_padded, hidden]."""
        return decoder_layers(self.model.layers, self.model.norm, self.rotary,
                              self.embed_input_ids(input_ids), positions)

    def decoder_parts(self) -> DecoderParts:
        """``forward`` in pieces (see DecoderParts)."""
        return DecoderParts(self.embed_input_ids, self.model.layers, self.rotary,
                            self.model.norm, self.compute_logits, self.lm_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_reqs, hidden] -> logits [num_reqs, vocab] fp32, softcapped.
        NOTE: the head is called as a module, so a quantized head may replace it."""
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


def decoder_layers(layers: nn.ModuleList, norm: nn.Module,
                   rotaries: dict[str, RotaryEmbedding] | nn.ModuleDict, hidden: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The decoder loop every family shares: hidden [T, H] through each layer with the rope
    of its ``layer_type`` (``rotaries``: layer type -> rotary), then the final norm -> [T, H]."""
    rope = {t: (r, *r.cos_sin(positions, hidden.dtype)) for t, r in rotaries.items()}
    for layer in layers:
        hidden = layer(rope[layer.layer_type], hidden)
    return norm(hidden)


ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
               "gelu": nn.functional.gelu, "silu": nn.functional.silu}

# HF projection -> (rung's fused module, shard index): q/k/v and gate/up load into one matmul
STACKED_PARAMS = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1),
                  ("qkv_proj", "v_proj", 2),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul (Llama, Qwen, Gemma)."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)           # [T, intermediate] each
        return self.down_proj(self.act(gate) * up)


def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights with unit-scale activations (presets, load_format=dummy)."""
    gen = torch.Generator().manual_seed(seed)
    # NOTE: models that scale embeddings up (Gemma: by sqrt(hidden)) set `embed_init_std`
    # so scaled embeddings keep unit scale; others draw embeddings with std 1.
    embed_std = getattr(model, "embed_init_std", 1.0)
    for name, param in sorted(model.named_parameters()):
        if param.dim() == 1:
            # norms stay at their identity value; biases at 0
            continue
        fan_in = param.shape[-1]        # [out, in], or [experts, out, in]
        std = embed_std if "embed" in name else fan_in ** -0.5
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
        param.data.copy_(values.to(param.dtype))
