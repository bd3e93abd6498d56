"""Turns a scheduler output into tensors, runs the model, samples.

The runner owns the KV cache tensors (one per layer) and the per-request
random generators; it makes no scheduling decisions.  Under tensor
parallelism every rank has a runner over its slice of the model and KV
cache: rank 0's `execute` first broadcasts the step as increments (see
pagedllm/core/step_message.py), every rank then `run`s the same step, and only
rank 0 gets logits and samples.

On CUDA everything a step reads lives on the GPU: the KV cache, and the step's
inputs (token ids, positions, slots, block tables, lengths), which `prepare`
packs into one int64 buffer and copies over once, from pinned memory, without
waiting.  The only wait of a step is for the sampled ids (and logprobs, when
asked).  Decode-only steps replay a captured CUDA graph (cuda_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.core.layer_groups import LayerGroups, group_layers
from pagedllm.core.request import Request
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.core.step_message import Chunk, StepEncoder
from pagedllm.execution.logits_processors import TokenHistory
from pagedllm.execution.sampler import Sampler
from pagedllm.execution.structured_output import StructuredOutputError, StructuredOutputs
from pagedllm.layers.attention_metadata import AttentionMetadata, build_attention_metadata, group_block_tables
from pagedllm.models.llama import LlamaModel

logger = logging.getLogger("pagedllm")


@dataclass
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: list[AttentionMetadata]  # per layer: its group's (one object shared by a group's layers)
    logits_rows: torch.Tensor  # per sampled token (n>1 forks included): the row whose hidden state gives its logits
    # Per token, the sequence length its rotary is for: max(position + 1, prompt length); only where
    # the model's RoPE depends on it (pagedllm/layers/rotary.py), else None.
    rope_lengths: torch.Tensor | None = None


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]
    # Sequences whose row allowed no token at all (every token masked): the engine ends them.
    exhausted: set[str] = field(default_factory=set)
    # Sequences whose sampling raised, with what went wrong: the engine fails their requests.
    failed: dict[str, str] = field(default_factory=dict)
    # Of those, the ones whose own grammar failed (a constraint too complex for the grammar engine):
    # the request's input is at fault, not the engine.
    failed_by_grammar: set[str] = field(default_factory=set)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        device: str | torch.device = "cpu",
        groups: LayerGroups | None = None,
    ) -> None:
        c = model.config
        self.model = model
        # Layer groups (core/layer_groups.py): one cache tensor per place in a group, each layer using
        # its place's tensor through its group's block table.  Default: one group of every layer.
        self.groups = groups or group_layers(c.layer_windows, window_freeing=False)
        self.tp = model.tp
        self.block_size = block_size
        self.device = torch.device(device)
        # One block more than the pool hands out: rows that pad a decode graph's batch write their
        # K/V there, and freed or unused table entries name it; no request ever reads it.
        self.padding_block = num_blocks
        cache_blocks = num_blocks + 1
        # Left uninitialized: pages are committed as blocks are first used, and attention
        # never lets a slot outside a request's context reach its output, NaN included
        # (tests/test_attention.py::test_slots_outside_every_context_never_reach_the_output).
        # Under tensor parallelism: this rank's KV heads, the same number of blocks on every rank.
        kv_heads = model.shard.num_kv_heads
        self.kv_caches = [
            torch.empty(2, cache_blocks, block_size, kv_heads, c.head_dim, dtype=dtype, device=self.device)
            for _ in range(self.groups.group_size)
        ]
        self.layer_caches = [self.kv_caches[slot] for slot in self.groups.layer_slot]
        self.sampler = Sampler(seed, self.device, model.ops.kernels)
        self.graphs = None  # DecodeGraphs, once captured (CUDA, enforce_eager off)
        self.generators: dict[str, torch.Generator] = {}
        self.structured: StructuredOutputs | None = None  # set by the engine (rank 0 samples)
        self.encoder = StepEncoder() if self.tp.size > 1 else None
        self.step_message_bytes = 0  # total bytes of step messages broadcast (rank 0, tensor parallel)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.numel() * cache.element_size() for cache in self.kv_caches)

    def prepare(self, chunks: Sequence[Chunk]) -> StepTensors:
        bs, num_groups = self.block_size, self.groups.num_groups
        lens = [c.num_new_tokens for c in chunks]
        query_start_loc = [0, *np.cumsum(lens).tolist()]
        num_tokens, num_requests = query_start_loc[-1], len(chunks)
        max_blocks = max(len(c.block_table) for c in chunks) // num_groups
        seq_lens = [c.start + c.num_new_tokens for c in chunks]
        # Forks sample from the same last-position logits as the request they fork from.
        rows = [query_start_loc[i + 1] - 1 for i, c in enumerate(chunks) for _ in range(c.num_samples)]
        # One int64 buffer: ids, positions, each group's slots | sampled rows | query starts, seq lens |
        # each group's block tables.
        sizes = (num_tokens, num_tokens, num_groups * num_tokens, len(rows), num_requests + 1, num_requests)
        table_size = num_groups * num_requests * max_blocks
        buffer = np.zeros(sum(sizes) + table_size, dtype=np.int64)
        ids, positions, slots, logits_rows, starts, lengths, tables = np.split(buffer, np.cumsum(sizes))
        ids[:] = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=num_tokens)
        positions[:] = np.concatenate([np.arange(c.start, c.start + c.num_new_tokens) for c in chunks])
        tables = tables.reshape(num_groups, num_requests, max_blocks)
        tables[:] = group_block_tables([c.block_table for c in chunks], num_groups, max_blocks, self.padding_block)
        owner = np.repeat(np.arange(num_requests), lens)
        slots.reshape(num_groups, num_tokens)[:] = tables[:, owner, positions // bs] * bs + positions % bs
        logits_rows[:] = rows
        starts[:] = query_start_loc
        lengths[:] = seq_lens
        flat = self.to_device(torch.from_numpy(buffer))
        ids_t, positions_t, slots_t, rows_t, starts_t, lengths_t, tables_t = torch.split(flat, [*sizes, table_size])
        slots_t = slots_t.view(num_groups, num_tokens)
        tables_t = tables_t.view(num_groups, num_requests, max_blocks)
        metas = [
            build_attention_metadata(slots_t[g], query_start_loc, seq_lens, tables_t[g], starts_t, lengths_t)
            for g in range(num_groups)
        ]
        rope_lengths = None
        if self.model.rotary.length_dependent:
            prompt_lens = np.repeat([c.num_prompt_tokens for c in chunks], lens)
            rope_lengths = self.to_device(torch.from_numpy(np.maximum(positions + 1, prompt_lens)))
        return StepTensors(ids_t, positions_t, [metas[g] for g in self.groups.layer_group], rows_t, rope_lengths)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on the runner's device: staged in pinned memory and copied without waiting on CUDA
        (the caching host allocator keeps the pinned block until the copy has run)."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: fill each fresh block with its shared source, in every layer, before the step writes."""
        if not copies:
            return
        pairs = self.to_device(torch.tensor(copies, dtype=torch.int64))
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in self.kv_caches:  # one gather-scatter per layer for all the step's copies
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
        return self.sample(logits, requests)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        """One token per row, the whole batch at once; when that raises, row by row, so that a fault
        (a request's settings, its grammar, its history) ends only the requests whose rows raise."""
        try:
            return self._sample_rows(logits, requests)
        except StructuredOutputError:
            pass  # one sequence's grammar: found again and ended below, row by row
        except Exception:
            logger.warning("batched sampling failed; sampling the %d rows one by one", len(requests), exc_info=True)
        result = ModelRunnerOutput({}, {})
        for row, request in enumerate(requests):
            try:
                one = self._sample_rows(logits[row : row + 1], [request])
            except StructuredOutputError as error:
                logger.warning("structured output failed: %s", error)
                result.failed[request.request_id] = f"structured output failed: {error}"
                result.failed_by_grammar.add(request.request_id)
                continue
            except Exception as error:
                logger.exception("sampling failed for %s", request.request_id)
                result.failed[request.request_id] = f"sampling failed: {error!r}"
                continue
            result.sampled.update(one.sampled)
            result.logprobs.update(one.logprobs)
            result.exhausted.update(one.exhausted)
            result.failed.update(one.failed)
            result.failed_by_grammar.update(one.failed_by_grammar)
        return result

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
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
        output = ModelRunnerOutput({}, {})
        for rid, token, lp in zip(ids, result.token_ids, result.logprobs):
            if token is None:
                output.exhausted.add(rid)
                continue
            output.sampled[rid] = token
            if lp is not None:
                output.logprobs[rid] = lp
        if constrain is not None:
            for rid, token in output.sampled.items():
                try:
                    self.structured.accept(rid, token)
                except Exception as error:  # this sequence's grammar alone
                    logger.warning("structured output failed: %s", error)
                    output.failed[rid] = f"structured output failed: {error}"
                    output.failed_by_grammar.add(rid)
            for rid in output.failed:
                del output.sampled[rid]
        return output

    def run(self, chunks: Sequence[Chunk], block_copies: Sequence[tuple[int, int]]) -> torch.Tensor | None:
        """Every rank's part of a step: copy-on-write copies, the forward pass, the logits of the
        sampled rows; None where nothing samples, and on ranks other than 0."""
        self.copy_blocks(block_copies)
        if self.graphs is not None:
            logits = self.graphs.run(chunks)
            if logits is not None:  # a decode-only step that a captured graph covers
                return logits
        step = self.prepare(chunks)
        hidden = self.model(step.input_ids, step.positions, self.layer_caches, step.meta, step.rope_lengths)
        if not step.logits_rows.numel():
            return None
        return self.model.compute_logits(hidden.index_select(0, step.logits_rows))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = self.generators[request_id] = torch.Generator(self.device).manual_seed(seed)
        return generator

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's generator (and, tensor parallel, the workers' copy of its table)."""
        self.generators.pop(request_id, None)
        if self.structured is not None:
            self.structured.release(request_id)
        if self.encoder is not None:
            self.encoder.release(request_id)
