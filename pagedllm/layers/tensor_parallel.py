"""Tensor parallelism's collectives: this process's place in the group, and the all-reduce,
broadcast and gather the sharded layers call (no-ops at size 1).  Which slice of each weight a
rank holds is pagedllm/models/sharding.py."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (size 1: no group, collectives are no-ops)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_ints(self, message: array | None) -> list[int] | array:
        """Rank 0 sends `message` (int32) to every rank; the others pass None and get it back."""
        length = torch.empty(1, dtype=torch.int64)
        if self.rank == 0:
            length[0] = len(message)
            dist.broadcast(length, src=0)
            dist.broadcast(torch.frombuffer(message, dtype=torch.int32), src=0)
            return message
        dist.broadcast(length, src=0)
        payload = torch.empty(int(length[0]), dtype=torch.int32)
        dist.broadcast(payload, src=0)
        return payload.tolist()

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` side by side along the last dimension; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None
