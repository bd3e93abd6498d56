"""The one-call decode step against the Python layer loop, alternated in one process.

    python benchmarks/fused_decode.py --batch 1 8 32 64 128 --context 256 --rounds 8

For each batch: that many requests with random prompts of `--context` tokens are
prefilled, then decode steps run in blocks of `--block` steps, the fused step
(pagedllm/layers/fused_decode.py) and the layer loop taking turns (in alternating
order), `--rounds` blocks each.  Alternating in one process keeps the comparison fair on
a noisy machine: both see the same contexts (growing by one a step) and the same
neighbours.  Every timed step is checked to decode exactly `batch` requests (that the two
paths' outputs are the same to the bit is tests/test_fused_decode.py's job).  Reports the
median and fastest step of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from step_profile import run_batches, start_decoding  # this folder's profile: the same requests, the same report

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine


def run(engine: LLMEngine, batch: int, context: int, rounds: int, block: int, seed: int) -> dict:
    model = engine.runner.model
    fused = model.fused_decode
    if fused is None:
        raise SystemExit("the fused decode step does not apply to this model, dtype or CPU")
    if batch > fused.max_rows:
        raise SystemExit(f"batch {batch} is over the fused step's {fused.max_rows} rows")
    ids = start_decoding(engine, batch, context, 2 * rounds * block + 2, seed, "f")
    for _ in range(2):
        engine.step()  # warm both paths' buffers
    times: dict[str, list[float]] = {"fused": [], "loop": []}
    try:
        for r in range(rounds):
            for mode in ("fused", "loop") if r % 2 == 0 else ("loop", "fused"):
                model.fused_decode = fused if mode == "fused" else None
                for _ in range(block):
                    start = time.perf_counter()
                    outputs = engine.step()
                    times[mode].append(time.perf_counter() - start)
                    if len(outputs) != batch:
                        raise RuntimeError(f"a timed step decoded {len(outputs)} requests, not {batch}")
    finally:
        model.fused_decode = fused
    for request_id in ids:
        engine.abort_request(request_id)
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    fastest = {k: min(v) * 1e3 for k, v in times.items()}
    return {
        "batch": batch,
        "context": context,
        "steps_each": len(times["fused"]),
        "fused_ms_median": round(median["fused"], 2),
        "loop_ms_median": round(median["loop"], 2),
        "fused_ms_min": round(fastest["fused"], 2),
        "loop_ms_min": round(fastest["loop"], 2),
        "fused_over_loop_median": round(median["fused"] / median["loop"], 3),
        "fused_over_loop_min": round(fastest["fused"] / fastest["loop"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default="bench-results/fused-decode.json")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="4GiB", max_num_seqs=max(args.batch)))

    def measure(batch: int, seed: int) -> dict:
        return run(engine, batch, args.context, args.rounds, args.block, seed)

    run_batches(engine, args.batch, measure, args.output)


if __name__ == "__main__":
    main()
