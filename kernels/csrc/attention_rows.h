// The per-chunk math of the host paged decode attention (paged_decode_attention.cpp): a chunk's scores and value
// sums for the query rows that share a KV head, portable and AVX-512, and the paced prefetch of the rows the next
// passes read. Its own header so that the kernel's file keeps to the request loop.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "attention_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace deepinfer::attention_rows {

using namespace deepinfer::attention_math;

// n values as fp32: float rows are read in place; bf16 rows are widened into ``scratch``.
inline const float* as_float(const float* src, float* /*scratch*/, int64_t /*n*/) { return src; }

inline const float* as_float(const c10::BFloat16* src, float* scratch, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(scratch + i, load16(src + i));
#endif
  for (; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}

inline const float* as_float(const Fp8E4M3* src, float* scratch, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(scratch + i, load16(src + i));
#endif
  for (; i < n; ++i) scratch[i] = fp8_to_float(src[i]);
  return scratch;
}

constexpr int64_t kChunk = 16;  // keys per step: one 16-lane vector of scores per query row

// Lines of up to two regions prefetched into L2 a slice per issue(), paced with the compute between the calls: one
// burst fills the core's miss buffers and stalls it, and memory then idles while it computes (Zen 4, SmolLM2 layer
// at batch 32: 1.2-1.3x fp32, 1.2x bf16 over prefetching each chunk at once).
struct PacedPrefetch {
  const char* first = nullptr;
  const char* second = nullptr;  // may be null
  int64_t lines = 0, slices = 1, issued = 0;
  void issue() {
    if (issued >= slices) return;
    const int64_t from = lines * issued / slices, to = lines * (issued + 1) / slices;
    ++issued;
    for (int64_t l = from; l < to; ++l) {
      __builtin_prefetch(first + 64 * l, 0, 2);
      if (second) __builtin_prefetch(second + 64 * l, 0, 2);
    }
  }
};

// The per-chunk math: ``count`` query rows that share a KV head (q rows and accumulators ``head_dim`` apart, their
// scores ``score_stride`` apart) against n <= kChunk key (value) rows ``stride`` elements apart. Sharing matters
// because a key or value vector loaded once then serves every row of the group: at SmolLM2's 3 query heads per KV
// head, a third of the loads, and three independent FMA chains where one row had one. The portable form is plain
// loops; AVX-512 has a form per head_dim / 16 below. Every row's sums run in the order a lone row's would.
struct PortableRows {
  int64_t head_dim;
  template <typename T>  // the chunk's rows as fp32: bf16 widened into scratch once for all its query rows
  static const float* chunk_rows(const T* chunk, float* scratch, int64_t n) { return as_float(chunk, scratch, n); }
  static constexpr int64_t kMaxRows = 1;
  template <typename T>  // chunk_rows widens to the values themselves
  static constexpr float unit() { return 1.f; }
  static constexpr int64_t kPrefetchSlices = 1;  // prefetch.issue() calls per scores() call
  void scores(const float* q, int64_t /*count*/, const float* keys, int64_t stride, int64_t n, float scale,
              float* out, int64_t /*score_stride*/, PacedPrefetch& prefetch) const {
    prefetch.issue();
    for (int64_t j = 0; j < n; ++j) out[j] = dot(q, keys + j * stride, head_dim) * scale;
  }
  void accumulate(float* acc, int64_t /*count*/, const float* probs, int64_t /*score_stride*/, const float* values,
                  int64_t stride, int64_t n) const {
    for (int64_t j = 0; j < n; ++j) {
      const float p = probs[j];
      const float* value = values + j * stride;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * value[d];
    }
  }
};

#ifdef __AVX512F__
template <int kVecs>  // head_dim = 16 * kVecs
struct Avx512Rows {
  // Rows served by one load (callers pass count <= kMaxRows): their q vectors, 4 partial sums each and one key's
  // vectors fit the 32 registers (3 x 4 + 3 x 4 + 4 at head_dim 64; the quads may spill to L1).
  static constexpr int64_t kMaxRows = kVecs <= 4 ? 3 : 1;
  static constexpr int64_t kPrefetchSlices = kChunk / 4;  // one before each four keys

  template <typename T>  // float, bf16 or e4m3 rows, widened in registers as they are loaded
  static const T* chunk_rows(const T* chunk, float* /*scratch*/, int64_t /*n*/) { return chunk; }
  // What a widened value is short of the cache's: e4m3 codes load as value * 2^-8 (load16_over256), so the
  // caller multiplies its score and output scales by this.
  template <typename T>
  static constexpr float unit() { return std::is_same_v<T, Fp8E4M3> ? 256.f : 1.f; }
  template <typename T>
  static __m512 widen16(const T* p) {
    if constexpr (std::is_same_v<T, Fp8E4M3>) {
      return load16_over256(p);
    } else {
      return load16(p);
    }
  }

  template <typename T>
  void scores(const float* q, int64_t count, const T* keys, int64_t stride, int64_t n, float scale, float* out,
              int64_t score_stride, PacedPrefetch& prefetch) const {
    if constexpr (kMaxRows >= 3) {
      if (count == 3) return scores_of<3, T>(q, keys, stride, n, scale, out, score_stride, prefetch);
    }
    if constexpr (kMaxRows >= 2) {
      if (count == 2) return scores_of<2, T>(q, keys, stride, n, scale, out, score_stride, prefetch);
    }
    scores_of<1, T>(q, keys, stride, n, scale, out, score_stride, prefetch);
  }
  template <typename T>
  void accumulate(float* acc, int64_t count, const float* probs, int64_t score_stride, const T* values,
                  int64_t stride, int64_t n) const {
    if constexpr (kMaxRows >= 3) {
      if (count == 3) return accumulate_of<3, T>(acc, probs, score_stride, values, stride, n);
    }
    if constexpr (kMaxRows >= 2) {
      if (count == 2) return accumulate_of<2, T>(acc, probs, score_stride, values, stride, n);
    }
    accumulate_of<1, T>(acc, probs, score_stride, values, stride, n);
  }

  template <int kRows, typename T>
  static void scores_of(const float* q, const T* keys, int64_t stride, int64_t n, float scale, float* out,
                        int64_t score_stride, PacedPrefetch& prefetch) {
    __m512 qv[kRows][kVecs];
    for (int g = 0; g < kRows; ++g) {
      for (int v = 0; v < kVecs; ++v) qv[g][v] = _mm512_loadu_ps(q + (g * kVecs + v) * 16);
    }
    __m512 quads[kRows][kChunk / 4];
    // Four keys at a time, each row's four partial sums folded into a quad at once (see sum_lanes4).
#pragma GCC unroll 4
    for (int c = 0; c < kChunk / 4; ++c) {
      prefetch.issue();
      __m512 partial[kRows][4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        // Lanes past n repeat key 0 (no branch, no read past the chunk); the masked store drops them.
        const T* key = keys + (4 * c + j < n ? 4 * c + j : 0) * stride;
        const __m512 k0 = widen16(key);
        for (int g = 0; g < kRows; ++g) partial[g][j] = _mm512_mul_ps(qv[g][0], k0);
        for (int v = 1; v < kVecs; ++v) {
          const __m512 kv = widen16(key + 16 * v);
          for (int g = 0; g < kRows; ++g) partial[g][j] = _mm512_fmadd_ps(qv[g][v], kv, partial[g][j]);
        }
      }
      for (int g = 0; g < kRows; ++g) quads[g][c] = sum_lanes4(partial[g]);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < kRows; ++g) {
      _mm512_mask_storeu_ps(out + g * score_stride, keep, _mm512_mul_ps(sum_quads4(quads[g]), _mm512_set1_ps(scale)));
    }
  }

  template <int kRows, typename T>
  static void accumulate_of(float* acc, const float* probs, int64_t score_stride, const T* values,
                            int64_t stride, int64_t n) {
    __m512 a[kRows][kVecs];  // in registers across the chunk: one load and store per chunk, not per key
    for (int g = 0; g < kRows; ++g) {
      for (int v = 0; v < kVecs; ++v) a[g][v] = _mm512_loadu_ps(acc + (g * kVecs + v) * 16);
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* value = values + j * stride;
      __m512 p[kRows];
      for (int g = 0; g < kRows; ++g) p[g] = _mm512_set1_ps(probs[g * score_stride + j]);
      for (int v = 0; v < kVecs; ++v) {
        const __m512 x = widen16(value + 16 * v);
        for (int g = 0; g < kRows; ++g) a[g][v] = _mm512_fmadd_ps(p[g], x, a[g][v]);
      }
    }
    for (int g = 0; g < kRows; ++g) {
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc + (g * kVecs + v) * 16, a[g][v]);
    }
  }
};
#endif

}  // namespace deepinfer::attention_rows
