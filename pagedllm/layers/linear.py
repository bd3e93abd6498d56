"""Linear layers (y = x W^T) with the weight prepared once for the CPU's fastest GEMM.

`torch.nn.functional.linear` on torch's CPU build goes through MKL, which on
this project's AMD CPUs runs its generic path.  oneDNN (bundled with torch)
JIT-compiles for the CPU it finds; with the weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) its float32 GEMMs
measured 1.3-2x faster than `F.linear` on the model's shapes
(`python benchmarks/linear_backends.py`).  The reordered weight works for
any number of rows.  Where oneDNN cannot take the dtype here (bfloat16 needs
AVX-512 or AVX-NE-CONVERT), or `linear="torch"`, plain `F.linear` is used.

A decode step of a few requests is bound by reading the weights (or, at a few
dozen rows, by FMAs that oneDNN's GEMM, tuned for many rows, leaves idle), so
with a `small_batch` kernel library (a CpuKernels) such steps go to the C++
`packed_gemm` (csrc/small_gemm.cpp) on a copy of the weight packed in panels of
32 output columns: float32 linears of at most `packed_gemm_max_rows` rows (32
with AVX-512, 4 for the plain C++ build), and bfloat16 ones (even inner size)
of up to 512 rows where the CPU has AVX512-BF16, the LM head's too.  That copy
is kept beside oneDNN's (for SmolLM2's projections, +406 MiB in float32, +203
MiB in bfloat16); `linear="onednn"` goes without.
The limits were measured against oneDNN on SmolLM2's projections
(`python benchmarks/linear_backends.py`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_kernels import CpuKernels

LINEAR_BACKENDS = ("auto", "onednn", "torch")
ONEDNN_ROWS_HINT = 128  # the batch size oneDNN's weight packing is told to expect
# oneDNN's bfloat16 GEMM (AMX) blocks the rows differently past this many: for some shapes a row's
# output changes in its last bits from 33 rows on.
ONEDNN_BF16_ROW_LIMIT = 32
UNLIMITED_ROWS = 1 << 30  # a row limit this large is none


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """True when oneDNN's packed linear runs here for this dtype (checked on a tiny weight)."""
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 1)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), weight, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def resolve_linear_backend(name: str, dtype: torch.dtype) -> str:
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    if name == "torch":
        return "torch"
    if onednn_supports(dtype):
        return "onednn"
    if name == "onednn":
        raise ValueError(f"linear='onednn' cannot run {dtype} on this CPU; use linear='torch' or 'auto'")
    return "torch"


class Linear:
    """x [tokens, in] -> [tokens, out] for a weight [out, in]; with `small_batch` (a CpuKernels, or
    None) calls of a few rows go to its kernels where they run the dtype."""

    def __init__(self, weight: torch.Tensor, backend: str, small_batch: CpuKernels | None = None) -> None:
        self.out_features = weight.shape[0]
        self.small_weight: torch.Tensor | None = None  # the packed copy the small-batch kernel reads
        self.small_max_rows = 0
        max_rows = 0 if small_batch is None else small_batch.packed_gemm_max_rows.get(weight.dtype, 0)
        pairs_fit = weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0  # bfloat16 packs k in pairs
        if max_rows and pairs_fit:
            self.small_weight, self.small_max_rows = small_batch.pack_panels(weight), max_rows
            self._small = functools.partial(small_batch.packed_gemm, n=self.out_features)
        self.dtype = weight.dtype
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS_HINT)
            self._forward = self._onednn
        else:
            self.weight = weight
            self._forward = self._torch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_max_rows:
            return self._small(x.contiguous(), self.small_weight)
        return self._forward(x)

    def row_limits(self, dtype: torch.dtype | None = None) -> tuple[int, ...]:
        """The row counts that end the ranges within which a row's output does not depend on how many
        rows share the call (its kernels, and their blocking, stay the same); past the last, nothing
        is promised.  Without the small-batch kernel one GEMM takes every row count, whose blocking
        is not ours to know: (UNLIMITED_ROWS,).  (`dtype`: the weight's, the only one it runs.)"""
        if not self.small_max_rows:
            return (UNLIMITED_ROWS,)
        onednn_bf16 = self._forward == self._onednn and self.dtype == torch.bfloat16
        if onednn_bf16 and self.small_max_rows < ONEDNN_BF16_ROW_LIMIT:
            return (self.small_max_rows, ONEDNN_BF16_ROW_LIMIT)
        return (self.small_max_rows,)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
