// The softmax pieces both attention kernels share: a span's largest score and its
// exponentials, vectorized over the span.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "avx512.h"
#include "common.h"

namespace pagedllm {

// The largest of s[lo, hi) (the lowest float when empty).
inline float span_max(const float* s, int64_t lo, int64_t hi) {
  float mx = -std::numeric_limits<float>::max();
  int64_t i = lo;
#if defined(__AVX512F__)
  // 16 lanes: a scalar max chain (what the compiler makes of the plain loop, -ffast-math or
  // not) cost 4 cycles per key, 13% of the prefill kernel's time at 512 tokens.
  __m512 lanes = _mm512_set1_ps(mx);
  for (; i + 16 <= hi; i += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(s + i));
  if (i < hi) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (hi - i)) - 1);
    lanes = _mm512_mask_max_ps(lanes, tail, lanes, _mm512_maskz_loadu_ps(tail, s + i));
  }
  return _mm512_reduce_max_ps(lanes);
#else
  for (; i < hi; ++i) mx = std::max(mx, s[i]);
  return mx;
#endif
}

// s[lo, hi) = exp((s[i] - mx) * scale) in place; returns their sum.  With AVX-512, masked
// 16-lane steps, the last one partial.
inline float exp_span(float* s, int64_t lo, int64_t hi, float mx, float scale = 1.f) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx), scale_v = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 keep = hi - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (hi - i)) - 1);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + i), m), scale_v));
    _mm512_mask_storeu_ps(s + i, keep, e);
    sum = _mm512_mask_add_ps(sum, keep, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = lo; i < hi; ++i) {
    s[i] = fast_exp((s[i] - mx) * scale);
    sum += s[i];
  }
  return sum;
#endif
}

}  // namespace pagedllm
