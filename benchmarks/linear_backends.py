"""The engine's two GEMM backends for its projections, at the model's shapes.

    python benchmarks/linear_backends.py

`torch`: `F.linear` (MKL in torch's CPU build); `onednn`: oneDNN with the
weight reordered once (`pagedllm/execution/linear.py`).  float32; GFLOP/s, the two
backends interleaved round by round.  Then the small-batch GEMV against oneDNN
at 1 and 2 rows over all of SmolLM2's projections in turn (30 layers, 406 MiB in
float32, so every weight comes from memory as in a decode step): ms per pass
and the weight bytes read per second.
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
    gemv_against_onednn()


def gemv_against_onednn(layers: int = 30, rounds: int = 8) -> None:
    from pagedllm.execution.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None or torch.float32 not in kernels.gemv_dtypes:
        print("no float32 GEMV kernel here")
        return
    weights = [torch.randn(SHAPES[name]) for _ in range(layers) for name in ("qkv", "o", "gate_up", "down")]
    gemv = [Linear(w, "onednn", kernels) for w in weights]
    onednn = [Linear(w, "onednn") for w in weights]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    for m in (1, 2):
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"gemv": [], "onednn": []}
        for _ in range(rounds):
            for name, linears in (("gemv", gemv), ("onednn", onednn)):
                start = time.perf_counter()
                for w, linear in zip(weights, linears):
                    linear(xs[w.shape[1]])
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rates = ", ".join(f"{name} {v:.1f} ms ({weight_bytes / v / 1e6:.1f} GB/s)" for name, v in ms.items())
        print(f"{m} row(s), all projections: {rates}")


if __name__ == "__main__":
    main()
