"""Paged attention over a block-table KV cache, on the flattened tokens of a step.

Cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(K then V).  Token slot s lives at block s // block_size, offset s % block_size.
Each step first writes its new K/V at `slot_mapping`, then every request reads
its whole context (earlier chunks and this one) through its block table.

Two implementations share one signature:
- `reference_attention`: per request, per token, plain float32 math; the oracle.
- `fast_attention`: prefill chunks use SDPA per request over the request's
  gathered blocks; decodes are sorted by length and run in groups as batched
  matmuls, each group padded only to its own longest member.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DECODE_GROUP_SIZE = 32


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step; built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: list[int]  # [num_requests + 1]: request i owns tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [num_requests]: context length after this step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int64, padded with 0
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]  # built by build_decode_groups
    prefill_indices: list[int]  # requests with more than one new token


def build_decode_groups(
    query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]], list[int]]:
    """Sort single-token requests by length and cut them into groups.

    Each group is (token rows, block table rows, key mask [G, padded_len], padded_len).
    """
    decodes = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    prefills = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] > 1]
    decodes.sort(key=lambda i: seq_lens[i])
    groups = []
    for start in range(0, len(decodes), DECODE_GROUP_SIZE):
        members = decodes[start : start + DECODE_GROUP_SIZE]
        lens = torch.tensor([seq_lens[i] for i in members])
        num_blocks = -(-int(lens.max()) // block_size)
        padded = num_blocks * block_size
        rows = torch.tensor(members)
        tokens = torch.tensor([query_start_loc[i] for i in members])
        key_mask = torch.arange(padded)[None, :] < lens[:, None]
        groups.append((tokens, block_tables[rows, :num_blocks], key_mask, padded))
    return groups, prefills


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.view(-1, kv_heads, head_dim).to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.view(-1, kv_heads, head_dim).to(kv_cache.dtype))


def reference_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The oracle: q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads * head_dim]."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // kv_heads
    out = torch.empty(q.shape[0], num_heads, head_dim, dtype=torch.float32)
    for i, seq_len in enumerate(meta.seq_lens):
        table = meta.block_tables[i].tolist()
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots].float()  # [seq_len, kv_heads, d]
        v = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots].float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        for row in range(start, end):
            position = seq_len - (end - row)  # absolute position of this query token
            scores = torch.einsum("hd,shd->hs", q[row].float(), k[: position + 1]) / math.sqrt(head_dim)
            out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[: position + 1])
    return out.reshape(q.shape[0], -1).to(q.dtype)


def fast_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads, _ = q.shape
    group = num_heads // kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    k_cache, v_cache = kv_cache[0], kv_cache[1]

    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, num_new = meta.seq_lens[i], end - start
        blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        k = k_cache.index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = v_cache.index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        qi = q[start:end].transpose(0, 1)
        if num_new == seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        else:  # a later chunk: causal inside the chunk, full view of the earlier context
            mask = torch.ones(num_new, seq_len, dtype=torch.bool).tril(seq_len - num_new)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)

    scale = 1.0 / math.sqrt(head_dim)
    for tokens, tables, key_mask, padded in meta.decode_groups:
        size = tokens.shape[0]
        k = k_cache[tables].view(size, padded, kv_heads, head_dim)
        v = v_cache[tables].view(size, padded, kv_heads, head_dim)
        qg = q.index_select(0, tokens).view(size, kv_heads, group, head_dim)
        scores = torch.einsum("bhgd,bshd->bhgs", qg, k).float() * scale
        scores.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        out[tokens] = torch.einsum("bhgs,bshd->bhgd", probs, v).reshape(size, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
