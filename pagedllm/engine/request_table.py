"""Which request each live sequence belongs to: the one table intake writes and output
processing reads.  A request (`RequestGroup`) holds one sequence, n samples or a beam search's
live beams; each sequence is registered while it exists, and released from the model runner
(its grammar matcher, its token history) when it is unregistered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.core.request import Request
from pagedllm.core.request_group import RequestGroup


@dataclass
class RequestTable:
    release: Callable[[str], None]  # the runner's per-sequence state, dropped when a sequence goes
    groups: dict[str, RequestGroup] = field(default_factory=dict)  # by request id
    sequences: dict[str, Request] = field(default_factory=dict)  # by sequence id (a request's id when n=1)
    group_of: dict[str, RequestGroup] = field(default_factory=dict)  # sequence id -> its request

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for sequence in group.sequences:
            self.register(group, sequence)

    def register(self, group: RequestGroup, sequence: Request) -> None:
        self.sequences[sequence.request_id] = sequence
        self.group_of[sequence.request_id] = group

    def unregister(self, sequence: Request) -> None:
        del self.sequences[sequence.request_id], self.group_of[sequence.request_id]
        self.release(sequence.request_id)

    def forget(self, group: RequestGroup) -> None:
        """A finished request: it and its sequences leave the table."""
        del self.groups[group.request_id]
        for sequence in group.sequences:
            self.unregister(sequence)

    def in_use(self, request_id: str, sequence_ids: list[str]) -> bool:
        return request_id in self.groups or any(s in self.sequences for s in sequence_ids)
