"""BlockPool: the blocks of one KV cache group, their ref counts, the LRU queue of free
blocks and the hash -> block map of cached full blocks (see kv_cache_manager)."""

from __future__ import annotations

import collections

NULL_BLOCK = 0  # never allocated nor cached; pad rows and freed entries point here


class BlockPool:
    """Blocks 1..num_blocks-1 of one KV cache group (block 0 is the null block): ref counts,
    an LRU queue of free blocks, and the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV block pool needs the null block and one more, "
                             f"got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}               # hash -> block id
        # NOTE: insertion order is eviction order: the front is handed out first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b, None) for b in range(1, num_blocks))
        self.num_cached_free = 0                          # free blocks that keep a hash
        self.num_evicted = 0                              # cached blocks handed out again

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out, cached ones (evictable) included."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"allocating {count} of {len(self._free)} free KV blocks")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for b in blocks:
            self._evict(b)
            self.ref_cnt[b] = 1
        return blocks

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            self.num_cached_free -= 1
            self.num_evicted += 1
            if self.cached.get(h) == block:
                del self.cached[h]

    def touch(self, block: int) -> None:
        """One more request holds ``block`` (a prefix-cache hit)."""
        if self.ref_cnt[block] == 0:
            del self._free[block]
            self.num_cached_free -= 1          # only hashed blocks are found by a lookup
        self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks`` (null entries skipped). Pass them last
        block first: a chain's tail is evicted before its head."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] > 0:
                continue
            self._free[b] = None
            if self.block_hash[b] is None:
                self._free.move_to_end(b, last=False)     # nothing to keep: reuse first
            else:
                self.num_cached_free += 1

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block. A second block with the same contents stays private."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def reset_cache(self) -> None:
        """Forget every cached hash; only valid while no block is held."""
        if self.num_used:
            raise RuntimeError(f"resetting the prefix cache while {self.num_used} KV blocks "
                               "are held")
        self.block_hash = [None] * self.num_blocks
        self.cached.clear()
        self.num_cached_free = 0
