"""Pinned host buffers are never written while their async copy may be in flight.

On CPU the pairs of an engine's InputBatch are turned into a twin of the CUDA layout: a
separate "device" tensor per pair, and a copy fence whose event logs record/wait. Every
host write must come after the wait that follows the last record.
"""

import numpy as np
import torch

from rung.runtime import LLM, SamplingParams
from rung.runtime.worker.input_batch import HostCopyFence, HostDevicePair


class _LoggedArray(np.ndarray):
    log: list

    def __setitem__(self, key, value):
        self.log.append("write")
        super().__setitem__(key, value)


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


def _pairs(input_batch) -> list[HostDevicePair]:
    ib = input_batch
    return [ib.input_ids, ib.positions, ib.query_start_loc, ib.seq_lens,
            *ib.block_tables, *ib.slot_mappings]


def _instrument(input_batch, log: list) -> None:
    fence = input_batch.copy_fence
    fence._on_device, fence.event = True, _FakeEvent(log)
    input_batch.on_device = True
    logged = type("Logged", (_LoggedArray,), {"log": log})
    for pair in _pairs(input_batch):
        assert pair.fence is fence
        pair._on_device = True
        pair.gpu = pair._host.clone()        # the "device" copy: other memory than the host
        pair.host = pair.host.view(logged)


def _first_violation(log: list) -> int | None:
    """Index of a host write made while a recorded copy was not waited for."""
    pending = False
    for i, entry in enumerate(log):
        if entry == "record":
            pending = True
        elif entry == "wait":
            pending = False
        elif pending:
            return i
    return None


def _run(instrumented: bool) -> tuple[list[int], list]:
    # NOTE: a prompt over 2x the token budget gives chunked-prefill steps in a row that
    # sample nothing, so no logits copy or .tolist() syncs the host between them.
    # NOTE: CPU even on a CUDA machine: the twin's "device" tensors are CPU clones
    llm = LLM("tiny-llama", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128,
              enforce_eager=True, device="cpu")
    log: list = []
    if instrumented:
        _instrument(llm.engine.runner.input_batch, log)
    prompt = list(range(3, 60))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)
    return out[0].outputs[0].token_ids, log


def test_host_writes_wait_for_the_copies_of_the_previous_step():
    tokens, log = _run(instrumented=True)
    assert log.count("record") >= 4 and log.count("wait") >= 4
    assert "write" in log[log.index("record"):]      # later steps did write the buffers
    bad = _first_violation(log)
    assert bad is None, f"host write at log[{bad}] before waiting: {log[max(0, bad - 5):bad + 1]}"
    assert tokens == _run(instrumented=False)[0]     # the "device" copies carried every value


def test_fence_is_a_no_op_on_cpu():
    fence = HostCopyFence(torch.device("cpu"))
    fence.record()
    fence.wait()
    assert fence.event is None
    pair = HostDevicePair((4,), np.int64, torch.device("cpu"))
    pair.np[:] = 7
    assert pair.gpu.tolist() == [7, 7, 7, 7]           # same memory, no copy
