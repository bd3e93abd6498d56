"""The engine's two GEMM backends for its projections, at the model's shapes.

    python benchmarks/linear_backends.py

`torch`: `F.linear` (MKL in torch's CPU build); `onednn`: oneDNN with the
weight reordered once (`pagedllm/execution/linear.py`).  float32; GFLOP/s, the two
backends interleaved round by round.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedllm.execution.linear import Linear, onednn_supports

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    if not onednn_supports(torch.float32):
        raise SystemExit("oneDNN's packed linear does not run here")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'shape':>8} {'tokens':>6} {'torch GF/s':>11} {'onednn GF/s':>12} {'ratio':>6}")
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        backends = {b: Linear(weight, b) for b in ("torch", "onednn")}
        for m in (64, 128, 512):
            x = torch.randn(m, in_features)
            torch.testing.assert_close(backends["onednn"](x), backends["torch"](x), atol=1e-3, rtol=1e-3)
            times: dict[str, list[float]] = {b: [] for b in backends}
            for _ in range(10):
                for backend, linear in backends.items():
                    start = time.perf_counter()
                    linear(x)
                    times[backend].append(time.perf_counter() - start)
            flops = 2 * m * out_features * in_features
            rate = {b: flops / statistics.median(t) / 1e9 for b, t in times.items()}
            ratio = rate["onednn"] / rate["torch"]
            print(f"{name:>8} {m:>6} {rate['torch']:>11.1f} {rate['onednn']:>12.1f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
