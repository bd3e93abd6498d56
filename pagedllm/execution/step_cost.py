"""What one more row costs a decode step, measured on this machine, for speculative decoding's policy.

A decode step costs about `base + rows * per_row + (context tokens over all rows) *
per_context_token`: the weights are read once whatever the rows, each row adds its share of
compute, and its attention reads its context's K/V.  The ratios to `base` decide how many
draft tokens are worth verifying (core/speculation.py), and they differ by an order of
magnitude between machines and dtypes (weight-bound float32 on AVX2, compute-bound bfloat16
on a small model), so they are measured once when the engine starts: decode-only steps of a
few row counts at a short context, fitted by least squares, one row count at a long
context, and the sampler on as many rows at a temperature (softmax and cumulative sums over the
vocabulary, which greedy rows skip).  Each timing is the fastest of a few runs: a capability, not a figure to report.
"""

from __future__ import annotations

import logging
import time

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.speculation import StepCost
from pagedllm.execution.model_runner import ModelRunner, VerifyRow

logger = logging.getLogger("pagedllm")

ROW_COUNTS = (1, 4, 8, 16)
LONG_CONTEXT = 1024
REPEATS = 5


def _times(runner: ModelRunner, steps: list[list[VerifyRow]], repeats: int) -> list[float]:
    """The fastest of `repeats` runs of each step, timed in rounds that take every step in turn: a
    burst of load from elsewhere then slows one run of each, not every run of one."""
    for chunks in steps:
        runner.run(chunks, [])  # warm up this shape's kernels
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, chunks in enumerate(steps):
            start = time.perf_counter()
            runner.run(chunks, [])
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _sampling_time(runner: ModelRunner, rows: int, repeats: int) -> float:
    """Seconds to sample `rows` rows of logits at temperature 1 (a greedy row's argmax is ~free)."""
    logits = torch.randn(rows, runner.model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    logits = logits.to(runner.device)
    params = [SamplingParams(temperature=1.0)] * rows
    runner.sampler(logits, params, [None] * rows)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.sampler(logits, params, [None] * rows)
        best = min(best, time.perf_counter() - start)
    return best


def measure_step_cost(
    runner: ModelRunner, row_counts: tuple[int, ...] = ROW_COUNTS, repeats: int = REPEATS
) -> StepCost:
    """This runner's decode-step cost, relative to its base (rows on the padding block, zeroed)."""
    bs, padding = runner.block_size, runner.padding_block
    for cache in runner.kv_caches:  # the rows read it: zeros, not whatever the allocation held
        cache[:, padding].zero_()
    # The widest row count again, each row at a long context (one block, named over and over): a
    # draft row re-reads its request's context, which the request's first row has just brought
    # into the cache.
    # At most the model's longest context: positions past its rotary table are refused.
    rows, blocks = row_counts[-1], max(1, min(LONG_CONTEXT, runner.model.rotary.max_len) // bs)
    long = [VerifyRow(blocks * bs - 1 - j % bs, [0], [padding] * blocks, 1) for j in range(rows)]
    short_steps = [[VerifyRow(j % bs, [0], [padding], 1) for j in range(r)] for r in row_counts]
    *times, long_time = _times(runner, [*short_steps, long], repeats)
    n = len(row_counts)
    mean_rows, mean_time = sum(row_counts) / n, sum(times) / n
    slope = sum((r - mean_rows) * (t - mean_time) for r, t in zip(row_counts, times)) / sum(
        (r - mean_rows) ** 2 for r in row_counts
    )
    base = max(mean_time - slope * mean_rows, slope, 1e-6)
    slope = max(slope, 1e-6)
    short_context = sum(j % bs + 1 for j in range(rows))
    long_context = sum(blocks * bs - j % bs for j in range(rows))
    per_token = max(long_time - times[-1], 0.0) / max(long_context - short_context, 1)
    per_sampled_row = _sampling_time(runner, rows, repeats) / rows
    cost = StepCost(slope / base, per_token / base, per_sampled_row / base)
    logger.info(
        "decode step cost: %.2f ms + %.3f ms per row (+%.3f ms sampled at a temperature) + %.2f us per "
        "context token (rows %s: %s ms)",
        base * 1e3,
        slope * 1e3,
        per_sampled_row * 1e3,
        per_token * 1e6,
        list(row_counts),
        ", ".join(f"{t * 1e3:.1f}" for t in times),
    )
    return cost
