"""Decode attention paths side by side: the C++ kernel (reads K/V in place
through block tables) vs the pure-torch grouped path, on random block tables.

    python benchmarks/decode_attention.py --batch 128 --context 256 --layers 30

With `--layers N` each call reads the next of N separate caches, as a decode step's
30 layers do: SmolLM2's 30 layers at 128 x 256 tokens hold ~750 MiB of K/V, more
than any cache, where one layer's 25 MiB can stay in a 32 MiB L3 between calls.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedllm.layers.attention import cpp_attention, torch_attention
from pagedllm.layers.attention_metadata import build_attention_metadata


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=256, help="mean context length (uniform +-50%%)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1, help="separate caches read in turn (30: a whole step)")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    bs, kv_heads, heads, head_dim = args.block_size, 3, 9, 64
    low, high = args.context // 2, args.context * 3 // 2
    seq_lens = torch.randint(low, high + 1, (args.batch,), generator=gen).tolist()
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 16
    caches = [torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(args.layers)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq)
    tables, slots = [], []
    for n, nb in zip(seq_lens, blocks_per_seq):
        table, perm = perm[:nb], perm[nb:]
        tables.append(table + [0] * (width - nb))
        slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
    meta = build_attention_metadata(
        torch.tensor(slots), list(range(args.batch + 1)), seq_lens, torch.tensor(tables, dtype=torch.int64)
    )
    q = torch.randn(args.batch, heads, head_dim, generator=gen).to(dtype)
    kv_bytes = sum(seq_lens) * 2 * kv_heads * head_dim * dtype.itemsize
    print(
        f"batch {args.batch}, mean context {sum(seq_lens) / len(seq_lens):.0f}, block size {bs}, {args.dtype}, "
        f"{kv_bytes / 2**20:.1f} MiB of K/V per layer, {args.layers} layer(s) read in turn"
    )
    for name, fn in (("cpp", cpp_attention), ("torch", torch_attention)):
        for cache in caches:
            fn(q, cache, meta)
        start = time.perf_counter()
        for i in range(args.repeat * args.layers):
            fn(q, caches[i % args.layers], meta)
        ms = (time.perf_counter() - start) / (args.repeat * args.layers) * 1e3
        print(f"{name:>6}: {ms:7.2f} ms per layer, {kv_bytes / ms / 1e6:5.1f} GB/s of K/V read")


if __name__ == "__main__":
    main()
