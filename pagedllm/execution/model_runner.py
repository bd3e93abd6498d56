"""Turns a scheduler output into tensors, runs the model, samples.

The runner owns the KV cache tensors (one per layer); it makes no scheduling
decisions.  A chunk with draft tokens (speculative decoding) runs as one decode
row per position (`VerifyRow`), and each row is sampled as if the drafts before
it were accepted (`SampleRow`); the drafts are kept while they equal the
sampled tokens.  Under tensor
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
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.core.layer_groups import LayerGroups, group_layers
from pagedllm.core.request import Request
from pagedllm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedllm.core.step_message import Chunk, StepEncoder
from pagedllm.execution.logits_processors import TokenHistory
from pagedllm.execution.lora_adapters import LoraAdapters
from pagedllm.execution.memory_commit import commit_in_background
from pagedllm.execution.sampler import Sampler, argmax_only, token_seed
from pagedllm.execution.structured_output import StructuredOutputError, StructuredOutputs
from pagedllm.layers.attention_metadata import AttentionMetadata, build_attention_metadata, group_block_tables
from pagedllm.layers.output_buffers import OutputBuffers
from pagedllm.models.llama import LlamaModel

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.execution.rank_model import RankModel

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
    # Per sequence, the tokens it emits this step: one, or with draft tokens the accepted drafts
    # and the model's token after them.
    sampled: dict[str, list[int]]
    # Per sequence that asked, one (logprob of the token, [(token id, logprob)] top alternatives) per emitted token.
    logprobs: dict[str, list[tuple[float, list[tuple[int, float]]]]]
    # Sequences whose row allowed no token at all (every token masked): the engine ends them.
    exhausted: set[str] = field(default_factory=set)
    # Sequences whose sampling raised, with what went wrong: the engine fails their requests.
    failed: dict[str, str] = field(default_factory=dict)
    # Of those, the ones whose own grammar failed (a constraint too complex for the grammar engine):
    # the request's input is at fault, not the engine.
    failed_by_grammar: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class SampleRow:
    """One row of logits to sample: a sequence's next token after its tokens and `drafts_before`
    (the draft tokens before this position, taken as accepted)."""

    request: Request
    drafts_before: list[int]
    draft: int | None  # the draft token at this position (None: the last row, or no drafts)


@dataclass(frozen=True)
class VerifyRow:
    """One position of a chunk with draft tokens, run as a one-token decode row: attention of the
    token at `start` over every slot before it, which the rows before it write in the same layer
    pass (each layer writes all the step's K/V before any attention reads it).  So a chunk with k
    drafts is k + 1 decode rows sharing one block table, and takes the decode kernels, the fused
    one-call step and CUDA graphs alike."""

    start: int
    token_ids: list[int]
    block_table: list[int]
    num_prompt_tokens: int
    num_samples: int = 1
    draft_index: int = 0  # 0: the request's pending token; j: its j-th draft
    adapter: str | None = None  # speculation runs no adapters

    @property
    def num_new_tokens(self) -> int:
        return 1


def model_chunks(scheduled: Sequence[ScheduledRequest]) -> list[tuple[str, Chunk]]:
    """The chunks the model runs, by sequence id: chunks with draft tokens as one row per position."""
    chunks: list[tuple[str, Chunk]] = []
    for c in scheduled:
        if not c.draft_token_ids:
            chunks.append((c.request.request_id, c))
            continue
        for j, token in enumerate(c.token_ids):
            row = VerifyRow(c.start + j, [token], c.block_table, c.num_prompt_tokens, draft_index=j)
            chunks.append((c.request.request_id, row))
    return chunks


def sample_rows(scheduled: Sequence[ScheduledRequest]) -> list[SampleRow]:
    rows = []
    for c in scheduled:
        if not c.samples:
            continue
        if c.draft_token_ids:
            drafts = c.draft_token_ids
            rows += [
                SampleRow(c.request, drafts[:j], drafts[j] if j < len(drafts) else None) for j in range(len(drafts) + 1)
            ]
        else:
            rows += [SampleRow(r, [], None) for r in (c.request, *c.forks)]
    return rows


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        seed: int = 0,
        device: str | torch.device = "cpu",
        groups: LayerGroups | None = None,
        commit_cache: bool = False,
    ) -> None:
        c = model.config
        self.model = model
        self.head_buffers = OutputBuffers()
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
        # Attention never lets a slot outside a request's context reach its output, NaN included
        # (tests/test_attention.py::test_slots_outside_every_context_never_reach_the_output), so the
        # values are never read before written.  `commit_cache` has the OS back a CPU cache's pages
        # in the background: left to the first write of each block, that page fault (and in a VM,
        # the host's) fell inside the steps, up to a quarter of a prompt step's time.
        # Under tensor parallelism: this rank's KV heads, the same number of blocks on every rank.
        kv_heads = model.shard.num_kv_heads
        self.kv_caches = [
            torch.empty(2, cache_blocks, block_size, kv_heads, c.head_dim, dtype=kv_dtype, device=self.device)
            for _ in range(self.groups.group_size)
        ]
        self.commit_thread = None  # backs the cache's pages without writing them (execution/memory_commit.py)
        if commit_cache and self.device.type == "cpu":
            self.commit_thread = commit_in_background(self.kv_caches, "KV cache")
        self.layer_caches = [self.kv_caches[slot] for slot in self.groups.layer_slot]
        self.sampler = Sampler(seed, self.device, model.ops.kernels)
        self.graphs = None  # DecodeGraphs, once captured (CUDA, enforce_eager off)
        self.structured: StructuredOutputs | None = None  # set by the engine (rank 0 samples)
        self.encoder = StepEncoder() if self.tp.size > 1 else None
        self.step_message_bytes = 0  # total bytes of step messages broadcast (rank 0, tensor parallel)
        self.adapters: LoraAdapters | None = None  # LoRA adapters, set by the engine where it allows them

    @classmethod
    def for_rank(cls, built: RankModel, config: EngineConfig) -> ModelRunner:
        """The runner of a rank's model as build_rank_model made it, with the engine's settings."""
        return cls(
            built.model,
            built.num_blocks,
            config.block_size,
            built.kv_dtype,
            config.seed,
            built.device,
            built.groups,
            commit_cache=config.commit_kv_cache,
        )

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
        draft_rows = sum(1 for c in chunks if isinstance(c, VerifyRow) and c.draft_index > 0)
        metas = [
            build_attention_metadata(
                slots_t[g], query_start_loc, seq_lens, tables_t[g], starts_t, lengths_t, draft_rows
            )
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
            raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache  # no float8 index_put
            raw[:, dst] = raw[:, src]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run a scheduled step (on rank 0 under tensor parallelism) and sample."""
        chunks = model_chunks(output.scheduled)
        if self.encoder is not None:
            message = self.encoder.encode(chunks, output.block_copies)
            self.tp.broadcast_ints(message)
            self.step_message_bytes += 8 + 4 * len(message)  # the length, then the int32 payload
        rows = sample_rows(output.scheduled)
        logits = self.run([c for _, c in chunks], output.block_copies, float32=not self.argmax_only(rows))
        if logits is None:
            return ModelRunnerOutput({}, {})
        return self.sample(logits, rows)

    def argmax_only(self, rows: list[SampleRow]) -> bool:
        """Whether the step's sampling takes only each row's argmax of the raw logits (greedy, no
        logprobs, penalties, bias or grammar), which the sampler reads in the model's dtype."""
        if self.structured is not None and self.structured.matchers:
            return False
        return argmax_only([row.request.sampling_params for row in rows])

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> ModelRunnerOutput:
        """One token per row, the whole batch at once; when that raises, sequence by sequence, so that
        a fault (a request's settings, its grammar, its history) ends only the requests whose rows raise."""
        try:
            return self._sample_rows(logits, rows)
        except StructuredOutputError:
            pass  # one sequence's grammar: found again and ended below, alone
        except Exception:
            logger.warning("batched sampling failed; sampling the %d rows one by one", len(rows), exc_info=True)
        result = ModelRunnerOutput({}, {})
        start = 0
        while start < len(rows):  # a sequence's rows (several with drafts) are consecutive
            end = start + 1
            while end < len(rows) and rows[end].request is rows[start].request:
                end += 1
            request_id = rows[start].request.request_id
            try:
                one = self._sample_rows(logits[start:end], rows[start:end])
            except StructuredOutputError as error:
                logger.warning("structured output failed: %s", error)
                result.failed[request_id] = f"structured output failed: {error}"
                result.failed_by_grammar.add(request_id)
            except Exception as error:
                logger.exception("sampling failed for %s", request_id)
                result.failed[request_id] = f"sampling failed: {error!r}"
            else:
                result.sampled.update(one.sampled)
                result.logprobs.update(one.logprobs)
                result.exhausted.update(one.exhausted)
                result.failed.update(one.failed)
                result.failed_by_grammar.update(one.failed_by_grammar)
            start = end
        return result

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow]) -> ModelRunnerOutput:
        params = [row.request.sampling_params for row in rows]
        seeds = [
            None if p.seed is None else token_seed(p.seed, row.request.num_output_tokens + len(row.drafts_before))
            for p, row in zip(params, rows)
        ]
        histories = None
        if any(p.processes_logits for p in params):
            histories = [
                TokenHistory(r.prompt_token_ids, r.output_token_ids + row.drafts_before, r.eos_token_id)
                for row in rows
                for r in (row.request,)
            ]
        ids = [row.request.request_id for row in rows]
        constrain = None
        if self.structured is not None and self.structured.matchers:
            structured = self.structured
            prefixes = [row.drafts_before for row in rows]

            def constrain(logits: torch.Tensor) -> torch.Tensor:
                return structured.apply_masks(logits, ids, prefixes)

        result = self.sampler(logits, params, seeds, histories, constrain)
        output = ModelRunnerOutput({}, {})
        done: set[str] = set()  # sequences whose rows after this one are not reached
        for row, rid, token, lp in zip(rows, ids, result.token_ids, result.logprobs):
            if rid in done:
                continue
            if token is None:  # no token allowed: after accepted drafts, they stand and the step ends there
                if not row.drafts_before:
                    output.exhausted.add(rid)
                done.add(rid)
                continue
            output.sampled.setdefault(rid, []).append(token)
            if lp is not None:
                output.logprobs.setdefault(rid, []).append(lp)
            if row.draft is None or token != row.draft:  # the last row, or a rejected draft
                done.add(rid)
        if constrain is not None:
            for rid, tokens in output.sampled.items():
                try:
                    for token in tokens:
                        self.structured.accept(rid, token)
                except Exception as error:  # this sequence's grammar alone
                    logger.warning("structured output failed: %s", error)
                    output.failed[rid] = f"structured output failed: {error}"
                    output.failed_by_grammar.add(rid)
            for rid in output.failed:
                del output.sampled[rid]
                output.logprobs.pop(rid, None)
        return output

    def run(
        self, chunks: Sequence[Chunk], block_copies: Sequence[tuple[int, int]], float32: bool = True
    ) -> torch.Tensor | None:
        """Every rank's part of a step: copy-on-write copies, the forward pass, the logits of the
        sampled rows; None where nothing samples, and on ranks other than 0.  `float32=False`:
        the logits may stay in the model's dtype (see `compute_logits`)."""
        self.copy_blocks(block_copies)
        lora = self.adapters.for_step(chunks) if self.adapters is not None else None
        if self.graphs is not None and lora is None:
            logits = self.graphs.run(chunks)
            if logits is not None:  # a decode-only step that a captured graph covers
                return logits
        step = self.prepare(chunks)
        hidden = self.model(step.input_ids, step.positions, self.layer_caches, step.meta, step.rope_lengths, lora)
        if not step.logits_rows.numel():
            return None
        # The logits are sampled before the next step runs, so the head's outputs can reuse buffers.
        return self.model.compute_logits(hidden.index_select(0, step.logits_rows), self.head_buffers, float32)

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's grammar matcher (and, tensor parallel, the workers' copy of its table)."""
        if self.structured is not None:
            self.structured.release(request_id)
        if self.encoder is not None:
            self.encoder.release(request_id)
