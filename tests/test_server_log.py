"""The server's log: one line per finished request, and a periodic throughput / KV line."""

import logging

from pagedllm import SamplingParams
from pagedllm.serving.server_log import ServerLog


def test_finished_requests_and_periodic_stats_are_logged(make_llm, caplog):
    engine = make_llm(kv_cache_memory="64MiB").engine
    log = ServerLog(interval_s=0.0)  # a stats line after every step that did something
    engine.add_request([5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="a")
    engine.add_request([6] * 30, SamplingParams(max_tokens=2, n=2, seed=1, ignore_eos=True), request_id="b")
    with caplog.at_level(logging.INFO, logger="pagedllm.server"):
        while engine.has_unfinished_requests():
            log.observe_step(engine, engine.step(), 0.01)
    lines = [r.getMessage() for r in caplog.records]
    finished = [line for line in lines if line.startswith("request ")]
    assert len(finished) == 2
    assert any(line.startswith("request a finished (length): 20 prompt + 4 generated tokens") for line in finished)
    assert any(line.startswith("request b finished (length): 30 prompt + 4 generated tokens") for line in finished)
    stats = [line for line in lines if "generated tok/s" in line]
    assert stats and "KV cache" in stats[0] and "running" in stats[0]
    assert not log._generated and not log._first_seen  # nothing kept for finished requests
