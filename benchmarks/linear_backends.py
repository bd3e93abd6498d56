"""The engine's two GEMM backends for its projections, at the model's shapes.

    python benchmarks/linear_backends.py [--compare-dtypes]

`torch`: `F.linear` (MKL in torch's CPU build); `onednn`: oneDNN with the
weight reordered once (`pagedllm/layers/linear.py`).  float32; GFLOP/s, the two
backends interleaved round by round.  Then the small-batch `packed_gemm`
(csrc/small_gemm.cpp) against oneDNN at 1-512 rows over all of SmolLM2's
projections in turn (30 layers, 406 MiB in float32, 203 MiB in bfloat16, so
every weight comes from memory as in a decode step): ms per pass, GFLOP/s, and
the ratio; in float32, and in bfloat16 where the CPU has AVX512-BF16.

`--compare-dtypes` first times `F.linear` in float32 against bfloat16 at the same shapes
(alternated): what `dtype=auto` decides from the CPU's flags, measured (without AVX512-BF16
or AMX, bfloat16 is emulated and slower).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from pagedllm.layers.linear import Linear, onednn_supports

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def compare_dtypes(rounds: int = 10) -> None:
    print(f"{'shape':>8} {'tokens':>6} {'float32 GF/s':>13} {'bfloat16 GF/s':>14} {'bf16/fp32':>9}")
    for name, (out_features, in_features) in SHAPES.items():
        for m in (1, 16, 128, 512):
            weights = {d: torch.randn(out_features, in_features).to(d) for d in (torch.float32, torch.bfloat16)}
            inputs = {d: torch.randn(m, in_features).to(d) for d in weights}
            times: dict[torch.dtype, list[float]] = {d: [] for d in weights}
            for _ in range(rounds):
                for d in weights:
                    start = time.perf_counter()
                    torch.nn.functional.linear(inputs[d], weights[d])
                    times[d].append(time.perf_counter() - start)
            rate = {d: 2 * m * out_features * in_features / statistics.median(t) / 1e9 for d, t in times.items()}
            ratio = rate[torch.bfloat16] / rate[torch.float32]
            print(f"{name:>8} {m:>6} {rate[torch.float32]:>13.1f} {rate[torch.bfloat16]:>14.1f} {ratio:>9.2f}")


def main() -> None:
    if "--compare-dtypes" in sys.argv[1:]:
        compare_dtypes()
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
    for dtype in (torch.float32, torch.bfloat16):
        small_batch_against_onednn(dtype)


def small_batch_against_onednn(dtype: torch.dtype, layers: int = 30, rounds: int = 8) -> None:
    from pagedllm.layers.cpu_kernels import cpu_summary, load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        print("no C++ kernels here")
        return
    max_rows = kernels.packed_gemm_max_rows[dtype]
    if not max_rows or not onednn_supports(dtype):
        print(f"no {dtype} packed_gemm or oneDNN on this CPU ({cpu_summary()})")
        return
    names = ("qkv", "o", "gate_up", "down")
    weights = [torch.randn(SHAPES[name]).to(dtype) for _ in range(layers) for name in names]
    packed = [kernels.pack_panels(w) for w in weights]
    onednn = [Linear(w, "onednn") for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{dtype} packed_gemm (the engine's up to {max_rows} rows) against oneDNN, all projections, {cpu_summary()}:")
    for m in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512):
        xs = {k: torch.randn(m, k).to(dtype) for k in {w.shape[1] for w in weights}}
        times: dict[str, list[float]] = {"packed": [], "onednn": []}
        for _ in range(rounds):
            for name in times:
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    x = xs[w.shape[1]]
                    kernels.packed_gemm(x, packed[i], w.shape[0]) if name == "packed" else onednn[i](x)
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rates = ", ".join(f"{name} {v:6.1f} ms ({flops_per_row * m / v / 1e6:5.1f} GFLOP/s)" for name, v in ms.items())
        print(f"{m:>3} rows: {rates}, oneDNN / packed {ms['onednn'] / ms['packed']:.2f}")


if __name__ == "__main__":
    main()
