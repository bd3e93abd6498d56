// y = x W^T for a few rows of x (a decode step of 1-4 requests), W [N, K] row-major:
// the weights stream from memory once, 16 output rows at a time, each output row's
// dot product accumulated in its own register and the 16 horizontal sums finished
// together.  At such sizes a step is bound by reading the weights; oneDNN's packed
// GEMM, tuned for many rows, measured slower there (benchmarks/linear_backends.py).
//
// bfloat16 needs AVX512-BF16 (`vdpbf16ps`: two products per lane); float32 takes
// AVX-512F, or plain C++ the compiler vectorizes.  `gemv_available` says which
// dtypes this build runs.
#include <omp.h>

#include <algorithm>

#include "avx512.h"

namespace pagedllm {
namespace {

constexpr int64_t kRows = 16;  // output rows per tile

// Each tile of kRows output rows is one work item; a short last tile repeats its last row.
template <typename T, typename Tile>
void gemv_tiles(const T* w, int64_t n, int64_t k, Tile tile_fn) {
  const int64_t tiles = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * kRows, rows = std::min(kRows, n - n0);
    const T* wrow[kRows];
    for (int64_t i = 0; i < kRows; ++i) wrow[i] = w + (n0 + std::min(i, rows - 1)) * k;
    tile_fn(wrow, n0, rows);
  }
}

#if defined(__AVX512BF16__)
// Rounds 16 floats to bfloat16 (nearest even) and stores them.
inline void store_bf16(bf16* dst, __m512 v, int64_t n) {
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  _mm256_mask_storeu_epi16(dst, mask, reinterpret_cast<const __m256i&>(packed));
}

// K is a multiple of 32 (checked by the caller); N any.
void gemv(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
  gemv_tiles(w, n, k, [&](const bf16* const* wrow, int64_t n0, int64_t rows) {
    for (int64_t r = 0; r < m; ++r) {
      const bf16* xr = x + r * k;
      __m512 acc[kRows];
      for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; j += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + j);
        for (int64_t i = 0; i < kRows; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(wrow[i] + j), xv);
      }
      store_bf16(y + r * n + n0, hsum16(acc), rows);
    }
  });
}
#endif

// float32; K a multiple of 16 (checked by the caller); N any.
void gemv(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) {
  gemv_tiles(w, n, k, [&](const float* const* wrow, int64_t n0, int64_t rows) {
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
#if defined(__AVX512F__)
      __m512 acc[kRows];
      for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; j += 16) {
        const __m512 xv = _mm512_loadu_ps(xr + j);
        for (int64_t i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(wrow[i] + j), xv, acc[i]);
      }
      const __mmask16 mask = rows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1);
      _mm512_mask_storeu_ps(y + r * n + n0, mask, hsum16(acc));
#else
      // 16 partial sums per output row, so that the compiler vectorizes the inner loop.
      for (int64_t i = 0; i < rows; ++i) {
        float part[16] = {};
        for (int64_t j = 0; j < k; j += 16)
          for (int64_t l = 0; l < 16; ++l) part[l] += wrow[i][j + l] * xr[j + l];
        float sum = 0.f;
        for (int64_t l = 0; l < 16; ++l) sum += part[l];
        y[r * n + n0 + i] = sum;
      }
#endif
    }
  });
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

// Bit 0: float32 runs here; bit 1: bfloat16 does (AVX512-BF16).
PAGEDLLM_API int64_t gemv_available() {
#if defined(__AVX512BF16__)
  return 3;
#else
  return 1;
#endif
}

// x [m, k], w [n, k], y [m, n]; k a multiple of 32.
PAGEDLLM_API void gemv_bf16(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
  pagedllm::gemv(x, w, y, m, n, k);
#else
  (void)x, (void)w, (void)y, (void)m, (void)n, (void)k;
#endif
}

// x [m, k], w [n, k], y [m, n]; k a multiple of 16.
PAGEDLLM_API void gemv_f32(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k) {
  pagedllm::gemv(x, w, y, m, n, k);
}
