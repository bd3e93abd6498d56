"""pagedllm: an LLM inference engine built around PagedAttention.

The public names load on first use, so `import pagedllm` (and the pure-Python memory core
under pagedllm.core) does not import torch until an engine is asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.outputs import RequestOutput
    from pagedllm.core.sampling_params import SamplingParams, StructuredOutput
    from pagedllm.llm import LLM

_PUBLIC = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.core.sampling_params",
    "StructuredOutput": "pagedllm.core.sampling_params",
    "EngineConfig": "pagedllm.config",
    "RequestOutput": "pagedllm.core.outputs",
}
__all__ = ["LLM", "SamplingParams", "StructuredOutput", "EngineConfig", "RequestOutput"]  # = _PUBLIC
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
