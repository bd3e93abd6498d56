"""LoRA adapters in llama.cpp's GGUF form (what its `convert_lora_to_gguf.py` writes), read as
untrusted input and checked against the base model like a PEFT directory.

The file says `general.type = "adapter"`, `adapter.type = "lora"` and the base's
`general.architecture`; `adapter.lora.alpha` gives the scale alpha / rank (an alpha of 0, or none,
means a scale of 1, as llama.cpp reads it).  Each adapted weight `W` of the base has two tensors,
`W.lora_a` ([rank, in] in PyTorch's order) and `W.lora_b` ([out, rank]), in F32, F16, BF16 or Q8_0.
On architectures whose q/k rows llama.cpp interleaves per rotary pair, the converter permuted the
q/k `lora_b` rows the same way; they are put back in Hugging Face's order here, as the base's
are (pagedllm/models/loader.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagedllm.errors import ModelFileError
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf_config import GGUF_ARCHITECTURES, LAYER_NAMES, PERMUTED_QK, unpermute_rope_rows
from pagedllm.models.gguf_file import GGUFFile
from pagedllm.models.gguf_metadata import meta_float, meta_str
from pagedllm.models.gguf_weights import dequantize_tensor
from pagedllm.models.lora_files import TARGETS, LoraAdapter, projection_shapes

ADAPTER_TYPES = ("F32", "F16", "BF16", "Q8_0")
# llama.cpp's layer tensor stem -> the projection an adapter may target.
_TARGET_OF = {
    gguf: hf.split(".")[1] for gguf, hf in LAYER_NAMES.items() if hf.count(".") == 1 and hf.split(".")[1] in TARGETS
}


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a regular file that starts with GGUF's magic."""
    try:
        with path.open("rb") as handle:
            return path.is_file() and handle.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The GGUF LoRA adapter at `path`, checked against `config`; a ModelFileError names what is
    wrong or not supported."""
    path = Path(path)
    reader = GGUFFile(path)
    kind = meta_str(reader, path, "general.type", "model")
    if kind != "adapter":
        raise ModelFileError(path, "general.type", f"is {kind!r:.40}: a GGUF LoRA adapter says 'adapter'")
    adapter_type = meta_str(reader, path, "adapter.type", "")
    if adapter_type != "lora":
        raise ModelFileError(path, "adapter.type", f"{adapter_type!r:.40} adapters are not supported (LoRA only)")
    if "adapter.alora.invocation_tokens" in reader.fields:
        raise ModelFileError(path, "adapter.alora.invocation_tokens", "activated LoRA is not supported")
    arch = meta_str(reader, path, "general.architecture")
    if GGUF_ARCHITECTURES.get(arch) != config.architecture:
        raise ModelFileError(path, "general.architecture", f"{arch!r:.40} is not the base model's architecture")
    alpha = meta_float(reader, path, "adapter.lora.alpha", 0.0, -1e9, 1e9)

    expected = projection_shapes(config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    rank = None
    for tensor in reader.tensors:
        layer, module, side = _parse_name(tensor.name, path, config)
        item = f"tensor {tensor.name!r:.120}"
        if tensor.tensor_type.name not in ADAPTER_TYPES:
            problem = f"is {tensor.tensor_type.name}; adapter tensors are read in {', '.join(ADAPTER_TYPES)}"
            raise ModelFileError(path, item, problem)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if len(shape) != 2:
            raise ModelFileError(path, item, f"has {len(shape)} dimensions; a LoRA factor is a matrix")
        this_rank = shape[0] if side == "a" else shape[-1]
        rank = this_rank if rank is None else rank
        out_features, in_features = expected[module]
        want = (rank, in_features) if side == "a" else (out_features, rank)
        if shape != want:
            problem = f"has shape {list(shape)}; rank {rank} on this model needs {list(want)}"
            raise ModelFileError(path, item, problem + " (every tensor of an adapter has one rank)")
        if side in pairs.setdefault((layer, module), {}):
            raise ModelFileError(path, item, "appears twice")
        pairs[(layer, module)][side] = tensor
    if rank is None:
        raise ModelFileError(path, None, "holds no LoRA weights")
    if rank > max_rank:
        raise ModelFileError(path, None, f"rank {rank} is over the engine's max_lora_rank of {max_rank}")
    scale = alpha / rank if alpha else 1.0

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), sides in sorted(pairs.items()):
        if len(sides) != 2:
            missing = "b" if "a" in sides else "a"
            raise ModelFileError(path, f"layer {layer} {module}", f"has no lora_{missing} beside its lora_a/b")
        values = {}
        for side, tensor in sides.items():
            array = dequantize_tensor(tensor.data, tensor.tensor_type, [int(d) for d in reversed(tensor.shape)])
            if not np.isfinite(array).all():
                raise ModelFileError(path, f"tensor {tensor.name!r:.120}", "holds NaN or infinity")
            values[side] = array
        b = values["b"]
        if arch in PERMUTED_QK and module in ("q_proj", "k_proj"):
            b = unpermute_rope_rows(b, config.num_heads if module == "q_proj" else config.num_kv_heads)
        a_tensor = torch.from_numpy(np.array(values["a"], dtype=np.float32))
        layers[layer][module] = (a_tensor, torch.from_numpy(np.array(b * scale, dtype=np.float32)))
    return LoraAdapter(path, rank, scale, layers)


def _parse_name(name: str, path: Path, config: ModelConfig) -> tuple[int, str, str]:
    """(layer, projection, "a" or "b") of a tensor named `blk.N.STEM.weight.lora_a|lora_b`."""
    item = f"tensor {name!r:.120}"
    stem, _, side = name.rpartition(".lora_")
    parts = stem.split(".")
    if side not in ("a", "b"):
        raise ModelFileError(path, item, "is not a LoRA weight (its name ends in neither .lora_a nor .lora_b)")
    if parts[0] in ("token_embd", "output"):
        raise ModelFileError(path, item, "is an embedding or LM head adapter; only q/k/v/o/gate/up/down are supported")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[3] != "weight":
        raise ModelFileError(path, item, "is not named blk.N.<projection>.weight.lora_a|lora_b")
    if parts[2] not in _TARGET_OF:
        raise ModelFileError(path, item, f"targets {parts[2]!r:.40}; only q/k/v/o/gate/up/down are supported")
    layer = int(parts[1])
    if layer >= config.num_layers:
        raise ModelFileError(path, item, f"names layer {layer}; the model has {config.num_layers}")
    return layer, _TARGET_OF[parts[2]], side
