"""rung's GGUF GEMM at prefill size, 1 thread against 2, beside torch.mm of the same shape.

Random blocks of each type for a SmolLM2-shaped gate/up weight ([1536, 576]) times a
512-row activation, through `gguf_cpu.gguf_gemm` (the engine's op) and through torch.mm on
an fp32 weight of the same shape; each round times both at 1 and at 2 threads, A B A B.

    python dev/bench/gguf_gemm_threads.py [--rounds 6] [--types Q5_0,Q4_1,Q8_0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rung.kernels import gguf_cpu


def _weight(type_name: str, n: int, k: int, gen: torch.Generator) -> gguf_cpu.GGUFBlockWeight:
    block_bytes, groups = gguf_cpu.FILE_BLOCK[type_name]
    raw = torch.randint(0, 256, (n, k // (32 * groups), block_bytes), generator=gen,
                        dtype=torch.uint8)
    raw[..., :4] = torch.tensor([0x00, 0x20, 0x00, 0x20], dtype=torch.uint8)  # f16 scales
    return gguf_cpu.GGUFBlockWeight.from_file_blocks(raw.reshape(n, -1), type_name)


def _seconds(fn, calls: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--types", default="Q5_0,Q4_1,Q8_0")
    p.add_argument("--rows", type=int, default=512)
    args = p.parse_args()
    gguf_cpu.load_kernel()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 576, generator=gen)
    dense = torch.randn(1536, 576, generator=gen)
    for type_name in args.types.split(","):
        weight = _weight(type_name, 1536, 576, gen)
        ops = {"gguf": lambda w=weight: gguf_cpu.gguf_gemm(x, w), "mm": lambda: x @ dense.t()}
        seconds: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, fn in ops.items():
                    seconds.setdefault((name, threads), []).append(_seconds(fn))
        for name in ops:
            one, two = (statistics.median(seconds[name, t]) for t in (1, 2))
            print(f"{type_name} {name}: 1 thread {one * 1e3:.2f} ms, 2 threads {two * 1e3:.2f} ms,"
                  f" speed-up {one / two:.2f}x")


if __name__ == "__main__":
    main()
