// LoRA updates of a decode step's rows, each under its own adapter, in one call per projection:
//   y[row] += B_a (A_a x[row])   for every row whose adapter a >= 0
// with the adapters' A and B stacked by pagedllm/layers/lora.py's LoraStack, in x's dtype:
//   a_t [adapters][in][rank] (A transposed) and b_t [adapters][rank][out] (B transposed),
// zeros where an adapter's rank is smaller or it leaves the projection alone.  Both halves run
// as broadcasts of one value times a contiguous row (`t += x[k] * a_t[k]`, `acc += t[r] * b_t[r]`),
// which the compiler vectorizes for whatever the build targets (AVX2 or AVX-512).
//
// Rows are taken in the order `order` gives, row order[i] under adapter adapter_of[i] (the caller
// sorts them by adapter), split between
// the threads in contiguous ranges: a thread reads each adapter it meets once from memory and
// again from its cache for that adapter's next rows.  The adapters' bytes are what a step reads
// besides the model (8 rank-16 adapters on every projection of SmolLM2 are 78 MB in bfloat16, the
// model's 4-bit file 92 MB), hence the model's dtype rather than float32.  The update is summed in
// float32 and added to y's value in float32, then rounded to y's dtype once.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace pagedllm {
namespace {

template <typename T>
void lora_add(const T* x, T* y, const int64_t* order, const int64_t* adapter_of, int64_t count, int64_t in,
              int64_t out, const T* a_t, const T* b_t, int64_t rank) {
#pragma omp parallel
  {
    std::vector<float> t(static_cast<size_t>(rank)), acc(static_cast<size_t>(out));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const int64_t row = order[i], adapter = adapter_of[i];
      const T* xr = x + row * in;
      const T* a = a_t + adapter * in * rank;
      const T* b = b_t + adapter * rank * out;
      std::fill(t.begin(), t.end(), 0.f);
      for (int64_t k = 0; k < in; ++k) {
        const float xv = to_float(xr[k]);
        const T* ak = a + k * rank;
#pragma omp simd
        for (int64_t r = 0; r < rank; ++r) t[r] += xv * to_float(ak[r]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < rank; ++r) {
        const float tv = t[r];
        const T* br = b + r * out;
#pragma omp simd
        for (int64_t j = 0; j < out; ++j) acc[j] += tv * to_float(br[j]);
      }
      T* yr = y + row * out;
#pragma omp simd
      for (int64_t j = 0; j < out; ++j) yr[j] = from_float<T>(to_float(yr[j]) + acc[j]);
    }
  }
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

#define PAGEDLLM_LORA(SUFFIX, T)                                                                                 \
  PAGEDLLM_API void lora_add_##SUFFIX(const T* x, T* y, const int64_t* order, const int64_t* adapter_of,         \
                                      int64_t count, int64_t in, int64_t out, const T* a_t, const T* b_t,         \
                                      int64_t rank) {                                                            \
    pagedllm::lora_add<T>(x, y, order, adapter_of, count, in, out, a_t, b_t, rank);                              \
  }

PAGEDLLM_LORA(f32, float)
PAGEDLLM_LORA(bf16, bf16)
