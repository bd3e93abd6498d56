// AMX tile helpers shared by the kernels that use the tile unit (empty where the build has no
// AMX-BF16: PAGEDLLM_AMX is then undefined and callers take their other paths).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process AMX's tile state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asking again is harmless.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// All eight tiles as 16 rows of 64 bytes: C tiles of 16 x 16 float32, A tiles of 16 x 32
// bfloat16, B tiles of 16 pairs x 16 x 2 bfloat16.  Per thread, before its first tile instruction.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace pagedllm
#endif
