"""Speculative decoding's pure-Python parts: the drafters, the policy, and the paged cache under
random acceptance (the scheduler with a scripted model, no torch)."""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.arith import cdiv
from pagedllm.core.drafting import ROOT, Draft, NgramDrafter, SuffixDrafter, SuffixTree
from pagedllm.core.kv_cache_manager import FREED, KVCacheManager, block_key
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.speculation import Speculation, StepCost
from tests.test_fork import sample_group

# --- drafters ---------------------------------------------------------------------------------


def test_ngram_drafts_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 0, 2, 3]
    # [2, 3] occurred at 1-2 (then 4, 5) and 6-7 (then 7, 8): the latest wins.
    assert drafter.propose("r", tokens, 3).token_ids == [7, 8, 0]
    # Longer matches first: [9, 2, 3] only ever continued with 7.
    assert drafter.propose("r", [*tokens, 9, 2, 3], 2).token_ids == [7, 8]
    assert drafter.propose("r", [*tokens, 9, 2, 3], 0) == Draft.empty()
    assert drafter.propose("s", [5, 6, 7, 8], 4) == Draft.empty()  # nothing repeats
    drafter.finish("r", [])
    assert "r" not in drafter._index


def test_ngram_index_grows_with_the_sequence_as_a_fresh_one_would():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(300)]
    grown, fresh = NgramDrafter(), NgramDrafter()
    for end in range(2, 300, 7):
        assert grown.propose("r", tokens[:end], 5) == fresh.propose(f"f{end}", tokens[:end], 5)


def test_suffix_tree_counts_contexts_and_forgets_them():
    tree = SuffixTree(depth=3)
    tree.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    node = tree.match([7, 1, 2], min_length=2)
    assert node is not None and tree.counts[node] == 3
    assert {t: tree.counts[c] for t, c in tree.children[node].items()} == {3: 2, 4: 1}
    grown = tree.num_nodes
    tree.add([1, 2, 3, 1, 2, 4, 1, 2, 3], sign=-1)
    assert not tree.children[ROOT] and tree.num_nodes == 1
    tree.add([1, 2, 3, 1, 2, 4, 1, 2, 3])  # emptied nodes are given out again
    assert tree.num_nodes == grown and len(tree.counts) == grown


def test_suffix_tree_holds_nothing_the_garbage_collector_tracks():
    rng = random.Random(0)
    tree = SuffixTree(depth=16)
    tree.add([rng.randrange(50) for _ in range(2000)])
    assert tree.num_nodes > 10_000
    assert not any(gc.is_tracked(kids) for kids in tree.children if kids is not None)


def test_suffix_drafter_follows_the_most_frequent_continuation():
    drafter = SuffixDrafter(depth=8, min_match=2, min_confidence=0.4)
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 3, 5, 6]
    draft = drafter.propose("r", tokens, 4)
    # After [5, 6]: 7 always (3 of 3); after [5, 6, 7]: 8 twice, 9 once; after 8: 1 or 2, each
    # 1 of 2 (the first seen wins the tie); after [.., 8, 1]: 5.
    assert draft.token_ids == [7, 8, 1, 5]
    assert draft.confidence == [1.0, pytest.approx(2 / 3), 0.5, 1.0]
    # Below min_confidence the draft stops: 9 followed [5, 6, 7] once in 3.
    assert SuffixDrafter(depth=8, min_confidence=0.6).propose("s", tokens, 4).token_ids == [7, 8]


def test_suffix_drafts_run_past_the_trees_depth():
    drafter = SuffixDrafter(depth=4)
    tokens = list(range(100, 120)) + list(range(100, 110))  # quoting a passage longer than the depth
    assert drafter.propose("r", tokens, 8).token_ids == list(range(110, 118))


def test_suffix_drafter_shares_finished_outputs_and_evicts_the_oldest():
    drafter = SuffixDrafter(depth=6, min_match=2, cross_request=True, max_cached_requests=1)
    drafter.finish("a", [10, 11, 12, 13])
    assert drafter.propose("b", [1, 2, 10, 11], 3).token_ids == [12, 13]
    drafter.finish("c", [20, 21, 22])  # "a" leaves the shared tree
    assert drafter.propose("d", [1, 2, 10, 11], 3) == Draft.empty()
    assert drafter.propose("e", [20, 21], 3).token_ids == [22]


# --- the policy -------------------------------------------------------------------------------


class Scripted:
    """A drafter proposing fixed tokens per request."""

    def __init__(self, drafts: dict[str, list[int]]) -> None:
        self.drafts = drafts

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft:
        tokens = self.drafts.get(request_id, [])[:max_tokens]
        return Draft(tokens, [1.0] * len(tokens))

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        pass


def decoding(request_id: str, max_tokens: int = 50) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), max_model_len=100)
    r.append_token(4)
    r.num_computed_tokens = 3
    return r


class Counting(Scripted):
    """A scripted drafter that counts how often it is asked."""

    def __init__(self, drafts: dict[str, list[int]]) -> None:
        super().__init__(drafts)
        self.calls = 0

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft:
        self.calls += 1
        return super().propose(request_id, token_ids, max_tokens)


def drafts_in_first_decode_step(num_requests: int, limits: tuple[int, ...], arrival: int = 0) -> int:
    """Draft tokens scheduled in the first decode step of `num_requests` requests that all draft well
    (and an `arrival`-token prompt admitted in that step)."""
    kv = KVCacheManager(400, 4, enable_prefix_caching=False)
    drafter = Scripted({f"r{i}": [7] * 8 for i in range(num_requests)})
    spec = Speculation(drafter, max_draft_tokens=8, cost=StepCost(1e-3))
    scheduler = Scheduler(kv, 1024, 32, speculation=spec, draft_row_limits=limits)
    for i in range(num_requests):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50), max_model_len=100))
    prefill = scheduler.schedule()
    scheduler.update(prefill, {chunk.request.request_id: [5] for chunk in prefill.scheduled})
    if arrival:
        scheduler.add_request(Request("late", [1] * arrival, SamplingParams(max_tokens=5), max_model_len=100))
    step = scheduler.schedule()
    assert len(step.scheduled) == num_requests + (1 if arrival else 0)
    rows = sum(chunk.num_new_tokens for chunk in step.scheduled)
    drafts = sum(len(chunk.draft_token_ids) for chunk in step.scheduled)
    assert rows == num_requests + arrival + drafts
    assert len(kv.block_table("r0")) == cdiv(3 + 1 + len(step.scheduled[0].draft_token_ids), 4)
    return drafts


def test_drafts_keep_a_steps_rows_within_the_kernels_row_limits():
    assert drafts_in_first_decode_step(2, ()) == 16  # not limited
    assert drafts_in_first_decode_step(2, (4, 16)) == 2  # up to 4 rows
    assert drafts_in_first_decode_step(4, (4, 16)) == 0  # at the limit already
    assert drafts_in_first_decode_step(5, (4, 16)) == 11  # up to 16 rows
    assert drafts_in_first_decode_step(17, (4, 16)) == 0  # past the last limit, nothing is promised
    # A prompt admitted in the same step counts among the step's rows.
    assert drafts_in_first_decode_step(5, (4, 16), arrival=5) == 6  # 10 rows, 16 with drafts
    assert drafts_in_first_decode_step(5, (4, 16), arrival=10) == 1
    # Its sampled row (its whole prompt fits) would take the sampled rows from 4 to 5 with the one
    # draft planned: the draft goes, and its slot with it.
    assert drafts_in_first_decode_step(3, (4, 16), arrival=2) == 0
    assert drafts_in_first_decode_step(3, (4, 16)) == 1


def test_a_drafter_that_finds_nothing_is_asked_less_often_until_it_finds_something():
    drafter = Counting({})
    spec = Speculation(drafter, max_draft_tokens=4, cost=StepCost(0.1))
    request = decoding("a")
    for _ in range(90):
        assert spec.plan([request], 0, 100) == {}
    # Asked at steps 1, 3, 6, 11, 20, then every ninth step.
    assert drafter.calls == 5 + (90 - 20) // 9
    drafter.drafts["a"] = [7, 7]
    steps = 0
    while not spec.plan([request], 0, 100):
        steps += 1
    assert steps < 9
    calls = drafter.calls
    for _ in range(5):
        assert spec.plan([request], 0, 100)
    assert drafter.calls == calls + 5  # a draft was verified: asked every step again
    spec.finish(request)
    assert not spec._backoff


def test_a_good_record_earns_long_drafts_and_a_bad_one_none():
    spec = Speculation(Scripted({"a": [7] * 8}), max_draft_tokens=8, cost=StepCost(0.1))
    assert len(spec.plan([decoding("a")], 0, 100)["a"]) == 4  # the prior: 3 in 4 draft tokens hold
    for _ in range(5):
        spec.record("a", 8, 8)
    assert len(spec.plan([decoding("a")], 0, 100)["a"]) == 8
    for _ in range(10):
        spec.record("a", 4, 0)
    assert len(spec.plan([decoding("a")], 0, 100)["a"]) == 1
    spec.cost = StepCost(1.0)  # where a row costs as much as a step's base, a bad record gets no drafts
    assert spec.plan([decoding("a")], 0, 100) == {}
    for _ in range(60):  # no drafts verified: the record drifts back towards the pooled one
        spec.plan([decoding("a")], 0, 100)
    assert spec.plan([decoding("a")], 0, 100)
    assert spec.acceptance("new") > 0.7  # the pool remembers that most drafts held


def test_a_pool_that_fell_below_the_price_is_tried_again():
    """Early rejections can take the pooled record below what a draft must reach; steps without
    drafts bring it back towards the prior, so drafting does not end for good."""
    spec = Speculation(Scripted({"a": [7] * 4, "b": [7] * 4}), max_draft_tokens=4, cost=StepCost(1.0))
    assert spec.plan([decoding("a")], 0, 100)  # alone, a row priced as the base needs 0.5: the prior 0.75 pays
    for _ in range(4):
        spec.record("a", 4, 0)
    spec.finish(decoding("a"))
    assert spec.plan([decoding("b")], 0, 100) == {}  # the pool fell below the price
    waited = 0
    while not spec.plan([decoding("b")], 0, 100):
        waited += 1
        assert waited < 500, f"pooled acceptance stuck at {spec.acceptance('new'):.3f}"
    assert waited > 20  # not at once: the pool remembers for a while


def test_drafts_stop_where_rows_cost_more_than_they_bring():
    ids = [f"r{i}" for i in range(64)]
    spec = Speculation(Scripted({i: [7] * 4 for i in ids}), max_draft_tokens=4, cost=StepCost(0.1))
    for i in ids:
        spec.record(i, 4, 3)
    alone = spec.plan([decoding(ids[0])], 0, 1000)
    crowd = spec.plan([decoding(i) for i in ids], 0, 1000)
    assert sum(map(len, alone.values())) > 1 and sum(map(len, crowd.values())) == 0
    # A step's token allowance and a request's own max_tokens bound the drafts.
    assert sum(map(len, spec.plan([decoding(i) for i in ids[:8]], 0, 5).values())) <= 5
    assert len(spec.plan([decoding(ids[1], max_tokens=3)], 0, 100)[ids[1]]) == 1


# --- the paged cache under random acceptance --------------------------------------------------

VOCAB = 5


def model_token(tokens: list[int]) -> int:
    """The scripted model's greedy token after `tokens`."""
    return (tokens[-1] * 3 + (tokens[-2] if len(tokens) > 1 else 1) + len(tokens) % 2) % VOCAB


class RandomDrafter:
    """Drafts that are the model's own tokens for a random stretch, then random."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, request_id: str, token_ids: list[int], max_tokens: int) -> Draft:
        tokens, right = list(token_ids), self.rng.randrange(max_tokens + 1)
        draft = []
        for j in range(self.rng.randrange(max_tokens + 1)):
            draft.append(model_token(tokens) if j < right else self.rng.randrange(VOCAB))
            tokens.append(draft[-1])
        return Draft(draft, [1.0] * len(draft))

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        pass


def verify(chunk) -> list[int]:
    """What the model runner returns for a chunk: the model's token at each position while the
    drafts match it."""
    tokens = chunk.request.token_ids[: chunk.start + 1]
    emitted = []
    for j in range(len(chunk.draft_token_ids) + 1):
        emitted.append(model_token(tokens + chunk.draft_token_ids[:j]))
        if j == len(chunk.draft_token_ids) or emitted[-1] != chunk.draft_token_ids[j]:
            return emitted
    return emitted


def check_cache(kv: KVCacheManager, scheduler: Scheduler) -> None:
    num_groups, bs = kv.num_groups, kv.block_size
    held = [b for table in kv.block_tables.values() for b in table if b != FREED]
    for block in set(held):
        assert kv.pool.ref_counts[block] == held.count(block) and not kv.pool.is_free(block)
    assert len(set(held)) + kv.num_free_blocks == kv.num_blocks
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        # Blocks cover the computed tokens and at most the next one: none wholly past them.
        assert len(table) // num_groups <= max(cdiv(request.num_computed_tokens + 1, bs), 1)
        # Named blocks hold computed tokens only, and their keys are the request's actual tokens.
        keys = kv.block_keys.get(request.request_id, [])
        assert len(keys) <= request.num_computed_tokens // bs
        parent = kv.root_key
        for i, key in enumerate(keys):
            parent = block_key(parent, request.token_ids[i * bs : (i + 1) * bs])
            assert key == parent


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4]),
    windows=st.sampled_from([(0,), (0, 3), (5, 0)]),
    num_blocks=st.integers(50, 120),
    max_draft=st.integers(1, 6),
    budget=st.integers(4, 32),
)
def test_random_acceptance_keeps_counts_keys_and_tokens_exact(seed, block_size, windows, num_blocks, max_draft, budget):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, group_windows=windows)
    # Asked every step: its empty drafts would otherwise put off asking.
    spec = Speculation(RandomDrafter(seed), max_draft_tokens=max_draft, cost=StepCost(1e-3), max_backoff_steps=0)
    scheduler = Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=6, speculation=spec)
    requests = []
    shared_prompt = [rng.randrange(VOCAB) for _ in range(6)]
    for i in range(4):
        prompt = shared_prompt + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))]
        params = SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True)
        request = Request(f"r{i}", prompt, params, max_model_len=40)
        scheduler.add_request(request)
        requests.append(request)
    group = sample_group(prompt_len=5, n=2, max_tokens=8)  # forks, copy-on-write, then drafts
    scheduler.add_request(group[0])
    requests += group
    for _ in range(400):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        for chunk in out.scheduled:
            need = cdiv(chunk.start + chunk.num_new_tokens, block_size) * kv.num_groups
            assert len(chunk.block_table) >= need
            assert len(chunk.draft_token_ids) <= max_draft
        sampled = {}
        for chunk in out.scheduled:
            if chunk.samples:
                for sequence in (chunk.request, *chunk.forks):
                    sampled[sequence.request_id] = (
                        verify(chunk) if chunk.draft_token_ids else [model_token(sequence.token_ids)]
                    )
        scheduler.update(out, sampled)
        check_cache(kv, scheduler)
    assert not scheduler.num_unfinished
    assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.pool.ref_counts)
    for request in requests:  # exactly what one token a step gives
        tokens = list(request.prompt_token_ids)
        for _ in range(request.num_output_tokens):
            tokens.append(model_token(tokens))
        assert request.token_ids == tokens
        assert request.num_output_tokens == request.sampling_params.max_tokens
    if budget >= 12:  # room for drafts beside 6 requests, once the prompts waiting for the budget are in
        assert spec.stats.draft_tokens > 0
