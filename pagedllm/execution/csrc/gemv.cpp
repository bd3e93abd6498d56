// y = x W^T for a few rows of x (a decode step of 1-4 requests), W bfloat16 [N, K]
// row-major: the weights stream from memory once, 16 output rows at a time, each
// row's dot products accumulated by `vdpbf16ps` (two bf16 products per lane) and
// the 16 horizontal sums finished together.  At such sizes the step is bound by
// reading the weights; oneDNN's packed GEMM, tuned for many rows, measured slower
// there (benchmarks/linear_backends.py).  Built only with AVX512-BF16; elsewhere
// `gemv_bf16_available` says 0 and the engine keeps oneDNN for every size.
#include <omp.h>

#include <algorithm>

#include "avx512.h"

namespace pagedllm {
namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kRows = 16;  // output rows per tile

// Rounds 16 floats to bfloat16 (nearest even) and stores them.
inline void store_bf16(bf16* dst, __m512 v, int64_t n) {
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  _mm256_mask_storeu_epi16(dst, mask, reinterpret_cast<const __m256i&>(packed));
}

// K is a multiple of 32 (checked by the caller); N any.
void gemv(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * kRows, rows = std::min(kRows, n - n0);
    const bf16* wrow[kRows];
    for (int64_t i = 0; i < kRows; ++i) wrow[i] = w + (n0 + std::min(i, rows - 1)) * k;  // short tile: repeat
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
  }
}
#endif

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

PAGEDLLM_API int64_t gemv_bf16_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// x [m, k], w [n, k], y [m, n], all bfloat16; k a multiple of 32.
PAGEDLLM_API void gemv_bf16(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
  pagedllm::gemv(x, w, y, m, n, k);
#else
  (void)x, (void)w, (void)y, (void)m, (void)n, (void)k;
#endif
}
