"""LoRA adapters in a step of mixed requests: the base projection runs once for every row, then
each adapter's rows get their low-rank update, `y[rows] += (x[rows] @ A.T) @ B.T` (shrink, then
expand), adapter by adapter.  No per-adapter step and no weights merged into the base.

The model's fused projections (q/k/v stacked as `qkv_proj`, gate/up as `gate_up_proj`) take an
adapter's parts stacked the same way: A's rows stacked ([sum of ranks, in]) and B block-diagonal
([sum of outs, sum of ranks]), so one shrink and one expand serve the fused output.  A part the
adapter does not target leaves its block of B zero."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

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

    key: str  # NAME#DIGEST of its files (the prefix cache's salt)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    # Per layer, per projection, each adapted part's (out offset, out size, rank offset, rank):
    # where its block lies in the stacked B (the rest of B is zeros).
    parts: list[dict[str, tuple[tuple[int, int, int, int], ...]]] = field(default_factory=list)
    # For the C++ kernel (`pack` below): per layer, per projection, (the parts' blocks of B packed
    # one after another, their layout as csrc/lora.cpp reads it); the kernel reads A from `layers`.
    packed: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def pack(self, pack_panels: Callable[[torch.Tensor], torch.Tensor]) -> LoraWeights:
        """A copy whose `packed` holds each part's block of B packed by `pack_panels` (the C++
        kernels' panels), its rank rounded up to even in bfloat16 (a zero column: the same
        update), and the int64 layout [R, parts, then per part: out offset, out size, rank
        offset, rank, packed rank, offset in the packed tensor]."""
        packed = []
        for layer, layer_parts in zip(self.layers, self.parts):
            entry = {}
            for name, (a, b) in layer.items():
                blocks, desc, offset = [], [a.shape[0], len(layer_parts[name])], 0
                for out_offset, out_size, rank_offset, rank in layer_parts[name]:
                    block = b[out_offset : out_offset + out_size, rank_offset : rank_offset + rank]
                    padded = rank + (rank % 2 if b.dtype == torch.bfloat16 else 0)
                    if padded != rank:
                        block = torch.cat([block, block.new_zeros(out_size, padded - rank)], 1)
                    blocks.append(pack_panels(block.contiguous()).reshape(-1))
                    desc += [out_offset, out_size, rank_offset, rank, padded, offset]
                    offset += blocks[-1].numel()
                entry[name] = (torch.cat(blocks), torch.tensor(desc, dtype=torch.int64))
            packed.append(entry)
        return replace(self, packed=packed)

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
        fused_layers, fused_parts = [], []
        for parts in layers:
            fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            where: dict[str, tuple[tuple[int, int, int, int], ...]] = {}
            for name, members in FUSED_PARTS.items():
                present = [m for m in members if m in parts]
                if not present:
                    continue
                a = torch.cat([parts[m][0] for m in present])
                b = torch.zeros(sum(out_features[m] for m in members), a.shape[0])
                row, col, blocks = 0, 0, []
                for m in members:
                    if m in parts:
                        part_b = parts[m][1]
                        b[row : row + part_b.shape[0], col : col + part_b.shape[1]] = part_b
                        blocks.append((row, part_b.shape[0], col, part_b.shape[1]))
                        col += part_b.shape[1]
                    row += out_features[m]
                fused[name] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
                where[name] = tuple(blocks)
            fused_layers.append(fused)
            fused_parts.append(where)
        return cls(key, fused_layers, fused_parts)

    @property
    def dtype(self) -> torch.dtype:
        return next((a.dtype for layer in self.layers for a, _ in layer.values()), torch.float32)

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for pair in layer.values() for t in pair]
        tensors += [b for layer in self.packed for b, _ in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class KernelTable:
    """A set of adapters as the C++ kernel takes them: per layer, per projection, arrays of their
    A, packed B and layout addresses (null for an adapter that leaves the projection alone).  It
    holds the adapters, so the addresses stay valid while it lives."""

    keys: tuple[str, ...]
    adapters: tuple[LoraWeights, ...]
    layers: list[dict[str, tuple[ctypes.Array, ctypes.Array, ctypes.Array]]]

    @classmethod
    def build(cls, adapters: list[LoraWeights]) -> KernelTable:
        n = len(adapters)
        layers = []
        for index in range(len(adapters[0].packed)):
            entry = {}
            for name in FUSED_PARTS:
                if all(name not in a.packed[index] for a in adapters):
                    continue
                a_ptrs, b_ptrs, descs = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
                for i, adapter in enumerate(adapters):
                    if name in adapter.packed[index]:
                        packed_b, desc = adapter.packed[index][name]
                        a_ptrs[i] = adapter.layers[index][name][0].data_ptr()
                        b_ptrs[i], descs[i] = packed_b.data_ptr(), desc.data_ptr()
                entry[name] = (a_ptrs, b_ptrs, descs)
            layers.append(entry)
        return cls(tuple(a.key for a in adapters), tuple(adapters), layers)


@dataclass(frozen=True)
class LoraStack:
    """Several adapters stacked for one batched multiply: per layer, per fused projection,
    A.T as [adapters, in, R] and B.T as [adapters, R, out] in their dtype, R the largest of their ranks there
    (smaller ranks and projections an adapter leaves alone padded with zeros)."""

    keys: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def build(cls, adapters: list[LoraWeights]) -> LoraStack:
        layers = []
        for index in range(len(adapters[0].layers)):
            stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for name in FUSED_PARTS:
                pairs = [a.layers[index].get(name) for a in adapters]
                present = [pair for pair in pairs if pair is not None]
                if not present:
                    continue
                a0, b0 = present[0]
                rank = max(a.shape[0] for a, _ in present)
                a_t = a0.new_zeros(len(adapters), a0.shape[1], rank)
                b_t = b0.new_zeros(len(adapters), rank, b0.shape[0])
                for i, pair in enumerate(pairs):
                    if pair is not None:
                        a_t[i, :, : pair[0].shape[0]] = pair[0].T
                        b_t[i, : pair[1].shape[1]] = pair[1].T
                stacked[name] = (a_t, b_t)
            layers.append(stacked)
        return cls(tuple(a.key for a in adapters), layers)


class LoraKernel(Protocol):
    """The C++ kernel (layers/cpu_kernels.py's CpuKernels.lora_add), the dtypes it runs, and how it
    wants weights packed."""

    lora_add_available: dict[torch.dtype, bool]

    def pack_panels(self, weight: torch.Tensor) -> torch.Tensor: ...

    def lora_add(
        self, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, adapter_of: torch.Tensor,
        parts: tuple[ctypes.Array, ctypes.Array, ctypes.Array],
    ) -> None: ...  # fmt: skip


@dataclass(frozen=True)
class Batched:
    """A step's adapter rows for one batched multiply of the stacked adapters.  With the C++
    kernel: `gather` lists the rows sorted by adapter, `adapter_of` each one's place in the stack.
    In torch: `gather` is [adapters, G] flattened (G: the most rows any adapter has; shorter groups
    padded by repeating a row of theirs, whose update `mask` zeroes)."""

    gather: torch.Tensor
    mask: torch.Tensor | None  # [adapters, G, 1]: 1 for a real row, 0 for padding; None: no padding
    shape: tuple[int, int]
    kernel: LoraKernel | None = None
    adapter_of: torch.Tensor | None = None
    table: KernelTable | None = None


@dataclass(frozen=True)
class LayerLora:
    """One layer's share of a step: either every adapter's rows in one batched multiply (`batched`
    with `stacked`, this layer's LoraStack entry), or adapter by adapter (`groups`: each adapter's
    rows, a slice where they are consecutive, else an index tensor)."""

    groups: list[tuple[slice | torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]]
    batched: Batched | None = None
    stacked: dict[str, tuple] | None = None  # this layer's LoraStack or KernelTable entries

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection `name` of `x`) with each adapter's update added to its rows, in place."""
        if self.batched is not None:
            pair = self.stacked.get(name)
            if pair is None:
                return y
            b = self.batched
            if b.kernel is not None:
                b.kernel.lora_add(x.contiguous(), y, b.gather, b.adapter_of, pair)
                return y
            t = torch.bmm(x.index_select(0, b.gather).view(*b.shape, -1), pair[0])
            if b.mask is not None:
                t.mul_(b.mask)
            y.index_add_(0, b.gather, torch.bmm(t, pair[1]).flatten(0, 1))
            return y
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


# In torch, batched when the padded [adapters, G] grid is at least this full; below, adapter by
# adapter.  In bfloat16 the C++ kernel takes every step (prompt chunks too: there torch's
# bfloat16 index_add_ cost more than the kernel, 0.62x -> 0.69x the base model's tok/s on SmolLM2
# with 8 adapters on every projection); in float32 it takes steps of up to KERNEL_MAX_ROWS_FLOAT32
# adapter rows (decode steps), and prompt chunks go to torch's GEMMs.
MIN_BATCHED_FILL = 0.5
KERNEL_MAX_ROWS_FLOAT32 = 64


@dataclass(frozen=True)
class LoraStep:
    """A step's adapters: which rows each owns, and how the step multiplies them."""

    groups: list[tuple[slice | torch.Tensor, LoraWeights]]
    batched: Batched | None = None
    stack: LoraStack | None = None

    @classmethod
    def for_rows(
        cls,
        row_adapters: list[LoraWeights | None],
        stack_of: Callable[[list[LoraWeights]], LoraStack],
        device: torch.device | str = "cpu",
        kernel: LoraKernel | None = None,
        table_of: Callable[[list[LoraWeights]], KernelTable] | None = None,
    ) -> LoraStep | None:
        """From each row's adapter (None: the base model alone); None where no row has one.
        `stack_of` stacks a set of adapters (the caller keeps the stacks it has built); `kernel`:
        the C++ kernel, where the step's tensors are on the CPU and the adapters are packed for it,
        with `table_of` making (or finding) a set's KernelTable."""
        rows_of: dict[int, list[int]] = {}
        weights_of: dict[int, LoraWeights] = {}
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                rows_of.setdefault(id(adapter), []).append(row)
                weights_of[id(adapter)] = adapter
        if not rows_of:
            return None
        sizes = [len(rows) for rows in rows_of.values()]
        width = max(sizes)
        within = next(iter(weights_of.values())).dtype == torch.bfloat16 or sum(sizes) <= KERNEL_MAX_ROWS_FLOAT32
        if kernel is not None and table_of is not None and within:
            table = table_of([weights_of[key] for key in rows_of])
            order = [row for rows in rows_of.values() for row in rows]
            adapter_of = [i for i, rows in enumerate(rows_of.values()) for _ in rows]
            as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
            batched = Batched(as_tensor(order), None, (len(sizes), width), kernel, as_tensor(adapter_of), table)
            return cls([], batched)
        if len(rows_of) > 1 and sum(sizes) >= MIN_BATCHED_FILL * len(sizes) * width:
            gather = [rows + [rows[0]] * (width - len(rows)) for rows in rows_of.values()]
            mask = None
            if min(sizes) < width:
                mask = torch.tensor([[1.0] * s + [0.0] * (width - s) for s in sizes], device=device)
            adapters = [weights_of[key] for key in rows_of]
            stack = stack_of(adapters)
            index = torch.tensor([row for rows in gather for row in rows], dtype=torch.int64, device=device)
            batched = Batched(index, None if mask is None else mask.unsqueeze(-1), (len(sizes), width))
            return cls([], batched, stack)
        groups: list[tuple[slice | torch.Tensor, LoraWeights]] = []
        for key, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((slice(rows[0], rows[-1] + 1), weights_of[key]))
            else:
                groups.append((torch.tensor(rows, dtype=torch.int64, device=device), weights_of[key]))
        return cls(groups)

    @property
    def fused(self) -> bool:
        """Whether the one-call decode step can add these updates (the C++ kernel's kind)."""
        return self.batched is not None and self.batched.kernel is not None

    def layer(self, index: int) -> LayerLora:
        if self.fused:
            return LayerLora([], self.batched, self.batched.table.layers[index])
        if self.batched is not None:
            return LayerLora([], self.batched, self.stack.layers[index])
        return LayerLora([(rows, weights.layers[index]) for rows, weights in self.groups])
