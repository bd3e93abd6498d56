import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    assert all(pool.ref_counts[b] == 1 for b in blocks)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4 and pool.ref_counts == [0, 0, 0, 0]


def test_allocate_is_all_or_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_shared_block_returns_only_when_last_holder_frees():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1 and pool.ref_counts[block] == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_blocks([block])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([block])


def test_allocation_on_demand():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert len(kv.allocate_slots("a", 5).new_block_ids) == 2  # prefill: ceil(5/4)
    assert kv.allocate_slots("a", 8).new_block_ids == []  # decode into the partial block
    assert len(kv.allocate_slots("a", 9).new_block_ids) == 1  # last block full: one more
    assert len(kv.block_table("a")) == 3
    kv.free("a")
    assert kv.num_free_blocks == 10 and not kv.block_tables


def test_blocks_taken_together_lie_in_memory_order_per_group():
    # A finished request's blocks come back tail first; the next request still gets them ascending.
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("a", 16)
    kv.free("a")
    assert kv.allocate_slots("b", 16).new_block_ids == [0, 1, 2, 3]
    # Two layer groups: a table holds each block of tokens' two entries side by side, and each
    # group's own entries form one ascending run of the pool's blocks (not every other block).
    grouped = KVCacheManager(num_blocks=24, block_size=4, group_windows=(0, 8))
    grouped.allocate_slots("c", 12)
    table = grouped.block_table("c")
    assert table[0::2] == [0, 1, 2] and table[1::2] == [3, 4, 5]


def test_allocate_slots_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8)
    assert kv.allocate_slots("b", 8) is None
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 13) is None  # needs 2 more, 1 free: nothing changes
    assert len(kv.block_table("a")) == 2


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(
        st.tuples(st.sampled_from(["allocate", "append", "finish", "abort"]), st.integers(0, 5), st.integers(1, 40)),
        max_size=80,
    ),
)
def test_random_interleavings_never_leak_or_double_allocate(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    lengths: dict[str, int] = {}
    for op, rid, amount in ops:
        request_id = f"r{rid}"
        if op == "allocate" and request_id not in lengths:
            if kv.allocate_slots(request_id, amount) is not None:
                lengths[request_id] = amount
        elif op == "append" and request_id in lengths:
            if kv.allocate_slots(request_id, lengths[request_id] + amount) is not None:
                lengths[request_id] += amount
        elif op in ("finish", "abort") and request_id in lengths:
            kv.free(request_id)
            del lengths[request_id]

        held = [b for table in kv.block_tables.values() for b in table]
        assert len(held) == len(set(held)), "a block was handed out twice"
        assert len(held) + kv.num_free_blocks == num_blocks, "blocks leaked or exceed the pool"
        assert set(kv.block_tables) == set(lengths)
        for request_id, length in lengths.items():
            assert len(kv.block_table(request_id)) == -(-length // block_size)
        for block in range(num_blocks):
            assert kv.pool.ref_counts[block] == held.count(block)
    for request_id in list(lengths):
        kv.free(request_id)
    assert kv.num_free_blocks == num_blocks and all(c == 0 for c in kv.pool.ref_counts)


def assert_counts_equal_holders(kv: KVCacheManager) -> list[int]:
    """Every block's reference count equals the tables holding it, and the free count is the rest;
    returns the held blocks (with repeats for shared ones)."""
    held = [b for table in kv.block_tables.values() for b in table]
    for block in range(kv.num_blocks):
        assert kv.pool.ref_counts[block] == held.count(block), "reference count != holders"
        assert kv.pool.is_free(block) == (block not in held)
    assert kv.num_free_blocks == kv.num_blocks - len(set(held)), "a block leaked"
    return held


def test_reset_prefix_cache_forgets_contents_only_when_nothing_is_held():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", [1, 2, 3, 4, 5], 5)
    with pytest.raises(ValueError, match="no block is held"):
        kv.pool.reset_prefix_cache()
    kv.free("a")
    assert kv.find_cached_prefix([1, 2, 3, 4, 5])
    kv.pool.reset_prefix_cache()
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == [] and kv.pool.num_cached_blocks == 0
    assert kv.num_free_blocks == 4


def test_a_run_of_pages_is_consecutive_evicts_cached_content_and_goes_back_whole():
    pool = BlockPool(10)
    pool.record_events = True
    held = pool.allocate(3)  # 0, 1, 2
    pool.cache_block(held[2], b"k2")
    pool.free_blocks([held[2]])  # 2: free, cached
    first = pool.allocate_run(7)  # only 3..9 is free in one run of 7
    assert first == 3 and pool.num_page_blocks == 7 and pool.num_free_blocks == 1
    assert pool.allocate_run(2) is None  # block 2 alone is free
    pool.free_run(first)
    assert pool.num_page_blocks == 0 and pool.num_free_blocks == 8
    run = pool.allocate_run(8)  # 2..9 now, block 2's cached content evicted
    assert run == 2 and pool.lookup(b"k2") is None and (False, b"k2") in pool.drain_events()
    with pytest.raises(ValueError, match="does not start a run"):
        pool.free_run(0)
