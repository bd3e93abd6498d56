"""The traditional baseline: each request reserves one contiguous run of KV slots.

Pure Python.  At admission a request reserves space for the most tokens it may
ever hold (`reserve="max-model-len"`, what engines did before paging, or
`reserve="request"`: prompt + max_tokens), taken first fit from one arena the
size of the paged cache.  A request that finds no hole large enough waits even
when the free slots add up to enough: that is external fragmentation, and
every such wait is counted in `num_fragmentation_waits`.

The arena is addressed in units of `block_size` slots, so a reservation is a
run of consecutive block ids and the model reads it through the same block
table and the same attention kernel as the paged layout: a comparison of the
two layouts isolates memory management.  Rounding a reservation up to whole
blocks wastes under one block, as paging does in a request's last block.
"""

from __future__ import annotations

import bisect

from pagedllm.core.arith import cdiv
from pagedllm.core.kv_cache_manager import AllocationResult

RESERVE_MODES = ("max-model-len", "request")


class ContiguousKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, reserve: str = "max-model-len") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if reserve not in RESERVE_MODES:
            raise ValueError(f"reserve must be one of {', '.join(RESERVE_MODES)}, got {reserve!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reserve = reserve
        # Free runs of blocks as sorted, disjoint, non-adjacent (start, length) pairs.
        self.holes: list[tuple[int, int]] = [(0, num_blocks)]
        self.block_tables: dict[str, list[int]] = {}
        self.num_fragmentation_waits = 0
        # One block table slot per block of tokens (no layer groups), nothing freed by window.
        self.num_groups = 1
        self.num_blocks_freed_by_window = 0

    @property
    def num_free_blocks(self) -> int:
        return sum(length for _, length in self.holes)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_tokens_capacity(self) -> int:
        return self.num_blocks * self.block_size

    # No prefix cache: sharing needs blocks that can sit in several tables.
    supports_prefix_caching = False
    num_cached_blocks = 0
    num_prefix_evictions = 0

    # No pages: LoRA adapters' weights stay in memory of their own beside this layout.
    supports_pages = False
    num_page_blocks = 0

    def allocate_pages(self, count: int) -> int | None:
        return None

    def free_pages(self, first: int) -> None:
        raise ValueError("the contiguous layout hands out no pages")

    def reset_prefix_cache(self) -> None:
        pass

    def drain_events(self) -> list[tuple[bool, bytes]]:
        return []

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, max_total_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """Blocks a request reserves at admission, and so the most it ever holds."""
        tokens = self.max_model_len if self.reserve == "max-model-len" else max_total_tokens
        return self.blocks_for_tokens(tokens)

    def cached_tokens(self, cached_blocks: list[int]) -> int:
        return 0  # no prefix cache

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def find_cached_prefix(self, token_ids: list[int], salt: bytes = b"") -> list[int]:
        """No prefix caching in this layout: sharing needs blocks that can sit in several tables."""
        return []

    def cache_full_blocks(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int, salt: bytes = b""
    ) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def mark_pending(
        self, request_id: str, token_ids: list[int], num_tokens_after_step: int, salt: bytes = b""
    ) -> None:
        pass

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        max_total_tokens: int,
        cached_blocks: list[int] | None = None,
        num_computed_tokens: int | None = None,
    ) -> AllocationResult | None:
        """Reserve the request's whole run on first call; later calls only check it covers the tokens."""
        if cached_blocks:
            raise ValueError("the contiguous layout has no prefix cache")
        table = self.block_tables.get(request_id)
        if table is not None:
            if self.blocks_for_tokens(num_total_tokens) > len(table):
                raise ValueError(
                    f"request {request_id} needs {num_total_tokens} tokens but reserved only "
                    f"{len(table) * self.block_size}"
                )
            return AllocationResult([])
        needed = self.max_blocks_held(max_total_tokens)
        if self.blocks_for_tokens(num_total_tokens) > needed:
            raise ValueError(f"request {request_id} asks for {num_total_tokens} tokens, more than its reservation")
        start = self._take_first_fit(needed)
        if start is None:
            if self.num_free_blocks >= needed:
                self.num_fragmentation_waits += 1
            return None
        table = self.block_tables[request_id] = list(range(start, start + needed))
        return AllocationResult(list(table))

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("the contiguous layout cannot share a reservation: n>1 needs --kv-layout paged")

    def _take_first_fit(self, length: int) -> int | None:
        for index, (start, hole) in enumerate(self.holes):
            if hole >= length:
                if hole == length:
                    del self.holes[index]
                else:
                    self.holes[index] = (start + length, hole - length)
                return start
        return None

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Nothing to give back: a request's reservation is one run of blocks for its whole length."""

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if not table:
            return
        start, end = table[0], table[0] + len(table)
        index = bisect.bisect_left(self.holes, (start, 0))
        # Merge with the hole just before and the hole just after, when they touch.
        if index > 0 and sum(self.holes[index - 1]) == start:
            index -= 1
            start = self.holes.pop(index)[0]
        if index < len(self.holes) and self.holes[index][0] == end:
            end += self.holes.pop(index)[1]
        self.holes.insert(index, (start, end - start))

    def block_states(self) -> str:
        """One character per block: "u" reserved by a request, "." free (no sharing, no cache here)."""
        states = ["u"] * self.num_blocks
        for start, length in self.holes:
            states[start : start + length] = ["."] * length
        return "".join(states)

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    def external_fragmentation_slots(self, max_total_tokens: int | None) -> int:
        """Free slots the next waiting request cannot use: holes shorter than its reservation."""
        if max_total_tokens is None:
            return 0
        needed = self.max_blocks_held(max_total_tokens)
        return sum(length for _, length in self.holes if length < needed) * self.block_size
