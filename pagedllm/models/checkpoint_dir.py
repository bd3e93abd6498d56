"""A Hugging Face checkpoint directory checked as untrusted input before any weight is read:
config.json's values (types and ranges), each .safetensors file's header (its length, every
tensor's dtype, shape and byte range inside the file, no two overlapping), the tensors the
config implies (tensor_checks.py), and the tokenizer's chat template.

The safetensors layout: an 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to {dtype, shape, data_offsets [begin, end)} (offsets from the end of the header),
then the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedllm.errors import ModelFileError
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_file import open_regular_file
from pagedllm.models.gguf_metadata import check_chat_template
from pagedllm.models.hf_config import config_from_hf_dict
from pagedllm.models.tensor_checks import check_tensors

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
# Element sizes of the dtypes a weight may have (loaded as float32).
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# config.json's structural fields: (lowest, highest); a value outside is refused before use.
_INT_FIELDS = {
    "num_hidden_layers": (1, 2**12),
    "hidden_size": (1, 2**20),
    "num_attention_heads": (1, 2**12),
    "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**16),
    "intermediate_size": (1, 2**20),
    "moe_intermediate_size": (0, 2**20),
    "vocab_size": (1, 2**24),
    "max_position_embeddings": (1, 2**24),
    "sliding_window": (0, 2**24),
    "num_experts": (0, 2**12),
    "num_local_experts": (0, 2**12),
    "num_experts_per_tok": (0, 2**12),
}


@dataclass(frozen=True)
class CheckedCheckpoint:
    config: ModelConfig
    files: list[Path]  # the .safetensors files, in order
    elements: int  # values over all tensors


def check_hf_dir(path: Path) -> CheckedCheckpoint:
    config_path = path / "config.json"
    fd, size = open_regular_file(config_path)
    try:
        if size > 16 * 2**20:
            raise ModelFileError(config_path, None, f"is {size} bytes; a model's config is far smaller")
        raw = os.read(fd, size)
    finally:
        os.close(fd)
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ModelFileError(config_path, None, f"is not valid JSON: {error}") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(config_path, None, "is not a JSON object")
    _check_fields(cfg, config_path)
    try:
        config = config_from_hf_dict(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as error:
        what = f"the field {error} is missing" if isinstance(error, KeyError) else str(error)
        raise ModelFileError(config_path, None, what) from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(path, None, "has no .safetensors weights")
    present: dict[str, tuple[int, ...]] = {}
    file_names: dict[str, str] = {}
    elements = 0
    for file in files:
        for name, shape in read_safetensors_header(file).items():
            ours = name.removeprefix("model.")
            if ours in present:
                raise ModelFileError(file, f"tensor {name!r}", "appears in more than one file")
            present[ours], file_names[ours] = shape, name
            elements += math.prod(shape)
    check_tensors(path, config, present, lambda name: file_names.get(name, name), refuse_extra=False)
    _check_tokenizer_config(path)
    return CheckedCheckpoint(config, files, elements)


def _check_fields(cfg: dict, path: Path) -> None:
    for key, (low, high) in _INT_FIELDS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFileError(path, key, f"is not an integer: {value!r:.60}")
        if not low <= value <= high:
            raise ModelFileError(path, key, f"{value} is out of range [{low}, {high}]")
    for key in ("rope_theta", "rms_norm_eps"):
        value = cfg.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
        ):
            raise ModelFileError(path, key, f"{value!r:.60} is not a finite positive number")
    heads, width = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    if heads and width and not cfg.get("head_dim") and width % heads:
        raise ModelFileError(path, "num_attention_heads", f"{heads} heads do not divide hidden_size {width}")
    kv = cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelFileError(path, "num_key_value_heads", f"{kv} does not divide {heads} attention heads")
    vocab = cfg.get("vocab_size")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(key)
        for token in ids if isinstance(ids, list) else [ids]:
            if token is not None and vocab and (not isinstance(token, int) or not 0 <= token < vocab):
                raise ModelFileError(path, key, f"{token!r:.60} is not a token id of the vocabulary ({vocab})")


def read_safetensors_header(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a .safetensors file's header, every entry checked against the file."""
    fd, size = open_regular_file(file)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ModelFileError(file, None, f"is {size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ModelFileError(file, None, f"its header length {length} runs past the file ({size} bytes)")
        raw = os.pread(fd, length, 8)
    finally:
        os.close(fd)

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ModelFileError(file, f"tensor {next(k for k in keys if keys.count(k) > 1)!r}", "appears twice")
        return dict(pairs)

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        if isinstance(error, ModelFileError):
            raise
        raise ModelFileError(file, None, f"its header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise ModelFileError(file, None, "its header is not a JSON object")
    data_bytes = size - 8 - length
    shapes: dict[str, tuple[int, ...]] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        item = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise ModelFileError(file, item, "its header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in FLOAT_DTYPES:
            raise ModelFileError(file, item, f"dtype {dtype!r:.40} is not a weight dtype ({', '.join(FLOAT_DTYPES)})")
        if not isinstance(shape, list) or len(shape) > 4 or not all(_count(d) for d in shape):
            raise ModelFileError(file, item, f"shape {shape!r:.60} is not a list of up to 4 sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o, 0) for o in offsets)):
            raise ModelFileError(file, item, f"data_offsets {offsets!r:.60} is not [begin, end]")
        begin, end = offsets
        if math.prod(shape) * FLOAT_DTYPES[dtype] != end - begin:
            raise ModelFileError(file, item, f"{dtype} {shape} does not take the {end - begin} bytes it is given")
        if end > data_bytes:
            raise ModelFileError(file, item, f"its bytes [{begin}, {end}) run past the file's {data_bytes} data bytes")
        shapes[name] = tuple(shape)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ModelFileError(file, f"tensor {other!r}", f"its data overlaps tensor {name!r}'s")
    return shapes


def _count(value, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= 2**48


def _check_tokenizer_config(path: Path) -> None:
    """The chat template a checkpoint's tokenizer_config.json (or chat_template.jinja) carries must parse."""
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            settings = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
            raise ModelFileError(config_file, None, f"is not valid JSON: {error}") from None
        template = settings.get("chat_template") if isinstance(settings, dict) else None
        if isinstance(template, str):
            check_chat_template(template, config_file, "chat_template")
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            check_chat_template(jinja.read_text(encoding="utf-8"), jinja, "the template")
        except (OSError, UnicodeDecodeError) as error:
            raise ModelFileError(jinja, None, f"cannot be read: {error}") from None
