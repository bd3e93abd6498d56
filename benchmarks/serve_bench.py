"""Serving benchmark: replay a workload through the OpenAI API of `pagedllm serve`, and of vLLM's
server beside it, engines alternated.

    python benchmarks/serve_bench.py --workload benchmarks/workloads/random-128.jsonl \
        --request-rate 1.5 --repeats 3 [--vllm-python V/bin/python]

Every request is a stream (token-id prompts, greedy, EOS ignored) sent at `--request-rate`
requests/s (Poisson arrivals from `--seed`; `inf`: all at once); pagedllm/benchmarking/serve.py
measures time to first token, inter-token latency and end-to-end latency.  Each round starts
each server afresh, sends the same warm-up (4 reversed prompts, 16 tokens each), then replays the
workload; rounds alternate which server goes first.

pagedllm's server gets every engine flag given here (`engine_flags`: the same EngineConfig,
spelled out).  vLLM's (`python -m vllm.entrypoints.openai.api_server`, tuned as its CPU docs say;
pagedllm/benchmarking/peers.py) gets the same dtype, KV cache size and maximum length, and its
own latency setting: `--vllm-max-num-batched-tokens` (its step token budget, which bounds the
prefill chunk beside decodes as pagedllm's --prefill-tokens-with-decodes does; unset: vLLM's
default).  The JSON holds both servers' full settings, every run, and medians with min and max.

`--url URL --served-model NAME` replays once against a server already running (nothing else is
started).  `--offline` also runs `pagedllm bench`'s in-process loop once, for the served/offline
ratio.  Results go to bench-results/ (ignored by git) unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time

import httpx

from pagedllm.benchmarking.compare import alternate, format_spread, machine, paired_ratio, summarize
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.peers import peer_directory, vllm_env, vllm_settings, vllm_version
from pagedllm.benchmarking.serve import replay
from pagedllm.benchmarking.throughput import print_result, run_bench, warmup_requests
from pagedllm.cli_args import add_engine_args, engine_config, engine_flags
from pagedllm.execution.device import resolve_dtype
from pagedllm.execution.startup_checks import DEFAULT_CPU_KV_CACHE_MEMORY
from pagedllm.testing.servers import free_port, serve_subprocess, stop_process

LATENCIES = ("ttft_p50_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "e2el_p50_s", "e2el_p99_s")
FIGURES = ("output_tokens_per_s", *LATENCIES)


@contextlib.contextmanager
def vllm_server(python: str, arguments: list[str], env: dict[str, str]):
    """vLLM's OpenAI server on a free port, serving as 'default'; yields its /v1 base URL once
    /v1/models answers, and stops it on exit."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", *arguments]
    command += ["--served-model-name", "default", "--port", str(port), "--host", "127.0.0.1"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with status {process.returncode} before answering")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's server did not answer within 900 s")
            time.sleep(2)
        yield url
    finally:
        stop_process(process, 60)


def served_run(url: str, requests: list[dict], warmup: list[dict], args: argparse.Namespace, model: str) -> dict:
    asyncio.run(replay(url, warmup, float("inf"), args.seed, model))
    return asyncio.run(replay(url, requests, args.request_rate, args.seed, model))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts every server afresh")
    parser.add_argument("--offline", action="store_true", help="also run the offline loop once")
    parser.add_argument("--url", default=None, help="replay against this running server (its /v1 base) only")
    parser.add_argument("--served-model", default="default", help="the model name to send with --url")
    parser.add_argument("--vllm-python", default=None, help="also start and replay against vLLM from this venv")
    parser.add_argument("--vllm-max-num-batched-tokens", type=int, default=None, help="vLLM's step token budget")
    parser.add_argument("--output", default="bench-results/serve-bench.json")
    add_engine_args(parser, serving=True)
    args = parser.parse_args()
    config = engine_config(args)
    requests = load_workload(args.workload, args.num_requests)
    if any(r["n"] != 1 or r["temperature"] != 0.0 for r in requests):
        raise SystemExit("this benchmark replays greedy single-sample workloads")
    warmup = warmup_requests(requests)
    report: dict = {"workload": args.workload, "requests": len(requests), "request_rate": str(args.request_rate)}
    report["machine"] = machine()
    if args.url:
        report["served"] = served_run(args.url, requests, warmup, args, args.served_model)
        print_result(report, args.output)
        return 0

    flags = engine_flags(config)
    report["settings"] = {"pagedllm": dataclasses.asdict(config) | {"serve_flags": flags}}

    def pagedllm_served() -> dict:
        with serve_subprocess(*flags, "--served-model-name", "default", api_key=None) as server:
            result = served_run(server.v1, requests, warmup, args, "default")
            result["kv_blocks_held_after"] = server.stats()["kv"]["used_blocks"]
        return result

    runs = {"pagedllm": pagedllm_served}
    if args.vllm_python:
        model = config.model or "smollm2"
        dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
        env = vllm_env(args.vllm_python, config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        arguments = ["--model", str(peer_directory(model)), "--dtype", dtype, "--seed", "0"]
        arguments += ["--max-model-len", str(config.max_model_len or 8192)]
        if args.vllm_max_num_batched_tokens:
            arguments += ["--max-num-batched-tokens", str(args.vllm_max_num_batched_tokens)]
        report["settings"]["vllm"] = {
            "version": vllm_version(args.vllm_python),
            "arguments": arguments,
            "env": vllm_settings(env),
        }

        def vllm_served() -> dict:
            with vllm_server(args.vllm_python, arguments, env) as url:
                return served_run(url, requests, warmup, args, "default")

        runs["vllm"] = vllm_served
    results = alternate(runs, args.repeats, log=lambda line: print(line, flush=True))
    for name, engine_runs in results.items():
        report[name] = summarize(engine_runs, FIGURES)
    if "vllm" in results:
        ours, theirs = results["pagedllm"], results["vllm"]
        report["pagedllm_over_vllm_output_tokens_per_s"] = paired_ratio(ours, theirs, "output_tokens_per_s")
        for key in LATENCIES:  # above 1: pagedllm's latency is lower
            report[f"vllm_over_pagedllm_{key}"] = paired_ratio(ours, theirs, key, higher_is_better=False)
    if args.offline:
        offline = run_bench(config, requests)
        report["offline"] = {k: offline[k] for k in ("wall_s", "output_tokens", "output_tokens_per_s", "peak_running")}
    report["runs"] = results
    print_result(report, args.output)
    for name in results:
        for key in ("output_tokens_per_s", "itl_p50_s", "e2el_p50_s"):
            print(format_spread(f"{name} {key}", report[name][key]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
