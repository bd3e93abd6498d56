"""Settings checked at start, before anything large is allocated (pure Python).

Each check either raises a `ValueError` that names the setting and a value that
works, or returns an adjusted value that the engine logs.  The rules:

- `max_model_len` may not exceed the model's own context length (its position
  embeddings were trained up to there; beyond it the output is garbage).
- `kv_cache_memory` may not exceed 90% of the memory the machine has available
  (`MemAvailable`): the weights and the step's activations need the rest, and a
  larger request ends in the kernel's OOM killer or an allocator traceback.
- The KV cache must hold at least one request of `max_model_len` tokens.  When
  `max_model_len` was left to the model's default, it is lowered to what the
  cache holds (logged); when it was given explicitly, that is an error.
- On CUDA the KV cache gets what `gpu_memory_utilization` of the device leaves
  after the weights, a profiled forward pass at the full token budget and the
  decode graphs (`plan_gpu_memory`);
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KV_MEMORY_SHARE_OF_AVAILABLE = 0.9


def format_bytes(n: int | float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def available_memory_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file (not Linux)."""
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def check_kv_cache_memory(requested: int, available: int | None) -> None:
    if available is None:
        return
    limit = int(available * KV_MEMORY_SHARE_OF_AVAILABLE)
    if requested > limit:
        raise ValueError(
            f"kv_cache_memory {format_bytes(requested)} is more than this machine can give the KV cache: "
            f"{format_bytes(available)} of memory is available (MemAvailable) and the weights need part of it; "
            f"pass --kv-cache-memory {limit // 2**20}MiB or less"
        )


def process_memory_limit() -> int | None:
    """What this process may still map under its address-space limit (ulimit -v), or None if unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text()
        mapped = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        mapped = 0
    return max(soft - mapped, 0)


def check_load_memory(weights: int, kv_cache: int, available: int | None) -> None:
    """The weights as loaded (at least `weights` bytes, from the checked shapes) and the KV cache must
    fit in the memory the machine has available and the process may map: refused before loading,
    not ended by the OOM killer half way."""
    limit = process_memory_limit()
    rooms = {"is available": available, "this process may still map (ulimit -v)": limit}
    known = {where: room for where, room in rooms.items() if room is not None}
    if not known:
        return
    where = min(known, key=known.__getitem__)
    room = known[where]
    if weights + kv_cache <= room:
        return
    raise ValueError(
        f"the model needs at least {format_bytes(weights)} to load and the KV cache {format_bytes(kv_cache)}, but "
        f"{format_bytes(room)} {where}: pass a smaller --kv-cache-memory, or use a smaller or more quantized model"
    )


def check_max_model_len(requested: int | None, model_max_len: int) -> int:
    """The maximum model length to use: the model's own when none was asked for."""
    if requested is None:
        return model_max_len
    if requested > model_max_len:
        raise ValueError(
            f"max_model_len {requested} is longer than this model's context length of {model_max_len} tokens "
            f"(max_position_embeddings, times a RoPE scaling factor that extends it); "
            f"pass --max-model-len {model_max_len} or less"
        )
    return requested


def fit_max_model_len(max_model_len: int, explicit: bool, num_blocks: int, block_size: int, block_bytes: int) -> int:
    """`max_model_len`, lowered to the cache's capacity when it was the model's default.

    `block_bytes` is one block's KV over all layers and ranks, to say how much memory one
    request of `max_model_len` needs."""
    capacity = num_blocks * block_size
    if capacity >= max_model_len:
        return max_model_len
    needed = -(-max_model_len // block_size) * block_bytes
    if explicit or capacity < 2:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}), fewer than one request "
            f"of max_model_len {max_model_len}: pass --kv-cache-memory {-(-needed // 2**20)}MiB "
            f"or more, or --max-model-len {capacity} or less"
        )
    return capacity


# --- devices -------------------------------------------------------------------------
#
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 2**30
MIN_DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 2**20
DEFAULT_KV_SHARE_OF_FREE = 0.5  # of what the machine has available once the weights are in


def default_cpu_kv_cache_memory(available: int | None, weights: int) -> int:
    """The CPU KV cache when none is asked for: 4 GiB, or half of what the machine has free after
    the weights where that is less (at least 256 MiB; a machine with less fails the load check)."""
    if available is None:
        return DEFAULT_CPU_KV_CACHE_MEMORY
    half_of_free = int((available - weights) * DEFAULT_KV_SHARE_OF_FREE) // 2**20 * 2**20
    return max(MIN_DEFAULT_CPU_KV_CACHE_MEMORY, min(DEFAULT_CPU_KV_CACHE_MEMORY, half_of_free))


@dataclass(frozen=True)
class GpuMemoryPlan:
    """How a GPU's memory is shared out, from a profile run (all in bytes)."""

    total: int  # the device's memory
    budget: int  # total x gpu_memory_utilization: what this engine may use
    in_use_at_start: int  # taken before the weights: the CUDA context and other processes
    weights: int
    peak_activations: int  # the profiled forward pass and sampler at the full token budget, above the weights
    cuda_graphs: int  # set aside for the decode graphs' memory pool (0 with enforce_eager)
    kv_cache: int  # what is left for the KV cache

    def describe(self) -> str:
        parts = [
            f"{format_bytes(self.budget)} of {format_bytes(self.total)} "
            f"({self.budget / self.total:.0%}, gpu_memory_utilization)",
            f"in use at start {format_bytes(self.in_use_at_start)}",
            f"weights {format_bytes(self.weights)}",
            f"activations at the token budget {format_bytes(self.peak_activations)}",
        ]
        if self.cuda_graphs:
            parts.append(f"CUDA graphs {format_bytes(self.cuda_graphs)}")
        return ", ".join(parts) + f" -> KV cache {format_bytes(self.kv_cache)}"


def plan_gpu_memory(
    total: int,
    utilization: float,
    in_use_at_start: int,
    weights: int,
    peak_activations: int,
    cuda_graphs: int,
) -> GpuMemoryPlan:
    """The KV cache gets the budget less everything else; an error when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization)
    kv = budget - in_use_at_start - weights - peak_activations - cuda_graphs
    plan = GpuMemoryPlan(total, budget, in_use_at_start, weights, peak_activations, cuda_graphs, max(kv, 0))
    if kv <= 0:
        needed = (total * utilization - kv) / total
        hint = (
            f"raise --gpu-memory-utilization to {min(needed + 0.01, 1.0):.2f}"
            if needed < 1
            else "free the GPU (other processes hold it), lower --max-num-batched-tokens, or use a smaller model"
        )
        raise ValueError(f"no GPU memory is left for the KV cache: {plan.describe()}; {hint}")
    return plan
