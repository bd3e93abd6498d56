"""LoRA adapters from PEFT directories (`adapter_config.json` + `adapter_model.safetensors`) or,
through pagedllm/models/lora_gguf.py, llama.cpp's GGUF adapters, read as untrusted input: every
setting the engine does not run is refused by name, every tensor's name, shape and values are
checked against the base model before anything is used.

An adapter adds `scale * B @ A` to a projection's weight, where A is [rank, in] and B [out, rank];
`scale` is lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA.  The engine never merges it:
each step adds `scale * (x @ A.T) @ B.T` to the base projection's output for the rows of the
requests that name the adapter (pagedllm/layers/lora.py)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.errors import ModelFileError
from pagedllm.models.checkpoint_dir import read_safetensors_header
from pagedllm.models.config import ModelConfig

# The projections an adapter may target, by their names in a llama-style checkpoint.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter, checked against a base model: per layer, per targeted projection, (A, B) in
    float32 with the scale folded into B."""

    path: Path
    rank: int
    scale: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection an adapter may target."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hidden, inter = c.hidden_size, c.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def adapter_digest(path: str | Path) -> str:
    """A digest of the adapter's files (a PEFT directory's config and weights, or a GGUF file): two
    files with one digest hold one adapter, so KV computed under one serves the other."""
    path = Path(path)
    files = [path / "adapter_config.json", path / "adapter_model.safetensors"] if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path`: a PEFT directory, or a GGUF file as llama.cpp's converter writes it
    (pagedllm/models/lora_gguf.py)."""
    path = Path(path)
    if not path.is_dir():
        from pagedllm.models.lora_gguf import is_gguf_file, read_gguf_adapter

        if is_gguf_file(path):
            return read_gguf_adapter(path, config, max_rank)
    return read_peft_adapter(path, config, max_rank)


def read_peft_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The PEFT LoRA adapter in directory `path`, checked against `config`; a ModelFileError names
    what is wrong or not supported."""
    path = Path(path)
    if not path.is_dir():
        problem = "is neither a directory nor a GGUF file (a LoRA adapter is a PEFT directory or a GGUF adapter)"
        raise ModelFileError(path, None, problem)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ModelFileError(path, None, f"has no {needed.name} (a PEFT LoRA adapter has both files)")
    settings = _read_settings(config_file)
    rank, alpha = settings["r"], settings["lora_alpha"]
    if rank > max_rank:
        raise ModelFileError(config_file, "r", f"rank {rank} is over the engine's max_lora_rank of {max_rank}")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank

    shapes = read_safetensors_header(weights_file)
    expected = projection_shapes(config)
    pairs: dict[tuple[int, str], dict[str, str]] = {}  # (layer, projection) -> {"A": name, "B": name}
    for name, shape in shapes.items():
        item = f"tensor {name!r:.120}"
        match = _KEY.match(name)
        if match is None:
            what = "an embedding or LM head adapter" if ("embed" in name or "lm_head" in name) else "not a LoRA weight"
            raise ModelFileError(weights_file, item, f"is {what}; only q/k/v/o/gate/up/down are supported")
        layer, module, side = int(match[1]), match[3], match[4]
        if module not in expected:
            raise ModelFileError(weights_file, item, f"targets {module!r}, not one of {', '.join(TARGETS)}")
        if layer >= config.num_layers:
            raise ModelFileError(weights_file, item, f"names layer {layer}; the model has {config.num_layers}")
        out_features, in_features = expected[module]
        want = (rank, in_features) if side == "A" else (out_features, rank)
        if tuple(shape) != want:
            problem = f"has shape {list(shape)}; rank {rank} on this model needs {list(want)}"
            raise ModelFileError(weights_file, item, problem)
        pairs.setdefault((layer, module), {})[side] = name
    for (layer, module), sides in pairs.items():
        if len(sides) != 2:
            missing = "B" if "A" in sides else "A"
            raise ModelFileError(weights_file, f"layer {layer} {module}", f"has no lora_{missing} beside its lora_A/B")
    if not pairs:
        raise ModelFileError(weights_file, None, "holds no LoRA weights")

    from safetensors.torch import load_file  # the header above was checked against the file first

    tensors = load_file(str(weights_file))
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), sides in sorted(pairs.items()):
        a, b = tensors[sides["A"]].float(), tensors[sides["B"]].float()
        for side, values in (("A", a), ("B", b)):
            if not torch.isfinite(values).all():
                raise ModelFileError(weights_file, f"layer {layer} {module} lora_{side}", "holds NaN or infinity")
        layers[layer][module] = (a.contiguous(), (b * scale).contiguous())
    return LoraAdapter(path, rank, scale, layers)


def _read_settings(file: Path) -> dict:
    """adapter_config.json, with every setting that changes the math checked."""
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelFileError(file, None, f"is over {MAX_CONFIG_BYTES} bytes")
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ModelFileError(file, None, f"is not valid JSON: {error}") from None
    if not isinstance(settings, dict):
        raise ModelFileError(file, None, "is not a JSON object")
    kind = settings.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelFileError(file, "peft_type", f"{kind!r:.40} adapters are not supported (LoRA only)")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) is not supported",
        "lora_bias": "LoRA biases are not supported",
        "modules_to_save": "modules_to_save (whole trained copies of modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layer_replication": "layer_replication is not supported",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
        "trainable_token_indices": "trained token embeddings (trainable_token_indices) are not supported",
        "target_parameters": "adapters on parameters (target_parameters) are not supported",
        "use_qalora": "QA-LoRA is not supported",
        "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
        "arrow_config": "Arrow routing between adapters is not supported",
        "kasa_config": "KaSA adapters are not supported",
        "monteclora_config": "MonteCLoRA adapters are not supported",
        "velora_config": "VeLoRA adapters are not supported",
    }
    for key, problem in refused.items():
        if settings.get(key):
            raise ModelFileError(file, key, problem)
    if settings.get("bias", "none") != "none":
        raise ModelFileError(file, "bias", f"bias={settings['bias']!r:.40}: trained biases are not supported")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelFileError(file, "r", f"{rank!r:.40} is not a positive integer rank")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelFileError(file, "lora_alpha", f"{alpha!r:.40} is not a finite number")
    return settings | {"r": rank, "lora_alpha": float(alpha)}
