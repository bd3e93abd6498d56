// Many-row steps on weights kept quantized, in bfloat16: what runs above the integer kernels'
// row limit (pagedllm/layers/quantized.py picks per step).
//
// `quant_amx_gemm` (17 to a few hundred rows, CPUs with AMX-BF16): each thread takes
// kChunkPanels panels of the weight (the panel layout of quant_gemm.cpp), dequantizes them into a
// buffer laid out as AMX B tiles (per block of 32 k values, 16 rows of 16 columns x 2 consecutive
// k values), and multiplies the rows of x against it with `tdpbf16ps`, 32 rows x 32 columns per
// pass, float32 accumulation.  The dequantized chunk (32 columns x k) stays in the thread's
// cache: the step reads the quantized bytes and writes no dense copy of the weight.  A thread
// takes consecutive chunks and overlaps three of them: while the tile unit multiplies one, the
// vector units dequantize the next into a second buffer a block at a time between the
// multiply's tile instructions (ChunkDequantizer), and the thread asks for the one after's
// quantized bytes a few lines per block (Ahead).  Without Ahead a chunk's reads waited until
// its dequantization began, and the kernel took 1.2-1.4x as long at 48-96 rows.  Overlapping
// the dequantization with the multiply took a pass over Gemma 3's projections and LM head from
// 40.1 to 29.0 ms at 40 rows and from 82.4 to 61.7 at 112, SmolLM2's to 0.87-0.96x its time at
// 17-224 rows (2-core Xeon with AMX; benchmarks/quantized_linear.py).  The products are the
// same bits either way.
//
// `dequantize_blocked` (more rows, AVX512-BF16): the whole weight dequantized into the blocked
// layout oneDNN packs a bfloat16 linear weight in, so that oneDNN's GEMM (faster than the tile
// kernel above, measured) runs on it as on the dequantized model's packed weight.
//
// Values are dequantized as scale * u + (min - zero * scale) in float32, then rounded to bfloat16
// (nearest even), as the dequantized model's weights are.  Built where the compiler targets
// AVX512-BF16 (and AMX-BF16 for the tiles, -march=native on such a CPU); elsewhere the
// `*_available()` functions return 0 and callers take the other paths.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "common.h"
#include "quant_layout.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLLM_BF16_PAIRS 1
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

#if defined(PAGEDLLM_BF16_PAIRS)
constexpr int64_t kTileElems = 512;  // bfloat16 values in one B tile: 16 rows of 64 bytes

// A quad's 64 bytes (byte 4c + i: column c's value at k = 4j + i) to two B tile rows: `even`
// holds k = 4j, 4j + 1 of each column, `odd` 4j + 2, 4j + 3.  scale[t] and bias[t] hold columns
// 4t..4t + 3 four times each, matching 16 bytes of the quad.
template <bool Signed>
inline void quad_to_rows(const __m128i (&b)[4], const __m512* scale, const __m512* bias, uint16_t* even,
                         uint16_t* odd) {
  __m512 f[4];
  for (int t = 0; t < 4; ++t) {
    const __m512i w = Signed ? _mm512_cvtepi8_epi32(b[t]) : _mm512_cvtepu8_epi32(b[t]);
    f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w), scale[t], bias[t]);
  }
  // As 32-bit pairs, lo's pair d is column d / 2's (k0 k1) for even d, (k2 k3) for odd d; hi's
  // the same for columns 8 + d / 2.
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
  const __m512i even_pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_pairs = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  _mm512_storeu_si512(even, _mm512_permutex2var_epi32(lo, even_pairs, hi));
  _mm512_storeu_si512(odd, _mm512_permutex2var_epi32(lo, odd_pairs, hi));
}

// A quad held in a register (4- and 5-bit values, unpacked from their nibbles), a quarter at a time.
template <bool Signed>
inline void quad_to_rows(__m512i q, const __m512* scale, const __m512* bias, uint16_t* even, uint16_t* odd) {
  const __m128i b[4] = {_mm512_extracti32x4_epi32(q, 0), _mm512_extracti32x4_epi32(q, 1),
                        _mm512_extracti32x4_epi32(q, 2), _mm512_extracti32x4_epi32(q, 3)};
  quad_to_rows<Signed>(b, scale, bias, even, odd);
}

// A quad of 8-bit values read a quarter at a time straight from memory: each widening then
// takes its bytes from a load rather than from an extract, which shares the shuffle port with
// the widening (alone on one core, in cache, 0.064 against 0.071 ns a weight; Gemma 3's head,
// all 8-bit, did not move measurably with it: its time goes elsewhere, see multiply_chunk).
template <bool Signed>
inline void quad_to_rows(const uint8_t* quad, const __m512* scale, const __m512* bias, uint16_t* even, uint16_t* odd) {
  const __m128i* p = reinterpret_cast<const __m128i*>(quad);
  const __m128i b[4] = {_mm_loadu_si128(p), _mm_loadu_si128(p + 1), _mm_loadu_si128(p + 2), _mm_loadu_si128(p + 3)};
  quad_to_rows<Signed>(b, scale, bias, even, odd);
}

// Group g's 16 scales (mins) as floats: the super-group's float16 times the group's int8.
inline __m512 scale_vector(const PanelScales& s, int64_t g) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.scales + s.super_at(g))));
  if (s.sub_scales == nullptr) return v;
  const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.sub_scales + g * kPanel));
  return _mm512_mul_ps(v, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
}
inline __m512 min_vector(const PanelScales& s, int64_t g) {
  if (s.mins == nullptr) return _mm512_setzero_ps();
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.mins + s.super_at(g))));
  if (s.sub_mins == nullptr) return v;
  const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.sub_mins + g * kPanel));
  return _mm512_mul_ps(v, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
}

// A group's 16 scales and biases spread so that lane l of vector t is column 4t + l / 4's.
inline void spread(__m512 sv, __m512 mv, int32_t zero, __m512* scale, __m512* bias) {
  const __m512 bv = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(zero)), sv, mv);
  const __m512i base = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int t = 0; t < 4; ++t) {
    const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(4 * t));
    scale[t] = _mm512_permutexvar_ps(idx, sv);
    bias[t] = _mm512_permutexvar_ps(idx, bv);
  }
}

// Block b of panel p of the weight in pairs of k values: 16 rows of 16 columns x 2 (k = 2i,
// 2i + 1 in row i), rows row_stride values apart from `rows`.
template <int Bits, int Group>
void dequantize_block(const QuantWeight& w, int64_t p, int64_t b, uint16_t* rows, int64_t row_stride) {
  constexpr bool kSigned = Bits == 8 && !kUnsigned8;
  const uint8_t* blk = w.qs + (p * (w.cols / kBlock) + b) * block_bytes(Bits);
  const PanelScales ps(w, p);
  const int32_t zero = static_cast<int32_t>(w.zero);
  __m512 scale[2][4], bias[2][4];  // [the block's group][spread]
  for (int h = 0; h < (Group == 16 ? 2 : 1); ++h) {
    const int64_t g = Group == 16 ? 2 * b + h : b;
    spread(scale_vector(ps, g), min_vector(ps, g), zero, scale[h], bias[h]);
  }
  if constexpr (Bits == 8) {
    for (int j = 0; j < 8; ++j) {
      const int h = Group == 16 && j >= 4 ? 1 : 0;
      quad_to_rows<kSigned>(blk + j * 64, scale[h], bias[h], rows + 2 * j * row_stride,
                            rows + (2 * j + 1) * row_stride);
    }
  } else {
    constexpr int kHigh = Group == 16 ? 1 : 0;  // the group of quads 4..7
    const __m512i nibble = _mm512_set1_epi8(0x0F), fifth_bit = _mm512_set1_epi8(0x10), pair = _mm512_set1_epi8(0x30);
    const __m512i extra0 = Bits == 4 ? _mm512_setzero_si512() : _mm512_loadu_si512(blk + 256);
    const __m512i extra1 = Bits == 6 ? _mm512_loadu_si512(blk + 320) : _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(blk + j * 64);
      __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      if constexpr (Bits == 5) {  // bit j (j + 4) of each byte of extra0 is the fifth bit of quad j (j + 4)
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(extra0, 4 - j), fifth_bit));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(extra0, j), fifth_bit));
      }
      if constexpr (Bits == 6) {  // bits 2j, 2j + 1 of extra0 (extra1): quad j's (j + 4's) high pair
        const auto to_pair = [&](__m512i plane) {
          const __m512i shifted = j < 2 ? _mm512_slli_epi16(plane, 4 - 2 * j) : _mm512_srli_epi16(plane, 2 * j - 4);
          return _mm512_and_si512(shifted, pair);
        };
        lo = _mm512_or_si512(lo, to_pair(extra0));
        hi = _mm512_or_si512(hi, to_pair(extra1));
      }
      quad_to_rows<false>(lo, scale[0], bias[0], rows + 2 * j * row_stride, rows + (2 * j + 1) * row_stride);
      quad_to_rows<false>(hi, scale[kHigh], bias[kHigh], rows + (2 * j + 8) * row_stride,
                          rows + (2 * j + 9) * row_stride);
    }
  }
}

// Panel p of the weight: block b at dst + b * block_stride (dequantize_block's layout).
template <int Bits, int Group>
void dequantize_panel(const QuantWeight& w, int64_t p, uint16_t* dst, int64_t block_stride, int64_t row_stride) {
  for (int64_t b = 0; b < w.cols / kBlock; ++b)
    dequantize_block<Bits, Group>(w, p, b, dst + b * block_stride, row_stride);
}

// The whole weight [n, k] in oneDNN's blocked bfloat16 layout for a linear's weight (AB16b32a2b:
// blocks of 32 output columns x 32 k, outer order column block then k block, inside [k pairs 16]
// [columns 32][2]), which torch's packed linear reads.  n is a multiple of 32.
template <int Bits, int Group>
void dequantize_blocked(const QuantWeight& w, uint16_t* out) {
  const int64_t blocks = w.cols / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < w.rows / kPanel; ++p)
    dequantize_panel<Bits, Group>(w, p, out + (p / 2 * blocks) * 1024 + (p % 2) * 32, 1024, 64);
}

// Panels p0 .. p0 + np of the weight as B tiles in buf (block b's panels side by side), one
// (panel, block) at a time: `step` dequantizes the next few, so that a chunk's dequantization
// can be spread over the multiply of the chunk before it.
template <int Bits, int Group>
struct ChunkDequantizer {
  const QuantWeight* w = nullptr;
  int64_t p0 = 0, np = 0;
  uint16_t* buf = nullptr;
  int64_t done = 0, per = 0;

  int64_t total() const { return w == nullptr ? 0 : np * (w->cols / kBlock); }
  // Spread the chunk over `iterations` calls of step().
  void spread(int64_t iterations) { per = (total() + iterations - 1) / std::max<int64_t>(1, iterations); }
  void step() {
    if (w == nullptr) return;
    const int64_t blocks = w->cols / kBlock;
    for (int64_t j = 0; j < per && done < total(); ++j, ++done) {
      const int64_t p = done / blocks, b = done % blocks;
      dequantize_block<Bits, Group>(*w, p0 + p, b, buf + (b * np + p) * kTileElems, 32);
    }
  }
  void finish() {
    per = total();
    step();
  }
};
#endif

#if defined(PAGEDLLM_AMX)
constexpr int64_t kChunkPanels = 2;  // panels (of kPanel = 16 columns) one thread dequantizes at a time
constexpr int64_t kRowBlock = 512;   // rows of x multiplied per dequantized chunk (a multiple of 32)
constexpr int64_t kStepBlocks = 16;  // blocks of k per step of multiply_chunk: 2 panels' B tiles, 32 KB
constexpr int64_t kStreamOutputBytes = int64_t{4} << 20;  // twice a core's L2 on the Xeons with AMX

// Memory a chunk's multiply asks for (into L2, prefetcht1) while the tile unit works: the next
// chunk's quantized values, scales, sub-scales, mins and sub-mins, spread evenly over the
// multiply's blocks of k.
struct Ahead {
  static constexpr int kRanges = 5;
  const char* start[kRanges] = {};
  int64_t lines[kRanges] = {};

  struct Cursor {
    const Ahead* ahead;
    int64_t per, range = 0, line = 0;
    // Asks for the next `count` lines.
    void ask_some(int64_t count) {
      for (int64_t j = 0; j < count && range < kRanges; ++j) {
        while (range < kRanges && line >= ahead->lines[range]) ++range, line = 0;
        if (range == kRanges) return;
        __builtin_prefetch(ahead->start[range] + 64 * line++, 0, 2);
      }
    }
  };
  // A cursor for `iterations` blocks: `per` lines a block cover every line.
  Cursor spread(int64_t iterations) const {
    int64_t total = 0;
    for (int64_t n : lines) total += n;
    return Cursor{this, (total + iterations - 1) / std::max<int64_t>(1, iterations)};
  }
  void add(int i, const void* from, int64_t bytes) {
    if (from == nullptr) return;
    start[i] = static_cast<const char*>(from);
    lines[i] = (bytes + 63) / 64;
  }
};

// Panels p0 .. p0 + np of the weight, as ranges of whole cache lines.
template <int Bits>
Ahead chunk_weight(const QuantWeight& w, int64_t p0, int64_t np) {
  const int64_t blocks = w.cols / kBlock, groups = w.cols / w.group, supers = w.cols / w.super_group;
  Ahead a;
  a.add(0, w.qs + p0 * blocks * block_bytes(Bits), np * blocks * block_bytes(Bits));
  a.add(1, w.scales + p0 * supers * kPanel, np * supers * kPanel * 2);
  if (w.sub_scales != nullptr) a.add(2, w.sub_scales + p0 * groups * kPanel, np * groups * kPanel);
  if (w.mins != nullptr) a.add(3, w.mins + p0 * supers * kPanel, np * supers * kPanel * 2);
  if (w.sub_mins != nullptr) a.add(4, w.sub_mins + p0 * groups * kPanel, np * groups * kPanel);
  return a;
}

// Rows r0..r0 + rows of x [.., k] as A tiles: a [rows / 16 rounded up][k / 32][16 x 32], each tile's
// 1 KB contiguous, rows past the end zero.
void pack_rows(const bf16* x, int64_t rows, int64_t k, uint16_t* a) {
  const int64_t blocks = k / kBlock, tiles = (rows + 15) / 16;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t row = 16 * t + r;
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t* dst = a + ((t * blocks + b) * 16 + r) * kBlock;
        if (row < rows) {
          std::memcpy(dst, x + row * k + b * kBlock, kBlock * sizeof(bf16));
        } else {
          std::memset(dst, 0, kBlock * sizeof(bf16));
        }
      }
    }
  }
}

// y[r][c] for rows r < m (A tiles in a, from pack_rows) and the chunk's columns c < cols (at
// most 32: one or two panels), from the B tiles in buf.  k is walked in steps of kStepBlocks
// blocks, each step over every 32-row pass: the step's B tiles (32 KB) stay in L1 while the
// passes' A tiles stream from L2, so each tile load but the first pass's hits L1.  (Walking
// all of k per pass read both operands from L2, one tile load per `tdpbf16ps`, which the L2
// cannot feed at the tile unit's rate.)  The 32 x 32 float accumulators of each pass wait in
// `acc` [rows rounded up to 32][32] between steps.  `stream`: y's rows are written with
// streaming stores where they fill whole cache lines (see amx_gemm).
template <typename Dequantizer>
void multiply_chunk(const uint16_t* a, int64_t m, int64_t k, const uint16_t* buf, int64_t np, int64_t cols, bf16* y,
                    int64_t ldy, float* acc, const Ahead& ahead, Dequantizer& following, bool stream) {
  const int64_t blocks = k / kBlock;
  const bool two = np > 1;
  constexpr int64_t ldc = 32 * sizeof(float);
  Ahead::Cursor next = ahead.spread(((m + 31) / 32) * blocks);
  following.spread(((m + 31) / 32) * blocks);
  for (int64_t b0 = 0; b0 < blocks; b0 += kStepBlocks) {
    const int64_t b1 = std::min(blocks, b0 + kStepBlocks);
    for (int64_t r0 = 0; r0 < m; r0 += 32) {
      const uint16_t* upper = a + (r0 / 16) * blocks * kTileElems;
      const uint16_t* lower_tiles = upper + blocks * kTileElems;
      const bool lower = m - r0 > 16;  // a last pass of at most 16 rows leaves the lower A tile out
      float* c = acc + r0 * 32;
      if (b0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, c, ldc);
        _tile_loadd(1, c + 16, ldc);
        _tile_loadd(2, c + 16 * 32, ldc);
        _tile_loadd(3, c + 16 * 32 + 16, ldc);
      }
      // Each block's share of the asks goes out in quarters between its dequantization and
      // tile instructions: asked all at once, they queued behind each other and stalled the
      // thread (Gemma 3's head at 64-112 rows 6-23% slower, SmolLM2's projections ~5%).
      const int64_t quarter = next.per / 4;
      for (int64_t b = b0; b < b1; ++b) {
        next.ask_some(quarter);
        following.step();
        next.ask_some(quarter);
        _tile_loadd(4, upper + b * kTileElems, 64);
        _tile_loadd(6, buf + (b * np) * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        next.ask_some(quarter);
        if (two) {
          _tile_loadd(7, buf + (b * np + 1) * kTileElems, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (lower) {
          _tile_loadd(5, lower_tiles + b * kTileElems, 64);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
        next.ask_some(next.per - 3 * quarter);
      }
      _tile_stored(0, c, ldc);
      _tile_stored(1, c + 16, ldc);
      _tile_stored(2, c + 16 * 32, ldc);
      _tile_stored(3, c + 16 * 32 + 16, ldc);
    }
  }
  const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  // A whole chunk's rows that fill whole cache lines go around the cache when the output is large.
  const bool around = stream && cols == 32 && reinterpret_cast<uintptr_t>(y) % 64 == 0 && ldy % 32 == 0;
  for (int64_t r = 0; r < m; ++r) {
    const __m512i out = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(acc + r * 32 + 16), _mm512_loadu_ps(acc + r * 32));
    if (around) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(y + r * ldy), out);
    } else {
      _mm512_mask_storeu_epi16(y + r * ldy, mask, out);
    }
  }
}

template <int Bits, int Group>
void amx_gemm(const bf16* x, bf16* y, int64_t m, int64_t ldy, const QuantWeight& w) {
  const int64_t n = w.rows, k = w.cols;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t chunks = (panels + kChunkPanels - 1) / kChunkPanels;
  // Rows in blocks of kRowBlock, each chunk dequantized again per block, so that a block of x
  // stays in L2 beside the chunk rather than streaming from L3 once per chunk.
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  std::vector<uint16_t> a((std::min(m, kRowBlock) + 31) / 32 * 32 * k);
  // An output larger than kStreamOutputBytes (an LM head's, of many rows) is written around
  // the cache (streaming stores, whole lines), since it cannot stay there anyway: written
  // through it, each line was first read from memory and evicted what the step reads next.
  const bool stream = m * n * static_cast<int64_t>(sizeof(bf16)) >= kStreamOutputBytes;
#pragma omp parallel
  {
    configure_tiles();
    static thread_local std::vector<uint16_t> buf;  // two chunks' B tiles: one multiplied, the next filled
    static thread_local std::vector<float> acc;
    const size_t half = static_cast<size_t>(k / kBlock * kChunkPanels * kTileElems);
    if (buf.size() < 2 * half) buf.resize(2 * half);
    const size_t acc_need = static_cast<size_t>((std::min(m, kRowBlock) + 31) / 32 * 32 * 32);
    if (acc.size() < acc_need) acc.resize(acc_need);
    // This thread's chunks, consecutive, so that each one's multiply can dequantize the next.
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t first = chunks * thread / threads, last = chunks * (thread + 1) / threads;
    auto panels_of = [&](int64_t chunk) { return std::min(kChunkPanels, panels - chunk * kChunkPanels); };
    auto dequantizer = [&](int64_t chunk, uint16_t* into) {
      ChunkDequantizer<Bits, Group> d;  // past this thread's chunks: nothing to do
      if (chunk < last) {
        d.w = &w;
        d.p0 = chunk * kChunkPanels, d.np = panels_of(chunk), d.buf = into;
      }
      return d;
    };
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t r0 = rb * kRowBlock, rows = std::min(kRowBlock, m - r0);
      pack_rows(x + r0 * k, rows, k, a.data());  // ends in the omp for's barrier
      if (first < last) dequantizer(first, buf.data()).finish();
      for (int64_t chunk = first; chunk < last; ++chunk) {
        uint16_t* current = buf.data() + ((chunk - first) % 2) * half;
        // The next chunk dequantized, and the one after asked for, while this one multiplies:
        // the vector units and the tile unit then work at once.
        auto following = dequantizer(chunk + 1, buf.data() + ((chunk - first + 1) % 2) * half);
        const Ahead ahead = chunk + 2 < last
                                ? chunk_weight<Bits>(w, (chunk + 2) * kChunkPanels, panels_of(chunk + 2))
                                : Ahead{};
        const int64_t p0 = chunk * kChunkPanels, np = panels_of(chunk);
        multiply_chunk(a.data(), rows, k, current, np, std::min(np * kPanel, n - p0 * kPanel),
                       y + r0 * ldy + p0 * kPanel, ldy, acc.data(), ahead, following, stream);
        following.finish();
      }
#pragma omp barrier  // every thread is done with `a` before the next row block packs it
    }
    if (stream) _mm_sfence();  // the streamed rows are visible before the caller reads them
    _tile_release();
  }
}
#endif

}  // namespace
}  // namespace pagedllm

using pagedllm::bf16;
using pagedllm::QuantWeight;

// 1 where this build has the AMX kernel and the OS let the process use the tiles.
PAGEDLLM_API int64_t quant_amx_available() {
#if defined(PAGEDLLM_AMX)
  return pagedllm::amx_granted() ? 1 : 0;
#else
  return 0;
#endif
}

// y[r * ldy + j] = row r of x [m, w.cols] times column j < w.rows of the panel-packed weight; a
// no-op where quant_amx_available() is 0.
PAGEDLLM_API void quant_amx_gemm_bf16(const bf16* x, bf16* y, int64_t m, int64_t ldy, const QuantWeight* w) {
#if defined(PAGEDLLM_AMX)
  if (!pagedllm::amx_granted()) return;
  if (w->bits == 4) return pagedllm::amx_gemm<4, 32>(x, y, m, ldy, *w);
  if (w->bits == 5) return pagedllm::amx_gemm<5, 32>(x, y, m, ldy, *w);
  if (w->bits == 6) return pagedllm::amx_gemm<6, 16>(x, y, m, ldy, *w);
  if (w->group == 16) return pagedllm::amx_gemm<8, 16>(x, y, m, ldy, *w);
  return pagedllm::amx_gemm<8, 32>(x, y, m, ldy, *w);
#else
  (void)x, (void)y, (void)m, (void)ldy, (void)w;
#endif
}

// 1 where this build can write oneDNN's blocked bfloat16 layout (AVX512-BF16).
PAGEDLLM_API int64_t dequantize_blocked_available() {
#if defined(PAGEDLLM_BF16_PAIRS)
  return 1;
#else
  return 0;
#endif
}

// The panel-packed weight (rows a multiple of 32) dequantized to bfloat16 in oneDNN's blocked
// layout at `out` (see dequantize_blocked); a no-op where dequantize_blocked_available() is 0.
PAGEDLLM_API void dequantize_blocked_bf16(const QuantWeight* w, bf16* out) {
#if defined(PAGEDLLM_BF16_PAIRS)
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  if (w->bits == 4) return pagedllm::dequantize_blocked<4, 32>(*w, o);
  if (w->bits == 5) return pagedllm::dequantize_blocked<5, 32>(*w, o);
  if (w->bits == 6) return pagedllm::dequantize_blocked<6, 16>(*w, o);
  if (w->group == 16) return pagedllm::dequantize_blocked<8, 16>(*w, o);
  return pagedllm::dequantize_blocked<8, 32>(*w, o);
#else
  (void)w, (void)out;
#endif
}
