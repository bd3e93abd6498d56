"""One request, decoded token by token: pagedllm beside llama.cpp on the same GGUF file.

    pip install llama-cpp-python   # builds llama.cpp from source for this CPU (~10 min)
    python benchmarks/llamacpp_compare.py --output docs/results/llamacpp-compare.json

Both engines read the bundled model's GGUF file: llama.cpp (through
llama-cpp-python) computes on its quantized blocks directly, pagedllm
dequantizes them at load time and computes in `--dtype` (`auto`: bfloat16 where
the CPU has AVX512-BF16, else float32).  So llama.cpp reads fewer weight bytes
per token; the comparison is what a user gets from each engine on that file.
The request is the first of `long-output-64` (a 62-token prompt, 322 tokens
out), greedy, EOS ignored, one at a time.  llama.cpp runs with its defaults
plus the thread count its docs recommend (one per physical core, here every
core).  Each engine is timed per token: time to first token (the prompt), then
the mean and median gap between tokens; output tok/s is tokens over the whole
wall time, as `vllm_compare.py --num-requests 1` reports it.  The two token
streams are compared too (how many leading tokens agree), to show both run the
same model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result
from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.execution.device import resolve_dtype
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.models.loader import BUNDLED_MODELS, resolve_model_path


def summarize(stamps: list[float], start: float, tokens: list[int]) -> dict:
    """Per-token figures from the time each token arrived (`stamps`, after `start`)."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    wall = stamps[-1] - start
    return {
        "output_tokens": len(tokens),
        "wall_s": round(wall, 3),
        "ttft_s": round(stamps[0] - start, 4),
        "itl_mean_ms": round(statistics.fmean(gaps) * 1e3, 2),
        "itl_median_ms": round(statistics.median(gaps) * 1e3, 2),
        "decode_tokens_per_s": round(1 / statistics.fmean(gaps), 2),
        "output_tokens_per_s": round(len(tokens) / wall, 2),
    }


def run_pagedllm(config: EngineConfig, prompt: list[int], max_tokens: int) -> tuple[dict, list[int]]:
    begin = time.perf_counter()
    with LLMEngine(config) as engine:
        startup = time.perf_counter() - begin
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(prompt, params, request_id="warm-up")  # first-call costs out of the timing
        engine.wait_all()
        stamps: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        engine.add_request(prompt, params, request_id="timed")
        while engine.has_unfinished_requests():
            for output in engine.step():
                new = list(output.outputs[0].token_ids)[len(tokens) :]
                stamps += [time.perf_counter()] * len(new)
                tokens += new
    return {"startup_s": round(startup, 2)} | summarize(stamps, start, tokens), tokens


def run_llamacpp(path: str, prompt: list[int], max_tokens: int, threads: int) -> tuple[dict, list[int]]:
    from llama_cpp import Llama

    begin = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(prompt) + max_tokens + 8, n_threads=threads, seed=0, verbose=False)
    startup = time.perf_counter() - begin
    results = []
    for _ in range(2):  # a warm-up run, then the timed one
        llm.reset()
        stamps: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; EOS is not special here
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == max_tokens:
                break
        results.append((summarize(stamps, start, tokens), tokens))
    figures, tokens = results[-1]
    return {"startup_s": round(startup, 2), "threads": threads} | figures, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(BUNDLED_MODELS))
    parser.add_argument("--workload", default="benchmarks/workloads/long-output-64.jsonl")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: every core)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    request = load_workload(args.workload, 1)[0]
    prompt, max_tokens = request["prompt_token_ids"], request["max_tokens"]
    gguf = resolve_model_path(args.model)
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    result: dict = {"model": args.model, "gguf": gguf.name, "prompt_tokens": len(prompt), "dtype": dtype}
    result["cpu"] = cpu_summary()
    print(result["cpu"], dtype, flush=True)
    config = EngineConfig(model=args.model, dtype=dtype, max_model_len=2048)
    result["pagedllm"], ours = run_pagedllm(config, prompt, max_tokens)
    result["llama_cpp"], theirs = run_llamacpp(str(gguf), prompt, max_tokens, args.threads)
    result["leading_tokens_agreeing"] = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
    )
    for key in ("decode_tokens_per_s", "output_tokens_per_s"):
        result[f"pagedllm_over_llama_cpp_{key}"] = round(result["pagedllm"][key] / result["llama_cpp"][key], 3)
    print_result(result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
