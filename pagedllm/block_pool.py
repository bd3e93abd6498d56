"""Physical KV blocks: a free list and one reference count per block.

Pure Python (no torch) so it is unit-tested in milliseconds.  The pool knows
nothing about requests; it only hands out block ids and takes them back.

Invariant: a block is in the free list exactly when its reference count is 0.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with reference count 1 (all or none)."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add one holder to blocks that are already in use (sharing)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                raise ValueError(f"block {block} is free; only a used block can be shared")
            self.ref_counts[block] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one holder from each block; blocks nobody holds go back to the pool."""
        for block in blocks:
            count = self.ref_counts[block]
            if count == 0:
                raise ValueError(f"block {block} freed twice")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)
