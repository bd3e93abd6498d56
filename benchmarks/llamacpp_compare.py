"""pagedllm beside llama.cpp on the same GGUF file: one request token by token, and batches.

    pip install llama-cpp-python   # builds llama.cpp from source for this CPU (~10 min)
    python benchmarks/llamacpp_compare.py --scenario one-128 one-1024 batch-8 batch-32 --repeats 3
    python benchmarks/llamacpp_compare.py --model bench-results/models/llama3.2-1b/Q4_K_M.gguf \
        --engines native llama_cpp --scenario one-128   # a real-size file (benchmarks/make_models.py)

Engines, all reading the same GGUF file (the bundled model's unless --model names another):
- `native`: pagedllm with weights=native, computing on the file's quantized blocks;
- `dequantized`: pagedllm with weights=dequantized (the file dequantized to --dtype at load);
- `llama_cpp`: llama.cpp through llama-cpp-python, with its defaults plus the thread count its
  docs recommend (one per physical core, here every core).
Scenarios:
- `one-128`, `one-1024`: one request, a prompt of 128 or 1,024 tokens (the random-128 workload's
  ids, concatenated), 256 tokens out, timed token by token: time to first token, then the mean
  gap between tokens (decode tok/s).  llama.cpp runs it through `Llama.generate`.
- `prompt-512`, `prompt-2048`: one request of 512 or 2,048 prompt tokens, 8 out: time to first
  token is the figure compared (llama.cpp with llama-cpp-python's default n_batch, 512).
- `batch-8`, `batch-32`: the first 8 or 32 requests of sharegpt-like-160, all at once; output
  tok/s over the wall time.  llama.cpp runs them through its batch API as its server does with
  several slots: one context with a sequence per request and a unified KV cache, prompts packed
  into batches of n_batch (2,048) tokens, then one token per unfinished sequence per
  `llama_decode`; `--llama-cpp-split-kv` gives each sequence its own share of the cache, as
  llama-server does when `-np N` is given.
For one request the report also gives the machine's read bandwidth (a 1 GiB tensor summed,
median of 7, before the rounds), the bytes a token reads (the file's tensors; of an untied
embedding table one row), the ceiling `bandwidth / bytes` and each engine's decode as a fraction
of it.  On a shared machine the bandwidth drifts from minute to minute (a 2-core VM read 22 to
45 GB/s within the hour), so each one-request run also sums the tensor three times just before
its engine starts and three times just after it is freed, and the fraction is also taken run by
run against the median of those six (`<engine>_fraction_of_own_ceiling`: median, min and max
over the rounds).
Greedy, EOS ignored.  Each round starts every engine afresh; each runs its scenario once untimed
with at most 8 tokens out (warm-up, on prompts whose first token differs, so that the timed run
finds none of its prompt already computed) and once timed; rounds rotate which engine goes first, and
the JSON reports the median with min and max, the ratios per round, the machine and the
versions.  The token streams are compared too (leading tokens that agree).  Results go to
bench-results/ unless --output says.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

from pagedllm.benchmarking.compare import (
    alternate,
    format_spread,
    machine,
    package_version,
    paired_ratio,
    read_bandwidth_gbs,
    spread,
    summarize,
)
from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result
from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.execution.device import resolve_dtype
from pagedllm.layers.cpu_kernels import cpu_summary
from pagedllm.models.loader import BUNDLED_MODELS, resolve_model_path

SCENARIOS = ("one-128", "one-1024", "prompt-512", "prompt-2048", "batch-8", "batch-32")
ONE_REQUEST_OUTPUT = 256
PROMPT_OUTPUT = 8  # the prompt-N scenarios: time to first token is their figure
LLAMA_CPP_N_BATCH = 2048  # llama-server's default logical batch
WARM_UP_TOKENS = 8


def decode_bytes_per_token(path) -> int:
    """The file's tensor bytes that one decode step reads: all of them, but for an untied
    embedding table, of which it reads one row."""
    import gguf as gguf_lib

    tensors = gguf_lib.GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def requests_for(scenario: str) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of each request of a scenario."""
    if scenario.startswith(("one-", "prompt-")):
        kind, length = scenario.split("-")
        ids = [t for r in load_workload("benchmarks/workloads/random-128.jsonl", 128) for t in r["prompt_token_ids"]]
        if len(ids) < int(length):
            raise ValueError(f"random-128.jsonl holds {len(ids)} prompt tokens, fewer than {scenario} needs")
        return [(ids[: int(length)], ONE_REQUEST_OUTPUT if kind == "one" else PROMPT_OUTPUT)]
    count = int(scenario.removeprefix("batch-"))
    return [
        (r["prompt_token_ids"], r["max_tokens"])
        for r in load_workload("benchmarks/workloads/sharegpt-like-160.jsonl", count)
    ]


def warm_up_prompt(prompt: list[int]) -> list[int]:
    """The prompt with its first token changed: a warm-up on it shares no prefix with the timed
    run, so neither engine's timed run finds its prompt already computed (pagedllm's prefix
    cache, llama.cpp's reuse of the context's tokens)."""
    return [prompt[0] ^ 1, *prompt[1:]]


def token_figures(stamps: list[float], start: float, tokens: list[int]) -> dict:
    """Per-token figures from the time each token arrived (`stamps`, after `start`)."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    wall = stamps[-1] - start
    return {
        "output_tokens": len(tokens),
        "wall_s": round(wall, 3),
        "ttft_s": round(stamps[0] - start, 4),
        "itl_median_ms": round(statistics.median(gaps) * 1e3, 2),
        "decode_tokens_per_s": round(1 / statistics.fmean(gaps), 2),
        "output_tokens_per_s": round(len(tokens) / wall, 2),
    }


def run_pagedllm(config: EngineConfig, requests: list[tuple[list[int], int]]) -> tuple[dict, list[list[int]]]:
    begin = time.perf_counter()
    with LLMEngine(config) as engine:
        startup = time.perf_counter() - begin
        for round_ in ("warm-up", "timed"):
            streams: dict[str, list[int]] = {}
            stamps: list[float] = []
            start = time.perf_counter()
            for i, (prompt, max_tokens) in enumerate(requests):
                if round_ == "warm-up":
                    prompt, max_tokens = warm_up_prompt(prompt), min(max_tokens, WARM_UP_TOKENS)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(prompt, params, request_id=f"{round_}-{i}")
                streams[f"{round_}-{i}"] = []
            while engine.has_unfinished_requests():
                for output in engine.step():
                    new = list(output.outputs[0].token_ids)[len(streams[output.request_id]) :]
                    stamps += [time.perf_counter()] * len(new)
                    streams[output.request_id] += new
        weights = engine.rank_memory[0].weight_bytes
    tokens = list(streams.values())
    figures = {"startup_s": round(startup, 2), "weight_mib": round(weights / 2**20, 1)}
    return figures | summary(stamps, start, tokens), tokens


def summary(stamps: list[float], start: float, tokens: list[list[int]]) -> dict:
    if len(tokens) == 1:
        return token_figures(stamps, start, tokens[0])
    wall = max(stamps) - start
    total = sum(len(t) for t in tokens)
    return {"output_tokens": total, "wall_s": round(wall, 3), "output_tokens_per_s": round(total / wall, 2)}


def run_llamacpp(
    path: str, requests: list[tuple[list[int], int]], threads: int, unified: bool = True
) -> tuple[dict, list[list[int]]]:
    import llama_cpp

    begin = time.perf_counter()
    if len(requests) == 1:
        prompt, max_tokens = requests[0]
        llm = llama_cpp.Llama(path, n_ctx=len(prompt) + max_tokens + 8, n_threads=threads, seed=0, verbose=False)
        startup = time.perf_counter() - begin
        for ids, limit in ((warm_up_prompt(prompt), WARM_UP_TOKENS), (prompt, max_tokens)):  # warm-up, timed
            stamps: list[float] = []
            tokens: list[int] = []
            start = time.perf_counter()
            for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):  # greedy; EOS is not special here
                stamps.append(time.perf_counter())
                tokens.append(int(token))
                if len(tokens) == limit:
                    break
        llm.close()
        return {"startup_s": round(startup, 2), "threads": threads} | token_figures(stamps, start, tokens), [tokens]
    batched = LlamaCppBatch(path, requests, threads, unified)
    startup = time.perf_counter() - begin
    for warm_up, limit in ((True, WARM_UP_TOKENS), (False, None)):
        start = time.perf_counter()
        tokens, stamps = batched.run(limit, warm_up)
    batched.close()
    return {"startup_s": round(startup, 2), "threads": threads} | summary(stamps, start, tokens), tokens


class LlamaCppBatch:
    """Greedy decoding of several sequences at once through llama.cpp's C API (as llama-server
    runs its slots): one context, a sequence id per request, a unified KV cache."""

    def __init__(self, path: str, requests: list[tuple[list[int], int]], threads: int, unified: bool = True) -> None:
        import llama_cpp as lc

        self.lc, self.requests = lc, requests
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        # Unified: one pool of every sequence's tokens (llama-server's default); else each
        # sequence gets n_ctx / n_seq_max cells (llama-server with an explicit -np).
        longest = max(len(p) + m for p, m in requests) + 16
        params.n_ctx = sum(len(p) + m for p, m in requests) + 16 if unified else longest * len(requests)
        params.n_batch = LLAMA_CPP_N_BATCH
        params.n_seq_max = len(requests)
        params.kv_unified = unified
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(LLAMA_CPP_N_BATCH, len(requests)), 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))))

    def run(self, limit: int | None = None, warm_up: bool = False) -> tuple[list[list[int]], list[float]]:
        """Every request to its output length (at most `limit` tokens each); `warm_up`: on the
        warm-up prompts."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        tokens: list[list[int]] = [[] for _ in self.requests]
        stamps: list[float] = []
        pending: list[tuple[int, int, int, bool]] = []  # prompts, packed into batches of n_batch
        for seq, (prompt, _) in enumerate(self.requests):
            prompt = warm_up_prompt(prompt) if warm_up else prompt
            pending += [(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
        for first in range(0, len(pending), LLAMA_CPP_N_BATCH):
            chunk = pending[first : first + LLAMA_CPP_N_BATCH]
            self._decode(chunk)
            for i, (_, _, seq, last) in enumerate(chunk):
                if last:
                    tokens[seq].append(self._argmax(i))
                    stamps.append(time.perf_counter())
        while True:
            live = [s for s, (_, n) in enumerate(self.requests) if len(tokens[s]) < min(n, limit or n)]
            if not live:
                return tokens, stamps
            self._decode([(tokens[s][-1], len(self.requests[s][0]) + len(tokens[s]) - 1, s, True) for s in live])
            for i, s in enumerate(live):
                tokens[s].append(self._argmax(i))
            stamps += [time.perf_counter()] * len(live)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


FIGURES = (
    "decode_tokens_per_s", "output_tokens_per_s", "ttft_s", "itl_median_ms", "startup_s", "weight_mib",
    "read_bandwidth_gbs",
)  # fmt: skip


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of tokens before each stream's first difference."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b))
    return round(same / max(1, sum(len(s) for s in a)), 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="smollm2", help=f"a bundled model ({', '.join(BUNDLED_MODELS)}) or a .gguf file"
    )
    parser.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--engines", nargs="+", default=["native", "dequantized", "llama_cpp"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: every core)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each starts every engine afresh")
    parser.add_argument(
        "--llama-cpp-split-kv",
        action="store_true",
        help="batches: a KV share per sequence (llama-server with -np N) instead of its default unified cache",
    )
    parser.add_argument("--output", default=None, help="default: bench-results/llamacpp-<model>.json")
    args = parser.parse_args()
    gguf = resolve_model_path(args.model)
    label = args.model if args.model in BUNDLED_MODELS else f"{gguf.parent.name}-{gguf.stem}"
    dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    configs = {
        w: EngineConfig(model=args.model, dtype=dtype, max_model_len=4096, weights=w, kv_cache_memory="2GiB")
        for w in ("native", "dequantized")
    }
    report: dict = {"model": args.model, "gguf": gguf.name, "dtype": dtype, "repeats": args.repeats}
    report |= {"machine": machine(), "cpu": cpu_summary()}
    # One stream's ceiling: the machine's read bandwidth over the bytes a token reads.
    report["read_bandwidth_gbs"] = read_bandwidth_gbs()
    report["bytes_read_per_token"] = decode_bytes_per_token(gguf)
    ceiling = report["read_bandwidth_gbs"]["median"] * 1e9 / report["bytes_read_per_token"]
    report["decode_ceiling_tokens_per_s"] = round(ceiling, 1)
    print(f"read bandwidth {format_spread('', report['read_bandwidth_gbs'])} GB/s; ceiling {ceiling:.1f} tok/s")
    report["settings"] = {w: dataclasses.asdict(c) for w, c in configs.items()}
    report["settings"]["llama_cpp"] = {
        "version": package_version("llama_cpp_python"), "n_threads": args.threads, "n_batch": LLAMA_CPP_N_BATCH,
        "kv_unified": not args.llama_cpp_split_kv,
    }  # fmt: skip
    print(cpu_summary(), dtype, flush=True)
    for scenario in args.scenario:
        requests = requests_for(scenario)
        streams: dict[str, list[list[int]]] = {}

        def engine_run(name: str, requests=requests, streams=streams):
            def run() -> dict:
                # the bandwidth as this run met it, read just before and just after it (module doc)
                bandwidth = read_bandwidth_gbs(repeats=3)["runs"] if len(requests) == 1 else []
                if name == "llama_cpp":
                    unified = not args.llama_cpp_split_kv
                    figures, streams[name] = run_llamacpp(str(gguf), requests, args.threads, unified)
                else:
                    figures, streams[name] = run_pagedllm(configs[name], requests)
                if bandwidth:
                    bandwidth += read_bandwidth_gbs(repeats=3)["runs"]
                    figures["read_bandwidth_gbs"] = statistics.median(bandwidth)
                return figures

            return run

        runs = alternate({name: engine_run(name) for name in args.engines}, args.repeats, log=print)
        key = "decode_tokens_per_s" if len(requests) == 1 else "output_tokens_per_s"
        key = "ttft_s" if scenario.startswith("prompt-") else key
        entry: dict = {"requests": len(requests), "prompt_tokens": sum(len(p) for p, _ in requests)}
        entry |= {name: summarize(runs[name], FIGURES) for name in args.engines}
        for ours in ("native", "dequantized"):
            for theirs in args.engines:
                if ours in runs and theirs != ours and not (ours == "dequantized" and theirs == "native"):
                    higher_is_better = key != "ttft_s"
                    entry[f"{ours}_over_{theirs}_{key}"] = paired_ratio(runs[ours], runs[theirs], key, higher_is_better)
                    entry[f"{ours}_vs_{theirs}_leading_tokens_agreeing"] = leading_agreement(
                        streams[ours], streams[theirs]
                    )
        if scenario.startswith("one-"):  # each engine's one-stream decode as a fraction of the ceiling
            for name in args.engines:
                median = entry[name]["decode_tokens_per_s"]["median"]
                entry[f"{name}_fraction_of_ceiling"] = round(median / ceiling, 3)
                per_run = [
                    one["decode_tokens_per_s"] * report["bytes_read_per_token"] / (one["read_bandwidth_gbs"] * 1e9)
                    for one in runs[name]
                ]
                entry[f"{name}_fraction_of_own_ceiling"] = spread(per_run)
                print(
                    f"{scenario} {name}: {median} tok/s, {median / ceiling:.0%} of the ceiling; "
                    f"{format_spread('run by run', entry[f'{name}_fraction_of_own_ceiling'])} of each run's own",
                    flush=True,
                )
        entry["runs"] = runs
        report[scenario] = entry
        for name, figures in entry.items():
            if name.endswith(key):
                print(format_spread(f"{scenario} {name}", figures), flush=True)
    print_result(report, args.output or f"bench-results/llamacpp-{label}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
