"""Data-parallel serving on one machine: prefix-aware routing against round-robin, and 2
replicas x 1 core against 1 replica x 2 cores, on a multi-prefix workload; the router's own
added latency; a replica killed mid-run.

    python benchmarks/data_parallel.py --repeats 3 --output docs/results/data-parallel.json

The workload is `pagedllm bench serve`'s `shared-prefix` dataset: `--num-prefixes` system
prompts of `--prefix-len` tokens, each request one of them plus a unique tail, streamed at
`--request-rate` (Poisson arrivals, the same seed every run).  Each configuration starts its
server afresh (`pagedllm serve`, with `--data-parallel-size 2` for the replicated ones, each
replica then pinned to one core), sends the same warm-up, replays the workload, and reads the
prefix-cache hit rate over all replicas from `/stats` (the warm-up's share taken out).
Configurations alternate over `--repeats` rounds; medians with min and max.

The KV cache per replica (`--kv-cache-memory`, 224 MiB: ~10,000 tokens of SmolLM2 in
bfloat16) holds some of the prefixes, not all: with
round-robin every replica sees every prefix and evicts; with prefix routing each replica
keeps its share.  The single replica gets the two replicas' memory together, so it holds
every prefix: the hit rate prefix routing is compared with.

`--router-latency N`: N one-token requests one after another, straight to a replica and
through the front-end: the median difference is what the front-end adds per request.
`--kill-at S`: in one extra prefix-routed run, one replica is killed S seconds in: requests
that never got an answer (none may), and how long until the front-end took it back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from pagedllm.benchmarking.compare import alternate, machine, summarize
from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset
from pagedllm.benchmarking.serve import replay
from pagedllm.testing.servers import free_port, wait_healthy

CONFIGS = {
    "prefix-2x1": ["--data-parallel-size", "2", "--router", "prefix"],
    "round-robin-2x1": ["--data-parallel-size", "2", "--router", "round-robin"],
    "single-1x2": [],
}
FIGURES = ("prefix_cache_hit_rate", "ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "e2el_p50_s", "failed")


class Served:
    def __init__(self, flags: list[str], kv_memory: str, single_memory: str) -> None:
        self.port = free_port()
        memory = single_memory if not flags else kv_memory
        command = [sys.executable, "-m", "pagedllm", "serve", "--port", str(self.port), "--kv-cache-memory", memory,
                   "--max-model-len", "4096", *flags]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_healthy(self.url, timeout=300, process=self.process)

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=30).json()

    def hit_counts(self) -> tuple[int, int]:
        stats = self.stats()
        totals = stats.get("total", stats)
        return totals["prefix_cache_queried_tokens"], totals["prefix_cache_hit_tokens"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        subprocess.run(["ray", "stop", "--force"], capture_output=True)


def run_config(flags: list[str], args, requests: list[dict], warmup: list[dict], kill_at: float | None = None) -> dict:
    served = Served(flags, args.kv_cache_memory, args.single_kv_cache_memory)
    try:
        asyncio.run(replay(served.url + "/v1", warmup, float("inf")))
        queried0, hit0 = served.hit_counts()
        result = asyncio.run(replay_with_kill(served, requests, args.request_rate, kill_at))
        queried, hit = served.hit_counts()
        result["prefix_cache_hit_rate"] = round((hit - hit0) / max(1, queried - queried0), 4)
        if "total" in (stats := served.stats()):
            result["router"] = stats["router"]
        return result
    finally:
        served.stop()


async def replay_with_kill(served: Served, requests: list[dict], rate: float, kill_at: float | None) -> dict:
    task = asyncio.create_task(replay(served.url + "/v1", requests, rate))
    if kill_at is None:
        return await task
    await asyncio.sleep(kill_at)
    router = served.stats()["router"]
    victim = max(range(len(router["in_flight"])), key=lambda i: router["in_flight"][i])
    port = router["addresses"][victim].rsplit(":", 1)[1]
    pid = int(
        subprocess.run(["pgrep", "-f", f"kv-events.*--port {port}"], capture_output=True, text=True).stdout.split()[0]
    )
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while True:  # until the front-end has taken it back
        await asyncio.sleep(0.2)
        health = httpx.get(served.url + "/health").json()
        if all(r == "up" for r in health["replicas"]) and time.monotonic() - killed > 1.0:
            break
    recovered = time.monotonic() - killed
    result = await task
    result["kill"] = {
        "replica": victim,
        "in_flight_when_killed": router["in_flight"][victim],
        "seconds_until_back": round(recovered, 2),
        # A stream already under way on the killed replica ends with an error event (its tokens
        # cannot be taken back); one not yet answered is placed again.  None may go unanswered.
        "requests_ended_with_an_error": result["failed"],
        "requests_never_answered": result["requests"] - result["completed"] - result["failed"],
        "first_error": result.get("first_error"),
    }
    return result


def router_latency(args, count: int) -> dict:
    """Median latency of a one-token request straight to a replica and through the front-end."""
    served = Served(CONFIGS["prefix-2x1"], args.kv_cache_memory, args.single_kv_cache_memory)
    try:
        replica = served.stats()["router"]["addresses"][0]

        def timed(base: str) -> list[float]:
            times = []
            with httpx.Client(timeout=60) as client:
                for i in range(count):
                    start = time.perf_counter()
                    client.post(base + "/v1/completions", json={"prompt": [100 + i, 200, 300], "max_tokens": 1,
                                                                 "model": "SmolLM2-135M-Instruct"})  # fmt: skip
                    times.append(time.perf_counter() - start)
            return times

        direct, through = [], []
        for _ in range(3):  # alternated
            direct += timed(replica)
            through += timed(served.url)
        d, t = statistics.median(direct) * 1e3, statistics.median(through) * 1e3
        return {"requests": 3 * count, "direct_p50_ms": round(d, 2), "through_frontend_p50_ms": round(t, 2),
                "added_ms": round(t - d, 2), "route_ms_mean": served.stats()["router"]["route_ms_mean"]}  # fmt: skip
    finally:
        served.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=32, help="each request's own tail")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--kv-cache-memory", default="224MiB", help="per replica")
    parser.add_argument("--single-kv-cache-memory", default="448MiB", help="the one replica's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--router-latency", type=int, default=50)
    parser.add_argument("--kill-at", type=float, default=30.0)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--output", default="bench-results/data-parallel.json")
    args = parser.parse_args()

    spec = DatasetSpec("shared-prefix", args.num_prompts, args.input_len, args.output_len, range_ratio=0.5,
                       prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, seed=0)  # fmt: skip
    requests = generate_dataset(spec, 49152)
    warmup = [dict(r, prompt_token_ids=r["prompt_token_ids"][::-1][:64], max_tokens=4) for r in requests[:4]]
    runs = alternate({name: (lambda f=CONFIGS[name]: run_config(f, args, requests, warmup)) for name in args.configs},
                     args.repeats)  # fmt: skip
    results: dict = {"machine": machine(), "setup": vars(args), "dataset": spec.describe(), "runs": runs}
    results["summary"] = {name: summarize(rs, FIGURES) for name, rs in runs.items()}
    if {"prefix-2x1", "round-robin-2x1"} <= set(runs):
        p50 = [rr["ttft_p50_s"] / p["ttft_p50_s"] for p, rr in zip(runs["prefix-2x1"], runs["round-robin-2x1"])]
        results["summary"]["ttft_p50_round_robin_over_prefix"] = summarize([{"x": x} for x in p50], ("x",))["x"]
    if args.router_latency:
        results["router_latency"] = router_latency(args, args.router_latency)
    if args.kill_at:
        results["kill_run"] = run_config(CONFIGS["prefix-2x1"], args, requests, warmup, kill_at=args.kill_at)
    import json
    from pathlib import Path

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"], indent=2))
    print(json.dumps({k: results.get(k) for k in ("router_latency",)}, indent=2))
    if "kill_run" in results:
        print(json.dumps(results["kill_run"].get("kill"), indent=2))


if __name__ == "__main__":
    main()
