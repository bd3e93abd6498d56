"""Offline throughput: submit a whole workload at once, run to completion, report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.speculation import SpeculationStats
from pagedllm.engine import LLMEngine


def print_result(result: dict, output: str | Path | None = None) -> None:
    """Print a result as JSON, and write the same text to `output` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")


def run_bench(config: EngineConfig, requests: list[dict], ignore_eos: bool = True) -> dict:
    with LLMEngine(config) as engine:
        return run_on_engine(engine, requests, ignore_eos)


def run_on_engine(engine: LLMEngine, requests: list[dict], ignore_eos: bool = True, desc: str = "bench") -> dict:
    start = time.perf_counter()
    for item in requests:
        params = SamplingParams(
            n=item.get("n", 1),
            temperature=item.get("temperature", 0.0),
            seed=item.get("seed"),
            max_tokens=item["max_tokens"],
            ignore_eos=ignore_eos,
        )
        engine.add_request(item["prompt_token_ids"], params, request_id=item["id"])
    scheduler = engine.scheduler
    stats_before = (engine.stats.steps, scheduler.num_preemptions)
    prefix_before = (
        scheduler.prefix_cache_queried_tokens,
        scheduler.prefix_cache_hit_tokens,
        scheduler.num_forks,
        scheduler.num_cow_copies,
    )
    kv = engine.kv_cache
    evictions_before = kv.num_prefix_evictions if kv.supports_prefix_caching else None
    engine.stats.peak_running = engine.stats.kv_peak_blocks_used = 0
    engine.memory.reset(engine.scheduler)
    message_bytes_before = engine.runner.step_message_bytes
    freed_before = engine.kv_cache.num_blocks_freed_by_window
    spec_before = dataclasses.replace(engine.speculation.stats) if engine.speculation is not None else None
    output_tokens = 0
    ttfts = []
    errors: list[str] = []
    with tqdm(total=len(requests), desc=desc, unit="req") as bar:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    output_tokens += sum(c.num_tokens for c in output.outputs)
                    ttfts.append(output.time_to_first_token or 0.0)
                    if output.finish_reason == "error":
                        errors.append(output.error or "unknown error")
                    bar.update(1)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    ttfts.sort()
    return {
        "wall_s": round(wall, 3),
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 2),
        "steps": engine.stats.steps - stats_before[0],
        "peak_running": engine.stats.peak_running,
        "preemptions": engine.scheduler.num_preemptions - stats_before[1],
        "kv_blocks_total": engine.kv_cache.num_blocks,
        "kv_peak_blocks_used": engine.stats.kv_peak_blocks_used,
        # Bytes of KV the busiest step held, every layer (and rank) counted.
        "kv_bytes_peak": engine.stats.kv_peak_blocks_used * engine.kv_block_bytes,
        "kv_blocks_freed_by_window": engine.kv_cache.num_blocks_freed_by_window - freed_before,
        "layer_groups": engine.layer_groups.describe(),
        "block_size": engine.config.block_size,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "ttft_median_s": round(ttfts[len(ttfts) // 2], 3),
        # Requests a fault ended (`pagedllm bench` exits 1 when there are any).
        "failed_requests": len(errors),
        **({"first_error": errors[0]} if errors else {}),
        "kv_layout": engine.config.kv_layout,
        **({"reserve": engine.config.reserve} if engine.config.kv_layout == "contiguous" else {}),
        "max_model_len": engine.max_model_len,
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "step_message_bytes": engine.runner.step_message_bytes - message_bytes_before,
        "rank_memory": [dataclasses.asdict(m) for m in engine.rank_memory],
        "weights": engine.weights,
        "weights_summary": engine.weights_summary,
        **prefix_cache_stats(engine, prefix_before, evictions_before),
        "speculation": speculation_stats(engine, spec_before),
        **engine.memory.summary(engine.scheduler),
    }


def speculation_stats(engine: LLMEngine, before: SpeculationStats | None) -> dict | None:
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


def prefix_cache_stats(engine: LLMEngine, before: tuple[int, ...], evictions_before: int | None) -> dict:
    """Sharing in this run: prefix-cache hits, forks and copy-on-write copies, evictions."""
    scheduler = engine.scheduler
    queried = scheduler.prefix_cache_queried_tokens - before[0]
    hit = scheduler.prefix_cache_hit_tokens - before[1]
    stats = {
        "prefix_caching": engine.config.enable_prefix_caching and engine.config.kv_layout == "paged",
        "forks": scheduler.num_forks - before[2],
        "cow_copies": scheduler.num_cow_copies - before[3],
        "prefix_cache_hit_tokens": hit,
        "prefix_cache_hit_rate": round(hit / queried, 4) if queried else 0.0,
    }
    if evictions_before is not None:
        stats |= {
            "prefix_cache_evictions": engine.kv_cache.num_prefix_evictions - evictions_before,
            "kv_cached_blocks": engine.kv_cache.num_cached_blocks,
        }
    return stats


def warmup_requests(requests: list[dict], count: int = 4, max_tokens: int = 16) -> list[dict]:
    """What every engine in a comparison runs, untimed, after it starts: the first `count`
    prompts reversed (so the timed run finds none of them in a prefix cache), `max_tokens` each."""
    return [
        {"id": f"warm-up-{i}", "prompt_token_ids": r["prompt_token_ids"][::-1], "max_tokens": max_tokens}
        for i, r in enumerate(requests[:count])
    ]


def start_and_run(config: EngineConfig, requests: list[dict], warmup: list[dict]) -> dict:
    """Start an engine (timed: `startup_s`), run `warmup` untimed, then the workload (timed)."""
    begin = time.perf_counter()
    with LLMEngine(config) as engine:
        startup = time.perf_counter() - begin
        if warmup:
            run_on_engine(engine, warmup, desc="warm-up")
        return {"startup_s": round(startup, 2)} | run_on_engine(engine, requests)


def run_in_subprocess(config: EngineConfig, requests: list[dict], warmup: list[dict]) -> dict:
    """`start_and_run` in a fresh python process, as a peer engine's run is: every start pays
    the same (kernels load from their cache, weights from the page cache)."""
    settings = {"config": dataclasses.asdict(config), "requests": requests, "warmup": warmup}
    command = [sys.executable, "-m", "pagedllm.benchmarking.throughput"]
    proc = subprocess.run(command, input=json.dumps(settings), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"pagedllm run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


if __name__ == "__main__":  # the child of run_in_subprocess: settings on stdin, one RESULT line out
    given = json.loads(sys.stdin.read())
    result = start_and_run(EngineConfig(**given["config"]), given["requests"], given["warmup"])
    print("RESULT " + json.dumps(result))
