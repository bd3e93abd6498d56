"""The LoRA adapters an engine knows, by name: registered (checked, its file's path kept) and,
up to `max_loras` of them, resident (its weights in memory: in a run of the KV cache's own blocks
where the cache has pages, execution/lora_pages.py).  A request's adapter is made resident
when the scheduler admits it (`make_resident`), evicting the least recently used adapter that no
running request uses; with none to evict the request waits, as it waits for KV blocks.

Every registration gets a key, `NAME#DIGEST` (the digest of the adapter's files), which requests
carry: an adapter registered again under the same name from other contents is another key, so the
prefix cache (salted by the key) never hands one adapter's KV blocks to the other, while replicas
that loaded the same file under the same name agree on the key (the data-parallel router places
by it).  A file read again for residency must still have its digest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedllm.core.step_message import Chunk
from pagedllm.errors import ModelFileError
from pagedllm.execution.lora_pages import LoraPages, PagedAdapter
from pagedllm.layers.lora import KernelTable, LoraKernel, LoraStack, LoraStep, LoraWeights
from pagedllm.models.config import ModelConfig
from pagedllm.models.lora_files import adapter_digest, projection_shapes, read_adapter

MAX_STACKS = 4  # stacked sets kept: a steady decode batch reuses its one
MAX_REGISTERED = 4096  # adapters registered at once (each a path and a key; only max_loras resident)
ADAPTER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/")


@dataclass(frozen=True)
class Registered:
    key: str
    path: Path


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
        """`max_loras`: adapters resident at once; `kernel`: the C++ kernels, where the model runs
        on them (and they have `lora_add` for the dtype)."""
        if kernel is not None and not kernel.lora_add_available.get(dtype, False):
            kernel = None
        self.config, self.dtype, self.device, self.kernel = config, dtype, device, kernel
        self.max_loras, self.max_rank = max_loras, max_rank
        self.registered: dict[str, Registered] = {}
        self.resident: OrderedDict[str, LoraWeights] = OrderedDict()  # by key, least recently used first
        self.num_evictions = 0
        self._stacks: dict[tuple[str, ...], LoraStack] = {}  # the sets of adapters steps ran together
        self._tables: dict[tuple[str, ...], KernelTable] = {}  # the same, for the C++ kernel
        self.pages: LoraPages | None = None  # where resident adapters live in the KV cache's blocks
        self._paged: dict[str, PagedAdapter] = {}  # by key: each resident adapter's run of pages
        self._page_blocks: dict[str, int] = {}  # by key: the blocks each registered adapter's pages take

    def use_pages(self, pages: LoraPages) -> None:
        """From now on, resident adapters live in the KV cache's pages (execution/lora_pages.py)."""
        if self.resident:
            raise ValueError("pages are given before any adapter is resident")
        self.pages = pages

    def load(self, name: str, path: str | Path) -> str:
        """Register the adapter at `path` (PEFT directory or GGUF file) as `name` (read and checked whole now), resident
        while there is room; its key."""
        if not name or len(name) > 128 or not set(name) <= ADAPTER_NAME_CHARS:
            raise ValueError(f"adapter name {name!r:.140} must be 1-128 letters, digits or - _ . : /")
        if name in self.registered:
            raise ValueError(f"an adapter named {name!r} is loaded already (unload it first)")
        if len(self.registered) >= MAX_REGISTERED:
            raise ValueError(f"{MAX_REGISTERED} adapters are registered, the most this engine keeps")
        path = Path(path)
        weights = self._read(name, path)  # checked (regular files, sane sizes) before the digest reads them
        key = f"{name}#{adapter_digest(path)}"
        weights = replace(weights, key=key)
        if self.pages is not None:
            blocks = self.pages.blocks_needed(weights)
            if blocks > self.pages.kv.num_blocks:
                total = self.pages.kv.num_blocks
                raise ValueError(
                    f"LoRA adapter {name!r} needs {blocks} blocks of the KV cache for its pages; the cache has "
                    f"{total} (raise kv_cache_memory)"
                )
            self._page_blocks[key] = blocks
        self.registered[name] = Registered(key, path)
        if len(self.resident) < self.max_loras:
            self._store(key, weights, busy=None)  # where pages are short it stays registered only
        return key

    def _store(self, key: str, weights: LoraWeights, busy: set[str] | None) -> bool:
        """Make `weights` resident: into pages where the cache has them, evicting idle adapters
        (outside `busy`; None: evict none) until a run is free.  False: no room."""
        if self.pages is None:
            self.resident[key] = weights
            return True
        paged = self.pages.place(weights)
        while paged is None:
            idle = None if busy is None else next((k for k in self.resident if k not in busy), None)
            if idle is None:
                return False
            self._evict(idle)
            paged = self.pages.place(weights)
        self._paged[key] = paged
        self.resident[key] = paged.weights
        return True

    def blocks_of(self, key: str) -> int:
        """The KV cache blocks adapter `key`'s pages take while resident (0 without pages)."""
        return self._page_blocks.get(key, 0)

    def reclaim(self, blocks: int, busy: set[str]) -> int:
        """Evict idle resident adapters (outside `busy`), least recently used first, until their
        pages give back at least `blocks` blocks; the blocks given back."""
        freed = 0
        for key in [k for k in self.resident if k not in busy and k in self._paged]:
            if freed >= blocks:
                break
            freed += self._paged[key].num_blocks
            self._evict(key)
        return freed

    def _read(self, key: str, path: Path) -> LoraWeights:
        adapter = read_adapter(path, self.config, self.max_rank)
        outs = {name: shape[0] for name, shape in projection_shapes(self.config).items()}
        weights = LoraWeights.build(key, adapter.layers, outs, self.dtype, self.device)
        return weights.pack(self.kernel.pack_panels) if self.kernel is not None else weights

    def make_resident(self, key: str, busy: set[str]) -> bool:
        """Whether adapter `key` is resident, made so where it was not: read from its file again,
        in the place of the least recently used resident adapter outside `busy` (the keys running
        requests use).  False: every slot is busy; the request waits.  A file that fails its
        checks now raises (ModelFileError, OSError)."""
        if key in self.resident:
            self.resident.move_to_end(key)
            return True
        if len(self.resident) >= self.max_loras:
            idle = next((k for k in self.resident if k not in busy), None)
            if idle is None:
                return False
            self._evict(idle)
        registered = next(r for r in self.registered.values() if r.key == key)
        weights = self._read(key, registered.path)
        if f"{self.name_of(key)}#{adapter_digest(registered.path)}" != key:
            raise ModelFileError(registered.path, None, "changed on disk since the adapter was loaded; load it again")
        return self._store(key, weights, busy)

    def _evict(self, key: str) -> None:
        del self.resident[key]
        if key in self._paged:
            self.pages.release(self._paged.pop(key))
        self.num_evictions += 1
        self._stacks = {keys: s for keys, s in self._stacks.items() if key not in keys}
        self._tables = {keys: t for keys, t in self._tables.items() if key not in keys}

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

    def unload(self, name: str) -> None:
        registered = self.registered.pop(name, None)
        if registered is None:
            raise KeyError(f"no adapter named {name!r} is loaded")
        if registered.key in self.resident:
            self._evict(registered.key)
            self.num_evictions -= 1  # unloaded, not evicted
        self._page_blocks.pop(registered.key, None)

    def key_of(self, name: str) -> str:
        registered = self.registered.get(name)
        if registered is None:
            known = ", ".join(sorted(self.registered)[:20]) or "none is loaded"
            raise KeyError(f"no LoRA adapter named {name!r:.140} (loaded: {known})")
        return registered.key

    def name_of(self, key: str) -> str:
        return key.rsplit("#", 1)[0]

    def summary(self) -> dict:
        """How many adapters are registered and resident, their resident bytes, and evictions."""
        return {
            "registered": len(self.registered),
            "resident": len(self.resident),
            "max_loras": self.max_loras,
            "resident_bytes": sum(w.nbytes for w in self.resident.values()),
            "page_blocks": sum(p.num_blocks for p in self._paged.values()),
            "evictions": self.num_evictions,
        }

    def describe(self) -> list[dict]:
        """Each registered adapter: its name, key, where it came from, whether it is resident and its
        bytes there."""
        rows = []
        for name, r in sorted(self.registered.items()):
            weights = self.resident.get(r.key)
            rows.append({"name": name, "key": r.key, "path": str(r.path), "resident": weights is not None,
                         "bytes": weights.nbytes if weights is not None else 0})  # fmt: skip
        return rows

    def for_step(self, chunks: Sequence[Chunk]) -> LoraStep | None:
        """Each of the step's token rows with its chunk's adapter (resident: the scheduler admitted
        it so); None where no chunk has one."""
        if not any(c.adapter for c in chunks):
            return None
        rows: list[LoraWeights | None] = []
        for c in chunks:
            rows += [self.resident[c.adapter] if c.adapter else None] * c.num_new_tokens
        return LoraStep.for_rows(rows, self.stack_of, self.device, self.kernel, self.table_of)
