"""How close one decode step's fp32 matmuls come to the memory bandwidth, per layout.

Times SmolLM2-135M's weight matmuls for ``--rows`` rows (one decode step of that many
requests) in the layouts rung could use, interleaved (A B C A B C ...) in one process on
one thread, next to the read bandwidth (``sum`` over as many bytes as the weights):

- ``x @ Wt``      W^T contiguous (rung's CPU layout today: MKL GEMV, no transpose);
- ``F.linear``    W row-major [out, in] (HF's layout);
- ``mkldnn``      oneDNN's packed weight (``torch.ops.mkldnn._linear_pointwise`` over
                  ``torch.ops.mkldnn._reorder_linear_weight``), what inductor's CPU
                  freezing path emits;
- ``head/8``      ``x @ Wt`` with the 49152-row head split into 8 column chunks.

    OMP_NUM_THREADS=1 python -m rung.bench.gemv_bandwidth --rows 1 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

# SmolLM2-135M: (out, in) of q/k/v, o, gate/up, down x 30 layers, then the tied head
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, HEAD_SHAPE = 30, (49152, 576)


def _variants(rows: int) -> tuple[dict[str, Callable[[], None]], int]:
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [HEAD_SHAPE]
    weights = [torch.randn(s, generator=gen) for s in shapes]                 # [out, in]
    weights_t = [w.t().contiguous() for w in weights]                           # [in, out]
    xs = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in shapes}}
    nbytes = sum(w.numel() * 4 for w in weights)
    flat = torch.randn(nbytes // 4, generator=gen)
    variants: dict[str, Callable[[], None]] = {
        "read bandwidth (sum)": lambda: flat.sum(),
        "x @ Wt": lambda: [xs[wt.shape[0]] @ wt for wt in weights_t],
        "F.linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
    }
    head_chunks = weights_t[-1].chunk(8, dim=1)
    head_chunks = [c.contiguous() for c in head_chunks]
    variants["head/8"] = lambda: ([xs[wt.shape[0]] @ wt for wt in weights_t[:-1]]
                                  + [xs[576] @ c for c in head_chunks])
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        variants["mkldnn"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, packed)]
    return variants, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    variants, nbytes = _variants(args.rows)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    print(f"{nbytes / 1e6:.0f} MB of fp32 weights, {args.rows} rows, 1 thread")
    for name, values in seconds.items():
        med = statistics.median(values)
        print(f"{name:22s} {med * 1e3:8.2f} ms  {nbytes / med / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
