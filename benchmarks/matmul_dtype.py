"""float32 vs bfloat16 matmul speed on this CPU, at the model's projection shapes.

    python benchmarks/matmul_dtype.py

The engine's `dtype="auto"` picks bfloat16 only on CPUs with native bf16 math
(AVX512-BF16 or AMX); this script shows why, on the machine at hand.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from pagedllm.execution.device import cpu_has_native_bf16

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def gflops(m: int, out_features: int, in_features: int, dtype: torch.dtype, repeat: int = 10) -> float:
    x = torch.randn(m, in_features).to(dtype)
    w = torch.randn(out_features, in_features).to(dtype)
    for _ in range(2):
        F.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeat):
        F.linear(x, w)
    return 2 * m * out_features * in_features * repeat / (time.perf_counter() - start) / 1e9


def main() -> None:
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}"
    )
    print(f"{'shape':>8} {'tokens':>6} {'float32 GF/s':>13} {'bfloat16 GF/s':>14} {'bf16/fp32':>9}")
    for name, (out_features, in_features) in SHAPES.items():
        for m in (64, 512):
            f32 = gflops(m, out_features, in_features, torch.float32)
            bf16 = gflops(m, out_features, in_features, torch.bfloat16, repeat=3)
            print(f"{name:>8} {m:>6} {f32:>13.1f} {bf16:>14.1f} {bf16 / f32:>9.2f}")


if __name__ == "__main__":
    main()
