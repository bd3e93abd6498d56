"""GGUF quantized tensors repacked, once at load, into the layout the quantized kernels read
(pagedllm/layers/quantized.py): blocks of 32 values, each `scale * (q - zero) + min`, the
scales and mins kept as the file keeps them (float16, and the K types' int8 sub-scales).

Each type's bytes are decoded here from the ggml block formats:
- Q4_0 (d, 16 nibble bytes): value = d * (q - 8); Q4_1 (d, m, nibbles): d * q + m.
- Q5_0 (d, 32 high bits, nibbles): d * (q - 16); Q5_1 (d, m, high bits, nibbles): d * q + m.
- Q8_0 (d, 32 signed bytes): d * q.
- Q4_K / Q5_K: super-blocks of 256 with d and dmin in float16 and eight 6-bit sub-scales
  and sub-mins packed in 12 bytes: value = d * sc * q - dmin * m per sub-block of 32.
- Q6_K: super-blocks of 256, 16 signed 8-bit sub-scales (one per 16 values), d in float16:
  value = d * sc * (q - 32), q's low 4 bits and high 2 bits stored apart.
Nothing is rounded or widened: the repacked weight holds the file's numbers, in no more bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.layers.quantized import QuantizedWeight

# type name: bytes per block, values per block
_BLOCK_SHAPES = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q5_0": (22, 32),
    "Q5_1": (24, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}
NATIVE_TYPES = tuple(_BLOCK_SHAPES)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row, as a float16 column [blocks, 1]."""
    return np.ascontiguousarray(raw).view(np.float16)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's nibble order for a 32-value block: byte i holds value i (low) and i + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's four bytes of high bits -> [blocks, 32] of 0 or 1 (bit i: value i)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit sub-scales and sub-mins of a Q4_K/Q5_K super-block from its 12 bytes: for
    j < 4, the low 6 bits of bytes j and j + 4; for j >= 4, a nibble of byte j + 4 with the two
    top bits of byte j - 4 (scale) or byte j (min) above it."""
    b = packed.astype(np.uint8)
    low_sc, low_m, nib = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc = np.concatenate([low_sc & 0x3F, (nib & 0x0F) | ((low_sc >> 6) << 4)], axis=1)
    mn = np.concatenate([low_m & 0x3F, (nib >> 4) | ((low_m >> 6) << 4)], axis=1)
    return sc.astype(np.int8), mn.astype(np.int8)


@dataclass
class _Decoded:
    # [count * values / 32, 16] for 4 bits, as QuantizedWeight keeps them (byte i: value i low,
    # value i + 16 high); else [count * values / 32, 32]: uint8 for 5 and 6 bits, int8 for 8
    q: np.ndarray
    bits: int
    zero: int
    scales: np.ndarray  # float16 [count, values / super_group]
    mins: np.ndarray | None = None  # float16 like scales
    sub_scales: np.ndarray | None = None  # int8 [count, values / group]
    sub_mins: np.ndarray | None = None
    super_group: int = 32


def _decode(blocks: np.ndarray, kind: str) -> _Decoded:
    """A type's blocks [count, bytes], decoded as QuantizedWeight keeps them."""
    n = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1"):  # ggml's nibble order is QuantizedWeight's
        d = _f16(blocks[:, 0:2])
        q = blocks[:, -16:]
        return _Decoded(q, 4, 8, d) if kind == "Q4_0" else _Decoded(q, 4, 0, d, _f16(blocks[:, 2:4]))
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(blocks[:, 0:2])
        start = 2 if kind == "Q5_0" else 4
        q = _unpack_nibbles(blocks[:, -16:]) | (_high_bits(blocks[:, start : start + 4]) << 4)
        return _Decoded(q, 5, 16, d) if kind == "Q5_0" else _Decoded(q, 5, 0, d, _f16(blocks[:, 2:4]))
    if kind == "Q8_0":
        return _Decoded(blocks[:, 2:34].view(np.int8), 8, 0, _f16(blocks[:, 0:2]))
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, -128:].reshape(n, 4, 32)  # 32 bytes hold sub-blocks 2g (low) and 2g + 1 (high)
        if kind == "Q4_K":  # re-nibbled straight into QuantizedWeight's order: no byte a value
            first, second = qs[:, :, :16], qs[:, :, 16:]
            q = np.stack([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], axis=2)
            return _Decoded(q.reshape(n * 8, 16), 4, 0, d, -dmin, sc, mn, super_group=256)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
        qh = blocks[:, 16:48]  # byte l holds bit 4 of value l in every sub-block j, at bit j
        q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        return _Decoded(q.reshape(n * 8, 32), 5, 0, d, -dmin, sc, mn, super_group=256)
    if kind == "Q6_K":
        ql, qh = blocks[:, 0:128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
        sc = blocks[:, 192:208].view(np.int8)
        d = _f16(blocks[:, 208:210])
        # Per half of 128 values: 32-value chunk c takes ql's low (c = 0, 1) or high (c = 2, 3)
        # nibbles of bytes 32(c % 2).., and bits 2c, 2c + 1 of qh.  Written in place, chunk by
        # chunk: concatenating whole-tensor temporaries took twice as long.
        q = np.empty((n, 2, 4, 32), np.uint8)
        for c in range(4):
            source, chunk = ql[:, :, 32 * (c % 2) : 32 * (c % 2) + 32], q[:, :, c]
            if c < 2:
                np.bitwise_and(source, 0x0F, out=chunk)
            else:
                np.right_shift(source, 4, out=chunk)
            chunk |= ((qh >> (2 * c)) & 3) << 4
        return _Decoded(q.reshape(n * 8, 32), 6, 32, d, sub_scales=sc, super_group=256)
    raise ValueError(f"GGUF type {kind} has no native kernel (native types: {', '.join(NATIVE_TYPES)})")


def repack(data: np.ndarray, kind: str, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw bytes (`GGUFReader` tensor data) of type `kind`, [rows, cols] in the
    Hugging Face orientation, as a QuantizedWeight."""
    if kind not in _BLOCK_SHAPES:
        raise ValueError(f"GGUF type {kind} has no native kernel (native types: {', '.join(NATIVE_TYPES)})")
    block_bytes, block_values = _BLOCK_SHAPES[kind]
    if cols % block_values:
        raise ValueError(f"a {kind} tensor's rows must hold whole blocks of {block_values}, got {cols}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != rows * cols // block_values:
        raise ValueError(f"{kind} tensor of {blocks.shape[0]} blocks does not hold [{rows}, {cols}]")
    decoded = _decode(blocks, kind)
    qs = decoded.q.view(np.uint8)
    mins, sub_mins = decoded.mins, decoded.sub_mins
    if mins is not None and not (mins.astype(np.float32) * (1 if sub_mins is None else sub_mins)).any():
        mins = sub_mins = None  # every min 0: the kernels skip the term

    def tensor(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))

    group = 16 if kind == "Q6_K" else 32
    return QuantizedWeight(
        qs=tensor(qs),
        scales=tensor(decoded.scales),
        sub_scales=tensor(decoded.sub_scales),
        mins=tensor(mins),
        sub_mins=tensor(sub_mins),
        bits=decoded.bits,
        group=group,
        zero=decoded.zero,
        source=kind,
        super_group=decoded.super_group,
    )


def dequantize_tensor(data: np.ndarray, tensor_type, shape: list[int]) -> np.ndarray:
    """A GGUF tensor's values as float32 in `shape` (outermost first).  A matrix of a type with
    native kernels is decoded by `repack` and expanded in torch (the same float32 products and
    sums as the `gguf` package's, so the same values; ten times faster on Gemma 3's Q8_0
    embedding); any other tensor by the `gguf` package.  That one works over groups of 16 rows, so
    a tensor of many short rows costs a numpy call per 16; blocks never straddle rows, so
    consecutive rows are handed over as one row of up to 2^20 values, which gives the same
    values in the same order."""
    import gguf

    if tensor_type.name in NATIVE_TYPES and len(shape) == 2:
        return repack(data, tensor_type.name, *shape).dequantize().numpy()
    rows = math.prod(shape[:-1])
    merge = 1
    while rows % (merge * 2) == 0 and merge * 2 * shape[-1] <= 1 << 20:
        merge *= 2
    raw = np.asarray(data).reshape(rows // merge, -1)
    return gguf.quants.dequantize(raw, tensor_type).astype(np.float32, copy=False).reshape(shape)
