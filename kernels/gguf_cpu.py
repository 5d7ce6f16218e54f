"""GGUF block-quantized matmuls on x86 CPUs: rung's own kernel (AVX2, and AVX-512 VNNI
where the CPU has it), fp32 activations, every common GGUF type in its own bits; and, built
into the same library, the float32 GEMV of a CPU model's float linears (``f32_linear``)
and the decode attention of CPU graphs (``paged_decode_attention``, kernels/cpu_attention.py).

torch's CPU int4 kernel (``aten::_weight_int4pack_mm_for_cpu``) converts every weight to
float before its FMA, and on AVX2 it is compute-bound, not bound by the weight stream.
``csrc/gguf_gemm.c`` does what llama.cpp does: each 32-group of an activation row is
rounded to int8 with its own scale, once per matmul, and a group's dot product with the
weight's 2- to 8-bit values is one integer dot (``maddubs`` + ``madd``, or VNNI's
``dpbusd``), scaled in fp32: the result is the exact weight times the rounded
activations. The weight keeps the file's block bytes (``GGUFBlockWeight``: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), regrouped per row by field so the kernel
converts 8 scales at once; nothing is rounded at load (the 6-bit scales of Q3_K, Q4_K and
Q5_K are unpacked to a byte each, 4 bytes a 256-weight super-block). The activation
rounding is the kernel's only approximation, and ``gguf_gemm_reference`` (torch, fp64,
over the exact decode ``dequantize_fp64``) is the same formula, the tests' oracle.

The kernel is the op ``rung::gguf_gemm`` (an opaque call inductor keeps in compiled
graphs), its CPU implementation in C++ (``csrc/gguf_op.cpp``): the dispatcher calls the C
kernel with no Python in between. Both are compiled once per machine and torch version
with the system compilers (the C++ one inductor uses) into ``$RUNG_CACHE_DIR/kernels``
(the C source twice, AVX2 and AVX-512 VNNI, side by side, chosen at run time: ``set_isa``;
the first build parses torch's headers and dominates a cold start; loading the cached
library is quick).
The op splits its work over torch's intra-op pool (``csrc/gguf_op.cpp``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GROUP_SIZE = 32                   # GGUF's block: 32 weights, one scale (and offset)
SUPER_BLOCK = 256                 # a K-quant's super-block: 8 groups of 32
_SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
_OP_SOURCE = Path(__file__).parent / "csrc" / "gguf_op.cpp"
# built into the same library: the decode attention op (kernels/cpu_attention.py)
_ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "cpu_attention.c"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC"]
_VNNI_CFLAGS = ["-DGGUF_VNNI", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni"]
_CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-w", "-fopenmp"]

# GGUF type -> kernel code (csrc/gguf_gemm.c), (bytes, groups of 32) of a file block and
# of the same block in rung's row layout (csrc/gguf_gemm.c's header; K-quants gain 4 bytes
# a super-block: their 6-bit scales unpacked to bytes)
TYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6,
              "Q6_K": 7, "Q3_K": 8, "Q2_K": 9}
FILE_BLOCK = {"Q4_0": (18, 1), "Q4_1": (20, 1), "Q8_0": (34, 1), "Q5_0": (22, 1),
              "Q5_1": (24, 1), "Q4_K": (144, 8), "Q5_K": (176, 8), "Q6_K": (210, 8),
              "Q3_K": (110, 8), "Q2_K": (84, 8)}
ROW_BLOCK = {**FILE_BLOCK, "Q4_K": (148, 8), "Q5_K": (180, 8), "Q3_K": (114, 8)}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
        "Q3_K": 3, "Q2_K": 2}
KERNEL_TYPES = tuple(TYPE_CODES)
# compatibility names of the legacy types' layout
BLOCK_BYTES = {t: FILE_BLOCK[t][0] for t in ("Q4_0", "Q4_1", "Q8_0")}
VALUE_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}


@dataclasses.dataclass
class GGUFBlockWeight:
    """A weight [N, K] in a GGUF file's blocks along K, each row's blocks regrouped by
    field (the layouts of csrc/gguf_gemm.c's header; lossless, the same bytes but for the
    K-quants' unpacked 6-bit scales). Legacy types: row n = [values of its G = K // 32
    blocks | G f16 scales d | G f16 minimums m (Q4_1 only)], and w[n, k] = d[n, g] *
    q[n, k] + z[n, g] with g = k // 32 and z = -8 d (Q4_0), m (Q4_1), 0 (Q8_0). A block's
    16 bytes of nibbles hold weight j in the low half of byte j and weight j + 16 in its
    high half; Q8_0 values are int8. ``dequantize_reference`` decodes every type."""

    rows: torch.Tensor      # [N, row bytes] uint8
    type_name: str          # a key of TYPE_CODES

    @classmethod
    def from_file_blocks(cls, blocks: torch.Tensor, type_name: str) -> GGUFBlockWeight:
        """blocks [N, row's file bytes] uint8 as a GGUF file stores them -> rung's row
        layout."""
        if type_name not in FILE_BLOCK:
            raise ValueError(f"rung's GGUF kernel serves {', '.join(KERNEL_TYPES)}, "
                             f"not {type_name}")
        num_rows, row_bytes = blocks.shape
        f = blocks.reshape(num_rows, row_bytes // FILE_BLOCK[type_name][0], -1)
        field_spans = {"Q4_0": [(2, 18), (0, 2)], "Q4_1": [(4, 20), (0, 2), (2, 4)],
                       "Q8_0": [(2, 34), (0, 2)], "Q5_0": [(6, 22), (2, 6), (0, 2)],
                       "Q5_1": [(8, 24), (4, 8), (0, 2), (2, 4)],
                       "Q4_K": [(16, 144), (0, 2), (2, 4)],
                       "Q5_K": [(48, 176), (16, 48), (0, 2), (2, 4)],
                       "Q6_K": [(0, 128), (128, 192), (192, 208), (208, 210)],
                       "Q3_K": [(32, 96), (0, 32)],
                       "Q2_K": [(16, 80), (0, 16), (80, 82), (82, 84)]}[type_name]
        parts = [f[..., a:b] for a, b in field_spans]
        if type_name in ("Q4_K", "Q5_K"):
            parts += list(_k_scales(f[..., 4:16]))
        if type_name == "Q3_K":
            parts += [_q3_k_scales(f[..., 96:108]), f[..., 108:110]]
        return cls(torch.cat([p.reshape(num_rows, -1) for p in parts], dim=1), type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.num_groups * GROUP_SIZE

    @property
    def num_groups(self) -> int:
        block_bytes, groups = ROW_BLOCK[self.type_name]
        return self.rows.shape[1] // block_bytes * groups

    @property
    def bits(self) -> int:
        return BITS[self.type_name]

    def _field(self, start: int, length: int) -> torch.Tensor:
        """Bytes [start, start + length) of every row, [N, length] uint8."""
        return self.rows[:, start:start + length]

    def _f16(self, index: int) -> torch.Tensor:
        """The ``index``-th f16 array of every legacy row (0: d, 1: m) -> [N, G] fp32."""
        start = self.num_groups * (VALUE_BYTES[self.type_name] + 2 * index)
        return (self.rows[:, start:start + 2 * self.num_groups].contiguous()
                .view(torch.float16).float())

    def scale(self) -> torch.Tensor:
        """Legacy types: [N, K // 32] fp32 (the f16 d, widened exactly)."""
        self._check_legacy()
        return self._f16(0)

    def offset(self) -> torch.Tensor:
        """Legacy types: [N, K // 32] fp32: -8 d (Q4_0), m (Q4_1) or 0 (Q8_0)."""
        self._check_legacy()
        if self.type_name == "Q4_1":
            return self._f16(1)
        return -8.0 * self.scale() if self.type_name == "Q4_0" else torch.zeros_like(
            self.scale())

    def values(self) -> torch.Tensor:
        """Legacy types: q [N, K] in k order: 0..15 (4 bits) or -128..127 (8 bits), int16."""
        self._check_legacy()
        num_rows, num_cols = self.shape
        values = self.rows[:, :self.num_groups * VALUE_BYTES[self.type_name]]
        if self.type_name == "Q8_0":
            return values.contiguous().view(torch.int8).short()
        return _nibbles_in_order(values, num_rows, self.num_groups).reshape(
            num_rows, num_cols).short()

    def _check_legacy(self) -> None:
        if self.type_name not in VALUE_BYTES:
            raise ValueError(f"scale / offset / values are the legacy types' fields "
                             f"({', '.join(VALUE_BYTES)}), not {self.type_name}'s")


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K / Q5_K super-block's 12 bytes of 6-bit scales -> (sc, min) [..., 8] uint8:
    bytes 0-3 hold sc 0-3 (and the top bits of sc 4-7), 4-7 min 0-3 (and of min 4-7),
    8-11 the low 4 bits of sc 4-7 and min 4-7."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """A Q3_K super-block's 12 bytes of 6-bit scales -> its 16 scales less 32, [..., 16]
    as int8 bytes: bytes 0-7 hold the low 4 bits of scales 0-7 (low nibbles) and 8-15
    (high nibbles), bytes 8-11 their top 2 bits, two per scale of 0-3, 4-7, 8-11, 12-15."""
    low, top = packed[..., 0:8], packed[..., 8:12]
    top = torch.cat([(top >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=-1)   # [..., 16]
    sc = torch.cat([low & 0x0F, low >> 4], dim=-1) | (top << 4)
    return (sc.to(torch.int16) - 32).to(torch.int8).view(torch.uint8)


def _nibbles_in_order(values: torch.Tensor, num_rows: int, num_groups: int) -> torch.Tensor:
    """Legacy 4-bit blocks' bytes [N, G * 16] -> [N, G, 32] uint8 in k order."""
    nibbles = values.reshape(num_rows, num_groups, 16)
    return torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)


def _pairs_in_order(packed: torch.Tensor, num_rows: int, num_super: int) -> torch.Tensor:
    """Q2_K / Q3_K 2-bit values [N, S * 64] bytes -> [N, S, 2, 4, 32] uint8: per
    super-block two halves of 128 weights, quarter k of a half in bits 2k, 2k + 1 of the
    half's 32 bytes."""
    halves = packed.reshape(num_rows, num_super, 2, 1, 32)
    return (halves >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 0x03


def _bits_in_order(packed: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 8 B] of their bits, bit j of byte i at 8 i + j (little end)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], -1)


def stack_rows(shards: list[GGUFBlockWeight]) -> GGUFBlockWeight:
    """Shards' rows stacked into one weight (fused q/k/v, gate/up)."""
    if len({(s.type_name, s.shape[1]) for s in shards}) != 1:
        raise ValueError(f"fused shards mix types or widths: "
                         f"{[(s.type_name, s.shape) for s in shards]}")
    if len(shards) == 1:
        return shards[0]
    return GGUFBlockWeight(torch.cat([s.rows for s in shards]), shards[0].type_name)


HUGE_PAGE = 2 << 20                # x86-64's transparent huge page
_MADV_HUGEPAGE = 14


def rows_in_one_buffer(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """``rows`` (weights of any dtype, contiguous) copied back to back into one buffer, in
    the given order (a forward's call order), asked for transparent huge pages; views into
    it, each of its row's dtype and shape.

    NOTE: a decode step streams every weight from DRAM once. In one buffer the kernel's
    prefetch past the end of a weight warms the next one, and on huge pages neither the
    TLB nor the hardware prefetcher stops at each 4 KB page (torch's allocator asks for
    none; THP is "madvise" on most distributions; docs/performance.md has the step's
    matmuls in separate tensors vs this buffer). Without THP the buffer is still one.
    """
    if not rows:
        return []
    total = sum(_aligned(r.nbytes) for r in rows)
    buffer = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = _aligned(buffer.data_ptr(), HUGE_PAGE) - buffer.data_ptr()
    _advise_huge_pages(buffer.data_ptr() + start, total)
    views, offset = [], start
    for r in rows:
        view = buffer[offset:offset + r.nbytes].view(r.dtype).view(r.shape)
        view.copy_(r)
        views.append(view)
        offset += _aligned(r.nbytes)
    return views


def _aligned(value: int, alignment: int = 64) -> int:
    return -(-value // alignment) * alignment


def _advise_huge_pages(address: int, length: int) -> None:
    """madvise(MADV_HUGEPAGE) before the first touch; a no-op where it is refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):      # not Linux, or no madvise: small pages
        pass


def dequantize_reference(weight: GGUFBlockWeight) -> torch.Tensor:
    """The weight [N, K] in fp32: the block formula in fp64, rounded once (exact for every
    type but the K-quants' d sc q - dmin m, which rounds like the gguf package's)."""
    return dequantize_fp64(weight).float()


def dequantize_fp64(weight: GGUFBlockWeight) -> torch.Tensor:
    """The weight [N, K] decoded from rung's row layout in fp64 (exact)."""
    t, rows = weight.type_name, weight.rows
    (num_rows, num_cols), G = weight.shape, weight.num_groups
    S = G // 8

    def f16(start: int, count: int) -> torch.Tensor:
        return rows[:, start:start + 2 * count].contiguous().view(torch.float16).double()

    if t in VALUE_BYTES:
        scale = weight.scale().double().repeat_interleave(GROUP_SIZE, dim=1)
        offset = weight.offset().double().repeat_interleave(GROUP_SIZE, dim=1)
        return weight.values().double() * scale + offset
    if t in ("Q5_0", "Q5_1"):
        q = (_nibbles_in_order(rows[:, :16 * G], num_rows, G).long()
             | (_bits_in_order(rows[:, 16 * G:20 * G]).reshape(num_rows, G, 32).long() << 4))
        d = f16(20 * G, G)[..., None]
        z = f16(22 * G, G)[..., None] if t == "Q5_1" else -16.0 * d
        return (d * q + z).reshape(num_rows, num_cols)
    if t in ("Q4_K", "Q5_K"):
        pairs = rows[:, :16 * G].reshape(num_rows, S, 4, 1, 32)
        q = ((pairs >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 0x0F).reshape(
            num_rows, G, 32).long()
        p = 16 * G
        if t == "Q5_K":
            high = rows[:, p:p + 32 * S].reshape(num_rows, S, 1, 32)
            bits = (high >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1   # [N, S, 8, 32]
            q = q | (bits.reshape(num_rows, G, 32).long() << 4)
            p += 32 * S
        d, dmin = f16(p, S), f16(p + 2 * S, S)                                # [N, S]
        sc = rows[:, p + 4 * S:p + 4 * S + G].double().reshape(num_rows, S, 8)
        mn = rows[:, p + 4 * S + G:p + 4 * S + 2 * G].double().reshape(num_rows, S, 8)
        scale = (d[..., None] * sc).reshape(num_rows, G, 1)
        offset = (dmin[..., None] * mn).reshape(num_rows, G, 1)
        return (scale * q - offset).reshape(num_rows, num_cols)
    if t == "Q2_K":
        # quarter k of a half takes bits 2k, 2k + 1 of its 32 bytes; a byte of scales per
        # 16 weights holds sc (low nibble) and mn (high)
        q = _pairs_in_order(rows[:, :8 * G], num_rows, S)
        packed = rows[:, 8 * G:10 * G].double().reshape(num_rows, S, 16)
        sc, mn = torch.remainder(packed, 16), torch.div(packed, 16, rounding_mode="floor")
        d, dmin = f16(10 * G, S)[..., None], f16(10 * G + 2 * S, S)[..., None]    # [N, S, 1]
        scale, offset = (d * sc).reshape(num_rows, S * 16), (dmin * mn).reshape(num_rows, S * 16)
        q = q.reshape(num_rows, S * 16, 16).double()
        return (q * scale[..., None] - offset[..., None]).reshape(num_rows, num_cols)
    if t == "Q3_K":
        # per super-block two halves of 128 weights; quarter k of a half takes bits 2k,
        # 2k + 1 of its 32 low bytes, less 4 where bit 4 h + k of the high byte is clear
        low = _pairs_in_order(rows[:, :8 * G], num_rows, S)
        high = _bits_in_order(rows[:, 8 * G:12 * G].reshape(num_rows, S, 32, 1)) \
            .reshape(num_rows, S, 32, 8).permute(0, 1, 3, 2).reshape(num_rows, S, 2, 4, 32)
        q = low.long() - 4 * (1 - high.long())
        sc = rows[:, 12 * G:14 * G].contiguous().view(torch.int8).double()  # [N, S * 16]
        scale = f16(14 * G, S).repeat_interleave(16, dim=1) * sc
        return (q.reshape(num_rows, S * 16, 16) * scale[..., None]).reshape(num_rows, num_cols)
    # Q6_K: per super-block two halves of 128 weights; quarter k of a half takes the
    # low (k < 2) or high nibbles of ql bytes 32 (k % 2) .. +32 and bits 2k, 2k + 1 of qh
    ql = rows[:, :16 * G].reshape(num_rows, S, 2, 1, 2, 32)                 # [., h, ., k%2, l]
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8)[:, None, None]) & 0x0F  # [.,h,k//2,k%2,l]
    qh = rows[:, 16 * G:24 * G].reshape(num_rows, S, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 0x03  # [., h, k, l]
    q = (low.reshape(num_rows, S, 2, 4, 32).long() | (high.long() << 4)) - 32
    sc = rows[:, 24 * G:26 * G].contiguous().view(torch.int8).double()      # [N, S * 16]
    d = f16(26 * G, S)                                                      # [N, S]
    scale = d.repeat_interleave(16, dim=1) * sc                              # [N, S * 16]
    return (q.reshape(num_rows, S * 16, 16) * scale[..., None]).reshape(num_rows, num_cols)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 32, 32] int8-valued fp32, dx [M, K // 32]): the
    kernel's activation rounding (dx = max|x| / 127 per group, round half to even)."""
    groups = x.float().reshape(x.shape[0], -1, GROUP_SIZE)                # [M, G, 32]
    dx = groups.abs().amax(-1) / 127.0                                    # [M, G]
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(groups * inv[..., None]), dx


def gguf_gemm_reference(x: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] fp32 by the kernel's formula: the int8-rounded x (dx * xq)
    times the exact weight, in fp64."""
    xq, dx = quantize_rows_reference(x)                                   # [M, G, 32], [M, G]
    rounded = (xq.double() * dx.double()[..., None]).reshape(x.shape)     # [M, K]
    return (rounded @ dequantize_fp64(weight).t()).float()


def gguf_gemm(x: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] fp32 (x of any float dtype, cast to fp32), eagerly or
    inside a compiled graph: the op ``rung::gguf_gemm``."""
    if not torch.compiler.is_compiling():
        load_kernel()
    return torch.ops.rung.gguf_gemm.default(x, weight.rows, TYPE_CODES[weight.type_name])


# NOTE: the CPU kernel is csrc/gguf_op.cpp (``load_kernel``): a Python kernel behind the
# dispatcher would add Python to each of a step's ~120 calls.
_LIBRARY = torch.library.Library("rung", "FRAGMENT")
_LIBRARY.define("gguf_gemm(Tensor x, Tensor rows, int code) -> Tensor")
_LIBRARY.impl("gguf_gemm", lambda x, rows, code: x.new_empty(
    x.shape[0], rows.shape[0], dtype=torch.float32), "Meta")
_LIBRARY.define("f32_linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("f32_linear", lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]),
              "Meta")
# the decode attention op built into the same library (kernels/cpu_attention.py uses it)
_LIBRARY.define("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
                "Tensor seq_lens, float scale, int sliding_window, float softcap) -> Tensor")
_LIBRARY.impl("paged_decode_attention",
              lambda query, kv_cache, block_table, seq_lens, scale, sliding_window, softcap:
              query.new_empty(query.shape, dtype=torch.float32), "Meta")


def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N], all float32, eagerly or inside a compiled
    graph (the op ``rung::f32_linear``): a few rows stream the row-major weight once
    (csrc/gguf_gemm.c's f32_gemv, every element summed in an order fixed by K), more rows
    are BLAS's GEMM."""
    if not torch.compiler.is_compiling():
        load_kernel()
    return torch.ops.rung.f32_linear.default(x, weight)


def gguf_embed(ids: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """ids [T] -> rows ``ids`` of the weight [T, K] fp32, eagerly or inside a compiled
    graph (the op ``rung::gguf_embed``): only the looked-up rows are decoded, by
    ``dequantize_reference`` (the decode the fp64 reference and the dequantized model use)."""
    return torch.ops.rung.gguf_embed.default(ids, weight.rows, TYPE_CODES[weight.type_name],
                                             weight.shape[1])


def _gather_decode(ids: torch.Tensor, rows: torch.Tensor, code: int,
                   num_cols: int) -> torch.Tensor:
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < rows.shape[0]):
        raise ValueError(f"token ids span [{int(ids.min())}, {int(ids.max())}]; the "
                         f"embedding has {rows.shape[0]} rows")
    return dequantize_reference(GGUFBlockWeight(rows.index_select(0, ids.long()),
                                                KERNEL_TYPES[code]))


# NOTE: a Python kernel: one call a step, and the graph sees an opaque op, not the decode
_LIBRARY.define("gguf_embed(Tensor ids, Tensor rows, int code, int num_cols) -> Tensor")
_LIBRARY.impl("gguf_embed", _gather_decode, "CPU")
_LIBRARY.impl("gguf_embed", lambda ids, rows, code, num_cols: rows.new_empty(
    ids.shape[0], num_cols, dtype=torch.float32), "Meta")


def available() -> str | None:
    """Why the kernel cannot run on this machine, or None."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    if _cxx_compiler() is None:
        return "no C++ compiler (c++, g++ or clang++) on PATH"
    return None


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang")
                 if c and shutil.which(c)), None)


def _cxx_compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++")
                 if c and shutil.which(c)), None)


def _cache_dir() -> Path:
    root = os.environ.get("RUNG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rung")
    return Path(root) / "kernels"


@functools.lru_cache(maxsize=1)
def load_kernel() -> None:
    """Register the ops' CPU kernels (gguf_gemm, f32_linear, paged_decode_attention),
    building them on first use and caching them by their sources, flags and torch
    version."""
    why = available()
    if why is not None:
        raise RuntimeError(f"rung's GGUF CPU kernel cannot run: {why}")
    from torch.utils import cpp_extension

    torch_lib = cpp_extension.library_paths()[0]
    cxxflags = [*_CXXFLAGS, *(f"-I{p}" for p in cpp_extension.include_paths()),
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    key = b"".join([_SOURCE.read_bytes(), _OP_SOURCE.read_bytes(),
                    _ATTENTION_SOURCE.read_bytes(),
                    " ".join(_CFLAGS + _VNNI_CFLAGS + cxxflags + [torch.__version__]).encode()])
    path = _cache_dir() / f"gguf_op-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            objs = [Path(tmp) / "gguf_avx2.o", Path(tmp) / "gguf_vnni.o", Path(tmp) / "op.o",
                    Path(tmp) / "attention.o"]
            built = Path(tmp) / path.name
            # NOTE: the four compiles are independent: at once, then one link
            _run([_compiler(), *_CFLAGS, "-c", "-o", str(objs[0]), str(_SOURCE)],
                 [_compiler(), *_CFLAGS, *_VNNI_CFLAGS, "-c", "-o", str(objs[1]), str(_SOURCE)],
                 [_cxx_compiler(), *cxxflags, "-c", "-o", str(objs[2]), str(_OP_SOURCE)],
                 [_compiler(), *_CFLAGS, "-c", "-o", str(objs[3]), str(_ATTENTION_SOURCE)])
            _run([_cxx_compiler(), *cxxflags, "-o", str(built), *map(str, objs),
                  f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"])
            os.replace(built, path)          # NOTE: atomic: a racing process sees all or none
        logger.info("compiled the GGUF CPU kernel into %s in %.1f s", path,
                    time.perf_counter() - start)
    torch.ops.load_library(str(path))
    _ISA_CONTROL.append(ctypes.CDLL(str(path)))
    _apply_isa(os.environ.get("RUNG_GGUF_ISA") or None)


_ISA_CONTROL: list[ctypes.CDLL] = []      # the loaded op library, for set_isa / isa
ISAS = ("avx2", "avx512_vnni")


def kernel_loaded() -> bool:
    """Whether ``load_kernel`` has registered the ops' CPU kernels in this process."""
    return bool(_ISA_CONTROL)


def set_isa(name: str | None) -> None:
    """Force the kernel's path: "avx2" (on any CPU), or None for the best this CPU runs
    (AVX-512 VNNI where present). ``RUNG_GGUF_ISA=avx2`` does the same at load."""
    load_kernel()
    _apply_isa(name)


def _apply_isa(name: str | None) -> None:
    if name not in (None, "auto", *ISAS):
        raise ValueError(f"RUNG_GGUF_ISA / set_isa takes {', '.join(ISAS)} or auto, "
                         f"not {name!r}")
    _ISA_CONTROL[0].rung_gguf_set_isa(0 if name == "avx2" else -1)


def isa() -> str:
    """The path rung::gguf_gemm runs now: "avx2" or "avx512_vnni"."""
    load_kernel()
    return ISAS[_ISA_CONTROL[0].rung_gguf_isa()]


def _run(*cmds: list[str]) -> None:
    """Run the compiler commands side by side; raise with the first failure's stderr."""
    logs = [tempfile.TemporaryFile("w+") for _ in cmds]   # NOTE: no pipe for one to fill
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
             for cmd, log in zip(cmds, logs)]
    for proc in procs:
        proc.wait()
    for cmd, proc, log in zip(cmds, procs, logs):
        with log:
            log.seek(0)
            if proc.returncode:
                raise RuntimeError(f"compiling rung's GGUF CPU kernel failed "
                                   f"({' '.join(cmd)}):\n{log.read()}")
