// Vector primitives of the packed GEMMs in plain C++ (any CPU): the same names as isa_avx512.h over 16-element
// arrays, the int8 dot products exact in int32. The fallback where neither AVX2 nor AVX-512 exists, and a
// cross-check of the vector paths in the tests.
// No include guard: packed_gemm.cpp includes it once.

struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };
struct W8 { uint8_t v[64]; };

#define PACKED_LANES for (int j = 0; j < 16; ++j)

PACKED_INLINE F16 fzero() { F16 r; PACKED_LANES r.v[j] = 0.f; return r; }
PACKED_INLINE F16 fload(const float* p) { F16 r; PACKED_LANES r.v[j] = p[j]; return r; }
PACKED_INLINE void fstore(float* p, const F16& a) { PACKED_LANES p[j] = a.v[j]; }
PACKED_INLINE F16 fset1(float s) { F16 r; PACKED_LANES r.v[j] = s; return r; }
PACKED_INLINE F16 fmul(const F16& a, const F16& b) { F16 r; PACKED_LANES r.v[j] = a.v[j] * b.v[j]; return r; }
PACKED_INLINE F16 fmadd(const F16& a, const F16& b, const F16& c) {
  F16 r; PACKED_LANES r.v[j] = std::fma(a.v[j], b.v[j], c.v[j]); return r;
}
PACKED_INLINE F16 fmsub(const F16& a, const F16& b, const F16& c) {
  F16 r; PACKED_LANES r.v[j] = std::fma(a.v[j], b.v[j], -c.v[j]); return r;
}
PACKED_INLINE F16 fnmadd(const F16& a, const F16& b, const F16& c) {
  F16 r; PACKED_LANES r.v[j] = std::fma(-a.v[j], b.v[j], c.v[j]); return r;
}
PACKED_INLINE F16 fma_bcast(const F16& w, const float* x, const F16& acc) {
  F16 r; const float s = *x; PACKED_LANES r.v[j] = std::fma(w.v[j], s, acc.v[j]); return r;
}
PACKED_INLINE F16 cvt(const I16& a) { F16 r; PACKED_LANES r.v[j] = static_cast<float>(a.v[j]); return r; }
PACKED_INLINE float half_bits(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
PACKED_INLINE F16 half16(const uint8_t* p) {
  F16 r;
  PACKED_LANES {
    uint16_t h;
    std::memcpy(&h, p + 2 * j, 2);
    r.v[j] = half_bits(h);
  }
  return r;
}

PACKED_INLINE I16 iset1(int32_t s) { I16 r; PACKED_LANES r.v[j] = s; return r; }
PACKED_INLINE I16 iload_u8(const uint8_t* p) { I16 r; PACKED_LANES r.v[j] = p[j]; return r; }
PACKED_INLINE I16 iand(const I16& a, int32_t m) { I16 r; PACKED_LANES r.v[j] = a.v[j] & m; return r; }
PACKED_INLINE I16 ior(const I16& a, const I16& b) { I16 r; PACKED_LANES r.v[j] = a.v[j] | b.v[j]; return r; }
PACKED_INLINE I16 isub(const I16& a, const I16& b) { I16 r; PACKED_LANES r.v[j] = a.v[j] - b.v[j]; return r; }
template <int N> PACKED_INLINE I16 isrl(const I16& a) {
  I16 r; PACKED_LANES r.v[j] = static_cast<int32_t>(static_cast<uint32_t>(a.v[j]) >> N); return r;
}
template <int N> PACKED_INLINE I16 isll(const I16& a) {
  I16 r; PACKED_LANES r.v[j] = static_cast<int32_t>(static_cast<uint32_t>(a.v[j]) << N); return r;
}
template <int N> PACKED_INLINE I16 isra(const I16& a) { I16 r; PACKED_LANES r.v[j] = a.v[j] >> N; return r; }
PACKED_INLINE I16 iload64(const uint8_t* p) { I16 r; std::memcpy(r.v, p, 64); return r; }  // little-endian lanes

PACKED_INLINE F16 e8m0_16(const uint8_t* p) {
  F16 r;
  PACKED_LANES {
    const uint32_t bits = static_cast<uint32_t>(p[j]) << 23;
    std::memcpy(&r.v[j], &bits, 4);
  }
  return r;
}
PACKED_INLINE float fp8_value_over_256(uint8_t b) {  // the fp16 trick of isa_avx512.h, one code
  const uint16_t h = static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
  return half_bits(h);
}
PACKED_INLINE F16 fp8_16(const uint8_t* p) { F16 r; PACKED_LANES r.v[j] = fp8_value_over_256(p[j]); return r; }
PACKED_INLINE void fp4_16(const uint8_t* p, const float* table16, F16& lo, F16& hi) {
  PACKED_LANES {
    lo.v[j] = table16[p[j] & 0xF];
    hi.v[j] = table16[p[j] >> 4];
  }
}
PACKED_INLINE W8 wload(const uint8_t* p) { W8 r; std::memcpy(r.v, p, 64); return r; }
PACKED_INLINE W8 wlo(const W8& w) { W8 r; for (int i = 0; i < 64; ++i) r.v[i] = w.v[i] & 0xF; return r; }
PACKED_INLINE W8 whi(const W8& w) { W8 r; for (int i = 0; i < 64; ++i) r.v[i] = w.v[i] >> 4; return r; }
struct IAccU { int32_t v[16]; };
using IAccS = IAccU;
constexpr int32_t kSignedBias = 0;
PACKED_INLINE IAccU izero_u() { IAccU r; PACKED_LANES r.v[j] = 0; return r; }
PACKED_INLINE IAccS izero_s() { return izero_u(); }
PACKED_INLINE W8 wprep_s(const W8& w) { return w; }
PACKED_INLINE void idot_u(IAccU& a, const W8& w, const int8_t* x) {
  PACKED_LANES {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(w.v[4 * j + i]) * x[i];
    a.v[j] += s;
  }
}
PACKED_INLINE void idot_s(IAccS& a, const W8& w, const int8_t* x) {
  PACKED_LANES {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(static_cast<int8_t>(w.v[4 * j + i])) * x[i];
    a.v[j] += s;
  }
}
PACKED_INLINE I16 ifinish_u(const IAccU& a) { I16 r; PACKED_LANES r.v[j] = a.v[j]; return r; }
PACKED_INLINE I16 ifinish_s(const IAccS& a) { return ifinish_u(a); }

#undef PACKED_LANES

constexpr int kRowsWiden = 4;
constexpr int kRowsScratch = kRowsWiden;  // per pass over a decoded chunk
constexpr int kRowsInt8 = 4;
