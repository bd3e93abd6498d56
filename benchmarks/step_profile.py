"""Where a decode step's time goes: the model's math against the engine's own work.

    python benchmarks/step_profile.py --batch 64 128 256 --context 256 --steps 10

For each batch size: that many requests with random prompts of `--context`
tokens are prefilled, then `--steps` decode steps are timed piece by piece
(wrapping the engine's own methods, nothing else changed).  Every timed step
is checked to decode exactly `batch` requests (one token each), or the run
stops with an error: the requests' `max_tokens` reaches past the prefill and
the timed steps, and they are aborted afterwards.

- model math: the forward pass (of which attention is reported apart), the LM
  head on the sampled rows, and the sampler;
- engine overhead: scheduling, copy-on-write block copies, building the step's
  tensors, and updating requests (append, stops, detokenizing, outputs),
  plus whatever of `LLMEngine.step()` none of the above covers.

Where a decode-only step runs all layers in one C++ call (pagedllm/layers/fused_decode.py),
attention happens inside it and is not timed apart; `--no-fused` runs the Python layer
loop instead, where it is.  Each result says which ran (`fused_decode`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.layers.cpu_kernels import cpu_summary


def timed(totals: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def start_decoding(engine: LLMEngine, batch: int, context: int, steps: int, seed: int, prefix: str) -> list[str]:
    """`batch` requests of random `context`-token prompts, prefilled (untimed); returns their ids."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    # Long enough that nobody finishes during the prefill steps (up to batch of them) or the timed ones.
    params = SamplingParams(temperature=0.0, max_tokens=batch + steps + 8, ignore_eos=True)
    ids = [f"{prefix}{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params, request_id)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # prefill (and the first decodes) untimed
    return ids


def run_batches(engine: LLMEngine, batches: list[int], measure, output: str | None) -> None:
    """measure(batch, seed) -> a result for each batch, printed; all of them written to `output`."""
    print(f"{cpu_summary()}, {str(engine.dtype).removeprefix('torch.')}")
    results = []
    for seed, batch in enumerate(batches):
        result = measure(batch, seed)
        print(json.dumps(result))
        results.append(result)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "dtype": str(engine.dtype),
            "kv_cache_dtype": str(engine.kv_dtype),
            "cpu": cpu_summary(),
            "results": results,
        }
        Path(output).write_text(json.dumps(summary, indent=2) + "\n")


def profile(engine: LLMEngine, batch: int, context: int, steps: int, seed: int) -> dict:
    ids = start_decoding(engine, batch, context, steps, seed, "p")

    totals: dict[str, float] = defaultdict(float)
    runner, model = engine.runner, engine.runner.model
    patches = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "copy_blocks", "copy_blocks"),
        (runner, "prepare", "prepare_tensors"),
        (model, "forward", "forward"),
        (model, "compute_logits", "lm_head"),
        (runner, "sampler", "sampler"),
        (engine, "_update", "update"),
        (model, "attention", "attention"),  # inside forward
    ]
    originals = [getattr(obj, attr) for obj, attr, _ in patches]
    for obj, attr, name in patches:
        setattr(obj, attr, timed(totals, name, getattr(obj, attr)))
    schedule = engine.scheduler.schedule

    def checked_schedule():
        output = schedule()
        tokens = [s.num_new_tokens for s in output.scheduled]
        if len(tokens) != batch or set(tokens) != {1}:
            raise RuntimeError(
                f"a timed step ran {len(tokens)} requests, {sum(tokens)} tokens, not a decode of {batch}"
            )
        return output

    engine.scheduler.schedule = checked_schedule
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        for (obj, attr, _), original in zip(patches, originals):
            setattr(obj, attr, original)
    for request_id in ids:
        engine.abort_request(request_id)

    math = totals["forward"] + totals["lm_head"] + totals["sampler"]
    overhead = wall - math
    per_step = {name: round(value / steps * 1e3, 2) for name, value in sorted(totals.items())}
    fused = model.fused_decode
    return {
        "batch": batch,
        "context": context,
        "fused_decode": fused is not None and batch <= fused.max_rows,
        "step_ms": round(wall / steps * 1e3, 2),
        "ms_per_step": per_step,
        "model_math_ms": round(math / steps * 1e3, 2),
        "engine_overhead_ms": round(overhead / steps * 1e3, 2),
        "engine_overhead_share": round(overhead / wall, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output", default="bench-results/step-profile.json")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | float16 | float32 | bfloat16")
    parser.add_argument("--weights", default="auto", help="auto | native | dequantized (see `pagedllm serve --help`)")
    parser.add_argument("--no-fused", action="store_true", help="run the Python layer loop, attention timed apart")
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            weights=args.weights,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_memory="4GiB",
            max_num_seqs=max(args.batch),
        )
    )
    if args.no_fused:
        engine.runner.model.fused_decode = None

    def measure(batch: int, seed: int) -> dict:
        return profile(engine, batch, args.context, args.steps, seed)

    run_batches(engine, args.batch, measure, args.output)


if __name__ == "__main__":
    main()
