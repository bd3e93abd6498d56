// Shared by the CPU kernels: the element types, conversions and a vectorizable exp.
//
// The kernels are plain C++ with a C ABI (no torch headers), so the library
// compiles in seconds and is called through ctypes with raw pointers.  bfloat16
// is carried as its 16 bits; conversions round to nearest even, as torch does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define PAGEDLLM_API extern "C" __attribute__((visibility("default")))

namespace pagedllm {

struct bf16 {
  uint16_t bits;
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
