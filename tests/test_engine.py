"""Engine behaviour on the real model: bad input, aborts, memory accounting."""

import logging
import sys

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import parse_bytes
from pagedllm.testing.hf_reference import greedy


@pytest.fixture
def llm(make_llm):
    return make_llm()


def test_bad_prompts_are_clear_errors_and_leave_nothing_behind(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="maximum context length is 8192"):
        llm.generate([[5] * 8192])
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate([[5, 49152]])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=0))
    # one bad prompt in a batch: nothing of the batch stays queued
    with pytest.raises(ValueError):
        llm.generate(["fine", ""])
    assert not engine.has_unfinished_requests()


def test_a_cache_smaller_than_the_context_lowers_max_model_len(make_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        llm = make_llm(kv_cache_memory="8MiB")  # 11 blocks of 16 tokens in float32
    capacity = llm.engine.kv_cache.num_tokens_capacity
    assert capacity == 176 and llm.engine.max_model_len == capacity
    assert "max model length lowered to 176" in caplog.text
    with pytest.raises(ValueError, match="maximum context length is 176"):
        llm.generate([[5] * 176])
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=capacity - 10, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == capacity - 10  # exactly filling the cache is fine


def test_settings_that_cannot_work_are_refused_at_start():
    from pagedllm import LLM

    with pytest.raises(ValueError, match="longer than this model's context length of 8192"):
        LLM(dtype="float32", max_model_len=100_000)
    with pytest.raises(ValueError, match=r"more than this machine can give the KV cache.*MemAvailable"):
        LLM(dtype="float32", kv_cache_memory="100TiB")
    # 4096 tokens of SmolLM2's float16 KV cache (auto beside float32): 90 MiB.
    with pytest.raises(ValueError, match=r"fewer than one request of max_model_len 4096: pass --kv-cache-memory 90MiB"):
        LLM(dtype="float32", kv_cache_memory="8MiB", max_model_len=4096)
    with pytest.raises(ValueError, match=r"pass --kv-cache-memory 180MiB"):
        LLM(dtype="float32", kv_cache_dtype="float32", kv_cache_memory="8MiB", max_model_len=4096)
    with pytest.raises(ValueError, match=r"kv_cache_dtype float16 does not run beside a bfloat16 model"):
        LLM(dtype="bfloat16", kv_cache_dtype="float16", kv_cache_memory="8MiB")


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    request_id = engine.add_request(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]), greedy(50)
    )
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.num_used_blocks > 0
    output = engine.abort_request(request_id)
    assert output.finished and output.finish_reason == "abort"
    assert engine.kv_cache.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request(request_id) is None  # unknown now: a no-op


def test_generate_keeps_prompt_order_and_reports_ttft(llm):
    prompts = ["One", "Two two two two two two two", "Three three"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and len(o.token_ids) == 5 and o.time_to_first_token > 0 for o in outputs)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0))
    assert "Paris" in out[0].text
    ids = out[0].prompt_token_ids
    assert llm.tokenizer.decode(ids).startswith("system\n") or "<|im_start|>" in llm.tokenizer.hf.decode(ids)


def test_startup_log_reports_kv_sizing(caplog):
    from pagedllm import LLM

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", block_size=32)
    message = caplog.text
    blocks = 64 * 2**20 // (32 * 2 * 30 * 3 * 64 * 2)  # float16 K and V (auto beside float32)
    assert llm.engine.kv_cache.num_blocks == blocks
    assert f"float16 KV cache: {blocks} blocks x 32 tokens = {blocks * 32} tokens" in message
    assert "concurrency" in message


def resident_fraction(tensor) -> float:
    """The share of a CPU tensor's pages that the OS has backed with memory (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = -(-(end - start) // page)
    status = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in status) / pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore on Linux")
def test_the_kv_cache_is_committed_in_the_background_unless_asked_not_to(caplog):
    """The engine is ready before its cache is committed; the commit backs every page without
    writing one (a block a step wrote meanwhile keeps its values)."""
    from pagedllm import LLM
    from pagedllm.execution.memory_commit import commit_in_background

    with caplog.at_level(logging.DEBUG, logger="pagedllm"):
        committed = LLM(dtype="float32", kv_cache_memory="96MiB", commit_kv_cache=True)
        thread = committed.engine.runner.commit_thread
        assert thread is not None, caplog.text
        thread.join(timeout=60)
    assert "KV cache committed: 0.09 of 0.09 GiB" in caplog.text
    assert all(resident_fraction(cache) == 1.0 for cache in committed.engine.runner.kv_caches)
    lazy = LLM(dtype="float32", kv_cache_memory="96MiB", commit_kv_cache=False)
    assert lazy.engine.runner.commit_thread is None
    assert all(resident_fraction(cache) < 0.1 for cache in lazy.engine.runner.kv_caches)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert lazy.generate("The capital of France is", params)[0].outputs[0].token_ids == (
        committed.generate("The capital of France is", params)[0].outputs[0].token_ids
    )

    buffer = torch.empty(64 * 2**20, dtype=torch.uint8)
    written = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    buffer[40 * 2**20 : 40 * 2**20 + written.numel()] = written  # a step's write, before the commit reaches it
    assert resident_fraction(buffer) < 0.1
    commit_in_background([buffer], "test buffer").join(timeout=60)
    assert resident_fraction(buffer) == 1.0
    assert torch.equal(buffer[40 * 2**20 : 40 * 2**20 + written.numel()], written)


def test_engine_arguments_are_checked():
    from pagedllm import LLM

    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(block_sise=16)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="memory size"):
        LLM(kv_cache_memory="lots")


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


def test_interrupted_generate_frees_its_requests(llm, monkeypatch):
    engine = llm.engine
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert engine.kv_cache.num_used_blocks == 0 and not engine.has_unfinished_requests()


def _staggered_run(llm, prompts: list[str]) -> tuple[dict[str, list[int]], list[int]]:
    """The first prompt decodes before the others arrive; returns every request's tokens and the
    prompt tokens of each step that also carried a decode."""
    engine, mixed_prefill = llm.engine, []
    real_schedule = engine.scheduler.schedule

    def schedule():
        out = real_schedule()
        if any(c.num_new_tokens == 1 for c in out.scheduled):
            mixed_prefill.append(sum(c.num_new_tokens for c in out.scheduled if c.num_new_tokens > 1))
        return out

    engine.scheduler.schedule = schedule
    try:
        ids = [engine.add_request(prompts[0], greedy(24))]
        for _ in range(2):
            engine.step()
        ids += [engine.add_request(p, greedy(12)) for p in prompts[1:]]
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = output.outputs[0].token_ids
    finally:
        engine.scheduler.schedule = real_schedule
    return {str(i): tokens[rid] for i, rid in enumerate(ids)}, mixed_prefill


def test_capped_prefill_beside_decodes_gives_the_same_tokens(make_llm):
    prompts = [
        "Write a short poem about the sea.",
        "Explain in detail how a hash table handles collisions, with an example in Python code. " * 3,
        "What is the capital of France?",
        "List five prime numbers and say why each is prime.",
    ]
    free, free_mixed = _staggered_run(make_llm(), prompts)
    capped, capped_mixed = _staggered_run(make_llm(prefill_tokens_with_decodes=8), prompts)
    assert capped == free
    assert max(free_mixed) > 8  # uncapped, the long prompt shares one step with the decode
    assert max(capped_mixed) <= 8 and sum(map(bool, capped_mixed)) > sum(map(bool, free_mixed))
