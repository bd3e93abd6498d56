"""pagedllm: an LLM inference engine built around PagedAttention."""

from pagedllm.config import EngineConfig
from pagedllm.llm import LLM
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
