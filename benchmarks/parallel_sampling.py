"""Parallel sampling (n>1) with shared prompt blocks vs the same samples without sharing.

Shared: P requests with `n=K` each; every prompt is computed once and its
blocks are held by the K samples (reference counts), which copy only the
partial last block when they diverge.  Unshared: the same P*K samples as P*K
independent requests (sample i of a prompt with seed+i, so the tokens are the
same) with prefix caching off, so every sample computes and stores its own
prompt.  Side by side in one process:

    python benchmarks/parallel_sampling.py --output docs/results/parallel-sampling.json
"""

from __future__ import annotations

import argparse
import gc
import random

from pagedllm.benchmarking.throughput import print_result, run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--output", default="bench-results/parallel-sampling.json")
    args = parser.parse_args()

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    common = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    shared = [
        {"id": f"p{i}", "prompt_token_ids": p, "n": args.n, "seed": 1000 * i, **common} for i, p in enumerate(prompts)
    ]
    unshared = [
        {"id": f"p{i}#{k}", "prompt_token_ids": p, "n": 1, "seed": 1000 * i + k, **common}
        for i, p in enumerate(prompts)
        for k in range(args.n)
    ]
    results = {}
    for name, requests, caching in (("shared", shared, True), ("unshared", unshared, False)):
        config = EngineConfig(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=caching)
        engine = LLMEngine(config)
        results[name] = run_on_engine(engine, requests, desc=name)
        del engine
        gc.collect()
    s, u = results["shared"], results["unshared"]
    results["peak_blocks_shared_over_unshared"] = round(s["kv_peak_blocks_used"] / u["kv_peak_blocks_used"], 4)
    results["output_tokens_per_s_ratio"] = round(s["output_tokens_per_s"] / u["output_tokens_per_s"], 3)
    results["setup"] = vars(args)
    print_result(results, args.output)


if __name__ == "__main__":
    main()
