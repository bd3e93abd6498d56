"""KV cache element types at the same --kv-cache-memory: offline throughput when the cache, not
the compute, limits how many requests run at once.

    python benchmarks/kv_cache_compare.py --kv-cache-memory 128MiB --repeats 3

Every request of the workload at once (greedy, EOS ignored, the engine's defaults otherwise),
once per cache type and round, the types alternated and each engine started afresh in its own
process with the same warm-up.  With a small cache the scheduler runs as many requests as their
blocks fit and preempts when decoding outgrows it; a cache of one-byte values (float8_e4m3) fits
twice the tokens of a 16-bit one.  Medians with min and max of output tok/s, the peak of requests
running in one step and the preemptions, the ratio round by round against the first type, and
the machine go to bench-results/kv-cache-compare.json (or --output).
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.benchmarking.compare import alternate, format_spread, machine, paired_ratio, summarize
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result, run_in_subprocess, warmup_requests
from pagedllm.config import EngineConfig
from pagedllm.layers.cpu_kernels import cpu_summary

FIGURES = ("output_tokens_per_s", "wall_s", "peak_running", "preemptions", "kv_blocks_total")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", default="benchmarks/workloads/sharegpt-like-160.jsonl")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "float8_e4m3"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench-results/kv-cache-compare.json")
    args = parser.parse_args()
    requests = load_workload(args.workload, args.num_requests)
    warmup = warmup_requests(requests)
    configs = {
        kv: EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory)
        for kv in args.kv_cache_dtypes
    }
    print(cpu_summary(), flush=True)
    jobs = {kv: (lambda c=c: run_in_subprocess(c, requests, warmup)) for kv, c in configs.items()}
    runs = alternate(jobs, args.repeats)
    base = args.kv_cache_dtypes[0]
    report: dict = {"model": args.model, "workload": args.workload, "requests": len(requests)}
    report |= {"kv_cache_memory": args.kv_cache_memory, "repeats": args.repeats, "cpu": cpu_summary()}
    report |= {"machine": machine(), "kv_cache_dtype": {kv: runs[kv][0]["kv_cache_dtype"] for kv in configs}}
    report |= {kv: summarize(runs[kv], FIGURES) for kv in configs}
    for kv in args.kv_cache_dtypes[1:]:
        ratio = paired_ratio(runs[kv], runs[base], "output_tokens_per_s")
        report[f"{kv}_over_{base}_output_tokens_per_s"] = ratio
        print(format_spread(f"{kv} / {base} output tok/s", ratio), flush=True)
    report["runs"] = runs
    print_result(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
