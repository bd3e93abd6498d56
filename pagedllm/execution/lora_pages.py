"""LoRA adapters' weights in the KV cache's own memory: a resident adapter holds a run of the
block pool's blocks (`KVCache.allocate_pages`), and its tensors are written where those blocks
lie in the cache tensors, so adapters and KV share one memory budget, counted in one unit.

Where the weights go: every cache tensor is [2 (K, V), blocks, block_size, kv_heads, head_dim],
so a run of n blocks is two contiguous spans in each of them (its K half and its V half).  Layer
l's tensors (its dense A and B, and B's parts packed for the C++ kernel) are written into the
spans of the tensor layer l's cache lives in; layers that share a cache tensor (layer groups)
share its spans.  Each tensor lies whole in one span, 64-byte aligned, in the first span with
room.  n is the smallest run in which every tensor of every layer fits.  Block ids in a run
never enter a request's block table (the pool holds them), so no KV write reaches them and no
attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedllm.core.kv_cache import KVCache
from pagedllm.layers.lora import LoraWeights

ALIGN = 64


@dataclass(frozen=True)
class PagedAdapter:
    weights: LoraWeights  # its tensors are views of the cache tensors
    first_block: int
    num_blocks: int


class LoraPages:
    def __init__(self, kv_cache: KVCache, caches: list[torch.Tensor], layer_slot: tuple[int, ...]) -> None:
        """`caches`: the model runner's cache tensors; `layer_slot`: per layer, which of them it uses."""
        self.kv, self.caches, self.layer_slot = kv_cache, caches, layer_slot
        self.span_bytes = caches[0][0, 0].numel() * caches[0].element_size()  # one block's K (or V) part

    @staticmethod
    def usable(kv_cache: KVCache, caches: list[torch.Tensor]) -> bool:
        """Whether adapters can live in this cache's pages (a paged layout whose block spans keep
        64-byte alignment)."""
        if not kv_cache.supports_pages or not caches:
            return False
        return (caches[0][0, 0].numel() * caches[0].element_size()) % ALIGN == 0

    def blocks_needed(self, weights: LoraWeights) -> int:
        sizes = self._sizes_by_slot(weights)
        total = max((sum(s) for s in sizes.values()), default=0)
        count = max(1, -(-total // (2 * self.span_bytes)))
        while self._plan(sizes, count) is None:
            count += 1
        return count

    def place(self, weights: LoraWeights) -> PagedAdapter | None:
        """`weights` copied into a run of pages; None where no run that long is free."""
        count = self.blocks_needed(weights)
        first = self.kv.allocate_pages(count)
        if first is None:
            return None
        spans = {
            slot: [self.caches[slot][half, first : first + count].reshape(-1).view(torch.uint8) for half in (0, 1)]
            for slot in set(self.layer_slot)
        }
        plan = self._plan(self._sizes_by_slot(weights), count)
        offsets = {slot: iter(places) for slot, places in plan.items()}

        def copy(tensor: torch.Tensor, slot: int) -> torch.Tensor:
            half, at = next(offsets[slot])
            nbytes = tensor.numel() * tensor.element_size()
            view = spans[slot][half][at : at + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            return view

        layers, packed = [], []
        for index, layer in enumerate(weights.layers):
            slot = self.layer_slot[index]
            layers.append({name: (copy(a, slot), copy(b, slot)) for name, (a, b) in layer.items()})
            if weights.packed:
                packed.append({name: (copy(b, slot), desc) for name, (b, desc) in weights.packed[index].items()})
        return PagedAdapter(replace(weights, layers=layers, packed=packed), first, count)

    def release(self, adapter: PagedAdapter) -> None:
        self.kv.free_pages(adapter.first_block)

    def _sizes_by_slot(self, weights: LoraWeights) -> dict[int, list[int]]:
        """Per cache tensor, the byte sizes of the tensors written there, in the order `place` writes them."""
        sizes: dict[int, list[int]] = {slot: [] for slot in set(self.layer_slot)}
        for index, layer in enumerate(weights.layers):
            tensors = [t for pair in layer.values() for t in pair]
            if weights.packed:
                tensors += [b for b, _ in weights.packed[index].values()]
            sizes[self.layer_slot[index]] += [t.numel() * t.element_size() for t in tensors]
        return sizes

    def _plan(self, sizes: dict[int, list[int]], count: int) -> dict[int, list[tuple[int, int]]] | None:
        """Per cache tensor, (half, byte offset) of each tensor in a run of `count` blocks: each in
        the first half (K, then V) with room left for it; None where one does not fit."""
        capacity = count * self.span_bytes
        plan: dict[int, list[tuple[int, int]]] = {}
        for slot, slot_sizes in sizes.items():
            used, places = [0, 0], []
            for size in slot_sizes:
                half = next((h for h in (0, 1) if used[h] + size <= capacity), None)
                if half is None:
                    return None
                places.append((half, used[half]))
                used[half] += -(-size // ALIGN) * ALIGN
            plan[slot] = places
        return plan
