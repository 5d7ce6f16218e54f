"""GGUF block-quantized matmuls on x86 CPUs: rung's own AVX2 kernel, fp32 activations.

torch's CPU int4 kernel (``aten::_weight_int4pack_mm_for_cpu``) converts every weight to
float before its FMA; on AVX2 it runs SmolLM2's layer matmuls in 20 ms a decode step, 2x
llama.cpp's whole step. ``csrc/gguf_gemm.c`` does what llama.cpp does: each 32-group of an
activation row is rounded to int8 with its own scale, and a group's dot product with the
weight's 4- or 8-bit values is one integer ``maddubs`` (32 weights an instruction), scaled
in fp32. The weight stays in GGUF's own blocks (``GGUFBlockWeight``: Q4_0, Q4_1, Q8_0), so
nothing is rounded at load; the activation rounding is the kernel's only approximation,
and ``gguf_gemm_reference`` (torch, fp64) is the same formula, the tests' oracle.

The C source is compiled once per machine with the system C compiler (the one inductor
uses) into ``$RUNG_CACHE_DIR/kernels`` and called through ctypes; inside compiled graphs
it is the custom op ``rung::gguf_gemm`` (an opaque call inductor keeps).
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
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

GROUP_SIZE = 32                   # GGUF's block: 32 weights, one scale (and offset)
_SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]


@dataclasses.dataclass
class GGUFBlockWeight:
    """A weight [N, K] in GGUF blocks: w[n, k] = scale[n, g] * q[n, k] + offset[n, g]
    (g = k // 32; Q4_0: offset -8 scale; Q4_1: offset m; Q8_0: offset 0)."""

    qs: torch.Tensor        # bits 4: [N, K // 2] uint8, byte j of a group = weights j, j + 16
    #                         bits 8: [N, K] int8
    scale: torch.Tensor     # [N, K // 32] fp32
    offset: torch.Tensor    # [N, K // 32] fp32
    bits: int               # 4 or 8

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.scale.shape[1] * GROUP_SIZE

    def values(self) -> torch.Tensor:
        """q [N, K] in k order: 0..15 (4 bits) or -128..127 (8 bits), int16."""
        if self.bits == 8:
            return self.qs.to(torch.int16)
        num_rows, num_cols = self.shape
        groups = self.qs.reshape(num_rows, num_cols // GROUP_SIZE, GROUP_SIZE // 2)
        nibbles = torch.cat((groups & 0x0F, groups >> 4), dim=-1)       # [N, G, 32]
        return nibbles.reshape(num_rows, num_cols).to(torch.int16)


def stack_rows(shards: list[GGUFBlockWeight]) -> GGUFBlockWeight:
    """Shards' rows stacked into one weight (fused q/k/v, gate/up)."""
    if len({s.bits for s in shards}) != 1 or len({s.shape[1] for s in shards}) != 1:
        raise ValueError(f"fused shards mix bit widths or widths: "
                         f"{[(s.bits, s.shape) for s in shards]}")
    if len(shards) == 1:
        return shards[0]
    return GGUFBlockWeight(torch.cat([s.qs for s in shards]),
                           torch.cat([s.scale for s in shards]),
                           torch.cat([s.offset for s in shards]), shards[0].bits)


def dequantize_reference(weight: GGUFBlockWeight) -> torch.Tensor:
    """The weight [N, K] in fp32 (the block formula, exact: fp32 scale times small ints)."""
    scale = weight.scale.repeat_interleave(GROUP_SIZE, dim=1)            # [N, K]
    offset = weight.offset.repeat_interleave(GROUP_SIZE, dim=1)          # [N, K]
    return weight.values().float() * scale + offset


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 32, 32] int8-valued fp32, dx [M, K // 32]): the
    kernel's activation rounding (dx = max|x| / 127 per group, round half to even)."""
    groups = x.float().reshape(x.shape[0], -1, GROUP_SIZE)                # [M, G, 32]
    dx = groups.abs().amax(-1) / 127.0                                    # [M, G]
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(groups * inv[..., None]), dx


def gguf_gemm_reference(x: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] fp32 by the kernel's formula, summed in fp64."""
    xq, dx = quantize_rows_reference(x)                                   # [M, G, 32], [M, G]
    xsum = x.double().reshape(xq.shape).sum(-1)                           # [M, G]
    num_rows, num_cols = weight.shape
    q = weight.values().double().reshape(num_rows, num_cols // GROUP_SIZE, GROUP_SIZE)
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q)                   # [M, N, G]
    scaled = dots * weight.scale.double()[None] * dx.double()[:, None]    # [M, N, G]
    return (scaled.sum(-1) + xsum @ weight.offset.double().t()).float()


def gguf_gemm(x: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """x [M, K] fp32 @ w^T -> [M, N] fp32 (eager; compiled graphs call ``rung::gguf_gemm``)."""
    if torch.compiler.is_compiling():
        return torch.ops.rung.gguf_gemm(x, weight.qs, weight.scale, weight.offset, weight.bits)
    return _gemm(x, weight.qs, weight.scale, weight.offset, weight.bits)


def _gemm(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
          bits: int) -> torch.Tensor:
    num_rows, num_cols = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    out = torch.empty(num_rows, qs.shape[0], dtype=torch.float32)
    status = _library().gguf_gemm(x.data_ptr(), num_rows, num_cols, qs.data_ptr(),
                                  scale.data_ptr(), offset.data_ptr(), qs.shape[0], bits,
                                  out.data_ptr())
    if status:
        raise MemoryError(f"gguf_gemm: no scratch memory for {num_rows} x {num_cols} rows")
    return out


@torch.library.custom_op("rung::gguf_gemm", mutates_args=())
def _gguf_gemm_op(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor,
                  offset: torch.Tensor, bits: int) -> torch.Tensor:
    return _gemm(x, qs, scale, offset, bits)


@_gguf_gemm_op.register_fake
def _(x, qs, scale, offset, bits):
    return x.new_empty(x.shape[0], qs.shape[0], dtype=torch.float32)


def available() -> str | None:
    """Why the kernel cannot run on this machine, or None."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    return None


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang")
                 if c and shutil.which(c)), None)


def _cache_dir() -> Path:
    root = os.environ.get("RUNG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rung")
    return Path(root) / "kernels"


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The compiled kernel, built on first use (about a second) and cached by source hash."""
    why = available()
    if why is not None:
        raise RuntimeError(f"rung's GGUF CPU kernel cannot run: {why}")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"gguf_gemm-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            cmd = [_compiler(), *_CFLAGS, "-o", str(built), str(_SOURCE)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"compiling {_SOURCE.name} failed ({' '.join(cmd)}):\n"
                                   f"{result.stderr}")
            os.replace(built, path)          # NOTE: atomic: a racing process sees all or none
        logger.info("compiled the GGUF CPU kernel into %s", path)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_gemm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int, ptr]
    lib.gguf_gemm.restype = ctypes.c_int
    return lib
