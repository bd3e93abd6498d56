// LoRA updates of a step's rows, each under its own adapter, in one call per projection:
//   y[row] += B_a (A_a x[row])   for every row listed in `order`, a = adapter_of[i]
// Each adapter passes three addresses (pagedllm/layers/lora.py's KernelTable), set up once when
// it is loaded, so a step copies no weight:
//   a:    its A, [R, in] row by row (R: the ranks of the parts it adapts, stacked);
//   b:    its B, each adapted part's block [out_p, r_p] on its own, packed for `panel_rows`
//         (panels of 32 output columns; bfloat16 in pairs of k, r_p rounded up to even);
//   desc: int64 [R, parts, then per part: out_offset, out_size, rank_offset, rank, packed rank,
//         offset in b].
// A fused projection's parts (q, k, v; gate, up) each read only their own block of B: the zeros
// between the blocks of the stacked B are never stored or multiplied, and A's rows are read once
// each, not padded to a panel.  An adapter that leaves the projection alone has a null `a`.
//
// The rows come sorted by adapter; the work items are runs of up to kPanelRows rows of one
// adapter, gathered into a small buffer.  The shrink (t = x A^T) is a dot product per row and
// rank; the expand (u = t B_p^T, part by part) runs on panel_gemm.h's register tile, which
// streams each panel once for all the run's rows; u is added to the parts' columns of y.  In
// bfloat16 t is rounded to bfloat16 between the two (as transformers+PEFT's bfloat16 matmuls
// round it), u added to y in float32 and rounded once.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "panel_gemm.h"

namespace pagedllm {
namespace {

constexpr int64_t kDescHead = 2, kDescPart = 6;

// Ask for `bytes` from p ahead of their use.  An adapter's rows of A are short streams (a row of
// 576 values is 18 cache lines), too short for the hardware prefetcher to ramp up on.  Measured
// on SmolLM2 with 8 adapters at 32 rows: a decode step 30 ms without, 28 ms with (base 20 ms); the
// kernel still reads only ~10 GB/s of the 24 two cores can.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at);
}
#if defined(__AVX512F__)
constexpr int64_t kDotRows = 4, kDotRanks = 4;  // rows of x and of A per pass over them

// 16 lanes of float32, or 16 pairs of bfloat16, from p (n of them valid, n < a full vector: masked).
inline __m512 load_lanes(const float* p, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline __m512 load_lanes(const bf16* p, int64_t n) {
  if (n >= 32) return _mm512_loadu_ps(p);
  return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p));
}

// t[r * rank + j] = x[r] . A[j] for kDotRows rows of x (row stride `in`) and the kDotRanks rows
// of A from j0 (fewer at its end: the last row is repeated and not stored): 16 accumulators, so
// each load of x or A feeds four products and no sum waits on the one before.
template <typename E>
inline void dot_block(const typename E::T* x, int64_t in, const typename E::T* a, int64_t rank, int64_t j0,
                      typename E::T* t, int64_t rows) {
  constexpr int64_t width = 16 * E::step;
  const typename E::T* ar[kDotRanks];
#pragma GCC unroll 4
  for (int q = 0; q < kDotRanks; ++q) ar[q] = a + std::min(j0 + q, rank - 1) * in;
  __m512 acc[kDotRows][kDotRanks];
#pragma GCC unroll 4
  for (int r = 0; r < kDotRows; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < kDotRanks; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i += width) {
    const int64_t n = std::min(width, in - i);
    __m512 w[kDotRanks];
#pragma GCC unroll 4
    for (int q = 0; q < kDotRanks; ++q) w[q] = load_lanes(ar[q] + i, n);
#pragma GCC unroll 4
    for (int r = 0; r < kDotRows; ++r) {
      const __m512 xv = load_lanes(x + r * in + i, n);
#pragma GCC unroll 4
      for (int q = 0; q < kDotRanks; ++q) acc[r][q] = E::madd(acc[r][q], w[q], xv);
    }
  }
  const int64_t ranks = std::min(kDotRanks, rank - j0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < ranks; ++q)
      t[r * rank + j0 + q] = from_float<typename E::T>(_mm512_reduce_add_ps(acc[r][q]));
}
#elif defined(__AVX2__)
// AVX2 (float32 only: bfloat16 runs where AVX512-BF16 is): the same blocks in 8 lanes, 4 rows by
// 2 ranks, so 8 sums are in flight (11 of the 16 registers).  A loop of one row and one rank
// waited on each add (one chain of fused multiply-adds): on a 2-core AVX2 EPYC, float32, the
// kernel over SmolLM2's layers at 32 rows of 8 rank-16 adapters took 17.0 ms before, 13.1 after.
constexpr int64_t kDotRows = 4, kDotRanks = 2;

inline __m256 load_lanes(const float* p, int64_t n) {
  if (n >= 8) return _mm256_loadu_ps(p);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, mask);
}
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename E>
inline void dot_block(const float* x, int64_t in, const float* a, int64_t rank, int64_t j0, float* t, int64_t rows) {
  const float* ar[kDotRanks];
  for (int q = 0; q < kDotRanks; ++q) ar[q] = a + std::min(j0 + q, rank - 1) * in;
  __m256 acc[kDotRows][kDotRanks];
  for (int r = 0; r < kDotRows; ++r)
    for (int q = 0; q < kDotRanks; ++q) acc[r][q] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; i += 8) {
    const int64_t n = std::min<int64_t>(8, in - i);
    __m256 w[kDotRanks];
    for (int q = 0; q < kDotRanks; ++q) w[q] = load_lanes(ar[q] + i, n);
    for (int r = 0; r < kDotRows; ++r) {
      const __m256 xv = load_lanes(x + r * in + i, n);
      for (int q = 0; q < kDotRanks; ++q) acc[r][q] = _mm256_fmadd_ps(w[q], xv, acc[r][q]);
    }
  }
  const int64_t ranks = std::min(kDotRanks, rank - j0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t q = 0; q < ranks; ++q) t[r * rank + j0 + q] = sum_lanes(acc[r][q]);
}
#else
constexpr int64_t kDotRows = 4, kDotRanks = 4;

template <typename E>
inline void dot_block(const float* x, int64_t in, const float* a, int64_t rank, int64_t j0, float* t, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = j0; j < std::min(j0 + kDotRanks, rank); ++j) {
      float sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * a[j * in + i];
      t[r * rank + j] = sum;
    }
}
#endif

// t [n, rank] = xs [n, in] A^T, A [rank, in]; xs has rows up to a multiple of kDotRows (zeros past n).
// The rows of A two blocks ahead are fetched while a block is computed (the first two by the caller).
template <typename E>
void shrink(const typename E::T* xs, int64_t n, int64_t in, const typename E::T* a, int64_t rank,
            typename E::T* t) {
  for (int64_t j = 0; j < rank; j += kDotRanks) {
    const int64_t ahead = j + 2 * kDotRanks;
    if (ahead < rank) prefetch(a + ahead * in, std::min(kDotRanks, rank - ahead) * in * sizeof(*a));
    for (int64_t r = 0; r < n; r += kDotRows)
      dot_block<E>(xs + r * in, in, a, rank, j, t + r * rank, std::min(kDotRows, n - r));
  }
}

template <typename E>
void lora_add(const typename E::T* x, typename E::T* y, const int64_t* order, const int64_t* adapter_of,
              int64_t count, int64_t in, int64_t out, const void* const* a_rows, const void* const* b_packed,
              const void* const* descs) {
  using T = typename E::T;
  std::vector<int64_t> starts;  // runs of up to kPanelRows consecutive entries of one adapter
  for (int64_t i = 0; i < count; ++i)
    if (i == 0 || adapter_of[i] != adapter_of[i - 1] || i - starts.back() == kPanelRows) starts.push_back(i);
  const int64_t items = static_cast<int64_t>(starts.size());
  starts.push_back(count);
  int64_t max_rank = 0;
  for (int64_t i = 0; i < count; ++i)
    if (a_rows[adapter_of[i]] != nullptr)
      max_rank = std::max(max_rank, static_cast<const int64_t*>(descs[adapter_of[i]])[0]);
  constexpr int64_t buffer_rows = (kPanelRows + kDotRows - 1) / kDotRows * kDotRows;
#pragma omp parallel if (items > 1)
  {
    // Each thread's buffers, kept between calls (fresh ones were allocated and zero-filled at every
    // call: ~26 MB of writes a SmolLM2 decode step).
    thread_local std::vector<T> xs, t, tp, u;
    for (auto [buffer, size] : {std::pair{&xs, buffer_rows * in}, std::pair{&t, kPanelRows * max_rank},
                                std::pair{&tp, kPanelRows * (max_rank + 1)}, std::pair{&u, kPanelRows * out}})
      if (buffer->size() < static_cast<size_t>(size)) buffer->resize(static_cast<size_t>(size));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t first = starts[item], n = starts[item + 1] - first, adapter = adapter_of[first];
      const T* a = static_cast<const T*>(a_rows[adapter]);
      if (a == nullptr) continue;
      const T* b = static_cast<const T*>(b_packed[adapter]);
      const int64_t* desc = static_cast<const int64_t*>(descs[adapter]);
      const int64_t rank = desc[0], parts = desc[1];
      // A's first two blocks, and B's first two panels, which the shrink leaves time to arrive.
      prefetch(a, std::min(rank, 2 * kDotRanks) * in * sizeof(T));
      const int64_t first_panels = std::min<int64_t>(2, (desc[kDescHead + 1] + kPanel - 1) / kPanel);
      prefetch(b + desc[kDescHead + 5], first_panels * desc[kDescHead + 4] * kPanel * sizeof(T));
      for (int64_t i = 0; i < n; ++i) std::memcpy(&xs[i * in], x + order[first + i] * in, in * sizeof(T));
      std::memset(&xs[n * in], 0, ((n + kDotRows - 1) / kDotRows * kDotRows - n) * in * sizeof(T));
      shrink<E>(xs.data(), n, in, a, rank, t.data());
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t* part = desc + kDescHead + p * kDescPart;
        const int64_t out_offset = part[0], out_size = part[1], rank_offset = part[2], part_rank = part[3],
                      packed_rank = part[4];
        const T* panels = b + part[5];
        for (int64_t i = 0; i < n; ++i) {  // this part's ranks of t, and a zero for an odd bfloat16 rank
          std::memcpy(&tp[i * packed_rank], &t[i * rank + rank_offset], part_rank * sizeof(T));
          std::memset(&tp[i * packed_rank + part_rank], 0, (packed_rank - part_rank) * sizeof(T));
        }
        const int64_t panel = packed_rank * kPanel;
        for (int64_t c = 0; c * kPanel < out_size; ++c) {
          if ((c + 2) * kPanel < out_size) prefetch(panels + (c + 2) * panel, panel * sizeof(T));
          panel_rows<E>(tp.data(), n, packed_rank, panels + c * packed_rank * kPanel, u.data() + out_offset + c * kPanel,
                        out, std::min(kPanel, out_size - c * kPanel));
        }
        for (int64_t i = 0; i < n; ++i) {
          T* yr = y + order[first + i] * out + out_offset;
          const T* ur = &u[i * out + out_offset];
#pragma omp simd
          for (int64_t j = 0; j < out_size; ++j) yr[j] = from_float<T>(to_float(yr[j]) + to_float(ur[j]));
        }
      }
    }
  }
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

// 1 where this build has the kernel for the dtype (bfloat16 needs AVX512-BF16, as packed_gemm).
PAGEDLLM_API int64_t lora_add_available_f32() { return 1; }
PAGEDLLM_API int64_t lora_add_available_bf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

PAGEDLLM_API void lora_add_f32(const float* x, float* y, const int64_t* order, const int64_t* adapter_of,
                               int64_t count, int64_t in, int64_t out, const void* const* a_rows,
                               const void* const* b_packed, const void* const* descs) {
  pagedllm::lora_add<pagedllm::F32Panel>(x, y, order, adapter_of, count, in, out, a_rows, b_packed, descs);
}

PAGEDLLM_API void lora_add_bf16(const bf16* x, bf16* y, const int64_t* order, const int64_t* adapter_of,
                                int64_t count, int64_t in, int64_t out, const void* const* a_rows,
                                const void* const* b_packed, const void* const* descs) {
#if defined(__AVX512BF16__)
  pagedllm::lora_add<pagedllm::BF16Panel>(x, y, order, adapter_of, count, in, out, a_rows, b_packed, descs);
#else
  (void)x, (void)y, (void)order, (void)adapter_of, (void)count, (void)in, (void)out, (void)a_rows, (void)b_packed,
      (void)descs;
#endif
}
