"""Random LoRA adapters in PEFT's directory format, for tests and for trying adapters on a model
without training one (`scripts/make_lora_adapter.py`).  Written without PEFT: its
`adapter_config.json` and `adapter_model.safetensors`, tensors named as PEFT names them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.models.config import ModelConfig
from pagedllm.models.lora_files import TARGETS, projection_shapes


def write_random_adapter(
    path: str | Path,
    config: ModelConfig,
    rank: int = 16,
    alpha: float = 32.0,
    targets: tuple[str, ...] = TARGETS,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A rank-`rank` adapter on every layer's `targets`, A and B drawn from N(0, std) (seeded), at `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for name in targets:
            out_features, in_features = shapes[name]
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
    from safetensors.torch import save_file

    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return path
