"""This CPU's bfloat16 multiply-add peak: what no GEMM here can beat.

    python benchmarks/bf16_peak.py

Compiles a loop of 12 independent `vdpbf16ps` chains on registers (inline assembly, so the
compiler cannot merge them) and runs it on every core with OpenMP; each 512-bit `vdpbf16ps`
is 32 multiply-adds, 64 flops.  Needs g++ and AVX512-BF16; says so and stops otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from pagedllm.layers.cpu_kernels import cpu_flags, cpu_summary

SOURCE = r"""
#include <omp.h>
#include <stdio.h>
int main() {
  const long iters = 100000000;
  const double t0 = omp_get_wtime();
#pragma omp parallel
  for (long i = 0; i < iters; ++i)
    __asm__ volatile(
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm0\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm1\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm2\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm3\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm4\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm5\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm6\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm7\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm8\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm9\n\t"
        "vdpbf16ps %%zmm30, %%zmm31, %%zmm10\n\t" "vdpbf16ps %%zmm30, %%zmm31, %%zmm11\n\t"
        ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11");
  const double seconds = omp_get_wtime() - t0;
  printf("%.1f GFLOP/s on %d threads\n", iters * 12.0 * 64 * omp_get_max_threads() / seconds / 1e9,
         omp_get_max_threads());
  return 0;
}
"""


def main() -> None:
    if "avx512_bf16" not in cpu_flags().split():
        sys.exit(f"{cpu_summary()}: no AVX512-BF16, so no vdpbf16ps to time")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        result = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    print(f"{cpu_summary()}: bfloat16 vdpbf16ps peak {result.stdout.strip()}")


if __name__ == "__main__":
    main()
