"""pagedllm vs transformers' own `generate`, engines alternated.

Same model (the bundled SmolLM2 GGUF, dequantized by both), same dtype, same requests, greedy,
EOS ignored.  transformers runs static batches (default 16): prompts left-padded, each batch
generating until its longest request is done; only the tokens each request asked for are
counted (pagedllm/benchmarking/peers.py).  pagedllm gets every request at once.  Each round
starts both afresh and runs the same warm-up (4 reversed prompts, 16 tokens each) before the
timed run; rounds alternate which goes first.

    python benchmarks/compare_transformers.py --workload benchmarks/workloads/random-128.jsonl \
        --dtype float32 --repeats 3

Results go to bench-results/ (ignored by git) unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from pagedllm.benchmarking.compare import alternate, format_spread, machine, package_version, paired_ratio, summarize
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.peers import transformers_generate
from pagedllm.benchmarking.throughput import print_result, run_in_subprocess, warmup_requests
from pagedllm.config import EngineConfig
from pagedllm.models.loader import default_model_path

FIGURES = ("output_tokens_per_s", "total_tokens_per_s", "wall_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench-results/compare-transformers.json")
    args = parser.parse_args()

    requests = load_workload(args.workload, args.num_requests)
    warmup = warmup_requests(requests)
    config = EngineConfig(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)

    def transformers_run() -> dict:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, args.dtype)
        )
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        transformers_generate(model.eval(), warmup, args.batch_size, pad_id=pad)
        return transformers_generate(model, requests, args.batch_size, pad_id=pad)

    runs = {"pagedllm": lambda: run_in_subprocess(config, requests, warmup), "transformers": transformers_run}
    results = alternate(runs, args.repeats)
    report = {
        "workload": Path(args.workload).name,
        "requests": len(requests),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "machine": machine(),
        "settings": {
            "pagedllm": dataclasses.asdict(config),
            "transformers": {"version": package_version("transformers"), "batch_size": args.batch_size},
        },
        "pagedllm": summarize(results["pagedllm"], FIGURES),
        "transformers": summarize(results["transformers"], FIGURES),
        "pagedllm_over_transformers": paired_ratio(results["pagedllm"], results["transformers"], "output_tokens_per_s"),
        "peak_running": [run["peak_running"] for run in results["pagedllm"]],
    }
    print_result(report, args.output)
    print(format_spread("pagedllm / transformers output tok/s", report["pagedllm_over_transformers"], "x"))


if __name__ == "__main__":
    main()
