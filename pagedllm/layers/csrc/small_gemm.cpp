// y = x W^T for the few rows of a decode step (1 to a few dozen requests), where a
// step is bound by reading the weights or by FMAs that oneDNN's GEMM, tuned for many
// rows, leaves idle (benchmarks/linear_backends.py).
//
// `packed_gemm`: W packed once in panels of 32 output columns, so a panel streams from
// memory once for all rows of x.  A register tile holds up to kPanelRows rows x 32
// columns (two zmm each: 24 accumulators) and x's values are broadcast: per step of k,
// 2 weight loads, kPanelRows broadcasts and 2 kPanelRows multiply-adds.
// - float32: [ceil(N / 32)][K][32] (any N, any K); FMAs.  AVX-512F intrinsics, or plain
//   C++ the compiler vectorizes (4 rows a tile).
// - bfloat16 (AVX512-BF16 only): [ceil(N / 32)][K / 2][32][2] (K even): each column's
//   pair of k values side by side, which one `vdpbf16ps` multiplies and adds into a
//   float32 lane; the sums are rounded to bfloat16 once, at the end, as oneDNN does.
#include <omp.h>

#include <algorithm>

#include "panel_gemm.h"

namespace pagedllm {
namespace {

template <typename E>
void packed_gemm(const typename E::T* x, const typename E::T* packed, typename E::T* y, int64_t m, int64_t n,
                 int64_t k) {
  if (m == 0) return;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + kPanelRows - 1) / kPanelRows, step = (m + tiles - 1) / tiles;  // even row tiles
#pragma omp parallel for schedule(static) if (m * n * k >= (1 << 16))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0);
    for (int64_t r0 = 0; r0 < m; r0 += step)
      panel_rows<E>(x + r0 * k, std::min(step, m - r0), k, packed + p * k * kPanel, y + r0 * n + n0, n, cols);
  }
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

// Up to how many rows the engine sends each dtype here; 0: this build has no such kernel.
PAGEDLLM_API int64_t packed_gemm_max_rows_f32() { return pagedllm::kMaxRows; }
PAGEDLLM_API int64_t packed_gemm_max_rows_bf16() {
#if defined(__AVX512BF16__)
  return pagedllm::kMaxRowsBF16;
#else
  return 0;
#endif
}

// x [m, k], packed [ceil(n / 32), k, 32] (W [n, k] packed by 32 columns), y [m, n].
PAGEDLLM_API void packed_gemm_f32(const float* x, const float* packed, float* y, int64_t m, int64_t n, int64_t k) {
  pagedllm::packed_gemm<pagedllm::F32Panel>(x, packed, y, m, n, k);
}

// x [m, k], packed [ceil(n / 32), k / 2, 32, 2] (W [n, k] packed by 32 columns, k values in
// pairs), y [m, n]; k even.
PAGEDLLM_API void packed_gemm_bf16(const bf16* x, const bf16* packed, bf16* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
  pagedllm::packed_gemm<pagedllm::BF16Panel>(x, packed, y, m, n, k);
#else
  (void)x, (void)packed, (void)y, (void)m, (void)n, (void)k;
#endif
}
