"""pagedllm against OpenVINO GenAI on the same workload, offline, engines alternated.

    python benchmarks/openvino_compare.py --openvino-python O/bin/python \
        --model bench-results/models/llama3.2-1b/Q4_K_M.gguf \
        --workload benchmarks/workloads/sharegpt-like-160.jsonl --num-requests 32 --repeats 3

OpenVINO GenAI is Intel's own runtime for LLMs on its CPUs, with a paged KV cache and continuous
batching.  It is not a dependency: it lives in its own virtual environment (`python -m venv O &&
O/bin/pip install openvino-genai "optimum-intel[openvino]"`).  It reads the Hugging Face
directory beside the GGUF file (benchmarks/make_models.py --hf writes it, the same weights),
exported once to OpenVINO IR with its weights compressed to `--weight-format` (int4, the default,
as close to a Q4_K_M file as it comes; int8) by optimum-cli, as its docs make a model; then a
`ContinuousBatchingPipeline` on the CPU with its scheduler's defaults, prefix caching on and the
same KV cache size (pagedllm/benchmarking/peers.py).

Each round starts each engine in a fresh process (start-up timed), runs the same warm-up (the
first 4 prompts reversed, 16 tokens each), then the whole workload at once, timed: token-id
prompts, greedy, EOS ignored.  Rounds alternate which engine goes first; the JSON has every run,
the median with min and max of each figure, the per-round ratio and the machine.  Results go to
bench-results/ (ignored by git) unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

from pagedllm.benchmarking.compare import alternate, machine, offline_header, offline_report, print_offline
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.peers import openvino_model, openvino_version, peer_directory, run_openvino_offline
from pagedllm.benchmarking.throughput import print_result, run_in_subprocess, warmup_requests
from pagedllm.config import EngineConfig, parse_bytes
from pagedllm.execution.device import resolve_dtype


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--openvino-python", required=True, help="the python of the venv that has openvino-genai")
    parser.add_argument("--model", required=True, help="a bundled model or a .gguf file with hf/ beside it")
    parser.add_argument("--workload", required=True, help="a JSONL workload (token-id prompts)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--weight-format", default="int4", choices=["int4", "int8"], help="OpenVINO's weights")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="both engines' KV cache (OpenVINO: whole GB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts both engines afresh")
    parser.add_argument("--output", default="bench-results/openvino-compare.json")
    args = parser.parse_args()
    hf_dir = peer_directory(args.model)
    ov_dir = openvino_model(args.openvino_python, hf_dir, args.weight_format)
    requests = load_workload(args.workload, args.num_requests)
    warmup = warmup_requests(requests)
    dtype = str(resolve_dtype("auto")).removeprefix("torch.")
    kv_bytes = parse_bytes(args.kv_cache_memory)
    config = EngineConfig(model=args.model, kv_cache_memory=kv_bytes, max_model_len=args.max_model_len)
    ov_run = {"workload": str(Path(args.workload).resolve()), "num_requests": len(requests), "model": str(ov_dir),
              "cache_gb": max(1, -(-kv_bytes // 10**9)), "warmup": warmup}  # fmt: skip
    logs, ov_round = Path(args.output).with_suffix(""), itertools.count(1)

    def run_openvino() -> dict:
        log = logs.with_name(f"{logs.name}.openvino-run{next(ov_round)}.log")
        return run_openvino_offline(args.openvino_python, ov_run, log)

    runs = {"pagedllm": lambda: run_in_subprocess(config, requests, warmup), "openvino": run_openvino}
    print(machine()["cpu"], dtype, f"OpenVINO {args.weight_format}", flush=True)
    results = alternate(runs, args.repeats, log=lambda line: print(line, flush=True))
    ours, theirs = results["pagedllm"], results["openvino"]
    report = {
        **offline_header(args.workload, len(requests), dtype, args.repeats),
        "settings": {
            "pagedllm": dataclasses.asdict(config),
            "openvino": {
                "version": openvino_version(args.openvino_python),
                "weight_format": args.weight_format,
                "pipeline": {k: v for k, v in ov_run.items() if k not in ("warmup", "workload")},
            },
            "warmup": {"requests": len(warmup), "max_tokens": warmup[0]["max_tokens"] if warmup else 0},
        },
        **offline_report("openvino", ours, theirs),
    }
    print_result(report, args.output)
    print_offline(report, "openvino", "OpenVINO GenAI")
    return 0


if __name__ == "__main__":
    sys.exit(main())
