"""The engine keeps freed activation memory in the process (execution/heap.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from pagedllm.execution.heap import keep_freed_memory
if sys.argv[1] == "on":
    assert keep_freed_memory()
x = torch.empty(24 * 2**20, dtype=torch.uint8); x.fill_(1); del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(24 * 2**20, dtype=torch.uint8); x.fill_(1); del x
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_on_reuse(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_step_sized_tensor_is_reused_without_page_faults():
    # 24 MiB, the size of a 4,096-token step's gate and up projections in bfloat16: by default
    # glibc maps it afresh and unmaps it when freed, 6,144 pages to fault in again each time.
    assert faults_on_reuse("off") > 3000
    assert faults_on_reuse("on") < 300
