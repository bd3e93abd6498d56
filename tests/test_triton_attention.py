"""The Triton paged-attention kernel against the reference, run on CPU tensors by
Triton's interpreter: random ragged batches mixing whole prompts, later chunks
over cached context and decodes, block sizes 8/16/32, GQA ratios 1/3/8."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run kernels on the CPU

from test_attention import WINDOWED, make_batch  # noqa: E402

from pagedllm.layers.attention import reference_attention  # noqa: E402
from pagedllm.layers.triton_attention import triton_attention  # noqa: E402


def random_shapes(seed: int, count: int) -> list[tuple[int, int]]:
    """(cached context, new tokens) per request: decodes, whole prompts and later chunks."""
    gen = torch.Generator().manual_seed(seed)
    shapes = []
    for _ in range(count):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        context = int(torch.randint(1, 70, (1,), generator=gen))
        new = int(torch.randint(2, 40, (1,), generator=gen))
        shapes.append([(context, 1), (0, new), (context, new)][kind])
    return shapes


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 8)])
def test_triton_kernel_matches_reference(block_size, kv_heads, group):
    shapes = random_shapes(block_size * 10 + group, 6)
    q, cache, meta, _ = make_batch(block_size + group, block_size, kv_heads, group, 64, shapes)
    torch.testing.assert_close(
        triton_attention(q, cache, meta), reference_attention(q, cache, meta), atol=1e-4, rtol=1e-4
    )


def test_triton_kernel_bfloat16_and_small_head_dim():
    shapes = [(5, 1), (0, 17), (33, 9)]
    q, cache, meta, _ = make_batch(7, 16, 3, 3, 32, shapes, dtype=torch.bfloat16)
    expected = reference_attention(q, cache, meta).float()
    torch.testing.assert_close(triton_attention(q, cache, meta).float(), expected, atol=3e-2, rtol=3e-2)


def test_triton_kernel_ignores_slots_outside_every_context():
    shapes = [(20, 1), (0, 12), (9, 7)]
    q, cache, meta, _ = make_batch(3, 8, 2, 2, 64, shapes)
    expected = reference_attention(q, cache, meta)
    in_context = torch.zeros(cache.shape[1] * 8, dtype=torch.bool)
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens):
        in_context[[table[p // 8] * 8 + p % 8 for p in range(seq_len)]] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~in_context] = float("nan")
    torch.testing.assert_close(triton_attention(q, cache, meta), expected, atol=1e-4, rtol=1e-4)


def test_attention_selection_picks_triton_on_cuda_only():
    from pagedllm.layers.attention import select_attention
    from pagedllm.layers.attention import triton_attention as lazy_triton

    assert select_attention("auto", 64, device="cuda") is lazy_triton
    assert select_attention("auto", 64, device="cpu") is not lazy_triton
    q, cache, meta, _ = make_batch(1, 16, 3, 3, 64, [(4, 1), (0, 5)])
    torch.testing.assert_close(lazy_triton(q, cache, meta), reference_attention(q, cache, meta), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 9, 40])
def test_triton_kernel_sliding_window_never_reads_older_slots(window):
    q, cache, meta, _ = make_batch(window, 16, 3, 3, 64, WINDOWED)
    expected = reference_attention(q, cache, meta, window)
    visible = torch.zeros(cache.shape[1] * 16, dtype=torch.bool)
    for table, seq_len, (ctx, _) in zip(meta.block_tables.tolist(), meta.seq_lens, WINDOWED):
        visible[[table[p // 16] * 16 + p % 16 for p in range(max(0, ctx - window + 1), seq_len)]] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~visible] = float("nan")
    torch.testing.assert_close(triton_attention(q, cache, meta, window), expected, atol=1e-4, rtol=1e-4)
