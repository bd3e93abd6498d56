// The register tile of `packed_gemm` (csrc/small_gemm.cpp), shared with the LoRA kernel
// (csrc/lora.cpp): rows of x against one panel of a weight packed in panels of 32 output columns.
#pragma once

#include <algorithm>

#include "avx512.h"

namespace pagedllm {

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

}  // namespace pagedllm
