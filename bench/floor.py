"""The bare-matmul floor: a decode step's weight matmuls alone, as plain torch ops.

Per layer qkv, o, gate_up and down (every ``nn.Linear`` of the model, in module order;
a quantized ``QuantLinear`` runs its own kernel on its blocks), plus ``lm_head`` for the
sampled rows; no norms, RoPE, attention, KV writes, sampling or
host bookkeeping. Inputs and outputs are preallocated, so a step allocates nothing.
Float weights are held pre-transposed (W^T contiguous, ``x @ Wt``), the fastest layout for
BLAS, so rung cannot beat the floor by changing its own weight layout; a float32 layer
rung runs through its own GEMV (``rung::f32_linear``) runs that kernel here too.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from rung.bench.stats import sync
from rung.models.layers import QuantLinear, is_f32_gemv


class MatmulFloor:
    """One decode step's weight matmuls on ``num_reqs`` rows (one token per request)."""

    def __init__(self, model: nn.Module, num_reqs: int) -> None:
        # (x [num_reqs, in], W^T [in, out] contiguous, bias [out] | None, out [num_reqs, out])
        self.ops: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        # (x [num_reqs, in], a layer that runs its own kernel)
        self.quant_ops: list[tuple[torch.Tensor, nn.Module]] = []
        gen = torch.Generator().manual_seed(0)
        for linear in _linears(model):
            if isinstance(linear, QuantLinear) or is_f32_gemv(linear):
                x = torch.randn(num_reqs, linear.in_features, generator=gen)
                self.quant_ops.append((x, linear))
                continue
            w = linear.weight
            x = torch.randn(num_reqs, linear.in_features, generator=gen).to(w.device, w.dtype)
            out = torch.empty(num_reqs, linear.out_features, dtype=w.dtype, device=w.device)
            # NOTE: no copy when the model already stores W^T (rung's CPU layout)
            self.ops.append((x, w.detach().t().contiguous(), linear.bias, out))
        if not self.ops and not self.quant_ops:
            raise ValueError(f"model {type(model).__name__} has no nn.Linear: no matmul floor")
        self.device = (self.ops[0][0] if self.ops else self.quant_ops[0][0]).device

    @property
    def num_matmuls(self) -> int:
        return len(self.ops) + len(self.quant_ops)

    @torch.inference_mode()
    def step(self) -> None:
        for x, w_t, bias, out in self.ops:
            if bias is None:
                torch.mm(x, w_t, out=out)
            else:
                torch.addmm(bias, x, w_t, out=out)
        for x, layer in self.quant_ops:
            layer(x)

    def time_steps(self, num_steps: int, num_warmup: int = 3) -> list[float]:
        """Seconds per step, ``num_steps`` samples after ``num_warmup`` untimed steps."""
        for _ in range(num_warmup):
            self.step()
        sync(self.device)
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            self.step()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times


def _linears(model: nn.Module) -> list[nn.Linear | QuantLinear]:
    """Every distinct nn.Linear or QuantLinear; lm_head last, as in a forward pass."""
    seen: set[int] = set()
    out: list[nn.Linear | QuantLinear] = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, QuantLinear)) and id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    head = getattr(model, "lm_head", None)
    if head in out:
        out.remove(head)
        out.append(head)
    return out
