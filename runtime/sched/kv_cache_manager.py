"""Paged KV cache bookkeeping: one block pool and one block list per KV cache group,
automatic prefix caching, and sliding-window blocks freed as they leave the window.

Prefix caching (vLLM's automatic prefix caching, by hashed full blocks):
- a block is *full* when all ``block_size`` of its tokens are computed (their KV written and,
  under speculative decoding, verified). Only full blocks get a hash, chained over the
  tokens of every block before them, so a hash names the whole prefix up to its block end.
  A full block is never written again, so sharing it is safe; the block a request still
  writes into is never full, never hashed, never shared.
- each group's pool maps hash -> block. A new (or preempted) request takes the longest
  chain of cached blocks that every group can serve, and computes only the rest.
- freed blocks go to an LRU free queue; a hashed one keeps its hash (and stays a hit)
  until it is handed out again (evicted). Blocks without a hash are handed out first.

Sliding-window groups keep only the blocks a later query can still see: a target query at
position p reads keys > p - W, the MTP drafter reads one key more (> p - W - 1). Blocks
wholly before ``num_computed_tokens - W`` are freed and their block-table entries point at
the null block, which attention masks out as it does every key outside the window.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import logging
import sys

import numpy as np

from rung.core.kv_cache_spec import KVCacheGroup
from rung.runtime.sched.block_pool import NULL_BLOCK, BlockPool

logger = logging.getLogger(__name__)

class RequestBlocks(list):
    """One block list per KV cache group, and a ``version`` that changes (to a value
    never used before, by any request) whenever one of the lists changes, so a block-table
    row written for one version is stale for every other."""

    version: int


@dataclasses.dataclass
class PrefixCacheStats:
    num_requests: int = 0        # admissions that looked the cache up
    num_query_tokens: int = 0    # tokens those requests had
    num_hit_tokens: int = 0      # tokens served from the cache (not computed)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / max(self.num_query_tokens, 1)


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block: chained over its parent's hash, so it names the whole prefix.
    Nothing but the tokens changes a block's KV in rung (one model per engine; each group
    has its own map), so nothing else enters the hash."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class KVCacheManager:
    """Blocks per request per group. Every group tracks the same tokens, so each group's
    list has the same length; page sizes differ by spec. Sliding-window groups free
    blocks that left the window (their entries become ``NULL_BLOCK``)."""

    def __init__(self, groups: list[KVCacheGroup], num_blocks: int,
                 enable_prefix_caching: bool = True) -> None:
        self.groups = groups
        self.block_size = groups[0].spec.block_size
        if any(g.spec.block_size != self.block_size for g in groups):
            raise ValueError("every KV cache group must use one block size, got "
                             f"{[g.spec.block_size for g in groups]}")
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(num_blocks) for _ in groups]
        # per group: keys a later query may still read behind num_computed_tokens
        # (W for a window of W: the target reads W - 1 keys back, the MTP drafter W)
        self.lookback = [g.spec.sliding_window for g in groups]
        self.req_blocks: dict[str, RequestBlocks] = {}
        self._num_cached: dict[str, int] = {}            # leading blocks already hashed
        self._num_skipped: dict[str, list[int]] = {}     # per group: leading null entries
        self._versions = itertools.count(1)
        self.prefix_stats = PrefixCacheStats()
        self._pending_query: dict[str, tuple[int, int]] = {}   # looked up, not yet admitted
        # NOTE: what lets a step skip the manager for a request whose step stays inside
        # its last block (the common decode step): read by the scheduler and by
        # Request.commit, written here alone
        self.num_slots: dict[str, int] = {}     # request id -> tokens its blocks hold
        # request id -> the num_computed_tokens from which advance() has work (a block to
        # hash, a sliding-window block to free); below it advance() would do nothing
        self.advance_at: dict[str, int] = {}

    # --- counts -----------------------------------------------------------------------
    # NOTE: every group's pool has the same number of blocks and a request needs blocks
    # in every group, so the counts are per group, not sums: total is what one group
    # holds, free what the fullest group has left (free + used == total).
    @property
    def num_total_blocks(self) -> int:
        """Blocks in each group's pool (the null block aside)."""
        return self.pools[0].num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can still be handed out in every group, evictable cached ones
        included."""
        return min(p.num_free for p in self.pools)

    @property
    def num_cached_free_blocks(self) -> int:
        return min(p.num_cached_free for p in self.pools)

    @property
    def num_used_blocks(self) -> int:
        return max(p.num_used for p in self.pools)

    def group_name(self, g: int) -> str:
        window = self.lookback[g]
        kind = "full attention" if window is None else f"sliding window {window}"
        return f"KV cache group {g} ({kind})"

    def group_stats(self) -> list[dict]:
        return [{"group": g, "sliding_window": self.lookback[g],
                 "total_blocks": pool.num_blocks - 1, "free_blocks": pool.num_free,
                 "used_blocks": pool.num_used, "cached_free_blocks": pool.num_cached_free}
                for g, pool in enumerate(self.pools)]

    def shortage(self, num_tokens: int) -> str:
        """Why ``num_tokens`` tokens of one request do not fit even alone: the group that
        needs the most blocks (a sliding window frees what left it), and what it holds."""
        num_blocks = -(-num_tokens // self.block_size)
        live = [num_blocks - self._first_needed(g, num_tokens) for g in range(len(self.pools))]
        g = max(range(len(live)), key=live.__getitem__)
        total = self.num_total_blocks
        return (f"{num_tokens} tokens need {live[g]} blocks of {self.block_size} tokens in "
                f"{self.group_name(g)}, which holds {total} blocks "
                f"({total * self.block_size} tokens)")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and the hit statistics (vLLM's `reset_prefix_cache`).
        Refused (False, with a warning) while requests hold blocks: their hashes are live."""
        num_used = self.num_used_blocks
        if num_used:
            logger.warning("prefix cache not reset: %d KV blocks are still held by requests",
                           num_used)
            return False
        for pool in self.pools:
            pool.reset_cache()
        self.prefix_stats = PrefixCacheStats()
        return True

    def blocks_held(self, request_id: str) -> list[int]:
        """Live (non-null) blocks the request holds, per group."""
        return [sum(b != NULL_BLOCK for b in blocks)
                for blocks in self.req_blocks.get(request_id, [[] for _ in self.groups])]

    # --- prefix caching -----------------------------------------------------------------
    def take_cached_prefix(self, req) -> int:
        """Give a request without blocks the longest cached prefix every group can serve.
        Returns the number of tokens it covers (a multiple of block_size); at least one
        token is always left to compute, so the first sampled token has logits. A request
        that already holds blocks keeps its ``num_computed_tokens``."""
        # NOTE: prompt_logprobs need every prompt position computed (as in vLLM)
        if (not self.enable_prefix_caching or req.num_computed_tokens
                or req.request_id in self.req_blocks or req.params.prompt_logprobs is not None):
            return req.num_computed_tokens
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        num_hit = self._num_hit_blocks(hashes)
        # NOTE: counted once the admission succeeds (allocate), not at every retry
        self._pending_query[req.request_id] = (len(req.token_ids), num_hit * self.block_size)
        if num_hit == 0:
            return 0
        blocks = self._new_blocks(req.request_id)
        for g, (pool, group_blocks) in enumerate(zip(self.pools, blocks)):
            first = self._first_needed(g, num_hit * self.block_size)
            group_blocks.extend([NULL_BLOCK] * first)
            self._num_skipped[req.request_id][g] = first
            for h in hashes[first:num_hit]:
                block = pool.lookup(h)
                pool.touch(block)
                group_blocks.append(block)
        self._num_cached[req.request_id] = num_hit
        self.num_slots[req.request_id] = len(blocks[0]) * self.block_size
        self._set_advance_at(req.request_id)
        return num_hit * self.block_size

    def _block_hashes(self, req, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first ``num_blocks`` blocks (kept on the request)."""
        return req.hash_blocks(num_blocks, self.block_size, hash_block)

    def _num_hit_blocks(self, hashes: list[bytes]) -> int:
        """Longest hit length that every group can serve. A full-attention group serves
        h blocks when blocks 0..h-1 are cached; a sliding group when the blocks a query at
        h * block_size can still read are. Lowering h for one group can break another
        sliding group's hit, so repeat until no group lowers it."""
        num_hit = len(hashes)
        while True:
            lowered = min(self._group_hit(g, hashes, num_hit) for g in range(len(self.pools)))
            if lowered == num_hit:
                return num_hit
            num_hit = lowered

    def _group_hit(self, g: int, hashes: list[bytes], limit: int) -> int:
        """Largest h <= limit such that group g holds cached blocks
        _first_needed(g, h) .. h-1."""
        cached = self.pools[g].cached
        best, run = 0, 0                    # run: consecutive cached blocks ending at i
        for i in range(limit):
            run = run + 1 if hashes[i] in cached else 0
            if run == 0 and self.lookback[g] is None:
                break                       # full attention needs an unbroken chain
            if run >= i + 1 - self._first_needed(g, (i + 1) * self.block_size):
                best = i + 1
        return best

    def _first_needed(self, g: int, num_tokens: int) -> int:
        """First block of group g that a query at position >= num_tokens may read."""
        lookback = self.lookback[g]
        if lookback is None:
            return 0
        return max(0, (num_tokens - lookback) // self.block_size)

    # --- per step -----------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold ``num_tokens``; all groups or none."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            blocks = self._new_blocks(request_id)
        extra = -(-num_tokens // self.block_size) - len(blocks[0])
        if extra > 0:           # else the common decode step: the last block has room
            if any(pool.num_free < extra for pool in self.pools):
                return False
            for pool, group_blocks in zip(self.pools, blocks):
                group_blocks.extend(pool.allocate(extra))
            blocks.version = next(self._versions)
            self.num_slots[request_id] = len(blocks[0]) * self.block_size
        if self._pending_query:
            self._record_query(request_id)
        return True

    def _record_query(self, request_id: str) -> None:
        query = self._pending_query.pop(request_id, None)
        if query is not None:
            self.prefix_stats.num_requests += 1
            self.prefix_stats.num_query_tokens += query[0]
            self.prefix_stats.num_hit_tokens += query[1]

    def advance(self, req) -> None:
        """The request's first ``num_computed_tokens`` tokens are now in the cache: hash
        the blocks that became full, and free sliding-window blocks that left the window."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks is None:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks[0]))
        if self.enable_prefix_caching and num_full > self._num_cached[req.request_id]:
            self._cache_full_blocks(req, blocks, num_full)
        changed = False
        for g, lookback in enumerate(self.lookback):
            if lookback is not None:
                changed |= self._free_skipped(req, g, blocks[g])
        if changed:
            blocks.version = next(self._versions)
        self._set_advance_at(req.request_id)

    def _set_advance_at(self, request_id: str) -> None:
        """When advance() next has work for the request: its next block fills (prefix
        caching), or a block of a sliding-window group leaves the window (_free_skipped
        frees block s + 1 once (n - lookback) // block_size > s)."""
        bs = self.block_size
        due = [(self._num_cached[request_id] + 1) * bs] if self.enable_prefix_caching else []
        skipped = self._num_skipped[request_id]
        due += [(skipped[g] + 1) * bs + lookback for g, lookback in enumerate(self.lookback)
                if lookback is not None]
        self.advance_at[request_id] = min(due, default=sys.maxsize)

    def _cache_full_blocks(self, req, blocks: RequestBlocks, num_full: int) -> None:
        first = self._num_cached[req.request_id]
        if num_full * self.block_size > len(req.token_ids):
            # NOTE: a block hashed over fewer tokens than it holds names the wrong prefix
            # for every block chained after it
            raise RuntimeError(f"request {req.request_id!r}: {num_full} full blocks of "
                               f"{self.block_size} tokens but only {len(req.token_ids)} "
                               "tokens are known: tokens must be committed before advance()")
        hashes = self._block_hashes(req, num_full)
        for pool, group_blocks in zip(self.pools, blocks):
            for i in range(first, num_full):
                if group_blocks[i] != NULL_BLOCK:
                    pool.cache(group_blocks[i], hashes[i])
        self._num_cached[req.request_id] = num_full

    def _free_skipped(self, req, g: int, group_blocks: list[int]) -> bool:
        """Free group g's blocks before the first one a later query may read."""
        skipped = self._num_skipped[req.request_id]
        first = min(self._first_needed(g, req.num_computed_tokens), len(group_blocks))
        if first <= skipped[g]:
            return False
        self.pools[g].free(group_blocks[skipped[g]:first][::-1])
        group_blocks[skipped[g]:first] = [NULL_BLOCK] * (first - skipped[g])
        skipped[g] = first
        return True

    def _new_blocks(self, request_id: str) -> RequestBlocks:
        blocks = self.req_blocks[request_id] = RequestBlocks([] for _ in self.groups)
        blocks.version = next(self._versions)
        self._num_cached[request_id] = 0
        self._num_skipped[request_id] = [0] * len(self.groups)
        self.num_slots[request_id] = 0
        self._set_advance_at(request_id)
        return blocks

    def free(self, request_id: str) -> None:
        """Release every block of the request (hashed ones stay cached until evicted)."""
        blocks = self.req_blocks.pop(request_id, None)
        self._pending_query.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._num_skipped.pop(request_id, None)
        self.num_slots.pop(request_id, None)
        self.advance_at.pop(request_id, None)
        for pool, group_blocks in zip(self.pools, blocks or []):
            pool.free(group_blocks[::-1])

    def block_ids(self, request_id: str) -> RequestBlocks:
        """One block list per group."""
        return self.req_blocks[request_id]

    # --- checks -------------------------------------------------------------------------
    def check_consistency(self) -> None:
        """Raise AssertionError unless every block is accounted for exactly once: ref
        counts equal the requests holding a block, free blocks have ref 0, the null block
        is never held, cached or free, and every cached hash maps to a block carrying it."""
        for g, pool in enumerate(self.pools):
            held = collections.Counter(b for blocks in self.req_blocks.values()
                                       for b in blocks[g] if b != NULL_BLOCK)
            assert NULL_BLOCK not in pool._free and pool.ref_cnt[NULL_BLOCK] == 0
            assert pool.block_hash[NULL_BLOCK] is None
            for b in range(1, pool.num_blocks):
                assert pool.ref_cnt[b] == held[b], (g, b, pool.ref_cnt[b], held[b])
                assert (pool.ref_cnt[b] == 0) == (b in pool._free), (g, b)
            assert all(pool.block_hash[b] == h for h, b in pool.cached.items())
            assert pool.num_cached_free == sum(pool.block_hash[b] is not None
                                               for b in pool._free)
            assert len(pool._free) + sum(1 for b in range(1, pool.num_blocks)
                                         if pool.ref_cnt[b]) == pool.num_blocks - 1
