"""CUDA graphs for decode-only steps.

A decode step of a small model launches a few hundred small kernels (per layer:
norms, projections, rotary, the cache write, attention, the MLP); on a GPU the
launches, not the math, set its time.  A CUDA graph records them once and
replays them with one launch.  A graph's shapes are fixed, so graphs are
captured for a ladder of batch sizes (`graph_batch_sizes`) and a step of n
decodes replays the smallest captured size >= n (`padded_batch_size`), its
spare rows padded: token 0 at position 0, context length 0 (the attention
kernel reads no key for them), and their K/V written to the runner's padding
slot, a block past the ones the pool hands out.

Every input of a graph lives in one device buffer at fixed offsets: per step the
runner fills a host buffer of the same layout and copies it over in one
non-blocking copy, then replays.  Prefill chunks and mixed steps run eagerly;
so does a decode step larger than the largest graph.  The graphs share one
memory pool (captured largest first, so the smaller ones reuse its memory).

The ladder and padding arithmetic is plain Python (tested without a GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.step_message import Chunk
from pagedllm.layers.attention_metadata import build_attention_metadata, group_block_tables

logger = logging.getLogger("pagedllm")

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, largest: int = MAX_GRAPH_BATCH) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to min(max_num_seqs, largest), that bound rounded up to
    a multiple of 16 (or itself, below 8): a step of more than 8 decodes pads at most 15 rows."""
    top = min(max_num_seqs, largest)
    if top < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4, 8) if b <= top]
    if top > 8:
        sizes.extend(range(16, -(-top // 16) * 16 + 1, 16))
    elif sizes[-1] < top:  # 3, 5, 6 or 7
        sizes.append(top)
    return sizes


def padded_batch_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `batch` decodes; None when none does (run eagerly)."""
    for size in sizes:
        if size >= batch:
            return size
    return None


@dataclass
class GraphLayout:
    """Where each input of a graph of `batch` rows sits in the shared buffer (int64 offsets), with
    `groups` layer groups (core/layer_groups.py), each with its own slots and block tables."""

    batch: int
    max_blocks: int
    groups: int = 1

    @property
    def size(self) -> int:
        return (3 + self.groups) * self.batch + self.groups * self.batch * self.max_blocks

    def split(self, flat):
        """(ids, positions, seq_lens, slots [groups, batch], block_tables [groups, batch, max_blocks])
        as views of `flat` (a tensor or an array)."""
        b, g = self.batch, self.groups
        ids, positions, seq_lens = (flat[i * b : (i + 1) * b] for i in range(3))
        slots = flat[3 * b : (3 + g) * b].reshape(g, b)
        tables = flat[(3 + g) * b : self.size].reshape(g, b, self.max_blocks)
        return ids, positions, seq_lens, slots, tables

    def fill(self, host: np.ndarray, chunks: Sequence[Chunk], block_size: int, padding_block: int) -> None:
        """Write a decode step's inputs for `chunks` (at most `batch` of them) into `host`, padded;
        freed (-1) and unused table entries name the padding block."""
        ids, positions, seq_lens, slots, tables = self.split(host)
        n = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        ids[:n] = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        positions[:n] = starts
        seq_lens[:n] = starts + 1
        ids[n:] = positions[n:] = seq_lens[n:] = 0  # padding rows: no context, so no key is read
        tables[:, :n] = group_block_tables([c.block_table for c in chunks], self.groups, self.max_blocks, padding_block)
        tables[:, n:] = padding_block
        slots[:, :n] = tables[:, np.arange(n), starts // block_size] * block_size + starts % block_size
        slots[:, n:] = padding_block * block_size


class CudaGraphCapture:
    """Records a function as a CUDA graph (after a warm-up run on a side stream, as torch asks);
    every graph shares one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # Triton compiles, the allocator settles
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out

    def memory_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def pinned(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64).pin_memory()

    def event(self):
        return torch.cuda.Event()


class EagerCapture:
    """Stands in for CUDA graph capture where there is no GPU (the tests): "replay" runs the
    function again into the captured output, so the padding and buffer logic is exercised."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()

        @torch.inference_mode()
        def replay() -> None:
            out.copy_(fn())

        return replay, out

    def memory_allocated(self) -> int:
        return 0

    def pinned(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64)

    def event(self):
        return _DoneEvent()


class _DoneEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DecodeGraphs:
    """The captured decode graphs of one model runner; `run` replays one for a decode-only step.
    Only the Triton attention kernel runs under them: it reads the lengths from the graph's
    input tensors, where the CPU kernels read Python lists fixed at capture."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture=None) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.num_groups = runner.groups.num_groups
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = runner.device
        self.capturer = capture or CudaGraphCapture(device)
        largest = GraphLayout(self.sizes[-1], self.max_blocks, self.num_groups)
        self.flat = torch.zeros(largest.size, dtype=torch.int64, device=device)
        self.host = self.capturer.pinned(largest.size)
        self.copied = self.capturer.event()  # the last copy out of `host` (refilled only after it ran)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays = 0  # decode steps a graph ran (the rest ran eagerly)
        self.pool_bytes = 0
        self._capture()

    def _forward(self, layout: GraphLayout) -> torch.Tensor:
        b = layout.batch
        ids, positions, seq_lens, slots, tables = layout.split(self.flat)
        starts = self._starts[b]
        metas = [
            build_attention_metadata(slots[g], list(range(b + 1)), [1] * b, tables[g], starts, seq_lens)
            for g in range(layout.groups)
        ]
        runner = self.runner
        hidden = runner.model(ids, positions, runner.layer_caches, [metas[g] for g in runner.groups.layer_group])
        return runner.model.compute_logits(hidden)

    def _capture(self) -> None:
        began = time.monotonic()
        device = self.runner.device
        before = self.capturer.memory_allocated()
        self._starts = {b: torch.arange(b + 1, dtype=torch.int64, device=device) for b in self.sizes}
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            layout = GraphLayout(b, self.max_blocks, self.num_groups)
            layout.fill(self.host.numpy()[: layout.size], [], self.block_size, self.runner.padding_block)
            self.flat[: layout.size].copy_(self.host[: layout.size])
            self.graphs[b] = self.capturer.capture(lambda layout=layout: self._forward(layout))
        self.pool_bytes = self.capturer.memory_allocated() - before
        logger.info(
            "captured %d CUDA graphs for decode batches %s in %.1f s (%.0f MiB)",
            len(self.sizes),
            _ranges(self.sizes),
            time.monotonic() - began,
            self.pool_bytes / 2**20,
        )

    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor | None:
        """The sampled rows' logits of a decode-only step, by graph replay; None when the step has a
        prefill chunk, is larger than every graph, or has a block table longer than the graphs'."""
        if not chunks or any(c.num_new_tokens != 1 or c.num_samples == 0 for c in chunks):
            return None
        size = padded_batch_size(len(chunks), self.sizes)
        if size is None or any(len(c.block_table) > self.max_blocks * self.num_groups for c in chunks):
            return None
        layout = GraphLayout(size, self.max_blocks, self.num_groups)
        self.copied.synchronize()  # normally long done: the last step's sampled ids were read since
        layout.fill(self.host.numpy()[: layout.size], chunks, self.block_size, self.runner.padding_block)
        self.flat[: layout.size].copy_(self.host[: layout.size], non_blocking=True)
        self.copied.record()
        replay, logits = self.graphs[size]
        replay()
        self.replays += 1
        counts = [c.num_samples for c in chunks]
        if all(n == 1 for n in counts):
            return logits[: len(chunks)]
        rows = [i for i, n in enumerate(counts) for _ in range(n)]  # forks share their request's row
        return logits.index_select(0, self.runner.to_device(torch.tensor(rows, dtype=torch.int64)))


def _ranges(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes) if len(sizes) <= 8 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
