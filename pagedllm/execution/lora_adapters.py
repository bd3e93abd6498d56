"""The LoRA adapters an engine has loaded, by name, and each step's rows by adapter.

Every load gets a key of its own (`NAME#N`), which requests carry: an adapter unloaded and loaded
again under the same name from another file is another key, so the prefix cache (salted by the
key) never hands one adapter's KV blocks to the other."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedllm.core.step_message import Chunk
from pagedllm.layers.lora import KernelTable, LoraKernel, LoraStack, LoraStep, LoraWeights
from pagedllm.models.config import ModelConfig
from pagedllm.models.lora_files import projection_shapes, read_peft_adapter

MAX_STACKS = 4  # stacked sets kept: a steady decode batch reuses its one
ADAPTER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


class LoraAdapters:
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
        kernel: LoraKernel | None = None,
    ) -> None:
        """`kernel`: the C++ kernels, where the model runs on them (and they have `lora_add` for the dtype)."""
        if kernel is not None and not kernel.lora_add_available.get(dtype, False):
            kernel = None
        self.config, self.dtype, self.device, self.kernel = config, dtype, device, kernel
        self.max_loras, self.max_rank = max_loras, max_rank
        self.by_name: dict[str, LoraWeights] = {}
        self.paths: dict[str, Path] = {}
        self.by_key: dict[str, LoraWeights] = {}
        self._serial = itertools.count(1)
        self._stacks: dict[tuple[str, ...], LoraStack] = {}  # the sets of adapters steps ran together
        self._tables: dict[tuple[str, ...], KernelTable] = {}  # the same, for the C++ kernel

    def table_of(self, adapters: list[LoraWeights]) -> KernelTable:
        """The adapters' KernelTable, kept for the next steps with the same set."""
        keys = tuple(a.key for a in adapters)
        table = self._tables.get(keys)
        if table is None:
            if len(self._tables) >= MAX_STACKS:
                del self._tables[next(iter(self._tables))]
            table = self._tables[keys] = KernelTable.build(adapters)
        return table

    def stack_of(self, adapters: list[LoraWeights]) -> LoraStack:
        """The adapters stacked for a batched step, kept for the next steps with the same set."""
        keys = tuple(a.key for a in adapters)
        stack = self._stacks.get(keys)
        if stack is None:
            if len(self._stacks) >= MAX_STACKS:  # the oldest set goes
                del self._stacks[next(iter(self._stacks))]
            stack = self._stacks[keys] = LoraStack.build(adapters)
        return stack

    def load(self, name: str, path: str | Path) -> str:
        """Read, check and keep the PEFT adapter at `path` as `name`; its key."""
        if not name or len(name) > 128 or not set(name) <= ADAPTER_NAME_CHARS:
            raise ValueError(f"adapter name {name!r:.140} must be 1-128 letters, digits or - _ . : /")
        if name in self.by_name:
            raise ValueError(f"an adapter named {name!r} is loaded already (unload it first)")
        if len(self.by_name) >= self.max_loras:
            raise ValueError(f"{len(self.by_name)} adapters are loaded, the most max_loras={self.max_loras} allows")
        adapter = read_peft_adapter(path, self.config, self.max_rank)
        outs = {name: shape[0] for name, shape in projection_shapes(self.config).items()}
        key = f"{name}#{next(self._serial)}"
        weights = LoraWeights.build(key, adapter.layers, outs, self.dtype, self.device)
        if self.kernel is not None:
            weights = weights.pack(self.kernel.pack_panels)
        self.by_name[name], self.by_key[key], self.paths[name] = weights, weights, adapter.path
        return key

    def unload(self, name: str) -> None:
        weights = self.by_name.pop(name, None)
        if weights is None:
            raise KeyError(f"no adapter named {name!r} is loaded")
        del self.by_key[weights.key], self.paths[name]
        self._stacks = {keys: s for keys, s in self._stacks.items() if weights.key not in keys}
        self._tables = {keys: t for keys, t in self._tables.items() if weights.key not in keys}

    def key_of(self, name: str) -> str:
        weights = self.by_name.get(name)
        if weights is None:
            known = ", ".join(sorted(self.by_name)) or "none is loaded"
            raise KeyError(f"no LoRA adapter named {name!r:.140} (loaded: {known})")
        return weights.key

    def describe(self) -> list[dict]:
        """Each loaded adapter: its name, where it came from, its bytes."""
        return [
            {"name": name, "path": str(self.paths[name]), "bytes": w.nbytes} for name, w in sorted(self.by_name.items())
        ]

    def for_step(self, chunks: Sequence[Chunk]) -> LoraStep | None:
        """Each of the step's token rows with its chunk's adapter; None where no chunk has one."""
        if not any(c.adapter for c in chunks):
            return None
        rows: list[LoraWeights | None] = []
        for c in chunks:
            rows += [self.by_key[c.adapter] if c.adapter else None] * c.num_new_tokens
        return LoraStep.for_rows(rows, self.stack_of, self.device, self.kernel, self.table_of)
