"""Linear layers (y = x W^T) with the weight prepared once for the CPU's fastest GEMM.

`torch.nn.functional.linear` on torch's CPU build goes through MKL, which on
this project's AMD CPUs runs its generic path.  oneDNN (bundled with torch)
JIT-compiles for the CPU it finds; with the weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) its float32 GEMMs
measured 1.3-2x faster than `F.linear` on the model's shapes
(`python benchmarks/linear_backends.py`).  The reordered weight works for
any number of rows.  Where oneDNN cannot take the dtype here (bfloat16 needs
AVX-512 or AVX-NE-CONVERT), or `linear="torch"`, plain `F.linear` is used.

A decode step of one or two requests is bound by reading the weights, and
there oneDNN's per-call overhead showed: linears of at most `GEMV_MAX_ROWS`
rows go to the C++ GEMV kernel (csrc/gemv.cpp) instead, which reads the plain
weight once: float32 everywhere (AVX-512F or plain C++), bfloat16 with
AVX512-BF16.  It keeps that plain copy beside the packed one (for SmolLM2,
+203 MiB in bfloat16, +406 MiB in float32); `linear="onednn"` goes without.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedllm.execution.cpu_kernels import GEMV_K_MULTIPLE

LINEAR_BACKENDS = ("auto", "onednn", "torch")
GEMV_MAX_ROWS = 2


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
    """x [tokens, in] -> [tokens, out] for a weight [out, in]; `gemv` (a CpuKernels, or None) takes
    calls of at most GEMV_MAX_ROWS rows in the dtypes it runs."""

    def __init__(self, weight: torch.Tensor, backend: str, gemv=None) -> None:
        self.out_features = weight.shape[0]
        self.plain: torch.Tensor | None = None  # the [out, in] weight the GEMV kernel reads
        dtype = weight.dtype
        if gemv is not None and dtype in gemv.gemv_dtypes and weight.shape[1] % GEMV_K_MULTIPLE[dtype] == 0:
            self.plain, self._gemv = weight.contiguous(), gemv.gemv
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 128)
            self._forward = self._onednn
        else:
            self.weight = weight
            self._forward = self._torch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.shape[0] <= GEMV_MAX_ROWS:
            return self._gemv(x.contiguous(), self.plain)
        return self._forward(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
