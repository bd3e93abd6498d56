// The panel layout of weights kept quantized (described in quant_gemm.cpp's header), shared by
// the integer kernels (quant_gemm.cpp) and the AMX tile kernels (quant_amx.cpp).
#pragma once

#include <cstdint>

namespace pagedllm {

constexpr int64_t kBlock = 32;  // values per quantized block along k

// Output columns per panel: one vector holds 4 consecutive k values of each.
#if defined(__AVX512BW__)
constexpr int64_t kPanel = 16;
#else
constexpr int64_t kPanel = 8;
#endif

// 8-bit values stored as q + 128 (zero point 128), the form VNNI's unsigned x signed dot takes.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kUnsigned8 = true;
#else
constexpr bool kUnsigned8 = false;
#endif

// Bytes of one panel's block of 32 values: 4-bit nibbles, plus a plane of fifth bits for 5-bit.
inline int64_t block_bytes(int64_t bits) { return kPanel * (bits == 4 ? 16 : bits == 5 ? 20 : 32); }

}  // namespace pagedllm
