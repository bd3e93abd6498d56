"""Turns a scheduler output into tensors, runs the model, samples.

The runner owns the KV cache tensors (one per layer) and the per-request
random generators; it makes no scheduling decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, build_attention_metadata
from pagedllm.model import LlamaModel
from pagedllm.request import Request
from pagedllm.sampler import Sampler
from pagedllm.scheduler import SchedulerOutput


@dataclass
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    samplers: list[Request]  # each sequence that samples a token this step (n>1 forks included)
    logits_rows: torch.Tensor  # token row whose hidden state gives that sequence's logits


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
        c = model.config
        self.model = model
        self.block_size = block_size
        # Left uninitialized: pages are committed as blocks are first used, and attention
        # never lets a slot outside a request's context reach its output, NaN included
        # (tests/test_attention.py::test_slots_outside_every_context_never_reach_the_output).
        self.kv_caches = [
            torch.empty(2, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=dtype) for _ in range(c.num_layers)
        ]
        self.sampler = Sampler(seed)
        self.generators: dict[str, torch.Generator] = {}

    def prepare(self, output: SchedulerOutput) -> StepTensors:
        bs = self.block_size
        chunks = output.scheduled
        lens = [c.num_new_tokens for c in chunks]
        query_start_loc = [0, *np.cumsum(lens).tolist()]
        input_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=query_start_loc[-1])
        positions = np.concatenate([np.arange(c.start, c.start + c.num_new_tokens) for c in chunks])
        max_blocks = max(len(c.block_table) for c in chunks)
        tables = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        owner = np.repeat(np.arange(len(chunks)), lens)
        slot_mapping = tables[owner, positions // bs] * bs + positions % bs
        seq_lens = [c.start + c.num_new_tokens for c in chunks]
        meta = build_attention_metadata(
            torch.from_numpy(slot_mapping), query_start_loc, seq_lens, torch.from_numpy(tables)
        )
        samplers: list[Request] = []
        rows: list[int] = []
        for i, c in enumerate(chunks):
            if c.samples:  # forks sample from the same last-position logits as the request they fork from
                samplers.extend((c.request, *c.forks))
                rows.extend([query_start_loc[i + 1] - 1] * (1 + len(c.forks)))
        logits_rows = torch.tensor(rows, dtype=torch.int64)
        return StepTensors(torch.from_numpy(input_ids), torch.from_numpy(positions), meta, samplers, logits_rows)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: fill each fresh block with its shared source, in every layer, before the step writes."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_blocks(output.block_copies)
        step = self.prepare(output)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if not step.samplers:
            return ModelRunnerOutput({}, {})
        logits = self.model.compute_logits(hidden.index_select(0, step.logits_rows))
        requests = step.samplers
        params = [r.sampling_params for r in requests]
        generators = [self._generator(r.request_id, r.sampling_params.seed) for r in requests]
        result = self.sampler(logits, params, generators)
        ids = [r.request_id for r in requests]
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, result.token_ids)), logprobs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = torch.Generator().manual_seed(seed)
        return generator

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self.generators.pop(request_id, None)
