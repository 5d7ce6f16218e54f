"""The descriptor contract itself: failure classes 1 and 4, and the descriptor invariants."""

import numpy as np
import pytest
import torch

from rung.core.attention_metadata import CommonAttentionMetadata, validate
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.errors import ContractError
from rung.core.graph_mode import CUDAGraphMode
from rung.kernels.backend import AttentionLayerSpec
from rung.kernels.torch_backend import TorchAttentionImpl
from rung.runtime.sampling_params import SamplingParams
from rung.runtime.sched.kv_cache_manager import NULL_BLOCK
from rung.runtime.sched.request import Request
from rung.runtime.sched.scheduler import ScheduledRequest, SchedulerOutput
from rung.runtime.worker.input_batch import InputBatch

BLOCK_SIZE, MAX_BLOCKS = 4, 8


def _batch(num_groups: int = 2) -> InputBatch:
    return InputBatch(max_num_reqs=8, max_num_tokens=32, max_blocks_per_req=MAX_BLOCKS,
                      num_kv_groups=num_groups, block_size=BLOCK_SIZE,
                      device=torch.device("cpu"))


def _decode_step(num_reqs: int, num_groups: int = 2) -> tuple[SchedulerOutput, list]:
    """num_reqs requests decoding one token each; in group g request i owns blocks
    10i+2g+1 and 10i+2g+2."""
    scheduled, block_ids = [], []
    for i in range(num_reqs):
        req = Request(f"r{i}", None, list(range(3, 9)), SamplingParams(), None, i)
        req.num_computed_tokens = 5
        scheduled.append(ScheduledRequest(req, 1))
        block_ids.append([[10 * i + 2 * g + 1, 10 * i + 2 * g + 2] for g in range(num_groups)])
    return SchedulerOutput(scheduled, num_reqs, [], [], block_ids, [1] * num_reqs, 1), block_ids


def test_pad_rows_are_rewritten_after_poison_for_every_group():
    """Failure class 4: stale pad rows of static buffers must never reach a replay."""
    batch = _batch()
    batch.poison(np.random.default_rng(0), vocab_size=100, num_blocks=64)
    sched, block_ids = _decode_step(3)
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 3, 8, 3, 8, 1)
    commons = batch.prepare(sched, block_ids, desc, max_model_len=32).commons
    assert {(m.max_query_len, m.max_seq_len) for m in commons} == {(1, 32)}   # decode graph's
    assert len(commons) == 2
    for group, meta in enumerate(commons):
        validate(meta)
        assert meta.block_table.shape == (8, MAX_BLOCKS)
        assert (meta.block_table[3:] == NULL_BLOCK).all()
        assert (meta.seq_lens[3:] == 0).all() and (meta.query_start_loc[3:] == 3).all()
        assert (meta.slot_mapping[3:] == -1).all()
        first_block = 10 * 0 + 1 + 2 * group
        # position 5 of request 0 lives in its second block, offset 1
        assert int(meta.slot_mapping[0]) == (first_block + 1) * BLOCK_SIZE + 1
    assert (batch.input_ids.np[3:8] == 0).all() and (batch.positions.np[3:8] == 0).all()


def test_eager_metadata_has_exactly_the_real_rows():
    batch = _batch(num_groups=1)
    sched, block_ids = _decode_step(3, num_groups=1)
    desc = BatchExecutionDescriptor.eager(3, 3, 1)
    (meta,) = batch.prepare(sched, block_ids, desc, max_model_len=32).commons
    assert (meta.max_query_len, meta.max_seq_len) == (1, 6)
    validate(meta)
    assert meta.block_table.shape[0] == meta.seq_lens.shape[0] == 3


def _meta(num_rows: int, block_table_rows: int) -> CommonAttentionMetadata:
    desc = BatchExecutionDescriptor.eager(num_rows, num_rows, 1)
    return CommonAttentionMetadata(
        desc, torch.arange(num_rows + 1, dtype=torch.int32),
        torch.full((num_rows,), 4, dtype=torch.int32),
        torch.ones(block_table_rows, 2, dtype=torch.int32),
        torch.zeros(num_rows, dtype=torch.int64), BLOCK_SIZE, 1, 4)


def test_block_table_left_at_the_padded_batch_is_caught():
    """Failure class 1: a per-group block table of num_reqs_padded rows next to an
    unpadded query_start_loc is FlashAttention's 'batch_size must be equal to batch_size_k'."""
    meta = _meta(num_rows=3, block_table_rows=8)
    with pytest.raises(ContractError, match="batch_size must be equal to batch_size_k"):
        validate(meta)
    impl = TorchAttentionImpl(AttentionLayerSpec(2, 1, 4, 0.5))
    q = torch.zeros(3, 2, 4)
    kv = torch.zeros(2, 4, BLOCK_SIZE, 1, 4)
    with pytest.raises(ContractError, match="batch_size must be equal to batch_size_k"):
        impl.forward(q, torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), kv, meta, torch.empty_like(q))


@pytest.mark.parametrize("fields, message", [
    ((CUDAGraphMode.NONE, 3, 4, 3, 4), "NONE never pads requests"),
    ((CUDAGraphMode.FULL, 5, 4, 5, 8), "num_reqs 5 > num_reqs_padded 4"),
    ((CUDAGraphMode.FULL, 2, 2, 9, 8), "num_tokens 9 > num_tokens_padded 8"),
    ((CUDAGraphMode.FULL_AND_PIECEWISE, 1, 1, 1, 1), "runtime mode"),
])
def test_descriptor_invariants(fields, message):
    with pytest.raises(ContractError, match=message):
        BatchExecutionDescriptor(*fields)
    with pytest.raises(ContractError, match="uniform query len 2"):
        BatchExecutionDescriptor(CUDAGraphMode.FULL, 3, 4, 5, 8, 2)
