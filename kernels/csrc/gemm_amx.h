// AMX bf16 tile passes of the blocked GEMM (gemm_amx.cpp), for gemv.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace deepinfer {

// The CPU has AMX-TILE and AMX-BF16 and this process may use them (asked of Linux once).
bool amx_bf16_usable();
// Tile configuration is per thread: every task that calls amx_tile_pair loads it first and releases it after.
void amx_configure_thread();
void amx_release_thread();
// acc [16 * row_blocks][32] fp32 (row stride 32) = x's 16 * row_blocks rows (row stride ldx; rows past the
// caller's are zeros) times bf16 blocked weight tiles w0 (columns 0-15) and w1 (16-31); in a multiple of 32.
void amx_tile_pair(const c10::BFloat16* x, int64_t ldx, int row_blocks, const c10::BFloat16* w0,
                   const c10::BFloat16* w1, int64_t in, float* acc);

}  // namespace deepinfer
