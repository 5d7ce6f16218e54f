"""GGUF block-quantized matmuls on x86 CPUs: rung's own AVX2 kernel, fp32 activations.

torch's CPU int4 kernel (``aten::_weight_int4pack_mm_for_cpu``) converts every weight to
float before its FMA, and on AVX2 it is compute-bound (``bench/gemv_bandwidth.py``).
``csrc/gguf_gemm.c`` does what llama.cpp does: each 32-group of an activation row is
rounded to int8 with its own scale, and a group's dot product with the weight's 4- or
8-bit values is one integer ``maddubs`` (32 weights an instruction), scaled in fp32: the
result is the exact weight times the rounded activations. The weight keeps the file's
block bytes (``GGUFBlockWeight``: Q4_0, Q4_1, Q8_0), regrouped per row (values, then
scales) so the kernel converts 8 scales at once; nothing is rounded or unpacked at load,
and the kernel reads as many bytes as llama.cpp. The activation rounding is the kernel's
only approximation, and ``gguf_gemm_reference`` (torch, fp64) is the same formula, the
tests' oracle.

The kernel is the op ``rung::gguf_gemm`` (an opaque call inductor keeps in compiled
graphs), its CPU implementation in C++ (``csrc/gguf_op.cpp``): the dispatcher calls the C
kernel with no Python in between. Both are compiled once per machine and torch version
with the system compilers (the C++ one inductor uses) into ``$RUNG_CACHE_DIR/kernels``
(~15 s of CPU the first time, torch's headers; loading the cached library takes
milliseconds).
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
_SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
_OP_SOURCE = Path(__file__).parent / "csrc" / "gguf_op.cpp"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-shared", "-fPIC"]
_CXXFLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-w"]


# GGUF type -> bytes a block (values, f16 d, Q4_1's f16 m) and code of csrc/gguf_gemm.c
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
VALUE_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}
TYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@dataclasses.dataclass
class GGUFBlockWeight:
    """A weight [N, K] of a GGUF file's blocks of 32 along K, the file's bytes regrouped
    per row (the same size): row n = [values of its G = K // 32 blocks | G f16 scales d |
    G f16 minimums m (Q4_1 only)], and w[n, k] = d[n, g] * q[n, k] + z[n, g] with g = k //
    32 and z = -8 d (Q4_0), m (Q4_1), 0 (Q8_0). A block's 16 bytes of nibbles hold weight
    j in the low half of byte j and weight j + 16 in its high half; Q8_0 values are int8."""

    rows: torch.Tensor      # [N, K // 32 * BLOCK_BYTES[type_name]] uint8
    type_name: str          # "Q4_0", "Q4_1" or "Q8_0"

    @classmethod
    def from_file_blocks(cls, blocks: torch.Tensor, type_name: str) -> GGUFBlockWeight:
        """blocks [N, G * BLOCK_BYTES] uint8 as a GGUF file stores them (d, [m], values
        per block) -> the per-row layout."""
        num_rows, row_bytes = blocks.shape
        fields = blocks.reshape(num_rows, row_bytes // BLOCK_BYTES[type_name], -1)
        parts = [fields[..., -VALUE_BYTES[type_name]:], fields[..., :2]]
        if type_name == "Q4_1":
            parts.append(fields[..., 2:4])
        return cls(torch.cat([p.reshape(num_rows, -1) for p in parts], dim=1), type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.num_groups * GROUP_SIZE

    @property
    def num_groups(self) -> int:
        return self.rows.shape[1] // BLOCK_BYTES[self.type_name]

    @property
    def bits(self) -> int:
        return 8 if self.type_name == "Q8_0" else 4

    def _f16(self, index: int) -> torch.Tensor:
        """The ``index``-th f16 array of every row (0: d, 1: m) -> [N, G] fp32."""
        start = self.num_groups * (VALUE_BYTES[self.type_name] + 2 * index)
        return (self.rows[:, start:start + 2 * self.num_groups].contiguous()
                .view(torch.float16).float())

    def scale(self) -> torch.Tensor:
        """[N, K // 32] fp32 (the f16 d, widened exactly)."""
        return self._f16(0)

    def offset(self) -> torch.Tensor:
        """[N, K // 32] fp32: -8 d (Q4_0), m (Q4_1) or 0 (Q8_0)."""
        if self.type_name == "Q4_1":
            return self._f16(1)
        return -8.0 * self.scale() if self.type_name == "Q4_0" else torch.zeros_like(
            self.scale())

    def values(self) -> torch.Tensor:
        """q [N, K] in k order: 0..15 (4 bits) or -128..127 (8 bits), int16."""
        num_rows, num_cols = self.shape
        values = self.rows[:, :self.num_groups * VALUE_BYTES[self.type_name]]
        if self.type_name == "Q8_0":
            return values.contiguous().view(torch.int8).short()
        nibbles = values.reshape(num_rows, self.num_groups, 16)               # [N, G, 16]
        return torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(
            num_rows, num_cols).short()


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
    """``rows`` (uint8 weights) copied back to back into one buffer, in the given order
    (a forward's call order), asked for transparent huge pages; views into it.

    NOTE: a decode step streams every weight from DRAM once. In one buffer the kernel's
    prefetch past the end of a weight warms the next one, and on huge pages neither the
    TLB nor the hardware prefetcher stops at each 4 KB page (torch's allocator asks for
    none; THP is "madvise" on most distributions): SmolLM2's step matmuls, one thread,
    41 interleaved rounds at load 2.5: 9.66 vs 11.15 ms (bench/gguf_kernel_ab.py's
    weights, separate tensors vs this buffer). Without THP the buffer is still one.
    """
    if not rows:
        return []
    total = sum(_aligned(r.numel()) for r in rows)
    buffer = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = _aligned(buffer.data_ptr(), HUGE_PAGE) - buffer.data_ptr()
    _advise_huge_pages(buffer.data_ptr() + start, total)
    views, offset = [], start
    for r in rows:
        view = buffer[offset:offset + r.numel()].view(r.shape)
        view.copy_(r)
        views.append(view)
        offset += _aligned(r.numel())
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
    """The weight [N, K] in fp32 (the block formula, exact: fp32 scale times small ints)."""
    scale = weight.scale().repeat_interleave(GROUP_SIZE, dim=1)          # [N, K]
    offset = weight.offset().repeat_interleave(GROUP_SIZE, dim=1)        # [N, K]
    return weight.values().float() * scale + offset


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
    return (rounded @ dequantize_reference(weight).double().t()).float()


def gguf_gemm(x: torch.Tensor, weight: GGUFBlockWeight) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] fp32 (x of any float dtype, cast to fp32), eagerly or
    inside a compiled graph: the op ``rung::gguf_gemm``."""
    if not torch.compiler.is_compiling():
        load_kernel()
    return torch.ops.rung.gguf_gemm.default(x, weight.rows, TYPE_CODES[weight.type_name])


# NOTE: the CPU kernel is csrc/gguf_op.cpp (``load_kernel``): a Python kernel behind the
# dispatcher cost ~10 us more a call than an aten op's (at load 5: 20 vs 10.7 us a call,
# ~120 calls a step).
_LIBRARY = torch.library.Library("rung", "FRAGMENT")
_LIBRARY.define("gguf_gemm(Tensor x, Tensor rows, int code) -> Tensor")
_LIBRARY.impl("gguf_gemm", lambda x, rows, code: x.new_empty(
    x.shape[0], rows.shape[0], dtype=torch.float32), "Meta")


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
    """Register the op's CPU kernel, building it on first use and caching it by its
    sources, flags and torch version."""
    why = available()
    if why is not None:
        raise RuntimeError(f"rung's GGUF CPU kernel cannot run: {why}")
    from torch.utils import cpp_extension

    torch_lib = cpp_extension.library_paths()[0]
    cxxflags = [*_CXXFLAGS, *(f"-I{p}" for p in cpp_extension.include_paths()),
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    key = b"".join([_SOURCE.read_bytes(), _OP_SOURCE.read_bytes(),
                    " ".join(_CFLAGS + cxxflags + [torch.__version__]).encode()])
    path = _cache_dir() / f"gguf_op-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            obj, built = Path(tmp) / "gguf_gemm.o", Path(tmp) / path.name
            _run([_compiler(), *_CFLAGS, "-c", "-o", str(obj), str(_SOURCE)])
            _run([_cxx_compiler(), *cxxflags, "-o", str(built), str(_OP_SOURCE), str(obj),
                  f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"])
            os.replace(built, path)          # NOTE: atomic: a racing process sees all or none
        logger.info("compiled the GGUF CPU kernel into %s in %.1f s", path,
                    time.perf_counter() - start)
    torch.ops.load_library(str(path))


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"compiling rung's GGUF CPU kernel failed ({' '.join(cmd)}):\n"
                           f"{result.stderr}")
