"""The engine's counters and KV occupancy as one dict: what `/stats` returns, what the Prometheus
gauges, the periodic log line and the dashboard read.  Call it on the engine thread (between
steps), so the figures are one consistent picture."""

from __future__ import annotations

import dataclasses

from pagedllm.engine import LLMEngine


def engine_state(engine: LLMEngine) -> dict:
    """Counters and the KV cache's occupancy, as the stats endpoint reports them."""
    scheduler, kv = engine.scheduler, engine.kv_cache
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
            "cached_blocks": kv.num_cached_blocks,
        },
        "prefix_cache_hit_rate": scheduler.prefix_cache_hit_tokens / queried if queried else 0.0,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_hit_tokens": scheduler.prefix_cache_hit_tokens,
        "forks": scheduler.num_forks,
        # Sliding-window layers' blocks given back while their requests ran (core/layer_groups.py).
        "kv_blocks_freed_by_window": kv.num_blocks_freed_by_window,
        "layer_groups": engine.layer_groups.describe(),
        "cow_copies": scheduler.num_cow_copies,
        # Speculative decoding's counters (core/speculation.py); None when it is off.
        "speculation": (
            {"method": engine.config.speculative, **engine.speculation.stats.as_dict()}
            if engine.speculation is not None
            else None
        ),
        # Each rank's weights, KV cache and RSS as measured at start (one entry without tensor parallelism).
        "weights": engine.weights,
        "weights_summary": engine.weights_summary,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "rank_memory": [dataclasses.asdict(m) for m in engine.rank_memory],
        "step_message_bytes": engine.runner.step_message_bytes,
    }
