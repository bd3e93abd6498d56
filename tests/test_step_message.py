"""The tensor-parallel step messages (pure Python): a worker that applies rank 0's
increments holds exactly the scheduler's block tables, whatever the scheduler did."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import ScheduledRequest, Scheduler
from pagedllm.core.step_message import StepEncoder, WorkerBlockTables, shutdown_message


class FakeChunk:
    def __init__(self, start: int, token_ids: list[int], block_table: list[int], num_samples: int = 1) -> None:
        self.start, self.token_ids, self.block_table, self.num_samples = start, token_ids, block_table, num_samples
        self.num_new_tokens = len(token_ids)
        self.num_prompt_tokens = 32


def roundtrip(encoder: StepEncoder, worker: WorkerBlockTables, chunks, copies=()):
    message = encoder.encode(chunks, list(copies))
    return message, worker.apply(list(message))


def test_increments_cover_append_copy_on_write_reset_and_release():
    encoder, worker = StepEncoder(), WorkerBlockTables()
    # A new request with two prefix-cache blocks and one fresh one: the whole table goes out.
    message, plan = roundtrip(encoder, worker, [("a", FakeChunk(32, [5, 6, 7], [3, 9, 4]))])
    assert plan.chunks[0].block_table == [3, 9, 4] and plan.chunks[0].token_ids == [5, 6, 7]
    assert plan.chunks[0].start == 32 and plan.chunks[0].num_samples == 1 and plan.chunks[0].num_prompt_tokens == 32
    # A decode in the same block: nothing appended, only the token travels.
    message, plan = roundtrip(encoder, worker, [("a", FakeChunk(35, [8], [3, 9, 4]))])
    assert list(message) == [1, 1, 0, 0, encoder.handles["a"], 35, 1, 1, 32, 3, 0, 8]
    # Crossing into a new block appends one id.
    message, plan = roundtrip(encoder, worker, [("a", FakeChunk(48, [9], [3, 9, 4, 11]))])
    assert message[9:11].tolist() == [3, 1] and worker.tables[encoder.handles["a"]] == [3, 9, 4, 11]
    # Copy-on-write swaps the last block: keep 3, send the fresh id, and the copy.
    message, plan = roundtrip(encoder, worker, [("a", FakeChunk(49, [1], [3, 9, 4, 12]))], [(11, 12)])
    assert plan.block_copies == [(11, 12)] and plan.chunks[0].block_table == [3, 9, 4, 12]
    # Preempted and admitted again into other blocks: keep 0.
    message, plan = roundtrip(encoder, worker, [("a", FakeChunk(0, [1, 2], [7]))])
    assert message[9] == 0 and plan.chunks[0].block_table == [7]
    # Released: the next message drops the worker's table.
    handle = encoder.handles["a"]
    encoder.release("a")
    roundtrip(encoder, worker, [("b", FakeChunk(0, [1], [2]))])
    assert handle not in worker.tables and list(worker.tables.values()) == [[2]]
    assert worker.apply(list(shutdown_message())) is None


def test_a_malformed_message_is_a_clear_error():
    worker = WorkerBlockTables()
    with pytest.raises(ValueError, match="empty"):
        worker.apply([])
    with pytest.raises(ValueError, match="kind"):
        worker.apply([9])
    with pytest.raises(ValueError, match="keeps 2 blocks"):
        worker.apply([1, 1, 0, 0, 0, 0, 1, 1, 1, 2, 0, 5])
    with pytest.raises(ValueError, match="header accounts"):
        worker.apply([1, 0, 0, 0, 99])


def group(rid: str, prompt: list[int], n: int, max_tokens: int) -> Request:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        Request(f"{rid}#{i}", prompt, params.for_sample(i) if n > 1 else params, eos_token_id=0, max_model_len=200)
        for i in range(n)
    ]
    seqs[0].forks = seqs[1:]
    for child in seqs[1:]:
        child.fork_parent = seqs[0]
    return seqs[0]


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),  # which of three shared prompt stems (prefix-cache hits)
            st.integers(1, 20),  # own tokens after the stem
            st.integers(1, 3),  # n: forks copy on write
            st.integers(1, 12),  # max_tokens
            st.integers(0, 6),  # arrives at step
        ),
        min_size=1,
        max_size=10,
    ),
    num_blocks=st.integers(12, 40),
    aborts=st.sets(st.integers(0, 9), max_size=3),
)
def test_worker_tables_follow_the_scheduler(requests, num_blocks, aborts):
    """Prefix caching, forks with copy-on-write, preemption (a small cache), aborts and finishes:
    after every message the worker's table of every scheduled sequence is the scheduler's, and the
    worker holds tables only for sequences still alive."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=24, max_num_seqs=6)
    encoder, worker = StepEncoder(), WorkerBlockTables()
    stems = [[s * 100 + i for i in range(1, 9)] for s in range(3)]
    parents: list[Request] = []
    alive: dict[str, Request] = {}
    for step in range(200):
        for i, (stem, own, n, max_tokens, arrives) in enumerate(requests):
            if arrives == step:
                parent = group(str(i), stems[stem] + list(range(500, 500 + own)), n, max_tokens)
                try:
                    scheduler.add_request(parent)
                except ValueError:
                    continue  # can never fit this cache: refused up front
                parents.append(parent)
                alive |= {s.request_id: s for s in (parent, *parent.forks)}
        if step == 3:
            for i in aborts:
                if i < len(parents):
                    for s in (*parents[i].forks, parents[i]):
                        scheduler.finish(s, FinishReason.ABORT)
        for seq_id in [s for s, r in alive.items() if r.finished]:
            encoder.release(seq_id)
            del alive[seq_id]
        out = scheduler.schedule()
        if out.is_empty:
            if scheduler.num_unfinished == 0 and step > 6:
                break
            continue
        plan = worker.apply(list(encoder.encode(((c.request.request_id, c) for c in out.scheduled), out.block_copies)))
        assert plan.block_copies == out.block_copies
        for sent, chunk in zip(out.scheduled, plan.chunks):
            assert isinstance(sent, ScheduledRequest)
            assert chunk.block_table == kv.block_table(sent.request.request_id)
            assert (chunk.start, chunk.token_ids, chunk.num_samples) == (sent.start, sent.token_ids, sent.num_samples)
        assert set(worker.tables) <= {encoder.handles.get(s) for s in alive}
        sampled = {s.request_id: [7] for c in out.scheduled if c.samples for s in (c.request, *c.forks)}
        scheduler.update(out, sampled)
