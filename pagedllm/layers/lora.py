"""LoRA adapters in a step of mixed requests: the base projection runs once for every row, then
each adapter's rows get their low-rank update, `y[rows] += (x[rows] @ A.T) @ B.T` (shrink, then
expand), adapter by adapter.  No per-adapter step and no weights merged into the base.

The model's fused projections (q/k/v stacked as `qkv_proj`, gate/up as `gate_up_proj`) take an
adapter's parts stacked the same way: A's rows stacked ([sum of ranks, in]) and B block-diagonal
([sum of outs, sum of ranks]), so one shrink and one expand serve the fused output.  A part the
adapter does not target leaves its block of B zero."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The model's fused projections and the checkpoint projections they stack, in row order.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LoraWeights:
    """One resident adapter: per layer, per fused projection, (A [r', in], B [out, r']) in the
    model's dtype with the scale folded into B; a projection it leaves alone is absent."""

    key: str  # unique among every adapter the engine ever loaded (the prefix cache's salt)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def build(
        cls,
        key: str,
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        out_features: dict[str, int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LoraWeights:
        """From per-layer, per-checkpoint-projection (A, scaled B) in float32; `out_features` gives
        every checkpoint projection's output size, for the zero blocks of parts left alone."""
        fused_layers = []
        for parts in layers:
            fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for name, members in FUSED_PARTS.items():
                present = [m for m in members if m in parts]
                if not present:
                    continue
                a = torch.cat([parts[m][0] for m in present])
                b = torch.zeros(sum(out_features[m] for m in members), a.shape[0])
                row, col = 0, 0
                for m in members:
                    if m in parts:
                        part_b = parts[m][1]
                        b[row : row + part_b.shape[0], col : col + part_b.shape[1]] = part_b
                        col += part_b.shape[1]
                    row += out_features[m]
                fused[name] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
            fused_layers.append(fused)
        return cls(key, fused_layers)

    @property
    def nbytes(self) -> int:
        pairs = [pair for layer in self.layers for pair in layer.values()]
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)


@dataclass(frozen=True)
class LayerLora:
    """One layer's share of a step: each adapter in the step with the rows it owns (a slice where
    they are consecutive, else an index tensor)."""

    groups: list[tuple[slice | torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]]

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection `name` of `x`) with each adapter's update added to its rows, in place."""
        for rows, weights in self.groups:
            pair = weights.get(name)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                y[rows] += (x[rows] @ a.T) @ b.T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


@dataclass(frozen=True)
class LoraStep:
    """A step's adapters: which rows each owns, per layer."""

    groups: list[tuple[slice | torch.Tensor, LoraWeights]]

    @classmethod
    def for_rows(cls, row_adapters: list[LoraWeights | None], device: torch.device | str = "cpu") -> LoraStep | None:
        """From each row's adapter (None: the base model alone); None where no row has one."""
        rows_of: dict[int, list[int]] = {}
        weights_of: dict[int, LoraWeights] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                rows_of.setdefault(id(adapter), []).append(row)
                weights_of[id(adapter)] = adapter
        if not rows_of:
            return None
        groups: list[tuple[slice | torch.Tensor, LoraWeights]] = []
        for key, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((slice(rows[0], rows[-1] + 1), weights_of[key]))
            else:
                groups.append((torch.tensor(rows, dtype=torch.int64, device=device), weights_of[key]))
        return cls(groups)

    def layer(self, index: int) -> LayerLora:
        return LayerLora([(rows, weights.layers[index]) for rows, weights in self.groups])
