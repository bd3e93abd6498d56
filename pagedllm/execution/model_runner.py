"""Turns a scheduler output into tensors, runs the model, samples.

The runner owns the KV cache tensors (one per layer) and the per-request
random generators; it makes no scheduling decisions.  Under tensor
parallelism every rank has a runner over its slice of the model and KV
cache: rank 0's `execute` first broadcasts the step as increments (see
pagedllm/core/step_message.py), every rank then `run`s the same step, and only
rank 0 gets logits and samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.step_message import Chunk, StepEncoder
from pagedllm.execution.attention_metadata import AttentionMetadata, build_attention_metadata
from pagedllm.execution.logits_processors import TokenHistory
from pagedllm.execution.sampler import Sampler
from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.models.llama import LlamaModel


@dataclass
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # per sampled token (n>1 forks included): the row whose hidden state gives its logits


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
        c = model.config
        self.model = model
        self.tp = model.tp
        self.block_size = block_size
        # Left uninitialized: pages are committed as blocks are first used, and attention
        # never lets a slot outside a request's context reach its output, NaN included
        # (tests/test_attention.py::test_slots_outside_every_context_never_reach_the_output).
        # Under tensor parallelism: this rank's KV heads, the same number of blocks on every rank.
        kv_heads = model.shard.num_kv_heads
        self.kv_caches = [
            torch.empty(2, num_blocks, block_size, kv_heads, c.head_dim, dtype=dtype) for _ in range(c.num_layers)
        ]
        self.sampler = Sampler(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.structured: StructuredOutputs | None = None  # set by the engine (rank 0 samples)
        self.encoder = StepEncoder() if self.tp.size > 1 else None
        self.step_message_bytes = 0  # total bytes of step messages broadcast (rank 0, tensor parallel)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    def prepare(self, chunks: Sequence[Chunk]) -> StepTensors:
        bs = self.block_size
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
        # Forks sample from the same last-position logits as the request they fork from.
        rows = [query_start_loc[i + 1] - 1 for i, c in enumerate(chunks) for _ in range(c.num_samples)]
        logits_rows = torch.tensor(rows, dtype=torch.int64)
        return StepTensors(torch.from_numpy(input_ids), torch.from_numpy(positions), meta, logits_rows)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: fill each fresh block with its shared source, in every layer, before the step writes."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run a scheduled step (on rank 0 under tensor parallelism) and sample."""
        if self.encoder is not None:
            message = self.encoder.encode(((c.request.request_id, c) for c in output.scheduled), output.block_copies)
            self.tp.broadcast_ints(message)
            self.step_message_bytes += 8 + 4 * len(message)  # the length, then the int32 payload
        logits = self.run(output.scheduled, output.block_copies)
        if logits is None:
            return ModelRunnerOutput({}, {})
        requests = [r for c in output.scheduled if c.samples for r in (c.request, *c.forks)]
        params = [r.sampling_params for r in requests]
        generators = [self._generator(r.request_id, r.sampling_params.seed) for r in requests]
        histories = None
        if any(p.processes_logits for p in params):
            histories = [TokenHistory(r.prompt_token_ids, r.output_token_ids, r.eos_token_id) for r in requests]
        ids = [r.request_id for r in requests]
        constrain = None
        if self.structured is not None and self.structured.matchers:
            structured = self.structured

            def constrain(rows: torch.Tensor) -> torch.Tensor:
                return structured.apply_masks(rows, ids)

        result = self.sampler(logits, params, generators, histories, constrain)
        if constrain is not None:
            for rid, token in zip(ids, result.token_ids):
                self.structured.accept(rid, token)
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return ModelRunnerOutput(dict(zip(ids, result.token_ids)), logprobs)

    def run(self, chunks: Sequence[Chunk], block_copies: Sequence[tuple[int, int]]) -> torch.Tensor | None:
        """Every rank's part of a step: copy-on-write copies, the forward pass, the logits of the
        sampled rows; None where nothing samples, and on ranks other than 0."""
        self.copy_blocks(block_copies)
        step = self.prepare(chunks)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if not step.logits_rows.numel():
            return None
        return self.model.compute_logits(hidden.index_select(0, step.logits_rows))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = torch.Generator().manual_seed(seed)
        return generator

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's generator (and, tensor parallel, the workers' copy of its table)."""
        self.generators.pop(request_id, None)
        if self.structured is not None:
            self.structured.release(request_id)
        if self.encoder is not None:
            self.encoder.release(request_id)
