"""Keep freed activation memory in the process for the next step (glibc's malloc).

A step allocates its activations afresh: tensors of a few MiB to tens of MiB, freed when the
step ends.  glibc's defaults hand much of that back to the OS: chunks above a threshold that
starts at 128 KiB are mmap'ed and unmapped when freed, and the top of the heap is trimmed once
128 KiB lie free there.  The next step then takes a page fault on every 4 KiB it touches, and
the kernel zeroes each page again (in a VM the host may have to back it first).  On a 2-core VM
a fresh engine's first run of 4,096-token prompt steps took about 100,000-270,000 such faults
and ran up to a third slower than the runs after it.

So a CPU engine raises both thresholds once, as other allocators (tcmalloc, jemalloc) behave by
default: chunks up to 32 MiB (glibc's largest allowed threshold) come from the heap, and up to
`TRIM_THRESHOLD` bytes of free heap stay with the process.  What the steps use at their peak
stays allocated between steps; nothing else changes.  Under an allocator preloaded in glibc's
place (tcmalloc, as vLLM's CPU docs advise), `mallopt` is that allocator's, which keeps freed
memory by itself and ignores the call.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger("pagedllm")

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (once per process); False where the C library is not glibc or
    refused them."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    if ok:
        logger.debug("malloc: heap chunks up to %d MiB, %d MiB kept", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    _done = ok
    return ok
