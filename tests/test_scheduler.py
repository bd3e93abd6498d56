import pytest

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(
        rid,
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=0,
        max_model_len=1000,
        arrival_time=arrival,
    )


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {c.request.request_id: [token] for c in out.scheduled if c.samples}
    finished = scheduler.update(out, sampled)
    return out, finished


def test_prefill_then_decode_and_free_on_finish():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    r = make_request("a", 6, max_tokens=3)
    s.add_request(r)
    out, _ = run_step(s)
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(0, 6)]
    assert len(kv.block_table("a")) == 2
    out, _ = run_step(s)
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(6, 1)]
    _, finished = run_step(s)
    assert finished == [r] and r.finish_reason == FinishReason.LENGTH
    assert r.output_token_ids == [7, 7, 7]
    assert kv.num_free_blocks == 8 and s.num_unfinished == 0


def test_chunked_prefill_mixes_with_decodes_within_budget():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    a, b = make_request("a", 3, max_tokens=10), make_request("b", 20, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    out, _ = run_step(s)
    assert [(c.request.request_id, c.start, c.num_new_tokens, c.samples) for c in out.scheduled] == [
        ("a", 0, 3, True),
        ("b", 0, 5, False),
    ]
    out, _ = run_step(s)
    # a decodes one token, b's prefill continues with the rest of the budget
    assert [(c.request.request_id, c.start, c.num_new_tokens) for c in out.scheduled] == [("a", 3, 1), ("b", 5, 7)]
    assert out.num_batched_tokens == 8
    run_step(s)
    assert b.num_computed_tokens == 19 and b.num_output_tokens == 0
    out, _ = run_step(s)
    assert b.num_output_tokens == 1  # the chunk that reached the prompt's end sampled


def test_max_num_seqs_caps_the_running_batch():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 4))
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.scheduled] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_takes_latest_arrival_and_recomputes_it():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    a, b = make_request("a", 8, max_tokens=8, arrival=0), make_request("b", 8, max_tokens=8, arrival=1)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled: 4 blocks used, each has 9 tokens
    out, _ = run_step(s)  # a needs a third block: b (latest) is preempted
    assert out.preempted == [b] and b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and kv.block_table("b") == []
    while a.status != RequestStatus.FINISHED:
        run_step(s)
    out, _ = run_step(s)  # b comes back and recomputes prompt + its generated token
    assert out.scheduled[0].request is b and out.scheduled[0].num_new_tokens == 9
    while s.num_unfinished:
        run_step(s)
    assert b.num_output_tokens == 8 and kv.num_free_blocks == 4


def test_request_preempts_itself_when_it_is_the_latest():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    a, b = make_request("a", 4, max_tokens=5, arrival=0), make_request("b", 8, max_tokens=4, arrival=1)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # a: 1 block, b: 2 blocks (prompt 8 exactly fills 2)
    out, _ = run_step(s)  # a needs block 2 -> preempt b; b's decode cannot run this step
    assert out.preempted == [b]
    assert [c.request.request_id for c in out.scheduled] == ["a"]


def test_request_that_can_never_fit_is_rejected():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8)
    with pytest.raises(ValueError, match="can never fit"):
        s.add_request(make_request("big", 6, max_tokens=5))
    assert s.num_unfinished == 0


def test_abort_waiting_and_running_frees_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=4, max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert kv.num_free_blocks == 8 and s.num_unfinished == 0
    assert a.finish_reason == b.finish_reason == FinishReason.ABORT


def test_prefill_cap_applies_only_while_some_request_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, prefill_tokens_with_decodes=6)
    a, b, c = make_request("a", 20, max_tokens=10), make_request("b", 15, max_tokens=2), make_request("c", 4)
    s.add_request(a)
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 20)]  # nobody decodes yet
    s.add_request(b)
    s.add_request(c)
    out, _ = run_step(s)
    # a decodes; b's prompt gets only the capped share, and c waits behind it for budget
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 6)]
    assert out.admission_blocked_by == "budget"
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 6)]
    out, _ = run_step(s)
    # b's last 3 prompt tokens leave 3 of the cap for c's 4-token prompt
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == [
        ("a", 22, 1),
        ("b", 12, 3),
        ("c", 0, 3),
    ]
    while s.num_unfinished:
        run_step(s)
    assert b.num_output_tokens == 2 and c.num_output_tokens == 4 and kv.num_free_blocks == 64


def test_prefill_cap_must_be_positive():
    with pytest.raises(ValueError, match="prefill_tokens_with_decodes"):
        Scheduler(KVCacheManager(num_blocks=4, block_size=4), 64, 8, prefill_tokens_with_decodes=0)
    with pytest.raises(ValueError, match="prefill_tokens_with_decodes"):
        EngineConfig(prefill_tokens_with_decodes=-3)
