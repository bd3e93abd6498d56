"""pagedllm: an LLM inference engine built around PagedAttention."""

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
