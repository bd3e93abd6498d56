// Every layer of a llama model for a decode-only step, in one call.
//
// It runs the kernels the Python layer loop calls, in the same order on the same buffers
// (add_rms_norm, packed_gemm, rope_write_kv, paged decode attention, silu_mul), so its
// output is the same to the bit; what it saves is the Python between them: ~9 calls a
// layer, for SmolLM2's 30 layers on a 2-core Zen 4 (bfloat16) 4.7 ms of a one-request
// step's 16.4 (0.71x the time in one call), during which the other core waited; 0.92x the
// time at 64 and 128 requests, with the row split below (benchmarks/fused_decode.py).
// Only plain llama layers (no biases, no q/k norm), every projection packed for
// packed_gemm or kept quantized for quant_gemm (a GGUF's blocks), one KV cache per layer
// (pagedllm/layers/fused_decode.py checks).
#include <omp.h>

#include <cstdint>
#include <vector>

#include "common.h"

using pagedllm::bf16;

// A quantized weight's part of a projection's output columns (csrc/quant_gemm.cpp's layout).
struct QuantPart {
  const uint8_t* qs;
  const float* scales;
  const float* mins;
  int64_t rows, bits, group, zero;
};

// One projection: a float weight packed by `pack_panels` (packed non-null), or quantized
// parts side by side in its output.
constexpr int64_t kMaxParts = 4;
struct Projection {
  const void* packed;
  int64_t num_parts;
  QuantPart parts[kMaxParts];
};

// One layer's weights and its K and V caches.
struct DecodeLayer {
  const void* input_norm;
  const Projection* qkv_proj;
  const Projection* o_proj;
  const void* post_norm;
  const Projection* gate_up_proj;
  const Projection* down_proj;
  void* k_cache;
  void* v_cache;
  int64_t window;  // sliding window (0: full attention)
  int64_t rotary_dim;  // dims of each head that rotate, the rest passing through (0: no rotary)
};

struct DecodeShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
};

// The kernels' exported entry points (the other files of this library).
#define PAGEDLLM_DECLARE(SUFFIX, T)                                                                               \
  extern "C" {                                                                                                     \
  void add_rms_norm_##SUFFIX(const T*, T*, const T*, T*, int64_t, int64_t, float);                                 \
  void rope_write_kv_##SUFFIX(const T*, T*, T*, T*, const int64_t*, const int64_t*, const float*, const float*,    \
                              int64_t, int64_t, int64_t, int64_t, int64_t);                                        \
  void silu_mul_##SUFFIX(const T*, T*, int64_t, int64_t);                                                          \
  void packed_gemm_##SUFFIX(const T*, const T*, T*, int64_t, int64_t, int64_t);                                    \
  void quant_gemm_##SUFFIX(const T*, T*, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const float*,          \
                           const float*, int64_t, int64_t, int64_t);                                               \
  void paged_decode_attention_##SUFFIX(const T*, const T*, const T*, T*, const int64_t*, const int64_t*,           \
                                       const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, \
                                       int64_t);                                                                   \
  }                                                                                                                \
  struct Kernels_##SUFFIX {                                                                                        \
    static constexpr auto add_rms_norm = add_rms_norm_##SUFFIX;                                                    \
    static constexpr auto rope_write_kv = rope_write_kv_##SUFFIX;                                                  \
    static constexpr auto silu_mul = silu_mul_##SUFFIX;                                                            \
    static constexpr auto packed_gemm = packed_gemm_##SUFFIX;                                                      \
    static constexpr auto quant_gemm = quant_gemm_##SUFFIX;                                                        \
    static constexpr auto decode_attention = paged_decode_attention_##SUFFIX;                                      \
  };

PAGEDLLM_DECLARE(f32, float)
PAGEDLLM_DECLARE(bf16, bf16)

namespace pagedllm {
namespace {

// Workspace rows hold, one after the other: the normed input, the fused QKV output, q, the
// attention output, a projection's output, gate/up, and the activation.
int64_t workspace_row(const DecodeShape& s) {
  const int64_t q = s.heads * s.head_dim, qkv = q + 2 * s.kv_heads * s.head_dim;
  return s.hidden + qkv + 2 * q + s.hidden + 3 * s.intermediate;
}

// y [m, n] = x [m, k] times the projection's weight, as pagedllm/layers/linear.py and
// quantized.py call the kernels for a step of these rows.
template <typename T, typename K>
void project(const Projection* p, const T* x, T* y, int64_t m, int64_t n, int64_t k) {
  if (p->packed != nullptr) return K::packed_gemm(x, static_cast<const T*>(p->packed), y, m, n, k);
  int64_t col = 0;
  for (int64_t i = 0; i < p->num_parts; ++i) {
    const QuantPart& q = p->parts[i];
    K::quant_gemm(x, y + col, m, q.rows, k, n, q.qs, q.scales, q.mins, q.bits, q.group, q.zero);
    col += q.rows;
  }
}

// The layers for m rows, with the kernels' own parallel regions (each splits its work over
// the threads: a GEMM by output panels, attention by request and KV head).
template <typename T, typename K>
void run_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeShape& s, T* residual, T* out,
                T* workspace, const T* final_norm, const int64_t* positions, const int64_t* slots, const float* cos,
                const float* sin, const int64_t* rows, const int64_t* seq_lens, const int64_t* tables, int64_t m,
                int64_t max_blocks) {
  const int64_t q_size = s.heads * s.head_dim, qkv_size = q_size + 2 * s.kv_heads * s.head_dim;
  T* h = workspace;
  T* qkv = h + m * s.hidden;
  T* q = qkv + m * qkv_size;
  T* attn = q + m * q_size;
  T* delta = attn + m * q_size;  // o_proj's output, then down_proj's: added to the residual next
  T* gate_up = delta + m * s.hidden;
  T* act = gate_up + m * 2 * s.intermediate;
  const int64_t group = s.heads / s.kv_heads;
  for (int64_t l = 0; l < num_layers; ++l) {
    const DecodeLayer& layer = layers[l];
    K::add_rms_norm(l == 0 ? nullptr : delta, residual, static_cast<const T*>(layer.input_norm), h, m, s.hidden,
                    s.eps);
    project<T, K>(layer.qkv_proj, h, qkv, m, qkv_size, s.hidden);
    T* k_cache = static_cast<T*>(layer.k_cache);
    T* v_cache = static_cast<T*>(layer.v_cache);
    K::rope_write_kv(qkv, q, k_cache, v_cache, positions, slots, cos, sin, m, s.heads, s.kv_heads, s.head_dim,
                    layer.rotary_dim);
    K::decode_attention(q, k_cache, v_cache, attn, rows, seq_lens, tables, m, max_blocks, s.block_size, s.kv_heads,
                        group, s.scale, layer.window, s.head_dim);
    project<T, K>(layer.o_proj, attn, delta, m, s.hidden, q_size);
    K::add_rms_norm(delta, residual, static_cast<const T*>(layer.post_norm), h, m, s.hidden, s.eps);
    project<T, K>(layer.gate_up_proj, h, gate_up, m, 2 * s.intermediate, s.hidden);
    K::silu_mul(gate_up, act, m, s.intermediate);
    project<T, K>(layer.down_proj, act, delta, m, s.hidden, s.intermediate);
  }
  K::add_rms_norm(num_layers > 0 ? delta : nullptr, residual, final_norm, out, m, s.hidden, s.eps);
}

// With enough rows, each thread runs every layer for its own rows, start to end: a request's
// rows depend on no other request's, so the threads never wait for each other (with the
// kernels' regions, each of ~9 a layer ended at a barrier, and the threads spent 6-11% of
// a 128-request step waiting in OpenMP), and one thread's attention (bound by memory) overlaps another's
// GEMMs (bound by FMAs).  Each thread then reads all the weights, so this needs rows enough
// per thread for a GEMM to stay compute-bound: kMinRowsPerThread x the thread count.
constexpr int64_t kMinRowsPerThread = 16;

template <typename T, typename K>
void decode_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeShape& s, T* residual, T* out,
                   T* workspace, const T* final_norm, const int64_t* positions, const int64_t* slots,
                   const float* cos, const float* sin, const int64_t* rows, const int64_t* seq_lens,
                   const int64_t* tables, int64_t m, int64_t max_blocks) {
  const int threads = omp_get_max_threads();
  // Nested regions must run on one thread each (OpenMP's default), or the kernels' own regions
  // would start teams inside the threads' ones.
  const bool split = threads > 1 && m >= kMinRowsPerThread * threads * threads && !omp_in_parallel() &&
                     omp_get_max_active_levels() <= 1;
  if (!split)
    return run_layers<T, K>(layers, num_layers, s, residual, out, workspace, final_norm, positions, slots, cos, sin,
                            rows, seq_lens, tables, m, max_blocks);
  // Rows cut into one contiguous range a thread, balanced by cost: a row's projections, counted
  // as the context tokens whose attention reads as long (at ~16 FLOP a byte, about this CPU's
  // peak over its memory bandwidth), plus its request's context.
  const int64_t q_size = s.heads * s.head_dim, qkv_size = q_size + 2 * s.kv_heads * s.head_dim;
  const double flops = 2.0 * (s.hidden * qkv_size + q_size * s.hidden + 3.0 * s.hidden * s.intermediate);
  const double kv_bytes = 2.0 * s.kv_heads * s.head_dim * sizeof(T);
  const double row_cost = flops / 16.0 / kv_bytes;
  std::vector<int64_t> request_of_row(m, -1);
  for (int64_t i = 0; i < m; ++i) request_of_row[rows[i]] = i;
  double total = 0;
  for (int64_t i = 0; i < m; ++i) total += row_cost + seq_lens[i];
  std::vector<int64_t> bounds(threads + 1, m);
  bounds[0] = 0;
  double sum = 0;
  for (int64_t r = 0, t = 1; r < m && t < threads; ++r) {
    sum += row_cost + seq_lens[request_of_row[r]];
    if (sum >= total * t / threads) bounds[t++] = r + 1;
  }
  const int64_t row_size = workspace_row(s);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int64_t a = bounds[t], n = bounds[t + 1] - a;
    if (n > 0) {
      std::vector<int64_t> my_rows(n), my_lens(n), my_tables(n * max_blocks);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = request_of_row[a + r];
        my_rows[r] = r;
        my_lens[r] = seq_lens[i];
        std::memcpy(&my_tables[r * max_blocks], tables + i * max_blocks, max_blocks * sizeof(int64_t));
      }
      run_layers<T, K>(layers, num_layers, s, residual + a * s.hidden, out + a * s.hidden, workspace + a * row_size,
                       final_norm, positions + a, slots + a, cos, sin, my_rows.data(), my_lens.data(),
                       my_tables.data(), n, max_blocks);
    }
  }
}

}  // namespace
}  // namespace pagedllm

// Elements of workspace each of a step's rows needs.
PAGEDLLM_API int64_t decode_layers_workspace(const DecodeShape* shape) { return pagedllm::workspace_row(*shape); }

// residual [m, hidden] (the embedded tokens, updated in place as the layers add to it) ->
// out [m, hidden], the final norm's output.  positions, slots: per row; rows, seq_lens, tables:
// per request, as paged_decode_attention takes them (here one row per request).
#define PAGEDLLM_DECODE_LAYERS(SUFFIX, T)                                                                         \
  PAGEDLLM_API void decode_layers_##SUFFIX(const DecodeLayer* layers, int64_t num_layers, const DecodeShape* shape, \
                                           T* residual, T* out, T* workspace, const T* final_norm,                 \
                                           const int64_t* positions, const int64_t* slots, const float* cos,        \
                                           const float* sin, const int64_t* rows, const int64_t* seq_lens,          \
                                           const int64_t* tables, int64_t m, int64_t max_blocks) {                  \
    pagedllm::decode_layers<T, Kernels_##SUFFIX>(layers, num_layers, *shape, residual, out, workspace, final_norm,  \
                                                 positions, slots, cos, sin, rows, seq_lens, tables, m, max_blocks); \
  }

PAGEDLLM_DECODE_LAYERS(f32, float)
PAGEDLLM_DECODE_LAYERS(bf16, bf16)
