"""A mixture-of-experts model against the dense model of the same active size, side by side.

Two tiny random-weight checkpoints that transformers builds (in a temporary directory):
a Qwen3-MoE whose tokens each use `--top-k` of `--experts` experts of width `--expert-width`,
and a Qwen3 whose dense MLP is as wide as those active experts together (top-k x width), every
other size equal.  Each runs the same random prompts at each batch size (greedy, EOS
ignored); the engines alternate, `--repeats` rounds, and the median, min and max output
tokens/s are reported, with the MoE / dense ratio per round.

    python benchmarks/moe.py --batch 1 32 --repeats 3 --output docs/results/moe-vs-dense.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from pathlib import Path

from pagedllm.benchmarking.compare import machine
from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset
from pagedllm.benchmarking.throughput import print_result, run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.testing.hf_reference import save_random_model


def checkpoints(root: Path, args) -> dict[str, Path]:
    shape = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    active = args.top_k * args.expert_width
    moe = dict(num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_width)
    save_random_model(root / "moe", "qwen3_moe", **shape, **moe, intermediate_size=active, norm_topk_prob=True)
    save_random_model(root / "dense", "qwen3", **shape, intermediate_size=active)
    return {"moe": root / "moe", "dense": root / "dense"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench-results/moe-vs-dense.json")
    args = parser.parse_args()

    results: dict = {"setup": vars(args), "machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), args)
        engines = {
            name: LLMEngine(EngineConfig(model=str(path), dtype=args.dtype, kv_cache_memory="512MiB"))
            for name, path in paths.items()
        }
        results["dtype"] = str(engines["moe"].runner.model.embed_tokens.dtype).removeprefix("torch.")
        results["weight_bytes"] = {name: e.runner.model.weight_bytes() for name, e in engines.items()}
        for batch in args.batch:
            spec = DatasetSpec("random", batch, args.input_len, args.output_len, seed=batch)
            requests = generate_dataset(spec, 49152)
            for name, engine in engines.items():  # warm-up: every kernel built, every shape seen once
                run_on_engine(engine, requests[:2], desc=f"warm-up {name}")
            for round_ in range(args.repeats):
                order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
                for name in order:
                    requests = [dict(r, id=f"{name}-{batch}-{round_}-{r['id']}") for r in requests]
                    result = run_on_engine(engines[name], requests, desc=f"{name} batch {batch}")
                    results["runs"].append({"model": name, "batch": batch, "round": round_, **result})
                    gc.collect()
    summary = {}
    for batch in args.batch:
        rate = {
            name: [r["output_tokens_per_s"] for r in results["runs"] if r["model"] == name and r["batch"] == batch]
            for name in ("moe", "dense")
        }
        ratios = [m / d for m, d in zip(rate["moe"], rate["dense"])]
        summary[f"batch_{batch}"] = {
            **{f"{name}_output_tokens_per_s": _median_range(values) for name, values in rate.items()},
            "moe_over_dense": _median_range(ratios),
        }
    results["summary"] = summary
    print_result(results, args.output)


def _median_range(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


if __name__ == "__main__":
    main()
