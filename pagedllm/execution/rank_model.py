"""One rank's model, built from the settings: weights loaded and sliced for the rank, the
dtype, attention and linear backends chosen, and the KV cache sized (blocks and maximum model
length).  The engine builds rank 0 with it; tensor-parallel workers build the other ranks."""

from __future__ import annotations

import ctypes
import gc
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.layer_groups import LayerGroups, group_layers
from pagedllm.execution.device import resolve_dtype, resolve_kv_cache_dtype, select_device
from pagedllm.execution.fused_step import select_fused_decode
from pagedllm.execution.heap import keep_freed_memory
from pagedllm.execution.startup_checks import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    available_memory_bytes,
    check_kv_cache_memory,
    check_load_memory,
    check_max_model_len,
    default_cpu_kv_cache_memory,
    fit_max_model_len,
    format_bytes,
)
from pagedllm.layers.attention import cpp_attention, select_attention
from pagedllm.layers.fused_ops import CppOps, LayerOps, select_ops
from pagedllm.layers.linear import resolve_linear_backend
from pagedllm.layers.quantized import QuantizedSetup, QuantizedWeight, lm_head_max_rows, quantized_max_rows
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import LlamaModel
from pagedllm.models.loader import (
    forget_gguf_readers,
    gguf_tensor_bytes,
    load_weights,
    resolve_model_path,
    weight_memory_needed,
)
from pagedllm.models.registry import model_class
from pagedllm.models.sharding import ShardLayout, check_tensor_parallel_size, shard_hf_weights

logger = logging.getLogger("pagedllm")


def return_freed_memory() -> None:
    """Give the checkpoint's freed pages back to the OS (glibc keeps them otherwise): SmolLM2's
    ranks at tensor-parallel size 3, which dequantize the whole GGUF to keep a third of it,
    measured 1011-1044 MiB RSS before, 463-551 after (benchmarks/tensor_parallel.py)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass
class RankModel:
    """One rank's slice of the model, loaded, and the KV cache size every rank shares."""

    model: LlamaModel
    model_config: ModelConfig
    path: Path
    device: str  # cpu or cuda:N
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's elements: dtype, or float16 beside float32 on the CPU
    linear_backend: str
    max_model_len: int
    num_blocks: int
    bytes_per_token: int  # KV bytes of one token in one block on this rank (a layer group's layers, K and V)
    groups: LayerGroups  # the layers one block holds, and which groups free blocks out of their window
    memory_plan: str | None = None  # CUDA: how the device's memory was shared out (logged at start)
    weights: str = "dequantized"  # native: a GGUF's quantized tensors kept as they are
    weights_summary: str = ""  # what each of the file's tensor types runs as, and the resident bytes


def use_native_weights(config: EngineConfig, path: Path, device: str, tp: TensorParallel, ops: LayerOps) -> bool:
    """Whether the GGUF's quantized tensors stay quantized (weights=native, or auto where it can)."""
    if config.weights == "dequantized":
        return False
    reasons = [
        reason
        for reason, failed in (
            (f"{path.name} is not a GGUF file", path.suffix != ".gguf"),
            (f"it runs on the CPU only, not {device}", device != "cpu"),
            ("it does not run with tensor parallelism", tp.size > 1),
            ("it needs the C++ CPU kernels (attention auto or cpp, and a compiler)", not isinstance(ops, CppOps)),
        )
        if failed
    ]
    if reasons and config.weights == "native":
        raise ValueError(f"weights='native' cannot be used here: {'; '.join(reasons)}")
    return not reasons


def describe_weights(weights: dict, native: bool) -> str:
    """What the loaded tensors run as, by their file's type, e.g. 'Q4_1 x210 on the 4-bit kernels,
    Q8_0 x1 on the 8-bit kernels, float x61'."""
    counts: dict[str, int] = {}
    for weight in weights.values():
        if isinstance(weight, QuantizedWeight):
            key = f"{weight.source} on the {weight.bits}-bit kernels"
        else:
            key = "float (norms, biases" + (", types without a native kernel)" if native else ", all else)")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{count} x {key}" for key, count in counts.items())


def build_rank_model(config: EngineConfig, tp: TensorParallel) -> RankModel:
    path = resolve_model_path(config.model)
    device = select_device(config.device, tp)
    dtype = resolve_dtype(config.dtype, device)
    on_cuda = device != "cpu"
    if on_cuda:
        torch.cuda.set_device(device)
        free, total = torch.cuda.mem_get_info(device)
        in_use_at_start = total - free  # the CUDA context and other processes
    kv_budget = config.kv_cache_memory
    ops = select_ops("auto" if config.attention in ("auto", "cpp") else "torch", dtype, device)
    native = use_native_weights(config, path, device, tp, ops)
    # The weights' lower bound (from the checked header): sizes the default cache and the load check.
    weights_needed = weight_memory_needed(path, native, config.max_model_len) if not on_cuda else 0
    if not on_cuda:
        keep_freed_memory()
        if kv_budget is None and tp.size > 1:  # every rank must size the same cache: no per-rank reading
            kv_budget = DEFAULT_CPU_KV_CACHE_MEMORY
        elif kv_budget is None:
            kv_budget = default_cpu_kv_cache_memory(available_memory_bytes(), weights_needed)
        # Spawned ranks share this machine, so rank 0 checks the whole budget; launched ranks
        # (possibly on other machines) each check their own share.
        if config.distributed_init_method is not None:
            check_kv_cache_memory(kv_budget // tp.size, available_memory_bytes())
        elif tp.rank == 0:
            check_kv_cache_memory(kv_budget, available_memory_bytes())
    # (The fused elementwise kernels come with the C++ attention kernels: attention auto or cpp.)
    if not on_cuda and tp.rank == 0:
        check_load_memory(weights_needed, kv_budget // tp.size, available_memory_bytes())
    model_config, weights = load_weights(path, keep_quantized=native)
    check_tensor_parallel_size(model_config, tp.size)
    max_model_len = check_max_model_len(config.max_model_len, model_config.context_length)
    shard = ShardLayout.for_rank(model_config, tp)

    attention = select_attention(config.attention, model_config.head_dim, device)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device, attention is cpp_attention)
    linear_backend = "torch" if on_cuda else resolve_linear_backend(config.linear, dtype)
    with torch.device(device):  # parameters and rotary tables are created on the device
        model = model_class(model_config)(model_config, dtype, max_model_len, attention, tp, ops)
    quantized = (
        QuantizedSetup(ops.kernels, quantized_max_rows(dtype, ops.kernels), lm_head_max_rows(dtype, ops.kernels))
        if native
        else None
    )
    summary = describe_weights(weights, native)
    # linear=auto adds the small-batch packed GEMM (and its packed weight copy) where it runs; a named
    # backend is used alone.
    model.load_hf_weights(
        shard_hf_weights(weights, model_config, tp), linear_backend, config.linear == "auto", quantized
    )
    model.fused_decode = select_fused_decode(model, ops, attention)
    del weights
    return_freed_memory()
    resident = model.weight_bytes()
    if path.suffix == ".gguf":
        file_bytes = gguf_tensor_bytes(path)
        summary += f"; resident weights {resident / 2**20:.1f} MiB, {resident / file_bytes:.2f}x the file's "
        summary += f"{file_bytes / 2**20:.1f} MiB of tensors"
        forget_gguf_readers()
    if tp.rank == 0:
        logger.info("weights %s: %s", "native" if native else "dequantized", summary)

    c = model_config
    groups = group_layers(c.layer_windows, config.window_freeing and config.kv_layout == "paged")
    bytes_per_token = 2 * groups.group_size * shard.num_kv_heads * c.head_dim * kv_dtype.itemsize
    memory_plan = None
    if on_cuda and kv_budget is None:
        from pagedllm.execution.memory_profile import plan_kv_cache

        plan = plan_kv_cache(model, config, dtype, torch.device(device), in_use_at_start, max_model_len)
        kv_budget, memory_plan = plan.kv_cache * tp.size, plan.describe()
    elif on_cuda and kv_budget // tp.size > torch.cuda.mem_get_info(device)[0]:
        raise ValueError(
            f"kv_cache_memory {format_bytes(kv_budget)} is more than {device} has free "
            f"({format_bytes(torch.cuda.mem_get_info(device)[0])} per rank); leave it unset to size the cache "
            "from --gpu-memory-utilization"
        )
    # kv_budget is every rank's KV together; each rank holds the same blocks for its own heads.
    block_bytes = bytes_per_token * tp.size * config.block_size
    num_blocks = kv_budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory {kv_budget} bytes holds no block of {config.block_size} tokens ({block_bytes} bytes each)"
        )
    # One request at full length holds at most a block per group for each of its blocks of tokens.
    fitted = fit_max_model_len(
        max_model_len,
        config.max_model_len is not None,
        num_blocks // groups.num_groups,
        config.block_size,
        block_bytes * groups.num_groups,
    )
    if fitted < max_model_len and tp.rank == 0:
        logger.warning(
            "the KV cache holds %d tokens, fewer than the model's context length of %d: max model length lowered "
            "to %d (raise --kv-cache-memory for longer requests)",
            num_blocks // groups.num_groups * config.block_size,
            max_model_len,
            fitted,
        )
    return RankModel(
        model,
        model_config,
        path,
        device,
        dtype,
        kv_dtype,
        linear_backend,
        fitted,
        num_blocks,
        bytes_per_token,
        groups,
        memory_plan,
        "native" if native else "dequantized",
        summary,
    )
