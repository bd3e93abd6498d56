"""Physical KV blocks: a free list, one reference count per block, and the prefix cache.

Pure Python (no torch) so it is unit-tested in milliseconds.  The pool knows
nothing about requests; it hands out block ids, takes them back, and remembers
which full blocks hold which content.

Invariants:
- a block is in the free list exactly when its reference count is 0;
- a block with a content key (`block_keys[b]`) is findable in `cached` under
  that key, whether it is held or free; a free cached block keeps its content
  until `allocate` takes it for something else (an eviction);
- the free list is ordered least recently freed first, so eviction takes the
  content that has gone unused longest.

`allocate_run` hands out a run of consecutive blocks for memory that is not KV (a LoRA
adapter's weights, written into those blocks' place in the cache tensors); `num_page_blocks`
counts them, and they are held (reference count 1) until `free_run`.

With `record_events`, the pool also keeps the content keys it started and stopped
holding since the last `drain_events()`, in order: what a data-parallel router reads
to know which prefixes each replica holds (pagedllm/replicas/router.py).
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.runs: dict[int, int] = {}  # first block -> length of each run allocate_run handed out
        self.num_page_blocks = 0  # blocks in those runs (held, but not by requests)
        self.record_events = False
        self._events: list[tuple[bool, bytes]] = []  # (stored: True / removed: False, key)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached (evictable) ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with reference count 1 (all or none), evicting cached content.

        Which blocks: the least recently freed.  In what order: ascending ids, so that blocks taken
        together lie in memory order in a request's table (a finished request's are freed tail
        first); decode attention walks a table in order, and the hardware prefetcher follows an
        ascending run of blocks where it loses the thread at every step back."""
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = sorted(self._free.popitem(last=False)[0] for _ in range(count))
        for block in blocks:
            self.ref_counts[block] = 1
            self._forget_content(block)
        return blocks

    def _forget_content(self, block: int) -> None:
        key = self.block_keys[block]
        if key is not None:
            del self.cached[key]
            self.block_keys[block] = None
            self.num_evictions += 1
            if self.record_events:
                self._events.append((False, key))

    def allocate_run(self, count: int) -> int | None:
        """Take `count` consecutive free blocks (evicting cached content), each with reference count
        1; the first id, or None where no such run is free.  Searched from the highest ids down:
        requests take the least recently freed blocks, so runs at the top stay whole longer."""
        if count < 1:
            raise ValueError(f"a run has at least one block, got {count}")
        length, first = 0, None
        for block in range(self.num_blocks - 1, -1, -1):
            length = length + 1 if self.ref_counts[block] == 0 else 0
            if length == count:
                first = block
                break
        if first is None:
            return None
        for block in range(first, first + count):
            del self._free[block]
            self.ref_counts[block] = 1
            self._forget_content(block)
        self.runs[first] = count
        self.num_page_blocks += count
        return first

    def free_run(self, first: int) -> None:
        """Give back the run `allocate_run` handed out starting at `first`."""
        count = self.runs.pop(first, None)
        if count is None:
            raise ValueError(f"block {first} does not start a run allocate_run handed out")
        for block in range(first, first + count):
            self.ref_counts[block] = 0
            self._free[block] = None
        self.num_page_blocks -= count

    def incref(self, blocks: list[int]) -> None:
        """Add one holder to blocks that are already in use (sharing)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                raise ValueError(f"block {block} is free; only a used block can be shared")
            self.ref_counts[block] += 1

    def touch(self, blocks: list[int]) -> None:
        """Add one holder to blocks a prefix lookup found: cached ones (taken off the free list when
        nobody holds them) or held ones another request is computing this step."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                if self.block_keys[block] is None:
                    raise ValueError(f"block {block} is free and holds no cached content")
                del self._free[block]
            self.ref_counts[block] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        """Drop one holder from each block; blocks nobody holds go to the end of the free list."""
        for block in blocks:
            count = self.ref_counts[block]
            if count == 0:
                raise ValueError(f"block {block} freed twice")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key)

    def cache_block(self, block: int, key: bytes) -> None:
        """Record that a held, full block holds the content named by `key`.

        When another block already holds that content (two requests computed
        the same prefix at the same time) the first stays the cached one.
        """
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is free; only a held block can be cached")
        if key in self.cached or self.block_keys[block] is not None:
            return
        self.cached[key] = block
        self.block_keys[block] = key
        if self.record_events:
            self._events.append((True, key))

    def reset_prefix_cache(self) -> None:
        """Forget every cached content (nothing may be held): later lookups all miss, as in a fresh pool."""
        held = self.num_used_blocks - self.num_page_blocks
        if held:
            raise ValueError(f"the prefix cache can be reset only when no block is held by a request ({held} are)")
        for key, block in self.cached.items():
            self.block_keys[block] = None
            if self.record_events:
                self._events.append((False, key))
        self.cached.clear()

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """The keys stored (True) and evicted (False) since the last call, oldest first."""
        events, self._events = self._events, []
        return events
