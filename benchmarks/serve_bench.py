"""Serving benchmark: replay a workload through the HTTP API, beside the offline engine.

    python benchmarks/serve_bench.py --workload ../shared/workloads/random-128.jsonl \
        --dtype float32 --request-rate inf --output docs/results/serve-random-128.json

One run does both, one after the other on the same engine settings:
1. offline: `pagedllm bench`'s loop (all requests submitted at once, in process);
2. served: `pagedllm serve` in a subprocess, and the async openai client sending
   every request as a stream (token-id prompts, greedy, EOS ignored) at
   `--request-rate` requests/s (Poisson arrivals; `inf`: all at once).
It reports output tokens/s for both and their ratio, and for the served run the
time to first token, inter-token latency (the gaps between a stream's chunks,
each chunk one step's text) and end-to-end latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_helpers import serve_subprocess  # noqa: E402

from pagedllm.bench import load_workload, print_result, run_bench  # noqa: E402
from pagedllm.cli import add_engine_args, engine_config  # noqa: E402
from pagedllm.config import EngineConfig  # noqa: E402


def engine_flags(config: EngineConfig) -> list[str]:
    """The `pagedllm serve` flags that give the same engine as `config`."""
    flags = ["--dtype", config.dtype, "--block-size", str(config.block_size), "--kv-layout", config.kv_layout]
    flags += ["--kv-cache-memory", str(config.kv_cache_memory), "--attention", config.attention]
    flags += [
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
        "--max-num-seqs",
        str(config.max_num_seqs),
    ]
    if config.max_model_len:
        flags += ["--max-model-len", str(config.max_model_len)]
    if config.num_threads:
        flags += ["--num-threads", str(config.num_threads)]
    if config.model:
        flags += ["--model", config.model]
    if not config.enable_prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def percentiles(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {
        f"{name}_mean_s": round(statistics.fmean(ordered), 4),
        f"{name}_p50_s": at(0.5),
        f"{name}_p90_s": at(0.9),
        f"{name}_p99_s": at(0.99),
    }


async def replay(base_url: str, requests: list[dict], rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    ttfts, gaps, latencies, tokens = [], [], [], []

    async def one(client: openai.AsyncOpenAI, item: dict, delay: float) -> None:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        stream = await client.completions.create(
            model="default",
            prompt=item["prompt_token_ids"],
            max_tokens=item["max_tokens"],
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        last = None
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens.append(chunk.usage.completion_tokens)
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    ttfts.append(now - sent)
                else:
                    gaps.append(now - last)
                last = now
        latencies.append(time.perf_counter() - sent)

    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate)
    start = time.perf_counter()
    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600) as client:
        await asyncio.gather(*(one(client, item, d) for item, d in zip(requests, delays)))
    wall = time.perf_counter() - start
    return {
        "wall_s": round(wall, 3),
        "output_tokens": sum(tokens),
        "output_tokens_per_s": round(sum(tokens) / wall, 2),
        **percentiles(ttfts, "ttft"),
        **percentiles(gaps, "itl"),
        **percentiles(latencies, "e2e"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--output", default=None)
    add_engine_args(parser)
    args = parser.parse_args()
    config = engine_config(args)
    requests = load_workload(args.workload, args.num_requests)
    if any(r["n"] != 1 or r["temperature"] != 0.0 for r in requests):
        raise SystemExit("this benchmark replays greedy single-sample workloads")

    result: dict = {"workload": args.workload, "requests": len(requests), "request_rate": str(args.request_rate)}
    if not args.skip_offline:
        offline = run_bench(config, requests)
        result["offline"] = {k: offline[k] for k in ("wall_s", "output_tokens", "output_tokens_per_s", "peak_running")}
        gc.collect()
    with serve_subprocess(*engine_flags(config), "--served-model-name", "default", api_key=None) as server:
        result["served"] = asyncio.run(replay(server.v1, requests, args.request_rate, args.seed))
        kv = server.stats()["kv"]
        result["served"]["kv_blocks_held_after"] = kv["used_blocks"]
    if "offline" in result:
        ratio = result["served"]["output_tokens_per_s"] / result["offline"]["output_tokens_per_s"]
        result["served_over_offline"] = round(ratio, 3)
    result["engine"] = {"dtype": config.dtype, "block_size": config.block_size, "kv_cache_memory": args.kv_cache_memory}
    print_result(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
