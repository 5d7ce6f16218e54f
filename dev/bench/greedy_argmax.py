"""torch's CPU argmax against max(dim).indices (the sampler's greedy pick), one thread,
interleaved A B A B in one process, over a row of logits of SmolLM2's and Gemma 3's
vocabulary sizes and 8 rows of Gemma's.

    python dev/bench/greedy_argmax.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _us(fn, calls: int = 100) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    for rows, vocab in ((1, 49152), (1, 262144), (8, 262144)):
        x = torch.randn(rows, vocab)
        assert torch.equal(x.argmax(-1), x.max(-1).indices)
        argmax, maxi = [], []
        for _ in range(args.rounds):
            argmax.append(_us(lambda x=x: x.argmax(-1)))
            maxi.append(_us(lambda x=x: x.max(-1).indices))
        a, m = statistics.median(argmax), statistics.median(maxi)
        print(f"{rows} x {vocab}: argmax {a:.0f} us, max {m:.0f} us, argmax / max {a / m:.2f}")


if __name__ == "__main__":
    main()
