"""The LM head's reused output tensors: the logits a step samples from are the same with them
as without, and a buffer is reused (not reallocated) while it is large enough."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm import LLM
from pagedllm.layers.output_buffers import OutputBuffers


def test_a_buffer_is_reused_while_large_enough_and_replaced_when_not():
    buffers = OutputBuffers()
    first = buffers.take("logits", 8, 16, torch.float32)
    assert first.shape == (8, 16) and first.is_contiguous()
    fewer = buffers.take("logits", 3, 16, torch.float32)
    assert fewer.shape == (3, 16) and fewer.data_ptr() == first.data_ptr()
    more = buffers.take("logits", 9, 16, torch.float32)
    assert more.shape == (9, 16) and more.data_ptr() != first.data_ptr()
    assert buffers.take("logits", 9, 16, torch.bfloat16).dtype == torch.bfloat16
    assert buffers.take("logits", 9, 17, torch.bfloat16).shape == (9, 17)
    assert buffers.nbytes == 9 * 17 * 2


@pytest.mark.parametrize("weights", ["native", "dequantized"])
def test_logits_through_reused_buffers_equal_fresh_ones(weights):
    llm = LLM(weights=weights, kv_cache_memory="64MiB")
    model = llm.engine.runner.model
    buffers = OutputBuffers()
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 20, 40, 3):  # each row count's own kernels; fewer rows after more reuse the buffers
        hidden = torch.randn(rows, model.config.hidden_size, generator=generator).to(model.norm.dtype)
        want = model.compute_logits(hidden)
        got = model.compute_logits(hidden, buffers)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), f"{rows} rows"
    del llm, model
    gc.collect()
