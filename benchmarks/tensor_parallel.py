"""Tensor parallelism on this machine: per-rank memory, step times, and what crosses the wire.

    python benchmarks/tensor_parallel.py --output docs/results/tensor-parallel.json

For each model and tensor-parallel size, one engine (ranks spawned as
processes, gloo over loopback) runs, one after another:

- a prefill step: one request of `--prefill` prompt tokens;
- decode steps: `--batch` requests with `--context`-token prompts, then
  `--steps` timed decode steps (each request computes one token).

Per step it reports the wall time on rank 0, the time rank 0 spent inside
collectives (all-reduce, the logits gather, the step broadcast; this includes
waiting for the slowest rank), and the bytes: the step message rank 0 sends
(measured), and the all-reduce and gather payloads (counted from the shapes).
Each run is a fresh process (so RSS is its own).  The models: a tiny random
llama (8 query / 4 KV heads, hidden 128, 2 layers, built here) and
SmolLM2-135M.  On 2 shared CPU cores, more ranks only split the same cores:
this measures the cost of the machinery, not a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine


def make_tiny_llama(folder: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.loader import default_model_path
    from pagedllm.text.tokenizer import Tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    Tokenizer(default_model_path()).hf.save_pretrained(folder)
    return str(folder)


def time_collectives(totals: dict[str, float]) -> None:
    """Wrap torch.distributed's collectives in this process (rank 0) to add up their time."""
    for name in ("all_reduce", "gather", "broadcast"):
        original = getattr(dist, name)
        if hasattr(original, "__wrapped_collective__"):
            continue

        def wrapper(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        wrapper.__wrapped_collective__ = True
        setattr(dist, name, wrapper)


def measure(model: str | None, tp: int, args: argparse.Namespace, totals: dict[str, float]) -> dict:
    config = EngineConfig(
        model=model,
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory="512MiB",
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    with LLMEngine(config) as engine:
        c = engine.model_config
        vocab = c.vocab_size
        gen = torch.Generator().manual_seed(0)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        # Warm up (first calls build kernels and caches), then one timed prefill.
        engine.add_request(torch.randint(0, vocab, (64,), generator=gen).tolist(), one)
        engine.wait_all()
        engine.add_request(torch.randint(0, vocab, (args.prefill,), generator=gen).tolist(), one)
        totals.clear()
        start = time.perf_counter()
        engine.step()
        prefill_s, prefill_comm = time.perf_counter() - start, sum(totals.values())
        engine.wait_all()

        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
        for _ in range(args.batch):
            engine.add_request(torch.randint(0, vocab, (args.context,), generator=gen).tolist(), params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
        engine.step()  # the first all-decode step
        walls, comms = [], []
        bytes_before = engine.runner.step_message_bytes
        for _ in range(args.steps):
            totals.clear()
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            comms.append(sum(totals.values()))
        message_bytes = (engine.runner.step_message_bytes - bytes_before) / args.steps
        engine.wait_all()
        memory = [dataclasses.asdict(m) for m in engine.rank_memory]
        threads = torch.get_num_threads()
    itemsize = 4
    hidden = c.hidden_size
    all_reduces = 2 * c.num_layers + 1 if tp > 1 else 0
    shard = -(-vocab // tp)
    return {
        "model": "tiny-llama" if model else "SmolLM2-135M",
        "tensor_parallel_size": tp,
        "threads_per_rank": threads,
        "prefill_tokens": args.prefill,
        "prefill_step_s": round(prefill_s, 4),
        "prefill_collective_s": round(prefill_comm, 4),
        "decode_batch": args.batch,
        "decode_step_s_median": round(statistics.median(walls), 4),
        "decode_collective_s_median": round(statistics.median(comms), 4),
        "step_message_bytes_per_decode_step": round(message_bytes, 1),
        "all_reduces_per_step": all_reduces,
        "all_reduce_bytes_per_decode_step": all_reduces * args.batch * hidden * itemsize,
        "logits_gather_bytes_per_decode_step": (tp - 1) * args.batch * shard * itemsize,
        "rank_memory": memory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-tiny", default="1,2,4")
    parser.add_argument("--sizes-smollm2", default="1,3")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", default="bench-results/tensor-parallel.json")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one measurement, in a fresh process so that RSS is this run's alone
        totals: dict[str, float] = defaultdict(float)
        time_collectives(totals)
        model, tp = args.one
        print(json.dumps(measure(None if model == "-" else model, int(tp), args, totals)))
        return
    results = []
    with tempfile.TemporaryDirectory() as folder:
        tiny = make_tiny_llama(Path(folder))
        runs = [(tiny, n) for n in args.sizes_tiny.split(",") if n]
        runs += [("-", n) for n in args.sizes_smollm2.split(",") if n]
        for model, tp in runs:
            command = [sys.executable, __file__, "--one", model, tp]
            command += ["--prefill", str(args.prefill), "--batch", str(args.batch)]
            command += ["--context", str(args.context), "--steps", str(args.steps)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "rank_memory"}), flush=True)
            for m in result["rank_memory"]:
                print(
                    f"  rank {m['rank']}: weights {m['weight_bytes'] / 2**20:.1f} MiB, "
                    f"KV {m['kv_cache_bytes'] / 2**20:.1f} MiB, RSS {m['rss_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
