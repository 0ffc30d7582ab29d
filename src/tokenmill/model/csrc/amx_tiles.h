#pragma once
// What every AMX kernel needs before its first tile: whether the compiler knows the intrinsics, the
// target attribute its functions carry, whether this process may run tiles (amx_ready), and the
// `ldtilecfg` operand. The quantized linear (quant_amx.h) and the prompt attention
// (prompt_flash_amx.h) share it.

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "cpu_isa_cap.h"

// Compilers that know AMX's intrinsics (GCC 11, clang 12 on). Built with another, the tiles are never
// ready (amx_ready) and the vector kernels run every step.
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define TM_AMX_COMPILES 1
#else
#define TM_AMX_COMPILES 0
#endif

#define TA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,f16c,fma,amx-tile,amx-bf16")))
#define TA_INLINE inline __attribute__((always_inline))

namespace tm_amx {

// Whether this process may run AMX-BF16 tiles: the CPU has them, TOKENMILL_CPU_ISA allows them, and
// the kernel granted the tile data state.
inline bool amx_ready() {
#if TM_AMX_COMPILES
  static const bool yes = [] {
    __builtin_cpu_init();
    if (!tm_isa::allows(tm_isa::kCapAmx) || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni"))
      return false;
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return yes;
#else
  return false;
#endif
}

// The first 64-byte boundary at or after p: where tile operands start in a scratch allocated 16
// floats longer than they need (a tile load's rows are 64-byte lines).
inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// A tile configuration (the `ldtilecfg` operand): palette 1, tile i of rows[i] x colsb[i] bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows x 64 bytes (the prompt attention's C, A and B; the AMX-INT8 linear's). A static
// object: GCC's `_tile_loadconfig` tells the compiler it reads 8 bytes, so stores to a local
// configuration past those may be dropped as dead.
inline const TileConfig& full_tiles() {
  static const TileConfig config = [] {
    TileConfig c{};
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  return config;
}

}  // namespace tm_amx
