// LoRA updates of a step's rows, each under its own adapter, in one call per projection:
//   y[row] += B_a (A_a x[row])   for every row listed in `order`, a = adapter_of[i]
// Each adapter's A [rank, in] and B [out, rank] are packed for `packed_gemm` (csrc/small_gemm.cpp,
// panels of 32 output columns; bfloat16 in pairs of k) once, when the adapter is loaded
// (pagedllm/layers/lora.py), and the step passes one pointer per adapter: no copy of any weight
// per step.  An adapter that leaves the projection alone has a null pointer; its rows are skipped.
//
// The rows come sorted by adapter; the work items are runs of up to kPanelRows rows of one
// adapter, gathered into a small buffer: the shrink (t = x A^T) and the expand (u = t B^T) run on
// panel_gemm.h's register tile, which streams each panel of the adapter's weights once for all the
// run's rows, and u is added to the rows of y.  In bfloat16 t is rounded to bfloat16 between the
// two (as transformers+PEFT's bfloat16 matmuls round it), u added to y in float32 and rounded once.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "panel_gemm.h"

namespace pagedllm {
namespace {

template <typename E>
void lora_add(const typename E::T* x, typename E::T* y, const int64_t* order, const int64_t* adapter_of,
              int64_t count, int64_t in, int64_t out, const void* const* a_packed, const void* const* b_packed,
              const int64_t* ranks) {
  using T = typename E::T;
  std::vector<int64_t> starts;  // runs of up to kPanelRows consecutive entries of one adapter
  for (int64_t i = 0; i < count; ++i)
    if (i == 0 || adapter_of[i] != adapter_of[i - 1] || i - starts.back() == kPanelRows) starts.push_back(i);
  const int64_t items = static_cast<int64_t>(starts.size());
  starts.push_back(count);
  int64_t max_rank = 0;
  for (int64_t i = 0; i < count; ++i) max_rank = std::max(max_rank, ranks[adapter_of[i]]);
#pragma omp parallel if (items > 1)
  {
    std::vector<T> xs(static_cast<size_t>(kPanelRows * in)), t(static_cast<size_t>(kPanelRows * max_rank)),
        u(static_cast<size_t>(kPanelRows * out));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t first = starts[item], n = starts[item + 1] - first, adapter = adapter_of[first];
      const T* a = static_cast<const T*>(a_packed[adapter]);
      const T* b = static_cast<const T*>(b_packed[adapter]);
      if (a == nullptr) continue;
      const int64_t rank = ranks[adapter];
      for (int64_t i = 0; i < n; ++i) std::copy(x + order[first + i] * in, x + (order[first + i] + 1) * in, &xs[i * in]);
      for (int64_t p = 0; p * kPanel < rank; ++p)
        panel_rows<E>(xs.data(), n, in, a + p * in * kPanel, t.data() + p * kPanel, rank,
                      std::min(kPanel, rank - p * kPanel));
      for (int64_t p = 0; p * kPanel < out; ++p)
        panel_rows<E>(t.data(), n, rank, b + p * rank * kPanel, u.data() + p * kPanel, out,
                      std::min(kPanel, out - p * kPanel));
      for (int64_t i = 0; i < n; ++i) {
        T* yr = y + order[first + i] * out;
        const T* ur = &u[i * out];
#pragma omp simd
        for (int64_t j = 0; j < out; ++j) yr[j] = from_float<T>(to_float(yr[j]) + to_float(ur[j]));
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
                               int64_t count, int64_t in, int64_t out, const void* const* a_packed,
                               const void* const* b_packed, const int64_t* ranks) {
  pagedllm::lora_add<pagedllm::F32Panel>(x, y, order, adapter_of, count, in, out, a_packed, b_packed, ranks);
}

PAGEDLLM_API void lora_add_bf16(const bf16* x, bf16* y, const int64_t* order, const int64_t* adapter_of,
                                int64_t count, int64_t in, int64_t out, const void* const* a_packed,
                                const void* const* b_packed, const int64_t* ranks) {
#if defined(__AVX512BF16__)
  pagedllm::lora_add<pagedllm::BF16Panel>(x, y, order, adapter_of, count, in, out, a_packed, b_packed, ranks);
#else
  (void)x, (void)y, (void)order, (void)adapter_of, (void)count, (void)in, (void)out, (void)a_packed, (void)b_packed,
      (void)ranks;
#endif
}
