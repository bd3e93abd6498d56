"""pagedllm vs transformers' own `generate`, side by side in one run.

Same model (the bundled SmolLM2 GGUF), same dtype, same requests, greedy, EOS
ignored.  transformers runs static batches (default 16): prompts left-padded,
each batch generating until its longest request is done; only the tokens each
request asked for are counted.  pagedllm gets every request at once.

    python benchmarks/compare_transformers.py --workload benchmarks/workloads/random-128.jsonl \
        --dtype float32 --output bench-results/compare-fp32.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pagedllm.benchmarking.datasets import load_workload
from pagedllm.benchmarking.throughput import print_result, run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.models.loader import default_model_path


@torch.inference_mode()
def run_transformers(requests: list[dict], dtype: torch.dtype, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    start = time.perf_counter()
    output_tokens = 0
    for i in tqdm(range(0, len(requests), batch_size), desc="transformers", unit="batch"):
        batch = requests[i : i + batch_size]
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            prompt = r["prompt_token_ids"]
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(r["max_tokens"] for r in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
        )
        output_tokens += sum(r["max_tokens"] for r in batch)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    return {
        "wall_s": round(wall, 3),
        "requests": len(requests),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 2),
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / wall, 2),
        "batch_size": batch_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=16, help="transformers' static batch size")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    requests = load_workload(args.workload, args.num_requests)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory))
    ours = run_on_engine(engine, requests, desc="pagedllm")
    del engine
    theirs = run_transformers(requests, getattr(torch, args.dtype), args.batch_size)
    result = {
        "workload": Path(args.workload).name,
        "dtype": args.dtype,
        "pagedllm": ours,
        "transformers": theirs,
        "output_tokens_per_s_ratio": round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2),
    }
    print_result(result, args.output)


if __name__ == "__main__":
    main()
