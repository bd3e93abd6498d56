"""Projections on GGUF weights kept quantized against the same weights dequantized, per row count.

    python benchmarks/quantized_linear.py [--model smollm2|gemma3-270m] [--dtype auto|float32|bfloat16]
                                          [--rows 1 2 4 8 16 32 64 128 512] [--rounds 5] [--no-head]
                                          [--by-kind]

One pass runs every projection of every layer, and the LM head (left out with `--no-head`, to
time what a prompt step's rows run through), as a step of `rows` rows does, so the weights come
from memory as in the engine.  The ways, alternated round by round:
- `int`: the integer kernels on the quantized blocks (csrc/quant_gemm.cpp);
- `amx` (bfloat16 on a CPU with AMX-BF16): the tile kernel, which dequantizes a few panels at a
  time into the thread's cache (csrc/quant_amx.cpp);
- `blocked` (bfloat16, AVX512-BF16): the weight dequantized into oneDNN's blocked layout, then
  oneDNN's GEMM;
- `deq+gemm`: the weight dequantized into a plain scratch W^T, then a float GEMM;
- `dense`: the dequantized weights as the engine holds them with `weights=dequantized` (oneDNN
  with its packed copy, the small-batch kernels where they run).
Median ms per pass (min-max).  `QuantizedLinear`'s row limit comes from these crossovers.

`--by-kind` times the `int` way alone, per kind of projection (its file types and shape: a
Q4_K_M file's Q6_K `down_proj` apart from its Q4_K ones), each kind over all its layers.

Where a step turns from reading weights to arithmetic (many rows), the `int` path's rate is also
given as integer multiply-adds a second (rows x every weight's rows x cols, over its median time)
and as a share of this machine's peak for them: the instruction the integer kernels are built on
(VNNI's vpdpbusd, else vpmaddubsw with vpaddw) issued back to back from registers on every thread
(`CpuKernels.int8_multiply_add_peak`), measured before the rows and again after them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from pagedllm.execution.device import resolve_dtype
from pagedllm.layers.cpu_kernels import cpu_summary, load_cpu_kernels
from pagedllm.layers.linear import Linear, resolve_linear_backend
from pagedllm.layers.quantized import QuantizedLinear, QuantizedWeight, pack
from pagedllm.models.llama import fuse
from pagedllm.models.loader import load_weights, resolve_model_path

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def fused(weights: dict, config) -> list[list[QuantizedWeight]]:
    """The engine's fused projections (qkv, o, gate_up, down) per layer, and the LM head."""
    out = []
    for i in range(config.num_layers):
        w = [weights[f"layers.{i}.{name}.weight"] for name in PROJECTIONS]
        out += [fuse(w[0:3]), [w[3]], fuse(w[4:6]), [w[6]]]
    head = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return out + [[weights[head]]]


def alternated(passes: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each pass's ms over `rounds` rounds after one warm-up round, the order rotated each round."""
    times: dict[str, list[float]] = {name: [] for name in passes}
    names = list(passes)
    for round_ in range(rounds + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            passes[name]()
            if round_:  # the first round warms up
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def by_kind(quantized: list, packed: list, kernels, dtype: torch.dtype, rows: list[int], rounds: int, peak: float):
    """The integer kernels' time and share of the peak per kind of projection (its file types and
    shape), each kind over all its layers, kinds alternated round by round."""
    kinds: dict[str, list[int]] = {}
    for i, parts in enumerate(quantized):
        name = "+".join(w.source for w in parts) + f" {sum(w.shape[0] for w in parts)}x{parts[0].cols}"
        kinds.setdefault(name, []).append(i)
    linears = [QuantizedLinear(w, kernels, max_rows=1 << 30) for w in packed]
    print(f"{'kind (rows x k)':>28} {'layers':>6} {'rows':>5} {'int ms, all layers':>24} {'of peak':>8}")
    for m in rows:
        inputs = {name: torch.randn(m, quantized[ids[0]][0].cols).to(dtype) for name, ids in kinds.items()}

        def run(name: str, x: torch.Tensor) -> None:
            for i in kinds[name]:
                linears[i](x)

        times = alternated({name: partial(run, name, inputs[name]) for name in kinds}, rounds)
        for name, ids in kinds.items():
            t = times[name]
            macs = m * sum(w.shape[0] * w.shape[1] for i in ids for w in quantized[i])
            share = f"{macs / (statistics.median(t) / 1e3) / peak:.0%}" if peak else "-"
            cell = f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})"
            print(f"{name:>28} {len(ids):>6} {m:>5} {cell:>24} {share:>8}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-head", action="store_true", help="the layers' projections alone (as a prompt step runs)")
    parser.add_argument("--by-kind", action="store_true", help="the integer kernels alone, per kind of projection")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the C++ kernels do not build here")
    dtype = resolve_dtype(args.dtype, "cpu")
    config, weights = load_weights(resolve_model_path(args.model), keep_quantized=True)
    quantized = fused(weights, config)[: -1 if args.no_head else None]
    packed = [[pack(w, kernels.quant_panel_width, kernels.quant_unsigned8) for w in parts] for parts in quantized]
    what = args.model + (" without its LM head" if args.no_head else "")
    print(f"{cpu_summary()}; {dtype}; {what}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    peak = kernels.int8_multiply_add_peak()
    print(f"integer multiply-add peak: {peak / 1e9:.1f} G/s (all threads, from registers)")
    if args.by_kind:
        by_kind(quantized, packed, kernels, dtype, args.rows, args.rounds, peak)
    else:
        by_way(quantized, packed, kernels, dtype, config.hidden_size, args.rows, args.rounds, peak)
    if peak:
        print(f"integer multiply-add peak after the rows: {kernels.int8_multiply_add_peak() / 1e9:.1f} G/s")


def by_way(quantized: list, packed: list, kernels, dtype: torch.dtype, hidden: int, rows: list[int], rounds: int,
           peak: float) -> None:  # fmt: skip
    """Every projection per way (the module docstring's), ways alternated round by round."""
    backend = resolve_linear_backend("auto", dtype)
    ways: dict[str, list] = {
        "int": [QuantizedLinear(w, kernels, max_rows=1 << 30) for w in packed],
    }
    if kernels.quant_amx and dtype == torch.bfloat16:
        ways["amx"] = [QuantizedLinear(w, kernels, max_rows=0, tile_max_rows=1 << 30) for w in packed]
    if kernels.dequantize_blocked_bf16 and dtype == torch.bfloat16:
        ways["blocked"] = [QuantizedLinear(w, kernels, max_rows=0, tile_max_rows=0, blocked=True) for w in packed]
    ways |= {
        "deq+gemm": [QuantizedLinear(w, kernels, max_rows=0, tile_max_rows=0, blocked=False) for w in packed],
        "dense": [Linear(torch.cat([w.dequantize(dtype) for w in parts]), backend, kernels) for parts in quantized],
    }
    macs_per_row = sum(w.shape[0] * w.shape[1] for parts in quantized for w in parts)
    header = " ".join(f"{name + ' ms':>22}" for name in ways)
    print(f"{'rows':>5} {header} {'int/dense':>10} {'int G mult-add/s':>17} {'of peak':>8}")
    for m in rows:
        x = torch.randn(m, hidden).to(dtype)
        inputs = {id(w): torch.randn(m, w[0].cols).to(dtype) for w in quantized}

        def run(name: str, x: torch.Tensor, inputs: dict[int, torch.Tensor]) -> None:
            for w, linear in zip(quantized, ways[name]):
                linear(inputs[id(w)] if w[0].cols != hidden else x)

        times = alternated({name: partial(run, name, x, inputs) for name in ways}, rounds)
        cells = [f"{statistics.median(t):9.2f} ({min(t):.2f}-{max(t):.2f})" for t in times.values()]
        ratio = statistics.median(times["dense"]) / statistics.median(times["int"])
        rate = m * macs_per_row / (statistics.median(times["int"]) / 1e3)
        share = f"{rate / peak:.0%}" if peak else "-"
        print(f"{m:>5} " + " ".join(f"{c:>22}" for c in cells) + f" {ratio:>9.2f}x {rate / 1e9:>17.1f} {share:>8}")


if __name__ == "__main__":
    main()
