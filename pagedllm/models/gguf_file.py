"""A GGUF file's header and tensors, read lazily and checked as untrusted input: the metadata's
scalar values and numeric arrays, and each tensor's name, type, shape and bytes (a view of the
mapped file).

The `gguf` package's reader builds a numpy view of every metadata item, so a
vocabulary of strings costs it seconds (SmolLM2's 49,152 tokens ~4 s, Gemma 3's
262,144 ~15 s).  The weights never need those strings (the tokenizer reads them itself),
so here arrays of strings are stepped over and kept only as their length.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count; each
metadata item as key, type, value; each tensor as name, dims (innermost first), type, offset;
then the tensors' data from the next multiple of `general.alignment` (32 by default).

Every count, length and offset the file states is checked against the file's size before it
is used: nothing is allocated or read past the end on the file's word; the tensors' data follow
one another in the order listed, as llama.cpp requires.  A file that breaks a
rule gets a ModelFileError naming the item (docs/model-files.md lists the rules); the checks
are a walk over the header, never over the tensors' data.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.errors import ModelFileError, describe_file_kind

# GGUF value types: numpy dtype of each scalar type.
_SCALARS = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_INTEGER_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
MAX_ARRAY_NESTING = 2  # an array of arrays of scalars at most (no model's metadata nests deeper)
MAX_DIMS = 4  # as ggml
MAX_TENSOR_NAME = 256  # bytes; ggml's own limit is 64
MAX_ELEMENTS = 2**48  # per tensor: far past any model, far below int64 overflow in any product
# Tensor types the engine reads: float types, and the quantized types it dequantizes or runs
# natively (gguf.quants' decoders).  Integer tensors are not weights of any architecture here.
WEIGHT_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
    "MXFP4",
)  # fmt: skip


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


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


def open_regular_file(path: Path) -> tuple[int, int]:
    """(descriptor, size) of a regular file that can be read; anything else (a directory, a pipe,
    a device, no permission) is a ModelFileError.  Opened without blocking and checked on the open
    descriptor, so a named pipe never stalls the open and cannot be swapped in after the check."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except PermissionError:
        raise ModelFileError(path, None, "cannot be read: permission denied") from None
    except FileNotFoundError:
        raise ModelFileError(path, None, "no such file") from None
    except OSError as error:
        raise ModelFileError(path, None, f"cannot be opened: {error.strerror or error}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ModelFileError(path, None, f"is {describe_file_kind(info.st_mode)}, not a regular file")
    return fd, info.st_size


class GGUFFile:
    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        fd, self.size = open_regular_file(path)
        try:
            if self.size < _HEADER_BYTES:
                raise ModelFileError(path, None, f"is {self.size} bytes, shorter than a GGUF header ({_HEADER_BYTES})")
            try:
                self._mmap = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as error:
                raise ModelFileError(path, None, f"cannot be mapped into memory: {error}") from None
        finally:
            os.close(fd)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self._pos = 0
        if bytes(self._map[:4]) != b"GGUF":
            raise ModelFileError(path, None, f"is not a GGUF file: it starts with {bytes(self._map[:4])!r}")
        self._pos = 4
        version = self._unpack("<I", "the version")
        num_tensors, num_fields = self._unpack("<Q", "the tensor count"), self._unpack("<Q", "the metadata count")
        if version not in (2, 3):
            raise ModelFileError(path, None, f"GGUF version {version} is not supported (2 or 3)")
        # Each metadata item takes at least 13 bytes (key length, type, a one-byte value) and each
        # tensor at least 24 (name length, dimension count, type, offset).
        self._bounded(num_fields, 13, "the metadata count")
        self._bounded(num_tensors, 24, "the tensor count")
        self.fields: dict[str, object] = {}
        self.field_types: dict[str, int] = {}  # each key's GGUF value type (9 for an array)
        for index in range(num_fields):
            key = self._string(f"metadata item {index}'s key")
            if key in self.fields:
                raise ModelFileError(path, key, "the metadata key appears twice")
            kind = self._unpack("<I", key)
            self.fields[key] = self._value(kind, key, 0)
            self.field_types[key] = kind
        infos = [self._tensor_info(index) for index in range(num_tensors)]
        self.alignment = self._alignment()
        self.data_start = -(-self._pos // self.alignment) * self.alignment
        self.tensors = self._tensors(gguf, infos)

    # --- header primitives: each checks the bytes it needs are in the file -------------

    def _need(self, count: int, item: str) -> None:
        if count > self.size - self._pos:
            raise ModelFileError(
                self.path,
                item,
                f"needs {count} bytes at byte {self._pos}, past the end of the file ({self.size} bytes): truncated "
                "or damaged",
            )

    def _bounded(self, count: int, min_bytes: int, item: str) -> None:
        """A count of things of at least `min_bytes` each must fit in what is left of the file."""
        if count * min_bytes > self.size - self._pos:
            left = self.size - self._pos
            problem = f"{item} {count} cannot fit in the {left} bytes left: truncated or damaged"
            raise ModelFileError(self.path, None, problem)

    def _unpack(self, fmt: str, item: str):
        size = struct.calcsize(fmt)
        self._need(size, item)
        (value,) = struct.unpack_from(fmt, self._mmap, self._pos)
        self._pos += size
        return value

    def _string(self, item: str, limit: int | None = None) -> str:
        length = self._unpack("<Q", item)
        if limit is not None and length > limit:
            raise ModelFileError(self.path, item, f"a string of {length} bytes (at most {limit} here)")
        self._need(length, item)
        raw = bytes(self._map[self._pos : self._pos + length])
        self._pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, item, f"is not valid UTF-8 (at byte {self._pos - length})") from None

    def _value(self, kind: int, key: str, depth: int):
        if kind == _STRING:
            return self._string(key)
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            self._need(dtype.itemsize, key)
            value = np.frombuffer(self._mmap, dtype, 1, self._pos)[0].item()
            self._pos += dtype.itemsize
            return value
        if kind != _ARRAY:
            raise ModelFileError(self.path, key, f"unknown GGUF value type {kind}")
        if depth >= MAX_ARRAY_NESTING:
            raise ModelFileError(self.path, key, f"arrays nested more than {MAX_ARRAY_NESTING} deep")
        item, count = self._unpack("<I", key), self._unpack("<Q", key)
        if item == _STRING:
            self._bounded(count, 8, f"{key}: the array length")
            for _ in range(count):
                length = self._unpack("<Q", key)  # (read before _pos is added to: the read moves it)
                self._need(length, key)
                self._pos += length
            return StringArray(count)
        if item == _ARRAY:
            self._bounded(count, 12, f"{key}: the array length")
            return [self._value(item, key, depth + 1) for _ in range(count)]
        if item not in _SCALARS:
            raise ModelFileError(self.path, key, f"an array of unknown GGUF value type {item}")
        dtype = np.dtype(_SCALARS[item])
        self._bounded(count, dtype.itemsize, f"{key}: the array length")
        values = np.frombuffer(self._mmap, dtype, count, self._pos).tolist()
        self._pos += dtype.itemsize * count
        return values

    def _tensor_info(self, index: int) -> _TensorInfo:
        name = self._string(f"tensor {index}'s name", limit=MAX_TENSOR_NAME)
        n_dims = self._unpack("<I", name)
        if n_dims > MAX_DIMS:
            raise ModelFileError(self.path, f"tensor {name!r}", f"{n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(self._unpack("<Q", name) for _ in range(n_dims))
        return _TensorInfo(name, dims, self._unpack("<I", name), self._unpack("<Q", name))

    def _alignment(self) -> int:
        if "general.alignment" not in self.fields:
            return 32
        alignment = self.fields["general.alignment"]
        if self.field_types["general.alignment"] not in _INTEGER_TYPES or isinstance(alignment, bool):
            raise ModelFileError(self.path, "general.alignment", f"is not an integer: {alignment!r}")
        if alignment < 1 or alignment & (alignment - 1) or alignment > 2**20:
            raise ModelFileError(self.path, "general.alignment", f"{alignment} is not a power of two up to 2^20")
        return int(alignment)

    # --- tensors: types, shapes and bytes inside the file, laid out one after another ---

    def _tensors(self, gguf, infos: list[_TensorInfo]) -> list[GGUFTensor]:
        """Each tensor checked, and their data laid out as llama.cpp requires: one after another in
        the order listed, each at the previous one's end rounded up to the alignment (so no two
        overlap, and no type or shape can change without moving every offset after it)."""
        seen: set[str] = set()
        checked = []
        expected = 0
        # A layout out of order is raised by check_gguf after the tensors' names and shapes are
        # checked, which name the fault itself (a missing tensor, a wrong shape) where there is one.
        self.layout_error: ModelFileError | None = None
        for info in infos:
            item = f"tensor {info.name!r}"
            if info.name in seen:
                raise ModelFileError(self.path, item, "appears twice in the file")
            seen.add(info.name)
            try:
                tensor_type = gguf.GGMLQuantizationType(info.kind)
            except ValueError:
                raise ModelFileError(self.path, item, f"unknown tensor type {info.kind}") from None
            if tensor_type.name not in WEIGHT_TYPES:
                raise ModelFileError(
                    self.path, item, f"tensor type {tensor_type.name} is not one the engine reads as weights"
                )
            if any(d < 1 for d in info.dims):
                raise ModelFileError(self.path, item, f"a dimension of 0 in {list(info.dims)}")
            elements = 1
            for d in info.dims:
                elements *= d
                if elements > MAX_ELEMENTS:
                    raise ModelFileError(self.path, item, f"dimensions {list(info.dims)} are too large")
            block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
            if (info.dims[0] if info.dims else 1) % block:
                rows = info.dims[0] if info.dims else 1
                raise ModelFileError(
                    self.path, item, f"rows of {rows} values do not fill whole {tensor_type.name} blocks of {block}"
                )
            n_bytes = elements * type_size // block
            if info.offset % self.alignment:
                raise ModelFileError(
                    self.path, item, f"data offset {info.offset} is not a multiple of {self.alignment}"
                )
            first = self.data_start + info.offset
            if first + n_bytes > self.size:
                raise ModelFileError(
                    self.path,
                    item,
                    f"its {n_bytes} bytes at offset {info.offset} run past the end of the file "
                    f"({self.size} bytes): truncated or damaged",
                )
            if info.offset != expected and self.layout_error is None:
                self.layout_error = ModelFileError(
                    self.path,
                    item,
                    f"data offset {info.offset}, expected {expected}: the tensors' data must follow one another in "
                    "the order listed (another tensor's type or shape does not match its bytes, or the data overlap)",
                )
            expected = -(-(info.offset + n_bytes) // self.alignment) * self.alignment
            checked.append((info, tensor_type, elements, n_bytes, first))
        return [self._view(gguf, *entry) for entry in checked]

    def _view(self, gguf, info: _TensorInfo, tensor_type, elements: int, n_bytes: int, first: int) -> GGUFTensor:
        shape = tuple(reversed(info.dims))
        typed = {"F32": np.float32, "F16": np.float16}.get(tensor_type.name)
        if typed is not None:
            data = np.frombuffer(self._mmap, typed, elements, first).reshape(shape)
        else:
            data = self._map[first : first + n_bytes].reshape(gguf.quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(info.name, info.dims, tensor_type, n_bytes, data)
