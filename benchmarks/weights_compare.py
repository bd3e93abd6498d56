"""The same GGUF file with weights=native against weights=dequantized: offline throughput and
prompt throughput, engines alternated.

    python benchmarks/weights_compare.py --model smollm2 --repeats 3

Two runs per engine and round, each engine started afresh in its own process:
- `offline`: every request of the workload at once, greedy, EOS ignored: output tok/s;
- `prompt`: the same prompts with one token out each, so the steps are prompt chunks (up to
  --max-num-batched-tokens, 4,096, a step): prompt tok/s over the wall time.
Prefix caching is off for the prompt run (each prompt is computed whole).  Every run gets the
same warm-up.  Medians with min and max, the ratio round by round, the resident weight bytes
of each engine, and the machine go to bench-results/weights-compare.json (or --output).
"""

from __future__ import annotations

import argparse
import sys

from pagedllm.benchmarking.compare import alternate, format_spread, machine, paired_ratio, summarize
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result, run_in_subprocess, warmup_requests
from pagedllm.config import EngineConfig
from pagedllm.layers.cpu_kernels import cpu_summary

FIGURES = ("output_tokens_per_s", "total_tokens_per_s", "prompt_tokens_per_s", "wall_s", "startup_s", "weight_mib")


def run(config: EngineConfig, requests: list[dict], warmup: list[dict]) -> dict:
    result = run_in_subprocess(config, requests, warmup)
    result["prompt_tokens_per_s"] = round(result["prompt_tokens"] / result["wall_s"], 2)
    result["weight_mib"] = round(result["rank_memory"][0]["weight_bytes"] / 2**20, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", default="benchmarks/workloads/sharegpt-like-160.jsonl")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["offline", "prompt"], choices=["offline", "prompt"])
    parser.add_argument("--output", default="bench-results/weights-compare.json")
    args = parser.parse_args()
    requests = load_workload(args.workload, args.num_requests)
    warmup = warmup_requests(requests)
    report: dict = {"model": args.model, "workload": args.workload, "requests": len(requests)}
    report |= {"repeats": args.repeats, "cpu": cpu_summary(), "machine": machine()}
    print(cpu_summary(), flush=True)
    for kind in args.kinds:
        work = requests if kind == "offline" else [r | {"max_tokens": 1} for r in requests]
        configs = {
            w: EngineConfig(
                model=args.model, dtype=args.dtype, weights=w, kv_cache_memory="4GiB",
                enable_prefix_caching=kind == "offline",
            )
            for w in ("native", "dequantized")
        }  # fmt: skip
        runs = alternate(
            {w: (lambda c=c, work=work: run(c, work, warmup)) for w, c in configs.items()}, args.repeats, log=print
        )
        key = "output_tokens_per_s" if kind == "offline" else "prompt_tokens_per_s"
        entry = {w: summarize(runs[w], FIGURES) for w in configs}
        entry[f"native_over_dequantized_{key}"] = paired_ratio(runs["native"], runs["dequantized"], key)
        entry["runs"] = runs
        report[kind] = entry
        print(format_spread(f"{kind} native / dequantized {key}", entry[f"native_over_dequantized_{key}"]), flush=True)
    print_result(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
