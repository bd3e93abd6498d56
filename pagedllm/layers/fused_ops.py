"""The elementwise work of a llama layer, in two implementations with one interface.

- `CppOps`: the fused C++ kernels (pagedllm/layers/csrc/elementwise.cpp): residual add +
  RMSNorm in one pass, rotary on q and k + the K/V cache write in one pass,
  SiLU(gate) * up in one pass.
- `TorchOps`: the same math as separate torch ops; used where the C++ kernels
  cannot run (no compiler, another dtype, tensors off the CPU), and the
  reference the C++ ops are tested against.

Both keep Hugging Face's rounding points in low precision: the residual sum,
the normalized row before its weight, and SiLU before the product are rounded
to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.attention import write_kv
from pagedllm.layers.cpu_kernels import CpuKernels, load_cpu_kernels
from pagedllm.layers.rotary import RotaryStep


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalized in float32, times (1 + w) in float32, then rounded."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)


class TorchOps:
    name = "torch"
    kernels = None  # no C++ kernels (CppOps has them: the sampler's argmax uses them too)
    small_batch = None  # no small-batch GEMM kernels (see pagedllm/layers/linear.py)

    def add_rms_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place, when given); returns weight * rms_norm(residual)."""
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, eps)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        rotary: RotaryStep,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """Rotary on q and k of the fused QKV rows, k and v written at their slots; returns q."""
        _, _, _, kv_heads, head_dim = kv_cache.shape
        q_size, kv_size = num_heads * head_dim, kv_heads * head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = rotary.apply(q.reshape(-1, num_heads, head_dim))
        k = rotary.apply(k.reshape(-1, kv_heads, head_dim))
        write_kv(kv_cache, k, v, slot_mapping)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def gemma_norm(self, x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
        return gemma_rms_norm(x, weight_plus_one, eps)

    def gemma_norm_heads(self, qkv: torch.Tensor, start: int, width: int, weight: torch.Tensor, eps: float) -> None:
        """In place: Gemma's RMSNorm over each head (weight.numel() values) of qkv's columns
        [start, start + width)."""
        heads = qkv[:, start : start + width].unflatten(-1, (-1, weight.numel()))
        heads.copy_(gemma_rms_norm(heads, weight, eps))


class CppOps:
    name = "cpp"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self.small_batch = kernels

    def add_rms_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.kernels.add_rms_norm(delta, residual, weight, eps)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,
        rotary: RotaryStep,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        return self.kernels.rope_write_kv(
            qkv, rotary.index, rotary.cos32, rotary.sin32, kv_cache, slot_mapping, num_heads, rotary.rotary_dim
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh_mul(gate_up)

    def gemma_norm(self, x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.gemma_norm(x.contiguous(), weight_plus_one, eps)

    def gemma_norm_heads(self, qkv: torch.Tensor, start: int, width: int, weight: torch.Tensor, eps: float) -> None:
        self.kernels.gemma_norm(qkv, weight, eps, out=qkv, start=start, width=width)


LayerOps = TorchOps | CppOps


def select_ops(name: str, dtype: torch.dtype, device: str = "cpu") -> LayerOps:
    """auto: the C++ ops on the CPU for float32 and bfloat16 where they build, else torch."""
    if name not in ("auto", "cpp", "torch"):
        raise ValueError(f"ops must be auto, cpp or torch, got {name!r}")
    if name == "torch" or device != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        if name == "cpp":
            raise ValueError(f"ops='cpp' runs float32 or bfloat16 on the CPU, not {dtype} on {device}")
        return TorchOps()
    kernels = load_cpu_kernels()
    if kernels is None:
        if name == "cpp":
            raise RuntimeError("ops='cpp' asked for, but the C++ kernels could not be built (see the log)")
        return TorchOps()
    return CppOps(kernels)
