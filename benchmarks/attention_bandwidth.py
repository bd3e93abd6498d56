"""How fast decode attention reads the KV cache, against what the machine's memory gives.

    python benchmarks/attention_bandwidth.py [--shape smollm2|gemma3-270m] [--batch 160] [--context 400] [--repeats 7]

A model's attention shape (SmolLM2: 9 query heads, 3 KV heads, head dim 64, 30 layers; Gemma 3
270M: 4 query heads, 1 KV head, head dim 256, 18 layers), bfloat16 where the CPU has
AVX512-BF16, else float32, each request one query token, every layer's cache full attention.  Four figures, in
GB/s of K/V bytes read (median of `--repeats`, with min and max):

- `plain read`: `torch.sum` over one 2 GiB tensor, the machine's streaming read rate;
- `kernel, blocks in order`: the C++ decode kernel over `--batch` requests of `--context`
  tokens whose blocks lie one after another in memory (as a prompt's blocks mostly do);
- `kernel, blocks shuffled`: the same with every 16-token block placed at random;
- `kernel, held in cache`: 8 requests of 200 tokens over one layer's cache, called as many
  times as the full run reads bytes: the kernel's arithmetic with (almost) no memory wait.

Where the two memory-bound figures fall far below the plain read while the in-cache figure is
near it, the kernel's arithmetic and its waits for memory add up rather than overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedllm.layers.attention_metadata import build_attention_metadata
from pagedllm.layers.cpu_kernels import CpuKernels, cpu_flags, load_cpu_kernels

BLOCK = 16
# query heads, KV heads, head dim, layers
SHAPES = {"smollm2": (9, 3, 64, 30), "gemma3-270m": (4, 1, 256, 18)}
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def timed(fn, repeats: int) -> list[float]:
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def rates(num_bytes: int, samples: list[float]) -> dict:
    gbs = sorted(num_bytes / s / 1e9 for s in samples)
    return {"gb_per_s": round(statistics.median(gbs), 1), "min": round(gbs[0], 1), "max": round(gbs[-1], 1)}


def decode_case(
    kernels: CpuKernels, shape: str, batch: int, context: int, layers: int, shuffled: bool, dtype: torch.dtype
):
    """One query token per request over `layers` caches; returns (one pass over every layer, K/V bytes read).
    The kernel is called directly, its tensors built once, so that Python adds little to the time."""
    heads, kv_heads, head_dim, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    per_request = -(-context // BLOCK)
    num_blocks = batch * per_request + 1  # block 0 unused
    caches = [torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(layers)]
    order = torch.randperm(num_blocks - 1, generator=gen) if shuffled else torch.arange(num_blocks - 1)
    tables = (order[: batch * per_request] + 1).view(batch, per_request).to(torch.int64)
    last = context - 1
    slots = tables[:, last // BLOCK] * BLOCK + last % BLOCK
    meta = build_attention_metadata(slots, list(range(batch + 1)), [context] * batch, tables)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    rows, seq_lens, block_tables = meta.decode_tensors()
    scale = head_dim**-0.5

    def run() -> None:
        for cache in caches:
            kernels.paged_decode_attention(q, cache[0], cache[1], out, rows, seq_lens, block_tables, scale)

    return run, layers * batch * context * kv_heads * head_dim * 2 * caches[0].element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="whose attention shape")
    parser.add_argument("--batch", type=int, default=160)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ CPU kernels did not build here; nothing to measure")
    dtype = torch.bfloat16 if kernels.native_bf16 else torch.float32
    flags = [f for f in SHOWN_FLAGS if f in cpu_flags().split()]
    result: dict = {
        "cpu_flags": " ".join(flags),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "shape": args.shape,
    }
    layers = SHAPES[args.shape][3]

    plain = torch.ones(1 << 29, dtype=torch.float32)  # 2 GiB
    result["plain read"] = rates(plain.numel() * 4, timed(plain.sum, args.repeats))
    del plain
    for name, shuffled in (("kernel, blocks in order", False), ("kernel, blocks shuffled", True)):
        run, num_bytes = decode_case(kernels, args.shape, args.batch, args.context, layers, shuffled, dtype)
        result[name] = rates(num_bytes, timed(run, args.repeats))
    small, small_bytes = decode_case(kernels, args.shape, 8, 200, 1, False, dtype)
    calls = max(1, round(layers * args.batch * args.context / (8 * 200)))

    def in_cache() -> None:
        for _ in range(calls):
            small()

    result["kernel, held in cache"] = rates(small_bytes * calls, timed(in_cache, args.repeats))
    result["batch"], result["context"] = args.batch, args.context
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
