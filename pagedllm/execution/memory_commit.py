"""Committing a large CPU buffer's memory in the background, without writing to it.

A KV cache left to the OS is committed page by page as steps first write each block: that page
fault (and in a VM, the host's) fell inside the steps, up to a quarter of a prompt step's time.
Zeroing the cache at start moves the cost out of the steps but into the start (12.5 s for
4 GiB on a loaded 2-core machine).  Instead, a low-priority thread asks the kernel to back the
pages, `madvise(MADV_POPULATE_WRITE)`, a chunk at a time: the kernel maps each page writable
and leaves its contents alone, so steps that already write blocks while it runs lose nothing,
and the server answers as soon as the model is loaded.  Kernels before Linux 5.14 lack the
call; there the cache is committed as it is used.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger("pagedllm")

MADV_POPULATE_WRITE = 23  # linux/mman.h (Python's mmap module names it from 3.13 on)
CHUNK_BYTES = 64 * 2**20


def _libc_madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def page_ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, length) of every page that holds part of a tensor, in CHUNK_BYTES pieces.  The first
    and last pages may hold other data too (the allocator aligns a tensor to 64 bytes, not to a
    page): backing them changes nothing in them, and both are mapped, since the tensor is in them."""
    page = mmap.PAGESIZE
    ranges = []
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        start = start // page * page
        end = (end + page - 1) // page * page
        for at in range(start, end, CHUNK_BYTES):
            ranges.append((at, min(CHUNK_BYTES, end - at)))
    return ranges


def commit_in_background(tensors: Sequence[torch.Tensor], what: str) -> threading.Thread | None:
    """Start a daemon thread that backs every page of `tensors` (which stay owned by the caller and
    must outlive it: the runner holds its caches for its whole life).  None where the kernel
    cannot (the memory is then committed as used)."""
    ranges = page_ranges(tensors)
    if not ranges:
        return None
    madvise = _libc_madvise()
    start, length = ranges[0]
    if madvise(start, length, MADV_POPULATE_WRITE) != 0:  # the first chunk, here: does the kernel know it?
        errno = ctypes.get_errno()
        logger.info("%s committed as used (madvise(MADV_POPULATE_WRITE): %s)", what, os.strerror(errno))
        return None

    held = list(tensors)  # the memory stays mapped until the thread is done, even if the caller drops it

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        began, done = time.perf_counter(), length
        for at, size in ranges[1:]:
            if madvise(at, size, MADV_POPULATE_WRITE) != 0:
                reason = os.strerror(ctypes.get_errno())
                logger.warning("%s: committing stopped after %d MiB (%s)", what, done >> 20, reason)
                break
            done += size
        held.clear()
        total = sum(size for _, size in ranges)
        seconds = time.perf_counter() - began
        logger.debug("%s committed: %.2f of %.2f GiB in %.2f s", what, done / 2**30, total / 2**30, seconds)

    thread = threading.Thread(target=run, name="pagedllm-commit", daemon=True)
    thread.start()
    return thread
