"""Beam search memory: KV blocks with beams sharing blocks vs every beam holding its own copy.

Every step each live beam's table is a fork of its parent's (reference
counts, copy-on-write for the partial last block), so the beams hold their
common prefix once.  "Unshared" is the sum of the same tables' lengths, the
blocks the beams would hold if each kept its own copy of its whole KV (as a
per-beam contiguous cache does); both come from the engine's per-step KV
samples of one run.

    python benchmarks/beam_search.py --output docs/results/beam-search.json
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm.benchmarking.throughput import print_result
from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default="bench-results/beam-search.json")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="1GiB"))
    rng = random.Random(0)
    params = SamplingParams(beam_width=args.beam_width, n=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    before = engine.begin_run()
    start = time.perf_counter()
    for i in range(args.prompts):
        engine.add_request([rng.randrange(100, 49000) for _ in range(args.prompt_len)], params, f"beam-{i}")
    outputs = engine.wait_all()
    wall = time.perf_counter() - start
    report = engine.run_report(before)
    block = engine.info.block_size
    result = {
        "setup": vars(args),
        "wall_s": round(wall, 2),
        "hypotheses": sum(len(o.outputs) for o in outputs),
        "kv_peak_blocks_used": report["kv_allocated_peak"] // block,
        "kv_peak_blocks_unshared": report["kv_unshared_peak"] // block,
        "cow_copies": report["cow_copies"],
        "forks": report["forks"],
    }
    result["peak_blocks_shared_over_unshared"] = round(
        result["kv_peak_blocks_used"] / result["kv_peak_blocks_unshared"], 4
    )
    print_result(result, args.output)


if __name__ == "__main__":
    main()
