// y = x W^T for the few rows of a decode step (1 to a few dozen requests), where a
// step is bound by reading the weights or by FMAs that oneDNN's GEMM, tuned for many
// rows, leaves idle (benchmarks/linear_backends.py).
//
// float32: `packed_gemm`, W packed once as [ceil(N / 32)][K][32] (any N, any K).  Each
// step of k reads 32 output columns' weights as one contiguous 128-byte run, so a
// panel of 32 columns streams from memory once for all rows of x.  A register tile
// holds up to kPanelRows rows x 32 columns (two zmm each: 24 accumulators) and x's
// values are broadcast: per k, 2 weight loads, kPanelRows broadcasts and 2 kPanelRows
// FMAs.  AVX-512F intrinsics, or plain C++ the compiler vectorizes (4 rows a tile).
//
// bfloat16 (AVX512-BF16 only): `gemv` on the plain W [N, K], 16 output rows at a time,
// each dot product accumulated in its own register by `vdpbf16ps` and the 16
// horizontal sums finished together; one or two rows.  `gemv_available` says whether
// this build has it.
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

// K is a multiple of 32 (checked by the caller); N any.  Each tile of kRows output rows is
// one work item; a short last tile repeats its last row.
void gemv(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t n0 = tile * kRows, rows = std::min(kRows, n - n0);
    const bf16* wrow[kRows];
    for (int64_t i = 0; i < kRows; ++i) wrow[i] = w + (n0 + std::min(i, rows - 1)) * k;
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

// --- float32, weights packed in panels of 32 columns ---------------------------------
constexpr int64_t kPanel = 32;  // output columns per packed panel
// kMaxRows: up to how many rows this beats oneDNN's GEMM on SmolLM2's projections
// (benchmarks/linear_backends.py); the engine sends no more.  The plain loop was
// measured built for AVX2 (-march=haswell) on an AVX-512 Xeon: faster at 1-4 rows.
#if defined(__AVX512F__)
constexpr int64_t kPanelRows = 12, kMaxRows = 32;
#else
constexpr int64_t kPanelRows = 4, kMaxRows = 4;
#endif

template <int R>
inline void panel_tile(const float* x, int64_t k, const float* panel, float* y, int64_t n, int64_t cols) {
#if defined(__AVX512F__)
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    const __m512 w0 = _mm512_loadu_ps(panel + j * kPanel), w1 = _mm512_loadu_ps(panel + j * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + j]);
      acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
    }
  }
  const __mmask16 lo = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * n, lo, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * n + 16, hi, acc[r][1]);
  }
#else
  float acc[R][kPanel] = {};
  for (int64_t j = 0; j < k; ++j)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * k + j];
#pragma omp simd
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += panel[j * kPanel + c] * xv;
    }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + cols, y + r * n);
#endif
}

template <int R = kPanelRows>
inline void panel_rows(const float* x, int64_t rows, int64_t k, const float* panel, float* y, int64_t n,
                       int64_t cols) {
  if constexpr (R > 1)
    if (rows < R) return panel_rows<R - 1>(x, rows, k, panel, y, n, cols);
  panel_tile<R>(x, k, panel, y, n, cols);
}

void packed_gemm(const float* x, const float* packed, float* y, int64_t m, int64_t n, int64_t k) {
  if (m == 0) return;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t tiles = (m + kPanelRows - 1) / kPanelRows, step = (m + tiles - 1) / tiles;  // even row tiles
#pragma omp parallel for schedule(static) if (m * n * k >= (1 << 16))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0);
    for (int64_t r0 = 0; r0 < m; r0 += step)
      panel_rows(x + r0 * k, std::min(step, m - r0), k, packed + p * k * kPanel, y + r0 * n + n0, n, cols);
  }
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

// 1 where this build has the bfloat16 GEMV (AVX512-BF16), else 0.
PAGEDLLM_API int64_t gemv_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
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

PAGEDLLM_API int64_t packed_gemm_max_rows() { return pagedllm::kMaxRows; }

// x [m, k], packed [ceil(n / 32), k, 32] (W [n, k] packed by 32 columns), y [m, n].
PAGEDLLM_API void packed_gemm_f32(const float* x, const float* packed, float* y, int64_t m, int64_t n, int64_t k) {
  pagedllm::packed_gemm(x, packed, y, m, n, k);
}
