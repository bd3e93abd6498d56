"""The live dashboard: what the KV cache and the scheduler hold right now.

`engine_state` runs on the engine thread (between steps), so the grid, the
block tables and the counters are one consistent picture.  The page itself
(`static/dashboard.html`) polls `/dashboard/state` and draws it.
"""

from __future__ import annotations

import dataclasses
from importlib import resources

from pagedllm.engine import LLMEngine

MAX_LISTED = 64  # requests listed per table; the counts cover all of them


def engine_state(engine: LLMEngine) -> dict:
    """Counters and the KV cache's occupancy, as the stats endpoint reports them."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    pool = getattr(kv, "pool", None)
    queried = scheduler.prefix_cache_queried_tokens
    return {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "steps": engine.stats.steps,
        "preemptions": scheduler.num_preemptions,
        "kv": {
            "layout": engine.config.kv_layout,
            "block_size": kv.block_size,
            "num_blocks": kv.num_blocks,
            "used_blocks": kv.num_used_blocks,
            "free_blocks": kv.num_free_blocks,
            "cached_blocks": pool.num_cached_blocks if pool is not None else 0,
        },
        "prefix_cache_hit_rate": scheduler.prefix_cache_hit_tokens / queried if queried else 0.0,
        "forks": scheduler.num_forks,
        # Sliding-window layers' blocks given back while their requests ran (core/layer_groups.py).
        "kv_blocks_freed_by_window": getattr(kv, "num_blocks_freed_by_window", 0),
        "layer_groups": engine.layer_groups.describe(),
        "cow_copies": scheduler.num_cow_copies,
        # Each rank's weights, KV cache and RSS as measured at start (one entry without tensor parallelism).
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "rank_memory": [dataclasses.asdict(m) for m in engine.rank_memory],
        "step_message_bytes": engine.runner.step_message_bytes,
    }


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
