"""Which model class runs which architecture."""

from __future__ import annotations

from pagedllm.models.config import ModelConfig
from pagedllm.models.gemma3 import Gemma3Model
from pagedllm.models.llama import LlamaModel
from pagedllm.models.qwen3_moe import Qwen3MoeModel

# llama, mistral, qwen2, qwen3, phi3, smollm3 and granite differ only in options of the llama
# layers (see llama.py).
MODEL_CLASSES: dict[str, type[LlamaModel]] = {"gemma3": Gemma3Model, "qwen3_moe": Qwen3MoeModel}


def model_class(config: ModelConfig) -> type[LlamaModel]:
    return MODEL_CLASSES.get(config.architecture, LlamaModel)
