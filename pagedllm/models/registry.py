"""Which model class runs which architecture."""

from __future__ import annotations

from pagedllm.models.config import ModelConfig
from pagedllm.models.gemma3 import Gemma3Model
from pagedllm.models.llama import LlamaModel

# llama, mistral, qwen2 and qwen3 differ only in options of the llama layers (see llama.py).
MODEL_CLASSES: dict[str, type[LlamaModel]] = {"gemma3": Gemma3Model}


def model_class(config: ModelConfig) -> type[LlamaModel]:
    return MODEL_CLASSES.get(config.architecture, LlamaModel)
