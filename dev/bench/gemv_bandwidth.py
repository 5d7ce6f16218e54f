"""How close one decode step's fp32 matmuls come to the memory bandwidth, per layout.

Times SmolLM2-135M's weight matmuls for ``--rows`` rows (one decode step of that many
requests) in the layouts rung could use, interleaved (A B C A B C ...) in one process on
one thread, next to the read bandwidth (``sum`` over as many bytes as the weights):

- ``x @ Wt``      W^T contiguous (rung's CPU layout today: MKL GEMV, no transpose);
- ``F.linear``    W row-major [out, in] (HF's layout);
- ``mkldnn``      oneDNN's packed weight (``torch.ops.mkldnn._linear_pointwise`` over
                  ``torch.ops.mkldnn._reorder_linear_weight``), what inductor's CPU
                  freezing path emits;
- ``head/8``      ``x @ Wt`` with the 49152-row head split into 8 column chunks;
- ``f32_linear``  rung's float32 GEMV (``rung::f32_linear``) on the row-major weights,
                  as separate tensors and in one buffer in call order (rung's CPU layout);
- ``gguf Q4_1+Q8_0``  rung's GGUF CPU kernel on the same shapes in SmolLM2's file types
                  (Q4_1 layers, Q8_0 head), bytes counted as stored;
- ``gguf Q4_1 (layers)``  the same without the head;
- ``torch int4``  torch's ``_weight_int4pack_mm_for_cpu`` on the layers (bf16 x), bytes
                  as packed (4-bit values, bf16 scale and zero per group).

    OMP_NUM_THREADS=1 python dev/bench/gemv_bandwidth.py --rows 1 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

# SmolLM2-135M: (out, in) of q/k/v, o, gate/up, down x 30 layers, then the tied head
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, HEAD_SHAPE = 30, (49152, 576)


def _variants(rows: int) -> tuple[dict[str, tuple[Callable[[], None], int]], int]:
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [HEAD_SHAPE]
    weights = [torch.randn(s, generator=gen) for s in shapes]                 # [out, in]
    weights_t = [w.t().contiguous() for w in weights]                           # [in, out]
    xs = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in shapes}}
    nbytes = sum(w.numel() * 4 for w in weights)
    flat = torch.randn(nbytes // 4, generator=gen)
    variants: dict[str, tuple[Callable[[], None], int]] = {
        "read bandwidth (sum)": (lambda: flat.sum(), nbytes),
        "x @ Wt": (lambda: [xs[wt.shape[0]] @ wt for wt in weights_t], nbytes),
        "F.linear": (lambda: [torch.nn.functional.linear(xs[w.shape[1]], w)
                              for w in weights], nbytes),
    }
    head_chunks = weights_t[-1].chunk(8, dim=1)
    head_chunks = [c.contiguous() for c in head_chunks]
    variants["head/8"] = (lambda: ([xs[wt.shape[0]] @ wt for wt in weights_t[:-1]]
                                   + [xs[576] @ c for c in head_chunks]), nbytes)
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        variants["mkldnn"] = (lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, packed)], nbytes)
    from rung.kernels import gguf_cpu

    if gguf_cpu.available() is None:
        separate = list(weights)
        one_buffer = gguf_cpu.rows_in_one_buffer(weights)
        variants["f32_linear"] = (lambda: [gguf_cpu.f32_linear(xs[w.shape[1]], w)
                                           for w in separate], nbytes)
        variants["f32_linear, 1 buffer"] = (lambda: [gguf_cpu.f32_linear(xs[w.shape[1]], w)
                                                     for w in one_buffer], nbytes)
    variants.update(_quantized_variants(shapes, xs, gen))
    return variants, nbytes


def _quantized_variants(shapes: list[tuple[int, int]], xs: dict[int, torch.Tensor],
                        gen: torch.Generator) -> dict[str, tuple[Callable[[], None], int]]:
    """rung's GGUF kernel (Q4_1 layers, Q8_0 head) and torch's int4 kernel (layers)."""
    from rung.kernels import gguf_cpu, int4

    variants = {}
    if gguf_cpu.available() is None:
        blocks = []
        for (n, k), t in zip(shapes, ["Q4_1"] * (len(shapes) - 1) + ["Q8_0"]):
            raw = torch.randint(0, 256, (n, k // 32, gguf_cpu.BLOCK_BYTES[t]), generator=gen,
                                dtype=torch.uint8)
            raw[..., :4] = torch.tensor([0x00, 0x20, 0x00, 0x20], dtype=torch.uint8)  # f16s
            blocks.append(gguf_cpu.GGUFBlockWeight.from_file_blocks(raw.reshape(n, -1), t))
        variants["gguf Q4_1+Q8_0"] = (lambda: [gguf_cpu.gguf_gemm(xs[b.shape[1]], b)
                                               for b in blocks],
                                      sum(b.rows.numel() for b in blocks))
        variants["gguf Q4_1 (layers)"] = (lambda: [gguf_cpu.gguf_gemm(xs[b.shape[1]], b)
                                                   for b in blocks[:-1]],
                                          sum(b.rows.numel() for b in blocks[:-1]))
    layers = shapes[:-1]
    packed = [int4.pack_int4([int4.Int4Weight(
        torch.randint(0, 16, s, generator=gen, dtype=torch.uint8),
        torch.rand(s[0], s[1] // 32, generator=gen), torch.rand(s[0], s[1] // 32,
                                                                generator=gen))],
        torch.device("cpu")) for s in layers]
    xs_bf16 = {k: x.bfloat16() for k, x in xs.items()}
    variants["torch int4 (layers)"] = (
        lambda: [int4.int4_mm(xs_bf16[s[1]], *p) for s, p in zip(layers, packed)],
        sum(n * k // 2 + n * k // 32 * 4 for n, k in layers))
    return variants


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    variants, nbytes = _variants(args.rows)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (fn, _) in variants.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    print(f"{nbytes / 1e6:.0f} MB of fp32 weights, {args.rows} rows, 1 thread, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in seconds.items():
        med, size = statistics.median(values), variants[name][1]
        print(f"{name:22s} {med * 1e3:8.2f} ms  {size / 1e6:6.0f} MB  "
              f"{size / med / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
