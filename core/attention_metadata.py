"""CommonAttentionMetadata: what every attention backend reads, one per KV cache group."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.errors import ContractError

# NOTE: the slot of a pad token: a KV write to it changes no live block (the Triton kernel
# masks the store; the torch reference redirects it to the null block).
PAD_SLOT_ID = -1


@dataclasses.dataclass
class CommonAttentionMetadata:
    """Views of persistent buffers, sliced by a descriptor.

    Request-indexed tensors have ``num_reqs_padded`` rows; token-indexed ones
    ``num_tokens_padded``. Pad rows hold the safe values of the descriptor contract.
    """

    desc: BatchExecutionDescriptor
    query_start_loc: torch.Tensor  # [num_reqs_padded + 1] int32, non-decreasing, flat over pads
    seq_lens: torch.Tensor         # [num_reqs_padded] int32, 0 for pads
    block_table: torch.Tensor      # [num_reqs_padded, max_blocks_per_req] int32, pads -> null block
    slot_mapping: torch.Tensor     # [num_tokens_padded] int64, PAD_SLOT_ID for pads
    block_size: int
    max_query_len: int             # real; under a graph the captured bound
    max_seq_len: int               # real in eager; max_model_len under a FULL graph

    @property
    def common(self) -> CommonAttentionMetadata:
        """A backend that needs nothing more hands its layers this object itself
        (see AttentionMetadata)."""
        return self

    @property
    def num_reqs(self) -> int:
        return self.desc.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.desc.num_tokens


class AttentionMetadata(Protocol):
    """What a backend's metadata builder returns for one attention group: whatever the
    backend's kernels need, and the group's CommonAttentionMetadata as ``common``."""

    @property
    def common(self) -> CommonAttentionMetadata: ...


def validate(meta: CommonAttentionMetadata, check_values: bool = True) -> None:
    """ContractError unless one group's metadata keeps the descriptor contract (failure
    classes 1 and 4).

    Shape checks are free; value checks sync with the host and run in tests and under
    ``--debug-padding``.
    """
    desc = meta.desc
    rows = meta.block_table.shape[0]
    if not rows == meta.query_start_loc.shape[0] - 1 == meta.seq_lens.shape[0]:
        raise ContractError(
            f"block_table rows {rows}, query_start_loc batch {meta.query_start_loc.shape[0] - 1} "
            f"and seq_lens {meta.seq_lens.shape[0]} disagree (batch_size must be equal to "
            "batch_size_k)")
    _require(rows == desc.num_reqs_padded, f"attention metadata has {rows} request rows, "
             f"descriptor says {desc.num_reqs_padded}")
    _require(meta.slot_mapping.shape[0] == desc.num_tokens_padded,
             f"slot_mapping has {meta.slot_mapping.shape[0]} tokens, descriptor says "
             f"{desc.num_tokens_padded}")
    if check_values:
        _validate_values(meta)


def _validate_values(meta: CommonAttentionMetadata) -> None:
    qsl = meta.query_start_loc.cpu()
    seq_lens = meta.seq_lens.cpu()
    slots = meta.slot_mapping.cpu()
    n, n_tok = meta.desc.num_reqs, meta.desc.num_tokens
    _require(int(qsl[0]) == 0 and bool((qsl[1:] >= qsl[:-1]).all()), "query_start_loc decreases")
    _require(int(qsl[n]) == n_tok, f"query_start_loc[{n}]={int(qsl[n])} != num_tokens {n_tok}")
    _require(bool((qsl[n:] == n_tok).all()), "pad rows of query_start_loc must be flat")
    _require(bool((seq_lens[n:] == 0).all()), "pad rows must have seq_len 0")
    _require(bool((seq_lens[:n] >= (qsl[1:n + 1] - qsl[:n])).all()),
             "seq_len shorter than query")
    _require(bool((slots[n_tok:] == PAD_SLOT_ID).all()),
             f"pad tokens must have slot {PAD_SLOT_ID}")
    if n < meta.block_table.shape[0]:
        pad_blocks = meta.block_table[n:].cpu()
        live = meta.block_table[:n].cpu()
        live_ids = set(live[live > 0].tolist())
        stale = live_ids & set(pad_blocks.flatten().tolist())
        _require(not stale, f"pad block-table rows point at live blocks {sorted(stale)[:8]}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)
