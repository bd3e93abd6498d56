"""The data-parallel router (pagedllm/replicas/router.py) and the block-pool events it reads:
placements follow the replicas' own cached blocks, load wins past the stated imbalance, dead
replicas take nothing, and in-flight counts and pending keys return to zero."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager, prompt_block_keys, root_key
from pagedllm.replicas.router import NoReplicaError, Router

BS = 4


def cached_on(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    assert kv.allocate_slots(rid, len(tokens)) is not None
    kv.cache_full_blocks(rid, tokens, len(tokens))


def test_the_pool_reports_what_it_stores_and_evicts_in_order():
    pool = BlockPool(2)
    pool.record_events = True
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ka")
    pool.cache_block(b, b"kb")
    pool.free_blocks([a, b])
    assert pool.drain_events() == [(True, b"ka"), (True, b"kb")]
    pool.allocate(1)  # evicts the least recently freed: a's content
    assert pool.drain_events() == [(False, b"ka")] and pool.drain_events() == []
    quiet = BlockPool(1)
    quiet.cache_block(quiet.allocate(1)[0], b"k")
    assert quiet.drain_events() == []  # off unless asked for


def test_the_router_computes_the_keys_the_cache_names_its_blocks_by():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, record_events=True)
    prompt = list(range(1, 12))  # 2 full blocks (the third would end with the last token... not full)
    cached_on(kv, "a", prompt)
    stored = [key for is_stored, key in kv.drain_events() if is_stored]
    assert stored == prompt_block_keys(prompt + [99], BS, root_key())[:2]
    salted = prompt_block_keys(prompt + [99], BS, root_key(request_salt=b"rope:long"))
    assert set(salted).isdisjoint(stored)


def test_a_request_goes_where_its_prefix_is_cached():
    router = Router(2, BS)
    shared = list(range(100, 140))  # 10 blocks
    keys = prompt_block_keys(shared + [1], BS, root_key())
    router.apply_events(1, [(True, k) for k in keys])
    placement = router.route(shared + [7, 8, 9])
    assert (placement.replica, placement.hit_blocks) == (1, 10)
    other = router.route(list(range(500, 540)))  # nothing cached anywhere: the least loaded
    assert other.replica == 0 and other.hit_blocks == 0


def test_requests_sharing_a_new_prefix_follow_the_first_before_its_events_arrive():
    router = Router(3, BS)
    prompt = list(range(1, 41))
    first = router.route(prompt + [1])
    follow = [router.route(prompt + [i]) for i in range(2, 5)]
    assert {p.replica for p in follow} == {first.replica}
    for placement in [first, *follow]:
        router.finished(placement)
    assert all(view.pending == {} and view.in_flight == 0 for view in router.replicas)


def test_load_wins_past_the_imbalance():
    router = Router(2, BS, max_imbalance=2)
    prompt = list(range(1, 41))
    router.apply_events(0, [(True, k) for k in prompt_block_keys(prompt + [0], BS, root_key())])
    placements = [router.route(prompt + [i]) for i in range(5)]
    # Replica 0 takes requests until it has 3 more in flight than replica 1; then replica 1 does,
    # and from then on it expects the prefix too, so the less loaded of the two takes the next.
    assert [p.replica for p in placements] == [0, 0, 0, 1, 1]
    assert router.num_routed_by_load == 1


def test_evicted_blocks_stop_attracting_requests():
    router = Router(2, BS)
    prompt = list(range(1, 41))
    keys = prompt_block_keys(prompt + [0], BS, root_key())
    router.apply_events(1, [(True, k) for k in keys])
    router.apply_events(1, [(False, keys[0])])  # the first block gone: no run from the start
    assert router.route(prompt + [5]).hit_blocks == 0


def test_round_robin_and_least_loaded_ignore_the_cache():
    prompt = list(range(1, 41))
    keys = prompt_block_keys(prompt + [0], BS, root_key())
    rr = Router(3, BS, policy="round-robin")
    rr.apply_events(2, [(True, k) for k in keys])
    assert [rr.route(prompt + [i]).replica for i in range(4)] == [0, 1, 2, 0]
    ll = Router(2, BS, policy="least-loaded")
    ll.apply_events(1, [(True, k) for k in keys])
    assert [ll.route(prompt + [i]).replica for i in range(3)] == [0, 1, 0]


def test_a_dead_replica_takes_nothing_and_comes_back_empty():
    router = Router(2, BS)
    prompt = list(range(1, 41))
    router.apply_events(0, [(True, k) for k in prompt_block_keys(prompt + [0], BS, root_key())])
    placed = router.route(prompt + [1])
    assert placed.replica == 0
    router.mark_down(0)
    router.finished(placed)  # its request ends after the replica died: nothing to undo
    assert router.route(prompt + [2]).replica == 1
    with pytest.raises(NoReplicaError):  # the only live replica already failed this request
        router.route(prompt + [3], exclude=(1,))
    router.mark_down(1)
    with pytest.raises(NoReplicaError, match="every replica is down"):
        router.route(prompt)
    router.mark_up(0)
    assert router.route(prompt + [4]).replica == 0 and router.replicas[0].held == set()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="router policy must be one of prefix, least-loaded, round-robin"):
        Router(2, BS, policy="random")
    with pytest.raises(ValueError, match="at least one replica"):
        Router(0, BS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.booleans()), min_size=1, max_size=60))
def test_in_flight_counts_and_pending_keys_return_to_zero(ops):
    """Random prompts (six prefixes), random finish orders: once every request has ended, no replica
    has anything in flight or pending, and the in-flight count always equals what is unfinished."""
    router = Router(3, BS, max_imbalance=1)
    open_placements = []
    for prefix, length, finish_one in ops:
        loads = [view.in_flight for view in router.replicas]
        placement = router.route([prefix * 1000 + t for t in range(length)])
        assert loads[placement.replica] <= min(loads) + router.max_imbalance  # the stated rule
        open_placements.append(placement)
        if finish_one:
            router.finished(open_placements.pop(len(open_placements) // 2))
        for i, view in enumerate(router.replicas):
            assert view.in_flight == sum(1 for p in open_placements if p.replica == i)
    for placement in open_placements:
        router.finished(placement)
    assert all(view.in_flight == 0 and view.pending == {} for view in router.replicas)


def test_every_policy_reports_the_hit_it_placed_on():
    prompt = list(range(1, 41))
    keys = prompt_block_keys(prompt + [0], BS, root_key())
    for policy in ("prefix", "least-loaded", "round-robin"):
        router = Router(2, BS, policy=policy)
        router.apply_events(0, [(True, k) for k in keys[:3]])
        assert router.route(prompt + [1]).hit_blocks == 3  # replica 0 either way, holding 3 blocks
