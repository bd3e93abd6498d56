"""Serving benchmark: replay a workload through the HTTP API, beside the offline engine.

    python benchmarks/serve_bench.py --workload benchmarks/workloads/random-128.jsonl \
        --dtype float32 --request-rate inf --output docs/results/serve-random-128.json

One run does both, one after the other on the same engine settings:
1. offline: `pagedllm bench`'s loop (all requests submitted at once, in process);
2. served: `pagedllm serve` in a subprocess, and the async openai client sending
   every request as a stream (token-id prompts, greedy, EOS ignored) at
   `--request-rate` requests/s (Poisson arrivals; `inf`: all at once).
It reports output tokens/s for both and their ratio, and for the served run the
time to first token, inter-token latency (the gaps between a stream's chunks,
each chunk one step's text) and end-to-end latency percentiles.

The same replay drives any OpenAI-compatible server: `--url URL --model NAME`
replays against one already running (nothing else is started), and
`--vllm-python VENV/bin/python` also starts vLLM's OpenAI server from that
virtual environment (`python -m vllm.entrypoints.openai.api_server`, tuned as
in benchmarks/vllm_compare.py, the same dtype and a 4 GiB KV cache) after
pagedllm's, replays the same arrivals against it, and reports pagedllm's
latencies over vLLM's:

    python benchmarks/serve_bench.py --workload W.jsonl --request-rate 1.5 --skip-offline \
        --vllm-python VENV/bin/python --output docs/results/serve-vs-vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_helpers import free_port, serve_subprocess, stop_process  # noqa: E402
from vllm_compare import hf_directory, vllm_env  # noqa: E402

from pagedllm.benchmarking.datasets import load_workload  # noqa: E402
from pagedllm.benchmarking.serve import replay  # noqa: E402
from pagedllm.benchmarking.throughput import print_result, run_bench  # noqa: E402
from pagedllm.cli_args import add_engine_args, engine_config  # noqa: E402
from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.execution.device import resolve_dtype  # noqa: E402
from pagedllm.layers.cpu_kernels import cpu_summary  # noqa: E402
from pagedllm.models.loader import BUNDLED_MODELS  # noqa: E402


@contextlib.contextmanager
def vllm_server(python: str, model: str, dtype: str, max_model_len: int):
    """vLLM's OpenAI server (tuned) on a free port, serving a bundled model as 'default'; yields
    its /v1 base URL once /v1/models answers, and stops it on exit."""
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_directory(model))]
    command += ["--served-model-name", "default", "--dtype", dtype, "--max-model-len", str(max_model_len)]
    command += ["--port", str(port), "--host", "127.0.0.1", "--seed", "0"]
    process = subprocess.Popen(command, env=vllm_env(python, tuned=True))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 900
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with status {process.returncode} before answering")
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM's server did not answer within 900 s")
            time.sleep(2)
        yield url
    finally:
        stop_process(process, 60)


def engine_flags(config: EngineConfig) -> list[str]:
    """The `pagedllm serve` flags that give the same engine as `config`."""
    flags = ["--dtype", config.dtype, "--block-size", str(config.block_size), "--kv-layout", config.kv_layout]
    flags += ["--attention", config.attention, "--linear", config.linear]
    if config.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(config.kv_cache_memory)]
    flags += [
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
        "--max-num-seqs",
        str(config.max_num_seqs),
    ]
    flags += ["--prefill-tokens-with-decodes", str(config.prefill_tokens_with_decodes).lower()]
    if config.max_model_len:
        flags += ["--max-model-len", str(config.max_model_len)]
    if config.num_threads:
        flags += ["--num-threads", str(config.num_threads)]
    if not config.adaptive_threads:
        flags.append("--no-adaptive-threads")
    if config.model:
        flags += ["--model", config.model]
    if not config.enable_prefix_caching:
        flags.append("--no-prefix-caching")
    return flags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--url", default=None, help="replay against this running server (its /v1 base) only")
    parser.add_argument("--served-model", default="default", help="the model name to send with --url")
    parser.add_argument("--vllm-python", default=None, help="also start and replay against vLLM from this venv")
    parser.add_argument("--output", default=None)
    add_engine_args(parser, serving=True)
    args = parser.parse_args()
    config = engine_config(args)
    requests = load_workload(args.workload, args.num_requests)
    if any(r["n"] != 1 or r["temperature"] != 0.0 for r in requests):
        raise SystemExit("this benchmark replays greedy single-sample workloads")

    result: dict = {"workload": args.workload, "requests": len(requests), "request_rate": str(args.request_rate)}
    result["cpu"] = cpu_summary()
    if args.url:
        result["served"] = asyncio.run(replay(args.url, requests, args.request_rate, args.seed, args.served_model))
        print_result(result, args.output)
        return 0
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
    dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
    result["engine"] = {
        "dtype": dtype,
        "block_size": config.block_size,
        "kv_cache_memory": args.kv_cache_memory,
        "prefill_tokens_with_decodes": config.prefill_tokens_with_decodes,
    }
    if args.vllm_python:
        model = config.model or "smollm2"
        if model not in BUNDLED_MODELS:
            raise SystemExit(f"--vllm-python serves a bundled model ({', '.join(sorted(BUNDLED_MODELS))}), not {model}")
        print_result(result, args.output)  # pagedllm's half, kept should vLLM fail
        gc.collect()
        with vllm_server(args.vllm_python, model, dtype, config.max_model_len or 8192) as url:
            result["vllm_served"] = asyncio.run(replay(url, requests, args.request_rate, args.seed, "default"))
        ours, theirs = result["served"], result["vllm_served"]
        for key in ("itl_p50_s", "itl_p99_s", "e2el_p50_s", "e2el_p99_s", "ttft_p50_s"):
            if key in ours and key in theirs and theirs[key] > 0:
                result[f"pagedllm_over_vllm_{key}"] = round(ours[key] / theirs[key], 3)
    print_result(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
