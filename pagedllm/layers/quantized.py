"""Linear layers and embedding lookups on weights kept quantized, as GGUF files ship them.

A `QuantizedWeight` holds a matrix in the layout the C++ kernels read
(csrc/quant_gemm.cpp): blocks of 32 values along the inner dimension, each value
`scale * q + min` for its group of 16 or 32, with q in 4 bits (from Q4_0, Q4_1, Q4_K)
or a signed byte (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0).  The models layer repacks a file's
blocks into it once at load (pagedllm/models/gguf_weights.py); nothing here knows GGUF.

A `QuantizedLinear` runs steps of up to `max_rows` rows on the integer kernels, which
quantize the activations to signed bytes per block of 32 (as llama.cpp does) and read
the weight's bytes once per tile of rows: a decode step reads 4-8x fewer weight bytes
than on float weights.  Steps of more rows (prompt chunks) dequantize the weight into a
scratch matrix of the model's dtype and run a float GEMM on it, which is faster there
than integer dot products (`python benchmarks/quantized_linear.py` measures both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_kernels import CpuKernels, cpu_flags

BLOCK = 32  # values per quantized block along the inner dimension
# Rows of a step up to which projections run on the integer kernels; above, a float GEMM on
# the weight dequantized for the step (`python benchmarks/quantized_linear.py`).
INT_MAX_ROWS = 128
INT_MAX_ROWS_AMX = 32  # bfloat16 where oneDNN's GEMM has AMX tiles


def quantized_max_rows(kernels: CpuKernels, dtype: torch.dtype) -> int:
    """The integer kernels' row limit for this CPU and dtype (see INT_MAX_ROWS)."""
    del kernels  # the limit depends on the float GEMM it hands over to, not on the integer build
    return INT_MAX_ROWS_AMX if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags().split() else INT_MAX_ROWS


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [rows, cols] (cols a multiple of 32) as the quantized kernels read it."""

    qs: torch.Tensor  # uint8 [rows, cols / 32 * block_bytes]
    scales: torch.Tensor  # float32 [rows, cols / group]
    mins: torch.Tensor | None  # float32 like scales, or None where every min is 0
    bits: int  # 4 or 8
    group: int  # 16 or 32 values share a scale and min
    source: str  # the file's type(s) it holds, e.g. "Q4_K" or "Q5_0+Q8_0"

    def __post_init__(self) -> None:
        rows = self.qs.shape[0]
        if self.bits not in (4, 8) or self.group not in (16, 32) or (self.bits == 4 and self.group != 32):
            raise ValueError(f"no quantized layout of {self.bits} bits in groups of {self.group}")
        if self.qs.dtype != torch.uint8 or self.qs.shape[1] % self.block_bytes:
            raise ValueError(f"quantized values must be uint8 whole blocks, got {self.qs.dtype} {tuple(self.qs.shape)}")
        for t in (self.scales, self.mins):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (rows, self.cols // self.group)):
                raise ValueError(f"scales/mins must be float32 [{rows}, {self.cols // self.group}]")

    @property
    def block_bytes(self) -> int:
        return BLOCK // 2 if self.bits == 4 else BLOCK

    @property
    def cols(self) -> int:
        return self.qs.shape[1] // self.block_bytes * BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qs.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        tensors = [self.qs, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` in that order (a permutation, or a slice of the output features)."""
        return replace(
            self,
            qs=self.qs[index].contiguous(),
            scales=self.scales[index].contiguous(),
            mins=None if self.mins is None else self.mins[index].contiguous(),
        )

    def widened(self, group: int) -> QuantizedWeight:
        """The same values in the 8-bit layout with groups of `group` (exact: 4-bit q fit a byte,
        and a group of 32 is two of 16 with the same scale)."""
        qs, scales, mins = self.qs, self.scales, self.mins
        if self.bits == 4:
            blocks = qs.reshape(qs.shape[0], -1, BLOCK // 2)
            qs = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(qs.shape[0], -1)
        if group != self.group:
            scales = scales.repeat_interleave(self.group // group, dim=1)
            mins = None if mins is None else mins.repeat_interleave(self.group // group, dim=1)
        return QuantizedWeight(qs.contiguous(), scales.contiguous(), mins, 8, group, self.source)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after another (fused projections); parts in different layouts are
        first widened to a common one, exactly."""
        if len({p.cols for p in parts}) != 1:
            raise ValueError(f"cannot stack quantized weights of widths {[p.cols for p in parts]}")
        if len({(p.bits, p.group) for p in parts}) > 1:
            group = min(p.group for p in parts)
            parts = [p.widened(group) for p in parts]
        first = parts[0]
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
        source = "+".join(dict.fromkeys(p.source for p in parts))
        qs, scales = torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts])
        return QuantizedWeight(qs, scales, mins, first.bits, first.group, source)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a float tensor, in torch (a reference for tests; the engine uses the kernels)."""
        rows, cols = self.shape
        if self.bits == 4:
            blocks = self.qs.reshape(rows, -1, BLOCK // 2)
            q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(rows, cols).float()
        else:
            q = self.qs.view(torch.int8).float()
        groups = q.reshape(rows, -1, self.group) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            groups = groups + self.mins.unsqueeze(-1)
        return groups.reshape(rows, cols).to(dtype)


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernels' panel layout (csrc/quant_gemm.cpp): output columns in
    panels of the build's width, a vector holding 4 consecutive k values of each column."""

    qs: torch.Tensor  # uint8 [panels, cols / 32 * panel * (16 or 32)]
    scales: torch.Tensor  # float32 [panels, cols / group, panel]
    mins: torch.Tensor | None
    bits: int
    group: int
    rows: int
    cols: int
    source: str

    @property
    def nbytes(self) -> int:
        tensors = [self.qs, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)


def pack(weight: QuantizedWeight, panel: int, unsigned8: bool) -> PackedWeight:
    """`weight` in panels of `panel` columns; with `unsigned8`, 8-bit values as q + 128 and mins
    as min - 128 * scale (the VNNI builds' form)."""
    rows, cols = weight.shape
    blocks = cols // BLOCK
    padded = -(-rows // panel) * panel
    if weight.bits == 4:
        half = weight.qs.reshape(rows, blocks, BLOCK // 2)
        q = torch.cat([half & 0x0F, half >> 4], dim=-1)  # [rows, blocks, 32] in k order
    else:
        q = weight.qs.reshape(rows, blocks, BLOCK)
    scales, mins = weight.scales, weight.mins
    if weight.bits == 8 and unsigned8:
        q = (q.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        mins = (torch.zeros_like(scales) if mins is None else mins) - 128.0 * scales
    pad = padded - rows
    if pad:
        q = torch.cat([q, q.new_zeros(pad, blocks, BLOCK)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        mins = None if mins is None else torch.cat([mins, mins.new_zeros(pad, mins.shape[1])])
    # [panels, panel, blocks, 8 quads, 4] -> [panels, blocks, 8 quads, panel, 4]
    q = q.reshape(padded // panel, panel, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if weight.bits == 4:  # quad j in the low nibbles, quad j + 4 in the high ones
        q = q[:, :, :4] | (q[:, :, 4:] << 4)
    groups = scales.shape[1]

    def by_panel(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(padded // panel, panel, groups).transpose(1, 2).contiguous()

    qs = q.contiguous().reshape(padded // panel, -1)
    return PackedWeight(qs, by_panel(scales), by_panel(mins), weight.bits, weight.group, rows, cols, weight.source)


class QuantizedLinear:
    """x [tokens, in] -> [tokens, out] on a PackedWeight [out, in]: the integer kernels up to
    `max_rows` rows, a float GEMM on the dequantized weight above (see the module's doc)."""

    def __init__(self, weight: PackedWeight, kernels: CpuKernels, max_rows: int) -> None:
        self.weight = weight
        self.out_features = weight.rows
        self.small_weight = None  # not packed for the float small-batch kernels
        self.kernels = kernels
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.kernels.quant_gemm(x.contiguous(), self.weight)
        return F.linear(x, self.kernels.dequantize_rows(self.weight, None, x.dtype))

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def quantized_embedding(weight: PackedWeight, kernels: CpuKernels, ids: torch.Tensor, dtype: torch.dtype):
    """Rows `ids` of an embedding table kept quantized, as `dtype` [len(ids), cols]."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.rows):
        raise IndexError(f"token id out of range for an embedding table of {weight.rows} rows")
    return kernels.dequantize_rows(weight, ids.to(torch.int64).contiguous(), dtype)
