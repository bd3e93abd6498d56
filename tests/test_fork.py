"""Forking for n>1 and copy-on-write, in the KV cache manager and scheduler (pure Python)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from tests.test_block_pool import assert_counts_equal_holders


def sample_group(prompt_len: int, n: int, max_tokens: int = 4) -> list[Request]:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        Request(f"g#{i}", list(range(1, prompt_len + 1)), params.for_sample(i), eos_token_id=0, max_model_len=100)
        for i in range(n)
    ]
    for child in seqs[1:]:
        child.fork_parent = seqs[0]
    seqs[0].forks = seqs[1:]
    return seqs


def step(s: Scheduler, tokens: dict[str, int] | None = None):
    out = s.schedule()
    sampled = {}
    for chunk in out.scheduled:
        if chunk.samples:
            for seq in (chunk.request, *chunk.forks):
                sampled[seq.request_id] = [(tokens or {}).get(seq.request_id, 7)]
    s.update(out, sampled)
    return out


def test_the_prompt_is_computed_once_and_the_partial_block_is_copied_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    parent, a, b = sample_group(prompt_len=6, n=3)
    s.add_request(parent)
    out = step(s, {"g#0": 10, "g#1": 11, "g#2": 12})
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("g#0", 6)]
    assert out.scheduled[0].forks == [a, b]
    assert [r.output_token_ids for r in (parent, a, b)] == [[10], [11], [12]]
    shared = list(kv.block_table("g#0"))
    assert kv.block_table("g#1") == kv.block_table("g#2") == shared
    assert [kv.pool.ref_counts[x] for x in shared] == [3, 3] and kv.num_used_blocks == 2

    out = step(s)  # each writes position 6, inside the shared partial block 1
    assert [c.num_new_tokens for c in out.scheduled] == [1, 1, 1]
    assert len(out.block_copies) == 2  # the last holder writes in place
    assert all(src == shared[1] for src, _ in out.block_copies)
    tables = [kv.block_table(r.request_id) for r in (parent, a, b)]
    assert {t[0] for t in tables} == {shared[0]} and kv.pool.ref_counts[shared[0]] == 3
    assert len({t[1] for t in tables}) == 3 and all(kv.pool.ref_counts[t[1]] == 1 for t in tables)
    while s.num_unfinished:
        step(s)
    assert kv.num_free_blocks == 10


def test_a_prompt_of_whole_blocks_forks_without_any_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add_request(sample_group(prompt_len=8, n=2)[0])
    step(s)
    out = step(s)  # position 8 starts a new block for each
    assert out.block_copies == [] and kv.num_used_blocks == 4


def test_aborting_before_the_fork_frees_everything():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=4, max_num_seqs=8)
    seqs = sample_group(prompt_len=10, n=3)
    s.add_request(seqs[0])
    step(s)  # the prompt is only partly computed: nobody forked yet
    for seq in reversed(seqs):
        s.finish(seq, FinishReason.ABORT)
    assert s.num_unfinished == 0 and kv.num_free_blocks == 10 and not seqs[0].forks


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(2, 14),
    block_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "fork", "write", "free"]), st.integers(0, 6), st.integers(1, 6)),
        max_size=60,
    ),
)
def test_forks_hits_and_writes_never_touch_a_shared_block_and_never_leak(num_blocks, block_size, ops):
    """A model of the cache contents, with prefix caching on: new requests start from a few shared
    prompts (so they hit, partly hit and evict cached blocks), fork, write and finish in any order,
    and every request always reads back exactly its own tokens."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    contents: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
    tokens: dict[str, list[int]] = {}
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9], [8, 8, 8, 8, 8, 8, 8]]
    clock = iter(range(100, 10**6))

    def write(rid: str, new: list[int], cached: list[int] | None = None) -> bool:
        done = len(tokens.get(rid, [])) if cached is None else len(cached) * block_size
        result = kv.allocate_slots(rid, done + len(new), cached_blocks=cached, num_computed_tokens=done)
        if result is None:
            return False
        for src, dst in result.copies:
            contents[dst] = dict(contents.get(src, {}))
        table = kv.block_table(rid)
        seq = tokens.setdefault(rid, [])
        if cached is not None:
            seq.extend(new_prompt[:done])
        for token in new:
            block, offset = table[len(seq) // block_size], len(seq) % block_size
            assert kv.pool.ref_counts[block] == 1, "a shared block was written in place"
            contents.setdefault(block, {})[offset] = token
            seq.append(token)
        kv.cache_full_blocks(rid, seq, len(seq))
        return True

    for op, rid, amount in ops:
        request_id = f"r{rid}"
        if op == "new" and request_id not in tokens:
            new_prompt = prompts[amount % 3][: 2 + amount]
            hits = kv.find_cached_prefix(new_prompt)
            if not write(request_id, new_prompt[len(hits) * block_size :], hits):
                tokens.pop(request_id, None)
        elif op == "fork" and request_id in tokens:
            child = f"r{rid}.{next(clock)}"
            kv.fork(request_id, child)
            tokens[child] = list(tokens[request_id])
        elif op == "write" and request_id in tokens:
            write(request_id, [next(clock) for _ in range(amount)])
        elif op == "free" and request_id in tokens:
            kv.free(request_id)
            del tokens[request_id]

        assert_counts_equal_holders(kv)
        for r, seq in tokens.items():
            table = kv.block_table(r)
            assert [contents[table[p // block_size]][p % block_size] for p in range(len(seq))] == seq
    for r in list(tokens):
        kv.free(r)
    assert kv.num_free_blocks == num_blocks and all(c == 0 for c in kv.pool.ref_counts)
