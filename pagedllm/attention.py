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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECODE_GROUP_SIZE = 32


@dataclass
class DecodeGroup:
    """Single-token requests of similar length, run as one batched matmul."""

    tokens: torch.Tensor  # [G] row of each member's query token
    block_ids: torch.Tensor  # [G * num_blocks] the members' block tables, flattened, padded with 0
    key_padding: torch.Tensor  # [G, num_blocks * block_size] True where a key is past the member's length
    k_buf: torch.Tensor  # gather scratch, reused by every layer of the step
    v_buf: torch.Tensor


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step; built once by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: list[int]  # [num_requests + 1]: request i owns tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [num_requests]: context length after this step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int64, padded with 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_indices: list[int] = field(default_factory=list)  # requests with more than one new token


def build_attention_metadata(
    slot_mapping: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    kv_cache_shape: torch.Size,
    dtype: torch.dtype,
) -> AttentionMetadata:
    """Sort single-token requests by length and cut them into groups, each
    padded only to its own longest member."""
    _, _, block_size, kv_heads, head_dim = kv_cache_shape
    num_new = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    decodes = sorted((i for i, n in enumerate(num_new) if n == 1), key=lambda i: seq_lens[i])
    meta = AttentionMetadata(slot_mapping, query_start_loc, seq_lens, block_tables)
    meta.prefill_indices = [i for i, n in enumerate(num_new) if n > 1]
    for start in range(0, len(decodes), DECODE_GROUP_SIZE):
        members = decodes[start : start + DECODE_GROUP_SIZE]
        lens = torch.tensor([seq_lens[i] for i in members])
        num_blocks = -(-int(lens.max()) // block_size)
        block_ids = block_tables[torch.tensor(members), :num_blocks].reshape(-1)
        row = block_size * kv_heads * head_dim
        meta.decode_groups.append(
            DecodeGroup(
                tokens=torch.tensor([query_start_loc[i] for i in members]),
                block_ids=block_ids,
                key_padding=torch.arange(num_blocks * block_size)[None, :] >= lens[:, None],
                k_buf=torch.empty(block_ids.shape[0], row, dtype=dtype),
                v_buf=torch.empty(block_ids.shape[0], row, dtype=dtype),
            )
        )
    return meta


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
    num_blocks = k_cache.shape[0]
    k_rows, v_rows = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)
    for grp in meta.decode_groups:
        size = grp.tokens.shape[0]
        torch.index_select(k_rows, 0, grp.block_ids, out=grp.k_buf)
        torch.index_select(v_rows, 0, grp.block_ids, out=grp.v_buf)
        k = grp.k_buf.view(size, -1, kv_heads, head_dim)
        v = grp.v_buf.view(size, -1, kv_heads, head_dim)
        qg = q.index_select(0, grp.tokens).view(size, kv_heads, group, head_dim)
        heads = []
        for h in range(kv_heads):  # per KV head: K/V are strided views, no copy
            scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).float().mul_(scale)
            scores.masked_fill_(grp.key_padding[:, None, :], float("-inf"))
            heads.append(torch.bmm(scores.softmax(-1).to(q.dtype), v[:, :, h]))
        out[grp.tokens] = torch.stack(heads, dim=1).view(size, num_heads, head_dim)
    return out.view(num_tokens, num_heads * head_dim)
