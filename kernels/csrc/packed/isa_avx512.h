// Vector primitives of the packed GEMMs (packed_gemm.cpp) for AVX-512 (F/BW/VL/DQ, F16C, FMA), with the int8 dot
// product as VNNI vpdpbusd when PACKED_VNNI is 1, else vpmaddubsw + vpmaddwd. Included inside a namespace and a
// `#pragma GCC target` region by packed_gemm.cpp; body.h is written against these names only (isa_avx2.h and
// isa_scalar.h define the same ones). A "lane" is one output row of a 16-row tile: F16 / I16 hold one fp32 / int32
// per row, W8 holds 4 bytes per row (64 bytes).
// No include guard: packed_gemm.cpp includes it once per namespace (with and without VNNI).

struct F16 { __m512 v; };
struct I16 { __m512i v; };
struct W8 { __m512i v; };

PACKED_INLINE F16 fzero() { return {_mm512_setzero_ps()}; }
PACKED_INLINE F16 fload(const float* p) { return {_mm512_loadu_ps(p)}; }
PACKED_INLINE void fstore(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
PACKED_INLINE F16 fset1(float s) { return {_mm512_set1_ps(s)}; }
PACKED_INLINE F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
PACKED_INLINE F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
PACKED_INLINE F16 fmsub(F16 a, F16 b, F16 c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }   // a * b - c
PACKED_INLINE F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
// acc + w * x[0] (x[0] broadcast from memory)
PACKED_INLINE F16 fma_bcast(F16 w, const float* x, F16 acc) { return {_mm512_fmadd_ps(w.v, _mm512_set1_ps(*x), acc.v)}; }
PACKED_INLINE F16 cvt(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
// 16 fp16 values (GGUF's d / m / dmin of the tile's rows) -> fp32, exactly.
PACKED_INLINE F16 half16(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

PACKED_INLINE I16 iset1(int32_t s) { return {_mm512_set1_epi32(s)}; }
PACKED_INLINE I16 iload_u8(const uint8_t* p) {  // 16 bytes, zero-extended
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
PACKED_INLINE I16 iand(I16 a, int32_t m) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(m))}; }
PACKED_INLINE I16 ior(I16 a, I16 b) { return {_mm512_or_si512(a.v, b.v)}; }
PACKED_INLINE I16 isub(I16 a, I16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
template <int N> PACKED_INLINE I16 isrl(I16 a) { return {_mm512_srli_epi32(a.v, N)}; }
template <int N> PACKED_INLINE I16 isll(I16 a) { return {_mm512_slli_epi32(a.v, N)}; }
template <int N> PACKED_INLINE I16 isra(I16 a) { return {_mm512_srai_epi32(a.v, N)}; }
PACKED_INLINE I16 iload64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }  // a group: 4 bytes a row

// e8m0 exponent bytes of 16 rows -> 2^(e - 127) (e in 1..254; e = 0 reads as 0, not 2^-127).
PACKED_INLINE F16 e8m0_16(const uint8_t* p) { return {_mm512_castsi512_ps(isll<23>(iload_u8(p)).v)}; }

// 16 float8_e4m3fn codes -> their values / 256: the byte moved into an fp16's bit pattern (sign to bit 15, the 7
// exponent + mantissa bits to bits 13..7) is an fp16 of exactly value * 2^-8, subnormals included, which
// vcvtph2ps widens exactly whatever MXCSR's DAZ says. NaN codes (0x7F, 0xFF) read as +-480.
PACKED_INLINE F16 fp8_16(const uint8_t* p) {
  __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  u = _mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1);
  u = _mm256_and_si256(u, _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return {_mm512_cvtph_ps(u)};
}

// 16 bytes of e2m1 code pairs (one per row) -> the low and the high code's values (vpermps reads the index's
// low 4 bits: the code itself).
PACKED_INLINE void fp4_16(const uint8_t* p, const float* table16, F16& lo, F16& hi) {
  const __m512 table = _mm512_loadu_ps(table16);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo.v = _mm512_permutexvar_ps(v, table);
  hi.v = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// ---- int8 dot products: acc lane j += sum_i w[4j + i] * x[i] over one row's 4 activation bytes ----
PACKED_INLINE W8 wload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
PACKED_INLINE W8 wlo(W8 w) { return {_mm512_and_si512(w.v, _mm512_set1_epi8(0x0F))}; }
PACKED_INLINE W8 whi(W8 w) { return {_mm512_and_si512(_mm512_srli_epi16(w.v, 4), _mm512_set1_epi8(0x0F))}; }
PACKED_INLINE __m512i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

#if PACKED_VNNI
// Unsigned weights (nibbles, 0..15).
struct IAccU { __m512i v; };
PACKED_INLINE IAccU izero_u() { return {_mm512_setzero_si512()}; }
PACKED_INLINE void idot_u(IAccU& a, W8 w, const int8_t* x) { a.v = _mm512_dpbusd_epi32(a.v, w.v, bcast4(x)); }
PACKED_INLINE I16 ifinish_u(IAccU a) { return {a.v}; }
// Signed weights (Q8_0): vpdpbusd's first operand is unsigned, so the weights go in as w + 128 (w ^ 0x80) and the
// caller takes kSignedBias * sum(x) off the block's sum.
constexpr int32_t kSignedBias = 128;
struct IAccS { __m512i v; };
PACKED_INLINE IAccS izero_s() { return {_mm512_setzero_si512()}; }
PACKED_INLINE W8 wprep_s(W8 w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
PACKED_INLINE void idot_s(IAccS& a, W8 w, const int8_t* x) { a.v = _mm512_dpbusd_epi32(a.v, w.v, bcast4(x)); }
PACKED_INLINE I16 ifinish_s(IAccS a) { return {a.v}; }
#else
// vpmaddubsw: u8 x s8 pairs summed into saturating int16. Nibbles (<= 15) times |x| <= 127 give <= 3810 a pair,
// so up to 8 idot_u calls sum in int16 lanes without saturating (8 x 3810 = 30480 < 32767); body.h makes at
// most 8 per accumulator. vpmaddwd with ones then sums the int16 pairs into the int32 lanes.
struct IAccU { __m512i v; };
PACKED_INLINE IAccU izero_u() { return {_mm512_setzero_si512()}; }
PACKED_INLINE void idot_u(IAccU& a, W8 w, const int8_t* x) {
  a.v = _mm512_adds_epi16(a.v, _mm512_maddubs_epi16(w.v, bcast4(x)));
}
PACKED_INLINE I16 ifinish_u(IAccU a) { return {_mm512_madd_epi16(a.v, _mm512_set1_epi16(1))}; }
// Signed weights: |w| (<= 128, as u8) times x with w's sign (|x| <= 127): <= 32512 a pair, then int32 at once.
constexpr int32_t kSignedBias = 0;
struct IAccS { __m512i v; };
PACKED_INLINE IAccS izero_s() { return {_mm512_setzero_si512()}; }
PACKED_INLINE W8 wprep_s(W8 w) { return w; }
PACKED_INLINE void idot_s(IAccS& a, W8 w, const int8_t* x) {
  const __m512i xv = bcast4(x);
  const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), xv);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w.v), signed_x);
  a.v = _mm512_add_epi32(a.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
PACKED_INLINE I16 ifinish_s(IAccS a) { return {a.v}; }
#endif

constexpr int kRowsWiden = 8;  // activation rows per widening pass: 8 zmm accumulators
constexpr int kRowsScratch = kRowsWiden;  // per pass over a decoded chunk
constexpr int kRowsInt8 = 8;   // per int8 pass (Q4_K: half, two accumulators a row)
