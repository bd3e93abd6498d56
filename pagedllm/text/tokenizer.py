"""Tokenizer and chat template, from the same source as the weights."""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

from pagedllm.cache_dir import cache_dir
from pagedllm.errors import ModelFileError

logger = logging.getLogger("pagedllm")


# What a base model (no chat template) answers to a chat: where plain text goes instead.
NO_CHAT_TEMPLATE = (
    "{name} has no chat template (a base model): send plain text instead: `pagedllm generate --raw`, "
    "the server's /v1/completions, or LLM.generate()"
)


# The tokenizers this process has built from GGUF files, by file identity: loading one takes
# 0.2 s (SmolLM2's 49k tokens) to 3 s (Gemma 3's 262k) even from the on-disk cache, and a process
# that starts several engines on one file (tests, notebooks) needs it once.  Each Tokenizer gets
# a shallow copy, so one that sets its own attributes (a chat template) changes no other; the
# Rust backend is shared, which encoding and decoding only read.
_LOADED: dict[str, Any] = {}
_LOADED_LOCK = threading.Lock()


class Tokenizer:
    """A thin wrapper over a transformers tokenizer: encode, decode, chat template."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.path = path
        if path.suffix == ".gguf":
            # Building a tokenizer from GGUF metadata takes 0.4-6 s; keep the result on disk.
            stat = path.stat()
            source = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:direct"  # `direct`: how it was built
            with _LOADED_LOCK:
                loaded = _LOADED.get(source)
            if loaded is None:
                loaded = _load_gguf_tokenizer(path, source)
                with _LOADED_LOCK:
                    _LOADED[source] = loaded
            self.hf = copy.copy(loaded)
        else:
            self.hf = _build(lambda p: AutoTokenizer.from_pretrained(str(p)), path)
        # A fast tokenizer without the space clean-up decodes to the same text through its Rust
        # backend directly, ~2-3 us sooner per call; the detokenizer calls it twice per request
        # and step (~0.6 ms a step at 128 requests).
        backend = getattr(self.hf, "_tokenizer", None)
        cleans_up = getattr(self.hf, "clean_up_tokenization_spaces", True)
        self._backend_decode = backend.decode if backend is not None and not cleans_up else None

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=True)
        return self.hf.decode(token_ids, skip_special_tokens=True)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (Qwen, Hermes and others)."""
        return "tools" in (self.hf.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError(NO_CHAT_TEMPLATE.format(name=self.path.name))
        extra = {"tools": tools} if tools else {}
        try:
            ids = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **extra)
        except Exception as error:  # the template is the model file's: its raise_exception(), undefined names
            detail = getattr(error, "message", None) or str(error) or type(error).__name__
            raise ValueError(f"{self.path.name}: the chat template failed on these messages: {detail}") from None
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _load_gguf_tokenizer(path: Path, source: str):
    """The tokenizer of a GGUF file from the on-disk cache, or built from its metadata and saved there."""
    from transformers import AutoTokenizer

    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    cached = cache_dir("tokenizers", key)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("building the tokenizer from %s (once; cached under %s)", path.name, cached.parent)
    tokenizer = _build(_tokenizer_from_gguf, path)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def _build(make, path: Path):
    """The tokenizer `make` builds from the model's files; whatever the files make it fail with is
    one line naming the file (they are untrusted input), never a traceback from the library."""
    try:
        return make(path)
    except Exception as error:  # the conversion libraries raise anything on a damaged vocabulary
        detail = " ".join(str(error).split())[:300]
        raise ModelFileError(path, "tokenizer", f"cannot be built ({type(error).__name__}: {detail})") from None


def _tokenizer_from_gguf(path: Path):
    """The tokenizer a GGUF's metadata describes: its vocabulary, merges, pre-tokenizer type
    (`tokenizer.ggml.pre`: llama-bpe, qwen2, ...), special tokens and chat template, converted by
    transformers' GGUF tokenizer mapping.  Called directly rather than through
    `AutoTokenizer.from_pretrained(gguf_file=...)`, which gives the same tokens
    (tests/test_model_families.py) but also reads the model's config, so it refuses
    architectures transformers does not map from GGUF (granite, smollm3) and takes 5-25 s
    longer on the bundled files."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    settings = {key: value for key, value in tokenizer_config.items() if value is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
