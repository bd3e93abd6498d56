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
  tables (no gather, no padding): one for prefill chunks (exact softmax over
  key tiles, causal), one for decodes.  A whole prompt (no cached context) at
  least `sdpa_min_prompt` tokens long goes to SDPA instead, where torch's flash
  attention measured faster than the C++ prefill kernel
  (`benchmarks/prompt_attention.py`): from 1,024 tokens in float32 (and in
  bfloat16 without AVX512-BF16, where the kernel computes in float32).  In
  bfloat16 with AMX the kernel runs its products on the tile unit and keeps
  prompts up to 2,048 or 4,096 tokens (by head dim; 1.8-2.3x SDPA's speed up to
  512 tokens); on AVX512-BF16 without AMX its `vdpbf16ps` path keeps every
  prompt (~2x SDPA up to 4,096).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.cpu_kernels import ATTENTION_HEAD_DIMS, CpuKernels, load_cpu_kernels

logger = logging.getLogger("pagedllm")

# Whole prompts at least this long run through SDPA in `cpp_attention` (docs/performance.md):
# float32 (or bfloat16 computed in float32); bfloat16 where the CPU has AMX but the kernel was not
# built with its tiles; and bfloat16 with the kernel on AMX tiles, by head dim (SDPA's flash
# attention keeps O(tokens) memory where the kernel holds a tile's whole score matrix, so it wins
# on long prompts: from 4,096 tokens at head dim 64, from 2,048 at 256).
SDPA_MIN_PROMPT = 1024
SDPA_MIN_PROMPT_AMX = 128
SDPA_MIN_PROMPT_AMX_KERNEL_SMALL_HEADS = 4096  # head_dim 64
SDPA_MIN_PROMPT_AMX_KERNEL = 2048  # larger heads


def sdpa_min_prompt(dtype: torch.dtype, kernels: CpuKernels, head_dim: int) -> int | None:
    """The prompt length from which `cpp_attention` hands a whole prompt to SDPA, or None for never."""
    if dtype != torch.bfloat16 or not kernels.native_bf16:
        return SDPA_MIN_PROMPT
    if kernels.amx_tiles:
        return SDPA_MIN_PROMPT_AMX_KERNEL_SMALL_HEADS if head_dim <= 64 else SDPA_MIN_PROMPT_AMX_KERNEL
    return SDPA_MIN_PROMPT_AMX if kernels.amx_bf16 else None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    # A float8 cache is written through its bytes (torch has no index_copy_ for float8; its
    # conversion rounds to nearest and saturates, as the C++ kernels' does).
    raw = torch.uint8 if kv_cache.dtype == torch.float8_e4m3fn else kv_cache.dtype
    flat = kv_cache.view(raw).view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.view(-1, kv_heads, head_dim).to(kv_cache.dtype).view(raw))
    flat[1].index_copy_(0, slot_mapping, v.view(-1, kv_heads, head_dim).to(kv_cache.dtype).view(raw))


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0
) -> torch.Tensor:
    """The oracle: q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads * head_dim].
    With `window` > 0 the query at position p sees keys p - window + 1 .. p only."""
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
            lo = max(0, position - window + 1) if window > 0 else 0
            scores = torch.einsum("hd,shd->hs", q[row].float(), k[lo : position + 1]) / math.sqrt(head_dim)
            out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo : position + 1])
    return out.reshape(q.shape[0], -1).to(q.dtype)


def _prefill_sdpa(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
    window: int,
    indices: list[int] | None = None,
) -> None:
    """Prefill chunks (all, or those of `indices`), one SDPA call per request over its gathered blocks."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    for i in meta.prefill_indices if indices is None else indices:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len, num_new = meta.seq_lens[i], end - start
        # Keys lo .. seq_len - 1: under a window, nothing older than the first new token's window
        # is read at all (those slots may be freed; a zero weight times their NaN would be NaN).
        lo = max(0, seq_len - num_new - window + 1) if window > 0 else 0
        blocks = meta.block_tables[i, lo // block_size : -(-seq_len // block_size)]
        skip = lo // block_size * block_size
        # .to: a float16 cache beside float32 activations (a no-op when the dtypes agree).
        k = kv_cache[0].index_select(0, blocks).view(-1, kv_heads, head_dim)[lo - skip : seq_len - skip].to(q.dtype)
        v = kv_cache[1].index_select(0, blocks).view(-1, kv_heads, head_dim)[lo - skip : seq_len - skip].to(q.dtype)
        # 4-D [1, heads, tokens, dim]: torch's CPU flash kernel takes only that (3-D fell back to
        # the plain math path, measured 2-4x slower).
        k, v, keys = k.transpose(0, 1)[None], v.transpose(0, 1)[None], seq_len - lo
        qi = q[start:end].transpose(0, 1)[None]
        if num_new == keys:
            o = F.scaled_dot_product_attention(
                qi,
                k,
                v,
                is_causal=window == 0,
                attn_mask=None if window == 0 else _window_mask(num_new, keys, window),
                enable_gqa=True,
            )
        else:  # a later chunk: causal inside the chunk, the earlier context in view
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=_window_mask(num_new, keys, window), enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def _window_mask(num_new: int, keys: int, window: int) -> torch.Tensor:
    """[num_new, keys] True where the query (the last num_new of the keys' positions) sees the key."""
    mask = torch.ones(num_new, keys, dtype=torch.bool).tril(keys - num_new)
    if window > 0:
        mask &= ~torch.ones(num_new, keys, dtype=torch.bool).tril(keys - num_new - window)
    return mask


def _decode_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor, window: int
) -> None:
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
        k = grp.k_buf.view(size, -1, kv_heads, head_dim).to(q.dtype)  # a float16 cache: float32 copies
        v = grp.v_buf.view(size, -1, kv_heads, head_dim).to(q.dtype)
        # Slots past a member's length (or before its window) hold whatever the block held
        # (stale, never written or freed, possibly NaN); a zero weight times NaN is NaN, so clear them.
        hidden = grp.key_padding if window == 0 else grp.key_padding | grp.before_window(window)
        v.masked_fill_(hidden[:, :, None, None], 0.0)
        qg = q.index_select(0, grp.tokens).view(size, kv_heads, group, head_dim)
        heads = []
        for h in range(kv_heads):  # per KV head: K/V are strided views, no copy
            scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).float().mul_(scale)
            scores.masked_fill_(hidden[:, None, :], float("-inf"))
            heads.append(torch.bmm(scores.softmax(-1).to(q.dtype), v[:, :, h]))
        out[grp.tokens] = torch.stack(heads, dim=1).view(size, num_heads, head_dim)


def torch_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
    """Pure torch: SDPA for prefill chunks, grouped batched matmuls for decodes."""
    out = torch.empty_like(q)
    _prefill_sdpa(q, kv_cache, meta, out, window)
    if meta.decode_indices:
        _decode_torch(q, kv_cache, meta, out, window)
    return out.view(q.shape[0], -1)


def cpp_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
    """Prefill chunks and decodes both read K/V in place through the block tables (C++ kernels),
    except whole prompts of at least `sdpa_min_prompt` tokens that no window cuts: torch's SDPA
    (flash attention, causal) on their gathered K/V."""
    kernels = load_cpu_kernels()
    q = q.contiguous()
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if meta.prefill_indices:
        min_prompt = sdpa_min_prompt(q.dtype, kernels, q.shape[-1])
        whole = [] if min_prompt is None else meta.whole_prompt_prefills(min_prompt, window)
        if whole:  # no window applies to them (it is 0, or longer than the prompt)
            _prefill_sdpa(q, kv_cache, meta, out, 0, whole)
        rest = [i for i in meta.prefill_indices if i not in whole]
        if rest:
            starts, lens, seq_lens, tables = meta.prefill_tensors(rest)
            kernels.paged_prefill_attention(
                q, kv_cache[0], kv_cache[1], out, starts, lens, seq_lens, tables, scale, window
            )
    if meta.decode_indices:
        rows, seq_lens, tables = meta.decode_tensors()
        kernels.paged_decode_attention(
            q, kv_cache[0], kv_cache[1], out, rows, seq_lens, tables, scale, window, meta.decode_split_requests
        )
    return out.view(q.shape[0], -1)


def triton_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int = 0) -> torch.Tensor:
    """The Triton kernel (GPUs; see pagedllm/layers/triton_attention.py), imported on first use."""
    from pagedllm.layers.triton_attention import triton_attention as kernel

    return kernel(q, kv_cache, meta, window)


def select_attention(name: str, head_dim: int, device: str = "cpu"):
    """auto: on CUDA the Triton kernel; on the CPU the C++ kernels where they apply (head_dim 64,
    128 or 256) and build, else pure torch, with a warning saying why."""
    if name == "triton" or (name == "auto" and device.startswith("cuda")):
        return triton_attention
    if device.startswith("cuda"):
        raise ValueError(f"attention={name!r} runs on the CPU; on CUDA use attention='auto' or 'triton'")
    if name == "reference":
        return reference_attention
    if name == "torch":
        return torch_attention
    fits = head_dim in ATTENTION_HEAD_DIMS
    if name == "cpp" and not fits:
        raise ValueError(f"attention='cpp' needs head_dim {ATTENTION_HEAD_DIMS}, not {head_dim}")
    if not fits:
        logger.warning(
            "attention: the C++ kernels take head_dim %s (this model: %d); using the slower pure-torch path",
            ATTENTION_HEAD_DIMS,
            head_dim,
        )
        return torch_attention
    if load_cpu_kernels() is not None:
        return cpp_attention
    if name == "cpp":
        raise RuntimeError("attention='cpp' asked for, but the C++ kernel could not be built (see the log)")
    return torch_attention
