// A quantized weight's values into the kernels' panel layout (quant_gemm.cpp's header), at load.
//
// The input is pagedllm/layers/quantized.py's QuantizedWeight.qs, row by row in blocks of 32
// values: 4-bit, 16 bytes (byte i: value i in the low nibble, value i + 16 in the high one);
// 5-, 6- and 8-bit, a byte a value.  `pack` in quantized.py does the same in torch, which
// spends seconds on a 1B file's tensors (widening every value to a byte and permuting them);
// here each panel's block is written once, panels shared between the threads.
#include <omp.h>

#include <cstdint>
#include <cstring>

#include "quant_layout.h"

namespace {

// Row `row`'s 32 values of block b as bytes (8-bit: flipped to q + 128 where `flip`).
inline void block_values(const uint8_t* qs, int64_t row, int64_t b, int64_t blocks, int64_t bits, bool flip,
                         uint8_t* v) {
  if (bits == 4) {
    const uint8_t* in = qs + (row * blocks + b) * 16;
    for (int i = 0; i < 16; ++i) {
      v[i] = in[i] & 0x0F;
      v[i + 16] = in[i] >> 4;
    }
    return;
  }
  std::memcpy(v, qs + (row * blocks + b) * 32, 32);
  if (bits == 8 && flip)
    for (int j = 0; j < 32; ++j) v[j] ^= 0x80;  // q + 128 for a signed byte q
}

}  // namespace

// qs [rows, cols / 32 * (16 for 4-bit, else 32)] -> out [ceil(rows / kPanel), cols / 32 *
// block_bytes(bits)]; rows past the last are zero bytes.  flip8: 8-bit values stored as q + 128.
PAGEDLLM_API void quant_pack_values(const uint8_t* qs, uint8_t* out, int64_t rows, int64_t cols, int64_t bits,
                                    int64_t flip8) {
  constexpr int64_t panel = pagedllm::kPanel;
  const int64_t blocks = cols / 32, panels = (rows + panel - 1) / panel;
  const int64_t per_block = pagedllm::block_bytes(bits);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t v[32];
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* blk = out + (p * blocks + b) * per_block;
      std::memset(blk, 0, per_block);
      for (int64_t c = 0; c < panel && p * panel + c < rows; ++c) {
        block_values(qs, p * panel + c, b, blocks, bits, flip8 != 0, v);
        if (bits == 8) {
          for (int quad = 0; quad < 8; ++quad)
            for (int i = 0; i < 4; ++i) blk[(quad * panel + c) * 4 + i] = v[4 * quad + i];
          continue;
        }
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i)
            blk[(j * panel + c) * 4 + i] = (v[4 * j + i] & 0x0F) | ((v[4 * (j + 4) + i] & 0x0F) << 4);
        for (int i = 0; i < 4; ++i) {
          if (bits == 5) {  // bit j: the fifth bit of value 4j + i
            uint8_t fifth = 0;
            for (int j = 0; j < 8; ++j) fifth |= ((v[4 * j + i] >> 4) & 1) << j;
            blk[16 * panel + c * 4 + i] = fifth;
          } else if (bits == 6) {  // plane h, bits 2j, 2j + 1: value 4(4h + j) + i's top pair
            for (int h = 0; h < 2; ++h) {
              uint8_t pairs = 0;
              for (int j = 0; j < 4; ++j) pairs |= ((v[4 * (4 * h + j) + i] >> 4) & 3) << (2 * j);
              blk[(16 + 4 * h) * panel + c * 4 + i] = pairs;
            }
          }
        }
      }
    }
  }
}
