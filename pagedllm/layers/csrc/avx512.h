// AVX-512 helpers shared by the kernels (empty without AVX-512).
#pragma once

#include "common.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// float8 e4m3 (common.h): each byte sign-extended to 16 bits and shifted left 7, which puts the
// sign in bit 15 and a copy of it in bit 14 (cleared): a half holding the value times 2^-8.
inline __m512 load16(const f8* p) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xbfff)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}

#if defined(__AVX512BF16__)
// v rounded to bfloat16 (nearest even) and back to float32.
inline __m512 bf16_round(__m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
}
// Stores 16 floats rounded to bfloat16 (nearest even).
inline void store_bf16x16(bf16* dst, __m512 v) {
  const __m256bh b = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(b));
}
#endif

// fast_exp (common.h) on 16 lanes, the same steps: a loop the compiler vectorizes leaves its
// remainder (a causal row's last < 16 keys) to scalar code, which took a tenth of the prefill
// kernel's time; callers mask the remainder instead (exp_span in softmax.h).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-126.f * 0.6931472f), hi = _mm512_set1_ps(127.f * 0.6931472f);
  const __m512 t = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(x, lo), hi), _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once.
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // token 2i in 128-bit lanes 0-1, token 2i+1 in lanes 2-3
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // token 4i+j in lane j
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane j: tokens 8i+j and 8i+4+j, two partial sums each
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
  // d[4j + k] holds token j + 4k
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

}  // namespace pagedllm
#endif
