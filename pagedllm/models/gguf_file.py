"""A GGUF file's header and tensors, read lazily: the metadata's scalar values and numeric
arrays, and each tensor's name, type, shape and bytes (a view of the mapped file).

The `gguf` package's reader builds a numpy view of every metadata item, so a
vocabulary of strings costs it seconds (SmolLM2's 49,152 tokens ~4 s, Gemma 3's
262,144 ~15 s).  The weights never need those strings (the tokenizer reads them itself),
so here arrays of strings are stepped over and kept only as their length.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; each
metadata item as key, type, value; each tensor as name, dims (innermost first), type, offset;
then the tensors' data from the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF value types: numpy dtype of each scalar type.
_SCALARS = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """An array of strings in the metadata, stepped over: only its length is kept."""

    length: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as the file lists it: innermost dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data: np.ndarray  # as the `gguf` package's reader gives it: typed for float/int types, else bytes


class GGUFFile:
    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version, num_tensors, num_fields = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path.name}: GGUF version {version} is not supported (2 or 3)")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(gguf, start, *info) for info in infos]

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._map[self._pos : self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            value = np.frombuffer(self._map, dtype, 1, self._pos)[0].item()
            self._pos += dtype.itemsize
            return value
        if kind != _ARRAY:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item == _STRING:
            for _ in range(count):
                length = self._unpack("<Q")  # (read before _pos is added to: the read moves it)
                self._pos += length
            return StringArray(count)
        if item not in _SCALARS:
            return [self._value(item) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        values = np.frombuffer(self._map, dtype, count, self._pos).tolist()
        self._pos += dtype.itemsize * count
        return values

    def _tensor(self, gguf, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(kind)
        elements = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_bytes = elements * type_size // block
        shape = tuple(reversed(dims))
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(tensor_type.name)  # fmt: skip
        first = start + offset
        if typed is not None:
            data = np.frombuffer(self._map, typed, elements, first).reshape(shape)
        else:
            data = self._map[first : first + n_bytes].reshape(gguf.quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(name, dims, tensor_type, n_bytes, data)
