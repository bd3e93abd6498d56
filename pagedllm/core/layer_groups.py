"""Layers grouped for the KV cache, so sliding-window layers can give blocks back.

Pure Python.  A block of the pool holds `group_size` layers' K/V for
`block_size` tokens.  Layers are cut into groups of that many layers, every
layer of a group with the same window (0: full attention), and each group
has its own entries in a request's block table.  A sliding group's entries
for blocks that every future query has left behind go back to the pool
while the request runs; a full group keeps all of its entries.

Gemma 3 270M (18 layers, window 512 on 15, full on 3): groups of 3 layers,
one full group and five sliding ones.  A model whose layers all share one
window (Mistral) is one sliding group; a model without windows, or with
`window_freeing` off, is one full group of every layer (the layout of a
model without windows: one block holds every layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int, ...]  # per group: its layers' window, 0 for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its place in the group (which cache tensor it uses)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group: the layers one block holds."""
        return len(self.layer_group) // len(self.windows)

    @property
    def frees_blocks(self) -> bool:
        return any(self.windows)

    def describe(self) -> str:
        if not self.frees_blocks:
            return f"one block holds all {self.group_size} layers"
        sliding = [w for w in self.windows if w]
        full = len(self.windows) - len(sliding)
        return (
            f"{self.num_groups} groups of {self.group_size} layers ({full} full, {len(sliding)} sliding "
            f"with window {', '.join(str(w) for w in sorted(set(sliding)))}: their blocks older than it are freed)"
        )


def group_layers(layer_windows: Sequence[int], window_freeing: bool = True) -> LayerGroups:
    """Groups of equal size, one window each, in the order the layers first show each window."""
    num_layers = len(layer_windows)
    if num_layers == 0:
        raise ValueError("a model needs at least one layer")
    if not window_freeing or not any(layer_windows):
        return LayerGroups((0,), (0,) * num_layers, tuple(range(num_layers)))
    kinds = list(dict.fromkeys(layer_windows))  # distinct windows, first appearance first
    members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = math.gcd(*(len(m) for m in members.values()))
    windows: list[int] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for w in kinds:
        for start in range(0, len(members[w]), size):
            for slot, layer in enumerate(members[w][start : start + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(w)
    return LayerGroups(tuple(windows), tuple(layer_group), tuple(layer_slot))
