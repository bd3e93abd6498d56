"""Prefix caching in the block pool and KV cache manager (pure Python)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager, block_key
from pagedllm.core.scheduler import Scheduler
from tests.test_block_pool import assert_counts_equal_holders
from tests.test_scheduler import make_request, run_step


def computed(kv: KVCacheManager, rid: str, tokens: list[int], cached: list[int] | None = None) -> None:
    """Admit `rid` with all of `tokens` computed (hits first), as a prefill step would."""
    assert kv.allocate_slots(rid, len(tokens), cached_blocks=cached) is not None
    kv.cache_full_blocks(rid, tokens, len(tokens))


def test_a_second_request_reuses_the_first_ones_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    computed(kv, "a", prompt)
    hits = kv.find_cached_prefix(prompt[:9] + [99])
    assert hits == kv.block_table("a")[:2]
    computed(kv, "b", prompt[:9] + [99], hits)
    assert kv.block_table("b")[:2] == hits and kv.block_table("b")[2] != kv.block_table("a")[2]
    assert [kv.pool.ref_counts[b] for b in hits] == [2, 2]
    assert kv.num_used_blocks == 4  # 3 for a, 1 more for b


def test_the_last_token_is_never_served_from_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 9))  # exactly 2 blocks
    computed(kv, "a", prompt)
    assert len(kv.find_cached_prefix(prompt)) == 1  # the second block holds the last token: recomputed
    assert len(kv.find_cached_prefix(prompt + [5])) == 2


def test_a_different_earlier_block_changes_every_later_key():
    kv = KVCacheManager(num_blocks=10, block_size=2, enable_prefix_caching=True)
    computed(kv, "a", [1, 2, 3, 4, 5])
    assert kv.find_cached_prefix([9, 2, 3, 4, 5]) == []  # same second block, other parent
    assert kv.find_cached_prefix([1, 2, 3, 9, 5]) == kv.block_table("a")[:1]


def test_freed_blocks_stay_findable_until_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    computed(kv, "a", [1, 2, 3, 4])
    computed(kv, "b", [5, 6, 7, 8])
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 4
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 0])) == 2
    # a was freed first, so its blocks go first; tail before head within a request.
    kv.allocate_slots("c", 2)
    assert kv.pool.num_evictions == 1
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 0])) == 1  # a's tail block was evicted, its head survives
    assert len(kv.find_cached_prefix([5, 6, 7, 8, 0])) == 2


def test_a_hit_on_free_blocks_counts_them_against_the_free_list():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    computed(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    hits = kv.find_cached_prefix([1, 2, 3, 4, 5])
    assert len(hits) == 2
    # 3 free blocks, 2 of them are the hits: 3 more tokens need 2 new blocks, only 1 remains.
    assert kv.allocate_slots("b", 7, cached_blocks=hits) is None
    assert "b" not in kv.block_tables and kv.num_free_blocks == 3
    assert kv.allocate_slots("b", 6, cached_blocks=hits) is not None
    assert kv.num_free_blocks == 0 and kv.pool.num_evictions == 0


def test_scheduler_skips_cached_tokens_and_counts_the_hit_rate():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(make_request("a", 10, max_tokens=1))
    run_step(s)  # a: prefilled and finished; its 2 full blocks stay cached
    s.add_request(make_request("b", 10, max_tokens=1))
    out, _ = run_step(s)
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(8, 2)]
    assert (s.prefix_cache_queried_tokens, s.prefix_cache_hit_tokens) == (20, 8)
    assert kv.num_used_blocks == 0


def test_a_request_admitted_in_the_same_step_shares_blocks_being_computed():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    s.add_request(make_request("a", 10, max_tokens=2))
    s.add_request(make_request("b", 10, max_tokens=2))
    out, _ = run_step(s)
    # b finds a's two full blocks although a computes them in this very step: b computes only 2 tokens.
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in out.scheduled] == [("a", 0, 10), ("b", 8, 2)]
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert s.prefix_cache_hit_tokens == 8 and kv.pool.num_cached_blocks == 2
    out, _ = run_step(s)  # nothing pending carries over: the blocks are cached now
    assert not kv._pending


def test_without_prefix_caching_nothing_is_found():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    computed(kv, "a", list(range(9)))
    assert kv.find_cached_prefix(list(range(9))) == []


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(2, 16),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "finish"]), st.integers(0, 5), st.integers(0, 3), st.integers(1, 9)
        ),
        max_size=60,
    ),
)
def test_random_hits_growth_and_frees_keep_counts_right(num_blocks, ops):
    """Prompts are drawn from a few shared prefixes so hits, partial hits and evictions all happen."""
    bs = 2
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True)
    prefixes = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9, 9, 9], [1, 2, 8, 8]]
    tokens: dict[str, list[int]] = {}
    for op, rid, which, amount in ops:
        request_id = f"r{rid}"
        if op == "admit" and request_id not in tokens:
            prompt = prefixes[which][: max(1, amount)] + [rid + 100]
            hits = kv.find_cached_prefix(prompt)
            parent = kv.root_key
            for index, block in enumerate(hits):  # a hit holds exactly the tokens asked for, at that position
                parent = block_key(parent, prompt[index * bs : (index + 1) * bs])
                assert kv.pool.block_keys[block] == parent
            if kv.allocate_slots(request_id, len(prompt), cached_blocks=hits) is not None:
                tokens[request_id] = prompt
                kv.cache_full_blocks(request_id, prompt, len(prompt))
        elif op == "grow" and request_id in tokens:
            longer = tokens[request_id] + [amount] * amount
            if kv.allocate_slots(request_id, len(longer)) is not None:
                tokens[request_id] = longer
                kv.cache_full_blocks(request_id, longer, len(longer))
        elif op == "finish" and request_id in tokens:
            kv.free(request_id)
            del tokens[request_id]

        assert_counts_equal_holders(kv)
        for key, block in kv.pool.cached.items():
            assert kv.pool.block_keys[block] == key
        # Every cached block a request holds sits where its content key says: same tokens, same position.
        for request_id, table in kv.block_tables.items():
            for index, key in enumerate(kv.block_keys.get(request_id, [])):
                block = table[index]
                # None: another block held this content first (computed twice at once), so this one is not cached.
                assert kv.pool.block_keys[block] in (None, key)
    for request_id in list(tokens):
        kv.free(request_id)
    assert kv.num_free_blocks == num_blocks and all(c == 0 for c in kv.pool.ref_counts)


def test_a_salt_keeps_requests_whose_kv_differs_apart():
    """Blocks cached under one salt (a length-dependent RoPE's regime) are found only under it."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))
    assert kv.allocate_slots("a", len(prompt)) is not None
    kv.cache_full_blocks("a", prompt, len(prompt), salt=b"rope:long")
    assert kv.find_cached_prefix(prompt) == []
    assert kv.find_cached_prefix(prompt, salt=b"rope:other") == []
    assert kv.find_cached_prefix(prompt, salt=b"rope:long") == kv.block_table("a")[:2]


def test_the_scheduler_salts_each_request_by_its_prompt_length():
    """With a `prompt_salt` (LongRoPE past 12 tokens, say), a short prompt does not reuse blocks
    a long one computed, though its tokens are the long one's first ones."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8, prompt_salt=lambda n: b"long" if n > 12 else b"")
    s.add_request(make_request("long", 14, max_tokens=1))
    run_step(s)
    s.add_request(make_request("also-long", 13, max_tokens=1))
    run_step(s)
    assert s.prefix_cache_hit_tokens == 12  # the same regime: its three full blocks
    s.add_request(make_request("short", 10, max_tokens=1))
    out, _ = run_step(s)
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(0, 10)]
    assert s.prefix_cache_hit_tokens == 12
