// Vector primitives of the packed GEMMs for AVX2 + FMA + F16C, the int8 dot product as AVX-VNNI vpdpbusd (VEX) when
// PACKED_VNNI is 1, else vpmaddubsw + vpmaddwd. The same names as isa_avx512.h; a 16-row lane vector is two ymm
// halves (a: rows 0..7, b: rows 8..15), a W8 group two 32-byte halves.
// No include guard: packed_gemm.cpp includes it once per namespace (with and without VNNI).

struct F16 { __m256 a, b; };
struct I16 { __m256i a, b; };
struct W8 { __m256i a, b; };

PACKED_INLINE F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
PACKED_INLINE F16 fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
PACKED_INLINE void fstore(float* p, F16 v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
PACKED_INLINE F16 fset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
PACKED_INLINE F16 fmul(F16 x, F16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
PACKED_INLINE F16 fmadd(F16 x, F16 y, F16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
PACKED_INLINE F16 fmsub(F16 x, F16 y, F16 z) { return {_mm256_fmsub_ps(x.a, y.a, z.a), _mm256_fmsub_ps(x.b, y.b, z.b)}; }
PACKED_INLINE F16 fnmadd(F16 x, F16 y, F16 z) {
  return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)};
}
PACKED_INLINE F16 fma_bcast(F16 w, const float* x, F16 acc) {
  const __m256 s = _mm256_broadcast_ss(x);
  return {_mm256_fmadd_ps(w.a, s, acc.a), _mm256_fmadd_ps(w.b, s, acc.b)};
}
PACKED_INLINE F16 cvt(I16 v) { return {_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
PACKED_INLINE F16 half16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}

PACKED_INLINE I16 iset1(int32_t s) { return {_mm256_set1_epi32(s), _mm256_set1_epi32(s)}; }
PACKED_INLINE I16 iload_u8(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
PACKED_INLINE I16 iand(I16 v, int32_t m) {
  const __m256i mv = _mm256_set1_epi32(m);
  return {_mm256_and_si256(v.a, mv), _mm256_and_si256(v.b, mv)};
}
PACKED_INLINE I16 ior(I16 x, I16 y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
PACKED_INLINE I16 isub(I16 x, I16 y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
template <int N> PACKED_INLINE I16 isrl(I16 v) { return {_mm256_srli_epi32(v.a, N), _mm256_srli_epi32(v.b, N)}; }
template <int N> PACKED_INLINE I16 isll(I16 v) { return {_mm256_slli_epi32(v.a, N), _mm256_slli_epi32(v.b, N)}; }
template <int N> PACKED_INLINE I16 isra(I16 v) { return {_mm256_srai_epi32(v.a, N), _mm256_srai_epi32(v.b, N)}; }
PACKED_INLINE I16 iload64(const uint8_t* p) {  // a group: 4 bytes a row
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}

PACKED_INLINE F16 e8m0_16(const uint8_t* p) {
  const I16 e = isll<23>(iload_u8(p));
  return {_mm256_castsi256_ps(e.a), _mm256_castsi256_ps(e.b)};
}

// As isa_avx512.h: the code as an fp16 bit pattern of value * 2^-8, widened by vcvtph2ps.
PACKED_INLINE F16 fp8_16(const uint8_t* p) {
  __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  u = _mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1);
  u = _mm256_and_si256(u, _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(u)), _mm256_cvtph_ps(_mm256_extracti128_si256(u, 1))};
}

// vpermps has 8 entries: the magnitude from the code's low 3 bits, the sign (bit 3) xor-ed in.
PACKED_INLINE __m256 fp4_8(__m256i codes, __m256 magnitudes) {
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, codes), _mm256_castsi256_ps(sign));
}
PACKED_INLINE void fp4_16(const uint8_t* p, const float* table16, F16& lo, F16& hi) {
  const __m256 magnitudes = _mm256_loadu_ps(table16);
  const __m256i va = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i vb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {fp4_8(va, magnitudes), fp4_8(vb, magnitudes)};
  hi = {fp4_8(_mm256_srli_epi32(va, 4), magnitudes), fp4_8(_mm256_srli_epi32(vb, 4), magnitudes)};
}

// ---- int8 dot products ----
PACKED_INLINE W8 wload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
PACKED_INLINE W8 wlo(W8 w) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(w.a, m), _mm256_and_si256(w.b, m)};
}
PACKED_INLINE W8 whi(W8 w) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(w.b, 4), m)};
}
PACKED_INLINE __m256i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

#if PACKED_VNNI
struct IAccU { __m256i a, b; };
PACKED_INLINE IAccU izero_u() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
PACKED_INLINE void idot_u(IAccU& acc, W8 w, const int8_t* x) {
  const __m256i xv = bcast4(x);
  acc.a = _mm256_dpbusd_avx_epi32(acc.a, w.a, xv);
  acc.b = _mm256_dpbusd_avx_epi32(acc.b, w.b, xv);
}
PACKED_INLINE I16 ifinish_u(IAccU acc) { return {acc.a, acc.b}; }
constexpr int32_t kSignedBias = 128;
using IAccS = IAccU;
PACKED_INLINE IAccS izero_s() { return izero_u(); }
PACKED_INLINE W8 wprep_s(W8 w) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(w.a, flip), _mm256_xor_si256(w.b, flip)};
}
PACKED_INLINE void idot_s(IAccS& acc, W8 w, const int8_t* x) { idot_u(acc, w, x); }
PACKED_INLINE I16 ifinish_s(IAccS acc) { return {acc.a, acc.b}; }
#else
// int16 accumulation of up to 8 idot_u calls, as in isa_avx512.h.
struct IAccU { __m256i a, b; };
PACKED_INLINE IAccU izero_u() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
PACKED_INLINE void idot_u(IAccU& acc, W8 w, const int8_t* x) {
  const __m256i xv = bcast4(x);
  acc.a = _mm256_adds_epi16(acc.a, _mm256_maddubs_epi16(w.a, xv));
  acc.b = _mm256_adds_epi16(acc.b, _mm256_maddubs_epi16(w.b, xv));
}
PACKED_INLINE I16 ifinish_u(IAccU acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.a, ones), _mm256_madd_epi16(acc.b, ones)};
}
constexpr int32_t kSignedBias = 0;
struct IAccS { __m256i a, b; };
PACKED_INLINE IAccS izero_s() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
PACKED_INLINE W8 wprep_s(W8 w) { return w; }
PACKED_INLINE __m256i dot_s8(__m256i w, __m256i xv) {  // |w| x (x with w's sign): <= 32512 a pair
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1));
}
PACKED_INLINE void idot_s(IAccS& acc, W8 w, const int8_t* x) {
  const __m256i xv = bcast4(x);
  acc.a = _mm256_add_epi32(acc.a, dot_s8(w.a, xv));
  acc.b = _mm256_add_epi32(acc.b, dot_s8(w.b, xv));
}
PACKED_INLINE I16 ifinish_s(IAccS acc) { return {acc.a, acc.b}; }
#endif

#ifndef PACKED_AVX2_ROWS_WIDEN
#define PACKED_AVX2_ROWS_WIDEN 4
#endif
#ifndef PACKED_AVX2_ROWS_SCRATCH
#define PACKED_AVX2_ROWS_SCRATCH PACKED_AVX2_ROWS_WIDEN
#endif
#ifndef PACKED_AVX2_ROWS_INT8
#define PACKED_AVX2_ROWS_INT8 4
#endif
// Rows per pass (overridable for experiments). Busy 2-core Zen 3, 1536 x 1536, 32 rows: widening 4 + 4 took
// 0.55-0.6x the time of 2 + 2 (per decode pass + per pass over the decoded chunk); int8 4 took 0.7-1.0x of 2.
constexpr int kRowsWiden = PACKED_AVX2_ROWS_WIDEN;  // 4: 8 ymm accumulators
constexpr int kRowsScratch = PACKED_AVX2_ROWS_SCRATCH;
constexpr int kRowsInt8 = PACKED_AVX2_ROWS_INT8;
