// Small fp32 helpers of the host kernels (attention, the fused layer ops, the blocked GEMM's epilogues): dot
// products with independent partial sums, sums, maxima, a vectorizable exp, SiLU, bf16 rounding and (AVX-512)
// 16 dot products' final sums at once.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace deepinfer::attention_math {

// An e4m3 code of an fp8 KV cache (kernels/kv_fp8.py): sign << 7 | exponent << 3 | mantissa, bias 7, no inf.
struct Fp8E4M3 {
  uint8_t bits;
};

// Its value, (mantissa + 8 if normal) * 2^(max(exponent, 1) - 10), signed: an integer times a power of two, both
// normal fp32 numbers (no subnormal fp32 arithmetic, which a flush-to-zero mode would lose), so exact.
inline float fp8_to_float(Fp8E4M3 code) {
  const uint32_t c = code.bits, exponent = (c >> 3) & 15;
  const uint32_t pow2_bits = ((exponent > 0 ? exponent : 1) + 127 - 10) << 23;
  float pow2;
  std::memcpy(&pow2, &pow2_bits, sizeof pow2);
  const float magnitude = static_cast<float>((c & 7) | (exponent > 0 ? 8u : 0u)) * pow2;
  return (c & 128) ? -magnitude : magnitude;
}

constexpr int64_t kLanes = 16;  // independent partial sums: the compiler vectorizes without reassociating

// Lanes folded as a tree (vector adds), not one by one (a serial chain of 16 scalar adds per dot product).
inline float fold_sum(float* lanes) {
  for (int64_t l = 0; l < 8; ++l) lanes[l] += lanes[l + 8];
  for (int64_t l = 0; l < 4; ++l) lanes[l] += lanes[l + 4];
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int64_t i = 16; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = fold_sum(lanes);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[i] = dot(a, rows[i], n) for i < count, each summed in dot's order (the same bits), eight rows at a time: one
// dot of a 128-wide head is a chain of 8 dependent FMAs, latency-bound; eight independent chains are not.
inline void dots_of_rows(const float* a, const float* const* rows, int64_t count, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  if (n % 16 == 0) {
    constexpr int64_t kRows = 8;
    for (; i + kRows <= count; i += kRows) {
      __m512 acc[kRows];
      const __m512 a0 = _mm512_loadu_ps(a);
      for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_mul_ps(a0, _mm512_loadu_ps(rows[i + r]));
      for (int64_t c = 16; c < n; c += 16) {
        const __m512 ac = _mm512_loadu_ps(a + c);
        for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(ac, _mm512_loadu_ps(rows[i + r] + c), acc[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) out[i + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
#endif
  for (; i < count; ++i) out[i] = dot(a, rows[i], n);
}

inline float sum_of(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  }
  float sum = fold_sum(lanes);
  for (; i < n; ++i) sum += x[i];
  return sum;
}

inline float max_of(const float* x, int64_t n) {  // n >= 1
  float top = x[0];
  int64_t i = 1;
#ifdef __AVX512F__
  // The scalar loop does not vectorize (a max reduction needs -ffast-math): one compare per score otherwise.
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(x);
    for (i = 16; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    top = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < n; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

#ifdef __AVX512F__
// Sixteen dot products' final sums as a transpose-add tree (15 shuffle-and-add steps for 16 vectors, where 16
// horizontal reductions (_mm512_reduce_add_ps) cost ~4x the instructions and a latency chain each), in two halves
// so that a caller can reduce its partial sums four at a time and keep fewer of them in registers:
// sum_lanes4 folds 4 vectors into one "quad" (each 128-bit lane: one partial sum of each of the 4, in order);
// sum_quads4 folds 4 quads (of vectors 0-3, 4-7, 8-11, 12-15) into the result, lane j = the sum of vector j.
inline __m512 sum_lanes4(const __m512* v) {
  __m512 pairs[2];
  for (int j = 0; j < 2; ++j) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  }
  const __m512d a = _mm512_castps_pd(pairs[0]), b = _mm512_castps_pd(pairs[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

inline __m512 sum_quads4(const __m512* quads) {
  __m512 octs[2];
  for (int j = 0; j < 2; ++j) {  // 128-bit lanes (0+1, 2+3) of one, then of the other
    octs[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                            _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88), _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}
#endif

// exp(v) for v in [-87.3, 88.7] (callers clamp below; 88.7 and above give inf): Cephes' expf polynomial on the
// reduced argument times 2^k built from the exponent bits, within ~2 ulp; vectorizable where a loop calls it.
inline float exp_poly(float v) {
  v = v < 88.7f ? v : 88.7f;
  const float k = std::floor(v * 1.44269504088896341f + 0.5f);
  const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}

#ifdef __AVX512F__
// 16 values as fp32: a float load, or bf16 widened (its bits are the fp32's upper half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// 16 e4m3 codes widened in registers, exact: each code's bits moved into an fp16's (sign to bit 15, the 4 exponent
// and 3 mantissa bits to bits 7..13 with fp16's top exponent bit 0) make an fp16 of value * 2^-8, subnormal codes
// included (e4m3's bias is 7, fp16's 15; fp16's subnormals are e4m3's, scaled the same), which vcvtph2ps widens
// exactly in hardware, and * 256 (an exact power of two) restores the value. 5 instructions where the integer-and-
// multiply form took 15 (this VM's Xeon: 1.8x in a dot-product loop). Not the shorter fp32 form (code bits << 20,
// * 2^120): a subnormal code is then a subnormal fp32 operand, and the multiply takes a microcode assist (60x
// slower on this Xeon with small K values). The sign-extending widen copies the sign into bits 8..15, so after
// the shift bit 15 holds it and bit 14 (cleared by the mask) a copy.
// load16_over256 stops before the * 256: the decode attention folds that power of two into its score and output
// scales (exact: every product and sum is then 2^-8 times the same one, same rounding, none subnormal), one
// multiply fewer per 16 values on the two ports the kernel is bound by at long contexts.
inline __m512 load16_over256(const Fp8E4M3* p) {
  const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_cvtph_ps(half);
}
inline __m512 load16(const Fp8E4M3* p) { return _mm512_mul_ps(load16_over256(p), _mm512_set1_ps(256.f)); }

// exp_poly's steps 16 at a time (FMA-contracted, so within ~1 ulp of the scalar form): GCC leaves the scalar
// function unvectorized (~25 scalar operations an element). v must be clamped to [-87.3, 88.7] by the caller.
inline __m512 exp_poly16(__m512 v) {
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding for finite values).
inline __m256i bf16_bits16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16));
}
// 16 values as a tensor of the tag's type would hold them (bf16: rounded to nearest even), back in fp32.
inline __m512 stored16(__m512 v, float) { return v; }
inline __m512 stored16(__m512 v, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(v)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits16(v));
}

// silu(g) = g / (1 + exp(-g)), stored in the tag's type as torch stores the activation before the gate product.
// One definition for the SiLU-and-multiply op and the GEMM that fuses it, so the two agree to the bit.
template <typename scalar_t>
inline __m512 silu16(__m512 g, scalar_t tag) {
  const __m512 minus_g = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __m512 e = exp_poly16(_mm512_min_ps(_mm512_max_ps(minus_g, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f)));
  return stored16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), tag);
}
#endif

// exp(x - shift) for x <= shift, in place. Arguments below -87.3 give ~1e-38 instead of 0: negligible next to the
// 1 of the maximum.
inline void exp_shifted_inplace(float* x, int64_t n, float shift) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(shift)),
                                   _mm512_set1_ps(-87.3f));
    _mm512_storeu_ps(x + i, exp_poly16(v));
  }
#endif
  for (; i < n; ++i) {
    const float t = x[i] - shift;
    x[i] = exp_poly(t > -87.3f ? t : -87.3f);
  }
}

}  // namespace deepinfer::attention_math
