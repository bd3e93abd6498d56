"""Paged attention against SDPA over the same K/V laid out contiguously.

    python benchmarks/attention_kernels.py [--dtype float32 bfloat16] [--output docs/results/attention-kernels.json]

Two shapes (SmolLM2's heads: 9 query heads, 3 KV heads, head dim 64), one layer:
- decode: 32 requests, one query token each, 1,024 tokens of context each;
- prefill: one chunk of 512 new tokens over 1,024 cached ones (causal in the chunk).

The paged paths read a cache of shuffled 16-token blocks through block tables;
the baseline is `torch.nn.functional.scaled_dot_product_attention` on contiguous
[batch, heads, tokens, 64] tensors holding the same values, in its fastest form
measured here (grouped heads passed with `enable_gqa`, or folded into the query
rows so no K/V is repeated).  Times are medians of `--repeat` runs, all paths
interleaved in each round so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import cpp_attention, reference_attention, torch_attention
from pagedllm.layers.attention_metadata import build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def paged_case(contexts: list[int], new_tokens: list[int], dtype: torch.dtype, seed: int = 0):
    """A shuffled block cache holding each request's context + new tokens, and the same K/V contiguous."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(contexts, new_tokens)]
    blocks = [-(-t // BLOCK) for t in totals]
    num_blocks = sum(blocks) + 1
    cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks)
    tables, slots, contiguous = [], [], []
    for total, nb, n in zip(totals, blocks, new_tokens):
        table, perm = perm[:nb], perm[nb:]
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        positions = torch.arange(total)
        ids = torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK
        cache[0].view(-1, KV_HEADS, HEAD_DIM)[ids] = k
        cache[1].view(-1, KV_HEADS, HEAD_DIM)[ids] = v
        slots += ids[total - n :].tolist()
        tables.append(table + [0] * (width - nb))
        contiguous.append((k, v))
    qsl = [0]
    for n in new_tokens:
        qsl.append(qsl[-1] + n)
    meta = build_attention_metadata(torch.tensor(slots), qsl, totals, torch.tensor(tables, dtype=torch.int64))
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, cache, meta, contiguous


def sdpa_decode(q: torch.Tensor, contiguous) -> dict:
    """Contiguous baselines for decode: q [B, 9, 64], K/V [B, 3, ctx, 64]; (call, output -> token rows)."""
    k = torch.stack([k for k, _ in contiguous]).transpose(1, 2).contiguous()  # [B, 3, ctx, 64]
    v = torch.stack([v for _, v in contiguous]).transpose(1, 2).contiguous()
    group = HEADS // KV_HEADS
    q_gqa = q[:, :, None, :]  # [B, 9, 1, 64]
    q_folded = q.view(q.shape[0], KV_HEADS, group, HEAD_DIM)  # the group's query heads as query rows

    rows = lambda out: out.reshape(q.shape[0], -1)  # noqa: E731
    return {
        "sdpa_gqa": (lambda: F.scaled_dot_product_attention(q_gqa, k, v, enable_gqa=True), rows),
        "sdpa_folded": (lambda: F.scaled_dot_product_attention(q_folded, k, v), rows),
    }


def sdpa_prefill(q: torch.Tensor, contiguous, context: int) -> dict:
    """Contiguous baselines for one prefill chunk: q [1, 9, n, 64] over K/V [1, 3, context + n, 64]."""
    k, v = (t.transpose(0, 1)[None].contiguous() for t in contiguous[0])
    n = q.shape[0]
    mask = torch.ones(n, context + n, dtype=torch.bool).tril(context)
    q4 = q.transpose(0, 1)[None].contiguous()
    group = HEADS // KV_HEADS
    q_folded = q4.view(1, KV_HEADS, group * n, HEAD_DIM)  # rows: head-major within each KV group
    mask_folded = mask.repeat(group, 1)
    rows = lambda out: out.reshape(1, HEADS, n, HEAD_DIM)[0].transpose(0, 1).reshape(n, -1)  # noqa: E731
    return {
        "sdpa_gqa": (lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True), rows),
        "sdpa_folded": (lambda: F.scaled_dot_product_attention(q_folded, k, v, attn_mask=mask_folded), rows),
    }


def timed(fns: dict, repeat: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def run(shape: str, dtype: torch.dtype, repeat: int) -> dict:
    if shape == "decode":
        q, cache, meta, contiguous = paged_case([1023] * 32, [1] * 32, dtype)
        baselines = sdpa_decode(q, contiguous)
    else:
        q, cache, meta, contiguous = paged_case([1024], [512], dtype)
        baselines = sdpa_prefill(q, contiguous, 1024)
    reference = reference_attention(q, cache, meta).float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for fn, to_rows in baselines.values():  # every path computes the same thing
        torch.testing.assert_close(to_rows(fn()).float(), reference, atol=tolerance, rtol=tolerance)
    paths = {"paged_cpp": lambda: cpp_attention(q, cache, meta), "paged_torch": lambda: torch_attention(q, cache, meta)}
    for fn in paths.values():
        torch.testing.assert_close(fn().float(), reference, atol=tolerance, rtol=tolerance)
    ms = timed({**paths, **{name: fn for name, (fn, _) in baselines.items()}}, repeat)
    best_baseline = min(ms[name] for name in baselines)
    return {
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "ms": {name: round(value, 3) for name, value in ms.items()},
        "paged_cpp_over_best_sdpa": round(ms["paged_cpp"] / best_baseline, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--output", default="bench-results/attention-kernels.json")
    args = parser.parse_args()
    results = []
    for dtype in args.dtype:
        for shape in ("decode", "prefill"):
            result = run(shape, getattr(torch, dtype), args.repeat)
            print(json.dumps(result))
            results.append(result)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
