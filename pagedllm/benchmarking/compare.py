"""Side-by-side comparisons a skeptic can accept: engines alternated, each repeated, medians with
their spread, and the machine written beside every figure.

The comparison scripts in benchmarks/ (vLLM, llama.cpp, transformers, the serving replay) share
these rules:

- `alternate` runs every engine once per round, in an order that rotates each round (A B, then
  B A, ...), so a slow minute on a shared machine hits each engine alike; `--repeats` rounds.
- Each engine gets the same warm-up before its timed run, in every round.
- `spread` reports the median of the repeats with their min and max, never the best run; a
  ratio is taken within each round (the engines ran back to back) and reported the same way.
- `machine` records the CPU, its SIMD flags, the core count and the library versions, so a figure
  is never quoted without the hardware it was measured on.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

from pagedllm.layers.cpu_kernels import cpu_flags, cpu_summary

# The flags that decide which kernels run and how fast bfloat16 is.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """What a figure was measured on."""
    flags = set(cpu_flags().split())
    return {
        "cpu": cpu_summary(),
        "cpu_flags": [flag for flag in KERNEL_FLAGS if flag in flags],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "pagedllm": package_version("pagedllm"),
    }


def alternate(runs: dict[str, Callable[[], dict]], repeats: int, log: Callable[[str], None] = print) -> dict:
    """Every engine `repeats` times, alternating: round i starts at engine i mod n.  Returns
    {engine: [result of round 0, round 1, ...]}; each result gets its round and position."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    names = list(runs)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for position, name in enumerate(names[shift:] + names[:shift]):
            log(f"round {round_index + 1}/{repeats}: {name}")
            result = runs[name]()
            results[name].append({"round": round_index, "position": position} | result)
    return results


def spread(values: list[float], digits: int = 3) -> dict:
    """Median, min and max of a figure over the repeats, and the values themselves."""
    if not values:
        raise ValueError("no values to summarize")
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def summarize(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """`spread` of each figure in `keys` that every run has."""
    return {key: spread([run[key] for run in runs]) for key in keys if all(key in run for run in runs)}


def paired_ratio(ours: list[dict], theirs: list[dict], key: str, higher_is_better: bool = True) -> dict:
    """ours / theirs for `key`, taken round by round (each pair ran back to back), as a `spread`;
    for a figure where lower is better (a latency) theirs / ours, so above 1 always means ours
    is better."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} runs against {len(theirs)}: the rounds do not pair")
    pairs = [(a[key], b[key]) for a, b in zip(ours, theirs)]
    return spread([a / b if higher_is_better else b / a for a, b in pairs])


def format_spread(name: str, figures: dict, unit: str = "") -> str:
    """'name: median (min-max) unit', for the line a script prints at the end."""
    return f"{name}: {figures['median']:g} ({figures['min']:g}-{figures['max']:g}){unit}"


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 7) -> dict:
    """The machine's read bandwidth as one decode step meets it: the median time torch takes to
    sum a float32 tensor of `gib` GiB (far past every cache) on all of the process's threads,
    with min and max, in GB/s.  A one-request decode step reads every weight once, so
    `bandwidth / bytes read per token` is the ceiling on its tokens per second."""
    import time

    import torch

    values = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    values.sum()  # pages touched, threads started
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        rates.append(values.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return spread(rates, digits=1) | {"threads": torch.get_num_threads(), "tensor_gib": gib}


# What an offline comparison reports per engine, and what it keeps of each pagedllm run.
OFFLINE_FIGURES = ("output_tokens_per_s", "total_tokens_per_s", "wall_s", "startup_s")
KEPT_RUN_FIELDS = set(OFFLINE_FIGURES) | {"round", "position", "output_tokens", "peak_running", "steps", "preemptions"}


def offline_header(workload: str, num_requests: int, dtype: str, repeats: int) -> dict:
    """What an offline comparison ran: the workload, its size, the dtype, the rounds, the machine."""
    return {
        "workload": Path(workload).name,
        "requests": num_requests,
        "dtype": dtype,
        "repeats": repeats,
        "machine": machine(),
    }


def offline_report(peer: str, ours: list[dict], theirs: list[dict]) -> dict:
    """Both engines' figures (median, min, max), the round-by-round output ratio and every run."""
    return {
        "pagedllm": summarize(ours, OFFLINE_FIGURES),
        peer: summarize(theirs, OFFLINE_FIGURES),
        f"pagedllm_over_{peer}_output_tokens_per_s": paired_ratio(ours, theirs, "output_tokens_per_s"),
        f"pagedllm_over_{peer}_startup": paired_ratio(ours, theirs, "startup_s", higher_is_better=False),
        "runs": {"pagedllm": [{k: v for k, v in r.items() if k in KEPT_RUN_FIELDS} for r in ours], peer: theirs},
    }


def print_offline(report: dict, peer: str, label: str) -> None:
    print(format_spread("output tok/s, pagedllm", report["pagedllm"]["output_tokens_per_s"]))
    print(format_spread(f"output tok/s, {label}", report[peer]["output_tokens_per_s"]))
    print(format_spread(f"pagedllm / {label}", report[f"pagedllm_over_{peer}_output_tokens_per_s"], "x"))
