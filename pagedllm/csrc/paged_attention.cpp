// Paged attention on the CPU, reading K/V in place through the block tables:
// a decode kernel (one query token per request) and a prefill kernel (chunks of
// query tokens over their cached context).
//
// Decode:
// One work item = one decoding request, all of its heads.  A token's K (or V)
// row holds every KV head ([kv_heads, 64] contiguous), so walking a block row by
// row streams it from memory; per-head items would read it with a stride and
// run about 2.5x slower (measured).  Scores go to a per-thread buffer, then a
// softmax per head and a weighted sum of values.  OpenMP spreads requests over
// the cores.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t D = 64;
constexpr int64_t kMaxHeads = 64;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Calls fn(t, row as floats) for each token t < len of one request, walking its
// block table; `buf` receives the converted [kv_heads * 64] row.
template <typename T, typename Fn>
inline void for_each_row(const T* cache, const int64_t* table, int64_t len, int64_t block_size, int64_t row,
                         float* buf, Fn fn) {
  for (int64_t t = 0, j = 0; t < len; ++j) {
    const T* block = cache + table[j] * block_size * row;
    const int64_t n = std::min(block_size, len - t);
    for (int64_t r = 0; r < n; ++r, ++t) {
      const T* src = block + r * row;
      for (int64_t i = 0; i < row; ++i) buf[i] = to_float(src[i]);
      fn(t, buf);
    }
  }
}

template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table, int64_t len,
                int64_t block_size, int64_t kv_heads, int64_t group, float scale, std::vector<float>& scores) {
  const int64_t heads = kv_heads * group, row = kv_heads * D;
  float qf[kMaxHeads * D], acc[kMaxHeads * D], row_f[kMaxHeads * D];
  for (int64_t i = 0; i < heads * D; ++i) qf[i] = to_float(q[i]) * scale;
  scores.resize(heads * len);

  for_each_row(k_cache, table, len, block_size, row, row_f, [&](int64_t t, const float* krow) {
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const float* qh = qf + (h * group + g) * D;
        const float* kh = krow + h * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
        scores[(h * group + g) * len + t] = s;
      }
  });
  for (int64_t hg = 0; hg < heads; ++hg) {
    float* s = scores.data() + hg * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) m = std::max(m, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
  }
  std::fill(acc, acc + heads * D, 0.f);
  for_each_row(v_cache, table, len, block_size, row, row_f, [&](int64_t t, const float* vrow) {
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[(h * group + g) * len + t];
        float* a = acc + (h * group + g) * D;
        const float* vh = vrow + h * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
      }
  });
  for (int64_t i = 0; i < heads * D; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* rows,
                   const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests,
                   int64_t max_blocks, int64_t block_size, int64_t kv_heads, int64_t group, float scale) {
  const int64_t heads = kv_heads * group;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < num_requests; ++b) {
      decode_one(q + rows[b] * heads * D, k_cache, v_cache, out + rows[b] * heads * D,
                 block_tables + b * max_blocks, seq_lens[b], block_size, kv_heads, group, scale, scores);
    }
  }
}


// --- prefill chunks ------------------------------------------------------------------
//
// One work item = (request, KV head, a tile of query tokens).  Its rows are those
// tokens times the KV head's `group` query heads, so every K/V load serves all the
// query heads that read it (grouped-query heads never repeat K/V).  Three passes:
//   1. scores S = Q K^T, key tiles of kKeyTile positions gathered through the block
//      table (any block size) and transposed into a small buffer, kRowBlock rows at
//      a time: 2 * kRowBlock independent FMA chains, 12 of the 16 AVX2 registers
//      (6 rows measured 1.5-1.7x faster than 4 here; 8 spills);
//   2. an exact softmax per row over its visible keys (causal: the query at
//      position p sees keys 0..p), vectorized over whole rows;
//   3. O = P V: the item's V rows gathered once into a contiguous buffer, then
//      kRowBlock rows x 16 dims accumulated in registers over all visible keys.
// kRowsPerItem is a multiple of kRowBlock, so whole row blocks are real rows
// whenever group divides it (padding rows are zero and cost only their FMAs).
// S and the V rows live in a per-thread buffer (rows x keys + keys x 64 floats);
// measured faster here than an online softmax, whose per-tile rescaling cost as
// much as the two matmuls.
#ifndef PAGEDLLM_KEY_TILE
#define PAGEDLLM_KEY_TILE 16
#endif
#ifndef PAGEDLLM_ROWS_PER_ITEM
#define PAGEDLLM_ROWS_PER_ITEM 96
#endif
constexpr int64_t kKeyTile = PAGEDLLM_KEY_TILE;
constexpr int64_t kRowsPerItem = PAGEDLLM_ROWS_PER_ITEM;
#ifndef PAGEDLLM_ROW_BLOCK
#define PAGEDLLM_ROW_BLOCK 6
#endif
constexpr int64_t kRowBlock = PAGEDLLM_ROW_BLOCK;
constexpr int64_t kDimBlock = 16;

// exp(x) for x <= 0, in plain arithmetic so that loops over it vectorize (the libm
// call in such a loop measured ~14 cycles per element here).  2^(x log2 e) split
// into an integer power, put straight into the exponent bits, and 2^f on [0, 1)
// by a degree-6 polynomial: relative error below 2e-7.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -126.f) * 1.4426950408889634f;
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

template <typename T>
inline void load_tile(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t block_size,
                      int64_t kv_heads, int64_t h, float* dst, bool transpose) {
  for (int64_t i = 0; i < kKeyTile; ++i) {
    if (i < nk) {
      const int64_t pos = k0 + i;
      const T* row = cache + ((table[pos / block_size] * block_size + pos % block_size) * kv_heads + h) * D;
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

template <typename T>
void prefill_item(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* table, int64_t row0,
                  int64_t first_pos, int64_t num_tokens, int64_t block_size, int64_t kv_heads, int64_t group,
                  int64_t h, float scale, std::vector<float>& buf) {
  const int64_t heads = kv_heads * group, rows = num_tokens * group;
  const int64_t padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t num_keys = first_pos + num_tokens;  // the last token sees every key before it
  const int64_t width = (num_keys + kKeyTile - 1) / kKeyTile * kKeyTile;
  buf.resize(padded * (2 * D + 1 + width) + D * kKeyTile + width * D);
  float* Q = buf.data();              // [padded][D], pre-scaled; padding rows are zero
  float* acc = Q + padded * D;        // [padded][D]
  float* inv_sum = acc + padded * D;  // [padded]
  float* S = inv_sum + padded;        // [padded][width] scores, then probabilities
  float* tile = S + padded * width;   // [D][kKeyTile]: a K tile, transposed
  std::fill(Q, Q + padded * D, 0.f);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q + (row0 + t) * heads * D + (h * group + g) * D;
      float* dst = Q + (t * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * scale;
    }
  // Keys a block of rows can see: up to its last row's position.
  auto block_keys = [&](int64_t r0) { return first_pos + std::min(r0 + kRowBlock - 1, rows - 1) / group + 1; };

  // 1. scores
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeyTile) {
    load_tile(k_cache, table, k0, std::min(kKeyTile, num_keys - k0), block_size, kv_heads, h, tile, true);
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      if (k0 >= block_keys(r0)) continue;  // wholly in the causal future of these rows
      float s[kRowBlock][kKeyTile] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = tile + d * kKeyTile;
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          const float qd = Q[(r0 + rr) * D + d];
#pragma omp simd
          for (int64_t i = 0; i < kKeyTile; ++i) s[rr][i] += qd * kd[i];
        }
      }
      for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy(s[rr], s[rr] + kKeyTile, S + (r0 + rr) * width + k0);
    }
  }
  // 2. softmax over each row's visible keys; the rest of the row becomes 0
  for (int64_t r = 0; r < padded; ++r) {
    float* s = S + r * width;
    const int64_t visible = r < rows ? first_pos + r / group + 1 : 0;
    float mx = -std::numeric_limits<float>::max();
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < visible; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < visible; ++i) {
      s[i] = exp_nonpositive(s[i] - mx);
      sum += s[i];
    }
    std::fill(s + visible, s + width, 0.f);
    inv_sum[r] = visible ? 1.f / sum : 0.f;
  }
  // 3. values: the item's V rows gathered once into a contiguous buffer, then each
  // block of kRowBlock rows x kDimBlock dims sums over all its visible keys in registers.
  float* values = tile + D * kKeyTile;  // [width][D]
  for (int64_t k0 = 0; k0 < num_keys; k0 += kKeyTile)
    load_tile(v_cache, table, k0, std::min(kKeyTile, num_keys - k0), block_size, kv_heads, h, values + k0 * D, false);
  for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
    const int64_t keys = std::min(block_keys(r0), num_keys);
    const float* p0 = S + r0 * width;
    for (int64_t d0 = 0; d0 < D; d0 += kDimBlock) {
      float a[kRowBlock][kDimBlock] = {};
      for (int64_t i = 0; i < keys; ++i) {
        const float* vi = values + i * D + d0;
        for (int64_t rr = 0; rr < kRowBlock; ++rr) {
          const float p = p0[rr * width + i];
#pragma omp simd
          for (int64_t d = 0; d < kDimBlock; ++d) a[rr][d] += p * vi[d];
        }
      }
      for (int64_t rr = 0; rr < kRowBlock; ++rr) std::copy_n(a[rr], kDimBlock, acc + (r0 + rr) * D + d0);
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = t * group + g;
      T* dst = out + (row0 + t) * heads * D + (h * group + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv_sum[r]);
    }
}

template <typename T>
void prefill_kernel(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* query_starts,
                    const int64_t* query_lens, const int64_t* seq_lens, const int64_t* block_tables,
                    int64_t num_requests, int64_t max_blocks, int64_t block_size, int64_t kv_heads, int64_t group,
                    float scale) {
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  struct Item { int64_t request, head, first_token, num_tokens; };
  std::vector<Item> items;
  for (int64_t b = 0; b < num_requests; ++b)
    for (int64_t t = 0; t < query_lens[b]; t += tokens_per_item)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({b, h, t, std::min(tokens_per_item, query_lens[b] - t)});
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = num_items - 1; i >= 0; --i) {  // the last tiles see the most keys: start them first
      const Item& it = items[i];
      const int64_t b = it.request;
      const int64_t first_pos = seq_lens[b] - query_lens[b] + it.first_token;
      prefill_item(q, k_cache, v_cache, out, block_tables + b * max_blocks, query_starts[b] + it.first_token,
                   first_pos, it.num_tokens, block_size, kv_heads, group, it.head, scale, buf);
    }
  }
}

}  // namespace

// q, out: [num_tokens, num_heads, 64]; k_cache, v_cache: [num_blocks, block_size, kv_heads, 64];
// rows: the query row of each decoding request; seq_lens and block_tables per request.
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                            torch::Tensor rows, torch::Tensor seq_lens, torch::Tensor block_tables, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention needs contiguous tensors");
  TORCH_CHECK(q.size(2) == D && k_cache.size(3) == D, "paged_decode_attention supports head_dim 64 only");
  TORCH_CHECK(q.size(1) <= kMaxHeads, "paged_decode_attention supports at most 64 query heads");
  TORCH_CHECK(block_tables.is_contiguous() && rows.is_contiguous() && seq_lens.is_contiguous());
  const int64_t kv_heads = k_cache.size(2), group = q.size(1) / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                            block_tables.data_ptr<int64_t>(), rows.size(0), block_tables.size(1),
                            k_cache.size(1), kv_heads, group, static_cast<float>(scale));
  });
}

// Prefill chunks: q, out [num_tokens, num_heads, 64]; per prefilling request its first
// query row, number of new tokens, context length after the step, and block table.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                             torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor seq_lens,
                             torch::Tensor block_tables, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill_attention needs contiguous tensors");
  TORCH_CHECK(q.size(2) == D && k_cache.size(3) == D, "paged_prefill_attention supports head_dim 64 only");
  TORCH_CHECK(block_tables.is_contiguous() && query_starts.is_contiguous() && query_lens.is_contiguous() &&
              seq_lens.is_contiguous());
  const int64_t kv_heads = k_cache.size(2), group = q.size(1) / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), query_starts.data_ptr<int64_t>(), query_lens.data_ptr<int64_t>(),
                             seq_lens.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), query_starts.size(0),
                             block_tables.size(1), k_cache.size(1), kv_heads, group, static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill_attention", &paged_prefill_attention, "prefill-chunk attention through block tables (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention through block tables (CPU)");
}
