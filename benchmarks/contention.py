"""Throughput on a quiet machine and beside busy-loop processes, for each thread policy.

    python benchmarks/contention.py --busy 1 2 --output docs/results/contention.json

One engine; for each policy (`adaptive`: the default, threads follow the cores
other processes leave free; `all-cores`: one thread per core whatever runs
beside; `one`: a single thread) the same batch of requests runs quiet, then
beside 1 (and 2, ...) busy-loop processes this script starts and stops itself.
It reports output tokens per second and each busy figure as a share of the
same policy's quiet one, with the CPU and dtype.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.execution.thread_control import AdaptiveThreads, allowed_cpus
from pagedllm.layers.cpu_kernels import cpu_summary

BUSY_LOOP = "while True: pass"


def run_batch(engine: LLMEngine, args: argparse.Namespace, tag: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, params, f"{tag}-{i}")
    threads_seen: list[int] = []
    start = time.perf_counter()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
        threads_seen.append(torch.get_num_threads())
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    if tokens != args.num_requests * args.output_len:
        raise RuntimeError(f"expected {args.num_requests * args.output_len} output tokens, got {tokens}")
    return {
        "seconds": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "threads_by_step": sorted(set(threads_seen)),
        "steps_at_each_thread_count": {n: threads_seen.count(n) for n in sorted(set(threads_seen))},
    }


def with_busy_loops(count: int, fn):
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.5)
        return fn()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def set_policy(engine: LLMEngine, policy: str) -> None:
    cores = len(allowed_cpus())
    if policy == "adaptive":
        engine.threads = AdaptiveThreads(torch.set_num_threads)
    else:
        engine.threads = None
        torch.set_num_threads(cores if policy == "all-cores" else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["adaptive", "all-cores", "one"])
    parser.add_argument("--busy", type=int, nargs="+", default=[1], help="numbers of busy-loop processes to try")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default="bench-results/contention.json")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="1GiB"))
    set_policy(engine, "all-cores")
    run_batch(engine, args, "warmup")  # first-use costs (oneDNN primitives, page faults) out of the figures
    result: dict = {
        "cpu": cpu_summary(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "workload": vars(args) | {"output": None},
        "policies": {},
    }
    print(result["cpu"], result["dtype"])
    for policy in args.policies:
        set_policy(engine, policy)
        quiet = run_batch(engine, args, f"{policy}-quiet")
        rows = {"quiet": quiet}
        print(f"{policy:>10} quiet:  {quiet['output_tokens_per_s']:7.1f} tok/s  threads {quiet['threads_by_step']}")
        for count in args.busy:
            set_policy(engine, policy)  # adaptive starts from all cores again, and must find out for itself
            busy = with_busy_loops(count, lambda tag=f"{policy}-busy{count}": run_batch(engine, args, tag))
            busy["share_of_quiet"] = round(busy["output_tokens_per_s"] / quiet["output_tokens_per_s"], 3)
            rows[f"busy_{count}"] = busy
            print(
                f"{policy:>10} busy {count}: {busy['output_tokens_per_s']:7.1f} tok/s  "
                f"({busy['share_of_quiet']:.0%} of quiet)  threads {busy['steps_at_each_thread_count']}"
            )
        result["policies"][policy] = rows
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
