// Paged attention on the CPU, reading K/V in place through the block tables:
// a decode kernel (one query token per request) and a prefill kernel (chunks of
// query tokens over their cached context).  head_dim 64, 128 or 256 (a template
// parameter D; the register tiles cover 64 dims, C, and loop over D / C).  With a sliding window W
// (W > 0), the query at position p sees keys p - W + 1 .. p only; W = 0 is full
// causal attention.
//
// Decode:
// One work item = one decoding request, all of its heads.  A token's K (or V) row
// holds every KV head ([kv_heads, 64] contiguous) and a block's rows are
// contiguous, so walking the block table tile by tile streams each block from
// memory once; each K/V head row serves all `group` query heads that read it.
// Three passes over a per-thread buffer: scores (q . k for every key), an exact
// softmax, and the weighted sum of values.  With AVX-512 the scores of 16 keys are
// computed together, their horizontal sums done at once by a transpose tree, and
// with AVX512-BF16 bfloat16 rows go straight into `vdpbf16ps` without conversion;
// the value sums stay in registers for a tile.  Without AVX-512 the same loops are
// left to the compiler's vectorizer.  The scores are computed KV head by KV head, one
// query head at a time (the tile's keys come from L1 for the others of its group).
// Each pass asks for its first tile, then for the next tile's rows while it computes the
// current one, into L2, spreading those requests over its KV heads (each head's slice of
// the next rows as it starts that head): 13% faster than all at once in the scores pass,
// 3-13% in the values pass, which asks for its first tile before the softmax.  Against the
// kernel before (rows read in memory order, every head loading its query again for every
// key, prefetches into L1 all at once, none for the first tile) this measured 1.8-2.0x
// faster at 128 requests x ~268 tokens over 30 layers' caches (bfloat16, AVX512-BF16
// EPYC; docs/performance.md).
#include <omp.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "avx512.h"
#include "common.h"

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
inline void prefetch_rows(const T* const* rows, int64_t bytes, int64_t offset = 0) {
  for (int64_t i = 0; i < kKeys; ++i)
    for (int64_t b = 0; b < bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[i]) + offset + b, 0, 2);
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
template <int64_t D, typename T>
inline void head_scores(const T* q, const T* const* rows, int64_t offset, __m512 scale, float* scores) {
  alignas(64) __m512 partial[kKeys];
  for (int64_t c = 0; c < D; c += C) {
    Regs64 qr;
    load64(q + c, qr);
    for (int64_t i = 0; i < kKeys; ++i) {
      Regs64 kr;
      load64(rows[i] + offset + c, kr);
      partial[i] = dot_acc<T>(kr, qr, c == 0 ? _mm512_setzero_ps() : partial[i]);
    }
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(hsum16(partial), scale));
}

// Scores of every query head against one tile of keys, KV head by KV head, asking for each
// head's slice of the `next` tile's rows (if any).
template <int64_t D, typename T>
inline void tile_scores(const T* q, const T* const* rows, int64_t t0, int64_t kv_heads, int64_t group, float scale,
                        float* scores, int64_t ld, const T* const* next) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  constexpr int64_t head_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t h = 0; h < kv_heads; ++h) {
    if (next != nullptr) prefetch_rows(next, head_bytes, h * head_bytes);  // spread over the heads
    for (int64_t head = h * group; head < (h + 1) * group; ++head)
      head_scores<D>(q + head * D, rows, h * D, scale_v, scores + head * ld + t0);
  }
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
// put back by `store_paired_output`.
template <int G>
inline void tile_value_pairs(const uint32_t* weight_pairs, const bf16* const* rows, int64_t n, int64_t offset,
                             int64_t ld_pairs, float* acc, int64_t stride) {
  __m512 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm512_loadu_ps(acc + g * stride + 16 * j);
  for (int64_t i = 0; i < n; i += 2) {  // an odd tail pairs with the tile's repeated row, whose weight is 0
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
  for (int64_t h = 0; h < kv_heads; ++h) {
    if (next != nullptr) prefetch_rows(next, head_bytes, h * head_bytes);  // spread over the heads
    for (int64_t g = 0; g < group;) {
      const int64_t head = h * group + g, count = std::min<int64_t>(4, group - g);
      const uint32_t* p = pairs + head * ld_pairs + t0 / 2;
      for (int64_t c = 0; c < D; c += C) {
        float* a = acc + head * D + c;
        switch (count) {
          case 4: tile_value_pairs<4>(p, rows, n, h * D + c, ld_pairs, a, D); break;
          case 3: tile_value_pairs<3>(p, rows, n, h * D + c, ld_pairs, a, D); break;
          case 2: tile_value_pairs<2>(p, rows, n, h * D + c, ld_pairs, a, D); break;
          default: tile_value_pairs<1>(p, rows, n, h * D + c, ld_pairs, a, D); break;
        }
      }
      g += count;
    }
  }
}

// out = acc * inv_sum per head, rounded to bfloat16, the accumulators put back in dims'
// order by one permute per 16 dims (a scalar reorder before compiled to a scatter).
template <int64_t D>
inline void store_paired_output(const float* acc, const float* inv_sum, int64_t heads, bf16* out) {
  // Of each 32 dims: [0, 16) from acc's [0, 16) (lo) and [16, 32) (hi) of the same 32.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 scale = _mm512_set1_ps(inv_sum[h]);
    for (int64_t g = 0; g < D; g += 32) {
      const __m512 lo = _mm512_loadu_ps(acc + h * D + g), hi = _mm512_loadu_ps(acc + h * D + g + 16);
      store_bf16x16(out + h * D + g, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
      store_bf16x16(out + h * D + g + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
    }
  }
}
#endif

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
template <int64_t D, typename T>
inline void tile_scores(const T* q, const T* const* rows, int64_t t0, int64_t kv_heads, int64_t group, float scale,
                        float* scores, int64_t ld, const T* const* next) {
  if (next != nullptr) prefetch_rows(next, kv_heads * D * static_cast<int64_t>(sizeof(T)));
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = h * group + g;
      float qf[D];
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[head * D + d]) * scale;
      for (int64_t i = 0; i < kKeys; ++i) {
        const T* k = rows[i] + h * D;
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

// In place: each row of `scores` becomes its softmax, and inv_sum the reciprocal of its sum.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t ld, float* inv_sum) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * ld;
    const float mx = span_max(s, 0, len);
    inv_sum[r] = 1.f / exp_span(s, 0, len, mx);
  }
}

// One decoding request, every head: whole key rows (all KV heads) are read once, in
// block order, so each block's contiguous memory streams through the cache once.  Its
// keys are positions start .. seq_len - 1 (start > 0 under a sliding window); `len`
// counts them, and scores are indexed from `start`.
template <int64_t D, typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table, int64_t seq_len,
                int64_t window, int64_t block_size, int64_t kv_heads, int64_t group, float scale,
                std::vector<float>& buf) {
  const int64_t start = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0, len = seq_len - start;
  const int64_t heads = kv_heads * group, row = kv_heads * D;
  const int64_t ld = (len + kKeys - 1) / kKeys * kKeys;
  buf.resize(heads * (ld + D + 1) + heads * ld / 2);  // + bf16 weights (AVX512-BF16)
  float* scores = buf.data();
  float* acc = scores + heads * ld;
  float* inv_sum = acc + heads * D;
  const T* rows[kKeys];
  RowWalker<T> keys(k_cache, table, start, seq_len, block_size, row);
  const T* ahead[kKeys];
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
  RowWalker<T> keys_ahead(k_cache, table, start, seq_len, block_size, row);
  if (keys_ahead.next(ahead) > 0) prefetch_rows(ahead, row_bytes);  // the first tile
  for (int64_t t0 = 0; t0 < len; t0 += kKeys) {
    keys.next(rows);
    const bool more = keys_ahead.next(ahead) > 0;
    tile_scores<D>(q, rows, t0, kv_heads, group, scale, scores, ld, more ? ahead : nullptr);
  }
  RowWalker<T> values(v_cache, table, start, seq_len, block_size, row);
  RowWalker<T> values_ahead(v_cache, table, start, seq_len, block_size, row);
  if (values_ahead.next(ahead) > 0) prefetch_rows(ahead, row_bytes);  // arrives during the softmax
  softmax_rows(scores, heads, len, ld, inv_sum);
  std::fill(acc, acc + heads * D, 0.f);
#if defined(__AVX512BF16__)
  constexpr bool paired = std::is_same_v<T, bf16>;
  bf16* narrow = reinterpret_cast<bf16*>(inv_sum + heads);  // the weights as bfloat16
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
  if constexpr (paired) return store_paired_output<D>(acc, inv_sum, heads, out);
#endif
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = from_float<T>(acc[h * D + d] * inv_sum[h]);
}

template <int64_t D, typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* rows,
                   const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests, int64_t max_blocks,
                   int64_t block_size, int64_t kv_heads, int64_t group, float scale, int64_t window) {
  const int64_t heads = kv_heads * group;
  int64_t total = 0;
  for (int64_t b = 0; b < num_requests; ++b) total += seq_lens[b];
#pragma omp parallel if (total * heads >= 8192)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_requests; ++b)
      decode_one<D>(q + rows[b] * heads * D, k_cache, v_cache, out + rows[b] * heads * D, block_tables + b * max_blocks,
                 seq_lens[b], window, block_size, kv_heads, group, scale, buf);
  }
}

// --- prefill chunks ------------------------------------------------------------------
//
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

template <int64_t D, typename T>
void prefill_item(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table, int64_t row0,
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
  if constexpr (std::is_same_v<T, bf16>) {
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
    Float32Prefill<D, T>::scores(p, Q, k_cache, table, block_size, kv_heads, h, S, tile);
    softmax_item(p, S, inv_sum);
    Float32Prefill<D, T>::values(p, S, v_cache, table, block_size, kv_heads, h, acc, values);
  }
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      T* dst = out + (row0 + t) * heads * D + (h * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(acc[r * D + d] * inv_sum[r]);
    }
}

template <int64_t D, typename T>
void prefill_kernel(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* query_starts,
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
  const bool amx = std::is_same_v<T, bf16> && amx_granted();
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

// q, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim],
// head_dim 64, 128 or 256 (the caller checks; another size does nothing).
// Decode: rows = the query row of each decoding request; seq_lens and block tables per request.
// Prefill: per prefilling request its first query row, number of new tokens, context length
// after the step, and block table.  window: the sliding window (0: none).
#define PAGEDLLM_ATTENTION(SUFFIX, T)                                                                               \
  PAGEDLLM_API void paged_decode_attention_##SUFFIX(                                                               \
      const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* rows, const int64_t* seq_lens,         \
      const int64_t* block_tables, int64_t num_requests, int64_t max_blocks, int64_t block_size, int64_t kv_heads,  \
      int64_t group, float scale, int64_t window, int64_t head_dim) {                                              \
    switch (head_dim) {                                                                                            \
      case 64: pagedllm::decode_kernel<64, T>(q, k_cache, v_cache, out, rows, seq_lens, block_tables, num_requests, \
                                              max_blocks, block_size, kv_heads, group, scale, window); break;        \
      case 128: pagedllm::decode_kernel<128, T>(q, k_cache, v_cache, out, rows, seq_lens, block_tables,             \
                                                num_requests, max_blocks, block_size, kv_heads, group, scale,       \
                                                window); break;                                                     \
      case 256: pagedllm::decode_kernel<256, T>(q, k_cache, v_cache, out, rows, seq_lens, block_tables,             \
                                                num_requests, max_blocks, block_size, kv_heads, group, scale,       \
                                                window); break;                                                     \
      default: break;                                                                                              \
    }                                                                                                              \
  }                                                                                                                \
  PAGEDLLM_API void paged_prefill_attention_##SUFFIX(                                                              \
      const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* query_starts, const int64_t* query_lens, \
      const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests, int64_t max_blocks,               \
      int64_t block_size, int64_t kv_heads, int64_t group, float scale, int64_t window, int64_t head_dim) {         \
    switch (head_dim) {                                                                                            \
      case 64: pagedllm::prefill_kernel<64, T>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,        \
                                               block_tables, num_requests, max_blocks, block_size, kv_heads, group, \
                                               scale, window); break;                                               \
      case 128: pagedllm::prefill_kernel<128, T>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,      \
                                                 block_tables, num_requests, max_blocks, block_size, kv_heads,      \
                                                 group, scale, window); break;                                      \
      case 256: pagedllm::prefill_kernel<256, T>(q, k_cache, v_cache, out, query_starts, query_lens, seq_lens,      \
                                                 block_tables, num_requests, max_blocks, block_size, kv_heads,      \
                                                 group, scale, window); break;                                      \
      default: break;                                                                                              \
    }                                                                                                              \
  }

PAGEDLLM_ATTENTION(f32, float)
PAGEDLLM_ATTENTION(bf16, bf16)
