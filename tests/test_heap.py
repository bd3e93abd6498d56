"""The engine keeps freed activation memory in the process (execution/heap.py)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# One 24 MiB tensor (a 4,096-token step's gate and up projections in bfloat16) allocated and
# freed; glibc's own accounting says where it came from and what stayed, /proc what is resident.
SCRIPT = """
import ctypes, sys, torch
from pagedllm.execution.heap import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
def resident():
    return int(open("/proc/self/statm").read().split()[1])
before = libc.mallinfo2()
x = torch.empty(24 * 2**20, dtype=torch.uint8); x.fill_(1)
alive, resident_alive = libc.mallinfo2(), resident()
del x
freed, resident_freed = libc.mallinfo2(), resident()
print(alive.hblkhd - before.hblkhd, freed.fordblks, resident_alive - resident_freed)
"""


def allocate_and_free(setting: str) -> tuple[int, int, int]:
    """(bytes mmap'ed for the tensor, free bytes kept in the heap after it, pages released)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(out.stderr)
    mapped, kept, released = map(int, out.stdout.split()[-3:])
    return mapped, kept, released


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33+'s malloc"
)
def test_a_freed_step_sized_tensor_stays_in_the_process():
    # glibc's default maps such a tensor afresh and unmaps it when freed: its 6,144 pages leave
    # the process and the next step faults every one of them in again.
    mapped, _, released = allocate_and_free("off")
    assert mapped >= 24 * 2**20 and released > 5000
    # With the engine's setting it comes from the heap, and freeing it keeps it resident.
    mapped, kept, released = allocate_and_free("on")
    assert mapped == 0, f"{mapped} bytes mmap'ed"
    assert kept >= 24 * 2**20, f"only {kept} free bytes kept in the heap"
    assert released < 300, f"{released} pages released"
