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


def write_gguf_adapter(peft_dir: str | Path, out: str | Path, config: ModelConfig, tensor_type: str = "F32") -> Path:
    """The PEFT adapter in `peft_dir` as a GGUF adapter at `out`, laid out as llama.cpp's
        `convert_lora_to_gguf.py` writes one: `blk.N.attn_q.weight.lora_a` / `.lora_b` tensor names,
        the q/k `lora_b` rows interleaved per rotary pair (llama architecture), `adapter.lora.alpha`
        (rsLoRA's scale written as the alpha that gives it), tensors in F32, F16 or Q8_0 (rows too
    short for a Q8_0 block in F16)."""
    import math

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from pagedllm.models.gguf_config import GGUF_ARCHITECTURES, LAYER_NAMES, PERMUTED_QK
    from pagedllm.testing.gguf_export import interleave_rope

    peft_dir = Path(peft_dir)
    settings = json.loads((peft_dir / "adapter_config.json").read_text())
    rank, alpha = settings["r"], float(settings.get("lora_alpha", settings["r"]))
    if settings.get("use_rslora"):
        alpha = alpha * rank / math.sqrt(rank)  # llama.cpp scales by alpha / rank
    arch = {ours: theirs for theirs, ours in GGUF_ARCHITECTURES.items()}[config.architecture]
    stems = {hf: gguf_stem for gguf_stem, hf in LAYER_NAMES.items()}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    kind = gguf.GGMLQuantizationType[tensor_type]
    for name, tensor in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = name.removeprefix("base_model.model.model.layers.").split(".")
        layer, module, side = parts[0], f"{parts[1]}.{parts[2]}", parts[3][-1].lower()
        array = tensor.float().numpy()
        if side == "b" and arch in PERMUTED_QK and module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = interleave_rope(array, config.num_heads if module.endswith("q_proj") else config.num_kv_heads)
        gguf_name = f"blk.{layer}.{stems[module]}.weight.lora_{side}"
        # A row shorter than Q8_0's 32-value block (B of a rank under 32) stays F16, as llama.cpp's converter leaves it.
        if tensor_type in ("F32", "F16") or array.shape[-1] % 32:
            float_type = np.float32 if tensor_type == "F32" else np.float16
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=float_type))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)
