"""The model's projections compute a row the same whatever the rows beside it, as long as their
count stays within one range of the kernels' row limits: what lets speculative decoding add draft
rows to a step without changing any token (core/scheduler.py, `draft_row_limits`)."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM
from pagedllm.layers.cpu_kernels import cpu_flags

NATIVE_BF16 = "avx512_bf16" in cpu_flags().split()
LAST_RANGE_ROWS = 300  # the most rows tried in an unlimited range


def ranges(limits: tuple[int, ...]) -> list[tuple[int, int]]:
    bounds = [0, *(min(limit, LAST_RANGE_ROWS) for limit in limits)]
    return [(lo + 1, hi) for lo, hi in zip(bounds, bounds[1:]) if lo < hi]


@pytest.mark.parametrize(
    "dtype,weights",
    [("float32", "native"), ("float32", "dequantized"), ("bfloat16", "native"), ("bfloat16", "dequantized")],
)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it_within_a_limit(dtype, weights):
    if dtype == "bfloat16" and not NATIVE_BF16:
        pytest.skip("bfloat16 is emulated on this CPU class")
    llm = LLM(dtype=dtype, weights=weights, kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    limits = model.kernel_row_limits()
    assert limits, "the CPU kernels change with the row count somewhere"
    layer = model.layers[0]
    projections = [*layer.linears.values(), model.lm_head_linear]
    generator = torch.Generator().manual_seed(0)
    for linear in projections:
        width = linear.parts[0].cols if hasattr(linear, "parts") else linear.weight.shape[1]
        x = torch.randn(LAST_RANGE_ROWS, width, generator=generator).to(getattr(torch, dtype))
        for lo, hi in ranges(limits):
            want = linear(x[:lo])[: min(lo, 2)]
            for rows in sorted({lo, lo + 1, (lo + hi) // 2, hi} & set(range(lo, hi + 1))):
                got = linear(x[:rows])[: min(lo, 2)]
                assert torch.equal(got, want), f"{type(linear).__name__} {tuple(got.shape)}: {rows} vs {lo} rows"
    del llm, model, layer, projections
    gc.collect()
