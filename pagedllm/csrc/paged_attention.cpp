// Decode attention that reads K/V in place through the block table.
//
// One work item = (request, KV head): the `group` query heads that share the
// KV head are scored against the request's keys together, so each key and
// value row is loaded once.  Scores go to a per-item buffer, then a softmax
// and a weighted sum of values.  OpenMP spreads the items over the cores.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* rows,
                   const int64_t* seq_lens, const int64_t* block_tables, int64_t num_requests,
                   int64_t max_blocks, int64_t block_size, int64_t kv_heads, int64_t group,
                   float scale) {
  constexpr int64_t D = 64;
  const int64_t num_heads = kv_heads * group;
  const int64_t items = num_requests * kv_heads;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(group * D), acc(group * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      const T* qrow = q + rows[b] * num_heads * D + h * group * D;
      for (int64_t i = 0; i < group * D; ++i) qf[i] = to_float(qrow[i]) * scale;
      scores.resize(group * len);
      std::vector<float> maxes(group, -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < len; ++t) {
        const T* krow = k_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + h) * D;
        float kf[D];
        for (int64_t d = 0; d < D; ++d) kf[d] = to_float(krow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
          maxes[g] = std::max(maxes[g], s);
        }
      }
      std::vector<float> sums(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - maxes[g]);
          sums[g] += sg[t];
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vrow = v_cache + ((table[t / block_size] * block_size + t % block_size) * kv_heads + h) * D;
        float vf[D];
        for (int64_t d = 0; d < D; ++d) vf[d] = to_float(vrow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      T* orow = out + rows[b] * num_heads * D + h * group * D;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) orow[g * D + d] = static_cast<T>(acc[g * D + d] / sums[g]);
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
  TORCH_CHECK(q.size(2) == 64 && k_cache.size(3) == 64, "paged_decode_attention supports head_dim 64 only");
  TORCH_CHECK(block_tables.is_contiguous() && rows.is_contiguous() && seq_lens.is_contiguous());
  const int64_t kv_heads = k_cache.size(2), group = q.size(1) / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                            block_tables.data_ptr<int64_t>(), rows.size(0), block_tables.size(1),
                            k_cache.size(1), kv_heads, group, static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention through block tables (CPU)");
}
