"""A GGUF's metadata values read with their types and ranges checked: an integer key holds an
integer within the range the engine can run, a float key a finite number, a string key a string.
A value outside gets a ModelFileError naming the key; nothing is sized by a value before it
passes here."""

from __future__ import annotations

import math
import re
from pathlib import Path

from pagedllm.errors import ModelFileError
from pagedllm.models.gguf_file import StringArray

_MISSING = object()


def _raw(reader, key: str, default):
    value = reader.fields.get(key, _MISSING)
    return default if value is _MISSING else value


def meta_int(reader, path: Path, key: str, default, low: int, high: int) -> int:
    """An integer key within [low, high]; `default` where the file does not have it (None: required)."""
    value = _raw(reader, key, default)
    if value is None and default is None:
        raise ModelFileError(path, key, "is missing (the model's shape needs it)")
    if isinstance(value, list):
        raise ModelFileError(
            path,
            key,
            f"holds an array of {len(value)} values where one integer is expected (per-layer values are not supported)",
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(path, key, f"is not an integer: {_show(value)}")
    if not low <= value <= high:
        raise ModelFileError(path, key, f"{value} is out of range [{low}, {high}]")
    return value


def meta_float(reader, path: Path, key: str, default, low: float, high: float) -> float:
    """A finite number within (low, high]."""
    value = _raw(reader, key, default)
    if value is None and default is None:
        raise ModelFileError(path, key, "is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFileError(path, key, f"is not a number: {_show(value)}")
    value = float(value)
    if not math.isfinite(value) or not low < value <= high:
        raise ModelFileError(path, key, f"{value} is not a finite number in ({low:g}, {high:g}]")
    return value


def meta_str(reader, path: Path, key: str, default: str | None = None) -> str:
    value = _raw(reader, key, default)
    if value is None:
        raise ModelFileError(path, key, "is missing")
    if not isinstance(value, str):
        raise ModelFileError(path, key, f"is not a string: {_show(value)}")
    return value


def meta_token_id(reader, path: Path, key: str, vocab_size: int) -> int | None:
    """A special token's id, which must name a token of the vocabulary; None where not set."""
    if key not in reader.fields:
        return None
    return meta_int(reader, path, key, None, 0, vocab_size - 1)


def _show(value) -> str:
    if isinstance(value, StringArray):
        return f"an array of {value.length} strings"
    if isinstance(value, list):
        return f"an array of {len(value)} values"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# llama.cpp's token types: undefined, normal, unknown, control, user-defined, unused, byte.
MAX_TOKEN_TYPE = 6
# A pre-tokenizer name as llama.cpp's converter writes them (llama-bpe, qwen2, deepseek-r1-qwen, ...):
# one the tokenizer conversion does not know splits text as GPT-2 does (transformers' rule).
_PRE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Token ids the tokenizer is built with: each must lie in the vocabulary.
SPECIAL_TOKEN_KEYS = tuple(
    f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding", "seperator", "eot", "eom")
)


def check_tokenizer_metadata(reader, path: Path, vocab_size: int) -> None:
    """The vocabulary the tokenizer is built from: as many tokens as the embedding has rows, per-
    token arrays of the same length, special ids inside it, and a chat template that parses."""
    tokens = _raw(reader, "tokenizer.ggml.tokens", None)
    if tokens is not None:
        if not isinstance(tokens, StringArray):
            raise ModelFileError(path, "tokenizer.ggml.tokens", f"is not an array of strings: {_show(tokens)}")
        if tokens.length != vocab_size:
            raise ModelFileError(
                path,
                "tokenizer.ggml.tokens",
                f"{tokens.length} tokens, but the embedding token_embd.weight has {vocab_size} rows",
            )
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            values = _raw(reader, key, None)
            if values is not None and (not isinstance(values, list) or len(values) != tokens.length):
                raise ModelFileError(path, key, f"{_show(values)}, not one per token ({tokens.length})")
        types = _raw(reader, "tokenizer.ggml.token_type", None)
        if types:
            low, high = min(types), max(types)
            if not (isinstance(low, int) and isinstance(high, int)) or low < 0 or high > MAX_TOKEN_TYPE:
                raise ModelFileError(
                    path,
                    "tokenizer.ggml.token_type",
                    f"values [{low}, {high}] outside llama.cpp's types 0-{MAX_TOKEN_TYPE}",
                )
    pre = _raw(reader, "tokenizer.ggml.pre", None)
    if pre is not None and (not isinstance(pre, str) or not _PRE_NAME.fullmatch(pre)):
        raise ModelFileError(path, "tokenizer.ggml.pre", f"{_show(pre)} is not a pre-tokenizer name")
    for key in SPECIAL_TOKEN_KEYS:
        meta_token_id(reader, path, key, vocab_size)
    template = _raw(reader, "tokenizer.chat_template", None)
    if template is not None:
        if not isinstance(template, str):
            raise ModelFileError(path, "tokenizer.chat_template", f"is not a string: {_show(template)}")
        check_chat_template(template, path, "tokenizer.chat_template")


def check_chat_template(template: str, path: Path, item: str) -> None:
    """A chat template must compile as transformers compiles it (its Jinja extensions included)."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template)
    except ImportError:  # another transformers layout: plain Jinja with the loop controls
        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        except jinja2.TemplateError as error:
            raise ModelFileError(path, item, f"does not parse as a Jinja template: {error}") from None
    except jinja2.TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise ModelFileError(path, item, f"does not parse as a Jinja template{line}: {error.message}") from None
