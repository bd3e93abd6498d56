"""Sizing the KV cache on a GPU, as vLLM's `gpu_memory_utilization` does.

After the weights are on the device, one forward pass runs at the full token
budget (`max_num_batched_tokens` prompt tokens over as few requests as the
model length allows, through a throwaway KV cache just large enough), followed
by the sampler at `max_num_seqs` rows with top-k and top-p (its sorts are the
step's largest temporaries).  The peak of the allocator above the weights is
what a step needs besides the KV cache; `plan_gpu_memory` (pure arithmetic,
core/startup_checks.py) gives the KV cache the rest of the budget.  The decode
graphs' pool, captured after the KV cache exists, is set aside in proportion:
the largest graph's batch over the profiled tokens, times the profiled peak.
"""

from __future__ import annotations

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.step_message import ChunkPlan
from pagedllm.execution.cuda_graphs import graph_batch_sizes
from pagedllm.execution.model_runner import ModelRunner
from pagedllm.execution.startup_checks import GpuMemoryPlan, plan_gpu_memory


def profile_step_bytes(
    model, block_size: int, dtype: torch.dtype, device: torch.device, budget: int, max_len: int, max_num_seqs: int
) -> int:
    """Peak bytes the allocator holds, above what it held before, for one step at the token budget
    (the throwaway KV cache excluded)."""
    lengths = []
    left = budget
    while left > 0:  # requests no longer than the model allows, the budget's tokens in all
        lengths.append(min(left, max_len - 1))
        left -= lengths[-1]
    blocks_each = [-(-n // block_size) for n in lengths]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = ModelRunner(model, sum(blocks_each), block_size, dtype, device=device)
    cache_bytes = torch.cuda.memory_allocated(device) - before
    chunks, first = [], 0
    for i, (n, b) in enumerate(zip(lengths, blocks_each)):
        chunks.append(ChunkPlan(i, 0, [1] * n, list(range(first, first + b)), 1, n))
        first += b
    with torch.inference_mode():
        runner.run(chunks, [])
        rows = min(max_num_seqs, budget)
        logits = torch.randn(rows, model.config.vocab_size, device=device)
        params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * rows
        runner.sampler(logits, params, [None] * rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    del runner, logits
    torch.cuda.empty_cache()
    return peak


def plan_kv_cache(
    model, config, dtype: torch.dtype, device: torch.device, in_use_at_start: int, max_len: int
) -> GpuMemoryPlan:
    """The KV cache's bytes on this device under `config.gpu_memory_utilization`."""
    weights = torch.cuda.memory_allocated(device)
    peak = profile_step_bytes(
        model, config.block_size, dtype, device, config.max_num_batched_tokens, max_len, config.max_num_seqs
    )
    graphs = 0
    if not config.enforce_eager:
        largest = graph_batch_sizes(config.max_num_seqs)[-1]
        graphs = peak * min(1.0, largest / config.max_num_batched_tokens)
    total = torch.cuda.get_device_properties(device).total_memory
    return plan_gpu_memory(total, config.gpu_memory_utilization, in_use_at_start, weights, peak, int(graphs))
