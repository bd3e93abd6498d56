"""Whole-prompt attention: the C++ prefill kernel against torch's SDPA, by prompt length.

    python benchmarks/prompt_attention.py --dtype float32 --output docs/results/prompt-attention.json

One layer, one request whose whole context is its prompt (no cached prefix),
causal, for SmolLM2's heads (9 query, 3 KV, head dim 64) and Gemma 3's (4
query, 1 KV, head dim 256).  `cpp_kernel` is the C++ kernel reading K/V
through a shuffled block table; `sdpa` is the path `cpp_attention` takes for
prompts of at least SDPA_MIN_PROMPT tokens (gather the blocks, then
`scaled_dot_product_attention(is_causal=True)`).  Both are checked against each
other; times are medians of interleaved rounds.  The crossover sets
SDPA_MIN_PROMPT in pagedllm/layers/attention.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from pagedllm.layers.attention import _prefill_sdpa
from pagedllm.layers.attention_metadata import build_attention_metadata
from pagedllm.layers.cpu_kernels import cpu_summary, load_cpu_kernels

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
BLOCK = 16


def case(length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(length)
    blocks = -(-length // BLOCK)
    cache = torch.randn(2, blocks + 1, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    table = (torch.randperm(blocks, generator=gen) + 1).view(1, -1)
    positions = torch.arange(length)
    slots = table[0, positions // BLOCK] * BLOCK + positions % BLOCK
    meta = build_attention_metadata(slots, [0, length], [length], table)
    q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
    return q, cache, meta


def measure(length: int, shape: str, dtype: torch.dtype, repeat: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    q, cache, meta = case(length, heads, kv_heads, head_dim, dtype)
    kernels = load_cpu_kernels()
    scale = 1.0 / math.sqrt(head_dim)

    def cpp_kernel() -> torch.Tensor:
        out = torch.empty_like(q)
        kernels.paged_prefill_attention(q, cache[0], cache[1], out, *meta.prefill_tensors(), scale, 0)
        return out

    def sdpa() -> torch.Tensor:
        out = torch.empty_like(q)
        _prefill_sdpa(q, cache, meta, out, 0)
        return out

    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(cpp_kernel().float(), sdpa().float(), atol=tolerance, rtol=tolerance)
    samples: dict[str, list[float]] = {"cpp_kernel": [], "sdpa": []}
    for _ in range(repeat):
        for name, fn in (("cpp_kernel", cpp_kernel), ("sdpa", sdpa)):
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    ms = {name: round(statistics.median(s) * 1e3, 3) for name, s in samples.items()}
    return {"shape": shape, "tokens": length, "ms": ms, "sdpa_speedup": round(ms["cpp_kernel"] / ms["sdpa"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", default="bench-results/prompt-attention.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    result: dict = {"cpu": cpu_summary(), "dtype": args.dtype, "threads": torch.get_num_threads(), "results": []}
    print(result["cpu"], args.dtype, flush=True)
    for shape in SHAPES:
        for length in args.lengths:
            row = measure(length, shape, dtype, args.repeat)
            print(json.dumps(row), flush=True)
            result["results"].append(row)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
