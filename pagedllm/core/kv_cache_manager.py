"""Which request holds which physical blocks: one block table per request.

Pure Python.  Allocation is on demand: a request's table grows only to cover
the tokens it has computed or is about to compute, so the internal waste of a
request is at most one partially filled block.

Prefix caching: every full block is named by a key chained from its parent
block's key and its own token ids (SHA-256, so two different prefixes never
share a key in practice, and a hit never returns another prefix's KV).  A new
request's leading full blocks are looked up by key; the hits go into its table
with one more holder each, and only the rest is computed.

Layer groups (core/layer_groups.py): with G groups, a request's table holds G
entries per block of tokens, interleaved: block i of group g is entry i*G + g.
Each entry is a pool block holding that group's layers.  For a sliding group
of window W, the entries of blocks whose every position is older than W - 1
tokens before the next position to compute are given back to the pool
(`free_outside_window`, at every allocation) and become FREED (-1): no query
of the request reads them again, which every attention path guarantees by
never reading a slot older than its query's window.  With one full group
(every model without windows) the table is the plain one-entry-per-block list.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from pagedllm.core.arith import cdiv
from pagedllm.core.block_pool import BlockPool

FREED = -1  # a sliding group's table entry whose block went back to the pool


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """The content key of a full block: SHA-256 over the parent's key and the block's token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def root_key(cache_salt: bytes = b"", request_salt: bytes = b"") -> bytes:
    """The key a request's first block chains from: the cache's salt, then the request's, mixed in."""
    root = hashlib.sha256(b"pagedllm" + cache_salt).digest()
    return root if not request_salt else hashlib.sha256(root + request_salt).digest()


def adapter_salt(adapter_key: str) -> bytes:
    """A request salt for KV computed under a LoRA adapter: its blocks never serve the base model or
    another adapter.  The scheduler and the data-parallel router both salt with it."""
    return b"lora:" + adapter_key.encode()


def prompt_block_keys(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """The keys of the leading full blocks a prefix-cache lookup can hit for this prompt (its last
    token is always computed, so a block that ends with it is not among them)."""
    keys, parent = [], root
    for index in range((len(token_ids) - 1) // block_size):
        parent = block_key(parent, token_ids[index * block_size : (index + 1) * block_size])
        keys.append(parent)
    return keys


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
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        cache_salt: bytes = b"",
        group_windows: tuple[int, ...] = (0,),
        record_events: bool = False,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if not group_windows or any(w < 0 for w in group_windows):
            raise ValueError(f"group_windows must be one window (0: full) per layer group, got {group_windows}")
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.num_groups = len(group_windows)
        self._sliding = [(g, w) for g, w in enumerate(group_windows) if w > 0]
        # Per request and sliding group: how many leading blocks are FREED already.
        self._freed_upto: dict[str, list[int]] = {}
        self.num_blocks_freed_by_window = 0
        self.pool = BlockPool(num_blocks)
        # Block keys stored and evicted, kept for drain_events() (the data-parallel router's feed).
        self.pool.record_events = record_events
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        # Keys of each request's leading full blocks, as far as they have been named.
        self.block_keys: dict[str, list[bytes]] = {}
        # Mixed into the first block's key: anything besides the tokens that changes the KV.
        self.cache_salt = cache_salt
        self.root_key = root_key(cache_salt)
        # Full blocks that requests scheduled this step are computing: findable by later requests of the
        # same step (every layer writes the step's K/V before any attention reads it), cached after it.
        self._pending: dict[bytes, int] = {}
        self.num_fragmentation_waits = 0  # kept for parity with the contiguous layout: never counts here

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def supports_prefix_caching(self) -> bool:
        return self.enable_prefix_caching

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a keyed prefix (reusable until a fresh block is needed)."""
        return self.pool.num_cached_blocks

    @property
    def num_prefix_evictions(self) -> int:
        return self.pool.num_evictions

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (no request may hold blocks)."""
        self.pool.reset_prefix_cache()

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """Block keys stored (True) and evicted (False) since the last call, oldest first; empty
        unless the cache was made with `record_events`."""
        return self.pool.drain_events()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks requests hold (pages excluded)."""
        return self.pool.num_used_blocks - self.pool.num_page_blocks

    # --- pages: runs of blocks whose memory holds LoRA adapters' weights, not KV --------------

    @property
    def supports_pages(self) -> bool:
        return True

    @property
    def num_page_blocks(self) -> int:
        return self.pool.num_page_blocks

    def allocate_pages(self, count: int) -> int | None:
        """A run of `count` consecutive free blocks for non-KV memory; its first block, or None
        where no run that long is free."""
        first = self.pool.allocate_run(count)
        if first is not None:
            self._forget_pending()  # a pending block a run took must not be found this step
        return first

    def free_pages(self, first: int) -> None:
        self.pool.free_run(first)

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, max_total_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """The most blocks a request of that length can ever hold: every group's blocks for all its
        tokens, except that a sliding group holds its window's blocks and one chunk's."""
        full = self.blocks_for_tokens(max_total_tokens)
        chunk = max_total_tokens if max_chunk_tokens is None else max_chunk_tokens
        held = 0
        for w in self.group_windows:
            held += full if w == 0 else min(full, self.blocks_for_tokens(w - 1 + chunk) + 1)
        return held

    def cached_tokens(self, cached_blocks: list[int]) -> int:
        """Tokens a `find_cached_prefix` hit covers."""
        return len(cached_blocks) // self.num_groups * self.block_size

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def _group_key(self, key: bytes, group: int) -> bytes:
        """The content key of one group's block: a group's K/V differ from another's for the same tokens."""
        return key if group == 0 else hashlib.sha256(key + group.to_bytes(2, "little")).digest()

    # --- prefix cache ------------------------------------------------------------------

    def _root(self, salt: bytes) -> bytes:
        """The key a request's first block chains from: the cache's own, or with the request's salt
        (anything besides its tokens that changes its KV, such as a length-dependent RoPE's
        frequencies) mixed in."""
        return self.root_key if not salt else root_key(self.cache_salt, salt)

    def find_cached_prefix(self, token_ids: list[int], salt: bytes = b"") -> list[int]:
        """Cached blocks holding the longest run of the request's leading full blocks (G entries each,
        a sliding group's FREED where the first position to compute no longer sees them).

        The request's last token is never covered: it must be computed to give
        the logits of the next token.  Changes nothing (see `allocate_slots`).
        """
        if not self.enable_prefix_caching:
            return []
        bs, num_groups = self.block_size, self.num_groups
        found: list[list[int | None]] = []  # per block: each group's cached block, or None
        parent = self._root(salt)
        for index in range((len(token_ids) - 1) // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            entries = [self._lookup(self._group_key(parent, g)) for g in range(num_groups)]
            if any(entries[g] is None for g, w in enumerate(self.group_windows) if w == 0):
                break  # a full group must have every block
            found.append(entries)
        for num_hit in range(len(found), 0, -1):  # the longest run whose windows are whole
            first_needed = [max(0, num_hit * bs - w + 1) // bs for w in self.group_windows]
            if all(found[i][g] is not None for g, w in self._sliding for i in range(first_needed[g], num_hit)):
                hits = []
                for i in range(num_hit):
                    for g, w in enumerate(self.group_windows):
                        hits.append(found[i][g] if w == 0 or i >= first_needed[g] else FREED)
                return hits
        return []

    def _lookup(self, key: bytes) -> int | None:
        block = self.pool.lookup(key)
        return self._pending.get(key) if block is None else block

    def begin_step(self) -> None:
        """A new step: blocks pending from the last one are computed (and cached) or abandoned."""
        self._pending.clear()

    def mark_pending(
        self, request_id: str, token_ids: list[int], num_tokens_after_step: int, salt: bytes = b""
    ) -> None:
        """The request's blocks that this step fills become findable by requests admitted after it."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request_id]
        bs, num_groups = self.block_size, self.num_groups
        parent = self._root(salt)
        for index in range(num_tokens_after_step // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            for g in range(num_groups):
                block, key = table[index * num_groups + g], self._group_key(parent, g)
                if block != FREED and self.pool.lookup(key) is None:
                    self._pending.setdefault(key, block)

    def cache_full_blocks(
        self, request_id: str, token_ids: list[int], num_computed_tokens: int, salt: bytes = b""
    ) -> None:
        """Name and register the request's blocks that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request_id)
        if not table:
            return
        keys = self.block_keys.setdefault(request_id, [])
        bs, num_groups = self.block_size, self.num_groups
        parent = keys[-1] if keys else self._root(salt)
        for index in range(len(keys), num_computed_tokens // bs):
            parent = block_key(parent, token_ids[index * bs : (index + 1) * bs])
            keys.append(parent)
            for g in range(num_groups):
                if table[index * num_groups + g] != FREED:
                    self.pool.cache_block(table[index * num_groups + g], self._group_key(parent, g))

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
        replaced by a fresh copy: copy-on-write.  With `num_computed_tokens`,
        sliding groups first give back the blocks out of their window (always:
        no query needs them again).  Returns the new blocks and copies, or None
        (and allocates nothing) when the pool has too few free blocks.
        `max_total_tokens` is unused: paging allocates on demand (the
        contiguous layout reserves it up front).
        """
        table = self.block_tables.get(request_id)
        cached_blocks = cached_blocks or []
        if cached_blocks and table:
            raise ValueError(f"request {request_id} already holds blocks; cached blocks only start a table")
        num_groups = self.num_groups
        if table and num_computed_tokens is not None:
            self.free_outside_window(request_id, num_computed_tokens)
        held = (len(table) if table else len(cached_blocks)) // num_groups
        missing = max(0, self.blocks_for_tokens(num_total_tokens) - held) * num_groups
        shared: list[int] = []  # table positions of shared blocks the step writes into
        if table and num_computed_tokens is not None:
            index = num_computed_tokens // self.block_size
            if index < held:
                for position in range(index * num_groups, (index + 1) * num_groups):
                    block = table[position]
                    if block != FREED and self.pool.ref_counts[block] > 1:
                        shared.append(position)
                missing += len(shared)
        # Cached hits that nobody holds now sit in the free list: taking them shrinks it.
        held_hits = [b for b in cached_blocks if b != FREED]
        free_after_hits = self.pool.num_free_blocks - sum(1 for b in held_hits if self.pool.is_free(b))
        if missing > free_after_hits:
            return None
        if table is None:
            self.pool.touch(held_hits)  # their keys are named again by cache_full_blocks
            table = self.block_tables[request_id] = list(cached_blocks)
            if self._sliding:
                self._freed_upto[request_id] = [
                    next((i for i, b in enumerate(table[g::num_groups]) if b != FREED), len(table) // num_groups)
                    for g, _ in self._sliding
                ]
        new_blocks = self.pool.allocate(missing)
        copies = []
        for position in shared:
            source, copy = table[position], new_blocks.pop(0)
            table[position] = copy
            self.pool.free_blocks([source])  # others still hold it: only the count drops
            copies.append((source, copy))
        # G entries per new block of tokens, any pool block serves any group.  Each group takes its
        # blocks as one ascending run of the pool's (ascending) blocks: handed out entry by entry, a
        # group's consecutive blocks lay G blocks apart, and Gemma 3's decode attention (6 groups)
        # read K/V at the rate of blocks placed at random (benchmarks/attention_bandwidth.py).
        per_group = len(new_blocks) // num_groups
        new_blocks = [new_blocks[g * per_group + i] for i in range(per_group) for g in range(num_groups)]
        table.extend(new_blocks)
        return AllocationResult(new_blocks, copies)

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back each sliding group's blocks that the query at `num_computed_tokens` (and every
        later one) no longer sees: those whose every position is below num_computed_tokens - W + 1."""
        if not self._sliding:
            return
        table = self.block_tables.get(request_id)
        if not table:
            return
        num_groups, bs = self.num_groups, self.block_size
        held = len(table) // num_groups
        freed_upto = self._freed_upto.setdefault(request_id, [0] * len(self._sliding))
        released = []
        for k, (g, w) in enumerate(self._sliding):
            end = min(max(0, num_computed_tokens - w + 1) // bs, held)
            for index in range(freed_upto[k], end):
                block = table[index * num_groups + g]
                if block != FREED:
                    released.append(block)
                    table[index * num_groups + g] = FREED
            freed_upto[k] = max(freed_upto[k], end)
        if released:
            self.pool.free_blocks(released)
            self.num_blocks_freed_by_window += len(released)
            self._forget_pending()

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks covering its first `num_tokens` tokens, giving back
        the blocks wholly past them (speculative decoding's rejected draft tokens).  Those blocks
        hold no computed token, so none of them is named in the prefix cache."""
        table = self.block_tables.get(request_id)
        keep = self.blocks_for_tokens(num_tokens) * self.num_groups
        if not table or len(table) <= keep:
            return
        if len(self.block_keys.get(request_id, ())) * self.num_groups > keep:
            raise ValueError(f"request {request_id}: truncating to {num_tokens} tokens would drop a named block")
        released = [b for b in reversed(table[keep:]) if b != FREED]
        del table[keep:]
        self.pool.free_blocks(released)
        self._forget_pending()

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's whole table; every block gains a holder (nothing is copied yet)."""
        if child_id in self.block_tables:
            raise ValueError(f"request {child_id} already holds blocks")
        table = self.block_tables.get(parent_id)
        if not table:
            raise ValueError(f"request {parent_id} holds no blocks to fork")
        self.pool.incref([b for b in table if b != FREED])
        self.block_tables[child_id] = list(table)
        if parent_id in self.block_keys:
            self.block_keys[child_id] = list(self.block_keys[parent_id])
        if parent_id in self._freed_upto:
            self._freed_upto[child_id] = list(self._freed_upto[parent_id])

    def block_states(self) -> str:
        """One character per physical block: "." free, "u" held by one request,
        "s" shared by several, "c" free but holding cached content (evictable)."""
        pool = self.pool
        states = [
            ("s" if ref > 1 else "u") if ref else ("c" if key is not None else ".")
            for ref, key in zip(pool.ref_counts, pool.block_keys)
        ]
        for first, count in self.pool.runs.items():
            states[first : first + count] = "a" * count
        return "".join(states)

    def num_allocated_slots(self) -> int:
        """Slots of the blocks in use (a slot: one token of one group's layers)."""
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
        self._freed_upto.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free_blocks([b for b in reversed(table) if b != FREED])
            self._forget_pending()

    def _forget_pending(self) -> None:
        if self._pending:  # a block nobody computes any more must not be found this step
            self._pending = {k: b for k, b in self._pending.items() if not self.pool.is_free(b)}
