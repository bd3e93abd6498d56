// Shared by the CPU kernels: the element types, conversions and a vectorizable exp.
//
// The kernels are plain C++ with a C ABI (no torch headers), so the library
// compiles in seconds and is called through ctypes with raw pointers.  bfloat16
// is carried as its 16 bits; conversions round to nearest even, as torch does.  So is
// IEEE half precision (f16), the element of a 16-bit KV cache beside float32 activations:
// converted by F16C's instructions where the build has them (every AVX2 CPU), else in
// plain arithmetic.  An 8-bit KV cache holds float8 e4m3 (f8: 1 sign, 4 exponent bits with
// bias 7, 3 mantissa bits; no infinities, 0x7f/0xff NaN, largest finite 448), as torch's
// float8_e4m3fn: read through half precision (its bits moved into a half's, times 2^8), written
// rounded to nearest even and saturated at +-448.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#define PAGEDLLM_API extern "C" __attribute__((visibility("default")))

namespace pagedllm {

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
struct f8 {
  uint8_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

#if defined(__F16C__)
inline float to_float(f16 x) { return _cvtsh_ss(x.bits); }
template <>
inline f16 from_float<f16>(float x) {
  return f16{static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))};
}
#else
inline float to_float(f16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu, mantissa = x.bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1fu) {
    u = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24
    float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <>
inline f16 from_float<f16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return f16{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal, rounded to nearest even by the float adder
    float f;
    std::memcpy(&f, &a, sizeof f);
    const float scaled = f * 16777216.f;  // in units of 2^-24
    const float rounded = std::nearbyint(scaled);
    return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded))};
  }
  // Normal: drop 13 mantissa bits, rounding to nearest even (a carry into the exponent is right).
  const uint32_t biased = a - (112u << 23);
  const uint32_t rounded = biased + 0xfffu + ((biased >> 13) & 1u);
  return f16{static_cast<uint16_t>(sign | (rounded >> 13))};
}
#endif

// e4m3's bits in a half's place: sign to bit 15, exponent and mantissa to bits 7-13; the half
// then holds the value times 2^-8 (normal and subnormal alike).
inline f16 f8_as_scaled_f16(f8 x) {
  return f16{static_cast<uint16_t>(((x.bits & 0x80u) << 8) | ((x.bits & 0x7fu) << 7))};
}
inline float to_float(f8 x) { return to_float(f8_as_scaled_f16(x)) * 256.f; }
template <>
inline f8 from_float<f8>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f8{0x7f};                       // NaN
  if (a >= 0x43e00000u) return f8{static_cast<uint8_t>(sign | 0x7eu)};  // |x| >= 448 (inf too): saturated
  if (a < 0x3c800000u) {  // below 2^-6: a subnormal, in units of 2^-9 (8 of them is 2^-6, encoded 0x08)
    float f;
    std::memcpy(&f, &a, sizeof f);
    return f8{static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(f * 512.f)))};
  }
  // Normal: keep 3 mantissa bits, rounding to nearest even (a carry into the exponent is right;
  // below 448 nothing rounds past it).
  const uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t exponent = (rounded >> 23) - 120u, mantissa = (rounded >> 20) & 7u;
  return f8{static_cast<uint8_t>(sign | (exponent << 3) | mantissa)};
}

// Rounds a float to T and back: the value a tensor of dtype T would hold.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// exp(x) in plain arithmetic so that loops over it vectorize (a libm call in such a
// loop measured ~14 cycles per element).  2^(x log2 e) split into an integer power,
// put straight into the exponent bits, and 2^f on [0, 1) by a degree-6 polynomial:
// relative error below 2e-7 over [-87, 88]; below that it returns tiny numbers, not 0
// (harmless wherever it is used: softmax weights and SiLU).
inline float fast_exp(float x) {
  const float t = std::fmin(std::fmax(x, -126.f * 0.6931472f), 127.f * 0.6931472f) * 1.4426950408889634f;
  const float whole = std::floor(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof power);
  return p * power;
}

}  // namespace pagedllm
