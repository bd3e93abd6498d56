// Every layer of a llama or Gemma 3 model for a decode-only step, in one call.
//
// It runs the kernels the Python layer loop calls, in the same order on the same buffers
// (add_rms_norm, packed_gemm, rope_write_kv, paged decode attention, silu_mul; Gemma 3's
// layers gemma_norm and gelu_tanh_mul, and the residual adds torch makes), so its output is
// the same to the bit; what it saves is the Python between them: ~9 calls a llama layer
// (~15 a Gemma one), for SmolLM2's 30 layers on a 2-core Zen 4 (bfloat16) 4.7 ms of a
// one-request step's 16.4 (0.71x the time in one call), during which the other core waited;
// 0.92x the time at 64 and 128 requests, with the row split below (benchmarks/fused_decode.py).
// Only plain llama layers (no biases, no q/k norm) or Gemma 3's, every projection packed for
// packed_gemm or kept quantized for quant_gemm (a GGUF's blocks; past the integer kernels' rows,
// in bfloat16 with AMX, the tile kernel quant_amx_gemm), one KV cache per layer and
// each layer's own block tables (its layer group's; pagedllm/layers/fused_decode.py checks).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "quant_layout.h"

using pagedllm::bf16;

// A quantized weight's part of a projection's output columns: quant_layout.h's QuantWeight.
using QuantPart = pagedllm::QuantWeight;

// One projection: a float weight packed by `pack_panels` (packed non-null), or quantized
// parts side by side in its output.
constexpr int64_t kMaxParts = 4;
struct Projection {
  const void* packed;
  int64_t num_parts;
  QuantPart parts[kMaxParts];
};

// One layer's weights, its K and V caches, rotary tables and block tables.
struct DecodeLayer {
  const void* input_norm;  // Gemma 3: every norm weight is float32 (1 + w)
  const Projection* qkv_proj;
  const Projection* o_proj;
  const void* post_norm;
  const Projection* gate_up_proj;
  const Projection* down_proj;
  const float* pre_ffn_norm;  // Gemma 3 only, as the three after it
  const float* post_ffn_norm;
  const float* q_norm;
  const float* k_norm;
  void* k_cache;
  void* v_cache;
  const float* cos;  // [positions, rotary_dim / 2], read at each row's position
  const float* sin;
  const int64_t* slots;  // per row, the cache slot of its new K/V in this layer's group's blocks
  const int64_t* tables;  // per request, its block table for this layer's group: [requests, max_blocks]
  int64_t max_blocks;
  int64_t window;  // sliding window (0: full attention)
  int64_t rotary_dim;  // dims of each head that rotate, the rest passing through (0: no rotary)
};

// A step's LoRA adapters (pagedllm/layers/lora.py's KernelTable): per layer, per projection (qkv,
// o, gate_up, down) one A, packed B and layout address per adapter of the step (a null: no
// adapter of the step touches it), and the rows under an adapter, sorted by adapter, with each
// one's place in those arrays.  Each projection's update is csrc/lora.cpp's lora_add.
struct LoraPart {
  const void* const* a;
  const void* const* b;
  const void* const* descs;
};
struct LoraRows {
  const LoraPart* parts;  // [layers][4]
  const int64_t* order;
  const int64_t* adapter_of;
  int64_t count;
};

struct DecodeShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
  float eps, scale;
  int64_t gemma;  // 1: Gemma 3's layers, 0: llama's
  float q_scale;  // Gemma 3: q times this before attention, rounded to the dtype (1: not at all)
  // Quantized projections of a step of more rows than this take the AMX tile kernel
  // (quant_amx_gemm), as QuantizedLinear does; 0: always the integer kernels.
  int64_t quant_int_max_rows;
};

// The kernels' exported entry points (the other files of this library).
#define PAGEDLLM_DECLARE(SUFFIX, T, TILE)                                                                           \
  extern "C" {                                                                                                     \
  void add_rms_norm_##SUFFIX(const T*, T*, const T*, T*, int64_t, int64_t, float);                                 \
  void rope_write_kv_##SUFFIX(const T*, T*, T*, T*, const int64_t*, const int64_t*, const float*, const float*,    \
                              int64_t, int64_t, int64_t, int64_t, int64_t);                                        \
  void silu_mul_##SUFFIX(const T*, T*, int64_t, int64_t);                                                          \
  void gelu_tanh_mul_##SUFFIX(const T*, T*, int64_t, int64_t);                                                     \
  void gemma_norm_##SUFFIX(const T*, const float*, T*, int64_t, int64_t, int64_t, int64_t, float);                 \
  void packed_gemm_##SUFFIX(const T*, const T*, T*, int64_t, int64_t, int64_t);                                    \
  void quant_gemm_##SUFFIX(const T*, T*, int64_t, int64_t, const QuantPart*);                                     \
  void paged_decode_attention_##SUFFIX(const T*, const T*, const T*, T*, const int64_t*, const int64_t*,           \
                                       const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, \
                                       int64_t, int64_t);                                                          \
  void lora_add_##SUFFIX(const T*, T*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t,                \
                         const void* const*, const void* const*, const void* const*);                               \
  }                                                                                                                \
  struct Kernels_##SUFFIX {                                                                                        \
    using KV = T; /* the KV cache's element */                                                                     \
    static constexpr auto add_rms_norm = add_rms_norm_##SUFFIX;                                                    \
    static constexpr auto rope_write_kv = rope_write_kv_##SUFFIX;                                                  \
    static constexpr auto silu_mul = silu_mul_##SUFFIX;                                                            \
    static constexpr auto gelu_tanh_mul = gelu_tanh_mul_##SUFFIX;                                                  \
    static constexpr auto gemma_norm = gemma_norm_##SUFFIX;                                                        \
    static constexpr auto packed_gemm = packed_gemm_##SUFFIX;                                                      \
    static constexpr auto quant_gemm = quant_gemm_##SUFFIX;                                                        \
    static constexpr auto quant_tile_gemm = TILE;                                                                  \
    static constexpr auto decode_attention = paged_decode_attention_##SUFFIX;                                      \
    static constexpr auto lora_add = lora_add_##SUFFIX;                                                            \
  };

// The AMX tile kernel on quantized weights (csrc/quant_amx.cpp), bfloat16 only; a float32
// step never takes the tile path (pagedllm/layers/fused_decode.py sets quant_int_max_rows to 0).
extern "C" void quant_amx_gemm_bf16(const bf16*, bf16*, int64_t, int64_t, const QuantPart*);
PAGEDLLM_DECLARE(f32, float, quant_gemm_f32)
PAGEDLLM_DECLARE(bf16, bf16, quant_amx_gemm_bf16)

// float32 layers over a float16 KV cache: only the two kernels that touch the cache differ.
extern "C" {
void rope_write_kv_f32_f16kv(const float*, float*, pagedllm::f16*, pagedllm::f16*, const int64_t*, const int64_t*,
                             const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
void paged_decode_attention_f32_f16kv(const float*, const pagedllm::f16*, const pagedllm::f16*, float*, const int64_t*,
                                      const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      float, int64_t, int64_t, int64_t);
}
struct Kernels_f32_f16kv : Kernels_f32 {
  using KV = pagedllm::f16;
  static constexpr auto rope_write_kv = rope_write_kv_f32_f16kv;
  static constexpr auto decode_attention = paged_decode_attention_f32_f16kv;
};

// float32 or bfloat16 layers over a float8 e4m3 KV cache.
#define PAGEDLLM_DECLARE_F8KV(SUFFIX, BASE, T)                                                                   \
  extern "C" {                                                                                                     \
  void rope_write_kv_##SUFFIX(const T*, T*, pagedllm::f8*, pagedllm::f8*, const int64_t*, const int64_t*,         \
                              const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);            \
  void paged_decode_attention_##SUFFIX(const T*, const pagedllm::f8*, const pagedllm::f8*, T*, const int64_t*,     \
                                       const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                       float, int64_t, int64_t, int64_t);                                          \
  }                                                                                                                \
  struct Kernels_##SUFFIX : Kernels_##BASE {                                                                       \
    using KV = pagedllm::f8;                                                                                       \
    static constexpr auto rope_write_kv = rope_write_kv_##SUFFIX;                                                  \
    static constexpr auto decode_attention = paged_decode_attention_##SUFFIX;                                      \
  };
PAGEDLLM_DECLARE_F8KV(f32_f8kv, f32, float)
PAGEDLLM_DECLARE_F8KV(bf16_f8kv, bf16, pagedllm::bf16)

namespace pagedllm {
namespace {

// Workspace rows hold, one after the other: the normed input, the fused QKV output, q, the
// attention output, a projection's output, gate/up, and the activation.
int64_t workspace_row(const DecodeShape& s) {
  const int64_t q = s.heads * s.head_dim, qkv = q + 2 * s.kv_heads * s.head_dim;
  return s.hidden + qkv + 2 * q + s.hidden + 3 * s.intermediate;
}

// y [m, n] = x [m, k] times the projection's weight, as pagedllm/layers/linear.py and
// quantized.py call the kernels for a step of these rows; `tile`: the step has more rows than
// the integer kernels take (decided on the whole step's rows, so that a thread's share of them
// takes the kernel the layer loop would).
template <typename T, typename K>
void project(const Projection* p, const T* x, T* y, int64_t m, int64_t n, int64_t k, bool tile) {
  if (p->packed != nullptr) return K::packed_gemm(x, static_cast<const T*>(p->packed), y, m, n, k);
  const auto gemm = tile ? K::quant_tile_gemm : K::quant_gemm;
  int64_t col = 0;
  for (int64_t i = 0; i < p->num_parts; ++i) {
    const QuantPart& q = p->parts[i];
    gemm(x, y + col, m, n, &q);
    col += q.rows;
  }
}

// Projection `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`: the step's adapters'
// updates added to y [m, n] from x [m, k], for the rows that have one.
template <typename T, typename K>
void add_lora(const LoraRows* lora, int64_t layer, int which, const T* x, T* y, int64_t k, int64_t n) {
  if (lora == nullptr || lora->count == 0) return;
  const LoraPart& part = lora->parts[layer * 4 + which];
  if (part.a == nullptr) return;
  K::lora_add(x, y, lora->order, lora->adapter_of, lora->count, k, n, part.a, part.b, part.descs);
}

// residual += delta, element by element in float and rounded once, as torch's add_ does.
template <typename T>
void add_into(T* residual, const T* delta, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] = from_float<T>(to_float(residual[i]) + to_float(delta[i]));
}

// Buffers of the workspace (workspace_row's order) for m rows.
template <typename T>
struct Buffers {
  T *h, *qkv, *q, *attn, *delta, *gate_up, *act;
  int64_t split_requests;  // what paged_decode_attention plans its split for: the step's requests
  Buffers(T* workspace, const DecodeShape& s, int64_t m, int64_t split) : split_requests(split) {
    const int64_t q_size = s.heads * s.head_dim, qkv_size = q_size + 2 * s.kv_heads * s.head_dim;
    h = workspace;
    qkv = h + m * s.hidden;
    q = qkv + m * qkv_size;
    attn = q + m * q_size;
    delta = attn + m * q_size;  // o_proj's output, then down_proj's: added to the residual next
    gate_up = delta + m * s.hidden;
    act = gate_up + m * 2 * s.intermediate;
  }
};

// q/k with rotary written to the cache, then attention over this layer's block tables.
template <typename T, typename K>
void attend(const DecodeLayer& layer, const DecodeShape& s, const Buffers<T>& b, const int64_t* positions,
            const int64_t* rows, const int64_t* seq_lens, int64_t m) {
  using KV = typename K::KV;
  KV* k_cache = static_cast<KV*>(layer.k_cache);
  KV* v_cache = static_cast<KV*>(layer.v_cache);
  K::rope_write_kv(b.qkv, b.q, k_cache, v_cache, positions, layer.slots, layer.cos, layer.sin, m, s.heads, s.kv_heads,
                   s.head_dim, layer.rotary_dim);
  if (s.q_scale != 1.f) {
    const int64_t n = m * s.heads * s.head_dim;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) b.q[i] = from_float<T>(to_float(b.q[i]) * s.q_scale);
  }
  K::decode_attention(b.q, k_cache, v_cache, b.attn, rows, seq_lens, layer.tables, m, layer.max_blocks,
                      s.block_size, s.kv_heads, s.heads / s.kv_heads, s.scale, layer.window, s.head_dim,
                      b.split_requests);
}

// One llama layer: delta (the previous layer's output; none for the first) added to the
// residual, and this layer's output left in b.delta.
template <typename T, typename K>
void llama_layer(const DecodeLayer& layer, int64_t l, const LoraRows* lora, const DecodeShape& s, T* residual,
                 const Buffers<T>& b, const int64_t* positions, const int64_t* rows, const int64_t* seq_lens,
                 int64_t m, bool tile) {
  const int64_t q_size = s.heads * s.head_dim, qkv_size = q_size + 2 * s.kv_heads * s.head_dim;
  K::add_rms_norm(l == 0 ? nullptr : b.delta, residual, static_cast<const T*>(layer.input_norm), b.h, m, s.hidden,
                  s.eps);
  project<T, K>(layer.qkv_proj, b.h, b.qkv, m, qkv_size, s.hidden, tile);
  add_lora<T, K>(lora, l, 0, b.h, b.qkv, s.hidden, qkv_size);
  attend<T, K>(layer, s, b, positions, rows, seq_lens, m);
  project<T, K>(layer.o_proj, b.attn, b.delta, m, s.hidden, q_size, tile);
  add_lora<T, K>(lora, l, 1, b.attn, b.delta, q_size, s.hidden);
  K::add_rms_norm(b.delta, residual, static_cast<const T*>(layer.post_norm), b.h, m, s.hidden, s.eps);
  project<T, K>(layer.gate_up_proj, b.h, b.gate_up, m, 2 * s.intermediate, s.hidden, tile);
  add_lora<T, K>(lora, l, 2, b.h, b.gate_up, s.hidden, 2 * s.intermediate);
  K::silu_mul(b.gate_up, b.act, m, s.intermediate);
  project<T, K>(layer.down_proj, b.act, b.delta, m, s.hidden, s.intermediate, tile);
  add_lora<T, K>(lora, l, 3, b.act, b.delta, s.intermediate, s.hidden);
}

// One Gemma 3 layer (pagedllm/models/gemma3.py): norms before and after attention and the
// MLP, q and k normed per head before rotary, GeGLU.
template <typename T, typename K>
void gemma_layer(const DecodeLayer& layer, int64_t l, const LoraRows* lora, const DecodeShape& s, T* residual,
                 const Buffers<T>& b, const int64_t* positions, const int64_t* rows, const int64_t* seq_lens,
                 int64_t m, bool tile) {
  const bool first = l == 0;
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim, qkv_size = q_size + 2 * kv_size;
  const int64_t hidden = s.hidden;
  if (!first) add_into(residual, b.delta, m * hidden);
  K::gemma_norm(residual, static_cast<const float*>(layer.input_norm), b.h, m, hidden, hidden, hidden, s.eps);
  project<T, K>(layer.qkv_proj, b.h, b.qkv, m, qkv_size, hidden, tile);
  add_lora<T, K>(lora, l, 0, b.h, b.qkv, hidden, qkv_size);
  K::gemma_norm(b.qkv, layer.q_norm, b.qkv, m, q_size, s.head_dim, qkv_size, s.eps);
  K::gemma_norm(b.qkv + q_size, layer.k_norm, b.qkv + q_size, m, kv_size, s.head_dim, qkv_size, s.eps);
  attend<T, K>(layer, s, b, positions, rows, seq_lens, m);
  project<T, K>(layer.o_proj, b.attn, b.delta, m, hidden, q_size, tile);
  add_lora<T, K>(lora, l, 1, b.attn, b.delta, q_size, hidden);
  K::gemma_norm(b.delta, static_cast<const float*>(layer.post_norm), b.delta, m, hidden, hidden, hidden, s.eps);
  add_into(residual, b.delta, m * hidden);
  K::gemma_norm(residual, layer.pre_ffn_norm, b.h, m, hidden, hidden, hidden, s.eps);
  project<T, K>(layer.gate_up_proj, b.h, b.gate_up, m, 2 * s.intermediate, hidden, tile);
  add_lora<T, K>(lora, l, 2, b.h, b.gate_up, hidden, 2 * s.intermediate);
  K::gelu_tanh_mul(b.gate_up, b.act, m, s.intermediate);
  project<T, K>(layer.down_proj, b.act, b.delta, m, hidden, s.intermediate, tile);
  add_lora<T, K>(lora, l, 3, b.act, b.delta, s.intermediate, hidden);
  K::gemma_norm(b.delta, layer.post_ffn_norm, b.delta, m, hidden, hidden, hidden, s.eps);
}

// The layers for m rows, with the kernels' own parallel regions (each splits its work over
// the threads: a GEMM by output panels, attention by request and KV head).
template <typename T, typename K>
void run_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeShape& s, T* residual, T* out,
                T* workspace, const void* final_norm, const int64_t* positions, const int64_t* rows,
                const int64_t* seq_lens, int64_t m, bool tile, int64_t split_requests, const LoraRows* lora) {
  const Buffers<T> b(workspace, s, m, split_requests);
  for (int64_t l = 0; l < num_layers; ++l) {
    if (s.gemma) {
      gemma_layer<T, K>(layers[l], l, lora, s, residual, b, positions, rows, seq_lens, m, tile);
    } else {
      llama_layer<T, K>(layers[l], l, lora, s, residual, b, positions, rows, seq_lens, m, tile);
    }
  }
  if (s.gemma) {
    if (num_layers > 0) add_into(residual, b.delta, m * s.hidden);
    K::gemma_norm(residual, static_cast<const float*>(final_norm), out, m, s.hidden, s.hidden, s.hidden, s.eps);
  } else {
    K::add_rms_norm(num_layers > 0 ? b.delta : nullptr, residual, static_cast<const T*>(final_norm), out, m,
                    s.hidden, s.eps);
  }
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
                   T* workspace, const void* final_norm, const int64_t* positions, const int64_t* rows,
                   const int64_t* seq_lens, int64_t m, int64_t split_requests, const LoraRows* lora) {
  const int threads = omp_get_max_threads();
  const bool tile = s.quant_int_max_rows > 0 && m > s.quant_int_max_rows;
  // Nested regions must run on one thread each (OpenMP's default), or the kernels' own regions
  // would start teams inside the threads' ones.
  const bool split = threads > 1 && m >= kMinRowsPerThread * threads * threads && !omp_in_parallel() &&
                     omp_get_max_active_levels() <= 1;
  if (!split)
    return run_layers<T, K>(layers, num_layers, s, residual, out, workspace, final_norm, positions, rows, seq_lens,
                            m, tile, split_requests, lora);
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
      // This thread's requests, numbered from 0 in row order, each layer's slots from row a, and
      // its block tables cut to them (layers of one group share one table, copied once).
      std::vector<int64_t> my_rows(n), my_lens(n);
      for (int64_t r = 0; r < n; ++r) {
        my_rows[r] = r;
        my_lens[r] = seq_lens[request_of_row[a + r]];
      }
      std::vector<DecodeLayer> my_layers(layers, layers + num_layers);
      std::vector<std::pair<const int64_t*, std::vector<int64_t>>> my_tables;
      for (DecodeLayer& layer : my_layers) {
        layer.slots += a;
        auto found = std::find_if(my_tables.begin(), my_tables.end(),
                                  [&](const auto& entry) { return entry.first == layer.tables; });
        if (found == my_tables.end()) {
          std::vector<int64_t> cut(n * layer.max_blocks);
          for (int64_t r = 0; r < n; ++r)
            std::memcpy(&cut[r * layer.max_blocks], layer.tables + request_of_row[a + r] * layer.max_blocks,
                        layer.max_blocks * sizeof(int64_t));
          my_tables.emplace_back(layer.tables, std::move(cut));
          found = my_tables.end() - 1;
        }
        layer.tables = found->second.data();
      }
      // This thread's adapter rows, counted from row a (still sorted by adapter).
      std::vector<int64_t> my_order, my_adapters;
      LoraRows my_lora{};
      if (lora != nullptr) {
        for (int64_t i = 0; i < lora->count; ++i) {
          if (lora->order[i] >= a && lora->order[i] < a + n) {
            my_order.push_back(lora->order[i] - a);
            my_adapters.push_back(lora->adapter_of[i]);
          }
        }
        my_lora = LoraRows{lora->parts, my_order.data(), my_adapters.data(), static_cast<int64_t>(my_order.size())};
      }
      run_layers<T, K>(my_layers.data(), num_layers, s, residual + a * s.hidden, out + a * s.hidden,
                       workspace + a * row_size, final_norm, positions + a, my_rows.data(), my_lens.data(), n,
                       tile, split_requests, lora != nullptr ? &my_lora : nullptr);
    }
  }
}

}  // namespace
}  // namespace pagedllm

// Elements of workspace each of a step's rows needs.
PAGEDLLM_API int64_t decode_layers_workspace(const DecodeShape* shape) { return pagedllm::workspace_row(*shape); }

// residual [m, hidden] (the embedded tokens, updated in place as the layers add to it) ->
// out [m, hidden], the final norm's output (its weight of the dtype, or float32 1 + w for
// Gemma 3).  positions: per row; rows, seq_lens: per request, as paged_decode_attention takes
// them (here one row per request); each layer's slots and block tables are in its DecodeLayer.
// lora: the step's adapters (null: none).
#define PAGEDLLM_DECODE_LAYERS(SUFFIX, T)                                                                         \
  PAGEDLLM_API void decode_layers_##SUFFIX(const DecodeLayer* layers, int64_t num_layers, const DecodeShape* shape, \
                                           T* residual, T* out, T* workspace, const void* final_norm,              \
                                           const int64_t* positions, const int64_t* rows, const int64_t* seq_lens,  \
                                           int64_t m, int64_t split_requests, const LoraRows* lora) {               \
    pagedllm::decode_layers<T, Kernels_##SUFFIX>(layers, num_layers, *shape, residual, out, workspace, final_norm,  \
                                                 positions, rows, seq_lens, m, split_requests, lora);               \
  }

PAGEDLLM_DECODE_LAYERS(f32, float)
PAGEDLLM_DECODE_LAYERS(bf16, bf16)
PAGEDLLM_DECODE_LAYERS(f32_f16kv, float)
PAGEDLLM_DECODE_LAYERS(f32_f8kv, float)
PAGEDLLM_DECODE_LAYERS(bf16_f8kv, bf16)
