"""Two versions of the C++ CPU kernels side by side, in one process.

    git worktree add /tmp/before COMMIT      # or any copy of an older tree
    python benchmarks/kernel_ab.py --a /tmp/before/pagedllm/layers/csrc --kernel decode

Builds the library from each `csrc` folder (`--a`, and `--b`, default this tree's) with the
flags the engine uses, checks the two give the same outputs (the largest difference is
printed), then alternates them round by round and reports medians and B's time as a share
of A's.  Kernels (SmolLM2's shapes, bfloat16 unless --dtype float32):

- `decode`: decode attention, `--batch` requests of ~`--context` tokens (uniform +-50%),
  16-token blocks shuffled, `--layers` separate caches read in turn (30: a step's K/V, more
  than any cache holds; 1: one layer's, which stays in L3);
- `decode-shared`: 96 decoding requests whose first 384 tokens are one of 4 shared prefixes;
- `prefill`: `--batch` whole prompts of `--context` tokens (causal) over 4 layers' caches;
- `silu`: SiLU(gate) * up over `--batch` rows of SmolLM2's MLP (2 x 1,536);
- `argmax`: greedy argmax over `--batch` rows x 49,152 float32 logits, torch.argmax timed beside.

A source file that version A does not have yet (csrc/sampling.cpp before the C++ argmax) is
taken from this tree for both.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.layers.cpu_kernels import _FLAGS, _SOURCES, CpuKernels, cpu_summary

HERE = Path(__file__).resolve().parent.parent / "pagedllm" / "execution" / "csrc"
KV_HEADS, HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16


def build(csrc: Path, out: Path) -> CpuKernels:
    # A tree from before a source file existed gets this tree's copy of it (self-contained).
    sources = [str(csrc / name if (csrc / name).exists() else HERE / name) for name in _SOURCES]
    subprocess.run(["g++", *_FLAGS, "-march=native", "-o", str(out), *sources], check=True)
    return CpuKernels(ctypes.CDLL(str(out)))


def tables_for(lengths: list[int], gen: torch.Generator, shared: int = 0, groups: int = 1):
    """Block tables for contexts of `lengths`; the first `shared` tokens (whole blocks) are one
    of `groups` prefixes, request b taking prefix b % groups; other blocks shuffled."""
    shared_blocks = shared // BLOCK
    own = [-(-n // BLOCK) - shared_blocks for n in lengths]
    total = groups * shared_blocks + sum(own)
    perm = torch.randperm(total - groups * shared_blocks, generator=gen) + groups * shared_blocks
    tables = torch.zeros(len(lengths), shared_blocks + max(own), dtype=torch.int64)
    start = 0
    for b, n in enumerate(own):
        g = b % groups
        tables[b, :shared_blocks] = torch.arange(g * shared_blocks, (g + 1) * shared_blocks)
        tables[b, shared_blocks : shared_blocks + n] = perm[start : start + n]
        start += n
    return tables, total + 1


Workload = tuple[Callable[[CpuKernels], torch.Tensor], str, Callable[[], object] | None]


def workload(args: argparse.Namespace, dtype: torch.dtype) -> Workload:
    """A call that runs the kernel once with the given library and returns its output, what it
    runs, and a torch call doing the same work to time beside it (or None)."""
    gen = torch.Generator().manual_seed(0)
    if args.kernel in ("decode", "decode-shared"):
        if args.kernel == "decode":
            batch, layers, shared, groups = args.batch, args.layers, 0, 1
            lengths = torch.randint(args.context // 2, args.context * 3 // 2 + 1, (batch,), generator=gen)
        else:
            batch, layers, shared, groups = 96, args.layers, 384, 4
            lengths = torch.randint(40, 120, (batch,), generator=gen) + shared
        tables, blocks = tables_for(lengths.tolist(), gen, shared, groups)
        caches = [torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(layers)]
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        out, rows = torch.empty_like(q), torch.arange(batch)

        def run(k: CpuKernels) -> torch.Tensor:
            for c in caches:
                k.paged_decode_attention(q, c[0], c[1], out, rows, lengths, tables, HEAD_DIM**-0.5)
            return out

        return run, f"{batch} requests, mean context {lengths.float().mean():.0f}, {layers} layer(s)", None
    if args.kernel == "prefill":
        n, length = args.batch, args.context
        tables, blocks = tables_for([length] * n, gen)
        caches = [torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(4)]
        q = torch.randn(n * length, HEADS, HEAD_DIM, generator=gen).to(dtype)
        out = torch.empty_like(q)
        starts, lens = torch.arange(n) * length, torch.full((n,), length)

        def run(k: CpuKernels) -> torch.Tensor:
            for c in caches:
                k.paged_prefill_attention(q, c[0], c[1], out, starts, lens, lens, tables, HEAD_DIM**-0.5)
            return out

        flops = n * length * (length + 1) / 2 * HEADS * HEAD_DIM * 4 * len(caches)
        return run, f"{n} prompts x {length} tokens, 4 layers ({flops / 1e9:.2f} GFLOP a round)", None
    if args.kernel == "silu":
        gate_up = torch.randn(args.batch, 2 * 1536, generator=gen).to(dtype)
        return (lambda k: k.silu_mul(gate_up)), f"{args.batch} rows x 1,536", None
    logits = torch.randn(args.batch, 49152, generator=gen)
    return (lambda k: k.argmax_rows(logits)), f"{args.batch} rows x 49,152 float32", lambda: logits.argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="the csrc folder of version A")
    parser.add_argument("--b", type=Path, default=HERE, help="the csrc folder of version B (default: this tree's)")
    parser.add_argument("--kernel", choices=["decode", "decode-shared", "prefill", "silu", "argmax"], default="decode")
    parser.add_argument("--batch", type=int, default=128, help="requests, prompts or rows")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": build(args.a, Path(tmp) / "a.so"), "B": build(args.b, Path(tmp) / "b.so")}
        run, what, reference = workload(args, getattr(torch, args.dtype))
        print(f"{cpu_summary()}, {args.dtype}; {args.kernel}: {what}")
        outputs = {name: run(lib).clone() for name, lib in libs.items()}
        diff = (outputs["A"].double() - outputs["B"].double()).abs().max().item()
        print(f"largest difference between A's and B's outputs: {diff:g}")
        calls: dict[str, Callable[[], object]] = {name: (lambda lib=lib: run(lib)) for name, lib in libs.items()}
        if reference is not None:
            calls["torch"] = reference
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, m in medians.items():
            print(f"  {name:>12}: {m * 1e3:8.3f} ms a round")
        print(f"B / A: {medians['B'] / medians['A']:.3f}")


if __name__ == "__main__":
    main()
