"""Which request holds which physical blocks: one block table per request.

Pure Python.  Allocation is on demand: a request's table grows only to cover
the tokens it has computed or is about to compute, so the internal waste of a
request is at most one partially filled block.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AllocationResult:
    """The blocks appended to a request's table by one `allocate_slots` call."""

    new_block_ids: list[int]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_fragmentation_waits = 0  # kept for parity with the contiguous layout: never counts here

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, max_total_tokens: int) -> int:
        """The most blocks a request of that length can ever hold."""
        return self.blocks_for_tokens(max_total_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, max_total_tokens: int | None = None
    ) -> AllocationResult | None:
        """Make the request's table cover `num_total_tokens` tokens.

        Returns the newly appended blocks, or None (and changes nothing) when
        the pool has too few free blocks.  `max_total_tokens` is unused: paging
        allocates on demand (the contiguous layout reserves it up front).
        """
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_for_tokens(num_total_tokens) - len(table)
        if missing <= 0:
            return AllocationResult([])
        if missing > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return None
        new_blocks = self.pool.allocate(missing)
        table.extend(new_blocks)
        return AllocationResult(new_blocks)

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    def external_fragmentation_slots(self, max_total_tokens: int | None) -> int:
        """Always 0: any free block can serve any request."""
        return 0

    def free(self, request_id: str) -> None:
        """Release every block the request holds (finish, abort or preemption)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            # Reversed so the tail blocks (least likely to be shared) return first.
            self.pool.free_blocks(list(reversed(table)))
