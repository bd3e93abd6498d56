"""What the engine tells the outside, read from its parts here so that nothing outside engine/
reaches into them: the settings front-ends need (`EngineInfo`), the counters and KV occupancy of
`/stats` (`engine_state`), the dashboard's blocks and tables (`kv_picture`), and a benchmark
run's figures (`RunCounters`, `run_report`).  Call them on the engine thread (between steps),
so each is one consistent picture."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.speculation import SpeculationStats

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine

MAX_LISTED = 64  # requests the dashboard lists per table; the counts cover all of them


@dataclass(frozen=True)
class EngineInfo:
    """Fixed for an engine's life: what a front-end checks requests against and reports."""

    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_blocks: int
    kv_layout: str
    dtype: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    num_layer_groups: int  # each request holds a block table per group (1 unless windows free blocks)


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
        # LoRA adapters (execution/lora_adapters.py) and the KV blocks their pages hold (their
        # bytes' worth under the contiguous layout); None where this engine cannot run adapters.
        "lora": lora_state(engine),
        # Each rank's weights, KV cache and RSS as measured at start (one entry without tensor parallelism).
        "weights": engine.weights,
        "weights_summary": engine.weights_summary,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "rank_memory": [dataclasses.asdict(m) for m in engine.rank_memory],
        "step_message_bytes": engine.runner.step_message_bytes,
    }


def lora_state(engine: LLMEngine) -> dict | None:
    if engine.lora_refusal:
        return None
    summary = engine.adapters.summary()
    in_pages = engine.adapters.pages is not None
    worth = -(-summary["resident_bytes"] // engine.kv_block_bytes)
    return summary | {"in_kv_pages": in_pages, "resident_kv_blocks": summary["page_blocks"] if in_pages else worth}


def kv_picture(engine: LLMEngine) -> dict:
    """Every block's state, and the running and waiting requests with their block tables (the
    first MAX_LISTED of each)."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    return {
        "blocks": kv.block_states(),
        "running_requests": [
            {
                "id": r.request_id,
                "tokens": r.num_tokens,
                "computed": r.num_computed_tokens,
                "block_table": kv.block_table(r.request_id),
            }
            for r in scheduler.running[:MAX_LISTED]
        ],
        "waiting_requests": [
            {"id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "preemptions": r.num_preemptions}
            for r in list(scheduler.waiting)[:MAX_LISTED]
        ],
    }


@dataclass(frozen=True)
class RunCounters:
    """The engine's cumulative counters at the start of a benchmark run."""

    steps: int
    preemptions: int
    prefix_queried: int
    prefix_hits: int
    forks: int
    cow_copies: int
    prefix_evictions: int
    step_message_bytes: int
    blocks_freed_by_window: int
    speculation: SpeculationStats | None


def begin_run(engine: LLMEngine) -> RunCounters:
    """Peaks and the KV memory series start over; the counters are read to be subtracted later."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    engine.stats.peak_running = engine.stats.kv_peak_blocks_used = 0
    engine.memory.reset(scheduler)
    return RunCounters(
        engine.stats.steps,
        scheduler.num_preemptions,
        scheduler.prefix_cache_queried_tokens,
        scheduler.prefix_cache_hit_tokens,
        scheduler.num_forks,
        scheduler.num_cow_copies,
        kv.num_prefix_evictions,
        engine.runner.step_message_bytes,
        kv.num_blocks_freed_by_window,
        dataclasses.replace(engine.speculation.stats) if engine.speculation is not None else None,
    )


def run_report(engine: LLMEngine, before: RunCounters) -> dict:
    """What the engine did since `begin_run`: steps, peaks, KV use, sharing, speculation, settings."""
    scheduler, kv, config = engine.scheduler, engine.kv_cache, engine.config
    queried = scheduler.prefix_cache_queried_tokens - before.prefix_queried
    hit = scheduler.prefix_cache_hit_tokens - before.prefix_hits
    report = {
        "steps": engine.stats.steps - before.steps,
        "peak_running": engine.stats.peak_running,
        "preemptions": scheduler.num_preemptions - before.preemptions,
        "kv_blocks_total": kv.num_blocks,
        "kv_peak_blocks_used": engine.stats.kv_peak_blocks_used,
        # Bytes of KV the busiest step held, every layer (and rank) counted.
        "kv_bytes_peak": engine.stats.kv_peak_blocks_used * engine.kv_block_bytes,
        "kv_blocks_freed_by_window": kv.num_blocks_freed_by_window - before.blocks_freed_by_window,
        "layer_groups": engine.layer_groups.describe(),
        "block_size": config.block_size,
        "dtype": engine.info.dtype,
        "kv_cache_dtype": engine.info.kv_cache_dtype,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "kv_layout": config.kv_layout,
        **({"reserve": config.reserve} if config.kv_layout == "contiguous" else {}),
        "max_model_len": engine.max_model_len,
        "tensor_parallel_size": config.tensor_parallel_size,
        "step_message_bytes": engine.runner.step_message_bytes - before.step_message_bytes,
        "rank_memory": [dataclasses.asdict(m) for m in engine.rank_memory],
        "weights": engine.weights,
        "weights_summary": engine.weights_summary,
        "prefix_caching": kv.supports_prefix_caching,
        "forks": scheduler.num_forks - before.forks,
        "cow_copies": scheduler.num_cow_copies - before.cow_copies,
        "prefix_cache_hit_tokens": hit,
        "prefix_cache_hit_rate": round(hit / queried, 4) if queried else 0.0,
    }
    if kv.supports_prefix_caching:
        report |= {
            "prefix_cache_evictions": kv.num_prefix_evictions - before.prefix_evictions,
            "kv_cached_blocks": kv.num_cached_blocks,
        }
    report["speculation"] = _speculation_report(engine, before.speculation)
    return report | engine.memory.summary(scheduler)


def _speculation_report(engine: LLMEngine, before: SpeculationStats | None) -> dict | None:
    """Speculative decoding in this run: drafts verified and accepted; None when it is off."""
    if engine.speculation is None or before is None:
        return None
    now = engine.speculation.stats
    delta = SpeculationStats(*(getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(now)))
    return {
        "method": engine.config.speculative,
        "row_cost": engine.speculation.cost.row,
        "context_token_cost": engine.speculation.cost.context_token,
        "draft_row_limits": list(engine.scheduler.draft_row_limits),
        **delta.as_dict(),
    }
