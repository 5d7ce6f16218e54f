"""Start-up of a GGUF file served quantized (its Q4_0 / Q4_1 / Q8_0 blocks kept as they are)
against the dequantizing load, interleaved (A B A B ...) in one process; each load parses
the file anew. Both in fp32 activations, rung's CPU default for either.

    OMP_NUM_THREADS=1 python dev/bench/gguf_startup.py --model smollm2-135m --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rung.models import loader

VARIANTS = {"quantized (quantization=gguf)": (torch.float32, "gguf"),
            "dequantized (fp32)": (torch.float32, None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (dtype, quantization) in VARIANTS.items():
            loader._open_gguf.cache_clear()
            start = time.perf_counter()
            loader.load_model(args.model, dtype, "cpu", quantization=quantization)
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["dequantized (fp32)"])
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"{name:32s} median {med:6.2f} s  ({med / base:.2f}x)  all {values}")


if __name__ == "__main__":
    main()
