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

#include "avx512.h"

namespace pagedllm {
namespace {

// --- weights packed in panels of 32 columns ------------------------------------------
constexpr int64_t kPanel = 32;  // output columns per packed panel
// kMaxRows, kMaxRowsBF16: up to how many rows this beats oneDNN's GEMM on SmolLM2's
// projections (benchmarks/linear_backends.py); the engine sends no more.  The plain loop was
// measured built for AVX2 (-march=haswell) on an AVX-512 Xeon: faster at 1-4 rows.
#if defined(__AVX512F__)
constexpr int64_t kPanelRows = 12, kMaxRows = 32;
constexpr int64_t kMaxRowsBF16 = 512;  // 1.00-1.10x oneDNN at 256-512 rows; at 2,048 oneDNN 0-8% faster
#else
constexpr int64_t kPanelRows = 4, kMaxRows = 4;
#endif

#if defined(__AVX512F__)
// One element type's register work for a panel tile: `step` k values per weight vector
// lane (float32: 1; bfloat16: a pair, which `vdpbf16ps` multiplies and adds at once).
struct F32Panel {
  using T = float;
  static constexpr int64_t step = 1;
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
  static void store(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
};
#if defined(__AVX512BF16__)
struct BF16Panel {
  using T = bf16;
  static constexpr int64_t step = 2;
  static __m512 broadcast(const bf16* x) {  // the pair x[j], x[j + 1] in every lane
    int32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static void store(bf16* y, __mmask16 mask, __m512 v) {  // rounded to nearest even
    const __m256bh packed = _mm512_cvtneps_pbh(v);
    _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<const __m256i&>(packed));
  }
};
#endif

// y[r, :cols] = x[r] . panel for R rows.  A panel is [k / step][32 columns][step]: per
// k step, 32 columns' weights side by side (two zmm), broadcast against x's values.
template <typename E, int R>
inline void panel_tile(const typename E::T* x, int64_t k, const typename E::T* panel, typename E::T* y, int64_t n,
                       int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += E::step) {
    const __m512 w0 = _mm512_loadu_ps(panel + j * kPanel), w1 = _mm512_loadu_ps(panel + j * kPanel + 16 * E::step);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = E::broadcast(x + r * k + j);
      acc[r][0] = E::madd(acc[r][0], w0, xv);
      acc[r][1] = E::madd(acc[r][1], w1, xv);
    }
  }
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    E::store(y + r * n, lo, acc[r][0]);
    E::store(y + r * n + 16, hi, acc[r][1]);
  }
}
#else
struct F32Panel {
  using T = float;
};

template <typename E, int R>
inline void panel_tile(const float* x, int64_t k, const float* panel, float* y, int64_t n, int64_t cols) {
  float acc[R][kPanel] = {};
  for (int64_t j = 0; j < k; ++j)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k + j];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += panel[j * kPanel + c] * xv;
    }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + cols, y + r * n);
}
#endif

template <typename E, int R = kPanelRows>
inline void panel_rows(const typename E::T* x, int64_t rows, int64_t k, const typename E::T* panel,
                       typename E::T* y, int64_t n, int64_t cols) {
  if constexpr (R > 1)
    if (rows < R) return panel_rows<E, R - 1>(x, rows, k, panel, y, n, cols);
  panel_tile<E, R>(x, k, panel, y, n, cols);
}

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
