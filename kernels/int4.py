"""Group-wise int4 weight-only matmul: torch's own kernels, one interface for CPU and CUDA.

A weight [N, K] is held as 4-bit values ``q`` in 0..15 with one (scale, zero) pair per
group of ``GROUP_SIZE`` consecutive weights along K; it stands for

    w[n, k] = (q[n, k] - 8) * scale[n, k // GROUP_SIZE] + zero[n, k // GROUP_SIZE]

(the convention of ``aten::_weight_int4pack_mm``: ``int4_reference`` is the oracle, and the
tests hold the kernels to it). The kernels read activations, scales and zeros in bfloat16
(``ACTIVATION_DTYPE``): the CPU kernel has fp16/fp32 variants too, but they are scalar
loops (far slower than bf16; docs/performance.md), and the CUDA kernel takes bf16 only.
"""

from __future__ import annotations

import dataclasses

import torch

GROUP_SIZE = 32                    # GGUF's Q4_0 / Q4_1 block: 32 weights, one scale
ACTIVATION_DTYPE = torch.bfloat16
# NOTE: the CPU packing needs N % 16 == 0, the CUDA one N % 8 == 0 and K % 32 == 0.
ROWS_MULTIPLE = 16


@dataclasses.dataclass
class Int4Weight:
    """A weight [N, K] in the portable form, before it is packed for one device's kernel."""

    q: torch.Tensor        # [N, K] uint8, values 0..15
    scale: torch.Tensor    # [N, K // GROUP_SIZE] fp32
    zero: torch.Tensor     # [N, K // GROUP_SIZE] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)



def int4_reference(weight: Int4Weight) -> torch.Tensor:
    """The weight [N, K] in fp32, by the kernels' convention (the tests' oracle)."""
    scale = weight.scale.repeat_interleave(GROUP_SIZE, dim=1)            # [N, K]
    zero = weight.zero.repeat_interleave(GROUP_SIZE, dim=1)              # [N, K]
    return (weight.q.float() - 8.0) * scale + zero


def check_packable(num_rows: int, num_cols: int) -> str | None:
    """Why a weight [num_rows, num_cols] cannot go through the int4 kernels, or None."""
    if num_rows % ROWS_MULTIPLE:
        return f"{num_rows} rows are not a multiple of {ROWS_MULTIPLE}"
    if num_cols % GROUP_SIZE:
        return f"{num_cols} columns are not a multiple of the group size {GROUP_SIZE}"
    return None


def pack_int4(shards: list[Int4Weight],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight of ``shards``' rows stacked (fused q/k/v, gate/up) -> (packed weight in
    the device kernel's layout, scales_and_zeros [K/G, N, 2] bf16)."""
    num_rows, num_cols = sum(s.shape[0] for s in shards), shards[0].shape[1]
    why = check_packable(num_rows, num_cols)
    if why is not None:
        raise ValueError(f"int4 weight of shape {(num_rows, num_cols)}: {why}")
    # NOTE: one copy per shard straight into the kernel's input dtype (no cat, no .to)
    q = torch.empty(num_rows, num_cols, dtype=torch.int32)                 # [N, K]
    scales_and_zeros = torch.empty(num_cols // GROUP_SIZE, num_rows, 2,
                                   dtype=ACTIVATION_DTYPE)                 # [K/G, N, 2]
    start = 0
    for shard in shards:
        stop = start + shard.shape[0]
        q[start:stop].copy_(shard.q)
        scales_and_zeros[:, start:stop, 0].copy_(shard.scale.t())
        scales_and_zeros[:, start:stop, 1].copy_(shard.zero.t())
        start = stop
    scales_and_zeros = scales_and_zeros.to(device)
    if device.type == "cuda":
        # NOTE: the CUDA packing takes two values a byte (even k in the high nibble) and
        # tiles K by inner_k_tiles * 16.
        q = q.to(device)
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)            # [N, K/2]
        inner_k_tiles = next(t for t in (8, 4, 2) if num_cols % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles), \
            scales_and_zeros
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros


def int4_mm(x: torch.Tensor, packed: torch.Tensor,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ w^T -> [M, N] bf16, w the int4 weight ``pack_int4`` packed."""
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP_SIZE, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)
