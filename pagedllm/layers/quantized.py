"""Linear layers and embedding lookups on weights kept quantized, as GGUF files ship them.

A `QuantizedWeight` holds a matrix row by row, in blocks of 32 values along the inner
dimension, each value `scale * (q - zero) + min` for its group of 16 or 32: q in 4 bits
(from Q4_0, Q4_1, Q4_K), 5 bits (Q5_0, Q5_1, Q5_K), 6 bits (Q6_K) or a signed byte (Q8_0).
Scales and mins are the file's own numbers in the file's own widths: float16, times an int8
sub-scale per group for the K types, so the weight takes the file's bytes.  The models layer
builds it from a file's blocks at load (pagedllm/models/gguf_weights.py); nothing here knows
GGUF.  `pack` turns it into the panel layout the C++ kernels read (csrc/quant_gemm.cpp, whose
header describes it), and that copy is all the engine keeps.

A `QuantizedLinear` runs steps of up to `max_rows` rows on the integer kernels, which
quantize the activations to signed bytes (as llama.cpp does: per block of 32, or per
super-group of 256 before the K types with AVX-512) and read the
weight's bytes once per tile of rows: a decode step reads about 5x fewer weight bytes than
on bfloat16 weights (10x fewer than on float32).  Steps of more rows (prompt chunks,
large batches) are bound by multiply-adds instead, and run in the model's dtype on the weight
dequantized.  In bfloat16 on a CPU with AMX-BF16, up to `tile_max_rows` rows go to the tile
kernel (csrc/quant_amx.cpp), which dequantizes a few panels at a time into the thread's cache;
more rows to oneDNN's GEMM on the weight dequantized straight into oneDNN's blocked layout (a
packed tensor per shape, reused).  Elsewhere the weight is dequantized into a plain scratch
matrix for a float GEMM (`python benchmarks/quantized_linear.py` measures each way).  These
take the activations as they are, so such a step computes what the dequantized model would
(up to the order of float additions); a request's tokens can therefore depend on how
many rows share its steps (docs/design.md, Quantized weights).  A fused projection (q, k, v) whose
parts came in different types keeps each part in its own layout and writes its columns of
the one output.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
from dataclasses import dataclass

import torch

from pagedllm.layers.cpu_kernels import QUANT_LAYOUTS, CpuKernels, cpu_flags
from pagedllm.layers.linear import ONEDNN_ROWS_HINT, UNLIMITED_ROWS, onednn_supports

BLOCK = 32  # values per quantized block along the inner dimension
# Rows of a step up to which projections run on the integer kernels (every row count with
# AVX512-VNNI and no AMX, see quantized_max_rows); above, in bfloat16 where
# the CPU has AMX-BF16, the AMX tile kernel up to TILE_MAX_ROWS rows, then oneDNN's GEMM on the
# weight dequantized into its blocked layout; elsewhere a float GEMM on the weight dequantized
# for the step (`python benchmarks/quantized_linear.py` measures the crossovers).
INT_MAX_ROWS = 128
INT_MAX_ROWS_AMX_TILES = 16  # bfloat16, with csrc/quant_amx.cpp
INT_MAX_ROWS_AMX = 64  # bfloat16 where only oneDNN's GEMM has the AMX tiles
# The tile kernel against oneDNN on the blocked copy, all of a layer's projections: 0.77-0.88x
# the time at 128-160 rows, level at 224, 1.07-1.10x at 320 (SmolLM2 and Gemma 3, 2-core Xeon).
TILE_MAX_ROWS = 224
BLOCKED_MAX_VALUES = 1 << 24  # the largest weight given a dense scratch copy (32 MiB in bfloat16)


# A quantized LM head runs on the integer kernels up to this many rows where the tile kernel
# runs (bfloat16, AMX), then on the tile kernel, which writes no dense copy of the table.  The
# tile kernel's time against the integer kernels': Gemma 3's 262,144-row head level at 16 rows,
# 0.87x at 24, 0.76x at 32; SmolLM2's 1.34x at 16, 1.05x at 24, 0.84x at 32 (2-core Xeon with
# AMX).  Elsewhere the head stays on the integer kernels at every row count: the other ways
# would dequantize the whole table.
LM_HEAD_INT_MAX_ROWS_AMX_TILES = 24


def quantized_max_rows(dtype: torch.dtype, kernels: CpuKernels) -> int:
    """The integer kernels' row limit for this CPU and dtype (see INT_MAX_ROWS)."""
    flags = cpu_flags().split()
    if dtype == torch.bfloat16 and "amx_bf16" in flags:
        return INT_MAX_ROWS_AMX_TILES if kernels.quant_amx else INT_MAX_ROWS_AMX
    if "avx512_vnni" in flags and "amx_bf16" not in flags:
        # VNNI's integer products outrun every float GEMM without AMX, at every row count: on a
        # 2-core AVX512-BF16 EPYC (no AMX), SmolLM2's projections took 0.80x the time of the
        # dequantized bfloat16 weights at 2,048 rows and 0.92x at 128, and 0.54x of float32's at 2,048.
        # (float32 on an AMX CPU keeps INT_MAX_ROWS: not measured there.)
        return UNLIMITED_ROWS
    return INT_MAX_ROWS


def lm_head_max_rows(dtype: torch.dtype, kernels: CpuKernels) -> int:
    """The integer kernels' row limit for a quantized LM head (see LM_HEAD_INT_MAX_ROWS_AMX_TILES)."""
    if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags().split() and kernels.quant_amx:
        return LM_HEAD_INT_MAX_ROWS_AMX_TILES
    return UNLIMITED_ROWS


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [rows, cols] (cols a multiple of 32), row by row.  `qs` holds, per block of 32:
    4-bit, 16 bytes (byte i: value i in the low nibble, value i + 16 in the high one);
    5- and 6-bit, 32 bytes of 0..31 or 0..63; 8-bit, 32 signed bytes.

    Value = scale * (q - zero) + min for its group of `group` values.  Scales and mins are kept
    as the file keeps them: `scales` (float16) per super-group of `super_group` values, times
    `sub_scales` (int8) per group where given (the K types); `mins` and `sub_mins` likewise,
    or None where every min is 0."""

    qs: torch.Tensor  # uint8 [rows, cols / 32 * block_bytes]
    scales: torch.Tensor  # float16 [rows, cols / super_group]
    sub_scales: torch.Tensor | None  # int8 [rows, cols / group], or None where super_group == group
    mins: torch.Tensor | None  # float16 like scales
    sub_mins: torch.Tensor | None  # int8 like sub_scales
    bits: int  # 4, 5, 6 or 8
    group: int  # values sharing a scale and min: 32, or 16 (6- and 8-bit)
    zero: int  # the integer subtracted from q (Q4_0: 8, Q5_0: 16, Q6_K: 32; 0 for 8-bit)
    source: str  # the file's type it holds, e.g. "Q4_K"
    super_group: int = 0  # values per entry of scales and mins; 0: the group

    def __post_init__(self) -> None:
        if not self.super_group:
            object.__setattr__(self, "super_group", self.group)
        rows = self.qs.shape[0]
        if (self.bits, self.group) not in QUANT_LAYOUTS:
            raise ValueError(f"no quantized layout of {self.bits} bits in groups of {self.group}")
        if self.bits == 8 and self.zero:
            raise ValueError("8-bit values are signed and take no zero point")
        per_super = self.super_group // self.group
        if self.super_group % self.group or per_super & (per_super - 1):
            raise ValueError(f"super-groups of {self.super_group} must hold a power of two of groups of {self.group}")
        if (per_super > 1) != (self.sub_scales is not None):
            raise ValueError(f"sub-scales are given exactly when super-groups ({self.super_group}) hold several groups")
        if self.qs.dtype != torch.uint8 or self.qs.dim() != 2 or self.qs.shape[1] % self.block_bytes:
            raise ValueError(f"quantized values must be uint8 whole blocks, got {self.qs.dtype} {tuple(self.qs.shape)}")
        if self.cols % self.super_group:
            raise ValueError(f"rows of {self.cols} values do not hold whole super-groups of {self.super_group}")
        supers, groups = (rows, self.cols // self.super_group), (rows, self.cols // self.group)
        for name, t, dtype, shape in (
            ("scales", self.scales, torch.float16, supers),
            ("mins", self.mins, torch.float16, supers),
            ("sub_scales", self.sub_scales, torch.int8, groups),
            ("sub_mins", self.sub_mins, torch.int8, groups),
        ):
            if t is not None and (t.dtype != dtype or tuple(t.shape) != shape):
                raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        if self.sub_mins is not None and (self.mins is None or self.sub_scales is None):
            raise ValueError("sub-mins come with mins and sub-scales")

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
    def layout(self) -> tuple:
        """Weights with equal layouts stack into one (see `cat`)."""
        return (self.bits, self.group, self.super_group, self.zero, self.mins is None, self.sub_mins is None, self.cols)

    def values(self) -> torch.Tensor:
        """q as int16 [rows, cols], in k order."""
        rows, cols = self.shape
        if self.bits == 4:
            blocks = self.qs.reshape(rows, -1, BLOCK // 2)
            return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(rows, cols).to(torch.int16)
        if self.bits in (5, 6):
            return self.qs.to(torch.int16)
        return self.qs.view(torch.int8).to(torch.int16)

    def group_scales(self) -> torch.Tensor:
        """Each group's scale, float32 [rows, cols / group]."""
        return _expand(self.scales, self.sub_scales, self.super_group // self.group)

    def group_mins(self) -> torch.Tensor | None:
        """Each group's min, float32 [rows, cols / group], or None."""
        return None if self.mins is None else _expand(self.mins, self.sub_mins, self.super_group // self.group)

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {"qs": self.qs, "scales": self.scales, "sub_scales": self.sub_scales, "mins": self.mins,
                "sub_mins": self.sub_mins}  # fmt: skip

    def select_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` in that order (a permutation, or a slice of the output features)."""
        picked = {name: None if t is None else t[index].contiguous() for name, t in self._tensors().items()}
        return dataclasses.replace(self, **picked)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows one after another; every part must have the same `layout`."""
        first = parts[0]
        if any(p.layout != first.layout for p in parts):
            raise ValueError(f"cannot stack quantized weights of layouts {[p.layout for p in parts]}")
        joined = {
            name: None if t is None else torch.cat([p._tensors()[name] for p in parts])
            for name, t in first._tensors().items()
        }
        return dataclasses.replace(first, **joined)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a float tensor, in torch (what weights=dequantized would hold; tests)."""
        rows, cols = self.shape
        q = (self.values() - self.zero).float()
        groups = q.reshape(rows, -1, self.group) * self.group_scales().unsqueeze(-1)
        mins = self.group_mins()
        if mins is not None:
            groups = groups + mins.unsqueeze(-1)
        return groups.reshape(rows, cols).to(dtype)


def _expand(supers: torch.Tensor, subs: torch.Tensor | None, per_super: int) -> torch.Tensor:
    """Per-group floats: each super-group's float16 repeated over its groups, times the int8s."""
    values = supers.float().repeat_interleave(per_super, dim=1)
    return values if subs is None else values * subs.float()


class QuantWeightStruct(ctypes.Structure):  # csrc/quant_layout.h's QuantWeight
    _fields_ = [(name, ctypes.c_void_p) for name in ("qs", "scales", "sub_scales", "mins", "sub_mins")]
    _fields_ += [(name, ctypes.c_int64) for name in ("rows", "cols", "bits", "group", "super_group", "zero")]


@dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight in the kernels' panel layout (csrc/quant_gemm.cpp): output columns in
    panels of the build's width, a vector holding 4 consecutive k values of each column; scales,
    sub-scales, mins and sub-mins as QuantizedWeight keeps them, [panels, per row, panel]."""

    qs: torch.Tensor  # uint8 [panels, bytes per panel]
    scales: torch.Tensor  # float16 [panels, cols / super_group, panel]
    sub_scales: torch.Tensor | None  # int8 [panels, cols / group, panel]
    mins: torch.Tensor | None  # like scales
    sub_mins: torch.Tensor | None  # like sub_scales
    bits: int
    group: int
    super_group: int
    zero: int
    rows: int
    cols: int
    source: str

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.scales, self.sub_scales, self.mins, self.sub_mins) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @functools.cached_property
    def struct(self) -> QuantWeightStruct:
        """The C struct the kernels take (pointers into this weight's tensors, which it outlives
        only as long as this object lives)."""

        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        return QuantWeightStruct(
            address(self.qs), address(self.scales), address(self.sub_scales), address(self.mins),
            address(self.sub_mins), self.rows, self.cols, self.bits, self.group, self.super_group, self.zero,
        )  # fmt: skip


def pack(weight: QuantizedWeight, panel: int, unsigned8: bool, kernels: CpuKernels | None = None) -> PackedWeight:
    """`weight` in panels of `panel` columns; with `unsigned8`, 8-bit values as q + 128 with
    zero point 128 (the VNNI builds' form).  Given the kernels (whose layout `panel` and
    `unsigned8` must be), their C++ packs the values: the same bytes, without widening every value
    to a byte (a 1B Q4_K_M file's 73 weights took 6.8 s in torch under a profiler; its engine
    start went from 13.5 to 11.5 s, medians of 5, on a 2-core AVX2 EPYC)."""
    rows, cols = weight.shape
    blocks = cols // BLOCK
    panels = -(-rows // panel)
    zero = 128 if weight.bits == 8 and unsigned8 else weight.zero
    if kernels is not None:
        if (panel, unsigned8) != (kernels.quant_panel_width, kernels.quant_unsigned8):
            raise ValueError(f"pack: panel {panel} / unsigned8 {unsigned8} is not the kernels' layout")
        qs = kernels.pack_quantized_values(weight.qs.contiguous(), rows, cols, weight.bits, zero == 128)
    else:
        qs = _pack_values(weight, panels, panel, blocks, unsigned8)
    pad = panels * panel - rows

    def by_panel(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if pad:
            t = torch.cat([t, t.new_zeros(pad, t.shape[1])])
        return t.reshape(panels, panel, t.shape[1]).transpose(1, 2).contiguous()

    return PackedWeight(
        qs.contiguous(), by_panel(weight.scales), by_panel(weight.sub_scales), by_panel(weight.mins),
        by_panel(weight.sub_mins), weight.bits, weight.group, weight.super_group, zero, rows, cols, weight.source,
    )  # fmt: skip


def _pack_values(weight: QuantizedWeight, panels: int, panel: int, blocks: int, unsigned8: bool) -> torch.Tensor:
    """`pack`'s values in torch (csrc/quant_pack.cpp does the same where the kernels are built)."""
    rows, cols = weight.shape
    q = weight.values()
    if weight.bits == 8 and unsigned8:
        q = q + 128
    q = q.to(torch.uint8)  # 8-bit signed values keep their bits
    pad = panels * panel - rows
    if pad:
        q = torch.cat([q, q.new_zeros(pad, cols)])
    # [panels, panel, blocks, 8 quads, 4] -> [panels, blocks, 8 quads, panel, 4]
    q = q.reshape(panels, panel, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if weight.bits == 8:
        qs = q.contiguous().reshape(panels, -1)
    else:  # quad j in the low nibbles, quad j + 4 in the high ones
        low = q & 0x0F
        parts = [(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(panels, blocks, -1)]
        high = q >> 4  # gathered with byte-wide shifts and ors (disjoint bits: no carries)
        if weight.bits == 5:  # byte (column, i): bit j is the fifth bit of value 4j + i
            fifth = high[:, :, 0].clone()
            for j in range(1, 8):
                fifth |= high[:, :, j] << j
            parts.append(fifth.reshape(panels, blocks, -1))
        if weight.bits == 6:  # plane h's byte (column, i): bits 2j, 2j + 1 hold value 4(4h + j) + i's top pair
            pairs = high.reshape(panels, blocks, 2, 4, panel, 4)
            plane = pairs[:, :, :, 0].clone()
            for j in range(1, 4):
                plane |= pairs[:, :, :, j] << (2 * j)
            parts.append(plane.reshape(panels, blocks, -1))
        qs = torch.cat(parts, dim=-1).reshape(panels, -1)
    return qs


class QuantizedLinear:
    """x [tokens, in] -> [tokens, out] on PackedWeights stacked by output columns: the integer
    kernels up to `max_rows` rows; above, for bfloat16 x where the kernels have them, the AMX tile
    kernel up to `tile_max_rows` rows and then oneDNN's GEMM on the weight dequantized into its
    blocked layout (`blocked`); else a float GEMM on the weight dequantized into a scratch W^T."""

    def __init__(
        self,
        parts: list[PackedWeight],
        kernels: CpuKernels,
        max_rows: int,
        tile_max_rows: int | None = None,
        blocked: bool | None = None,
    ) -> None:
        if len({p.cols for p in parts}) != 1:
            raise ValueError(
                f"the parts of a fused projection must share their input width, got {[p.cols for p in parts]}"
            )
        self.parts = parts
        self.out_features = sum(p.rows for p in parts)
        self.small_weight = None  # not packed for the float small-batch kernels
        self.kernels = kernels
        self.max_rows = max_rows
        # A weight larger than a layer's (an LM head: Gemma 3's is 168M values) would need a
        # dense scratch copy of hundreds of MiB for the blocked path: the tile kernel, which
        # needs none, takes all its many-row steps instead.
        large = self.out_features * parts[0].cols > BLOCKED_MAX_VALUES
        if tile_max_rows is None:
            tile_max_rows = (1 << 62 if large else TILE_MAX_ROWS) if kernels.quant_amx else 0
        self.tile_max_rows = tile_max_rows
        if blocked is None:
            blocked = (
                not large
                and kernels.dequantize_blocked_bf16
                and onednn_blocked_layout(self.out_features, parts[0].cols)
            )
        self.blocked = blocked and all(p.rows % 32 == 0 for p in parts)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The product; written into `out` ([rows, out_features] of x's dtype, contiguous) where the
        kernels write their own output (the integer and tile kernels), else a new tensor."""
        x = x.contiguous()
        rows = x.shape[0]
        if rows <= self.max_rows:
            gemm = self.kernels.quant_gemm
        elif rows <= self.tile_max_rows and x.dtype == torch.bfloat16:
            gemm = self.kernels.quant_amx_gemm
        elif self.blocked and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight(), None, "none", [], "")
        else:
            return torch.matmul(x, self.dense_transposed(x.dtype))
        y = torch.empty(rows, self.out_features, dtype=x.dtype) if out is None else out
        col = 0
        for part in self.parts:
            gemm(x, part, y, col)
            col += part.rows
        return y

    def row_limits(self, dtype: torch.dtype) -> tuple[int, ...]:
        """The row counts that end the ranges within which a row of `dtype` activations comes out the
        same whatever the rows beside it: the integer kernels' (each row's activations quantized on
        their own) and, in bfloat16 with AMX, the tile kernel's.  Past them oneDNN or a float GEMM
        block the rows as they see fit: nothing is promised there."""
        if self.max_rows >= UNLIMITED_ROWS:
            return (UNLIMITED_ROWS,)
        if dtype == torch.bfloat16 and self.kernels.quant_amx and self.max_rows < self.tile_max_rows:
            return (self.max_rows, min(self.tile_max_rows, UNLIMITED_ROWS))
        return (self.max_rows,)

    def onednn_weight(self) -> torch.Tensor:
        """The weight dequantized to bfloat16 in a oneDNN packed tensor that the next call of any
        QuantizedLinear of this shape on this thread overwrites."""
        cols = self.parts[0].cols
        weight = _onednn_scratch(self.out_features, cols)
        address, col = torch.ops.mkldnn.data_ptr(weight), 0
        for part in self.parts:  # 32 columns x all of k per block, column blocks outermost
            self.kernels.dequantize_blocked(part, address + col * cols * 2)
            col += part.rows
        return weight

    def dense_transposed(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T [in, out] dequantized to `dtype`, in a scratch buffer that the next call of any
        QuantizedLinear on this thread overwrites (a fresh allocation each time cost more in page
        faults than the dequantization itself)."""
        out = _scratch(self.out_features * self.parts[0].cols, dtype).view(self.parts[0].cols, -1)
        col = 0
        for part in self.parts:
            self.kernels.dequantize_transposed(part, out, col)
            col += part.rows
        return out

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@functools.cache
@dataclass(frozen=True)
class QuantizedSetup:
    """How projections kept quantized run: the C++ kernels, and up to how many rows of a step go
    to their integer GEMM (above: a float GEMM on the weight dequantized for the step)."""

    kernels: CpuKernels
    max_rows: int
    lm_head_max_rows: int  # the same for a quantized LM head (pagedllm/layers/quantized.py)

    def pack(self, weight: QuantizedWeight) -> PackedWeight:
        return pack(weight, self.kernels.quant_panel_width, self.kernels.quant_unsigned8, self.kernels)

    def linear(self, weights: list[QuantizedWeight | PackedWeight], max_rows: int | None = None) -> QuantizedLinear:
        parts = [w if isinstance(w, PackedWeight) else self.pack(w) for w in weights]
        return QuantizedLinear(parts, self.kernels, self.max_rows if max_rows is None else max_rows)


def onednn_blocked_layout(rows: int, cols: int) -> bool:
    """True when oneDNN packs a bfloat16 linear weight [rows, cols] as `dequantize_blocked` writes
    it: blocks of 32 rows x 32 columns, in each [16 column pairs][32 rows][2].  Checked on a random
    weight of that shape, so another oneDNN version or CPU with another layout takes the plain GEMM."""
    if rows % 32 or cols % 32 or not _onednn_bf16():
        return False
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
    if torch.ops.mkldnn._nbytes(packed) != rows * cols * 2:
        return False
    raw = torch.empty(rows * cols, dtype=torch.int16)
    ctypes.memmove(raw.data_ptr(), torch.ops.mkldnn.data_ptr(packed), rows * cols * 2)
    expected = weight.view(torch.int16).reshape(rows // 32, 32, cols // 32, 16, 2).permute(0, 2, 3, 1, 4)
    return torch.equal(raw, expected.reshape(-1))


def _onednn_bf16() -> bool:
    try:
        return all(hasattr(torch.ops.mkldnn, name) for name in ("data_ptr", "_nbytes")) and onednn_supports(
            torch.bfloat16
        )
    except (RuntimeError, AttributeError):
        return False


_SCRATCH = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer of at least `numel` elements, one per thread: an engine runs its steps on
    one thread, one at a time, and engines on other threads of the process get buffers of
    their own."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _onednn_scratch(rows: int, cols: int) -> torch.Tensor:
    """A reused oneDNN packed bfloat16 weight [rows, cols], one per shape and thread (see _scratch)."""
    tensors = getattr(_SCRATCH, "onednn", None)
    if tensors is None:
        tensors = _SCRATCH.onednn = {}
    weight = tensors.get((rows, cols))
    if weight is None:
        weight = tensors[rows, cols] = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(rows, cols, dtype=torch.bfloat16), ONEDNN_ROWS_HINT
        )
    return weight


def quantized_embedding(weight: PackedWeight, kernels: CpuKernels, ids: torch.Tensor, dtype: torch.dtype):
    """Rows `ids` of an embedding table kept quantized, as `dtype` [len(ids), cols]."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.rows):
        raise IndexError(f"token id out of range for an embedding table of {weight.rows} rows")
    ids = ids.to(torch.int64).contiguous()
    return kernels.dequantize_rows(weight, ids, torch.empty(ids.shape[0], weight.cols, dtype=dtype))
