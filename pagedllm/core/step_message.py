"""What rank 0 sends the other tensor-parallel ranks each step, as increments.

Pure Python.  Every rank runs the same model step, so every rank needs the
step's tokens, positions and block tables; only rank 0 has a scheduler.
Rank 0's `StepEncoder` keeps a mirror of the block table each worker holds
for each sequence and sends, per scheduled chunk, only how much of that
table is still right (`keep`) and the block ids that follow.  That one rule
covers every way a table changes: a new request (keep 0; prefix-cache hits
are just its first blocks), a decode that crosses into a new block (keep =
old length, one id), copy-on-write (keep stops before the replaced block), a
preempted request admitted again (keep = what survived, often 0), and a
forked sample's first step (keep 0).  A worker's `WorkerBlockTables` apply
the increments, so after each message its tables equal the scheduler's.

Wire format: one flat list of int32, `[kind, ...]`:

    STEP:  STEP, num_chunks, num_copies, num_released,
           per chunk: seq, start, num_new, num_samples, num_prompt, keep, num_appended, token ids...,
           block ids...,
           per copy: source, destination,
           released seq handles...
    SHUTDOWN

Sequences travel as small integer handles, not their string ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

STEP = 1
SHUTDOWN = 2


class Chunk(Protocol):
    """What the model runner needs of one request's share of a step (a `ScheduledRequest` is one)."""

    start: int
    num_new_tokens: int
    num_samples: int
    num_prompt_tokens: int  # the request's prompt length (a length-dependent RoPE reads it)

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def adapter(self) -> str | None: ...  # the key of the LoRA adapter it runs under

    @property
    def block_table(self) -> list[int]: ...


@dataclass
class ChunkPlan:
    """A chunk as a worker rebuilds it from the message."""

    seq: int
    start: int
    token_ids: list[int]
    block_table: list[int]
    num_samples: int
    num_prompt_tokens: int
    adapter: str | None = None  # tensor parallelism runs no adapters

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepPlan:
    """One step as every rank runs it: chunks in the scheduler's order and the copy-on-write copies."""

    chunks: list[ChunkPlan] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _WireChunk:
    seq: int
    start: int
    token_ids: list[int]
    num_samples: int
    num_prompt_tokens: int
    keep: int
    appended: list[int]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (append or nothing), compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class StepEncoder:
    """Rank 0's side: turns scheduled chunks into increment messages against its mirror of the workers' tables."""

    def __init__(self) -> None:
        self.handles: dict[str, int] = {}  # sequence id -> handle
        self.sent_tables: dict[int, list[int]] = {}  # handle -> the table every worker holds now
        self._next_handle = 0
        self._released: list[int] = []

    def handle(self, seq_id: str) -> int:
        handle = self.handles.get(seq_id)
        if handle is None:
            handle = self.handles[seq_id] = self._next_handle
            self._next_handle += 1
        return handle

    def release(self, seq_id: str) -> None:
        """The sequence is gone for good: the workers drop its table with the next message."""
        handle = self.handles.pop(seq_id, None)
        if handle is not None:
            self.sent_tables.pop(handle, None)
            self._released.append(handle)

    def encode(self, chunks: Iterable[tuple[str, Chunk]], block_copies: Sequence[tuple[int, int]]) -> array:
        """`chunks` are (sequence id, chunk) in the order the model runs them."""
        wire: list[_WireChunk] = []
        for seq_id, chunk in chunks:
            handle = self.handle(seq_id)
            table = chunk.block_table
            sent = self.sent_tables.get(handle, [])
            keep = _common_prefix(sent, table)
            wire.append(
                _WireChunk(
                    handle, chunk.start, chunk.token_ids, chunk.num_samples, chunk.num_prompt_tokens, keep, table[keep:]
                )
            )
            self.sent_tables[handle] = list(table)
        message = array("i", [STEP, len(wire), len(block_copies), len(self._released)])
        for c in wire:
            message.extend(
                (c.seq, c.start, len(c.token_ids), c.num_samples, c.num_prompt_tokens, c.keep, len(c.appended))
            )
            message.extend(c.token_ids)
            message.extend(c.appended)
        for source, destination in block_copies:
            message.extend((source, destination))
        message.extend(self._released)
        self._released = []
        return message


def shutdown_message() -> array:
    return array("i", [SHUTDOWN])


class WorkerBlockTables:
    """A worker's side: the block table of every live sequence, kept current from the messages."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def apply(self, message: Sequence[int]) -> StepPlan | None:
        """The step this message describes, with the tables updated; None for SHUTDOWN."""
        if not message:
            raise ValueError("empty step message")
        kind = message[0]
        if kind == SHUTDOWN:
            return None
        if kind != STEP:
            raise ValueError(f"unknown step message kind {kind}")
        num_chunks, num_copies, num_released = message[1], message[2], message[3]
        pos = 4
        plan = StepPlan()
        for _ in range(num_chunks):
            seq, start, num_new, num_samples, num_prompt, keep, num_appended = message[pos : pos + 7]
            pos += 7
            token_ids = list(message[pos : pos + num_new])
            pos += num_new
            table = self.tables.get(seq, [])
            if keep > len(table):
                raise ValueError(f"message keeps {keep} blocks of sequence {seq}, which has {len(table)}")
            table = self.tables[seq] = table[:keep] + list(message[pos : pos + num_appended])
            pos += num_appended
            plan.chunks.append(ChunkPlan(seq, start, token_ids, table, num_samples, num_prompt))
        for _ in range(num_copies):
            plan.block_copies.append((message[pos], message[pos + 1]))
            pos += 2
        for seq in message[pos : pos + num_released]:
            self.tables.pop(seq, None)
        pos += num_released
        if pos != len(message):
            raise ValueError(f"step message has {len(message)} ints but its header accounts for {pos}")
        return plan
