"""Persistent input buffers, allocated once at the maximum size, sliced by descriptors: a
step's real rows written from the scheduler output, the contract's pad values, and the
padded inputs and attention metadata a forward reads (`StepInputs`)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from rung.core.attention_metadata import PAD_SLOT_ID, CommonAttentionMetadata
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.runtime.sched.kv_cache_manager import NULL_BLOCK
from rung.runtime.sched.scheduler import ScheduledRequest, SchedulerOutput


@dataclasses.dataclass
class BatchLayout:
    """What `prepare` learned about the real batch."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    logits_indices: np.ndarray   # [num_logits] int64: token rows whose logits are sampled
    num_logits_per_req: list[int]  # 0 (prefill chunk), 1, or 1 + num_spec_tokens


@dataclasses.dataclass
class StepInputs:
    """The padded batch as a forward reads it: views of the input buffers, sliced by the
    step's descriptor, valid until the next step writes them."""

    layout: BatchLayout
    input_ids: torch.Tensor        # [num_tokens_padded] int64, 0 on pads
    positions: torch.Tensor        # [num_tokens_padded] int64, 0 on pads
    commons: list[CommonAttentionMetadata]   # one per KV cache group
    logits_indices: torch.Tensor   # [num_logits] int64 on the device: rows sampled


class HostCopyFence:
    """Orders host writes of pinned buffers after the async copies that read them.

    NOTE: ``sync()`` copies pinned host memory with ``non_blocking=True``; writing that
    memory again before the copy ran would send the NEXT step's values. ``record()`` after
    the copies, ``wait()`` before any host write (vLLM's ``prepare_inputs_event``). A step
    that samples nothing (a chunk of a long prompt) has no other host sync to hide behind.
    """

    def __init__(self, device: torch.device) -> None:
        self._on_device = device.type != "cpu"
        self.event = None            # a torch.cuda.Event, made at the first record
        self._pending = False

    def record(self) -> None:
        if not self._on_device:
            return
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record()
        self._pending = True

    def wait(self) -> None:
        if self._pending:
            self.event.synchronize()
            self._pending = False


class HostDevicePair:
    """A numpy host buffer and the device tensor graphs read (the same memory on CPU).

    ``np`` waits for this pair's in-flight copy first, so no host write can race it;
    ``host`` is the same array without the wait, for a batch that waited on the fence its
    pairs share once before it writes them all (`prepare`, `pad`).
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, device: torch.device,
                 fence: HostCopyFence | None = None) -> None:
        # NOTE: pinned host memory on CUDA, so the per-step copy is truly asynchronous
        host = torch.from_numpy(np.zeros(shape, dtype=dtype))
        if device.type != "cpu":
            host = host.pin_memory()
        self.host = host.numpy()
        self._host = host
        self._on_device = device.type != "cpu"
        self.fence = fence if fence is not None else HostCopyFence(device)
        self.gpu = host if device.type == "cpu" else torch.empty_like(host, device=device)

    @property
    def np(self) -> np.ndarray:
        self.fence.wait()
        return self.host

    def sync(self, rows: int) -> None:
        """Copy the first ``rows`` to the device (nothing to do on CPU: same memory)."""
        if self._on_device:
            self.gpu[:rows].copy_(self._host[:rows], non_blocking=True)
            self.fence.record()


class PaddedBatch:
    """Persistent buffers of a batch, allocated once at the maximum size, and the
    contract's pad values: the target's InputBatch and the drafter's DraftBatch are both one.

    Rows [num_reqs, num_reqs_padded) and [num_tokens, num_tokens_padded) are pads: `pad()`
    writes their safe values, `poison()` and `poison_pads()` garble them in debug mode.
    """

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 num_kv_groups: int, block_size: int, device: torch.device,
                 decode_query_len: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.decode_query_len = decode_query_len     # 1, or 1 + k under spec decode
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        self.device = device
        self.copy_fence = HostCopyFence(device)      # shared: one event per step
        # False: host and device buffers are one memory (no copy, no fence to wait on)
        self.on_device = device.type != "cpu"
        pair = lambda shape, dt: HostDevicePair(shape, dt, device, self.copy_fence)
        self.input_ids = pair((max_num_tokens,), np.int64)        # [max_num_tokens]
        self.positions = pair((max_num_tokens,), np.int64)        # [max_num_tokens]
        self.query_start_loc = pair((max_num_reqs + 1,), np.int32)  # [max_num_reqs + 1]
        self.seq_lens = pair((max_num_reqs,), np.int32)           # [max_num_reqs]
        self.block_tables = [pair((max_num_reqs, max_blocks_per_req), np.int32)
                             for _ in range(num_kv_groups)]       # per group
        self.slot_mappings = [pair((max_num_tokens,), np.int64)
                              for _ in range(num_kv_groups)]      # per group, PAD_SLOT_ID pads
        self._num_reqs = self._num_tokens = 0       # the real rows written last
        # a block-table row cache (InputBatch): a key per row, None where not vouched for
        self._row_keys: list[tuple | None] = [None] * max_num_reqs

    def poison(self, rng: np.random.Generator, vocab_size: int, num_blocks: int) -> None:
        """Fill every buffer with garbage, so a pad value `pad()` forgets shows up."""
        self.input_ids.np[:] = rng.integers(0, vocab_size, self.max_num_tokens)
        self.positions.np[:] = rng.integers(0, 1 << 20, self.max_num_tokens)
        self.query_start_loc.np[:] = rng.integers(0, 1 << 20, self.max_num_reqs + 1)
        self.seq_lens.np[:] = rng.integers(1, 1 << 20, self.max_num_reqs)
        rows = self._poisonable_block_rows()
        for bt in self.block_tables:
            bt.np[rows] = rng.integers(1, max(num_blocks, 2), bt.np[rows].shape)
        for sm in self.slot_mappings:
            sm.np[:] = rng.integers(0, 1 << 20, self.max_num_tokens)

    def _poisonable_block_rows(self) -> slice | list[int]:
        """Block-table rows `poison()` may garble: all of them, unless a cache vouches."""
        return slice(None)

    def poison_pads(self, desc: BatchExecutionDescriptor, generator: torch.Generator,
                    vocab_size: int, max_position: int) -> None:
        """Garbage into the device rows of pad tokens, as a replay of ``desc`` reads them:
        real outputs must not change."""
        t, t_pad = desc.num_tokens, desc.num_tokens_padded
        if t_pad > t:
            self.input_ids.gpu[t:t_pad] = torch.randint(0, vocab_size, (t_pad - t,),
                                                        generator=generator)
            self.positions.gpu[t:t_pad] = torch.randint(0, max_position, (t_pad - t,),
                                                        generator=generator)

    def pad(self, desc: BatchExecutionDescriptor) -> None:
        """Write the contract's safe values into pad rows and copy to the device."""
        n, n_pad = desc.num_reqs, desc.num_reqs_padded
        t, t_pad = desc.num_tokens, desc.num_tokens_padded
        if (n, t) != (self._num_reqs, self._num_tokens):
            raise RuntimeError(f"pad() for a batch of {n} requests / {t} tokens, but the "
                               f"prepared batch has {self._num_reqs} / {self._num_tokens}")
        if self.on_device:
            self.copy_fence.wait()
        if n_pad > n:
            self._row_keys[n:n_pad] = [None] * (n_pad - n)   # rows this overwrites
            self.query_start_loc.host[n + 1:n_pad + 1] = t    # zero-length pads keep it flat
            self.seq_lens.host[n:n_pad] = 0
            for bt in self.block_tables:
                bt.host[n:n_pad] = NULL_BLOCK
        if t_pad > t:
            self.input_ids.host[t:t_pad] = 0
            self.positions.host[t:t_pad] = 0
            for sm in self.slot_mappings:
                sm.host[t:t_pad] = PAD_SLOT_ID
        if not self.on_device:          # NOTE: the device reads the host memory itself
            return
        self.input_ids.sync(t_pad)
        self.positions.sync(t_pad)
        self.query_start_loc.sync(n_pad + 1)
        self.seq_lens.sync(n_pad)
        for bt, sm in zip(self.block_tables, self.slot_mappings):
            bt.sync(n_pad)
            sm.sync(t_pad)

    def inputs(self, desc: BatchExecutionDescriptor, layout: BatchLayout,
               max_model_len: int) -> StepInputs:
        """The padded batch of ``desc`` (written and padded) as its forward reads it.

        NOTE: a FULL graph replays for every later batch of its size: its kernels read up
        to max_model_len keys, and size their query tiles (FA picks its decode path) by
        1 or 1 + k per request for a uniform decode / verify graph, else by all tokens.
        """
        lens = (layout.max_query_len, layout.max_seq_len)
        if desc.mode == CUDAGraphMode.FULL:
            q = self.decode_query_len
            lens = (q if desc.uniform_query_len == q else desc.num_tokens_padded,
                    max_model_len)
        t_pad = desc.num_tokens_padded
        rows = torch.from_numpy(layout.logits_indices).to(self.device, non_blocking=True)
        return StepInputs(layout, self.input_ids.gpu[:t_pad], self.positions.gpu[:t_pad],
                          self.metadata_views(desc, *lens), rows)

    def metadata_views(self, desc: BatchExecutionDescriptor, max_query_len: int,
                       max_seq_len: int) -> list[CommonAttentionMetadata]:
        """One CommonAttentionMetadata per KV cache group, views sliced by ``desc``."""
        n_pad, t_pad = desc.num_reqs_padded, desc.num_tokens_padded
        return [CommonAttentionMetadata(desc, self.query_start_loc.gpu[:n_pad + 1],
                                        self.seq_lens.gpu[:n_pad], bt.gpu[:n_pad],
                                        sm.gpu[:t_pad], self.block_size, max_query_len,
                                        max_seq_len)
                for bt, sm in zip(self.block_tables, self.slot_mappings)]


class InputBatch(PaddedBatch):
    """The target model's batch: `prepare` writes the real rows of a scheduler output."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 num_kv_groups: int, block_size: int, device: torch.device,
                 decode_query_len: int = 1) -> None:
        super().__init__(max_num_reqs, max_num_tokens, max_blocks_per_req, num_kv_groups,
                         block_size, device, decode_query_len)
        self._arange = np.arange(max(max_num_reqs, max_num_tokens))   # read-only

    def _poisonable_block_rows(self) -> list[int]:
        """NOTE: block-table rows the row cache vouches for are left as they are: debug mode
        must not repair state production relies on (a stale cached row has to show up
        here exactly as it would in production; `check_block_rows` then names it)."""
        return [i for i, key in enumerate(self._row_keys) if key is None]

    def check_block_rows(self, block_ids: list[list[list[int]]]) -> None:
        """Debug check: every real row holds exactly its request's blocks, then nulls."""
        for i, req_blocks in enumerate(block_ids):
            for g, (table, blocks) in enumerate(zip(self.block_tables, req_blocks)):
                row = table.np[i]
                if row[:len(blocks)].tolist() != blocks or row[len(blocks):].any():
                    raise AssertionError(f"block-table row {i} (group {g}) holds "
                                         f"{row[:len(blocks) + 1].tolist()}..., its request "
                                         f"owns {blocks}")

    def prepare(self, sched: SchedulerOutput, block_ids: list[list[list[int]]],
                desc: BatchExecutionDescriptor, max_model_len: int) -> StepInputs:
        """The step's inputs in one call: write the real rows of ``sched``
        (``block_ids[i][g]``: request i's blocks in group g), pad them to ``desc`` (its
        dispatched descriptor), hand back what its forward reads."""
        layout = self.write(sched, block_ids)
        self.pad(desc)
        return self.inputs(desc, layout, max_model_len)

    def write(self, sched: SchedulerOutput, block_ids: list[list[list[int]]]) -> BatchLayout:
        """Write the real rows. ``block_ids[i][g]``: request i's blocks in group g."""
        num_reqs, num_tokens = len(sched.scheduled), sched.num_tokens
        if num_reqs > self.max_num_reqs or num_tokens > self.max_num_tokens:
            raise RuntimeError(f"batch of {num_reqs} requests / {num_tokens} tokens exceeds "
                               f"buffers {self.max_num_reqs} / {self.max_num_tokens}")
        if self.on_device:              # NOTE: once: every write below is after it
            self.copy_fence.wait()
        counts = np.array(sched.num_new_tokens, dtype=np.int64)
        starts = np.array([s.request.num_computed_tokens for s in sched.scheduled],
                          dtype=np.int64)
        qsl = self.query_start_loc.host
        qsl[0] = 0
        np.cumsum(counts, out=qsl[1:num_reqs + 1])
        self.seq_lens.host[:num_reqs] = starts + counts
        if num_tokens == num_reqs:          # one token each (decode, or a 1-token chunk)
            self.input_ids.host[:num_tokens] = [
                s.request.token_ids[s.request.num_computed_tokens] for s in sched.scheduled]
        else:
            self.input_ids.host[:num_tokens] = list(
                itertools.chain.from_iterable(_step_tokens(s) for s in sched.scheduled))
        self._write_block_rows(sched, block_ids)
        if num_tokens == num_reqs:          # token i is request i's token at its start
            req_of_token, positions = self._arange[:num_reqs], starts
        else:
            req_of_token = np.repeat(self._arange[:num_reqs], counts)   # [num_tokens]
            positions = (self._arange[:num_tokens] - qsl[req_of_token]
                         + starts[req_of_token])
        self.positions.host[:num_tokens] = positions
        for g, bt in enumerate(self.block_tables):
            block = bt.host[req_of_token, positions // self.block_size].astype(np.int64)
            offset = positions % self.block_size
            self.slot_mappings[g].host[:num_tokens] = block * self.block_size + offset
        self._num_reqs, self._num_tokens = num_reqs, num_tokens
        return self._layout(sched, counts, qsl)

    def _write_block_rows(self, sched: SchedulerOutput,
                          block_ids: list[list[list[int]]]) -> None:
        """Rewrite a block-table row only when its request or block count changed."""
        keys, tables = self._row_keys, self.block_tables
        for i, (s, req_blocks) in enumerate(zip(sched.scheduled, block_ids)):
            req = s.request
            # NOTE: the arrival index never repeats (a request id may be reused once its
            # request finished); a preempted request gets new blocks, so its preemption
            # count is part of the key; the KV cache manager also gives a request's block
            # lists a new version whenever an entry changes without the count changing
            # (sliding-window blocks freed to the null block). pad() clears the keys of
            # rows it overwrites.
            key = (req.arrival, req.num_preemptions, len(req_blocks[0]),
                   getattr(req_blocks, "version", None))
            if keys[i] == key:
                continue
            for table, blocks in zip(tables, req_blocks):
                row = table.host[i]
                row[:len(blocks)] = blocks
                row[len(blocks):] = NULL_BLOCK
            keys[i] = key

    def prepare_empty(self) -> BatchLayout:
        """A batch of no real request (graph capture)."""
        self.query_start_loc.np[0] = 0
        self._num_reqs = self._num_tokens = 0
        return self.prepare_empty_layout()

    @staticmethod
    def prepare_empty_layout() -> BatchLayout:
        """The layout of a batch of no real request, writing no buffer."""
        return BatchLayout(0, 0, 0, 0, np.zeros(0, np.int64), [])

    def _layout(self, sched: SchedulerOutput, counts: np.ndarray, qsl: np.ndarray) -> BatchLayout:
        num_reqs = len(sched.scheduled)
        num_logits = [(1 + s.num_spec_tokens) if s.samples else 0 for s in sched.scheduled]
        ends = qsl[1:num_reqs + 1].astype(np.int64)
        if all(n == 1 for n in num_logits):                          # plain decode / prefill
            logits_indices = ends - 1                                 # [num_reqs]
        else:
            # the last num_logits[i] token rows of request i, all requests at once
            per_req = np.asarray(num_logits, dtype=np.int64)        # [num_reqs]
            first = np.repeat(ends - per_req, per_req)
            within = np.arange(int(per_req.sum())) - np.repeat(np.cumsum(per_req) - per_req,
                                                                per_req)
            logits_indices = first + within                          # [num_logits]
        return BatchLayout(num_reqs, sched.num_tokens, int(counts.max(initial=0)),
                           int(self.seq_lens.host[:num_reqs].max(initial=0)), logits_indices,
                           num_logits)


def _step_tokens(s: ScheduledRequest) -> list[int]:
    """The token ids one scheduled request runs this step, drafts last."""
    req = s.request
    first = req.num_computed_tokens
    known = req.token_ids[first:first + s.num_new_tokens - s.num_spec_tokens]
    return known + req.spec_token_ids if s.num_spec_tokens else known
