"""Paged attention as one Triton kernel, for GPUs: prefill chunks and decodes alike.

One program = one request x one KV head x a tile of BLOCK_M query tokens.  Its
rows are those tokens times the KV head's query heads (grouped-query heads
share every K/V load; nothing is repeated).  Keys come in tiles of KEY_TILE
positions gathered through the block table, so any block size works, and an
online softmax (running max and sum per row) folds each tile into the output.
Causal: the query at position p sees keys 0..p, which covers decodes (one
token seeing everything), whole prompts and later chunks over cached context;
with a sliding window W > 0, keys p - W + 1 .. p only (the key loop starts at
the tile's first visible key).

Imported only when attention runs on CUDA, or by the tests, which run the
kernel on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set
before this module is imported).  The cache write is `write_kv` (index_copy_),
which runs on any device.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention_metadata import AttentionMetadata


# Integer arguments that change from step to step are not specialized on (Triton would otherwise
# compile a variant each time one of them becomes divisible by 16 or equal to 1).
@triton.jit(do_not_specialize=["max_blocks", "window"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks * block_size, kv_heads, HEAD_DIM] (the layer's K, flattened slots)
    v_cache_ptr,
    out_ptr,  # like q
    block_tables_ptr,  # [num_requests, max_blocks] int64
    query_starts_ptr,  # [num_requests + 1] int64: request i owns query rows [qs[i], qs[i+1])
    seq_lens_ptr,  # [num_requests] int64: context length after this step
    scale,
    max_blocks,
    window,  # sliding window (0: none)
    num_heads: tl.constexpr,
    kv_heads: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    KEY_TILE: tl.constexpr,  # key positions per loop iteration
    EXACT_FP32: tl.constexpr,  # float32 cache: full-precision dots (no TF32)
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + request)
    q_len = tl.load(query_starts_ptr + request + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)

    rows = tl.arange(0, BLOCK_M * GROUP_P)
    token = tile * BLOCK_M + rows // GROUP_P  # query token within the request's chunk
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (token < q_len) & (rows % GROUP_P < GROUP)
    position = seq_len - q_len + token  # absolute position of each row's token
    dims = tl.arange(0, HEAD_DIM)

    q_offsets = ((q_start + token) * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale

    running_max = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P, HEAD_DIM], tl.float32)

    last_position = seq_len - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    # No row of the tile sees a key older than its first row's window (int64 like seq_len either way).
    lowest_key = tl.where(window > 0, tl.maximum(seq_len - q_len + tile * BLOCK_M - window + 1, 0), seq_len * 0)
    for k0 in range(lowest_key // KEY_TILE * KEY_TILE, last_position + 1, KEY_TILE):
        keys = k0 + tl.arange(0, KEY_TILE)
        # Keys outside [lowest_key, last_position] are never loaded: their slots may be freed,
        # and a zero weight times a NaN there would still be NaN.
        key_ok = (keys <= last_position) & (keys >= lowest_key)
        block = tl.load(block_tables_ptr + request * max_blocks + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_offsets = (slot * kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=key_ok[:, None], other=0.0)

        if EXACT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [rows, KEY_TILE]
        else:  # bfloat16 / float16 cache: tensor-core dots, float32 accumulation
            scores = tl.dot(q.to(k.dtype), tl.trans(k))
        visible = (keys[None, :] <= position[:, None]) & key_ok[None, :] & row_ok[:, None]
        if window > 0:
            visible = visible & (keys[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw nothing yet
        correction = tl.exp(running_max - safe_max)
        p = tl.exp(scores - safe_max[:, None])
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        if EXACT_FP32:
            acc = acc * correction[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        running_max = new_max

    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def triton_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int = 0,
    block_m: int = 16,
    key_tile: int | None = None,
) -> torch.Tensor:
    """`block_m` query tokens per program and `key_tile` keys per loop iteration: by default
    16 and, on a GPU, 128 keys for decode-only steps and 64 for steps with prefill chunks (the
    fastest of those measured on an H200 by benchmarks/gpu_check.py)."""
    """Same contract as the other paths: q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads * head_dim]."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads, _ = q.shape
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    group = num_heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    device = q.device
    # Built once per step by the model runner; the tests call the kernel with the lists alone.
    query_starts = meta.query_starts
    if query_starts is None:
        query_starts = torch.tensor(meta.query_start_loc, dtype=torch.int64, device=device)
    seq_lens = meta.seq_lens_tensor
    if seq_lens is None:
        seq_lens = torch.tensor(meta.seq_lens, dtype=torch.int64, device=device)
    block_tables = meta.block_tables.to(device=device, dtype=torch.int64).contiguous()
    max_query_len = meta.max_query_len or max(
        meta.query_start_loc[i + 1] - meta.query_start_loc[i] for i in range(len(meta.seq_lens))
    )
    group_p = triton.next_power_of_2(group)
    # Two variants per model and dtype: decode-only steps, and steps with a prefill chunk.
    block_m = 1 if max_query_len == 1 else block_m
    block_m = max(block_m, 16 // group_p) if group_p < 16 else block_m  # tl.dot wants >= 16 rows
    if key_tile is None:
        key_tile = 16 if device.type != "cuda" else 128 if max_query_len == 1 else 64
    grid = (len(meta.seq_lens), kv_heads, triton.cdiv(max_query_len, block_m))
    _paged_attention_kernel[grid](
        q,
        kv_cache[0].view(num_blocks * block_size, kv_heads, head_dim),
        kv_cache[1].view(num_blocks * block_size, kv_heads, head_dim),
        out,
        block_tables,
        query_starts,
        seq_lens,
        1.0 / math.sqrt(head_dim),
        block_tables.shape[1],
        window,
        num_heads=num_heads,
        kv_heads=kv_heads,
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        KEY_TILE=key_tile,  # under the interpreter 16: each iteration's cost grows with the tile
        # Under the interpreter tl.dot on bfloat16 operands reads their raw bits as
        # integers (measured with triton 3.9), so there the dots run in float32.
        EXACT_FP32=kv_cache.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
    )
    return out.view(num_tokens, -1)
