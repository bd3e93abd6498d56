"""The contiguous-reservation baseline: first fit, release and merging, fragmentation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.contiguous_kv import ContiguousKVCacheManager
from pagedllm.core.scheduler import Scheduler
from tests.test_scheduler import make_request, run_step


def test_reservation_is_one_run_of_consecutive_blocks_sized_by_mode():
    kv = ContiguousKVCacheManager(num_blocks=40, block_size=4, max_model_len=64, reserve="max-model-len")
    result = kv.allocate_slots("a", 5, max_total_tokens=10)
    assert result is not None and result.new_block_ids == list(range(0, 16))  # 64 slots whatever the request
    assert kv.block_table("a") == list(range(16))
    assert kv.allocate_slots("a", 64, 10).new_block_ids == []  # later growth stays inside the reservation
    with pytest.raises(ValueError, match="reserved only 64"):
        kv.allocate_slots("a", 65, 10)

    kv = ContiguousKVCacheManager(num_blocks=40, block_size=4, max_model_len=64, reserve="request")
    assert kv.allocate_slots("a", 5, max_total_tokens=10).new_block_ids == [0, 1, 2]  # 10 tokens -> 3 blocks
    assert kv.num_allocated_slots() == 12 and kv.num_free_blocks == 37


def test_first_fit_takes_the_lowest_hole_that_is_large_enough():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=1, max_model_len=100, reserve="request")
    for rid, size in [("a", 2), ("b", 3), ("c", 2), ("d", 3)]:
        assert kv.allocate_slots(rid, 1, size) is not None
    assert kv.holes == []
    kv.free("a")  # hole [0, 2)
    kv.free("c")  # hole [5, 7)
    assert kv.holes == [(0, 2), (5, 2)]
    assert kv.allocate_slots("e", 1, 2).new_block_ids == [0, 1]  # first fit: the lower hole
    assert kv.allocate_slots("f", 1, 1).new_block_ids == [5]
    assert kv.holes == [(6, 1)]


def test_release_merges_neighbouring_holes():
    kv = ContiguousKVCacheManager(num_blocks=9, block_size=2, max_model_len=100, reserve="request")
    for rid in "abc":
        kv.allocate_slots(rid, 1, 6)  # 3 blocks each
    kv.free("a")
    kv.free("c")
    assert kv.holes == [(0, 3), (6, 3)]
    kv.free("b")  # joins both neighbours
    assert kv.holes == [(0, 9)] and kv.num_free_blocks == 9 and not kv.block_tables


def test_external_fragmentation_wait_is_counted_only_when_total_free_would_do():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=1, max_model_len=100, reserve="request")
    for rid in "abcd":
        kv.allocate_slots(rid, 1, 2)
    kv.free("a")
    kv.free("c")  # holes [0,2) and [4,6): 4 free, none of 3
    assert kv.allocate_slots("e", 1, 3) is None
    assert kv.num_fragmentation_waits == 1
    assert kv.external_fragmentation_slots(3) == 4  # both holes are useless to a 3-slot request
    assert kv.external_fragmentation_slots(2) == 0
    assert kv.allocate_slots("f", 1, 5) is None  # 5 > 4 free: plain shortage, not fragmentation
    assert kv.num_fragmentation_waits == 1
    assert "e" not in kv.block_tables and "f" not in kv.block_tables


def test_scheduler_holds_the_queue_on_fragmentation():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=1, max_model_len=100, reserve="request")
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    # a and c (2 slots) finish after one step; b and d (6 slots) keep running.
    for rid, max_tokens in [("a", 1), ("b", 5), ("c", 1), ("d", 5)]:
        s.add_request(make_request(rid, 1, max_tokens=max_tokens))
    s.add_request(make_request("e", 1, max_tokens=2))  # needs 3 slots
    run_step(s)
    assert [r.request_id for r in s.running] == ["b", "d"] and kv.holes == [(0, 2), (8, 2)]
    out, _ = run_step(s)
    assert "e" not in [c.request.request_id for c in out.scheduled]
    assert kv.num_fragmentation_waits >= 1 and [r.request_id for r in s.waiting] == ["e"]


def test_a_request_that_can_never_be_reserved_is_refused():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=64, reserve="max-model-len")
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    with pytest.raises(ValueError, match="can never fit"):
        s.add_request(make_request("a", 3, max_tokens=2))  # 64-slot reservation > 32 slots


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 12)), max_size=60),
)
def test_reservations_never_overlap_and_holes_account_for_the_rest(num_blocks, ops):
    kv = ContiguousKVCacheManager(num_blocks, block_size=2, max_model_len=1000, reserve="request")
    for reserve, rid, tokens in ops:
        request_id = f"r{rid}"
        if reserve and request_id not in kv.block_tables:
            kv.allocate_slots(request_id, 1, tokens)
        elif not reserve:
            kv.free(request_id)
        held = [b for table in kv.block_tables.values() for b in table]
        assert len(held) == len(set(held)), "two reservations overlap"
        for table in kv.block_tables.values():
            assert table == list(range(table[0], table[0] + len(table)))
        free = [b for start, length in kv.holes for b in range(start, start + length)]
        assert sorted(held + free) == list(range(num_blocks)), "a slot is lost or counted twice"
        # holes stay sorted and never touch (they would have been merged)
        assert all(a[0] + a[1] < b[0] for a, b in zip(kv.holes, kv.holes[1:]))
