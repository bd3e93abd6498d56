"""Paged attention over a block-table KV cache, on the flattened tokens of a step.

Cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(K then V).  Token slot s lives at block s // block_size, offset s % block_size.
Each step first writes its new K/V at `slot_mapping`, then every request reads
its whole context (earlier chunks and this one) through its block table.

Implementations share one signature (q, kv_cache, metadata) -> output:
- `reference_attention`: per request, per token, plain float32 math; the oracle.
- `torch_attention`: prefill chunks use SDPA per request over the request's
  gathered blocks; decodes are sorted by length and run in groups as batched
  matmuls, each group padded only to its own longest member.
- `cpp_attention`: C++/OpenMP kernels that read K/V in place through the block
  tables (no gather, no padding): one for prefill chunks (online softmax over
  key tiles, causal), one for decodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.cpu_kernels import load_cpu_kernels

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
    """What attention needs to know about one step; built once by the model runner
    and shared by every layer (derived tensors are built on first use)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: list[int]  # [num_requests + 1]: request i owns tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [num_requests]: context length after this step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int64, padded with 0
    prefill_indices: list[int] = field(default_factory=list)  # requests with more than one new token
    decode_indices: list[int] = field(default_factory=list)  # requests with one new token, shortest first
    _decode_groups: list[DecodeGroup] | None = None
    _decode_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _prefill_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def prefill_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first query row, new tokens, seq lens, block tables) of the prefilling requests, for the C++ kernel."""
        if self._prefill_tensors is None:
            index = self.prefill_indices
            qsl = self.query_start_loc
            self._prefill_tensors = (
                torch.tensor([qsl[i] for i in index], dtype=torch.int64),
                torch.tensor([qsl[i + 1] - qsl[i] for i in index], dtype=torch.int64),
                torch.tensor([self.seq_lens[i] for i in index], dtype=torch.int64),
                self.block_tables[torch.tensor(index, dtype=torch.int64)].contiguous(),
            )
        return self._prefill_tensors

    def decode_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query rows, seq lens, block tables) of the decoding requests, for the C++ kernel."""
        if self._decode_tensors is None:
            index = self.decode_indices
            self._decode_tensors = (
                torch.tensor([self.query_start_loc[i] for i in index], dtype=torch.int64),
                torch.tensor([self.seq_lens[i] for i in index], dtype=torch.int64),
                self.block_tables[torch.tensor(index, dtype=torch.int64)].contiguous(),
            )
        return self._decode_tensors

    def decode_groups(self, kv_cache: torch.Tensor) -> list[DecodeGroup]:
        """Decoding requests cut into groups of similar length, for the pure-torch path."""
        if self._decode_groups is None:
            _, _, block_size, kv_heads, head_dim = kv_cache.shape
            self._decode_groups = []
            for start in range(0, len(self.decode_indices), DECODE_GROUP_SIZE):
                members = self.decode_indices[start : start + DECODE_GROUP_SIZE]
                lens = torch.tensor([self.seq_lens[i] for i in members])
                num_blocks = -(-int(lens.max()) // block_size)
                block_ids = self.block_tables[torch.tensor(members), :num_blocks].reshape(-1)
                row = block_size * kv_heads * head_dim
                self._decode_groups.append(
                    DecodeGroup(
                        tokens=torch.tensor([self.query_start_loc[i] for i in members]),
                        block_ids=block_ids,
                        key_padding=torch.arange(num_blocks * block_size)[None, :] >= lens[:, None],
                        k_buf=torch.empty(block_ids.shape[0], row, dtype=kv_cache.dtype),
                        v_buf=torch.empty(block_ids.shape[0], row, dtype=kv_cache.dtype),
                    )
                )
        return self._decode_groups


def build_attention_metadata(
    slot_mapping: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor
) -> AttentionMetadata:
    meta = AttentionMetadata(slot_mapping, query_start_loc, seq_lens, block_tables)
    num_new = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    meta.prefill_indices = [i for i, n in enumerate(num_new) if n > 1]
    meta.decode_indices = sorted((i for i, n in enumerate(num_new) if n == 1), key=lambda i: seq_lens[i])
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


def _prefill_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
    """Prefill chunks, one SDPA call per request over its gathered blocks."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    for i in meta.prefill_indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, num_new = meta.seq_lens[i], end - start
        blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        k = kv_cache[0].index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = kv_cache[1].index_select(0, blocks).view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        qi = q[start:end].transpose(0, 1)
        if num_new == seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
        else:  # a later chunk: causal inside the chunk, full view of the earlier context
            mask = torch.ones(num_new, seq_len, dtype=torch.bool).tril(seq_len - num_new)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)


def _decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
    """Decodes in groups of similar length: gather, then batched matmuls per KV head."""
    _, num_blocks, _, kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    k_rows, v_rows = kv_cache[0].view(num_blocks, -1), kv_cache[1].view(num_blocks, -1)
    for grp in meta.decode_groups(kv_cache):
        size = grp.tokens.shape[0]
        torch.index_select(k_rows, 0, grp.block_ids, out=grp.k_buf)
        torch.index_select(v_rows, 0, grp.block_ids, out=grp.v_buf)
        k = grp.k_buf.view(size, -1, kv_heads, head_dim)
        v = grp.v_buf.view(size, -1, kv_heads, head_dim)
        # Slots past a member's length hold whatever the block held before (stale or
        # never written, possibly NaN); a zero weight times NaN is NaN, so clear them.
        v.masked_fill_(grp.key_padding[:, :, None, None], 0.0)
        qg = q.index_select(0, grp.tokens).view(size, kv_heads, group, head_dim)
        heads = []
        for h in range(kv_heads):  # per KV head: K/V are strided views, no copy
            scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).float().mul_(scale)
            scores.masked_fill_(grp.key_padding[:, None, :], float("-inf"))
            heads.append(torch.bmm(scores.softmax(-1).to(q.dtype), v[:, :, h]))
        out[grp.tokens] = torch.stack(heads, dim=1).view(size, num_heads, head_dim)


def torch_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Pure torch: SDPA for prefill chunks, grouped batched matmuls for decodes."""
    out = torch.empty_like(q)
    _prefill_sdpa(q, kv_cache, meta, out)
    if meta.decode_indices:
        _decode_torch(q, kv_cache, meta, out)
    return out.view(q.shape[0], -1)


def cpp_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Prefill chunks and decodes both read K/V in place through the block tables (C++ kernels)."""
    kernels = load_cpu_kernels()
    q = q.contiguous()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if meta.prefill_indices:
        starts, lens, seq_lens, tables = meta.prefill_tensors()
        kernels.paged_prefill_attention(q, kv_cache[0], kv_cache[1], out, starts, lens, seq_lens, tables, scale)
    if meta.decode_indices:
        rows, seq_lens, tables = meta.decode_tensors()
        kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], out, rows, seq_lens, tables, scale)
    return out.view(q.shape[0], -1)


def triton_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The Triton kernel (GPUs; see pagedllm/triton_attention.py), imported on first use."""
    from pagedllm.triton_attention import triton_attention as kernel

    return kernel(q, kv_cache, meta)


def select_attention(name: str, head_dim: int, num_heads: int, device: str = "cpu"):
    """auto: on CUDA the Triton kernel; on the CPU the C++ kernels where they apply (head_dim 64,
    at most 64 heads) and build, else pure torch."""
    if name == "triton" or (name == "auto" and device.startswith("cuda")):
        return triton_attention
    if name == "reference":
        return reference_attention
    if name == "torch":
        return torch_attention
    if name == "cpp" and (head_dim != 64 or num_heads > 64):
        raise ValueError(f"attention='cpp' needs head_dim 64 and at most 64 heads, not {head_dim} and {num_heads}")
    if name == "cpp" or (name == "auto" and head_dim == 64 and num_heads <= 64):
        if load_cpu_kernels() is not None:
            return cpp_attention
        if name == "cpp":
            raise RuntimeError("attention='cpp' asked for, but the C++ kernel could not be built (see the log)")
    return torch_attention
