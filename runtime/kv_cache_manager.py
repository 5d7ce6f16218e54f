"""Paged KV cache bookkeeping: one block pool and one block list per KV cache group."""

from __future__ import annotations

from rung.core.kv_cache_spec import KVCacheGroup

NULL_BLOCK = 0  # never allocated; pad rows and unused block-table entries point here


class BlockPool:
    """Free list of block ids 1..num_blocks-1 (block 0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, f"a pool needs the null block and one more, got {num_blocks}"
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self._free), f"allocating {count} of {len(self._free)} free blocks"
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(b for b in reversed(block_ids) if b != NULL_BLOCK)


class KVCacheManager:
    """Blocks per request per group. Every group tracks the same tokens, so each gets the
    same number of blocks; page sizes differ by spec."""

    def __init__(self, groups: list[KVCacheGroup], num_blocks: int) -> None:
        self.groups = groups
        self.block_size = groups[0].spec.block_size
        assert all(g.spec.block_size == self.block_size for g in groups), "one block size"
        self.pools = [BlockPool(num_blocks) for _ in groups]
        self.req_blocks: dict[str, list[list[int]]] = {}

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_blocks - 1 for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free for p in self.pools)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's blocks to hold ``num_tokens``; all groups or none."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            blocks = self.req_blocks[request_id] = [[] for _ in self.groups]
        extra = -(-num_tokens // self.block_size) - len(blocks[0])
        if extra <= 0:          # the common decode step: the last block has room
            return True
        if any(pool.num_free < extra for pool in self.pools):
            return False
        for pool, group_blocks in zip(self.pools, blocks):
            group_blocks.extend(pool.allocate(extra))
        return True

    def free(self, request_id: str) -> None:
        for pool, group_blocks in zip(self.pools, self.req_blocks.pop(request_id, [])):
            pool.free(group_blocks)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """One block list per group."""
        return self.req_blocks[request_id]
