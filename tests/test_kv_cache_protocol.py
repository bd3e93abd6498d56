"""One suite over both KV cache layouts: everything the scheduler, the engine and the front-ends ask
of a cache (pagedllm/core/kv_cache.py), answered by the paged manager and the contiguous baseline
alike, optional capabilities included.  Pure Python: milliseconds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm.core.contiguous_kv import ContiguousKVCacheManager
from pagedllm.core.kv_cache import KVCache
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from tests.test_scheduler import make_request, run_step

BS = 4


def paged() -> KVCacheManager:
    return KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=True, record_events=True)


def paged_without_prefix_cache() -> KVCacheManager:
    return KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)


def contiguous() -> ContiguousKVCacheManager:
    return ContiguousKVCacheManager(num_blocks=32, block_size=BS, max_model_len=32, reserve="request")


LAYOUTS = [paged, paged_without_prefix_cache, contiguous]


@pytest.fixture(params=LAYOUTS, ids=lambda make: make.__name__)
def kv(request: pytest.FixtureRequest) -> KVCache:
    return request.param()


def test_both_layouts_implement_the_protocol(kv: KVCache):
    assert isinstance(kv, KVCache)
    assert kv.num_blocks == 32 and kv.num_free_blocks == 32 and kv.num_used_blocks == 0
    assert kv.num_tokens_capacity == 32 * BS and kv.num_groups == 1
    assert kv.blocks_for_tokens(9) == 3 and kv.block_table("nobody") == []


def test_allocate_grow_and_free_leave_every_block_free(kv: KVCache):
    tokens = list(range(100, 110))
    kv.begin_step()
    result = kv.allocate_slots("a", len(tokens), 20)
    assert result is not None and result.new_block_ids == kv.block_table("a")
    assert kv.num_used_blocks == len(kv.block_table("a")) >= kv.blocks_for_tokens(len(tokens))
    kv.mark_pending("a", tokens, len(tokens))
    kv.cache_full_blocks("a", tokens, len(tokens))
    assert kv.allocate_slots("a", 14, 20) is not None and len(kv.block_table("a")) >= kv.blocks_for_tokens(14)
    assert kv.num_allocated_slots() == kv.num_used_blocks * BS
    assert len(kv.block_states()) == kv.num_blocks and kv.block_states().count(".") <= kv.num_free_blocks
    assert kv.external_fragmentation_slots(None) == 0
    kv.truncate("a", 10)
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks and kv.block_table("a") == []


def test_a_cache_too_small_answers_none_and_holds_nothing(kv: KVCache):
    assert kv.allocate_slots("big", 33 * BS, 33 * BS) is None
    assert kv.num_free_blocks == kv.num_blocks


def test_the_prefix_cache_capabilities_answer_on_every_layout(kv: KVCache):
    prompt = list(range(1, 13))  # three full blocks
    assert kv.allocate_slots("a", len(prompt), 16) is not None
    kv.cache_full_blocks("a", prompt, len(prompt))
    kv.free("a")
    hit = kv.find_cached_prefix(prompt + [99])
    if kv.supports_prefix_caching:
        assert len(hit) == 3 and kv.cached_tokens(hit) == 12 and kv.num_cached_blocks == 3
        assert [stored for stored, _ in kv.drain_events()] == [True, True, True] and kv.drain_events() == []
        kv.reset_prefix_cache()
        assert kv.find_cached_prefix(prompt + [99]) == [] and kv.num_cached_blocks == 0
        assert [stored for stored, _ in kv.drain_events()] == [False, False, False]
    else:
        assert hit == [] and kv.num_cached_blocks == 0 and kv.drain_events() == []
        kv.reset_prefix_cache()  # nothing to forget: a no-op, never an error
    assert kv.num_prefix_evictions == 0 and kv.num_blocks_freed_by_window == 0
    assert kv.num_free_blocks == kv.num_blocks


def test_the_pages_capability_answers_on_every_layout(kv: KVCache):
    if not kv.supports_pages:
        assert kv.allocate_pages(4) is None and kv.num_page_blocks == 0
        return
    first = kv.allocate_pages(4)
    assert first is not None and kv.num_page_blocks == 4
    # Pages are neither free nor held by requests; the dashboard draws them as "a".
    assert kv.num_free_blocks == kv.num_blocks - 4 and kv.num_used_blocks == 0
    assert kv.block_states()[first : first + 4] == "aaaa"
    assert kv.allocate_slots("a", 8 * BS, 8 * BS) is not None
    assert first not in kv.block_table("a")
    kv.free("a")
    kv.free_pages(first)
    assert kv.num_page_blocks == 0 and kv.num_free_blocks == kv.num_blocks


def test_events_are_recorded_only_when_the_cache_is_made_to():
    quiet = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    quiet.allocate_slots("a", 8)
    quiet.cache_full_blocks("a", list(range(8)), 8)
    assert quiet.drain_events() == []


def test_the_scheduler_runs_requests_to_the_end_on_every_layout(kv: KVCache):
    scheduler = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4)
    requests = [make_request(f"r{i}", 6, 4) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(40):
        if not scheduler.num_unfinished:
            break
        run_step(scheduler)
    assert scheduler.num_unfinished == 0 and kv.num_free_blocks == kv.num_blocks


def test_no_module_probes_a_kv_cache_with_getattr():
    """What a cache can do is in the protocol: no `getattr(<...kv...>, ...)` / `hasattr` probe of one."""
    package = Path(__file__).resolve().parent.parent / "pagedllm"
    probes = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                target = ast.unparse(node.args[0]) if node.args else ""
                if "kv" in target.lower() or "pool" in target.lower():
                    probes.append(f"{path.relative_to(package)}:{node.lineno}: {ast.unparse(node)}")
    assert probes == [], "\n".join(probes)
