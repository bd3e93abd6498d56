"""Which device and dtype a rank runs on.

`device`: auto | cpu | cuda | cuda:N.  auto is CUDA when torch sees a GPU, else the CPU.
`dtype`: auto | float32 | bfloat16.  auto is bfloat16 on CUDA and on CPUs with native bfloat16
matmuls (AVX512-BF16 or AMX), float32 elsewhere (AVX2: bfloat16 there is emulated and slower).
The facts about the machine come in as arguments to `resolve_device`, so its rules are tested
without a GPU.
"""

from __future__ import annotations

import torch

from pagedllm.layers.cpu_kernels import cpu_flags
from pagedllm.layers.tensor_parallel import TensorParallel


def resolve_device(name: str, cuda_available: bool, cuda_device_count: int, torch_cuda_version: str | None) -> str:
    """'cpu', or 'cuda:N' (a plain 'cuda' is device 0); a clear error for a device that is not there."""
    if name == "auto":
        return "cuda:0" if cuda_available else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        index_text = name.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
        if not cuda_available:
            why = "this torch is a CPU-only build" if torch_cuda_version is None else "torch sees no CUDA GPU"
            raise ValueError(
                f"device={name!r} needs a CUDA GPU, but {why} (torch.cuda.is_available() is False); "
                "use --device cpu (or auto, which picks the CPU here)"
            )
        index = int(index_text)
        if index >= cuda_device_count:
            raise ValueError(
                f"device={name!r}: torch sees {cuda_device_count} CUDA device(s), numbered 0 to {cuda_device_count - 1}"
            )
        return f"cuda:{index}"
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def cpu_has_native_bf16() -> bool:
    """True where bfloat16 matmuls beat float32: AVX512-BF16 or AMX (`benchmarks/linear_backends.py
    --compare-dtypes` measures it)."""
    flags = set(cpu_flags().split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") or cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
# An 8-bit cache: float8 e4m3 (torch.float8_e4m3fn), written rounded to nearest and saturated at
# +-448, read by the C++ attention kernels only.
FLOAT8_NAMES = ("float8_e4m3", "fp8")


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: str, cpp_attention: bool) -> torch.dtype:
    """The KV cache's element type: the model's dtype, or float16 beside float32 on the CPU (`auto`
    takes it where the C++ attention kernels run: they read float16 keys and values in registers,
    so attention reads half the bytes; the torch paths convert whole blocks first), or float8 e4m3
    beside either dtype where the C++ attention kernels run (asked for, never `auto`: it rounds
    every key and value to 3 mantissa bits)."""
    half_fits = dtype == torch.float32 and device == "cpu"
    if name == "auto":
        return torch.float16 if half_fits and cpp_attention else dtype
    model = str(dtype).removeprefix("torch.")
    if name in FLOAT8_NAMES:
        if device == "cpu" and cpp_attention:
            return torch.float8_e4m3fn
        where = "with the torch attention path" if device == "cpu" else f"on {device}"
        raise ValueError(
            f"kv_cache_dtype {name} runs on the CPU with the C++ attention kernels only (--attention auto or cpp), "
            f"not {where}"
        )
    wanted = _DTYPES[name]
    if wanted == dtype or (wanted == torch.float16 and half_fits):
        return wanted
    raise ValueError(
        f"kv_cache_dtype {name} does not run beside a {model} model on {device}: the KV cache holds the "
        f"model's dtype ({model}), or float16 beside float32 on the CPU, or float8_e4m3 on the CPU"
    )


def select_device(name: str, tp: TensorParallel) -> str:
    """'cpu' or 'cuda:N' for this rank: under tensor parallelism on CUDA, rank r takes device r
    (counted from the one named)."""
    device = resolve_device(name, torch.cuda.is_available(), torch.cuda.device_count(), torch.version.cuda)
    if device == "cpu" or tp.size == 1:
        return device
    index = int(device.partition(":")[2]) + tp.rank
    return resolve_device(f"cuda:{index}", True, torch.cuda.device_count(), torch.version.cuda)
