"""Output tensors reused from step to step for the LM head.

The LM head's outputs are a step's largest tensors: [sampled rows, vocabulary] in the model's
dtype, then in float32 for the sampler (Gemma 3 at 160 rows: 84 MB and 168 MB).  A fresh
tensor that large is mapped afresh by the allocator (glibc maps every allocation past 32 MB on
its own and unmaps it when freed), so every step paid its page faults again: 84 ms for the
float32 copy of Gemma 3's 160 rows against 26 ms into a tensor reused (measured on a 2-core
Xeon VM).  Only the model runner passes these to `compute_logits`, because it consumes each
step's logits before the next step: the tensors returned are views that the next call
overwrites.
"""

from __future__ import annotations

import torch


class OutputBuffers:
    """Named 2-D tensors, each kept at the most rows asked of it so far."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A [rows, cols] view of the buffer `name`, which holds whatever the last user left there."""
        tensor = self._tensors.get(name)
        if tensor is None or tensor.shape[0] < rows or tensor.shape[1] != cols or tensor.dtype != dtype:
            tensor = torch.empty(rows, cols, dtype=dtype)
            self._tensors[name] = tensor
        return tensor[:rows]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
