"""One request, decoded token by token: pagedllm beside llama.cpp on the same GGUF file.

    pip install llama-cpp-python   # builds llama.cpp from source for this CPU (~10 min)
    python benchmarks/llamacpp_compare.py --repeats 3

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
same model.  Each round starts both engines afresh, each decodes the request once untimed
(warm-up) and once timed; rounds alternate which engine goes first, and the JSON reports the
median with min and max of each figure, the per-round ratio, the machine and both versions.
Results go to bench-results/ (ignored by git) unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from pagedllm.benchmarking.compare import alternate, format_spread, machine, package_version, paired_ratio, summarize
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result
from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.execution.device import resolve_dtype
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.models.loader import BUNDLED_MODELS, resolve_model_path


def token_figures(stamps: list[float], start: float, tokens: list[int]) -> dict:
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
    return {"startup_s": round(startup, 2)} | token_figures(stamps, start, tokens), tokens


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
        results.append((token_figures(stamps, start, tokens), tokens))
    figures, tokens = results[-1]
    return {"startup_s": round(startup, 2), "threads": threads} | figures, tokens


FIGURES = ("decode_tokens_per_s", "output_tokens_per_s", "ttft_s", "itl_median_ms", "startup_s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(BUNDLED_MODELS))
    parser.add_argument("--workload", default="benchmarks/workloads/long-output-64.jsonl")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "native", "dequantized"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: every core)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts both engines afresh")
    parser.add_argument("--output", default="bench-results/llamacpp-compare.json")
    args = parser.parse_args()
    request = load_workload(args.workload, 1)[0]
    prompt, max_tokens = request["prompt_token_ids"], request["max_tokens"]
    gguf = resolve_model_path(args.model)
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    config = EngineConfig(model=args.model, dtype=dtype, max_model_len=2048, weights=args.weights)
    streams: dict[str, list[int]] = {}

    def ours() -> dict:
        figures, streams["pagedllm"] = run_pagedllm(config, prompt, max_tokens)
        return figures

    def theirs() -> dict:
        figures, streams["llama_cpp"] = run_llamacpp(str(gguf), prompt, max_tokens, args.threads)
        return figures

    print(cpu_summary(), dtype, flush=True)
    results = alternate({"pagedllm": ours, "llama_cpp": theirs}, args.repeats, log=lambda x: print(x, flush=True))
    report: dict = {"model": args.model, "gguf": gguf.name, "prompt_tokens": len(prompt), "dtype": dtype}
    report |= {"repeats": args.repeats, "machine": machine()}
    report["settings"] = {
        "pagedllm": dataclasses.asdict(config),
        "llama_cpp": {"version": package_version("llama_cpp_python"), "n_threads": args.threads, "greedy": True},
    }
    report["pagedllm"] = summarize(results["pagedllm"], FIGURES)
    report["llama_cpp"] = summarize(results["llama_cpp"], FIGURES)
    a, b = streams["pagedllm"], streams["llama_cpp"]
    report["leading_tokens_agreeing"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for key in ("decode_tokens_per_s", "output_tokens_per_s"):
        report[f"pagedllm_over_llama_cpp_{key}"] = paired_ratio(results["pagedllm"], results["llama_cpp"], key)
    report["runs"] = results
    print_result(report, args.output)
    print(format_spread("pagedllm / llama.cpp decode tok/s", report["pagedllm_over_llama_cpp_decode_tokens_per_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
