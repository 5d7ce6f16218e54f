"""Mixture-of-experts pieces: graph-safe routed experts and the expert-parallel exchange.

Routing never syncs with the host and every shape is fixed by the padded token count:
each local expert runs on every token and its output is weighted by a dense routing
matrix that is 0 where the token did not pick the expert. That costs ``num_experts /
top_k`` times the FLOPs of a grouped kernel, which is right for tiny test models and
keeps the layer capturable whole; a sort-based grouped path can replace `_local_experts`
without touching the contract.

Expert parallel (EP): the experts are split evenly across the data-parallel ranks. Every
rank runs the same padded token count (the DP sync pads all ranks to the max), so one
all-gather brings every rank's tokens to every rank, each rank applies its own experts,
and a reduce-scatter (gloo: all-reduce, then this rank's slice) sums the partial outputs
back to the rank that owns the tokens. Pad rows travel too: that is why DP padding must
reach the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


# --- expert-parallel exchange: custom ops, so torch.compile keeps them opaque ------------
@torch.library.custom_op("rung::ep_all_gather", mutates_args=())
def ep_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """x [T, H] on every rank -> [world_size * T, H], rank r's rows at [r*T, (r+1)*T)."""
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    dist.all_gather(list(out.chunk(world_size)), x.contiguous())
    return out


@ep_all_gather.register_fake
def _(x, world_size):
    return x.new_empty((world_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("rung::ep_reduce_scatter", mutates_args=())
def ep_reduce_scatter(partial: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """partial [world_size * T, H] per rank -> the sum over ranks of rows [rank*T, (rank+1)*T)."""
    num_tokens = partial.shape[0] // world_size
    if dist.get_backend() == "nccl":
        out = partial.new_empty((num_tokens, *partial.shape[1:]))
        dist.reduce_scatter_tensor(out, partial.contiguous())
        return out
    # NOTE: gloo has no reduce-scatter; all-reduce and keep this rank's rows.
    summed = partial.contiguous().clone()
    dist.all_reduce(summed)
    return summed[rank * num_tokens:(rank + 1) * num_tokens].clone()


@ep_reduce_scatter.register_fake
def _(partial, world_size, rank):
    return partial.new_empty((partial.shape[0] // world_size, *partial.shape[1:]))


# --- routing ----------------------------------------------------------------------------
def dense_routing(top_k_weights: torch.Tensor, top_k_index: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
    """[T, K] weights and expert ids -> [T, num_experts], 0 where a token skips an expert."""
    dense = top_k_weights.new_zeros(top_k_weights.shape[0], num_experts)
    return dense.scatter(1, top_k_index, top_k_weights)


class RoutedExperts(nn.Module):
    """``num_local_experts`` gated MLP experts stored as 3D tensors (HF's layout):
    gate_up_proj [E_local, 2 * I, H] (gate rows first), down_proj [E_local, H, I].

    ``first_expert``: global id of local expert 0 (expert parallel shards contiguously).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, activation) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = activation
        self.first_expert = 0
        self.ep_rank, self.ep_size = 0, 1

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def shard(self, ep_rank: int, ep_size: int) -> None:
        """Keep only this rank's contiguous slice of experts (expert parallel)."""
        if self.num_experts % ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the "
                             f"data-parallel size {ep_size}: experts are split evenly")
        per_rank = self.num_experts // ep_size
        start = ep_rank * per_rank
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.data[start:start + per_rank].clone(),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.data[start:start + per_rank].clone(),
                                      requires_grad=False)
        self.first_expert, self.ep_rank, self.ep_size = start, ep_rank, ep_size

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing [T, num_experts] (dense) -> sum of local experts' outputs [T, H]."""
        out = torch.zeros_like(x)
        # NOTE: experts in ascending id, each added once, as HF's index_add loop does; a
        # token that skipped an expert adds an exact 0.
        for e in range(self.num_local_experts):
            gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act(gate) * up, self.down_proj[e])        # [T, H]
            out = out + (y * routing[:, self.first_expert + e, None]).to(x.dtype)
        return out


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> int:
    """Shard every RoutedExperts of ``model`` across ``ep_size`` ranks; returns how many."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for m in experts:
        m.shard(ep_rank, ep_size)
    return len(experts)
