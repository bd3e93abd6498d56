"""KV memory metrics on small scenarios worked out by hand."""

import pytest

from pagedllm.core.contiguous_kv import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_metrics import KVMemoryTracker
from pagedllm.core.scheduler import Scheduler
from tests.test_scheduler import make_request, run_step


def two_requests_prefilled(kv) -> tuple[Scheduler, KVMemoryTracker]:
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    for rid, prompt_len in [("a", 5), ("b", 10), ("c", 5)]:
        s.add_request(make_request(rid, prompt_len, max_tokens=3))
    tracker = KVMemoryTracker()
    tracker.reset(s)
    out, _ = run_step(s)
    assert out.admission_blocked_by == "memory"  # c does not fit
    tracker.record(s, step=1, memory_bound=True)
    return s, tracker


def test_paged_figures_match_the_hand_count():
    # 5 blocks of 4: a (5 tokens) takes 2 blocks, b (10) takes 3; c waits.
    s, tracker = two_requests_prefilled(KVCacheManager(num_blocks=5, block_size=4))
    (sample,) = tracker.samples
    assert (sample.running, sample.waiting) == (2, 1)
    assert sample.tokens == 15  # computed tokens; the two sampled tokens are not in the cache yet
    assert sample.allocated == 20 and sample.capacity == 20
    assert sample.utilization == pytest.approx(0.75) and sample.internal_waste == 5
    assert sample.external_fragmentation == 0
    summary = tracker.summary(s)
    assert summary["kv_utilization_mean"] == 0.75 and summary["internal_waste_mean"] == 0.25
    assert summary["external_fragmentation_waits"] == 0 and summary["saturated_steps"] == 1


def test_contiguous_figures_match_the_hand_count():
    # reserve=request: a reserves 5+3 = 8 slots (2 blocks), b 10+3 = 13 -> 16 slots (4 blocks).
    # 7 blocks: one is left, and c needs 2 for its 8 slots: the free block is useless to it.
    kv = ContiguousKVCacheManager(num_blocks=7, block_size=4, max_model_len=100, reserve="request")
    s, tracker = two_requests_prefilled(kv)
    (sample,) = tracker.samples
    assert sample.tokens == 15 and sample.allocated == 24 and sample.capacity == 28
    assert sample.utilization == pytest.approx(15 / 24) and sample.internal_waste == 9
    assert sample.external_fragmentation == 4
    summary = tracker.summary(s)
    assert summary["kv_utilization_mean"] == round(15 / 24, 4)
    assert summary["internal_waste_mean"] == round(9 / 24, 4)
    assert summary["external_fragmentation_mean"] == round(4 / 28, 4)
    assert summary["external_fragmentation_waits"] == 0  # 4 free slots < 8 needed: shortage, not fragmentation


def test_max_model_len_reservation_wastes_what_the_request_never_uses():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, max_model_len=32, reserve="max-model-len")
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(make_request("a", 6, max_tokens=3))
    tracker = KVMemoryTracker()
    run_step(s)
    run_step(s)  # decode: 7 tokens computed, 32 reserved
    sample = tracker.record(s, step=2)
    assert (sample.tokens, sample.allocated, sample.internal_waste) == (7, 32, 25)
    summary = tracker.summary(s)  # never memory-bound: averaged over the steps with running requests
    assert summary["saturated_steps"] == 0 and summary["kv_utilization_mean"] == round(7 / 32, 4)


def test_scheduler_says_why_the_queue_head_waits():
    s = Scheduler(KVCacheManager(num_blocks=3, block_size=4), max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(make_request("a", 8))
    assert s.schedule().admission_blocked_by is None  # nobody left waiting
    s.add_request(make_request("b", 8))
    assert s.schedule().admission_blocked_by == "memory"  # a holds 2 of 3 blocks, b needs 2

    s = Scheduler(KVCacheManager(num_blocks=30, block_size=4), max_num_batched_tokens=10, max_num_seqs=8)
    for rid in "ab":
        s.add_request(make_request(rid, 10))
    assert s.schedule().admission_blocked_by == "budget"

    s = Scheduler(KVCacheManager(num_blocks=30, block_size=4), max_num_batched_tokens=100, max_num_seqs=1)
    for rid in "ab":
        s.add_request(make_request(rid, 4))
    assert s.schedule().admission_blocked_by == "max_num_seqs"


def test_sliding_groups_and_shared_prefixes_count_each_block_once():
    # Two layer groups, the second with a 4-token window: its old blocks go back to the pool
    # (FREED entries in the tables); b's prompt repeats a's, so prefix caching shares blocks.
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_prefix_caching=True, group_windows=(0, 4))
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(make_request("a", 10, max_tokens=8))
    run_step(s)
    s.add_request(make_request("b", 10, max_tokens=8))
    for _ in range(3):
        run_step(s)
    sample = KVMemoryTracker().record(s, step=1)

    filled: dict[int, int] = {}  # block -> tokens in it, the plain way
    tables = {r.request_id: kv.block_table(r.request_id) for r in s.running}
    for r in s.running:
        for index, block in enumerate(tables[r.request_id]):
            if block >= 0:
                tokens_before = index // 2 * 4  # two groups: entries interleave per block of positions
                filled[block] = max(filled.get(block, 0), min(4, r.num_computed_tokens - tokens_before))
    held = [b for t in tables.values() for b in t if b >= 0]
    assert any(b < 0 for t in tables.values() for b in t)  # the window freed blocks
    assert len(held) > len(set(held))  # and blocks are shared
    assert sample.tokens == sum(n for n in filled.values() if n > 0)
    assert sample.unshared == len(held) * 4
    assert sample.shared == len({b for b in held if held.count(b) > 1}) * 4
