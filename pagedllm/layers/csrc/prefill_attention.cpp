// Paged attention for prefill chunks on the CPU: chunks of query tokens over their cached
// context, reading K/V in place through the block tables (the decode kernel is in
// decode_attention.cpp).  head_dim 64, 128 or 256 (a template parameter D).  With a sliding
// window W (W > 0), the query at position p sees keys p - W + 1 .. p only; W = 0 is full
// causal attention.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "avx512.h"
#include "common.h"
#include "softmax.h"

namespace pagedllm {
namespace {

// One work item = (request, KV head, a tile of query tokens).  Its rows are those
// tokens times the KV head's `group` query heads, so every K/V load serves all the
// query heads that read it (grouped-query heads never repeat K/V).  Three passes:
//   1. scores S = Q K^T, key tiles of kKeyTile positions gathered through the block
//      table (any block size) and transposed into a small buffer, kRowBlock rows at
//      a time: kRowBlock independent FMA chains of 16 keys, 12 of the 16 AVX2
//      registers with 6 rows (measured 1.5-1.7x faster than 4 on an AMD EPYC; 8
//      spills), 12 of the 32 AVX-512 ones with 12 rows (1.2x faster than 6 on a
//      Xeon; 16 and 24 spill);
//   2. an exact softmax per row over its visible keys (causal: the query at
//      position p sees keys 0..p), vectorized over whole rows;
//   3. O = P V: the item's V rows gathered once into a contiguous buffer, then
//      kRowBlock rows x 16 dims accumulated in registers over all visible keys.
// kRowsPerItem is a multiple of kRowBlock, so whole row blocks are real rows
// whenever group divides it (padding rows are zero and cost only their FMAs).
// S and the V rows live in a per-thread buffer (rows x keys + keys x 64 floats);
// measured faster here than an online softmax, whose per-tile rescaling cost as
// much as the two matmuls.  In bfloat16 where the build has AMX-BF16 and the OS grants
// the tiles (amx.h), both products run on the tile unit instead (AmxPrefill, 16 rows
// a block): 1.8-2.3x torch's SDPA on whole prompts of 16-512 tokens, whose flash
// attention runs on the tiles too (benchmarks/prompt_attention.py, 2-core Xeon).
#ifndef PAGEDLLM_KEY_TILE
#define PAGEDLLM_KEY_TILE 16
#endif
#ifndef PAGEDLLM_ROWS_PER_ITEM
#define PAGEDLLM_ROWS_PER_ITEM 96
#endif
constexpr int64_t kKeyTile = PAGEDLLM_KEY_TILE;
constexpr int64_t kRowsPerItem = PAGEDLLM_ROWS_PER_ITEM;
#ifndef PAGEDLLM_ROW_BLOCK
#if defined(__AVX512F__)
#define PAGEDLLM_ROW_BLOCK 12
#else
#define PAGEDLLM_ROW_BLOCK 6
#endif
#endif
constexpr int64_t kRowBlock = PAGEDLLM_ROW_BLOCK;
static_assert(kRowsPerItem % kRowBlock == 0, "an item holds whole row blocks");
constexpr int64_t kDimBlock = 16;

// KV head h's D elements of position `pos`, found through the block table.
template <int64_t D, typename T>
inline const T* head_row(const T* cache, const int64_t* table, int64_t pos, int64_t block_size, int64_t kv_heads,
                         int64_t h) {
  return cache + ((table[pos / block_size] * block_size + pos % block_size) * kv_heads + h) * D;
}

template <int64_t D, typename T>
inline void load_tile(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t block_size,
                      int64_t kv_heads, int64_t h, float* dst, bool transpose) {
  for (int64_t i = 0; i < kKeyTile; ++i) {
    if (i < nk) {
      const T* row = head_row<D>(cache, table, k0 + i, block_size, kv_heads, h);
      if (transpose)
        for (int64_t d = 0; d < D; ++d) dst[d * kKeyTile + i] = to_float(row[d]);
      else
        for (int64_t d = 0; d < D; ++d) dst[i * D + d] = to_float(row[d]);
    } else if (transpose) {
      for (int64_t d = 0; d < D; ++d) dst[d * kKeyTile + i] = 0.f;
    } else {
      std::fill(dst + i * D, dst + (i + 1) * D, 0.f);
    }
  }
}

// The rows of one prefill item: `rows` real ones (token t, query head g at t * group + g),
// zero-padded to `padded`; visible keys k_lo .. first_pos + num_tokens - 1, indexed from k_lo.
struct PrefillRows {
  int64_t rows, padded, group, first_pos, k_lo, num_keys, width, window;
  // Keys a block of rows starting at r0 can see: up to its last row's position.
  int64_t block_keys(int64_t r0) const {
    return first_pos + std::min(r0 + kRowBlock - 1, rows - 1) / group + 1 - k_lo;
  }
};

// In place: each row of S [padded][width] (scores before `scale`, a positive factor) becomes its
// softmax over the keys it sees (0 elsewhere), and inv_sum the reciprocal of its sum.
inline void softmax_item(const PrefillRows& p, float* S, float* inv_sum, float scale = 1.f) {
  for (int64_t r = 0; r < p.padded; ++r) {
    float* s = S + r * p.width;
    const int64_t pos = p.first_pos + r / p.group;  // this row's position
    const int64_t hi = r < p.rows ? pos + 1 - p.k_lo : 0;
    const int64_t lo = r < p.rows && p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1 - p.k_lo) : 0;
    const float mx = span_max(s, lo, hi);
    const float sum = exp_span(s, lo, hi, mx, scale);
    std::fill(s, s + lo, 0.f);
    std::fill(s + std::max(hi, lo), s + p.width, 0.f);
    inv_sum[r] = hi > lo ? 1.f / sum : 0.f;
  }
}

// float32 math (either dtype): S = Q K^T over K tiles transposed into float32, then O = P V
// over the item's V rows gathered once.  Q: [padded][D] float32, pre-scaled.
template <int64_t D, typename T>
struct Float32Prefill {
  static void scores(const PrefillRows& p, const float* Q, const T* k_cache, const int64_t* table,
                     int64_t block_size, int64_t kv_heads, int64_t h, float* S, float* tile) {
    for (int64_t k0 = 0; k0 < p.num_keys; k0 += kKeyTile) {
      load_tile<D>(k_cache, table, p.k_lo + k0, std::min(kKeyTile, p.num_keys - k0), block_size, kv_heads, h, tile,
                   true);
      for (int64_t r0 = 0; r0 < p.padded; r0 += kRowBlock) {
        if (k0 >= p.block_keys(r0)) continue;  // wholly in the causal future of these rows
        float s[kRowBlock][kKeyTile] = {};
        for (int64_t d = 0; d < D; ++d) {
          const float* kd = tile + d * kKeyTile;
          for (int64_t rr = 0; rr < kRowBlock; ++rr) {
            const float qd = Q[(r0 + rr) * D + d];
#pragma omp simd
            for (int64_t i = 0; i < kKeyTile; ++i) s[rr][i] += qd * kd[i];
          }
        }
        for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy(s[rr], s[rr] + kKeyTile, S + (r0 + rr) * p.width + k0);
      }
    }
  }

  // Each block of kRowBlock rows x kDimBlock dims sums over all its visible keys in registers.
  static void values(const PrefillRows& p, const float* S, const T* v_cache, const int64_t* table,
                     int64_t block_size, int64_t kv_heads, int64_t h, float* acc, float* values) {
    for (int64_t k0 = 0; k0 < p.num_keys; k0 += kKeyTile)
      load_tile<D>(v_cache, table, p.k_lo + k0, std::min(kKeyTile, p.num_keys - k0), block_size, kv_heads, h,
                   values + k0 * D, false);
    for (int64_t r0 = 0; r0 < p.padded; r0 += kRowBlock) {
      const int64_t keys = std::min(p.block_keys(r0), p.num_keys);
      const float* p0 = S + r0 * p.width;
      for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
        float a[kRowBlock][kDimBlock] = {};
        for (int64_t i = 0; i < keys; ++i) {
          const float* vi = values + i * D + d0;
          for (int64_t rr = 0; rr < kRowBlock; ++rr) {
            const float w = p0[rr * p.width + i];
#pragma omp simd
            for (int64_t d = 0; d < kDimBlock; ++d) a[rr][d] += w * vi[d];
          }
        }
        for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy_n(a[rr], kDimBlock, acc + (r0 + rr) * D + d0);
      }
    }
  }
};

#if defined(__AVX512BF16__)
// out[c][i] = rows[i][c] for 16 rows of 16 32-bit elements (a dimension pair each): four
// rounds of 16 shuffles, against the 256 scalar loads and stores of the plain loop, which
// cost ~25% of the kernel's time (with the V interleave below).
inline void transpose16x16(const uint32_t* const* rows, uint32_t* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  for (int k = 0; k < 8; ++k) {  // in each 128-bit lane: rows 2k, 2k + 1 interleaved
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // r[4k + c], lane L: rows 4k .. 4k + 3 of column 4L + c
    r[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    r[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    r[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather column 4L + c's four lanes from r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_si512(out + c * 16, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(out + (4 + c) * 16, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(out + (8 + c) * 16, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(out + (12 + c) * 16, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// The item's V rows as [width / 2 pairs][D][2]: two keys' rows interleaved by 16-bit permutes,
// 32 dims at a time; keys past num_keys are zero.
template <int64_t D>
void gather_value_pairs(const PrefillRows& p, const bf16* v_cache, const int64_t* table, int64_t block_size,
                        int64_t kv_heads, int64_t h, bf16* values) {
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                       0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                       0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);  // x[d], y[d], d < 16
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));                        // d 16 .. 31
  auto v_row = [&](int64_t i) -> const bf16* {
    return i < p.num_keys ? head_row<D>(v_cache, table, p.k_lo + i, block_size, kv_heads, h) : nullptr;
  };
  for (int64_t i = 0; i < p.width; i += 2) {
    const bf16* x = v_row(i);
    const bf16* y = v_row(i + 1);
    bf16* dst = values + (i / 2) * D * 2;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i xv = x ? _mm512_loadu_si512(x + d) : _mm512_setzero_si512();
      const __m512i yv = y ? _mm512_loadu_si512(y + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(xv, lo, yv));
      _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(xv, hi, yv));
    }
  }
}

// P rounded to bfloat16 in place: row r's width values fill the first half of its bytes (each 16
// are read before the 8 floats they overwrite, which were read before them).
inline void narrow_weights(const PrefillRows& p, float* S) {
  for (int64_t r = 0; r < p.padded; ++r) {
    bf16* narrow_row = reinterpret_cast<bf16*>(S + r * p.width);
    for (int64_t i = 0; i < p.width; i += 16) store_bf16x16(narrow_row + i, _mm512_loadu_ps(S + r * p.width + i));
  }
}

// bfloat16 with AVX512-BF16: both products through `vdpbf16ps`, two elements per float32
// lane.  Scores: each K tile stored as [D / 2][16 keys] pairs of dims, each row's query
// pair broadcast (Qb: [padded][D] bfloat16, unscaled; the scale is applied to the sums).
// Values: the probabilities rounded to bfloat16 (as the decode kernel and GPU flash
// attention round P before P V) in pairs of keys, V gathered as [keys / 2][D] pairs.
template <int64_t D>
struct BF16Prefill {
  static void scores(const PrefillRows& p, const bf16* Qb, const bf16* k_cache, const int64_t* table,
                     int64_t block_size, int64_t kv_heads, int64_t h, float scale, float* S, uint32_t* tile) {
    const uint32_t* Q = reinterpret_cast<const uint32_t*>(Qb);  // [padded][D / 2] pairs
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t k0 = 0; k0 < p.num_keys; k0 += kKeyTile) {
      const int64_t nk = std::min(kKeyTile, p.num_keys - k0);
      const uint32_t* keys[kKeyTile];
      for (int64_t i = 0; i < kKeyTile; ++i) {
        const int64_t pos = p.k_lo + k0 + std::min(i, nk - 1);  // a short tile repeats its last key
        keys[i] = reinterpret_cast<const uint32_t*>(head_row<D>(k_cache, table, pos, block_size, kv_heads, h));
      }
      for (int64_t j0 = 0; j0 < D / 2; j0 += 16) {  // 16 dimension pairs at a time
        const uint32_t* part[kKeyTile];
        for (int64_t i = 0; i < kKeyTile; ++i) part[i] = keys[i] + j0;
        transpose16x16(part, tile + j0 * kKeyTile);
      }
      for (int64_t r0 = 0; r0 < p.padded; r0 += kRowBlock) {
        if (k0 >= p.block_keys(r0)) continue;
        __m512 s[kRowBlock];
        for (int64_t rr = 0; rr < kRowBlock; ++rr) s[rr] = _mm512_setzero_ps();
        for (int64_t j = 0; j < D / 2; ++j) {
          const __m512bh kj = (__m512bh)_mm512_loadu_si512(tile + j * kKeyTile);
          for (int64_t rr = 0; rr < kRowBlock; ++rr)
            s[rr] = _mm512_dpbf16_ps(s[rr], kj, (__m512bh)_mm512_set1_epi32(Q[(r0 + rr) * (D / 2) + j]));
        }
        for (int64_t rr = 0; rr < kRowBlock; ++rr)
          _mm512_storeu_ps(S + (r0 + rr) * p.width + k0, _mm512_mul_ps(s[rr], scale_v));
      }
    }
  }

  static void values(const PrefillRows& p, float* S, const bf16* v_cache, const int64_t* table,
                     int64_t block_size, int64_t kv_heads, int64_t h, float* acc, bf16* values) {
    gather_value_pairs<D>(p, v_cache, table, block_size, kv_heads, h, values);
    narrow_weights(p, S);
    const uint32_t* W = reinterpret_cast<const uint32_t*>(S);  // row r's key pairs from W + r * width
    for (int64_t r0 = 0; r0 < p.padded; r0 += kRowBlock) {
      const int64_t key_pairs = (std::min(p.block_keys(r0), p.num_keys) + 1) / 2;
      for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
        __m512 a[kRowBlock];
        for (int64_t rr = 0; rr < kRowBlock; ++rr) a[rr] = _mm512_setzero_ps();
        for (int64_t i = 0; i < key_pairs; ++i) {
          const __m512bh v = (__m512bh)_mm512_loadu_si512(values + (i * D + d0) * 2);
          for (int64_t rr = 0; rr < kRowBlock; ++rr)
            a[rr] = _mm512_dpbf16_ps(a[rr], v, (__m512bh)_mm512_set1_epi32(W[(r0 + rr) * p.width + i]));
        }
        for (int64_t rr = 0; rr < kRowBlock; ++rr) _mm512_storeu_ps(acc + (r0 + rr) * D + d0, a[rr]);
      }
    }
  }
};
#endif

#if defined(PAGEDLLM_AMX)
// bfloat16 on AMX tiles: the same three passes as BF16Prefill, each product a `tdpbf16ps` over
// blocks of 16 rows.  The K tiles transposed to pairs of dims ([D / 2][16 keys]) are the B tiles of
// Q K^T as they stand, and V's pairs of keys ([pairs][D][2]) those of P V; Q's rows and P's (in
// bfloat16, written over the first half of each float32 row) are A tiles read in place.  Keys
// run to `width`, a multiple of 32 (one A tile of P); columns past a row's visible keys are
// computed or left as they are, then zeroed by the softmax.  Tiles (configure_tiles): 0-3 C,
// 4 A, 5-7 B.
constexpr int64_t kAmxRows = 16;

template <int64_t D>
struct AmxPrefill {
  // Keys the rows r0 .. r0 + 15 see: up to the last real row's position.
  static int64_t block_keys(const PrefillRows& p, int64_t r0) {
    return p.first_pos + std::min(r0 + kAmxRows - 1, p.rows - 1) / p.group + 1 - p.k_lo;
  }

  // S [padded][width] = Q K^T (unscaled) for the keys each block of 16 rows sees, 32 keys at a
  // time; Kt receives every key tile's pairs first ([tiles][D / 2][16]).
  static void scores(const PrefillRows& p, const bf16* Qb, const bf16* k_cache, const int64_t* table,
                     int64_t block_size, int64_t kv_heads, int64_t h, float* S, uint32_t* Kt) {
    for (int64_t k0 = 0; k0 < p.num_keys; k0 += kKeyTile) {
      const int64_t nk = std::min(kKeyTile, p.num_keys - k0);
      const uint32_t* keys[kKeyTile];
      for (int64_t i = 0; i < kKeyTile; ++i) {  // a short tile repeats its last key
        const int64_t pos = p.k_lo + k0 + std::min(i, nk - 1);
        keys[i] = reinterpret_cast<const uint32_t*>(head_row<D>(k_cache, table, pos, block_size, kv_heads, h));
      }
      uint32_t* tile = Kt + k0 * (D / 2);
      for (int64_t j0 = 0; j0 < D / 2; j0 += 16) {
        const uint32_t* part[kKeyTile];
        for (int64_t i = 0; i < kKeyTile; ++i) part[i] = keys[i] + j0;
        transpose16x16(part, tile + j0 * kKeyTile);
      }
    }
    const int64_t lds = p.width * static_cast<int64_t>(sizeof(float));
    for (int64_t r0 = 0; r0 < p.padded; r0 += kAmxRows) {
      const int64_t keys = std::min(block_keys(p, r0), p.num_keys);
      const bf16* a = Qb + r0 * D;
      for (int64_t k0 = 0; k0 < keys; k0 += 2 * kKeyTile) {
        const bool two = k0 + kKeyTile < keys;
        const uint32_t* b0 = Kt + k0 * (D / 2);
        const uint32_t* b1 = b0 + kKeyTile * (D / 2);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < D / 32; ++c) {
          _tile_loadd(4, a + 32 * c, D * 2);
          _tile_loadd(5, b0 + c * 16 * kKeyTile, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (two) {
            _tile_loadd(6, b1 + c * 16 * kKeyTile, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
        }
        _tile_stored(0, S + r0 * p.width + k0, lds);
        if (two) _tile_stored(1, S + r0 * p.width + k0 + kKeyTile, lds);
      }
    }
  }

  // acc [padded][D] = P V, P being S's softmax; 64 dims (four C tiles) at a time.
  static void values(const PrefillRows& p, float* S, const bf16* v_cache, const int64_t* table, int64_t block_size,
                     int64_t kv_heads, int64_t h, float* acc, bf16* values) {
    gather_value_pairs<D>(p, v_cache, table, block_size, kv_heads, h, values);
    narrow_weights(p, S);
    const int64_t lds = p.width * static_cast<int64_t>(sizeof(float)), ldv = D * 2 * 2;
    for (int64_t r0 = 0; r0 < p.padded; r0 += kAmxRows) {
      const int64_t keys = std::min(block_keys(p, r0), p.num_keys);
      const bf16* a = reinterpret_cast<const bf16*>(S + r0 * p.width);
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < keys; k0 += 32) {
          const bf16* b = values + ((k0 / 2) * D + d0) * 2;
          _tile_loadd(4, a + k0, lds);
          _tile_loadd(5, b, ldv);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, b + 32, ldv);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, b + 64, ldv);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, b + 96, ldv);
          _tile_dpbf16ps(3, 4, 5);
        }
        float* c = acc + r0 * D + d0;
        _tile_stored(0, c, D * 4);
        _tile_stored(1, c + 16, D * 4);
        _tile_stored(2, c + 32, D * 4);
        _tile_stored(3, c + 48, D * 4);
      }
    }
  }
};
#endif

template <int64_t D, typename T, typename KV>
void prefill_item(const T* q, const KV* k_cache, const KV* v_cache, T* out, const int64_t* table, int64_t row0,
                  int64_t first_pos, int64_t num_tokens, int64_t window, int64_t block_size, int64_t kv_heads,
                  int64_t group, int64_t h, float scale, bool amx, std::vector<float>& buf) {
  const int64_t heads = kv_heads * group, rows = num_tokens * group;
  // Rows padded to whole row blocks, keys to whole key tiles (AMX: 16 rows, 32 keys).
  const int64_t row_block = amx ? 16 : kRowBlock, key_multiple = amx ? 32 : kKeyTile;
  const int64_t padded = (rows + row_block - 1) / row_block * row_block;
  // Keys k_lo .. first_pos + num_tokens - 1: the first row's window starts at k_lo and the
  // last token sees every key before it.
  const int64_t k_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t num_keys = first_pos + num_tokens - k_lo;
  const int64_t width = (num_keys + key_multiple - 1) / key_multiple * key_multiple;
  const PrefillRows p{rows, padded, group, first_pos, k_lo, num_keys, width, window};
  buf.resize(padded * (2 * D + 1 + width) + D * std::max(kKeyTile, width / 2) + width * D);
  float* Q = buf.data();              // [padded][D]; padding rows are zero
  float* acc = Q + padded * D;        // [padded][D]
  float* inv_sum = acc + padded * D;  // [padded]
  float* S = inv_sum + padded;        // [padded][width] scores, then probabilities
  float* tile = S + padded * width;   // a K tile (AMX: every key tile, as bfloat16 pairs)
  float* values = tile + D * std::max(kKeyTile, width / 2);  // the item's V rows
  auto query = [&](int64_t t, int64_t g) { return q + (row0 + t) * heads * D + (h * group + g) * D; };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<KV, bf16>) {
    // bfloat16 copies fit in the float32 buffers' room: Q, the K tile's pairs, V's pairs.
    bf16* Qb = reinterpret_cast<bf16*>(Q);
    std::fill(Qb, Qb + padded * D, bf16{0});
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t g = 0; g < group; ++g) std::copy_n(query(t, g), D, Qb + (t * group + g) * D);
#if defined(PAGEDLLM_AMX)
    if (amx) {
      AmxPrefill<D>::scores(p, Qb, k_cache, table, block_size, kv_heads, h, S, reinterpret_cast<uint32_t*>(tile));
      softmax_item(p, S, inv_sum, scale);
      AmxPrefill<D>::values(p, S, v_cache, table, block_size, kv_heads, h, acc, reinterpret_cast<bf16*>(values));
    } else
#endif
    {
      BF16Prefill<D>::scores(p, Qb, k_cache, table, block_size, kv_heads, h, scale, S,
                           reinterpret_cast<uint32_t*>(tile));
      softmax_item(p, S, inv_sum);
      BF16Prefill<D>::values(p, S, v_cache, table, block_size, kv_heads, h, acc, reinterpret_cast<bf16*>(values));
    }
  } else
#endif
  {
    std::fill(Q, Q + padded * D, 0.f);
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const T* src = query(t, g);
        float* dst = Q + (t * group + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
      }
    Float32Prefill<D, KV>::scores(p, Q, k_cache, table, block_size, kv_heads, h, S, tile);
    softmax_item(p, S, inv_sum);
    Float32Prefill<D, KV>::values(p, S, v_cache, table, block_size, kv_heads, h, acc, values);
  }
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      T* dst = out + (row0 + t) * heads * D + (h * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc[r * D + d] * inv_sum[r]);
    }
}

#if defined(__AVX512BF16__)
// bfloat16 queries over a float8 cache: the item's visible K and V rows of head h converted to
// bfloat16 (exact: e4m3 values are bfloat16 values) into per-thread copies laid out as the cache
// is, through a block table of its own, then the bfloat16 paths (AMX or AVX512-BF16) as they are.
// The copies keep every KV head's room (only head h is written or read) and stay allocated per
// thread at the longest context seen: 2 x 2 bytes x kv_heads x head_dim a token (SmolLM2: 768 B).
// PAGEDLLM_AMX implies AVX512-BF16 (amx.h), so `amx` is never set for float8 without this path.
template <int64_t D>
void prefill_item_f8(const bf16* q, const f8* k_cache, const f8* v_cache, bf16* out, const int64_t* table,
                     int64_t row0, int64_t first_pos, int64_t num_tokens, int64_t window, int64_t block_size,
                     int64_t kv_heads, int64_t group, int64_t h, float scale, bool amx, std::vector<float>& buf) {
  thread_local std::vector<bf16> k_rows, v_rows;
  thread_local std::vector<int64_t> own_table;
  const int64_t k_lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  const int64_t end = first_pos + num_tokens, first_block = k_lo / block_size;
  const int64_t blocks = (end + block_size - 1) / block_size;
  own_table.resize(blocks);
  for (int64_t j = first_block; j < blocks; ++j) own_table[j] = j - first_block;
  const size_t elements = static_cast<size_t>((blocks - first_block) * block_size * kv_heads * D);
  if (k_rows.size() < elements) k_rows.resize(elements), v_rows.resize(elements);
  for (int64_t pos = k_lo; pos < end; ++pos) {
    const int64_t at = ((pos - first_block * block_size) * kv_heads + h) * D;
    const f8* k = head_row<D>(k_cache, table, pos, block_size, kv_heads, h);
    const f8* v = head_row<D>(v_cache, table, pos, block_size, kv_heads, h);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh kb = _mm512_cvtne2ps_pbh(load16(k + d + 16), load16(k + d));
      const __m512bh vb = _mm512_cvtne2ps_pbh(load16(v + d + 16), load16(v + d));
      _mm512_storeu_si512(k_rows.data() + at + d, (__m512i)kb);
      _mm512_storeu_si512(v_rows.data() + at + d, (__m512i)vb);
    }
  }
  prefill_item<D>(q, k_rows.data(), v_rows.data(), out, own_table.data(), row0, first_pos, num_tokens, window,
                  block_size, kv_heads, group, h, scale, amx, buf);
}
#endif

template <int64_t D, typename T, typename KV>
void prefill_kernel(const T* q, const KV* k_cache, const KV* v_cache, T* out, const int64_t* query_starts,
                    const int64_t* query_lens, const int64_t* seq_lens, const int64_t* block_tables,
                    int64_t num_requests, int64_t max_blocks, int64_t block_size, int64_t kv_heads, int64_t group,
                    float scale, int64_t window) {
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  struct Item { int64_t request, head, first_token, num_tokens; };
  std::vector<Item> items;
  for (int64_t b = 0; b < num_requests; ++b)
    for (int64_t t = 0; t < query_lens[b]; t += tokens_per_item)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({b, h, t, std::min(tokens_per_item, query_lens[b] - t)});
  const int64_t num_items = static_cast<int64_t>(items.size());
#if defined(PAGEDLLM_AMX)
  const bool amx = std::is_same_v<T, bf16> && !std::is_same_v<KV, float> && amx_granted();
#else
  const bool amx = false;
#endif
#pragma omp parallel
  {
#if defined(PAGEDLLM_AMX)
    if (amx) configure_tiles();
#endif
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = num_items - 1; i >= 0; --i) {  // the last tiles see the most keys: start them first
      const Item& it = items[i];
      const int64_t b = it.request;
      const int64_t first_pos = seq_lens[b] - query_lens[b] + it.first_token;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<KV, f8>) {
        prefill_item_f8<D>(q, k_cache, v_cache, out, block_tables + b * max_blocks, query_starts[b] + it.first_token,
                           first_pos, it.num_tokens, window, block_size, kv_heads, group, it.head, scale, amx, buf);
        continue;
      }
#endif
      prefill_item<D>(q, k_cache, v_cache, out, block_tables + b * max_blocks, query_starts[b] + it.first_token,
                   first_pos, it.num_tokens, window, block_size, kv_heads, group, it.head, scale, amx, buf);
    }
#if defined(PAGEDLLM_AMX)
    if (amx) _tile_release();
#endif
  }
}


}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;
using pagedllm::f16;
using pagedllm::f8;

// q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim],
// head_dim 64, 128 or 256 (the caller checks; another size does nothing).
// Prefill: per prefilling request its first query row, number of new tokens, context length
// after the step, and block table.  window: the sliding window (0: none).
#define PAGEDLLM_PREFILL_ATTENTION(SUFFIX, T, KV)                                                                             \
  PAGEDLLM_API void paged_prefill_attention_##SUFFIX(                                                              \
      const T* q, const KV* k_cache, const KV* v_cache, T* out, const int64_t* query_starts, const int64_t* query_lens, \
      const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests, int64_t max_blocks,               \
      int64_t block_size, int64_t kv_heads, int64_t group, float scale, int64_t window, int64_t head_dim) {         \
    switch (head_dim) {                                                                                            \
      case 64: pagedllm::prefill_kernel<64, T, KV>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,        \
                                               block_tables, num_requests, max_blocks, block_size, kv_heads, group, \
                                               scale, window); break;                                               \
      case 128: pagedllm::prefill_kernel<128, T, KV>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,      \
                                                 block_tables, num_requests, max_blocks, block_size, kv_heads,      \
                                                 group, scale, window); break;                                      \
      case 256: pagedllm::prefill_kernel<256, T, KV>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,      \
                                                 block_tables, num_requests, max_blocks, block_size, kv_heads,      \
                                                 group, scale, window); break;                                      \
      default: break;                                                                                              \
    }                                                                                                              \
  }

PAGEDLLM_PREFILL_ATTENTION(f32, float, float)
PAGEDLLM_PREFILL_ATTENTION(bf16, bf16, bf16)
PAGEDLLM_PREFILL_ATTENTION(f32_f16kv, float, f16)  // float32 queries over a float16 KV cache
PAGEDLLM_PREFILL_ATTENTION(f32_f8kv, float, f8)    // float32 or bfloat16 queries over a float8 e4m3 one
PAGEDLLM_PREFILL_ATTENTION(bf16_f8kv, bf16, f8)
