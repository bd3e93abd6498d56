"""Where pagedllm keeps what it makes once and reuses: compiled kernels, converted tokenizers,
benchmark inputs.  `PAGEDLLM_CACHE_DIR` moves it; the default is ~/.cache/pagedllm."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache folder, or a path inside it (not created here)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or Path.home() / ".cache" / "pagedllm"
    return Path(root).joinpath(*parts)
