"""The C++ decode-attention kernel, compiled on first use for this CPU.

Built with torch's JIT extension loader (g++ and ninja) into torch's extension
cache, under a name tied to this CPU's instruction-set flags, so a cache
shared between machines never runs code built for another CPU.  When the
build fails the engine falls back to the pure-torch path and says so.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

logger = logging.getLogger("pagedllm")

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((flags + _SOURCE.read_text()).encode()).hexdigest()[:12]


@functools.cache
def load_cpu_kernels():
    """The compiled module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=f"pagedllm_cpu_{_cpu_tag()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # any build problem: compiler, ninja, headers
        logger.warning("C++ attention kernel unavailable (%s); using the pure-torch path", error)
        return None
