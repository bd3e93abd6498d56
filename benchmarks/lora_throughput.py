"""Output tok/s of a workload spread over several LoRA adapters against the same workload on the
base model alone, in one engine, alternated round by round.

The adapters are random (`pagedllm.testing.lora`; speed does not depend on the values), on every
projection or on `--targets` (PEFT's default for llama models is q_proj v_proj), written under
bench-results/lora/.  Request i runs under adapter i mod N.
Each run starts with the prefix cache emptied, after an untimed warm-up of both kinds.

    python benchmarks/lora_throughput.py --model smollm2 --adapters 8 --rank 16 \\
        --workload benchmarks/workloads/sharegpt-like-160.jsonl --num-requests 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result, run_on_engine, warmup_requests
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.models.loader import read_model_config, resolve_model_path
from pagedllm.models.lora_files import TARGETS
from pagedllm.testing.lora import write_random_adapter


def spread(requests: list[dict], names: list[str] | None) -> list[dict]:
    if not names:
        return requests
    return [r | {"lora": names[i % len(names)]} for i, r in enumerate(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS, help="projections adapted")
    parser.add_argument("--workload", default="benchmarks/workloads/sharegpt-like-160.jsonl")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--output", default="bench-results/lora-throughput.json")
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    config = read_model_config(path)
    root = Path("bench-results/lora") / path.stem
    names = [f"adapter-{i}" for i in range(args.adapters)]
    targets = tuple(args.targets)
    suffix = "all" if set(targets) == set(TARGETS) else "-".join(t.removesuffix("_proj") for t in targets)
    paths = [
        write_random_adapter(root / f"{name}-r{args.rank}-{suffix}", config, args.rank, targets=targets, seed=i)
        for i, name in enumerate(names)
    ]
    modules = [f"{name}={path}" for name, path in zip(names, paths)]
    requests = load_workload(args.workload, args.num_requests)
    engine_config = EngineConfig(
        model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, lora_modules=modules,
        max_loras=max(args.adapters, 1), max_lora_rank=args.rank,
    )  # fmt: skip
    runs: dict[str, list[dict]] = {"base": [], "adapters": []}
    with LLMEngine(engine_config) as engine:
        warmup = warmup_requests(requests)
        run_on_engine(engine, warmup, desc="warm-up base")
        run_on_engine(engine, spread(warmup, names), desc="warm-up adapters")
        for round_index in range(args.repeats):
            order = ["base", "adapters"] if round_index % 2 == 0 else ["adapters", "base"]
            for kind in order:
                engine.reset_prefix_cache()
                workload = spread(requests, names if kind == "adapters" else None)
                runs[kind].append(run_on_engine(engine, workload, desc=f"{kind} {round_index + 1}"))
        info = engine.info
    ratios = [a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(runs["adapters"], runs["base"])]

    def summary(values: list[float]) -> dict:
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": max(values)}

    result = {
        "setup": vars(args) | {"model_path": str(path), "dtype": info.dtype, "cpu": cpu_summary()},
        "base_output_tokens_per_s": summary([r["output_tokens_per_s"] for r in runs["base"]]),
        "adapters_output_tokens_per_s": summary([r["output_tokens_per_s"] for r in runs["adapters"]]),
        "adapters_over_base": summary(ratios),
        "peak_running": [r["peak_running"] for r in runs["base"] + runs["adapters"]],
        "failed_requests": sum(r["failed_requests"] for r in runs["base"] + runs["adapters"]),
    }
    print_result(result, args.output)


if __name__ == "__main__":
    main()
