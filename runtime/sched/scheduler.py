"""Continuous batching with chunked prefill, mixed batches, preemption by recompute."""

from __future__ import annotations

import collections
import dataclasses

from rung.runtime.sched.kv_cache_manager import KVCacheManager
from rung.runtime.sched.request import Request, RequestStatus


class ScheduledRequest:
    """One request's share of a step (a plain slotted class: built per request per step)."""

    __slots__ = ("request", "num_new_tokens", "num_spec_tokens", "samples")

    def __init__(self, request: Request, num_new_tokens: int, num_spec_tokens: int = 0) -> None:
        self.request = request
        self.num_new_tokens = num_new_tokens      # tokens to run this step, drafts included
        self.num_spec_tokens = num_spec_tokens    # drafts among them (verified this step)
        # whether this step yields a token: the chunk reaches the last known token
        self.samples = (request.num_computed_tokens + num_new_tokens - num_spec_tokens
                        >= len(request.token_ids))


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_tokens: int
    preempted: list[str]
    errored: list[Request]
    # block_ids[i][g]: scheduled request i's KV blocks in group g (the KV manager's lists)
    block_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # per scheduled request: its num_new_tokens (drafts included), in order
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)
    # the query length every scheduled request shares (decode: 1, or 1 + k), else None
    uniform_query_len: int | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput([], 0, [], [])
        allocate, num_slots, own = self.kv.allocate, self.kv.num_slots, []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:     # preempted earlier in this loop
                continue
            num_new = (self._num_new_tokens(req, budget) if req.spec_token_ids
                       else min(len(req.token_ids) - req.num_computed_tokens, budget))
            # NOTE: KV for every request's own tokens first; drafts only get blocks left
            # over after that (_fit_drafts), so they never preempt or error anyone.
            num_own = num_new - len(req.spec_token_ids)
            # NOTE: the common case (the last block has room) needs no allocation, and never
            # enters the preemption loop
            num_needed = req.num_computed_tokens + num_own
            if (num_needed <= num_slots.get(req.request_id, 0)
                    or allocate(req.request_id, num_needed)
                    or self._allocate_or_preempt(req, num_own, out)):
                own.append((req, num_own))
                budget -= num_new
        for req, num_own in own:
            num_spec = len(req.spec_token_ids)
            s = self._fit_drafts(req, num_own) if num_spec else ScheduledRequest(req, num_own)
            out.scheduled.append(s)
            budget += num_spec - s.num_spec_tokens      # drafts that did not fit
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            req.take_cached_prefix(self.kv.take_cached_prefix(req))   # prefix-cache hit
            num_new = self._num_new_tokens(req, budget)
            if not self.kv.allocate(req.request_id, req.num_computed_tokens + num_new):
                self.kv.free(req.request_id)           # gives a hit back; it stays cached
                req.take_cached_prefix(0)
                if not self.running:       # alone and still too big: it can never run
                    self.waiting.popleft()
                    out.errored.append(req)
                    continue
                break
            self.waiting.popleft()
            req.start()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, len(req.spec_token_ids)))
            budget -= num_new
        counts = out.num_new_tokens = [s.num_new_tokens for s in out.scheduled]
        out.num_tokens = sum(counts)
        # NOTE: n counts of at least 1 summing to n are all 1 (a decode step); else all at
        # most the first and summing to n times it are all equal to it
        if out.num_tokens == len(counts) or (counts and out.num_tokens == len(counts) * counts[0]
                                             and max(counts) == counts[0]):
            out.uniform_query_len = counts[0] if counts else None
        req_blocks = self.kv.req_blocks
        out.block_ids = [req_blocks[s.request.request_id] for s in out.scheduled]
        return out

    @staticmethod
    def _num_new_tokens(req: Request, budget: int) -> int:
        pending = len(req.token_ids) - req.num_computed_tokens
        if pending == 1 and req.spec_token_ids:
            # NOTE: drafts are verified whole or not at all, so a uniform batch stays uniform
            num_spec = len(req.spec_token_ids)
            if 1 + num_spec <= budget:
                return 1 + num_spec
            req.drop_drafts()
        return min(pending, budget)

    def _fit_drafts(self, req: Request, num_own: int) -> ScheduledRequest:
        """``req`` with as many of its drafts as the free KV blocks hold (maybe none).

        Drafts are optional work: under KV pressure they shrink instead of preempting or
        erroring a request, so speculation never changes which requests finish or how.
        """
        num_spec = len(req.spec_token_ids)
        while num_spec and not self.kv.allocate(
                req.request_id, req.num_computed_tokens + num_own + num_spec):
            num_spec -= 1
        req.drop_drafts(num_spec)
        return ScheduledRequest(req, num_own + num_spec, num_spec)

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(req.request_id, req.num_computed_tokens + num_new):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                self.running.remove(req)
                self.kv.free(req.request_id)
                out.errored.append(req)
                return False
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.preempt()
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.finish(reason, error)
