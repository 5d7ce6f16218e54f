"""rung's GGUF CPU kernel, two or more builds of it A/B in one process, on SmolLM2's step.

Each ``--source NAME=FILE.c`` is compiled with ``kernels/gguf_cpu.py``'s flags (or
``--cflags``) into a temporary library; every round runs one decode step's matmuls (30
layers of q/k/v, o, gate/up, down in Q4_1, the tied head in Q8_0, as in SmolLM2's file;
random blocks; ``--layer-type`` picks another type for the layers, e.g. Q5_0, which
llama.cpp's Q4_K_M file of SmolLM2 holds for most of them) through each build in turn, A B
A B ..., called straight through ctypes (the C entry points csrc/gguf_op.cpp calls: round
the activations, then the tiles, on one thread, in the op's tasks) with preallocated
inputs and outputs, so only the kernel is timed. ``--isa vnni`` builds with the AVX-512 VNNI flags. The default compares
the committed kernel (``git show HEAD:kernels/csrc/gguf_gemm.c``) with the working tree's.

    OMP_NUM_THREADS=1 python dev/bench/gguf_kernel_ab.py --rows 1 --rounds 21 \
        [--layer-type Q5_0] [--isa vnni]

Per build: the step's median and minimum (layers alone, head alone; on a shared machine
the minimum is the round least disturbed), GB/s over the bytes read and cycles a block
at ``--ghz`` (both from the median), and the median's ratio to the first build.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rung.kernels import gguf_cpu

# SmolLM2-135M: (out, in) of q/k/v, o, gate/up, down x 30 layers (Q4_1), tied head (Q8_0)
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, HEAD_SHAPE = 30, (49152, 576)


def _compile(source: Path, cflags: list[str], out_dir: Path, name: str) -> ctypes.CDLL:
    path = out_dir / f"{name}.so"
    cmd = [gguf_cpu._compiler(), *cflags, "-shared", "-o", str(path), str(source)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(path))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    suffix = "vnni" if "-DGGUF_VNNI" in cflags else "avx2"
    lib.round = getattr(lib, f"gguf_round_{suffix}")
    lib.round.argtypes = [ptr, i64, i64, i32, ptr, ptr, ptr]
    lib.tiles = getattr(lib, f"gguf_tiles_{suffix}")
    lib.tiles.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i32, i64, i64, i64, i64, ptr]
    lib.tiles.restype = i32
    return lib


def _weights(gen: torch.Generator, layer_type: str) -> list[gguf_cpu.GGUFBlockWeight]:
    shapes = LAYER_SHAPES * NUM_LAYERS + [HEAD_SHAPE]
    types = [layer_type] * (len(shapes) - 1) + ["Q8_0"]
    weights = []
    for (n, k), t in zip(shapes, types):
        block_bytes, groups = gguf_cpu.FILE_BLOCK[t]
        raw = torch.randint(0, 256, (n, k // (32 * groups), block_bytes), generator=gen,
                            dtype=torch.uint8)
        raw[..., :4] = torch.tensor([0x00, 0x20, 0x00, 0x20], dtype=torch.uint8)  # f16s
        weights.append(gguf_cpu.GGUFBlockWeight.from_file_blocks(raw.reshape(n, -1), t))
    return weights


def _calls(weights: list[gguf_cpu.GGUFBlockWeight], rows: int,
           gen: torch.Generator) -> list[tuple]:
    """Per matmul: (tensors kept referenced, x ptr, M, K, rows ptr, N, code, out ptr,
    xq / dx / xsum scratch ptrs, the op's tasks)."""
    calls = []
    for w in weights:
        n, k = w.shape
        g_padded = (k // 32 + 7) // 8 * 8
        x, out = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
        xq = torch.empty(rows * k, dtype=torch.int8)
        dx, xsum = torch.zeros(rows * g_padded), torch.zeros(rows * g_padded)
        calls.append(((x, out, xq, dx, xsum), x.data_ptr(), rows, k, w.rows.data_ptr(), n,
                      gguf_cpu.TYPE_CODES[w.type_name], out.data_ptr(), xq.data_ptr(),
                      dx.data_ptr(), xsum.data_ptr(), _tasks(rows, n)))
    return calls


# csrc/gguf_op.cpp's split: up to DECODE_ROWS activation rows take all weight rows in one
# call; more go in tasks of WEIGHT_CHUNK weight rows x ROW_TILE activation rows
DECODE_ROWS, ROW_TILE, WEIGHT_CHUNK = 4, 128, 16


def _tasks(m: int, n: int) -> list[tuple[int, int, int, int]]:
    if m <= DECODE_ROWS:
        return [(0, m, 0, n)]
    m_tiles = -(-m // ROW_TILE)
    return [(m0, min(m, m0 + ROW_TILE), n0, min(n, n0 + WEIGHT_CHUNK))
            for n0 in range(0, n, WEIGHT_CHUNK) for m0 in range(0, m_tiles * ROW_TILE, ROW_TILE)]


def _run(lib: ctypes.CDLL, calls: list[tuple]) -> float:
    start = time.perf_counter()
    for _, x, m, k, w, n, code, out, xq, dx, xsum, tasks in calls:
        lib.round(x, m, k, code, xq, dx, xsum)
        for m0, m1, n0, n1 in tasks:
            if lib.tiles(xq, dx, xsum, k, w, n, code, m0, m1, n0, n1, out):
                raise RuntimeError(f"gguf_tiles refused type code {code}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", action="append", default=[],
                   help="NAME=FILE.c (repeatable); default: HEAD and the working tree")
    p.add_argument("--cflags", default=None, help="default: kernels/gguf_cpu.py's for --isa")
    p.add_argument("--isa", choices=["avx2", "vnni"], default="avx2")
    p.add_argument("--layer-type", default="Q4_1", choices=sorted(gguf_cpu.TYPE_CODES))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--ghz", type=float, default=2.45, help="for cycles a block")
    args = p.parse_args()
    if args.cflags is None:
        args.cflags = " ".join(gguf_cpu._CFLAGS + (gguf_cpu._VNNI_CFLAGS if args.isa == "vnni"
                                                   else []))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sources = dict(s.split("=", 1) for s in args.source)
        if not sources:
            head = Path(tmp) / "head.c"
            head.write_bytes(subprocess.run(
                ["git", "show", "HEAD:kernels/csrc/gguf_gemm.c"], check=True,
                capture_output=True, cwd=gguf_cpu._SOURCE.parent).stdout)
            sources = {"HEAD": str(head), "worktree": str(gguf_cpu._SOURCE)}
        libs = {name: _compile(Path(src), args.cflags.split(), Path(tmp), name)
                for name, src in sources.items()}
        gen = torch.Generator().manual_seed(0)
        weights = _weights(gen, args.layer_type)
        calls = _calls(weights, args.rows, gen)
        parts = {"step": calls, "layers": calls[:-1], "head": calls[-1:]}
        seconds = {(n, part): [] for n in libs for part in parts}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                for part, part_calls in parts.items():
                    seconds[name, part].append(_run(lib, part_calls))
    blocks = {part: sum(w.shape[0] * w.num_groups for w in ws) for part, ws in
              (("step", weights), ("layers", weights[:-1]), ("head", weights[-1:]))}
    nbytes = {part: sum(w.rows.numel() for w in ws) for part, ws in
              (("step", weights), ("layers", weights[:-1]), ("head", weights[-1:]))}
    print(f"{args.rows} rows, layers {args.layer_type}, 1 thread, {args.rounds} rounds, load "
          f"{os.getloadavg()[0]:.1f}, cflags {args.cflags}")
    first = next(iter(libs))
    for (name, part), values in seconds.items():
        med = statistics.median(values)
        ratio = med / statistics.median(seconds[first, part])
        print(f"{name:10s} {part:6s} {med * 1e3:7.2f} ms (min {min(values) * 1e3:7.2f})"
              f"  {nbytes[part] / med / 1e9:5.1f} GB/s"
              f"  {med * args.ghz * 1e9 / blocks[part] / args.rows:5.2f} cycles/block/row"
              f"  x{ratio:.3f} of {first}")


if __name__ == "__main__":
    main()
