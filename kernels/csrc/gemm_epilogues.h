// The blocked GEMM's epilogues (gemv.cpp): a pass's fp32 sums, acc rows kAccStride floats apart (two 16-column
// tiles), into the output, with what the op fuses after the product.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "attention_math.h"

namespace deepinfer::gemm_epilogues {

constexpr int64_t kTile = 16;        // output columns per tile
constexpr int64_t kAccStride = 32;   // floats per acc row: two tiles

// One pass's sums (+ bias) into y's rows [row0, row0 + rows) and columns [col0, col0 + cols), each rounded to
// Round first (fp32 logits of a bf16 model hold the bf16 values, as y.float() would).
template <typename Out, typename Round = Out>
void store_block(const float* acc, const float* bias, Out* y, int64_t out, int64_t row0, int rows, int64_t col0,
                 int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const float* a = acc + r * kAccStride;
    Out* dst = y + (row0 + r) * out + col0;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<Out>(static_cast<Round>(a[c] + bias[col0 + c]));
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<Out>(static_cast<Round>(a[c]));
    }
  }
}

// The same, plus the residual stream: y = (sums + bias, stored in Out) + residual, as the unfused pair of ops
// rounds it (a decoder layer's last projection and its residual add).
template <typename Out>
void store_add_block(const float* acc, const float* bias, const Out* residual, Out* y, int64_t out, int64_t row0,
                     int rows, int64_t col0, int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const float* a = acc + r * kAccStride;
    const int64_t offset = (row0 + r) * out + col0;
    for (int64_t c = 0; c < cols; ++c) {
      const Out sum = static_cast<Out>(bias != nullptr ? a[c] + bias[col0 + c] : a[c]);
      y[offset + c] = static_cast<Out>(static_cast<float>(sum) + static_cast<float>(residual[offset + c]));
    }
  }
}

// A (gate tile, up tile) pair's sums -> silu(gate) * up for its 16 columns of y [rows, inter], each product
// stored in Out first: the bits of gate_up stored, then fused_layer_ops.cpp's silu_and_mul.
template <typename Out>
void store_silu_block(const float* acc, Out* y, int64_t inter, int64_t row0, int rows, int64_t col0) {
  namespace am = deepinfer::attention_math;
  for (int r = 0; r < rows; ++r) {
    const float* gate = acc + r * kAccStride;
    const float* up = gate + kTile;
    Out* dst = y + (row0 + r) * inter + col0;
#ifdef __AVX512F__
    const __m512 g = am::stored16(_mm512_loadu_ps(gate), Out{}), u = am::stored16(_mm512_loadu_ps(up), Out{});
    am::store16(dst, _mm512_mul_ps(am::silu16(g, Out{}), u));
#else
    for (int64_t c = 0; c < kTile; ++c) {
      const float g = static_cast<float>(static_cast<Out>(gate[c])), u = static_cast<float>(static_cast<Out>(up[c]));
      const float act = static_cast<float>(static_cast<Out>(g / (1.f + am::exp_poly(-g > -87.3f ? -g : -87.3f))));
      dst[c] = static_cast<Out>(act * u);
    }
#endif
  }
}

}  // namespace deepinfer::gemm_epilogues
