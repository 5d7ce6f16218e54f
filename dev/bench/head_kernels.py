"""The lm head's three CPU kernels by row count (``models/layers.py`` ``lm_head_logits``):
x @ W^T (a contiguous W^T copy), F.linear(x, W) and the tall GEMM (W @ x^T)^T, on a random
row-major [vocab, hidden] weight, interleaved A B C C B A in one process, one torch thread.

    python dev/bench/head_kernels.py [--vocab 49152 --hidden 576 --rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def kernels(weight: torch.Tensor) -> dict:
    weight_t = weight.t().contiguous()
    return {"x @ W^T": lambda x: torch.mm(x, weight_t),
            "F.linear": lambda x: torch.nn.functional.linear(x, weight),
            "tall GEMM": lambda x: torch.mm(weight, x.t()).t().contiguous()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", default="1,2,3,4,5,8,16,32,64,256")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=gen) * 0.02
    variants = kernels(weight)
    print(f"head {args.vocab} x {args.hidden} fp32, 1 thread; median ms of {args.rounds} rounds")
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, args.hidden, generator=gen)
        want = variants["F.linear"](x)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                start = time.perf_counter()
                got = variants[name](x)
                times[name].append((time.perf_counter() - start) * 1e3)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        print(f"{rows:4d} rows: " + ", ".join(f"{name} {statistics.median(t):6.1f}"
                                             for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
