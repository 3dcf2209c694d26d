// The blocked GEMM's micro-kernels (gemv.cpp): one pass of up to kMaxRows activation rows times up to kMaxTiles
// weight tiles into fp32 sums, per instruction set; each carries its target attribute, so one build holds every
// path whatever flags the file is compiled with, and gemv.cpp picks one from the CPU's flags at run time.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DEEPINFER_X86 1
#endif

namespace deepinfer::gemm_micro {

constexpr int64_t kTile = 16;  // output rows per tile
constexpr int kMaxTiles = 2;   // tiles per micro-kernel pass
constexpr int kMaxRows = 8;    // activation rows per micro-kernel pass

// Software prefetch into L2 this far ahead in a weight stream: the hardware prefetcher stops at 4 KiB pages, and
// the core's own L1 prefetch takes the lines on from L2. Zen 4, a decode step's GEMVs streamed from memory (same
// process, alternating): 0.90x (bf16) and 0.92x (fp32) the time of a prefetch into L1 1 KiB ahead, and 0.93-0.97x
// that of no software prefetch; 3 KiB ahead measured the same as 2.
constexpr int64_t kPrefetchBytes = 2048;

// Operand kinds: fp32 weights; bf16 weights with fp32 activations; bf16 weights with bf16 activations.
enum class Kind { kF32, kBf16W, kBf16WX };

// acc [kMaxRows][kMaxTiles * kTile] fp32: the micro-kernels write sums there; one epilogue adds bias and stores.
// prefetch: the AVX-512 passes prefetch, beside each weight line they read, the line this many bytes further on
// (their own stream ahead, or the next unit's tiles: gemv.cpp picks).
using MicroKernel = void (*)(const void* x, int64_t ldx, const void* w, int64_t tile_stride, int64_t in, float* acc,
                             int64_t prefetch);

// ---------------------------------------------------------------------------------------------- plain C++ ----
template <int R, int NT, Kind K>
void micro_scalar(const void* x_, int64_t ldx, const void* w_, int64_t tile_stride, int64_t in, float* acc,
                  int64_t /*prefetch*/) {
  for (int r = 0; r < R; ++r) std::fill(acc + r * kMaxTiles * kTile, acc + r * kMaxTiles * kTile + NT * kTile, 0.f);
  for (int t = 0; t < NT; ++t) {
    for (int64_t k = 0; k < in; ++k) {
      float wk[kTile];
      if constexpr (K == Kind::kF32) {
        const float* w = static_cast<const float*>(w_) + t * tile_stride + k * kTile;
        for (int c = 0; c < kTile; ++c) wk[c] = w[c];
      } else {
        const c10::BFloat16* w = static_cast<const c10::BFloat16*>(w_) + t * tile_stride + (k / 2) * 2 * kTile;
        for (int c = 0; c < kTile; ++c) wk[c] = static_cast<float>(w[2 * c + (k & 1)]);
      }
      for (int r = 0; r < R; ++r) {
        float xk;
        if constexpr (K == Kind::kBf16WX) {
          xk = static_cast<float>(static_cast<const c10::BFloat16*>(x_)[r * ldx + k]);
        } else {
          xk = static_cast<const float*>(x_)[r * ldx + k];
        }
        float* a = acc + r * kMaxTiles * kTile + t * kTile;
        for (int c = 0; c < kTile; ++c) a[c] += xk * wk[c];
      }
    }
  }
}

#ifdef DEEPINFER_X86
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")))
#define TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")))

// ------------------------------------------------------------------------------------------------- AVX2 ------
// A tile is two ymm halves per row; 4 rows x 2 halves = 8 accumulators (16 ymm registers in all).
template <int R, int NT, Kind K>
TARGET_AVX2 void micro_avx2(const void* x_, int64_t ldx, const void* w_, int64_t tile_stride, int64_t in,
                            float* acc, int64_t /*prefetch*/) {
  static_assert(NT == 1 && R <= 4, "AVX2 has 16 vector registers");
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* x = static_cast<const float*>(x_);
  if constexpr (K == Kind::kF32) {
    const float* w = static_cast<const float*>(w_);
    for (int64_t k = 0; k < in; ++k, w += kTile) {
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
        lo[r] = _mm256_fmadd_ps(w0, xk, lo[r]);
        hi[r] = _mm256_fmadd_ps(w1, xk, hi[r]);
      }
    }
  } else {  // bf16 pairs: lane = (w[k] low half, w[k+1] high half); a shift or a mask makes each an fp32
    const __m256i high_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const uint16_t* w = static_cast<const uint16_t*>(w_);
    for (int64_t k = 0; k < in; k += 2, w += 2 * kTile) {
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kTile));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16));
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
        lo[r] = _mm256_fmadd_ps(e0, xk, lo[r]);
        hi[r] = _mm256_fmadd_ps(e1, xk, hi[r]);
      }
      if (k + 1 < in) {
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(p0, high_mask));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(p1, high_mask));
        for (int r = 0; r < R; ++r) {
          const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k + 1);
          lo[r] = _mm256_fmadd_ps(o0, xk, lo[r]);
          hi[r] = _mm256_fmadd_ps(o1, xk, hi[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kMaxTiles * kTile, lo[r]);
    _mm256_storeu_ps(acc + r * kMaxTiles * kTile + 8, hi[r]);
  }
}

// ----------------------------------------------------------------------------------------------- AVX-512 -----
// Into L2: the line ``ahead`` bytes past ``line``.
inline void prefetch_weight(const void* line, int64_t ahead) {
  _mm_prefetch(static_cast<const char*>(line) + ahead, _MM_HINT_T1);
}

template <int R, int NT, Kind K>
TARGET_AVX512 void micro_avx512(const void* x_, int64_t ldx, const void* w_, int64_t tile_stride, int64_t in,
                                float* acc, int64_t prefetch) {
  static_assert(K != Kind::kBf16WX, "bf16 activations take micro_avx512_bf16 or are widened first");
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_setzero_ps();
  const float* x = static_cast<const float*>(x_);
  if constexpr (K == Kind::kF32) {
    const float* w = static_cast<const float*>(w_);
    for (int64_t k = 0; k < in; ++k, w += kTile) {
      __m512 wv[NT];
      for (int t = 0; t < NT; ++t) {
        prefetch_weight(w + t * tile_stride, prefetch);
        wv[t] = _mm512_loadu_ps(w + t * tile_stride);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
        for (int t = 0; t < NT; ++t) a[r][t] = _mm512_fmadd_ps(wv[t], xk, a[r][t]);
      }
    }
  } else {
    const __m512i high_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const uint16_t* w = static_cast<const uint16_t*>(w_);
    for (int64_t k = 0; k < in; k += 2, w += 2 * kTile) {
      __m512i pv[NT];
      for (int t = 0; t < NT; ++t) {
        prefetch_weight(w + t * tile_stride, prefetch);
        pv[t] = _mm512_loadu_si512(w + t * tile_stride);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
        for (int t = 0; t < NT; ++t)
          a[r][t] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(pv[t], 16)), xk, a[r][t]);
      }
      if (k + 1 < in) {
        for (int r = 0; r < R; ++r) {
          const __m512 xk = _mm512_set1_ps(x[r * ldx + k + 1]);
          for (int t = 0; t < NT; ++t)
            a[r][t] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(pv[t], high_mask)), xk, a[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + r * kMaxTiles * kTile + t * kTile, a[r][t]);
}

// bf16 x bf16: the activation pair (x[k], x[k+1]) is one 32-bit broadcast; vdpbf16ps adds both products.
template <int R, int NT, Kind K>
TARGET_AVX512BF16 void micro_avx512_bf16(const void* x_, int64_t ldx, const void* w_, int64_t tile_stride,
                                         int64_t in, float* acc, int64_t prefetch) {
  static_assert(K == Kind::kBf16WX, "vdpbf16ps needs bf16 on both sides");
  __m512 a[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) a[r][t] = _mm512_setzero_ps();
  const uint16_t* x = static_cast<const uint16_t*>(x_);
  const uint16_t* w = static_cast<const uint16_t*>(w_);
  const int64_t full_pairs = in / 2;
  for (int64_t p = 0; p < full_pairs; ++p, w += 2 * kTile) {
    __m512i pv[NT];
    for (int t = 0; t < NT; ++t) {
      prefetch_weight(w + t * tile_stride, prefetch);
      pv[t] = _mm512_loadu_si512(w + t * tile_stride);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < NT; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], (__m512bh)pv[t], xk);
    }
  }
  if (in % 2) {  // the last pair's second weight is zero padding; its activation lies past the row: use zero
    for (int r = 0; r < R; ++r) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[r * ldx + in - 1]));
      for (int t = 0; t < NT; ++t)
        a[r][t] = _mm512_dpbf16_ps(a[r][t], (__m512bh)_mm512_loadu_si512(w + t * tile_stride), xk);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + r * kMaxTiles * kTile + t * kTile, a[r][t]);
}

#endif  // DEEPINFER_X86

}  // namespace deepinfer::gemm_micro
