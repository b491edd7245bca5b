// AMX tile registers for patchbay's kernels: the process's permission to use them and one configuration for
// all eight (included where the compiler targets AMX, __AMX_TILE__).
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

// AMX: eight tile registers of up to 16 rows by 64 bytes, loaded and stored with a row stride, and a tile
// product (bfloat16 pairs or bytes) summing into float32 or int32 tiles.  Every kernel configures all eight
// as 16 rows of 64 bytes, once per chunk of work (the configuration belongs to the thread), and releases them
// after, so a thread that later runs no AMX saves no tile state when the kernel switches it out.
constexpr int64_t kAmxRows = 16;

// Linux hands a process AMX's tile data only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, feature XTILEDATA).
static bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

static void configure_amx_tiles() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kAmxRows;
    config.bytes_per_row[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, so the stores above may be
  // dropped as dead (a change that inlined this into a lambda had ldtilecfg read garbage and fault); an empty asm
  // that takes the address and clobbers memory keeps them.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
