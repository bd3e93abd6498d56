"""pagedllm: an LLM inference engine built around PagedAttention."""

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams, StructuredOutput
from pagedllm.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
