// Fused elementwise work of a llama layer, each one pass over its rows instead of
// the 5-12 separate torch ops (and temporaries) it replaces:
//   add_rms_norm:   residual += delta; out = weight * rms_norm(residual)
//   rope_write_kv:  rotary embedding of q and k from the fused QKV output, k and v
//                   written into the paged cache at their slots, q to its own buffer
//   silu_mul:       out = silu(gate) * up from the fused gate/up output
//   gelu_tanh_mul:  out = gelu_tanh(gate) * up, the same for Gemma's GeGLU
//   gemma_norm:     Gemma's RMSNorm of each `dim` values of a row: normalized and times its
//                   float32 (1 + w) in float32, rounded to the dtype once (as transformers)
// Rounding follows the model's dtype where Hugging Face's llama rounds (the residual
// sum, the normalized row before the weight, silu before the product), so bfloat16
// results match its numerics to the last bit except for the rotary products, which
// are computed in float32 and rounded once.
#include <omp.h>

#include <type_traits>

#include "avx512.h"

namespace pagedllm {
namespace {

// Small steps (a single decode) are not worth waking the other threads for.
constexpr int64_t kParallelElements = 1 << 15;

template <typename T>
void add_rms_norm(const T* delta, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* res = residual + r * hidden;
    if (delta != nullptr) {
      const T* d = delta + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) res[i] = from_float<T>(to_float(res[i]) + to_float(d[i]));
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += to_float(res[i]) * to_float(res[i]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    T* o = out + r * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(res[i]) * inv));
  }
}

template <typename T>
void gemma_norm(const T* x, const float* weight, T* out, int64_t rows, int64_t cols, int64_t dim, int64_t stride,
                float eps) {
#pragma omp parallel for if (rows * cols >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += dim) {
      const T* xi = x + r * stride + c0;
      T* o = out + r * stride + c0;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += to_float(xi[i]) * to_float(xi[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = from_float<T>(to_float(xi[i]) * inv * weight[i]);
    }
  }
}

// n elements from src into dst, converted where their types differ.
template <typename T, typename O>
inline void copy_as(const T* src, O* dst, int64_t n) {
  if constexpr (std::is_same_v<T, O>) {
    if (n > 0) std::memcpy(dst, src, n * sizeof(T));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<O>(to_float(src[i]));
  }
}

// Rotates one head into dst: its first 2 * half dims by halves (Hugging Face's order), the
// rest of its head_dim copied as they are (partial rotary; half 0: no rotary at all).
// Into dst of type O (a 16-bit KV cache beside float32 activations: rounded once, after the
// rotation in float).
template <typename T, typename O>
inline void rotate(const T* src, O* dst, const float* cos, const float* sin, int64_t half, int64_t head_dim) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
    dst[i] = from_float<O>(x1 * cos[i] - x2 * sin[i]);
    dst[i + half] = from_float<O>(x2 * cos[i] + x1 * sin[i]);
  }
  copy_as(src + 2 * half, dst + 2 * half, head_dim - 2 * half);
}

template <typename T, typename KV>
void rope_write_kv(const T* qkv, T* q_out, KV* k_cache, KV* v_cache, const int64_t* positions, const int64_t* slots,
                   const float* cos_table, const float* sin_table, int64_t tokens, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, int64_t rotary_dim) {
  // positions[t]: token t's row of the cos/sin tables (rotary_dim / 2 values each).
  const int64_t half = rotary_dim / 2, q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t row = q_size + 2 * kv_size;
#pragma omp parallel for if (tokens * row >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* src = qkv + t * row;
    const float* cos = cos_table + positions[t] * half;
    const float* sin = sin_table + positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) rotate(src + h * head_dim, q_out + t * q_size + h * head_dim, cos, sin, half, head_dim);
    KV* k_dst = k_cache + slots[t] * kv_size;
    for (int64_t h = 0; h < kv_heads; ++h) rotate(src + q_size + h * head_dim, k_dst + h * head_dim, cos, sin, half, head_dim);
    copy_as(src + q_size + kv_size, v_cache + slots[t] * kv_size, kv_size);
  }
}

// out = act(gate) * up for rows [gate | up], act's output rounded to T before the product as
// torch rounds it.
template <typename T, typename Act>
void gated(const T* gate_up, T* out, int64_t rows, int64_t width, Act act) {
#pragma omp parallel for if (rows * width >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * width;
    const T* up = gate + width;
    T* o = out + r * width;
    int64_t i = 0;
#if defined(__AVX512BF16__)
    // Both roundings by `vcvtneps2bf16` (nearest even, as from_float does), 16 at a time.
    if constexpr (std::is_same_v<T, bf16>) {
      for (; i + 16 <= width; i += 16)
        store_bf16x16(o + i, _mm512_mul_ps(bf16_round(act(load16(gate + i))), load16(up + i)));
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < width; ++j) o[j] = from_float<T>(round_to<T>(act(to_float(gate[j]))) * to_float(up[j]));
  }
}

#if defined(__AVX512F__)
// g / d for d >= 1 by the reciprocal estimate and one Newton step (relative error ~1e-7, as
// close as the exp before it): a division was most of the activations' time.
inline __m512 div16(__m512 g, __m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(g, _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
}
#endif

// Activations as types, so that `gated` inlines them into its loops (16 lanes with AVX-512).
struct Silu {
  float operator()(float g) const { return g / (1.f + fast_exp(-g)); }
#if defined(__AVX512F__)
  __m512 operator()(__m512 g) const {
    return div16(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  }
#endif
};

// GELU's tanh form, 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3), computed as
// g / (1 + e^(-2u)), the same value: 1 + tanh(u) written out cancels catastrophically for negative g.
struct GeluTanh {
  float operator()(float g) const {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.f + fast_exp(-2.f * u));
  }
#if defined(__AVX512F__)
  __m512 operator()(__m512 g) const {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    return div16(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_mul_ps(_mm512_set1_ps(-2.f), u))));
  }
#endif
};

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;

#define PAGEDLLM_ELEMENTWISE(SUFFIX, T)                                                                             \
  PAGEDLLM_API void add_rms_norm_##SUFFIX(const T* delta, T* residual, const T* weight, T* out, int64_t rows,        \
                                          int64_t hidden, float eps) {                                             \
    pagedllm::add_rms_norm<T>(delta, residual, weight, out, rows, hidden, eps);                                    \
  }                                                                                                                \
  PAGEDLLM_API void rope_write_kv_##SUFFIX(const T* qkv, T* q_out, T* k_cache, T* v_cache, const int64_t* positions, \
                                           const int64_t* slots, const float* cos, const float* sin, int64_t tokens, \
                                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim) { \
    pagedllm::rope_write_kv<T, T>(qkv, q_out, k_cache, v_cache, positions, slots, cos, sin, tokens, heads, kv_heads, \
                               head_dim, rotary_dim);                                                              \
  }                                                                                                                \
  PAGEDLLM_API void silu_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t width) {                      \
    pagedllm::gated<T>(gate_up, out, rows, width, pagedllm::Silu{});                                               \
  }                                                                                                                \
  PAGEDLLM_API void gelu_tanh_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t width) {                 \
    pagedllm::gated<T>(gate_up, out, rows, width, pagedllm::GeluTanh{});                                           \
  }                                                                                                                \
  PAGEDLLM_API void gemma_norm_##SUFFIX(const T* x, const float* weight, T* out, int64_t rows, int64_t cols,        \
                                        int64_t dim, int64_t stride, float eps) {                                   \
    pagedllm::gemma_norm<T>(x, weight, out, rows, cols, dim, stride, eps);                                         \
  }

PAGEDLLM_ELEMENTWISE(f32, float)
PAGEDLLM_ELEMENTWISE(bf16, bf16)

// float32 q and K/V rows written into a float16 KV cache.
PAGEDLLM_API void rope_write_kv_f32_f16kv(const float* qkv, float* q_out, pagedllm::f16* k_cache, pagedllm::f16* v_cache,
                                          const int64_t* positions, const int64_t* slots, const float* cos,
                                          const float* sin, int64_t tokens, int64_t heads, int64_t kv_heads,
                                          int64_t head_dim, int64_t rotary_dim) {
  pagedllm::rope_write_kv<float, pagedllm::f16>(qkv, q_out, k_cache, v_cache, positions, slots, cos, sin, tokens, heads,
                                                kv_heads, head_dim, rotary_dim);
}

// float32 or bfloat16 q, and K/V rows rounded once into a float8 e4m3 KV cache.
#define PAGEDLLM_ROPE_WRITE_F8KV(SUFFIX, T)                                                                         \
  PAGEDLLM_API void rope_write_kv_##SUFFIX(const T* qkv, T* q_out, pagedllm::f8* k_cache, pagedllm::f8* v_cache,     \
                                           const int64_t* positions, const int64_t* slots, const float* cos,        \
                                           const float* sin, int64_t tokens, int64_t heads, int64_t kv_heads,       \
                                           int64_t head_dim, int64_t rotary_dim) {                                  \
    pagedllm::rope_write_kv<T, pagedllm::f8>(qkv, q_out, k_cache, v_cache, positions, slots, cos, sin, tokens, heads, \
                                             kv_heads, head_dim, rotary_dim);                                       \
  }
PAGEDLLM_ROPE_WRITE_F8KV(f32_f8kv, float)
PAGEDLLM_ROPE_WRITE_F8KV(bf16_f8kv, bf16)

// The first i with values[i] outside [low, high), or -1: the Python boundary checks every index
// tensor a kernel is handed (block tables, slots, rows, positions) with this before the call.
PAGEDLLM_API int64_t first_out_of_range(const int64_t* values, int64_t n, int64_t low, int64_t high) {
  for (int64_t i = 0; i < n; ++i) {
    if (values[i] < low || values[i] >= high) return i;
  }
  return -1;
}
