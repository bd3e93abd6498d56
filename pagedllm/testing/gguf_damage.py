"""Damaged copies of a good GGUF file, one fault each, for the model-file fuzz tests.

The good file's header is read into an editable form (metadata items as raw bytes, tensor
infos as numbers), changed, and written back ahead of the original tensor data, so each fault is
exactly the one named: a metadata value, a count, a tensor's shape, type or offset, a cut.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class Item:
    key: str
    kind: int
    payload: bytes  # the value's bytes as the file stores them (after the type)


@dataclass
class TensorInfo:
    name: str
    dims: list[int]
    kind: int
    offset: int


@dataclass
class Header:
    version: int
    items: list[Item]
    tensors: list[TensorInfo]
    data_start: int  # in the good file
    alignment: int = 32
    # Counts written in place of the real ones (None: the real ones).
    num_items: int | None = None
    num_tensors: int | None = None
    extra: bytes = field(default=b"")  # raw bytes appended after the tensor infos

    def item(self, key: str) -> Item:
        return next(i for i in self.items if i.key == key)

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def value(kind: int, v) -> bytes:
    """A scalar or string value's bytes."""
    return _string(v) if kind == STRING else struct.pack(_SCALAR_FORMATS[kind], v)


def _skip_value(buf: bytes, pos: int, kind: int) -> int:
    if kind == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if kind in _SCALAR_FORMATS:
        return pos + struct.calcsize(_SCALAR_FORMATS[kind])
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALAR_FORMATS:
        return pos + count * struct.calcsize(_SCALAR_FORMATS[item])
    for _ in range(count):
        pos = _skip_value(buf, pos, item)
    return pos


def _read_string(buf: bytes, pos: int) -> tuple[str, int]:
    length = struct.unpack_from("<Q", buf, pos)[0]
    return buf[pos + 8 : pos + 8 + length].decode(), pos + 8 + length


def read_header(path: Path) -> Header:
    """A good GGUF file's header, editable."""
    with open(path, "rb") as f:
        buf = f.read(64 * 2**20)  # headers of the bundled models are a few MB
    version, num_tensors, num_items = struct.unpack_from("<IQQ", buf, 4)
    pos = 24
    items = []
    for _ in range(num_items):
        key, pos = _read_string(buf, pos)
        kind = struct.unpack_from("<I", buf, pos)[0]
        end = _skip_value(buf, pos + 4, kind)
        items.append(Item(key, kind, buf[pos + 4 : end]))
        pos = end
    tensors = []
    for _ in range(num_tensors):
        name, pos = _read_string(buf, pos)
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        pos += 4 + 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        tensors.append(TensorInfo(name, dims, kind, offset))
    alignment = 32
    for item in items:
        if item.key == "general.alignment":
            alignment = struct.unpack("<I", item.payload)[0]
    return Header(version, items, tensors, -(-pos // alignment) * alignment, alignment)


def header_bytes(header: Header) -> bytes:
    out = [b"GGUF", struct.pack("<I", header.version)]
    out.append(struct.pack("<Q", len(header.tensors) if header.num_tensors is None else header.num_tensors))
    out.append(struct.pack("<Q", len(header.items) if header.num_items is None else header.num_items))
    for item in header.items:
        out += [_string(item.key), struct.pack("<I", item.kind), item.payload]
    for t in header.tensors:
        out += [_string(t.name), struct.pack("<I", len(t.dims)), struct.pack(f"<{len(t.dims)}Q", *t.dims)]
        out.append(struct.pack("<IQ", t.kind, t.offset))
    out.append(header.extra)
    return b"".join(out)


def write(good: Path, header: Header, out: Path, data_alignment: int | None = None) -> Path:
    """The header, padded to the alignment, then the good file's tensor data."""
    raw = header_bytes(header)
    alignment = data_alignment or header.alignment
    with open(out, "wb") as f:
        f.write(raw + b"\0" * (-len(raw) % alignment))
        with open(good, "rb") as src:
            src.seek(header.data_start)
            shutil.copyfileobj(src, f, 16 * 2**20)
    return out


def set_item(header: Header, key: str, kind: int, v) -> Header:
    """The header with `key` holding `v` of type `kind` (added when absent)."""
    items = [i for i in header.items if i.key != key] + [Item(key, kind, value(kind, v))]
    return replace(header, items=items)


def map_tensor(header: Header, name: str, change: Callable[[TensorInfo], TensorInfo]) -> Header:
    return replace(header, tensors=[change(t) if t.name == name else t for t in header.tensors])
