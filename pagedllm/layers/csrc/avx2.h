// AVX2 helpers shared by the kernels' AVX2 paths (empty with AVX-512, whose paths use avx512.h,
// and without AVX2).
#pragma once

#include "common.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm {

// 8 values widened to float32 (each exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const f8* p) {  // as avx512.h's load16 for f8, 8 at a time
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<short>(0xbfff)));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}

}  // namespace pagedllm
#endif
