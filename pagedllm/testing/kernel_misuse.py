"""Wrong calls to the C++ CPU kernels, one mistake each: every one must be refused at the Python
boundary (KernelArgumentError, or the ValueError/TypeError an older check raises) before the
kernel runs.  Without the boundary's checks each would make its kernel read or write outside its
tensors, which tests/test_kernel_bounds.py shows under AddressSanitizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.layers.cpu_kernels import CpuKernels
from pagedllm.layers.quantized import PackedWeight, pack
from pagedllm.models.gguf_weights import repack

HEADS, KV_HEADS, D, BLOCKS, BLOCK_SIZE, TOKENS = 4, 2, 64, 4, 16, 4


def _cache() -> torch.Tensor:
    return torch.zeros(2, BLOCKS, BLOCK_SIZE, KV_HEADS, D)


def _rotary(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(rows, D // 2), torch.zeros(rows, D // 2)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _rope(k: CpuKernels, width: int = (HEADS + 2 * KV_HEADS) * D, positions=None, slots=None) -> None:
    cos, sin = _rotary()
    qkv = torch.randn(TOKENS, width)
    positions = _ids(0, 1, 2, 3) if positions is None else positions
    slots = _ids(0, 1, 2, 3) if slots is None else slots
    k.rope_write_kv(qkv, positions, cos, sin, _cache(), slots, HEADS)


def _decode(k: CpuKernels, rows=None, seq_lens=None, tables=None, out_tokens: int = 2) -> None:
    cache = _cache()
    q = torch.randn(2, HEADS, D)
    out = torch.empty(out_tokens, HEADS, D)
    rows = _ids(0, 1) if rows is None else rows
    seq_lens = _ids(5, 20) if seq_lens is None else seq_lens
    tables = torch.tensor([[0, 0], [1, 2]], dtype=torch.int64) if tables is None else tables
    k.paged_decode_attention(q, cache[0], cache[1], out, rows, seq_lens, tables, D**-0.5)


def _prefill(k: CpuKernels, starts, lens, seq_lens) -> None:
    cache = _cache()
    q = torch.randn(TOKENS, HEADS, D)
    tables = torch.tensor([[0, 1]], dtype=torch.int64)
    k.paged_prefill_attention(q, cache[0], cache[1], torch.empty_like(q), starts, lens, seq_lens, tables, D**-0.5)


def _packed(k: CpuKernels, rows: int = 64, cols: int = 64) -> PackedWeight:
    raw = np.random.default_rng(0).integers(0, 255, size=rows * cols // 32 * 18, dtype=np.uint8)
    raw.reshape(-1, 18)[:, 1] = 0x3C  # a float16 scale of about 1: finite values
    return pack(repack(raw, "Q4_0", rows, cols), k.quant_panel_width, k.quant_unsigned8)


def _quant_gemm(
    k: CpuKernels, x_cols: int = 64, out_cols: int = 64, truncate_qs: bool = False, **changes: object
) -> None:
    """`changes`: fields of the packed weight replaced (scales of another type, a part left out)."""
    w = _packed(k)
    if truncate_qs:
        w = dataclasses.replace(w, qs=w.qs[:, : w.qs.shape[1] // 2].contiguous())
    if changes:
        w = dataclasses.replace(w, **changes)
    k.quant_gemm(torch.randn(3, x_cols), w, torch.empty(3, out_cols))


def _dequantize_rows(k: CpuKernels, ids: torch.Tensor) -> None:
    w = _packed(k)
    k.dequantize_rows(w, ids, torch.empty(ids.shape[0], w.cols))


# name -> the wrong call (each makes exactly one mistake)
WRONG_CALLS: dict[str, Callable[[CpuKernels], None]] = {
    "rope_write_kv: qkv narrower than its heads": lambda k: _rope(k, width=(HEADS + KV_HEADS) * D),
    "rope_write_kv: a slot past the cache": lambda k: _rope(k, slots=_ids(0, 1, 2, BLOCKS * BLOCK_SIZE)),
    "rope_write_kv: a negative slot": lambda k: _rope(k, slots=_ids(0, -1, 2, 3)),
    "rope_write_kv: a position past the rotary tables": lambda k: _rope(k, positions=_ids(0, 1, 2, 64)),
    "rope_write_kv: fewer slots than tokens": lambda k: _rope(k, slots=_ids(0, 1)),
    "paged_decode_attention: a block id past the cache": lambda k: _decode(
        k, tables=torch.tensor([[0, 0], [1, BLOCKS]], dtype=torch.int64)
    ),
    "paged_decode_attention: a context longer than the table": lambda k: _decode(k, seq_lens=_ids(5, 3 * BLOCK_SIZE)),
    "paged_decode_attention: a query row past q": lambda k: _decode(k, rows=_ids(0, 2)),
    "paged_decode_attention: out smaller than q": lambda k: _decode(k, out_tokens=1),
    "paged_decode_attention: fewer lengths than requests": lambda k: _decode(k, seq_lens=_ids(5)),
    "paged_prefill_attention: rows past q": lambda k: _prefill(k, _ids(2), _ids(4), _ids(4)),
    "paged_prefill_attention: more new tokens than context": lambda k: _prefill(k, _ids(0), _ids(4), _ids(2)),
    "add_rms_norm: weight shorter than the rows": lambda k: k.add_rms_norm(
        None, torch.randn(3, 64), torch.ones(32), 1e-6
    ),
    "add_rms_norm: delta shorter than residual": lambda k: k.add_rms_norm(
        torch.randn(1, 64), torch.randn(3, 64), torch.ones(64), 1e-6
    ),
    "silu_mul: a 1-D input": lambda k: k.silu_mul(torch.randn(64)),
    "gemma_norm: columns past the rows": lambda k: k.gemma_norm(torch.randn(2, 64), torch.ones(32), 1e-6, None, 0, 96),
    "quant_gemm: x of another width": lambda k: _quant_gemm(k, x_cols=32),
    "quant_gemm: out narrower than the weight": lambda k: _quant_gemm(k, out_cols=32),
    "quant_gemm: a weight's values cut short": lambda k: _quant_gemm(k, truncate_qs=True),
    "quant_gemm: scales widened to float32": lambda k: _quant_gemm(k, scales=_packed(k).scales.float()),
    "quant_gemm: super-groups without their sub-scales": lambda k: _quant_gemm(k, super_group=256),
    "dequantize_rows: a row past the weight": lambda k: _dequantize_rows(k, _ids(0, 64)),
    "mask_rows: a row past x": lambda k: k.mask_rows(torch.randn(2, 64), torch.zeros(1, 2, dtype=torch.int32), [2]),
}


def run_all(kernels: CpuKernels) -> list[str]:
    """The wrong calls that were not refused (each refused one raises before its kernel runs)."""
    accepted = []
    for name, call in WRONG_CALLS.items():
        try:
            call(kernels)
        except (ValueError, TypeError):
            continue
        accepted.append(name)
    return accepted
