"""The live dashboard: what the KV cache and the scheduler hold right now.

`dashboard_state` runs on the engine thread (between steps), so the grid, the
block tables and the counters are one consistent picture.  The page itself
(`static/dashboard.html`) polls `/dashboard/state` and draws it.
"""

from __future__ import annotations

from importlib import resources

from pagedllm.engine import LLMEngine
from pagedllm.serving.engine_state import engine_state

MAX_LISTED = 64  # requests listed per table; the counts cover all of them


def dashboard_state(engine: LLMEngine, throughput: list[int]) -> dict:
    """`engine_state` plus every block's state, the requests with their block tables, and throughput."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    state = engine_state(engine)
    state["blocks"] = kv.block_states()
    state["running_requests"] = [
        {
            "id": r.request_id,
            "tokens": r.num_tokens,
            "computed": r.num_computed_tokens,
            "block_table": kv.block_table(r.request_id),
        }
        for r in scheduler.running[:MAX_LISTED]
    ]
    state["waiting_requests"] = [
        {"id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "preemptions": r.num_preemptions}
        for r in list(scheduler.waiting)[:MAX_LISTED]
    ]
    state["throughput"] = throughput
    return state


def dashboard_html() -> str:
    return resources.files("pagedllm.serving").joinpath("static/dashboard.html").read_text()
