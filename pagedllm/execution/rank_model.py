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
from pagedllm.execution.device import resolve_dtype, select_device
from pagedllm.execution.startup_checks import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    available_memory_bytes,
    check_kv_cache_memory,
    check_max_model_len,
    fit_max_model_len,
    format_bytes,
)
from pagedllm.layers.attention import cpp_attention, select_attention
from pagedllm.layers.fused_decode import FusedDecode, fused_decode_enabled
from pagedllm.layers.fused_ops import CppOps, LayerOps, select_ops
from pagedllm.layers.linear import resolve_linear_backend
from pagedllm.layers.tensor_parallel import TensorParallel
from pagedllm.models.config import ModelConfig
from pagedllm.models.llama import AttentionFn, LlamaModel
from pagedllm.models.loader import load_weights, resolve_model_path
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
    linear_backend: str
    max_model_len: int
    num_blocks: int
    bytes_per_token: int  # KV bytes of one token in one block on this rank (a layer group's layers, K and V)
    groups: LayerGroups  # the layers one block holds, and which groups free blocks out of their window
    memory_plan: str | None = None  # CUDA: how the device's memory was shared out (logged at start)


def select_fused_decode(model: LlamaModel, ops: LayerOps, attention: AttentionFn) -> FusedDecode | None:
    """The one-call decode step where this rank runs the C++ kernels for both attention and the
    elementwise ops (and PAGEDLLM_FUSED_DECODE is not 0) and the model's layers fit it."""
    if not (fused_decode_enabled() and isinstance(ops, CppOps) and attention is cpp_attention):
        return None
    return model.build_fused_decode(ops.kernels)


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
    if not on_cuda:
        kv_budget = kv_budget or DEFAULT_CPU_KV_CACHE_MEMORY
        # Spawned ranks share this machine, so rank 0 checks the whole budget; launched ranks
        # (possibly on other machines) each check their own share.
        if config.distributed_init_method is not None:
            check_kv_cache_memory(kv_budget // tp.size, available_memory_bytes())
        elif tp.rank == 0:
            check_kv_cache_memory(kv_budget, available_memory_bytes())
    model_config, weights = load_weights(path)
    check_tensor_parallel_size(model_config, tp.size)
    max_model_len = check_max_model_len(config.max_model_len, model_config.max_position_embeddings)
    shard = ShardLayout.for_rank(model_config, tp)

    attention = select_attention(config.attention, model_config.head_dim, device)
    # The fused elementwise kernels come with the C++ attention kernels (attention auto or cpp).
    ops = select_ops("auto" if config.attention in ("auto", "cpp") else "torch", dtype, device)
    linear_backend = "torch" if on_cuda else resolve_linear_backend(config.linear, dtype)
    with torch.device(device):  # parameters and rotary tables are created on the device
        model = model_class(model_config)(model_config, dtype, max_model_len, attention, tp, ops)
    # linear=auto adds the small-batch packed GEMM (and its packed weight copy) where it runs; a named
    # backend is used alone.
    model.load_hf_weights(shard_hf_weights(weights, model_config, tp), linear_backend, config.linear == "auto")
    model.fused_decode = select_fused_decode(model, ops, attention)
    del weights
    return_freed_memory()

    c = model_config
    groups = group_layers(c.layer_windows, config.window_freeing and config.kv_layout == "paged")
    bytes_per_token = 2 * groups.group_size * shard.num_kv_heads * c.head_dim * dtype.itemsize
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
        linear_backend,
        fitted,
        num_blocks,
        bytes_per_token,
        groups,
        memory_plan,
    )
