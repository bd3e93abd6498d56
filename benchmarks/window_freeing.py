"""Sliding-window block freeing on and off, side by side, at the same KV budget.

Gemma 3 (sliding window on 5 of every 6 layers) on long prompts: with freeing
on, a sliding group gives back the blocks its window has left behind while the
request runs; off, every layer keeps every block to the end.  Reported per
setting: output tok/s, peak concurrent requests, preemptions, `kv_bytes_peak`
(bytes of KV at the busiest step, every layer), blocks freed by the window, and
the KV each request holds at its last step (context = prompt + output - 1), read
off the running engine, against all of its layers at full length.

    python benchmarks/window_freeing.py --model gemma3-270m --num-prompts 8 --input-len 4096 \\
        --output-len 256 --kv-cache-memory 330MiB --dtype float32 --output docs/results/window-freeing.json
"""

from __future__ import annotations

import argparse
import gc

from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset
from pagedllm.benchmarking.throughput import print_result, run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import FREED
from pagedllm.engine import LLMEngine


def watch_request_memory(engine: LLMEngine, context: int) -> dict[str, tuple[int, int]]:
    """Wrap `engine.step` to record, after each step, each running request's KV bytes once its
    computed context is at least `context`, beside what all its layers at full length would hold:
    request id -> (held, all layers full) at its last step (the longest context it reached)."""
    record: dict[str, tuple[int, int]] = {}
    step = engine.step

    def watched():
        outputs = step()
        info = engine.info
        for request in engine.kv_picture()["running_requests"]:
            if request["computed"] >= context:
                held = sum(1 for b in request["block_table"] if b != FREED)
                full = -(-request["computed"] // info.block_size) * info.num_layer_groups
                record[request["id"]] = (held * engine.kv_block_bytes, full * engine.kv_block_bytes)
        return outputs

    engine.step = watched
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-memory", default="330MiB")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default="bench-results/window-freeing.json")
    args = parser.parse_args()

    results: dict = {"setup": vars(args)}
    for name, freeing in (("window_freeing_on", True), ("window_freeing_off", False)):
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.input_len + args.output_len,
            window_freeing=freeing,
        )
        engine = LLMEngine(config)
        spec = DatasetSpec("random", args.num_prompts, args.input_len, args.output_len, seed=0)
        requests = generate_dataset(spec, engine.model_config.vocab_size)
        record = watch_request_memory(engine, args.input_len)
        result = run_on_engine(engine, requests, desc=name)
        held, full = [sum(values) / len(record) for values in zip(*record.values())]
        result["per_request_at_last_step"] = {
            "requests": len(record),
            "kv_bytes_held_mean": round(held),
            "kv_bytes_all_layers_full_mean": round(full),
            "held_over_all_layers_full": round(held / full, 4),
        }
        results[name] = result
        del engine
        gc.collect()
    on, off = results["window_freeing_on"], results["window_freeing_off"]
    results["output_tokens_per_s_on_over_off"] = round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 3)
    results["peak_running_on_over_off"] = round(on["peak_running"] / off["peak_running"], 3)
    print_result(results, args.output)


if __name__ == "__main__":
    main()
