// Paged decode attention on the CPU (one query token per request), reading K/V in place
// through the block tables.  head_dim 64, 128 or 256 (a template parameter D; the register
// tiles cover 64 dims, C, and loop over D / C).  With a sliding window W (W > 0), the query
// at position p sees keys p - W + 1 .. p only; W = 0 is full causal attention.
//
// One work item = one decoding request, all of its heads, or with fewer requests than threads
// a part of its context (decode_kernel).  A token's K (or V) row holds every KV head
// ([kv_heads, 64] contiguous) and a block's rows are contiguous, so walking the block table
// tile by tile streams each block from memory once; each K/V head row serves all `group` query
// heads that read it.  Three passes over a per-thread buffer: scores (q . k for every key), an
// exact softmax, and the weighted sum of values.  The scores of a tile's keys are computed
// together, their horizontal sums done at once by a transpose tree (16 keys with AVX-512, 8
// with AVX2); with AVX512-BF16 bfloat16 rows go straight into `vdpbf16ps` without conversion;
// the value sums stay in registers for a tile.  A float8 cache's keys are widened once per tile
// and KV head (WideKey) for the group's query heads to share.  Without AVX2 the same loops are left to the
// compiler's vectorizer (on AVX2 its code summed each key's lanes apart: the intrinsics measured
// 1.3-1.4x faster on a 257-key context held in cache, one thread, float32, AMD EPYC).  The scores
// are computed KV head by KV head, one query head at a time (the tile's keys come from L1 for
// the others of its group).  Each pass asks for its first tile, then for the next tile's rows
// while it computes the current one, into L2, spreading those requests over its KV heads (each
// head's slice of the next rows as it starts that head): 13% faster than all at once in the
// scores pass, 3-13% in the values pass, which asks for its first tile before the softmax.
// With AVX512-BF16 and a bfloat16 cache they are spread finer still: the group's first query
// head asks for the next tile's row i (its slice) as it reads row i, key by key in the scores
// pass and pair by pair in the values pass.  At 160 requests x 400 tokens over 30 layers' caches
// that read K/V 1.13x faster with blocks in order, 1.09x placed at random, and 0.96x held in
// cache (benchmarks/attention_bandwidth.py, 2-core AMX Xeon; docs/performance.md).
// Against the kernel before (rows read in memory order, every head loading its query again for
// every key, prefetches into L1 all at once, none for the first tile) this measured 1.8-2.0x
// faster at 128 requests x ~268 tokens over 30 layers' caches (bfloat16, AVX512-BF16 EPYC;
// docs/performance.md).
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "avx2.h"
#include "avx512.h"
#include "common.h"
#include "softmax.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

constexpr int64_t C = 64;  // dims per register tile; head_dim D is a multiple of it
constexpr int64_t kKeys = 16;  // keys per score tile

// Walks one request's context from position `start` to `len` through its block table,
// handing out the cache rows (all KV heads) of successive positions, kKeys at a time,
// with no division per key.
template <typename T>
class RowWalker {
 public:
  RowWalker(const T* cache, const int64_t* table, int64_t start, int64_t len, int64_t block_size, int64_t row)
      : cache_(cache),
        table_(table),
        len_(len),
        block_size_(block_size),
        row_(row),
        t_(start),
        j_(start / block_size),
        r_(start % block_size) {
    if (r_ != 0) block_ = cache_ + table_[j_] * block_size_ * row_;
  }

  // Fills rows[0, kKeys) for the next positions and returns how many are real; a short
  // tile repeats its last row, so full-width loads stay inside the cache.
  int64_t next(const T** rows) {
    const int64_t n = std::min(kKeys, len_ - t_);
    if (n <= 0) return 0;
    for (int64_t i = 0; i < n; ++i) {
      if (r_ == 0) block_ = cache_ + table_[j_] * block_size_ * row_;
      rows[i] = block_ + r_ * row_;
      if (++r_ == block_size_) r_ = 0, ++j_;
    }
    for (int64_t i = n; i < kKeys; ++i) rows[i] = rows[n - 1];
    t_ += n;
    return n;
  }

 private:
  const T* cache_;
  const int64_t* table_;
  int64_t len_, block_size_, row_, t_, j_, r_;
  const T* block_ = nullptr;
};

// Asks for a tile's rows (`bytes` of each, from byte `offset`) ahead of their use, into L2
// (locality 2, prefetcht1): into L1 (prefetcht0) measured 1.4x slower on an AVX512-BF16
// EPYC, whose L1 miss buffers a SmolLM2 tile's 96 lines overrun (docs/performance.md).
template <typename T>
inline void prefetch_lines(const T* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 2);
}
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t bytes, int64_t offset = 0) {
  for (int64_t i = 0; i < kKeys; ++i) prefetch_lines(reinterpret_cast<const char*>(rows[i]) + offset, bytes);
}

#if defined(__AVX512F__)
// 64 elements of a query head or a key in registers: as floats, or for bfloat16 with
// AVX512-BF16 as pairs, the form `vdpbf16ps` takes.
struct Regs64 {
  __m512 f[4];
#if defined(__AVX512BF16__)
  __m512bh b[2];
#endif
};
inline void load64(const float* p, Regs64& r) {
  for (int j = 0; j < 4; ++j) r.f[j] = _mm512_loadu_ps(p + 16 * j);
}
inline void load64(const f16* p, Regs64& r) {
  for (int j = 0; j < 4; ++j) r.f[j] = load16(p + 16 * j);
}
inline void load64(const f8* p, Regs64& r) {
  for (int j = 0; j < 4; ++j) r.f[j] = load16(p + 16 * j);
}
// As floats whatever T is: a query's form beside a cache that is not bfloat16.
template <typename T>
inline void load64_floats(const T* p, Regs64& r) {
  for (int j = 0; j < 4; ++j) r.f[j] = load16(p + 16 * j);
}
inline void load64(const bf16* p, Regs64& r) {
#if defined(__AVX512BF16__)
  for (int j = 0; j < 2; ++j) r.b[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
#else
  for (int j = 0; j < 4; ++j) r.f[j] = load16(p + 16 * j);
#endif
}
// acc + q . k as 16 partial sums, for 64 elements of one key (T picks the registers' form).
template <typename T>
inline __m512 dot_acc(const Regs64& k, const Regs64& q, __m512 acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    acc = _mm512_dpbf16_ps(acc, k.b[0], q.b[0]);
    return _mm512_dpbf16_ps(acc, k.b[1], q.b[1]);
  }
#endif
  for (int j = 0; j < 4; ++j) acc = _mm512_fmadd_ps(k.f[j], q.f[j], acc);
  return acc;
}

// Scores of one query head against one tile of keys (its KV head at `offset` in each row):
// each (key, head) dot product is left as 16 partial sums, whose horizontal sums are then
// done 16 keys at a time.  One query head at a time, reloading the tile's keys from L1 for
// each head of the group: holding 2-4 heads' queries and partial sums (16 zmm each) in
// registers spills; 4 heads measured 1.04-1.16x the time, 2 within noise (docs/performance.md).
template <int64_t D, typename T, typename KV, bool Ask = false>
inline void head_scores(const T* q, const KV* const* rows, int64_t offset, float scale, float* scores,
                        const KV* const* next = nullptr) {
  alignas(64) __m512 partial[kKeys];
  for (int64_t c = 0; c < D; c += C) {
    Regs64 qr;
    if constexpr (std::is_same_v<KV, bf16>)
      load64(q + c, qr);
    else
      load64_floats(q + c, qr);
    for (int64_t i = 0; i < kKeys; ++i) {
      if constexpr (Ask) prefetch_lines(next[i] + offset + c, C * static_cast<int64_t>(sizeof(KV)));
      Regs64 kr;
      load64(rows[i] + offset + c, kr);
      partial[i] = dot_acc<KV>(kr, qr, c == 0 ? _mm512_setzero_ps() : partial[i]);
    }
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(hsum16(partial), _mm512_set1_ps(scale)));
}

// acc[g] += sum over the tile's n keys of p[g][t] v[t], for G query heads of one KV head and
// 64 of its dims (the accumulators stay in registers for the tile: 4G of them); head g's
// accumulators start at acc + g * stride.
template <int G, typename T>
inline void tile_values(const float* probs, const T* const* rows, int64_t n, int64_t offset, int64_t ld,
                        float* acc, int64_t stride) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_loadu_ps(acc + g * stride + 16 * j);
  for (int64_t i = 0; i < n; ++i) {
    const T* v = rows[i] + offset;
    __m512 row[4];
    for (int j = 0; j < 4; ++j) row[j] = load16(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * ld + i]);
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_fmadd_ps(p, row[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * stride + 16 * j, a[g][j]);
}


#if defined(__AVX512BF16__)
// bfloat16 values with AVX512-BF16: keys two at a time through `vdpbf16ps`, the weights
// rounded to bfloat16 first (as GPU flash attention rounds P before P.V).  Two V rows are
// interleaved by 16-bit unpacks, which keep each 128-bit lane's dims together: the
// accumulators hold each 32 dims in the order [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31],
// put back by `unpair_acc`.
template <int G, bool Ask = false>
inline void tile_value_pairs(const uint32_t* weight_pairs, const bf16* const* rows, int64_t n, int64_t offset,
                             int64_t ld_pairs, float* acc, int64_t stride, const bf16* const* next = nullptr) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_loadu_ps(acc + g * stride + 16 * j);
  for (int64_t i = 0; i < n; i += 2) {  // an odd tail pairs with the tile's repeated row, whose weight is 0
    if constexpr (Ask) {
      prefetch_lines(next[i] + offset, C * static_cast<int64_t>(sizeof(bf16)));
      prefetch_lines(next[i + 1] + offset, C * static_cast<int64_t>(sizeof(bf16)));
    }
    const bf16* v0 = rows[i] + offset;
    const bf16* v1 = rows[i + 1] + offset;
    const __m512i x0 = _mm512_loadu_si512(v0), x1 = _mm512_loadu_si512(v0 + 32);
    const __m512i y0 = _mm512_loadu_si512(v1), y1 = _mm512_loadu_si512(v1 + 32);
    const __m512bh pairs[4] = {(__m512bh)_mm512_unpacklo_epi16(x0, y0), (__m512bh)_mm512_unpackhi_epi16(x0, y0),
                               (__m512bh)_mm512_unpacklo_epi16(x1, y1), (__m512bh)_mm512_unpackhi_epi16(x1, y1)};
    for (int g = 0; g < G; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[g * ld_pairs + i / 2]));
      for (int j = 0; j < 4; ++j) a[g][j] = _mm512_dpbf16_ps(a[g][j], pairs[j], w);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * stride + 16 * j, a[g][j]);
}

// The softmax weights of every head as bfloat16, zero past `len` (to the tile's end).
inline void weights_to_bf16(const float* probs, int64_t heads, int64_t len, int64_t ld, bf16* out) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % kKeys)) - 1);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < ld; i += kKeys) {
      const __mmask16 keep = i + kKeys <= len ? static_cast<__mmask16>(0xFFFF) : tail;
      const __m256bh narrow = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, probs + h * ld + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * ld + i), reinterpret_cast<const __m256i&>(narrow));
    }
}

template <int64_t D>
inline void tile_all_values(const bf16* weights, const bf16* const* rows, int64_t n, int64_t t0, int64_t kv_heads,
                            int64_t group, int64_t ld, float* acc, const bf16* const* next) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(weights);
  const int64_t ld_pairs = ld / 2;
  constexpr int64_t head_bytes = D * static_cast<int64_t>(sizeof(bf16));
  // A full tile asks for the next one's rows pair by pair as the first heads of each KV head
  // read theirs (a short tile, the last, has no next).
  const bool spread = next != nullptr && n == kKeys;
  for (int64_t h = 0; h < kv_heads; ++h) {
    if (next != nullptr && !spread) prefetch_rows(next, head_bytes, h * head_bytes);
    for (int64_t g = 0; g < group;) {
      const int64_t head = h * group + g, count = std::min<int64_t>(4, group - g);
      const uint32_t* p = pairs + head * ld_pairs + t0 / 2;
      const bool ask = spread && g == 0;
      for (int64_t c = 0; c < D; c += C) {
        float* a = acc + head * D + c;
        const int64_t at = h * D + c;
        switch (count * 2 + ask) {
          case 9: tile_value_pairs<4, true>(p, rows, n, at, ld_pairs, a, D, next); break;
          case 8: tile_value_pairs<4>(p, rows, n, at, ld_pairs, a, D); break;
          case 7: tile_value_pairs<3, true>(p, rows, n, at, ld_pairs, a, D, next); break;
          case 6: tile_value_pairs<3>(p, rows, n, at, ld_pairs, a, D); break;
          case 5: tile_value_pairs<2, true>(p, rows, n, at, ld_pairs, a, D, next); break;
          case 4: tile_value_pairs<2>(p, rows, n, at, ld_pairs, a, D); break;
          case 3: tile_value_pairs<1, true>(p, rows, n, at, ld_pairs, a, D, next); break;
          default: tile_value_pairs<1>(p, rows, n, at, ld_pairs, a, D); break;
        }
      }
      g += count;
    }
  }
}

// The accumulators put back in dims' order, in place, by one permute per 16 dims.
template <int64_t D>
inline void unpair_acc(float* acc, int64_t heads) {
  // Of each 32 dims: [0, 16) from acc's [0, 16) (lo) and [16, 32) (hi) of the same 32.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < D; g += 32) {
      float* a = acc + h * D + g;
      const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif  // __AVX512BF16__
#elif defined(__AVX2__)  // load8: avx2.h

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once.
inline __m256 hsum8x8(const __m256* v) {
  // hadd(hadd(v0, v1), hadd(v2, v3)) holds v0..v3's sums of lanes 0-3 in its low half, of 4-7 in its high one.
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scores of one query head against one tile of keys (its KV head at `offset` in each row),
// 8 keys at a time and 32 dims a pass: 8 partial sums and 4 query registers, 12 of the 16.
// (The compiler's vectorization of the plain loop summed each key's lanes on its own.)
template <int64_t D, typename T, typename KV>
inline void head_scores(const T* q, const KV* const* rows, int64_t offset, float scale, float* scores) {
  for (int64_t k0 = 0; k0 < kKeys; k0 += 8) {
    __m256 partial[8];
    for (int i = 0; i < 8; ++i) partial[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
      __m256 qr[4];
      for (int j = 0; j < 4; ++j) qr[j] = load8(q + c + 8 * j);
      for (int i = 0; i < 8; ++i) {
        const KV* k = rows[k0 + i] + offset + c;
        for (int j = 0; j < 4; ++j) partial[i] = _mm256_fmadd_ps(load8(k + 8 * j), qr[j], partial[i]);
      }
    }
    _mm256_storeu_ps(scores + k0, _mm256_mul_ps(hsum8x8(partial), _mm256_set1_ps(scale)));
  }
}

// acc[g] += sum over the tile's n keys of p[g][t] v[t], for G query heads of one KV head and
// 64 of its dims, 16 dims a pass (2G accumulators in registers, 8 of the 16 at G = 4).
template <int G, typename T>
inline void tile_values(const float* probs, const T* const* rows, int64_t n, int64_t offset, int64_t ld,
                        float* acc, int64_t stride) {
  for (int64_t c = 0; c < C; c += 16) {
    __m256 a[G][2];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 2; ++j) a[g][j] = _mm256_loadu_ps(acc + g * stride + c + 8 * j);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = rows[i] + offset + c;
      const __m256 row[2] = {load8(v), load8(v + 8)};
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_broadcast_ss(probs + g * ld + i);
        for (int j = 0; j < 2; ++j) a[g][j] = _mm256_fmadd_ps(p, row[j], a[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 2; ++j) _mm256_storeu_ps(acc + g * stride + c + 8 * j, a[g][j]);
  }
}
#endif

#if defined(__AVX2__)  // AVX-512's head_scores and tile_values, or AVX2's
// The form a float8 cache's keys are widened to, once per tile and KV head, before the group's
// query heads read them: bfloat16 (exact for every float8 value) where bfloat16 queries take
// `vdpbf16ps`, else float32.  Widening inside head_scores repeated the conversion for each
// query head of the group and made float8 scores 2.7x bfloat16's compute (SmolLM2's heads).
#if defined(__AVX512BF16__)
template <typename T>
using WideKey = std::conditional_t<std::is_same_v<T, bf16>, bf16, float>;
#else
template <typename T>
using WideKey = float;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define PAGEDLLM_F8_LOOKUP 1
// float8 to bfloat16 by table, 64 values in 6 instructions (against 7 per 16 through half
// precision): `vpermi2b` looks up the high and the low byte of each magnitude's bfloat16 in
// 128-entry tables (its index ignores bit 7, the sign, which is put back into the high byte), and
// byte unpacks join them.  The unpacks work within 128-bit lanes, so 64 values come out in
// another order (lookup_source); the queries the keys meet are put in the same order
// (lookup_order), and a dot product does not depend on it.
struct F8Tables {
  __m512i hi[2], lo[2];
};
inline const F8Tables& f8_tables() {
  static const F8Tables tables = [] {
    alignas(64) uint8_t hi[128], lo[128];
    for (int m = 0; m < 128; ++m) {
      const bf16 b = from_float<bf16>(to_float(f8{static_cast<uint8_t>(m)}));
      hi[m] = static_cast<uint8_t>(b.bits >> 8);
      lo[m] = static_cast<uint8_t>(b.bits & 0xff);
    }
    return F8Tables{{_mm512_load_si512(hi), _mm512_load_si512(hi + 64)},
                    {_mm512_load_si512(lo), _mm512_load_si512(lo + 64)}};
  }();
  return tables;
}

// The input value that position j of widen64_lookup's 64 outputs holds: the outputs are values
// [0-7, 16-23, 32-39, 48-55 | 8-15, 24-31, 40-47, 56-63].
constexpr int64_t lookup_source(int64_t j) {
  return j < 32 ? 16 * (j / 8) + j % 8 : 16 * ((j - 32) / 8) + 8 + j % 8;
}

inline void widen64_lookup(const f8* p, bf16* out, const F8Tables& t) {
  const __m512i b = _mm512_loadu_si512(p);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi[0], b, t.hi[1]), b,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | (b & 0x80)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo[0], b, t.lo[1]);
  _mm512_storeu_si512(out, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi8(lo, hi));
}

// Every head's query [heads, D] with each 64 dims in the lookup's order, into out.
template <int64_t D>
inline const bf16* lookup_order(const bf16* q, int64_t heads, std::vector<bf16>& out) {
  out.resize(static_cast<size_t>(heads * D));
  for (int64_t i = 0; i < heads * D; i += 64)
    for (int64_t j = 0; j < 64; ++j) out[i + j] = q[i + lookup_source(j)];
  return out.data();
}
#endif

// rows[i] + offset, D float8 values each, into out[i] (with PAGEDLLM_F8_LOOKUP and bfloat16
// out, each 64 in the lookup's order).  Out is WideKey<T>: bfloat16 only where AVX512-BF16 is.
template <int64_t D, typename Out>
inline void widen_keys(const f8* const* rows, int64_t offset, Out (*out)[D]) {
#if defined(PAGEDLLM_F8_LOOKUP)
  if constexpr (std::is_same_v<Out, bf16>) {
    const F8Tables& tables = f8_tables();
    for (int64_t i = 0; i < kKeys; ++i)
      for (int64_t d = 0; d < D; d += 64) widen64_lookup(rows[i] + offset + d, out[i] + d, tables);
    return;
  }
#endif
  for (int64_t i = 0; i < kKeys; ++i) {
    const f8* k = rows[i] + offset;
#if defined(__AVX512F__)
    for (int64_t d = 0; d < D; d += 16) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<Out, bf16>) {
        store_bf16x16(out[i] + d, load16(k + d));
        continue;
      }
#endif
      if constexpr (std::is_same_v<Out, float>) _mm512_storeu_ps(out[i] + d, load16(k + d));
    }
#else
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out[i] + d, load8(k + d));
#endif
  }
}

// Scores of every query head against one tile of keys, KV head by KV head, asking for each
// head's slice of the `next` tile's rows (if any).
template <int64_t D, typename T, typename KV>
inline void tile_scores(const T* q, const KV* const* rows, int64_t t0, int64_t kv_heads, int64_t group, float scale,
                        float* scores, int64_t ld, const KV* const* next) {
  constexpr int64_t head_bytes = D * static_cast<int64_t>(sizeof(KV));
#if defined(__AVX512BF16__)
  constexpr bool spread = std::is_same_v<KV, bf16>;  // asked for key by key inside head_scores
#else
  constexpr bool spread = false;
#endif
  for (int64_t h = 0; h < kv_heads; ++h) {
    if (next != nullptr && !spread) prefetch_rows(next, head_bytes, h * head_bytes);  // spread over the heads
    if constexpr (std::is_same_v<KV, f8>) {
      using W = WideKey<T>;
      alignas(64) W wide[kKeys][D];
      const W* wide_rows[kKeys];
      widen_keys<D>(rows, h * D, wide);
      for (int64_t i = 0; i < kKeys; ++i) wide_rows[i] = wide[i];
      for (int64_t head = h * group; head < (h + 1) * group; ++head)
        head_scores<D>(q + head * D, wide_rows, 0, scale, scores + head * ld + t0);
    } else {
      for (int64_t head = h * group; head < (h + 1) * group; ++head) {
        if constexpr (spread) {
          if (next != nullptr && head == h * group) {  // the group's first head asks for the next rows
            head_scores<D, T, KV, true>(q + head * D, rows, h * D, scale, scores + head * ld + t0, next);
            continue;
          }
        }
        head_scores<D>(q + head * D, rows, h * D, scale, scores + head * ld + t0);
      }
    }
  }
}

template <int64_t D, typename T>
inline void tile_all_values(const float* probs, const T* const* rows, int64_t n, int64_t t0, int64_t kv_heads,
                            int64_t group, int64_t ld, float* acc) {
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = 0; g < group;) {
      const int64_t head = h * group + g, count = std::min<int64_t>(4, group - g);
      const float* p = probs + head * ld + t0;
      for (int64_t c = 0; c < D; c += C) {
        float* a = acc + head * D + c;
        switch (count) {
          case 4: tile_values<4>(p, rows, n, h * D + c, ld, a, D); break;
          case 3: tile_values<3>(p, rows, n, h * D + c, ld, a, D); break;
          case 2: tile_values<2>(p, rows, n, h * D + c, ld, a, D); break;
          default: tile_values<1>(p, rows, n, h * D + c, ld, a, D); break;
        }
      }
      g += count;
    }
}
#else
template <int64_t D, typename T, typename KV>
inline void tile_scores(const T* q, const KV* const* rows, int64_t t0, int64_t kv_heads, int64_t group, float scale,
                        float* scores, int64_t ld, const KV* const* next) {
  if (next != nullptr) prefetch_rows(next, kv_heads * D * static_cast<int64_t>(sizeof(KV)));
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      float qf[D];
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[head * D + d]) * scale;
      for (int64_t i = 0; i < kKeys; ++i) {
        const KV* k = rows[i] + h * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qf[d] * to_float(k[d]);
        scores[head * ld + t0 + i] = s;
      }
    }
}

template <int64_t D, typename T>
inline void tile_all_values(const float* probs, const T* const* rows, int64_t n, int64_t t0, int64_t kv_heads,
                            int64_t group, int64_t ld, float* acc) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      float v[D];
      for (int64_t d = 0; d < D; ++d) v[d] = to_float(rows[i][h * D + d]);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        const float p = probs[head * ld + t0 + i];
        float* a = acc + head * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
      }
    }
}
#endif

// In place: each row of `scores` becomes exp(score - its largest), mx that largest and sum
// the sum of those weights.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t ld, float* mx, float* sum) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    mx[r] = span_max(s, 0, len);
    sum[r] = exp_span(s, 0, len, mx[r]);
  }
}

// A part of one request's attention: for keys [start, end) and every head h, mx[h] (its largest
// score), sum[h] (the sum of exp(score - mx[h])) and acc [heads, D] (the sum of those weights
// times the values, dims in order).
struct Partial {
  float *acc, *mx, *sum;
  Partial(float* p, int64_t heads, int64_t d) : acc(p), mx(p + heads * d), sum(p + heads * d + heads) {}
  static int64_t floats(int64_t heads, int64_t d) { return heads * (d + 2); }
};

// Keys start .. end - 1 of one decoding request, every head, into `part`: whole key rows (all
// KV heads) are read once, in block order, so each block's contiguous memory streams through
// the cache once.  Scores are indexed from `start`.
template <int64_t D, typename T, typename KV>
void decode_span(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* table, int64_t start, int64_t end,
                 int64_t block_size, int64_t kv_heads, int64_t group, float scale, std::vector<float>& buf,
                 const Partial& part) {
  const int64_t len = end - start, heads = kv_heads * group, row = kv_heads * D;
  const int64_t ld = (len + kKeys - 1) / kKeys * kKeys;
  buf.resize(heads * ld + heads * ld / 2);  // scores, then their bf16 copy (AVX512-BF16)
  float* scores = buf.data();
  const KV* rows[kKeys];
  RowWalker<KV> keys(k_cache, table, start, end, block_size, row);
  const KV* ahead[kKeys];
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(KV));
  RowWalker<KV> keys_ahead(k_cache, table, start, end, block_size, row);
  if (keys_ahead.next(ahead) > 0) prefetch_rows(ahead, row_bytes);  // the first tile
  const T* q_scores = q;
#if defined(PAGEDLLM_F8_LOOKUP)
  static thread_local std::vector<bf16> reordered;
  if constexpr (std::is_same_v<KV, f8> && std::is_same_v<T, bf16>) q_scores = lookup_order<D>(q, heads, reordered);
#endif
  for (int64_t t0 = 0; t0 < len; t0 += kKeys) {
    keys.next(rows);
    const bool more = keys_ahead.next(ahead) > 0;
    tile_scores<D>(q_scores, rows, t0, kv_heads, group, scale, scores, ld, more ? ahead : nullptr);
  }
  RowWalker<KV> values(v_cache, table, start, end, block_size, row);
  RowWalker<KV> values_ahead(v_cache, table, start, end, block_size, row);
  if (values_ahead.next(ahead) > 0) prefetch_rows(ahead, row_bytes);  // arrives during the softmax
  softmax_rows(scores, heads, len, ld, part.mx, part.sum);
  float* acc = part.acc;
  std::fill(acc, acc + heads * D, 0.f);
#if defined(__AVX512BF16__)
  constexpr bool paired = std::is_same_v<KV, bf16>;
  bf16* narrow = reinterpret_cast<bf16*>(scores + heads * ld);  // the weights as bfloat16
  if constexpr (paired) weights_to_bf16(scores, heads, len, ld, narrow);
#endif
  for (int64_t t0 = 0; t0 < len; t0 += kKeys) {
    const int64_t n = values.next(rows);
    const bool more = values_ahead.next(ahead) > 0;
#if defined(__AVX512BF16__)
    if constexpr (paired) {
      tile_all_values<D>(narrow, rows, n, t0, kv_heads, group, ld, acc, more ? ahead : nullptr);
      continue;
    }
#endif
    if (more) prefetch_rows(ahead, row_bytes);
    tile_all_values<D>(scores, rows, n, t0, kv_heads, group, ld, acc);
  }
#if defined(__AVX512BF16__)
  if constexpr (paired) unpair_acc<D>(acc, heads);
#endif
}

// Parts a request's keys are cut into when there are fewer requests than threads, so that every
// thread has work: one request alone, on 2 cores, read its 1,024-token context at half the rate
// of two (4.9 against 12.5 GB/s, AVX2 EPYC, float32, timed over 30 layers' caches).  At 1,024
// tokens the split took SmolLM2's attention from 8.0 to 4.5 ms a step (benchmarks/step_profile.py
// --batch 1 --context 1024 --no-fused).  Each part is at least kMinPartKeys keys,
// and at most kMaxParts a request.
constexpr int64_t kMinPartKeys = 64;
constexpr int64_t kMaxParts = 16;

// out [heads, D] from a request's `count` parts (Partial's layout, one after the other): each
// rescaled to the parts' largest score, then all divided by their summed weights (one part:
// acc / sum, as before the kernel split requests).
template <int64_t D, typename T>
void merge_parts(const float* parts, int64_t count, int64_t heads, T* out) {
  const int64_t stride = Partial::floats(heads, D);
  const float* mx = parts + heads * D;  // part p's: mx[p * stride + h], then sums at + heads
  for (int64_t h = 0; h < heads; ++h) {
    float top = -std::numeric_limits<float>::max(), weight[kMaxParts], total = 0.f;
    for (int64_t p = 0; p < count; ++p) top = std::max(top, mx[p * stride + h]);
    for (int64_t p = 0; p < count; ++p) {
      weight[p] = count == 1 ? 1.f : std::exp(mx[p * stride + h] - top);
      total += weight[p] * mx[p * stride + heads + h];
    }
    const float inv = 1.f / total;
    const float* acc = parts + h * D;
    for (int64_t d = 0; d < D; ++d) {
      if (count == 1) {
        out[h * D + d] = from_float<T>(acc[d] * inv);
        continue;
      }
      float sum = 0.f;
      for (int64_t p = 0; p < count; ++p) sum += weight[p] * acc[p * stride + d];
      out[h * D + d] = from_float<T>(sum * inv);
    }
  }
}

// The threads a split is planned for: the cores this process may run on, fixed for its life.  Not
// the current OpenMP team size, which the adaptive thread count changes between steps: a row's
// parts (and so the last bits of its output) must depend on its step's requests only, so that a
// draft verified as a row equals the decode step it stands for (pagedllm/core/speculation.py).
int64_t split_threads() {
  static const int64_t count = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max<int64_t>(1, CPU_COUNT(&set)) : int64_t{1};
  }();
  return count;
}

// split_requests: the request count that decides how many parts a request's keys are cut into
// (the step's decoding requests; rows that verify drafts are computed as the decodes they stand
// for, so they count once per request).
template <int64_t D, typename T, typename KV>
void decode_kernel(const T* q, const KV* k_cache, const KV* v_cache, T* out, const int64_t* rows,
                   const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests, int64_t max_blocks,
                   int64_t block_size, int64_t kv_heads, int64_t group, float scale, int64_t window,
                   int64_t split_requests) {
  const int64_t heads = kv_heads * group;
  const int64_t threads = split_threads();
  const int64_t basis = std::max<int64_t>(1, split_requests);
  // Twice the threads' count of parts, so that uneven parts still balance.
  const int64_t wanted = basis < threads ? std::min(kMaxParts, (2 * threads + basis - 1) / basis) : 1;
  struct Item {
    int64_t request, start, end, count;
    int64_t slot;  // a split request's part: its place in `partials` (its request's parts in a row); else -1
  };
  std::vector<Item> items;
  int64_t total = 0, slots = 0;
  for (int64_t b = 0; b < num_requests; ++b) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0, len = seq_lens[b] - start;
    total += len;
    const int64_t parts = std::max<int64_t>(1, std::min(wanted, len / kMinPartKeys));
    const int64_t step = std::max<int64_t>(kKeys, ((len + parts - 1) / parts + kKeys - 1) / kKeys * kKeys);
    const int64_t count = std::max<int64_t>(1, (len + step - 1) / step);
    for (int64_t p = 0; p < count; ++p)  // an empty context (never a real decode) still gets its one part
      items.push_back({b, start + p * step, std::min(seq_lens[b], start + (p + 1) * step), count,
                       count > 1 ? slots++ : -1});
  }
  const int64_t stride = Partial::floats(heads, D);
  std::vector<float> partials(static_cast<size_t>(slots * stride));  // only split requests' parts
  const int64_t num_items = static_cast<int64_t>(items.size());
  // A team only where the work pays for starting it: one request of 300-400 keys and 9 heads ran
  // 1.4x faster on 2 threads than on one, of 130-200 keys no faster (AVX2 EPYC, float32).
#pragma omp parallel if (total * heads >= 2048)
  {
    std::vector<float> buf, whole(stride);  // whole: a request of one part, merged straight into out
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const Item& item = items[i];
      const int64_t b = item.request;
      float* part = item.slot < 0 ? whole.data() : partials.data() + item.slot * stride;
      decode_span<D>(q + rows[b] * heads * D, k_cache, v_cache, block_tables + b * max_blocks, item.start, item.end,
                     block_size, kv_heads, group, scale, buf, Partial(part, heads, D));
      if (item.count == 1) merge_parts<D>(part, 1, heads, out + rows[b] * heads * D);
    }
    if (slots > 0) {
#pragma omp for
      for (int64_t i = 0; i < num_items; ++i) {
        const Item& item = items[i];
        if (item.slot >= 0 && (i == 0 || items[i - 1].request != item.request))  // its request's first part
          merge_parts<D>(partials.data() + item.slot * stride, item.count, heads, out + rows[item.request] * heads * D);
      }
    }
  }
}

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;
using pagedllm::f16;
using pagedllm::f8;

// q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim],
// head_dim 64, 128 or 256 (the caller checks; another size does nothing).
// Decode: rows = the query row of each decoding request; seq_lens and block tables per request.
// window: the sliding window (0: none).  split_requests: see decode_kernel (num_requests when every
// row is its own request's decode).
#define PAGEDLLM_DECODE_ATTENTION(SUFFIX, T, KV)                                                                             \
  PAGEDLLM_API void paged_decode_attention_##SUFFIX(                                                               \
      const T* q, const KV* k_cache, const KV* v_cache, T* out, const int64_t* rows, const int64_t* seq_lens,       \
      const int64_t* block_tables, int64_t num_requests, int64_t max_blocks, int64_t block_size, int64_t kv_heads,  \
      int64_t group, float scale, int64_t window, int64_t head_dim, int64_t split_requests) {                      \
    switch (head_dim) {                                                                                            \
      case 64: pagedllm::decode_kernel<64, T, KV>(q, k_cache, v_cache, out, rows, seq_lens, block_tables, num_requests, \
                                              max_blocks, block_size, kv_heads, group, scale, window,              \
                                              split_requests); break;                                              \
      case 128: pagedllm::decode_kernel<128, T, KV>(q, k_cache, v_cache, out, rows, seq_lens, block_tables,             \
                                                num_requests, max_blocks, block_size, kv_heads, group, scale,       \
                                                window, split_requests); break;                                     \
      case 256: pagedllm::decode_kernel<256, T, KV>(q, k_cache, v_cache, out, rows, seq_lens, block_tables,             \
                                                num_requests, max_blocks, block_size, kv_heads, group, scale,       \
                                                window, split_requests); break;                                     \
      default: break;                                                                                              \
    }                                                                                                              \
  }

PAGEDLLM_DECODE_ATTENTION(f32, float, float)
PAGEDLLM_DECODE_ATTENTION(bf16, bf16, bf16)
// float32 queries and outputs over a float16 KV cache (half the bytes a key or value reads).
PAGEDLLM_DECODE_ATTENTION(f32_f16kv, float, f16)
// float32 or bfloat16 queries and outputs over a float8 e4m3 KV cache (a quarter or half the bytes).
PAGEDLLM_DECODE_ATTENTION(f32_f8kv, float, f8)
PAGEDLLM_DECODE_ATTENTION(bf16_f8kv, bf16, f8)
