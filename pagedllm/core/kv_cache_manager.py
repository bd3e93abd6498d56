"""Which request holds which physical blocks: one block table per request.

Pure Python.  Allocation is on demand: a request's table grows only to cover
the tokens it has computed or is about to compute, so the internal waste of a
request is at most one partially filled block.

Prefix caching: every full block is named by a key chained from its parent
block's key and its own token ids (SHA-256, so two different prefixes never
share a key in practice, and a hit never returns another prefix's KV).  A new
request's leading full blocks are looked up by key; the hits go into its table
with one more holder each, and only the rest is computed.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from pagedllm.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The content key of a full block: SHA-256 over the parent's key and the block's token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class AllocationResult:
    """What one `allocate_slots` call changed in a request's table.

    `copies` are copy-on-write pairs (source block, destination block): the
    destination replaced the shared source in the table, and the model runner
    must copy the source's contents into it before the step writes there.
    """

    new_block_ids: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, cache_salt: bytes = b""
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        # Keys of each request's leading full blocks, as far as they have been named.
        self.block_keys: dict[str, list[bytes]] = {}
        # Mixed into the first block's key: anything besides the tokens that changes the KV.
        self.root_key = hashlib.sha256(b"pagedllm" + cache_salt).digest()
        # Full blocks that requests scheduled this step are computing: findable by later requests of the
        # same step (every layer writes the step's K/V before any attention reads it), cached after it.
        self._pending: dict[bytes, int] = {}
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

    # --- prefix cache ------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest run of the request's leading full blocks.

        The request's last token is never covered: it must be computed to give
        the logits of the next token.  Changes nothing (see `allocate_slots`).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = self.root_key
        for index in range((len(token_ids) - 1) // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            block = self.pool.lookup(parent)
            if block is None:
                block = self._pending.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def begin_step(self) -> None:
        """A new step: blocks pending from the last one are computed (and cached) or abandoned."""
        self._pending.clear()

    def mark_pending(self, request_id: str, token_ids: list[int], num_tokens_after_step: int) -> None:
        """The request's blocks that this step fills become findable by requests admitted after it."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        bs = self.block_size
        parent = self.root_key
        for index in range(num_tokens_after_step // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            if self.pool.lookup(parent) is None:
                self._pending.setdefault(parent, table[index])

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Name and register the request's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id)
        if not table:
            return
        keys = self.block_keys.setdefault(request_id, [])
        bs = self.block_size
        parent = keys[-1] if keys else self.root_key
        for index in range(len(keys), num_computed_tokens // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            keys.append(parent)
            self.pool.cache_block(table[index], parent)

    # --- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        max_total_tokens: int | None = None,
        cached_blocks: list[int] | None = None,
        num_computed_tokens: int | None = None,
    ) -> AllocationResult | None:
        """Make the request's table cover `num_total_tokens` tokens.

        `cached_blocks` (from `find_cached_prefix`, on a request's first call
        only) start its table and gain a holder each.  When the step will
        write from position `num_computed_tokens` into a block that other
        requests also hold (a fork's shared last block), that block is
        replaced by a fresh copy: copy-on-write.  Returns the new blocks and
        copies, or None (and changes nothing) when the pool has too few free
        blocks.  `max_total_tokens` is unused: paging allocates on demand (the
        contiguous layout reserves it up front).
        """
        table = self.block_tables.get(request_id)
        cached_blocks = cached_blocks or []
        if cached_blocks and table:
            raise ValueError(f"request {request_id} already holds blocks; cached blocks only start a table")
        held = len(table) if table else len(cached_blocks)
        missing = max(0, self.blocks_for_tokens(num_total_tokens) - held)
        shared_index = None
        if table and num_computed_tokens is not None:
            index = num_computed_tokens // self.block_size
            if index < len(table) and self.pool.ref_counts[table[index]] > 1:
                shared_index = index
                missing += 1
        # Cached hits that nobody holds now sit in the free list: taking them shrinks it.
        free_after_hits = self.pool.num_free_blocks - sum(1 for b in cached_blocks if self.pool.is_free(b))
        if missing > free_after_hits:
            return None
        if table is None:
            self.pool.touch(cached_blocks)  # their keys are named again by cache_full_blocks
            table = self.block_tables[request_id] = list(cached_blocks)
        new_blocks = self.pool.allocate(missing)
        copies = []
        if shared_index is not None:
            source, copy = table[shared_index], new_blocks.pop(0)
            table[shared_index] = copy
            self.pool.free_blocks([source])  # others still hold it: only the count drops
            copies.append((source, copy))
        table.extend(new_blocks)
        return AllocationResult(new_blocks, copies)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's whole table; every block gains a holder (nothing is copied yet)."""
        if child_id in self.block_tables:
            raise ValueError(f"request {child_id} already holds blocks")
        table = self.block_tables.get(parent_id)
        if not table:
            raise ValueError(f"request {parent_id} holds no blocks to fork")
        self.pool.incref(table)
        self.block_tables[child_id] = list(table)
        if parent_id in self.block_keys:
            self.block_keys[child_id] = list(self.block_keys[parent_id])

    def block_states(self) -> str:
        """One character per physical block: "." free, "u" held by one request,
        "s" shared by several, "c" free but holding cached content (evictable)."""
        pool = self.pool
        return "".join(
            ("s" if ref > 1 else "u") if ref else ("c" if key is not None else ".")
            for ref, key in zip(pool.ref_counts, pool.block_keys)
        )

    def num_allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    def external_fragmentation_slots(self, max_total_tokens: int | None) -> int:
        """Always 0: any free block can serve any request."""
        return 0

    def free(self, request_id: str) -> None:
        """Drop the request's hold on every block it has (finish, abort or preemption).

        Tail blocks go first, so they are the first to be evicted: a prefix is
        more likely to be asked for again than a request's own tail.
        """
        self.block_keys.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free_blocks(list(reversed(table)))
            if self._pending:  # a block nobody computes any more must not be found this step
                self._pending = {k: b for k, b in self._pending.items() if not self.pool.is_free(b)}
