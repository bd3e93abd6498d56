"""A workload's wall time split by kind of step: steps that carry prompt tokens, and decode-only
steps by how many requests they decode (fewer than 20: the tail of the longest outputs; 20-63;
at least 64, where the fused decode step splits the rows between two threads).

    python benchmarks/step_kinds.py benchmarks/workloads/sharegpt-like-160.jsonl [--model M] [--num-requests 32]
    PAGEDLLM_FUSED_DECODE=0 python benchmarks/step_kinds.py benchmarks/workloads/sharegpt-like-160.jsonl

Every request is submitted at once (greedy, EOS ignored, a 4 GiB KV cache, the engine's
defaults otherwise), as `pagedllm bench` runs a workload; each step is timed around
`LLMEngine.step()` and counted by what the scheduler gave it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.layers.cpu_kernels import cpu_summary


def step_kind(tokens: list[int]) -> str:
    """The kind of a step that computes `tokens[i]` tokens of its i-th request."""
    if max(tokens) > 1:
        return "with prompt tokens"
    if len(tokens) >= 64:
        return "decode, >= 64"
    return "decode, 20-63" if len(tokens) >= 20 else "decode, < 20"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=None, help="the workload's first N requests (default: all)")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory="4GiB"))
    fused = engine.runner.model.fused_decode is not None
    print(f"{cpu_summary()}, {str(engine.dtype).removeprefix('torch.')}, fused decode step: {fused}")
    with open(args.workload) as f:
        for line in list(f)[: args.num_requests]:
            r = json.loads(line)
            params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
            engine.add_request(r["prompt_token_ids"], params, r["id"])
    schedule, last = engine.scheduler.schedule, {}

    def recording_schedule():
        last["output"] = schedule()
        return last["output"]

    engine.scheduler.schedule = recording_schedule
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        tokens = [c.num_new_tokens for c in last["output"].scheduled]
        if not tokens:
            continue
        entry = kinds[step_kind(tokens)]
        entry[0] += 1
        entry[1] += elapsed
        entry[2] += len(tokens)
    print(f"wall {time.perf_counter() - start:.2f} s")
    for kind, (steps, seconds, requests) in kinds.items():
        print(f"{kind}: {steps} steps, {seconds:.2f} s, {requests / steps:.1f} requests a step on average")


if __name__ == "__main__":
    main()
