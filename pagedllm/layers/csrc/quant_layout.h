// The panel layout of weights kept quantized (described in quant_gemm.cpp's header), shared by
// the integer kernels (quant_gemm.cpp), the AMX tile kernels (quant_amx.cpp) and the fused
// decode step (decode_layers.cpp).
#pragma once

#include <cstdint>

#include "common.h"

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

// Bytes of one panel's block of 32 values: 4-bit nibbles, plus a plane of fifth bits for 5-bit
// or two planes of high bit pairs for 6-bit.
inline int64_t block_bytes(int64_t bits) {
  return kPanel * (bits == 4 ? 16 : bits == 5 ? 20 : bits == 6 ? 24 : 32);
}

// One packed weight [rows, cols] (pagedllm/layers/quantized.py's PackedWeight, whose ctypes
// struct mirrors this one).  Value = scale * (u - zero) + min, where a group's scale is
// scales[its super-group] (float16) times sub_scales[the group] (int8) when sub_scales is
// given, else scales[the group]; the min likewise from mins and sub_mins (absent: 0).  Per panel,
// scales and mins are [cols / super_group][kPanel], sub-scales and sub-mins [cols / group][kPanel].
struct QuantWeight {
  const uint8_t* qs;
  const uint16_t* scales;
  const int8_t* sub_scales;
  const uint16_t* mins;
  const int8_t* sub_mins;
  int64_t rows, cols, bits, group, super_group, zero;
};

// The scales and mins of one panel of a QuantWeight.
struct PanelScales {
  const uint16_t* scales;
  const int8_t* sub_scales;
  const uint16_t* mins;
  const int8_t* sub_mins;
  int super_shift;  // log2 of the groups per super-group (1, 8 or 16: a shift, not a division per group)

  // Group and super-group sizes are powers of two (the callers check): shifts, not divisions,
  // since the tile kernel makes one of these per block.
  PanelScales(const QuantWeight& w, int64_t panel) {
    const int group_shift = __builtin_ctzll(static_cast<uint64_t>(w.group));
    const int super_group_shift = __builtin_ctzll(static_cast<uint64_t>(w.super_group));
    const int64_t groups = w.cols >> group_shift, supers = w.cols >> super_group_shift;
    scales = w.scales + panel * supers * kPanel;
    sub_scales = w.sub_scales == nullptr ? nullptr : w.sub_scales + panel * groups * kPanel;
    mins = w.mins == nullptr ? nullptr : w.mins + panel * supers * kPanel;
    sub_mins = w.sub_mins == nullptr ? nullptr : w.sub_mins + panel * groups * kPanel;
    super_shift = super_group_shift - group_shift;
  }
  // Offsets of group g's vector of kPanel super scales and sub-scales.
  int64_t super_at(int64_t g) const { return (g >> super_shift) * kPanel; }
  float scale(int64_t g, int64_t c) const {
    const float s = to_float(f16{scales[super_at(g) + c]});
    return sub_scales == nullptr ? s : s * static_cast<float>(sub_scales[g * kPanel + c]);
  }
  float min(int64_t g, int64_t c) const {
    if (mins == nullptr) return 0.f;
    const float v = to_float(f16{mins[super_at(g) + c]});
    return sub_mins == nullptr ? v : v * static_cast<float>(sub_mins[g * kPanel + c]);
  }
};

}  // namespace pagedllm
