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
"""

from __future__ import annotations

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


def check_max_model_len(requested: int | None, model_max_len: int) -> int:
    """The maximum model length to use: the model's own when none was asked for."""
    if requested is None:
        return model_max_len
    if requested > model_max_len:
        raise ValueError(
            f"max_model_len {requested} is longer than this model's context length of {model_max_len} tokens "
            f"(max_position_embeddings); pass --max-model-len {model_max_len} or less"
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
