// y = x W^T on weights kept quantized, as GGUF files ship them, and embedding rows read
// from them.
//
// Values.  Every GGUF type the engine runs natively is repacked once at load, bit for bit, into
// one of four kinds, in blocks of 32 values along k, each value w = scale * (u - zero) + min for
// its group of `group` values (pagedllm/models/gguf_weights.py): `zero` is an integer zero
// point (Q4_0: 8, Q5_0: 16, Q6_K: 32), min a float (Q4_1, Q4_K, Q5_1, Q5_K) or absent.
// - 4-bit: u in 0..15 (Q4_0, Q4_1, Q4_K);
// - 5-bit: u in 0..31 (Q5_0, Q5_1, Q5_K), as 4-bit plus a plane of fifth bits;
// - 6-bit: u in 0..63 (Q6_K, groups of 16), as 4-bit plus two planes of high bit pairs;
// - 8-bit: a signed byte (Q8_0).  Where the build has VNNI they are stored as q + 128 with
//   zero 128, which `vpdpbusd` (unsigned x signed bytes) takes without the sign trick below.
// Scales and mins are kept as the file keeps them (quant_layout.h's QuantWeight): a float16 per
// group for the legacy types; for the K types a float16 per super-group of 256 values times an
// int8 per group (Q4_K's and Q5_K's 6-bit sub-scales and sub-mins, Q6_K's signed sub-scales).
// So the weights in memory take the file's bytes (scales spread over panels, nothing added).
//
// Layout (pagedllm/layers/quantized.py packs it): output columns in panels of kPanel (16 with
// AVX-512, 8 with AVX2), so that one vector holds 4 consecutive k values ("a quad") of each
// of the panel's columns.  Per panel and block of 32: 8-bit, quads 0..7 one after another
// ([8][kPanel][4] bytes); 4-bit, [4][kPanel][4] bytes, quad j in the low nibbles and quad j + 4
// in the high ones; 5-bit, the 4-bit bytes then [kPanel][4] bytes of fifth bits, bit j of
// byte (c, i) for value 4j + i of column c; 6-bit, the 4-bit bytes then two planes of
// [kPanel][4] bytes, bits 2j, 2j + 1 of plane h's byte (c, i) the high pair of value
// 4(4h + j) + i.  Scales and mins: [panels][k / super-group][kPanel], sub-scales and sub-mins
// [panels][k / group][kPanel].
//
// Arithmetic.  The activations are quantized to signed bytes with a float scale, as llama.cpp's
// dot products do: per block of 32, or per super-group (256) before the K types with AVX-512
// (whose group sums super_tile scales in integers; k_activation_span).  A block's products are
// integer multiply-adds of a weight vector with one row's quad broadcast: VNNI's `vpdpbusd`,
// else `vpmaddubsw` (unsigned x signed bytes into int16 pairs) and `vpmaddwd`.  maddubs cannot
// saturate: u is at most 63, and signed 8-bit q goes in as |q| with x given q's sign (|q| <=
// 128, |x| <= 127).  The zero
// point comes off in integers (zero * the sum of the group's x); each block's int32 sums are
// then scaled once (the weight's scale times x's), and the mins' term is min * (the sum of
// the group's x).  A tile of up to kTileRows rows shares each weight vector loaded, so a
// step of a few rows reads the weights once.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "avx2.h"
#include "avx512.h"
#include "quant_layout.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kTileRows = 8;  // 32 vector registers: 8 rows' sums and accumulators beside the weights
#else
constexpr int64_t kTileRows = 4;
#endif

// Activation rows quantized per block of 32, in tiles of `ld` rows (kTileRows, or all m rows
// when fewer): a tile's blocks lie one after another, each block's rows side by side, so a tile
// of rows reads its blocks through one pointer at fixed offsets (a pointer per row ran the
// kernels out of registers) and in one contiguous stream.  Block-major over all m rows instead
// ([k / 32][m][32]), a tile's blocks were m * 32 bytes apart (128 KiB for a 4,096-token prompt
// step): every block in the same few L1 sets and its own page, and a 3B-shaped file's
// projections took 1.12x as long at 4,096 rows (docs/design.md).  The sums and steps are tiled
// the same way.  One per calling thread, kept between calls and only
// ever grown: a fresh one cost a zero-fill of up to m * k bytes at every projection.
struct QuantizedRows {
  int64_t m = 0;                // rows
  int64_t ld = 0;               // rows per tile: the stride from one block (group, span) of a tile to the next
  std::vector<int8_t> q;        // [tiles][k / 32][ld][32]
  std::vector<float> scale;     // [tiles][k / span][ld]: each span's step (quantize_rows)
  int span_shift = 0;           // log2 of the blocks of 32 per span
  std::vector<float> sums;      // [tiles][k / group][ld]: scale * the sum of q over each group of the weight's
  // [tiles][k / group][ld]: -zero * the sum of q over each group of the weight, where a group's
  // integer sums start (so the zero point costs the kernels a broadcast load, not a subtraction)
  std::vector<int32_t> zero_sums;

  // Where entry i (of per_row: blocks, groups or spans) of row `row` lies in its array.  A tile
  // kernel starts at a row that begins a tile (a multiple of ld) and steps ld entries per i.
  int64_t at(int64_t row, int64_t i, int64_t per_row) const { return ((row / ld) * per_row + i) * ld + row % ld; }
};

#if defined(__AVX2__) && !defined(__AVX512F__)  // load8: avx2.h
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif

// The largest |x| over n values (n a multiple of 32).
template <typename T>
inline float abs_max(const T* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 a = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) a = _mm512_max_ps(a, _mm512_abs_ps(load16(x + i)));
  return _mm512_reduce_max_ps(a);
#elif defined(__AVX2__)
  __m256 a = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < n; i += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, load8(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
#else
  float amax = 0.f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(to_float(x[j])));
  return amax;
#endif
}

// One block of 32 values to signed bytes q = x * inv (rounded to nearest, ties to even, as
// nearbyint); the sums of q over each 16 in half.
template <typename T>
inline void quantize_block(const T* x, float inv, int8_t* q, int32_t* half) {
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x), scale));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + 16), scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  half[0] = _mm512_reduce_add_epi32(q0);
  half[1] = _mm512_reduce_add_epi32(q1);
#elif defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(inv);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 8 * i), scale));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  half[0] = hsum8(_mm256_add_epi32(qi[0], qi[1]));
  half[1] = hsum8(_mm256_add_epi32(qi[2], qi[3]));
#else
  half[0] = half[1] = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(to_float(x[j]) * inv));
    half[j / 16] += q[j];
  }
#endif
}

// Each row's activations in spans of `span` values (32, or a K type's super-group of 256), each
// span to signed bytes with scale max|x| / 127 over it.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t group, int64_t span, int32_t zero, QuantizedRows& out) {
  const int64_t spans = m * k / span, per_span = span / kBlock;
  const int64_t ld = std::clamp<int64_t>(m, 1, kTileRows), padded = (m + ld - 1) / ld * ld;
  const auto grow = [](auto& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  };
  grow(out.q, padded * k);
  grow(out.scale, padded * k / span);
  grow(out.sums, padded * k / group);
  grow(out.zero_sums, padded * k / group);
  out.m = m;
  out.ld = ld;
  out.span_shift = __builtin_ctzll(static_cast<uint64_t>(per_span));
  const int64_t row_blocks = k / kBlock, row_spans = k / span, row_groups = k / group;
#pragma omp parallel for schedule(static) if (m * k >= (1 << 16))
  for (int64_t i = 0; i < spans; ++i) {  // rows are contiguous and k % span == 0: span i of the flat [m * k]
    const int64_t row = i / row_spans;
    const float amax = abs_max(x + i * span, span), d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    out.scale[out.at(row, i % row_spans, row_spans)] = d;
    for (int64_t j = 0; j < per_span; ++j) {
      const int64_t block = i * per_span + j, b = block % row_blocks;
      int32_t half[2];
      quantize_block(x + block * kBlock, inv, out.q.data() + out.at(row, b, row_blocks) * kBlock, half);
      if (group == kBlock) {
        const int64_t at = out.at(row, b, row_groups);
        out.sums[at] = d * static_cast<float>(half[0] + half[1]);
        out.zero_sums[at] = -zero * (half[0] + half[1]);
      } else {
        for (int h = 0; h < 2; ++h) {
          const int64_t at = out.at(row, 2 * b + h, row_groups);
          out.sums[at] = d * static_cast<float>(half[h]);
          out.zero_sums[at] = -zero * half[h];
        }
      }
    }
  }
}

// One instruction set's vectors: a vector holds one quad of kPanel columns.
#if defined(__AVX512BW__)
struct Isa {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I broadcast(const int8_t* quad) {
    int32_t v;
    std::memcpy(&v, quad, 4);
    return _mm512_set1_epi32(v);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I set32(const int32_t* p) { return _mm512_set1_epi32(*p); }
  // acc + the sums of u[i] * s[i] over each 4 bytes (u unsigned, s signed)
  static I dot(I acc, I u, I s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
  }
  // The peak's step (int8_multiply_add_peak): the integer multiply-add the kernels build on, into
  // int32 sums with VNNI, else into the int16 pair sums maddubs gives.  Written in asm because
  // GCC 12 wraps a loop of independent vpdpbusd intrinsics in two register copies each, and
  // would hoist a maddubs of operands that never change.
  static I peak_step(I acc, I u, I s) {
#if defined(__AVX512VNNI__)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#else
    I t;
    asm("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" : "+v"(acc), "=&v"(t) : "v"(u), "v"(s));
#endif
    return acc;
  }
  // dot(acc, u, broadcast(quad)), the quad's 4 bytes read by the multiply-add itself ({1to16}):
  // GCC issued a separate broadcast load for each one
  static I dot_quad(I acc, I u, const int8_t* quad) {
#if defined(__AVX512VNNI__)
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(quad)));
    return acc;
#else
    return dot(acc, u, broadcast(quad));
#endif
  }
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  // bit `bit` of every byte of h moved to bit 4 (the fifth bit of a 5-bit value), the rest 0
  static I fifth(I h, int bit) {
    const I shifted = bit < 4 ? _mm512_slli_epi16(h, 4 - bit) : _mm512_srli_epi16(h, bit - 4);
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x10));
  }
  // bits 2j, 2j + 1 of every byte of h moved to bits 4, 5 (a 6-bit value's high pair), the rest 0
  static I pair(I h, int j) {
    const I shifted = j < 2 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4);
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x30));
  }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I ints(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I sub32(I a, int32_t v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
  static I srl32(I v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I sll32(I v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I sra32(I v, int n) { return _mm512_sra_epi32(v, _mm_cvtsi32_si128(n)); }
  static I and32(I v, int32_t mask) { return _mm512_and_si512(v, _mm512_set1_epi32(mask)); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(bf16* p, F v) {  // rounded to nearest even (weights are finite)
    const I bits = _mm512_castps_si512(v);
    const I lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const I rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static I sign8(I x, I w) {  // x negated where w < 0 (where w == 0 the product is 0 anyway)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F bytes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__)
struct Isa {
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I broadcast(const int8_t* quad) {
    int32_t v;
    std::memcpy(&v, quad, 4);
    return _mm256_set1_epi32(v);
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I set32(const int32_t* p) { return _mm256_set1_epi32(*p); }
  static I dot(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I peak_step(I acc, I u, I s) {  // as AVX-512's above, in asm for the same reasons
    I t;
    asm("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(u), "x"(s));
    return acc;
  }
  static I dot_quad(I acc, I u, const int8_t* quad) { return dot(acc, u, broadcast(quad)); }
  static I abs8(I v) { return _mm256_abs_epi8(v); }
  // u[i] * s[i] + u[i + 1] * s[i + 1] in each int16 (u unsigned, s signed), and int16 sums
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  // a[2i] * w[2i] + a[2i + 1] * w[2i + 1] in each int32
  static I madd(I a, I w) { return _mm256_madd_epi16(a, w); }
  static I ones16() { return _mm256_set1_epi16(1); }
  static I set16(int16_t v) { return _mm256_set1_epi16(v); }
  static I sra16(I v, int n) { return _mm256_sra_epi16(v, _mm_cvtsi32_si128(n)); }
  // The 8 int8 at p, value c as 256 * p[c] in both int16 halves of int32 lane c: a madd weight
  // that multiplies a column's pair sums by its sub-scale (times 256: a shuffle places the byte
  // in the high half, which keeps its sign without a widening).
  static I sub_scales16(const int8_t* p) {
    int64_t v;
    std::memcpy(&v, p, 8);
    const __m256i z = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,  //
                                       -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x(v), z);
  }
  static I fifth(I h, int bit) {
    const I shifted = bit < 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x10));
  }
  static I pair(I h, int j) {
    const I shifted = j < 2 ? _mm256_slli_epi16(h, 4 - 2 * j) : _mm256_srli_epi16(h, 2 * j - 4);
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x30));
  }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub32(I a, int32_t v) { return _mm256_sub_epi32(a, _mm256_set1_epi32(v)); }
  static I srl32(I v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I sll32(I v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I sra32(I v, int n) { return _mm256_sra_epi32(v, _mm_cvtsi32_si128(n)); }
  static I and32(I v, int32_t mask) { return _mm256_and_si256(v, _mm256_set1_epi32(mask)); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store(bf16* p, F v) {
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int c = 0; c < 8; ++c) p[c] = from_float<bf16>(tmp[c]);
  }
  static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F bytes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void fstore(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#endif

#if defined(__AVX2__)
// Group g's kPanel scales (mins) as floats: the super-group's float16 times the group's int8.
inline Isa::F scale_vector(const PanelScales& s, int64_t g) {
  const Isa::F v = Isa::halves(s.scales + s.super_at(g));
  return s.sub_scales == nullptr ? v : Isa::mul(v, Isa::bytes(s.sub_scales + g * kPanel));
}
inline Isa::F min_vector(const PanelScales& s, int64_t g) {
  const Isa::F v = Isa::halves(s.mins + s.super_at(g));
  return s.sub_mins == nullptr ? v : Isa::mul(v, Isa::bytes(s.sub_mins + g * kPanel));
}

// acc[r] += the mins' term of R rows: each group's min times the sum of the row's x over it
// (xs: QuantizedRows::sums from the tile's first row).
template <int R>
inline void add_mins(const PanelScales& ps, const float* xs, int64_t groups, int64_t m, Isa::F* acc) {
  using V = Isa;
  if (ps.mins != nullptr && ps.sub_mins != nullptr) {
    // Sub-mins times each group's x sum over a super-group, then its float16 min once.
    const int64_t per_super = int64_t{1} << ps.super_shift;
    for (int64_t g0 = 0; g0 < groups; g0 += per_super) {
      V::F part[R];
      for (int r = 0; r < R; ++r) part[r] = V::fzero();
      for (int64_t g = g0; g < g0 + per_super; ++g) {
        const V::F sub = V::bytes(ps.sub_mins + g * kPanel);
        for (int r = 0; r < R; ++r) part[r] = V::fmadd(sub, V::fset(xs[g * m + r]), part[r]);
      }
      const V::F super = V::halves(ps.mins + ps.super_at(g0));
      for (int r = 0; r < R; ++r) acc[r] = V::fmadd(part[r], super, acc[r]);
    }
  } else if (ps.mins != nullptr) {
    for (int64_t g = 0; g < groups; ++g) {
      const V::F mins = min_vector(ps, g);
      for (int r = 0; r < R; ++r) acc[r] = V::fmadd(mins, V::fset(xs[g * m + r]), acc[r]);
    }
  }
}

// Quad j (0..7) of a 4-, 5- or 6-bit block as unsigned bytes: nibbles of vector j % 4 (low for
// j < 4), plus the fifth bit (bit j of the plane after the nibbles) or the high pair (bits
// 2(j % 4).. of plane j / 4).
template <int Bits>
inline Isa::I small_quad(const uint8_t* blk, int j) {
  const Isa::I v = Isa::load(blk + (j & 3) * kPanel * 4);
  Isa::I u = j < 4 ? Isa::low_nibbles(v) : Isa::high_nibbles(v);
  if constexpr (Bits == 5) u = Isa::or_(u, Isa::fifth(Isa::load(blk + 16 * kPanel), j));
  if constexpr (Bits == 6) u = Isa::or_(u, Isa::pair(Isa::load(blk + (16 + 4 * (j >> 2)) * kPanel), j & 3));
  return u;
}
#endif

// The stored integer of column c (within its panel) at k index j of block `blk` (which points
// at the panel's block).
inline int32_t panel_value(const uint8_t* blk, int64_t bits, int64_t c, int64_t j) {
  const int64_t quad = j / 4, byte = j % 4;
  if (bits == 8) {
    const uint8_t v = blk[(quad * kPanel + c) * 4 + byte];
    return kUnsigned8 ? static_cast<int32_t>(v) : static_cast<int32_t>(static_cast<int8_t>(v));
  }
  const uint8_t packed = blk[((quad % 4) * kPanel + c) * 4 + byte];
  const int32_t low = quad < 4 ? packed & 0x0F : packed >> 4;
  if (bits == 5) return low | (((blk[16 * kPanel + c * 4 + byte] >> quad) & 1) << 4);
  if (bits == 6) return low | (((blk[(16 + 4 * (quad / 4)) * kPanel + c * 4 + byte] >> (2 * (quad % 4))) & 3) << 4);
  return low;
}

#if defined(__AVX2__)
// Each block asks for the weight bytes this far ahead of it (prefetcht0).  The hardware's own
// prefetchers left a one-row product on a weight larger than the caches at 19 GB/s on two
// cores; asking 2 KiB ahead took Q4_K to 24-26 GB/s and Q6_K to 22-23 (1.5-3 KiB measured;
// a 2-core Xeon whose two cores sum a tensor at 22.5 GB/s).  A prefetch never faults, so
// asking past the weight's end is harmless.
constexpr int64_t kPrefetchBytes = 2048;
// out[r][c] = x row (row0 + r) . column c of the panel, for R rows.
// Without VNNI's one-instruction dot, 4- and 5-bit blocks in groups of 32 keep maddubs' int16
// pair sums across the block's quads (vpaddw) and widen them once (vpmaddwd), by the group's
// sub-scale where the type has one (Fold: Q4_K, Q5_K, whose zero point is 0).  A 4-bit
// maddubs sum is at most 2 * 15 * 127 = 3,810, so a block's eight sum to 30,480 and fit int16;
// 5-bit ones (7,874) go four and four into two sets.  The dot per quad was maddubs, madd, add
// (three instructions, one a multiply); this is maddubs and add, with one madd a block.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kInt16Sums = true;
#else
constexpr bool kInt16Sums = false;
#endif

template <int Bits, int Group, int R, bool Fold = false>
void panel_tile(const uint8_t* wq, const PanelScales& ps, const QuantizedRows& x, int64_t row0, int64_t k,
                float (*out)[kPanel]) {
  using V = Isa;
  // m: the stride of QuantizedRows' tile from here on (its ld)
  const int64_t blocks = k / kBlock, groups = k / Group, m = x.ld;
  const int8_t* xq = x.q.data() + x.at(row0, 0, blocks) * kBlock;
  const float* xd = x.scale.data() + x.at(row0, 0, blocks >> x.span_shift);
  const float* xs = x.sums.data() + x.at(row0, 0, groups);
  // A group's sums start at -zero * the sum of its x: sum of (u - zero) * x = sum of u * x - zero * sum of x
  const int32_t* zs = x.zero_sums.data() + x.at(row0, 0, groups);
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  [[maybe_unused]] typename V::F super = V::fzero();  // Fold: the super-group's scales (over 256 or 128)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wq + b * block_bytes(Bits);
    for (int64_t line = 0; line < block_bytes(Bits); line += 64) __builtin_prefetch(blk + kPrefetchBytes + line, 0, 3);
    const int8_t* rows = xq + b * m * kBlock;  // row r's block at rows + r * kBlock
    const float* d = xd + (b >> x.span_shift) * m;  // the block's span's steps
    const int32_t* z = zs + (Group == 16 ? 2 * b : b) * m;  // the block's first group
    typename V::I sum[R];
    for (int r = 0; r < R; ++r) sum[r] = V::set32(z + r);
    // The first group of 16 folded into acc midway, not kept in a second set of R sums.
    auto fold_first_half = [&]() {
      const typename V::F scale = scale_vector(ps, 2 * b);
      for (int r = 0; r < R; ++r) {
        acc[r] = V::fmadd(V::to_float(sum[r]), V::mul(scale, V::fset(d[r])), acc[r]);
        sum[r] = V::set32(z + m + r);
      }
    };
#if defined(__AVX2__) && !defined(__AVX512F__)  // kInt16Sums: Isa's int16 helpers are AVX2's
    if constexpr ((Bits == 4 || Bits == 5) && Group == 32) {
      constexpr int kSets = Bits == 4 ? 1 : 2;  // int16 sums per row: quads 0..3 and 4..7 apart for 5-bit
      typename V::I pairs[kSets][R];
      for (int j = 0; j < 4; ++j) {
        const typename V::I lo = small_quad<Bits>(blk, j), hi = small_quad<Bits>(blk, j + 4);
        for (int r = 0; r < R; ++r) {
          const int8_t* row = rows + r * kBlock;
          const typename V::I a = V::maddubs(lo, V::broadcast(row + 4 * j));
          const typename V::I c = V::maddubs(hi, V::broadcast(row + 16 + 4 * j));
          if constexpr (kSets == 1) {
            pairs[0][r] = j == 0 ? V::add16(a, c) : V::add16(pairs[0][r], V::add16(a, c));
          } else {
            pairs[0][r] = j == 0 ? a : V::add16(pairs[0][r], a);
            pairs[1][r] = j == 0 ? c : V::add16(pairs[1][r], c);
          }
        }
      }
      if constexpr (Fold) {
        // Sub-scales times 256 (times 128 for 5-bit, whose two madds are summed): every int32
        // stays under 2^31 (2 * 30,480 * 32,768 for 4-bit).
        typename V::I w = V::sub_scales16(ps.sub_scales + b * kPanel);
        if constexpr (kSets == 2) w = V::sra16(w, 1);
        if ((b & ((int64_t{1} << ps.super_shift) - 1)) == 0)  // a super-group's first block
          super = V::mul(V::halves(ps.scales + ps.super_at(b)), V::fset(kSets == 1 ? 1.f / 256 : 1.f / 128));
        for (int r = 0; r < R; ++r) {
          typename V::I s32 = V::madd(pairs[0][r], w);
          if constexpr (kSets == 2) s32 = V::add32(s32, V::madd(pairs[1][r], w));
          acc[r] = V::fmadd(V::to_float(s32), V::mul(super, V::fset(d[r])), acc[r]);
        }
      } else {
        const typename V::I ones = V::ones16();
        const typename V::F scale = scale_vector(ps, b);
        for (int r = 0; r < R; ++r) {
          typename V::I s32 = V::add32(V::madd(pairs[0][r], ones), V::set32(z + r));
          if constexpr (kSets == 2) s32 = V::add32(s32, V::madd(pairs[1][r], ones));
          acc[r] = V::fmadd(V::to_float(s32), V::mul(scale, V::fset(d[r])), acc[r]);
        }
      }
      continue;
    }
    if constexpr (Bits == 6 && Group == 16 && Fold) {
      // Q6_K: per group of 16, quads 0+1 and 2+3 in int16 (each maddubs at most 2 * 63 * 127 =
      // 16,002, so two fit), widened by the group's sub-scale times 32 (sub_scales16's 256, over
      // 8); the zero point's -32 * (the group's x sum) comes in as one more madd of the pair
      // (-16 * x sum, itself at most 16 * 16 * 127 = 32,512) with the same weight.  A group's
      // int32 is at most 3 * 2 * 32,512 * 4,096 < 2^30, a block's two under 2^31.
      if ((b & ((int64_t{1} << (ps.super_shift - 1)) - 1)) == 0)  // a super-group's first block
        super = V::mul(V::halves(ps.scales + ps.super_at(2 * b)), V::fset(1.f / 32));
      typename V::I s32[R];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // the block's two groups
        const typename V::I w = V::sra16(V::sub_scales16(ps.sub_scales + (2 * b + h) * kPanel), 3);
        const typename V::I u0 = small_quad<6>(blk, 4 * h), u1 = small_quad<6>(blk, 4 * h + 1);
        const typename V::I u2 = small_quad<6>(blk, 4 * h + 2), u3 = small_quad<6>(blk, 4 * h + 3);
        for (int r = 0; r < R; ++r) {
          const int8_t* row = rows + r * kBlock + 16 * h;
          const typename V::I p0 = V::add16(V::maddubs(u0, V::broadcast(row)), V::maddubs(u1, V::broadcast(row + 4)));
          const typename V::I p1 =
              V::add16(V::maddubs(u2, V::broadcast(row + 8)), V::maddubs(u3, V::broadcast(row + 12)));
          const typename V::I zero_pair = V::set16(static_cast<int16_t>(z[h * m + r] / 2));
          const typename V::I g = V::add32(V::add32(V::madd(p0, w), V::madd(p1, w)), V::madd(zero_pair, w));
          s32[r] = h == 0 ? g : V::add32(s32[r], g);
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = V::fmadd(V::to_float(s32[r]), V::mul(super, V::fset(d[r])), acc[r]);
      continue;
    }
#endif
    if constexpr (Bits == 8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const typename V::I v = V::load(blk + j * kPanel * 4);
        const typename V::I u = kUnsigned8 ? v : V::abs8(v);
        for (int r = 0; r < R; ++r) {
          if constexpr (kUnsigned8) {
            sum[r] = V::dot_quad(sum[r], u, rows + r * kBlock + 4 * j);
          } else {
            sum[r] = V::dot(sum[r], u, V::sign8(V::broadcast(rows + r * kBlock + 4 * j), v));
          }
        }
        if (Group == 16 && j == 3) fold_first_half();
      }
    } else if constexpr (Group == 32 || R <= kTileRows / 2) {
      // Quads j and j + 4 share their loads.  In groups of 16 (with registers to spare) quads
      // 4..7 go to a second set of sums, the second group's: two independent chains.
      constexpr bool kTwoGroups = Group == 16;
      typename V::I second[R];
      if constexpr (kTwoGroups)
        for (int r = 0; r < R; ++r) second[r] = V::set32(z + m + r);
      typename V::I* high = kTwoGroups ? second : sum;
      for (int j = 0; j < 4; ++j) {
        const typename V::I lo = small_quad<Bits>(blk, j), hi = small_quad<Bits>(blk, j + 4);
        for (int r = 0; r < R; ++r) {
          const int8_t* row = rows + r * kBlock;
          sum[r] = V::dot_quad(sum[r], lo, row + 4 * j);
          high[r] = V::dot_quad(high[r], hi, row + 16 + 4 * j);
        }
      }
      if constexpr (kTwoGroups) {
        const typename V::F scale = scale_vector(ps, 2 * b);
        for (int r = 0; r < R; ++r) {
          acc[r] = V::fmadd(V::to_float(sum[r]), V::mul(scale, V::fset(d[r])), acc[r]);
          sum[r] = second[r];
        }
      }
    } else {  // groups of 16: quads 0..3, then 4..7
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const typename V::I u = small_quad<Bits>(blk, j);
        for (int r = 0; r < R; ++r) sum[r] = V::dot_quad(sum[r], u, rows + r * kBlock + 4 * j);
        if (j == 3) fold_first_half();
      }
    }
    const typename V::F scale = scale_vector(ps, Group == 16 ? 2 * b + 1 : b);  // the block's (last) group
    for (int r = 0; r < R; ++r) acc[r] = V::fmadd(V::to_float(sum[r]), V::mul(scale, V::fset(d[r])), acc[r]);
  }
  add_mins<R>(ps, xs, groups, m, acc);
  for (int r = 0; r < R; ++r) V::fstore(out[r], acc[r]);
}

#if defined(__AVX512BW__)
// K types (Q4_K, Q5_K, Q6_K) with AVX-512.  Their activations are quantized per super-group (one
// step per row for its 256 values, quantize_rows), so a group's integer sum is multiplied by the
// group's int8 sub-scale in integers (vpmulld) and summed over the super-group, and only that sum
// is converted and scaled (its float16 scale times the row's step).  A group and row cost a
// multiply and an add; converting and scaling each group's sum took four vector instructions, two
// on the ports the dots run on: 1B-shaped Q4_K_M projections at 128 rows went from 59% to 69% of
// the integer peak, with dot_quad's embedded broadcasts (2-core Zen 4 EPYC, bfloat16, three runs
// of benchmarks/quantized_linear.py alternated with the build before; docs/design.md).
// Bounds: a 4-bit block's sum is at most 32 * 15 * 127 = 60,960, times a sub-scale of 63, eight
// to a super-group: 3.1e7; 5-bit 6.3e7; 6-bit (u - 32 in groups of 16, sub-scales down to -128)
// 16 * 32 * 127 * 128 * 16 = 1.3e8: all under 2^31.
template <int Bits, int Group, int R>
void super_tile(const uint8_t* wq, const PanelScales& ps, const QuantizedRows& x, int64_t row0, int64_t k,
                float (*out)[kPanel]) {
  using V = Isa;
  constexpr int kGroups = kBlock / Group;  // groups per block
  const int64_t blocks = k / kBlock, m = x.ld, per_super = int64_t{1} << x.span_shift;  // m: the tile's stride
  const int8_t* xq = x.q.data() + x.at(row0, 0, blocks) * kBlock;
  const float* xd = x.scale.data() + x.at(row0, 0, blocks >> x.span_shift);
  const int32_t* zs = x.zero_sums.data() + x.at(row0, 0, k / Group);
  V::F acc[R];
  V::I whole[R];  // the super-group's sums so far, each group's times its sub-scale
  for (int r = 0; r < R; ++r) {
    acc[r] = V::fzero();
    whole[r] = V::zero();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = wq + b * block_bytes(Bits);
    for (int64_t line = 0; line < block_bytes(Bits); line += 64) __builtin_prefetch(blk + kPrefetchBytes + line, 0, 3);
    const int8_t* rows = xq + b * m * kBlock;  // row r's block at rows + r * kBlock
#pragma GCC unroll 2
    for (int h = 0; h < kGroups; ++h) {
      const int64_t g = b * kGroups + h;
      V::I sum[R];
      for (int r = 0; r < R; ++r) sum[r] = V::set32(zs + g * m + r);
      if constexpr (Group == 32) {  // quads j and j + 4 share their loads
        for (int j = 0; j < 4; ++j) {
          const V::I lo = small_quad<Bits>(blk, j), hi = small_quad<Bits>(blk, j + 4);
          for (int r = 0; r < R; ++r) {
            const int8_t* row = rows + r * kBlock;
            sum[r] = V::dot_quad(V::dot_quad(sum[r], lo, row + 4 * j), hi, row + 16 + 4 * j);
          }
        }
      } else {  // groups of 16: quads 4h .. 4h + 3
        // Unrolled (as every quad loop here), so that small_quad's shifts and nibble choice are
        // constants: left as a loop, GCC 12 shifted by a register and branched per quad, and a
        // 3B-shaped file's Q6_K down projections took 1.05-1.16x as long at 8-128 rows (2-core
        // Zen 4 EPYC; benchmarks/quantized_linear.py --by-kind, docs/measurements.md).
#pragma GCC unroll 4
        for (int j = 4 * h; j < 4 * h + 4; ++j) {
          const V::I u = small_quad<Bits>(blk, j);
          for (int r = 0; r < R; ++r) sum[r] = V::dot_quad(sum[r], u, rows + r * kBlock + 4 * j);
        }
      }
      const V::I sub = V::ints(ps.sub_scales + g * kPanel);
      for (int r = 0; r < R; ++r) whole[r] = V::add32(whole[r], V::mullo32(sum[r], sub));
    }
    if (((b + 1) & (per_super - 1)) == 0) {  // a super-group's last block
      const V::F super = V::halves(ps.scales + ps.super_at(b * kGroups));
      const float* d = xd + (b >> x.span_shift) * m;
      for (int r = 0; r < R; ++r) {
        acc[r] = V::fmadd(V::to_float(whole[r]), V::mul(super, V::fset(d[r])), acc[r]);
        whole[r] = V::zero();
      }
    }
  }
  add_mins<R>(ps, x.sums.data() + x.at(row0, 0, k / Group), k / Group, m, acc);
  for (int r = 0; r < R; ++r) V::fstore(out[r], acc[r]);
}
#endif
#else
// Plain C++ for CPUs without AVX2: the same arithmetic, value by value.
template <int Bits, int Group, int R>
void panel_tile(const uint8_t* wq, const PanelScales& ps, int32_t zero, const QuantizedRows& x, int64_t row0,
                int64_t k, float (*out)[kPanel]) {
  const int64_t blocks = k / kBlock, groups = k / Group;
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r;
    for (int64_t c = 0; c < kPanel; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* xq = x.q.data() + x.at(row, b, blocks) * kBlock;
        int32_t half[2] = {0, 0};
        for (int64_t j = 0; j < kBlock; ++j)
          half[j / 16] += (panel_value(wq + b * block_bytes(Bits), Bits, c, j) - zero) * xq[j];
        const float d = x.scale[x.at(row, b >> x.span_shift, blocks >> x.span_shift)];
        if (Group == 32) {
          acc += d * ps.scale(b, c) * static_cast<float>(half[0] + half[1]);
        } else {
          acc += d * (ps.scale(2 * b, c) * half[0] + ps.scale(2 * b + 1, c) * half[1]);
        }
      }
      if (ps.mins != nullptr)
        for (int64_t g = 0; g < groups; ++g) acc += ps.min(g, c) * x.sums[x.at(row, g, groups)];
      out[r][c] = acc;
    }
  }
}
#endif

template <int Bits, int Group>
void panel_rows(const uint8_t* wq, const PanelScales& ps, int32_t zero, const QuantizedRows& x, int64_t row0,
                int64_t rows, int64_t k, float (*out)[kPanel]) {
#if defined(__AVX512BW__)
  if constexpr ((Bits == 4 || Bits == 5) && Group == 32 || Bits == 6 && Group == 16) {
    if (ps.sub_scales != nullptr) {  // QuantizedRows in spans of the super-group (quant_gemm)
      switch (rows) {
        case 1: return super_tile<Bits, Group, 1>(wq, ps, x, row0, k, out);
        case 2: return super_tile<Bits, Group, 2>(wq, ps, x, row0, k, out);
        case 3: return super_tile<Bits, Group, 3>(wq, ps, x, row0, k, out);
        case 4: return super_tile<Bits, Group, 4>(wq, ps, x, row0, k, out);
        case 5: return super_tile<Bits, Group, 5>(wq, ps, x, row0, k, out);
        case 6: return super_tile<Bits, Group, 6>(wq, ps, x, row0, k, out);
        case 7: return super_tile<Bits, Group, 7>(wq, ps, x, row0, k, out);
        default: return super_tile<Bits, Group, 8>(wq, ps, x, row0, k, out);
      }
    }
  }
#endif
#if defined(__AVX2__)
  // zero is folded into QuantizedRows' zero_sums; sub-scales into the int16 sums' madd where
  // the type has them (Q4_K, Q5_K: zero point 0; Q6_K: 32, taken into the madd too)
  if constexpr (kInt16Sums && ((Bits == 4 || Bits == 5) && Group == 32 || Bits == 6 && Group == 16)) {
    if (ps.sub_scales != nullptr && zero == (Bits == 6 ? 32 : 0)) {
      switch (rows) {
        case 1: return panel_tile<Bits, Group, 1, true>(wq, ps, x, row0, k, out);
        case 2: return panel_tile<Bits, Group, 2, true>(wq, ps, x, row0, k, out);
        case 3: return panel_tile<Bits, Group, 3, true>(wq, ps, x, row0, k, out);
        default: return panel_tile<Bits, Group, 4, true>(wq, ps, x, row0, k, out);
      }
    }
  }
#define PAGEDLLM_TILE(R) panel_tile<Bits, Group, R>(wq, ps, x, row0, k, out)
#else
#define PAGEDLLM_TILE(R) panel_tile<Bits, Group, R>(wq, ps, zero, x, row0, k, out)
#endif
  switch (rows) {
    case 1: return PAGEDLLM_TILE(1);
    case 2: return PAGEDLLM_TILE(2);
    case 3: return PAGEDLLM_TILE(3);
    case 4: return PAGEDLLM_TILE(4);
#if defined(__AVX512F__)
    case 5: return PAGEDLLM_TILE(5);
    case 6: return PAGEDLLM_TILE(6);
    case 7: return PAGEDLLM_TILE(7);
    default: return PAGEDLLM_TILE(8);
#else
    default: return PAGEDLLM_TILE(4);
#endif
  }
#undef PAGEDLLM_TILE
}

// A tile's floats to row `dst` of y: whole vectors where the panel is full.
template <typename T>
inline void store_row(T* dst, const float* src, int64_t cols) {
#if defined(__AVX2__)
  if (cols == kPanel) return Isa::store(dst, Isa::fload(src));
#endif
  for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(src[c]);
}

// Where the quantized activations outgrow a core's L2 (kFitsL2Bytes), rows are taken in blocks
// of about kRowBlockBytes, each block against every panel in turn: the block stays in L2 while
// the weight (a few hundred KiB to a few MiB) streams past it.  Panel by panel over all the rows
// instead, each panel read every row's activations again from L3 or memory, and Gemma 3's
// prompt steps were no faster than on its dequantized weights (2-core EPYC with AVX512-VNNI;
// benchmarks/weights_compare.py, docs/performance.md).
constexpr int64_t kRowBlockBytes = 128 << 10, kFitsL2Bytes = 1 << 20;

// The values sharing one activation step before a K type (sub-scales given) of `super_group`.
// With AVX-512, its super-group: super_tile then scales each group's sum in integers (16-19%
// faster at 8-128 rows on a 1B-shaped Q4_K_M file), at some accuracy: Gemma 3 270M's perplexity
// moved +0.55% from its dequantized weights' where per-32 steps moved it +0.09% (docs/design.md).
// Elsewhere, where the kernels scale every block's sum in floats either way, a block of 32 (as
// for the legacy types).  With AVX-512, spans of 128 and 64 took 1.05x and 1.11x 256's time
// at 128 rows (one run each).
inline int64_t k_activation_span(int64_t super_group) {
#if defined(__AVX512BW__)
  return std::max<int64_t>(super_group, kBlock);
#else
  (void)super_group;
  return kBlock;
#endif
}

// y[r * ldy + j] for j < w.rows: row r of x [m, w.cols] times column j of the weight.
template <typename T, int Bits, int Group>
void quant_gemm(const T* x, T* y, int64_t m, int64_t ldy, const QuantWeight& w) {
  thread_local QuantizedRows this_threads;
  QuantizedRows& xr = this_threads;  // inside the parallel region the name would be each worker's own
  const int64_t n = w.rows, k = w.cols;
  const int32_t zero = static_cast<int32_t>(w.zero);
  const int64_t span = w.sub_scales != nullptr ? k_activation_span(w.super_group) : kBlock;
  quantize_rows(x, m, k, Group, span, zero, xr);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_bytes = k / kBlock * block_bytes(Bits);
  const int64_t block_rows = m * k <= kFitsL2Bytes ? std::max<int64_t>(m, 1)
                                                   : std::max<int64_t>(1, kRowBlockBytes / k / kTileRows) * kTileRows;
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel), end = std::min(m, (rb + 1) * block_rows);
      const PanelScales ps(w, p);
      for (int64_t r0 = rb * block_rows; r0 < end; r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, end - r0);
        float out[kTileRows][kPanel];
        panel_rows<Bits, Group>(w.qs + p * panel_bytes, ps, zero, xr, r0, rows, k, out);
        for (int64_t r = 0; r < rows; ++r) store_row(y + (r0 + r) * ldy + p * kPanel, out[r], cols);
      }
    }
  }
}

template <typename T>
void quant_gemm_any(const T* x, T* y, int64_t m, int64_t ldy, const QuantWeight& w) {
  if (w.bits == 4) return quant_gemm<T, 4, 32>(x, y, m, ldy, w);
  if (w.bits == 5) return quant_gemm<T, 5, 32>(x, y, m, ldy, w);
  if (w.bits == 6) return quant_gemm<T, 6, 16>(x, y, m, ldy, w);
  if (w.group == 16) return quant_gemm<T, 8, 16>(x, y, m, ldy, w);
  return quant_gemm<T, 8, 32>(x, y, m, ldy, w);
}

// Rows `ids` of the weight as floats (embedding lookups).
template <typename T>
void dequantize_rows(const QuantWeight& w, const int64_t* ids, int64_t count, T* out) {
  const int64_t k = w.cols, panel_bytes = k / kBlock * block_bytes(w.bits);
  const int32_t zero = static_cast<int32_t>(w.zero);
#pragma omp parallel for schedule(static) if (count * k >= (1 << 16))
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = ids[i] / kPanel, c = ids[i] % kPanel;
    const PanelScales ps(w, p);
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = w.qs + p * panel_bytes + b * block_bytes(w.bits);
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t g = (b * kBlock + j) / w.group;
        const float v = ps.scale(g, c) * static_cast<float>(panel_value(blk, w.bits, c, j) - zero);
        out[i * k + b * kBlock + j] = from_float<T>(v + ps.min(g, c));
      }
    }
  }
}

// The whole weight transposed, W^T [k, n] at out (rows ldo apart), as floats: a float GEMM takes
// it for many-row steps.  In the panel layout byte i of every 4-byte lane of a quad's vector is
// one k row of the panel's columns, so each is shifted down, masked, converted and stored whole.
template <typename T, int Bits>
void dequantize_transposed(const QuantWeight& w, T* out, int64_t ldo) {
  const int64_t n = w.rows, k = w.cols, group = w.group, panel_bytes = k / kBlock * block_bytes(Bits);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int32_t zero = static_cast<int32_t>(w.zero);
  // Panels side by side that fill a 64-byte cache line of a row of out, done together so that
  // each line is written whole, once.
  constexpr int64_t line = std::max<int64_t>(1, 64 / (kPanel * static_cast<int64_t>(sizeof(T))));
#pragma omp parallel for schedule(static)
  for (int64_t first = 0; first < panels; first += line) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      for (int j = 0; j < 8; ++j) {
       for (int64_t p = first; p < std::min(panels, first + line); ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const uint8_t* blk = w.qs + p * panel_bytes + b * block_bytes(Bits);
        const int64_t g = (b * kBlock + 4 * j) / group;
        const PanelScales ps(w, p);
#if defined(__AVX2__)
        using V = Isa;
        const typename V::I v = V::load(blk + (Bits == 8 ? j : j & 3) * kPanel * 4);
        const typename V::I extra = Bits == 5   ? V::load(blk + 16 * kPanel)
                                    : Bits == 6 ? V::load(blk + (16 + 4 * (j >> 2)) * kPanel)
                                                : V::zero();
        const typename V::F scale = scale_vector(ps, g), offset = ps.mins == nullptr ? V::fzero() : min_vector(ps, g);
        for (int i = 0; i < 4; ++i) {
          typename V::I t;
          if constexpr (Bits == 8) {
            t = kUnsigned8 ? V::and32(V::srl32(v, 8 * i), 0xFF) : V::sra32(V::sll32(v, 24 - 8 * i), 24);
          } else {
            t = V::and32(V::srl32(v, 8 * i + (j < 4 ? 0 : 4)), 0x0F);
            if constexpr (Bits == 5) t = V::or_(t, V::sll32(V::and32(V::srl32(extra, 8 * i + j), 1), 4));
            if constexpr (Bits == 6) t = V::or_(t, V::sll32(V::and32(V::srl32(extra, 8 * i + 2 * (j & 3)), 3), 4));
          }
          const typename V::F row = V::fmadd(V::to_float(V::sub32(t, zero)), scale, offset);
          T* dst = out + (b * kBlock + 4 * j + i) * ldo + p * kPanel;
          if (cols == kPanel) {
            V::store(dst, row);
          } else {
            float tmp[kPanel];
            V::fstore(tmp, row);
            for (int64_t c = 0; c < cols; ++c) dst[c] = from_float<T>(tmp[c]);
          }
        }
#else
        for (int64_t i = 0; i < 4; ++i)
          for (int64_t c = 0; c < cols; ++c) {
            const float v = ps.scale(g, c) * static_cast<float>(panel_value(blk, Bits, c, 4 * j + i) - zero);
            out[(b * kBlock + 4 * j + i) * ldo + p * kPanel + c] = from_float<T>(v + ps.min(g, c));
          }
#endif
       }
      }
    }
  }
}

template <typename T>
void dequantize_any(const QuantWeight& w, const int64_t* ids, int64_t count, T* out) {
  if (ids != nullptr) return dequantize_rows(w, ids, count, out);
  // the whole weight, transposed: out is [k, count] (count >= n)
  if (w.bits == 4) return dequantize_transposed<T, 4>(w, out, count);
  if (w.bits == 5) return dequantize_transposed<T, 5>(w, out, count);
  if (w.bits == 6) return dequantize_transposed<T, 6>(w, out, count);
  return dequantize_transposed<T, 8>(w, out, count);
}

#if defined(__AVX2__)
// One thread's share of the integer peak: Isa::peak_step issued back to back into kPeakChains
// independent sums (more than its latency times its issue rate), its operands in registers, so
// that only the multiply-add's issue rate bounds it: no memory, no unpacking, no scaling.
// Returns the multiply-adds done (one per byte of a vector a step).
constexpr int kPeakChains = 12;
int64_t int8_peak_thread(int64_t iterations) {
  Isa::I acc[kPeakChains];
  for (int c = 0; c < kPeakChains; ++c) acc[c] = Isa::set32(&c);  // unequal, so no two chains merge
  const int8_t quad[4] = {1, 2, 3, 4};
  const Isa::I u = Isa::broadcast(quad), x = Isa::broadcast(quad);
  for (int64_t i = 0; i < iterations; ++i)
    for (auto& a : acc) a = Isa::peak_step(a, u, x);
  alignas(64) int32_t lanes[sizeof(Isa::I) / 4];
  int64_t sink = 0;
  for (auto& a : acc) {
    std::memcpy(lanes, &a, sizeof(a));
    sink += lanes[0];
  }
  asm volatile("" : : "r"(sink));
  return iterations * kPeakChains * static_cast<int64_t>(sizeof(Isa::I));
}
#endif

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;
using pagedllm::QuantWeight;

// The integer kernels' peak on this machine: every thread of the pool runs `iterations` rounds of
// the multiply-add they are built on (VNNI's vpdpbusd, else vpmaddubsw with vpaddw), from
// registers.  Returns the multiply-adds done by all threads, to be divided by the call's wall time
// (benchmarks/quantized_linear.py); 0 where the build has no AVX2 (plain C++, no peak to speak of).
PAGEDLLM_API int64_t int8_multiply_add_peak(int64_t iterations) {
#if defined(__AVX2__)
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  total += pagedllm::int8_peak_thread(iterations);
  return total;
#else
  (void)iterations;
  return 0;
#endif
}

// The layout's parameters for this build: columns per panel, and whether 8-bit values are
// stored as q + 128 (with zero point 128).
PAGEDLLM_API int64_t quant_panel_width() { return pagedllm::kPanel; }
PAGEDLLM_API int64_t quant_unsigned8() { return pagedllm::kUnsigned8 ? 1 : 0; }
// The activations' quantization span before a K type of super-groups of 256 (quant_gemm).
PAGEDLLM_API int64_t quant_k_activation_span() { return pagedllm::k_activation_span(256); }

// y[r * ldy + j] = row r of x [m, w.cols] times column j < w.rows of the weight.
PAGEDLLM_API void quant_gemm_f32(const float* x, float* y, int64_t m, int64_t ldy, const QuantWeight* w) {
  pagedllm::quant_gemm_any(x, y, m, ldy, *w);
}
PAGEDLLM_API void quant_gemm_bf16(const bf16* x, bf16* y, int64_t m, int64_t ldy, const QuantWeight* w) {
  pagedllm::quant_gemm_any(x, y, m, ldy, *w);
}
// Rows `ids` (int64 [count]) of the weight as floats, to `out` [count, cols]; with ids null, the
// whole weight transposed to out [cols, count] (count >= rows: the row stride, for a fused
// projection's parts side by side).
PAGEDLLM_API void dequantize_rows_f32(const QuantWeight* w, const int64_t* ids, int64_t count, float* out) {
  pagedllm::dequantize_any(*w, ids, count, out);
}
PAGEDLLM_API void dequantize_rows_bf16(const QuantWeight* w, const int64_t* ids, int64_t count, bf16* out) {
  pagedllm::dequantize_any(*w, ids, count, out);
}
