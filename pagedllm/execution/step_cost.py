"""What one more row costs a decode step, measured on this machine, for speculative decoding's policy.

A decode step costs about `base + per_row * rows`: the weights are read once whatever the
rows, and each row adds its share of compute.  The ratio per_row / base decides how many
draft tokens are worth verifying (core/speculation.py), and it differs by an order of
magnitude between machines and dtypes (weight-bound float32 on AVX2, compute-bound bfloat16
on a small model), so it is measured once when the engine starts: decode-only steps of a
few row counts, timed, fitted by least squares.
"""

from __future__ import annotations

import logging
import time

from pagedllm.execution.model_runner import ModelRunner, VerifyRow

logger = logging.getLogger("pagedllm")

ROW_COUNTS = (1, 4, 8, 16)
REPEATS = 3


def measure_row_cost(runner: ModelRunner, row_counts: tuple[int, ...] = ROW_COUNTS, repeats: int = REPEATS) -> float:
    """per_row / base of this runner's decode steps (rows of short context, on the padding block)."""
    bs, padding = runner.block_size, runner.padding_block
    for cache in runner.kv_caches:  # the rows read it: zeros, not whatever the allocation held
        cache[:, padding].zero_()
    times = []
    for rows in row_counts:
        chunks = [VerifyRow(j % bs, [0], [padding], 1) for j in range(rows)]
        runner.run(chunks, [])  # warm up this row count's kernels
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            runner.run(chunks, [])
            best = min(best, time.perf_counter() - start)
        times.append(best)
    n = len(row_counts)
    mean_rows, mean_time = sum(row_counts) / n, sum(times) / n
    slope = sum((r - mean_rows) * (t - mean_time) for r, t in zip(row_counts, times)) / sum(
        (r - mean_rows) ** 2 for r in row_counts
    )
    base = mean_time - slope * mean_rows
    ratio = max(slope, 1e-6) / max(base, slope, 1e-6)
    logger.info(
        "decode step cost: %.2f ms + %.2f ms per row (per-row / base %.3f; rows %s: %s ms)",
        base * 1e3,
        slope * 1e3,
        ratio,
        list(row_counts),
        ", ".join(f"{t * 1e3:.1f}" for t in times),
    )
    return ratio
