// The packed GEMMs' kernel bodies, written once against the primitives of isa_avx512.h / isa_avx2.h /
// isa_scalar.h: packed_gemm.cpp includes this file once per instruction set, inside that set's namespace and
// `#pragma GCC target` region. Needs Job, kTile, kE2M1 and store_rows from packed_gemm.cpp, and PACKED_WIDEN
// (1: compile the fp32-widening kernels here; the VNNI namespaces reuse their base set's).
//
// Each thread runs whole 16-row output tiles (the packed layouts keep a tile's bytes contiguous: one stream).
// fp32 widening: a decoder yields, for each input index k, the tile's 16 weights of column k as fp32 (dequantized
// exactly as the reference does: the same products, each rounded once), and each is FMA-ed into up to kRowsWiden
// activation rows held in registers. More rows: the first pass over a chunk of ~256 inputs also stores the
// decoded chunk (16 KiB, L1), and the other row passes read it there instead of decoding again.
// int8: each 16-row x 4-input group of weight bytes (64 bytes) is one vpdpbusd per activation row against the
// row's 4 int8 activations broadcast; each 32-input block's int32 sums become fp32 once (scales applied there).
// No include guard: included once per instruction-set namespace.

// f(std::integral_constant<int, i>) for i = 0 .. N - 1, unrolled at compile time. The per-row accumulator arrays
// below are indexed only through it: with constant indices from the start GCC keeps them in registers, where a
// `for (r < R)` loop over an array of two-ymm structs left a store to the stack after every FMA (AVX2, R = 4).
template <class F, size_t... I>
PACKED_INLINE void unroll_impl(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int, static_cast<int>(I)>{}), ...);
}
template <int N, class F>
PACKED_INLINE void unroll(F&& f) {
  unroll_impl(f, std::make_index_sequence<N>{});
}
#define PACKED_EACH(N, r) unroll<N>([&](auto r) __attribute__((always_inline))

template <int Max, class F>
PACKED_INLINE void with_rows(int r, F&& f) {  // f(std::integral_constant<int, r>) for 1 <= r <= Max
  if (r == Max) {
    f(std::integral_constant<int, Max>{});
    return;
  }
  if constexpr (Max > 1) with_rows<Max - 1>(r, f);
}

// Into L2, this far ahead in a tile's weight stream (the hardware prefetcher stops at 4 KiB pages; gemv.cpp's
// kPrefetchBytes, measured there).
constexpr int64_t kPrefetchBytes = 2048;
PACKED_INLINE void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + kPrefetchBytes, 0, 2); }

// Byte I of every row of a 64-byte group (16 rows x 4 bytes, one int32 lane a row): signed, or its low / high
// nibble, as fp32. One vector at a time, from the group's lanes held in a register.
template <int I> PACKED_INLINE F16 group_s8(I16 raw) { return cvt(isra<24>(isll<24 - 8 * I>(raw))); }
template <int I> PACKED_INLINE F16 group_lo(I16 raw) { return cvt(iand(isrl<8 * I>(raw), 0xF)); }
template <int I> PACKED_INLINE F16 group_hi(I16 raw) { return cvt(iand(isrl<8 * I + 4>(raw), 0xF)); }

PACKED_INLINE const uint8_t* gguf_block(const Job& j, int64_t tile, int64_t b) {
  return j.data + (tile * j.blocks + b) * j.block_bytes;
}

// Q4_K's 8 sub-block scales and mins of the tile's 16 rows (the 12 scale bytes stored byte-major, 16 rows a
// byte), times d and dmin: dsc[s] = d * sc[s], dm[s] = dmin * m[s], exactly as gguf's dequantizer forms them.
PACKED_INLINE void q4k_scales(const uint8_t* p, F16 dsc[8], F16 dm[8]) {
  const F16 d = half16(p), dmin = half16(p + 32);
  I16 bytes[12];
  for (int i = 0; i < 12; ++i) bytes[i] = iload_u8(p + 64 + 16 * i);
  for (int s = 0; s < 8; ++s) {
    I16 sc, mn;
    if (s < 4) {
      sc = iand(bytes[s], 63);
      mn = iand(bytes[s + 4], 63);
    } else {
      sc = ior(iand(bytes[s + 4], 0xF), isll<4>(isrl<6>(bytes[s - 4])));
      mn = ior(isrl<4>(bytes[s + 4]), isll<4>(isrl<6>(bytes[s])));
    }
    dsc[s] = fmul(d, cvt(sc));
    dm[s] = fmul(dmin, cvt(mn));
  }
}

#if PACKED_WIDEN
// ------------------------------------------------------------------------------------ fp32 widening ----------
// Decoders: blocks() blocks of block_k() inputs; block(tile, b, sink) calls sink(k, w) for each k of block b.
struct Fp8Dec {
  const Job& j;
  int64_t block_k() const { return j.block_k; }
  int64_t blocks() const { return (j.in + j.block_k - 1) / j.block_k; }
  template <class Sink>
  PACKED_INLINE void block(int64_t tile, int64_t b, Sink& sink) const {
    const int64_t k0 = b * j.block_k, k1 = std::min(j.in, k0 + j.block_k);
    // fp8_16 gives value / 256: the scale times 256 (exact) makes each weight value * scale, rounded once.
    const F16 s = fset1(j.fp8_scale[(tile * kTile / j.block_n) * j.scale_cols + b] * 256.f);
    const uint8_t* p = j.data + (tile * j.in + k0) * kTile;
    for (int64_t k = k0; k < k1; ++k, p += kTile) {
      if ((k & 3) == 0) prefetch_ahead(p);  // one 64-byte line per 4 inputs
      sink(k, fmul(fp8_16(p), s));
    }
  }
};

struct Fp4Dec {
  const Job& j;
  int64_t block_k() const { return 32; }
  int64_t blocks() const { return j.in / 32; }
  template <class Sink>
  PACKED_INLINE void block(int64_t tile, int64_t g, Sink& sink) const {
    const F16 s = e8m0_16(j.fp4_scale + (tile * (j.in / 32) + g) * kTile);
    const uint8_t* p = j.data + (tile * (j.in / 2) + g * 16) * kTile;
    for (int pair = 0; pair < 16; ++pair, p += kTile) {
      if ((pair & 3) == 0) prefetch_ahead(p);
      F16 lo, hi;
      fp4_16(p, kE2M1, lo, hi);
      sink(g * 32 + 2 * pair, fmul(lo, s));
      sink(g * 32 + 2 * pair + 1, fmul(hi, s));
    }
  }
};

struct Q8_0Dec {  // w = d * q
  const Job& j;
  int64_t block_k() const { return 32; }
  int64_t blocks() const { return j.blocks; }
  template <class Sink>
  PACKED_INLINE void block(int64_t tile, int64_t b, Sink& sink) const {
    const uint8_t* p = gguf_block(j, tile, b);
    const F16 d = half16(p);
    for (int g = 0; g < 8; ++g) {
      prefetch_ahead(p + 32 + 64 * g);
      const I16 raw = iload64(p + 32 + 64 * g);
      PACKED_EACH(4, i) { sink(32 * b + 4 * g + i, fmul(group_s8<decltype(i)::value>(raw), d)); });
    }
  }
};

template <bool kMin>  // Q4_0: w = d * (q - 8) (= q * d + (-8 d), exact); Q4_1: w = q * d + m (one rounding)
struct Q4Dec {
  const Job& j;
  int64_t block_k() const { return 32; }
  int64_t blocks() const { return j.blocks; }
  template <class Sink>
  PACKED_INLINE void block(int64_t tile, int64_t b, Sink& sink) const {
    const uint8_t* p = gguf_block(j, tile, b);
    const F16 d = half16(p);
    const F16 m = kMin ? half16(p + 32) : fmul(d, fset1(-8.f));
    const uint8_t* qs = p + (kMin ? 64 : 32);
    for (int g = 0; g < 4; ++g) {
      prefetch_ahead(qs + 64 * g);
      const I16 raw = iload64(qs + 64 * g);
      PACKED_EACH(4, i) {
        sink(32 * b + 4 * g + i, fmadd(group_lo<decltype(i)::value>(raw), d, m));
        sink(32 * b + 16 + 4 * g + i, fmadd(group_hi<decltype(i)::value>(raw), d, m));
      });
    }
  }
};

struct Q4KDec {  // w = (d * sc) * q - dmin * m per 32-input sub-block (one rounding)
  const Job& j;
  int64_t block_k() const { return 256; }
  int64_t blocks() const { return j.blocks; }
  template <class Sink>
  PACKED_INLINE void block(int64_t tile, int64_t b, Sink& sink) const {
    const uint8_t* p = gguf_block(j, tile, b);
    F16 dsc[8], dm[8];
    q4k_scales(p, dsc, dm);
    const uint8_t* qs = p + 256;
    for (int g = 0; g < 32; ++g) {
      const int pair = g / 8, c = g % 8;
      prefetch_ahead(qs + 64 * g);
      const I16 raw = iload64(qs + 64 * g);
      const int64_t k = 256 * b + 64 * pair + 4 * c;
      PACKED_EACH(4, i) {
        sink(k + i, fmsub(group_lo<decltype(i)::value>(raw), dsc[2 * pair], dm[2 * pair]));
        sink(k + 32 + i, fmsub(group_hi<decltype(i)::value>(raw), dsc[2 * pair + 1], dm[2 * pair + 1]));
      });
    }
  }
};

template <int R, bool kStore, class Dec>
void widen_decode_pass(const Dec& dec, int64_t tile, int64_t b0, int64_t b1, const float* x, int64_t ldx,
                       float* acc, float* scratch, int64_t kc0) {
  F16 a[R];
  PACKED_EACH(R, r) { a[r] = fload(acc + r * kTile); });
  auto sink = [&](int64_t k, F16 w) __attribute__((always_inline)) {
    if constexpr (kStore) fstore(scratch + (k - kc0) * kTile, w);
    PACKED_EACH(R, r) { a[r] = fma_bcast(w, x + r * ldx + k, a[r]); });
  };
  for (int64_t b = b0; b < b1; ++b) dec.block(tile, b, sink);
  PACKED_EACH(R, r) { fstore(acc + r * kTile, a[r]); });
}

template <int R>
void widen_scratch_pass(const float* scratch, int64_t kc0, int64_t kc1, const float* x, int64_t ldx, float* acc) {
  F16 a[R];
  PACKED_EACH(R, r) { a[r] = fload(acc + r * kTile); });
  for (int64_t k = kc0; k < kc1; ++k) {
    const F16 w = fload(scratch + (k - kc0) * kTile);
    PACKED_EACH(R, r) { a[r] = fma_bcast(w, x + r * ldx + k, a[r]); });
  }
  PACKED_EACH(R, r) { fstore(acc + r * kTile, a[r]); });
}

template <class Dec>
void widen_tiles_with(const Job& j, const Dec& dec, int64_t t0, int64_t t1) {
  const int64_t bk = dec.block_k(), nb = dec.blocks();
  const int64_t chunk_blocks = std::max<int64_t>(1, 256 / bk);
  std::vector<float> acc(j.rows * kTile);
  std::vector<float> scratch(j.rows > kRowsWiden ? chunk_blocks * bk * kTile : 0);
  const int first = static_cast<int>(std::min<int64_t>(kRowsWiden, j.rows));
  for (int64_t tile = t0; tile < t1; ++tile) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t cb = 0; cb < nb; cb += chunk_blocks) {
      const int64_t cb1 = std::min(nb, cb + chunk_blocks);
      const int64_t kc0 = cb * bk, kc1 = std::min(j.in, cb1 * bk);
      with_rows<kRowsWiden>(first, [&](auto rows) {
        if (j.rows > first) {
          widen_decode_pass<rows.value, true>(dec, tile, cb, cb1, j.x, j.in, acc.data(), scratch.data(), kc0);
        } else {
          widen_decode_pass<rows.value, false>(dec, tile, cb, cb1, j.x, j.in, acc.data(), nullptr, kc0);
        }
      });
      for (int64_t r0 = first; r0 < j.rows; r0 += kRowsScratch) {
        const int r = static_cast<int>(std::min<int64_t>(kRowsScratch, j.rows - r0));
        with_rows<kRowsScratch>(r, [&](auto rows) {
          widen_scratch_pass<rows.value>(scratch.data(), kc0, kc1, j.x + r0 * j.in, j.in, acc.data() + r0 * kTile);
        });
      }
    }
    store_rows(j, tile, 0, j.rows, acc.data());
  }
}

void widen_tiles(const Job& j, int64_t t0, int64_t t1) {
  switch (j.fmt) {
    case Fmt::kFp8: return widen_tiles_with(j, Fp8Dec{j}, t0, t1);
    case Fmt::kFp4: return widen_tiles_with(j, Fp4Dec{j}, t0, t1);
    case Fmt::kQ8_0: return widen_tiles_with(j, Q8_0Dec{j}, t0, t1);
    case Fmt::kQ4_0: return widen_tiles_with(j, Q4Dec<false>{j}, t0, t1);
    case Fmt::kQ4_1: return widen_tiles_with(j, Q4Dec<true>{j}, t0, t1);
    case Fmt::kQ4_K: return widen_tiles_with(j, Q4KDec{j}, t0, t1);
  }
}
#endif  // PACKED_WIDEN

// ----------------------------------------------------------------------------------------------- int8 -------
// The activation rows r0.. quantized per 32 inputs (packed_gemm.cpp): q int8 [rows, in], d = amax / 127,
// sum = sum(q), s = d * sum, per block [rows, in / 32]. acc: the tile's sums for all rows, 16 floats a row.
struct XRows {
  const int8_t* q;
  const float* d;
  const int32_t* sum;
  const float* s;
  int64_t in, nbx;  // row strides
  PACKED_INLINE const int8_t* at(int r, int64_t k) const { return q + r * in + k; }
  PACKED_INLINE int64_t blk(int r, int64_t xb) const { return r * nbx + xb; }
};

PACKED_INLINE XRows x_rows(const Job& j, int64_t r0) {
  const int64_t nbx = j.in / 32;
  return {j.xq + r0 * j.in, j.xd + r0 * nbx, j.xsum + r0 * nbx, j.xs + r0 * nbx, j.in, nbx};
}

template <int R>
void int8_pass_q8_0(const Job& j, int64_t tile, const XRows& x, float* acc) {
  F16 f[R];
  PACKED_EACH(R, r) { f[r] = fzero(); });
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* p = gguf_block(j, tile, b);
    IAccS a[R];
    PACKED_EACH(R, r) { a[r] = izero_s(); });
    for (int g = 0; g < 8; ++g) {
      prefetch_ahead(p + 32 + 64 * g);
      const W8 w = wprep_s(wload(p + 32 + 64 * g));
      PACKED_EACH(R, r) { idot_s(a[r], w, x.at(r, 32 * b + 4 * g)); });
    }
    const F16 d = half16(p);
    PACKED_EACH(R, r) {
      I16 s = ifinish_s(a[r]);
      if constexpr (kSignedBias != 0) s = isub(s, iset1(kSignedBias * x.sum[x.blk(r, b)]));
      f[r] = fmadd(cvt(s), fmul(d, fset1(x.d[x.blk(r, b)])), f[r]);
    });
  }
  PACKED_EACH(R, r) { fstore(acc + r * kTile, f[r]); });
}

template <int R, bool kMin>  // Q4_0: d * (sum(q x) - 8 sum(x)); Q4_1: d * sum(q x) + m * sum(x)
void int8_pass_q4(const Job& j, int64_t tile, const XRows& x, float* acc) {
  F16 f[R];
  PACKED_EACH(R, r) { f[r] = fzero(); });
  const int qs_at = kMin ? 64 : 32;
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* p = gguf_block(j, tile, b);
    IAccU a[R];
    PACKED_EACH(R, r) { a[r] = izero_u(); });
    for (int g = 0; g < 4; ++g) {  // 8 idot_u per accumulator: within the int16 paths' bound
      prefetch_ahead(p + qs_at + 64 * g);
      const W8 v = wload(p + qs_at + 64 * g);
      const W8 lo = wlo(v), hi = whi(v);
      PACKED_EACH(R, r) {
        idot_u(a[r], lo, x.at(r, 32 * b + 4 * g));
        idot_u(a[r], hi, x.at(r, 32 * b + 16 + 4 * g));
      });
    }
    const F16 d = half16(p), m = kMin ? half16(p + 32) : fzero();
    PACKED_EACH(R, r) {
      const int64_t xb = x.blk(r, b);
      if constexpr (kMin) {
        f[r] = fmadd(cvt(ifinish_u(a[r])), fmul(d, fset1(x.d[xb])), f[r]);
        f[r] = fmadd(m, fset1(x.s[xb]), f[r]);
      } else {
        const I16 s = isub(ifinish_u(a[r]), iset1(8 * x.sum[xb]));
        f[r] = fmadd(cvt(s), fmul(d, fset1(x.d[xb])), f[r]);
      }
    });
  }
  PACKED_EACH(R, r) { fstore(acc + r * kTile, f[r]); });
}

template <int R>  // per sub-block s: (d sc_s) * d_x * sum(q x) - (dmin m_s) * d_x * sum(x)
void int8_pass_q4_k(const Job& j, int64_t tile, const XRows& x, float* acc) {
  F16 f[R];
  PACKED_EACH(R, r) { f[r] = fzero(); });
  for (int64_t b = 0; b < j.blocks; ++b) {
    const uint8_t* p = gguf_block(j, tile, b);
    F16 dsc[8], dm[8];
    q4k_scales(p, dsc, dm);
    const uint8_t* qs = p + 256;
    for (int pair = 0; pair < 4; ++pair) {  // sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high)
      IAccU lo[R], hi[R];
      PACKED_EACH(R, r) { lo[r] = hi[r] = izero_u(); });
      for (int c = 0; c < 8; ++c) {
        prefetch_ahead(qs + 64 * (8 * pair + c));
        const W8 v = wload(qs + 64 * (8 * pair + c));
        const W8 wl = wlo(v), wh = whi(v);
        const int64_t k = 256 * b + 64 * pair + 4 * c;
        PACKED_EACH(R, r) {
          idot_u(lo[r], wl, x.at(r, k));
          idot_u(hi[r], wh, x.at(r, k + 32));
        });
      }
      const int s = 2 * pair;
      const int64_t xb0 = 8 * b + s;
      PACKED_EACH(R, r) {
        f[r] = fmadd(cvt(ifinish_u(lo[r])), fmul(dsc[s], fset1(x.d[x.blk(r, xb0)])), f[r]);
        f[r] = fnmadd(dm[s], fset1(x.s[x.blk(r, xb0)]), f[r]);
        f[r] = fmadd(cvt(ifinish_u(hi[r])), fmul(dsc[s + 1], fset1(x.d[x.blk(r, xb0 + 1)])), f[r]);
        f[r] = fnmadd(dm[s + 1], fset1(x.s[x.blk(r, xb0 + 1)]), f[r]);
      });
    }
  }
  PACKED_EACH(R, r) { fstore(acc + r * kTile, f[r]); });
}

template <int MaxRows, class Pass>
void int8_tiles_with(const Job& j, int64_t t0, int64_t t1, Pass&& pass) {
  std::vector<float> acc(j.rows * kTile);
  for (int64_t tile = t0; tile < t1; ++tile) {
    for (int64_t r0 = 0; r0 < j.rows; r0 += MaxRows) {
      const int r = static_cast<int>(std::min<int64_t>(MaxRows, j.rows - r0));
      const XRows x = x_rows(j, r0);
      with_rows<MaxRows>(r, [&](auto rows) { pass(rows, tile, x, acc.data() + r0 * kTile); });
    }
    store_rows(j, tile, 0, j.rows, acc.data());
  }
}

void int8_tiles(const Job& j, int64_t t0, int64_t t1) {
  switch (j.fmt) {
    case Fmt::kQ8_0:
      return int8_tiles_with<kRowsInt8>(j, t0, t1, [&](auto rows, int64_t tile, const XRows& x, float* acc) {
        int8_pass_q8_0<rows.value>(j, tile, x, acc);
      });
    case Fmt::kQ4_0:
      return int8_tiles_with<kRowsInt8>(j, t0, t1, [&](auto rows, int64_t tile, const XRows& x, float* acc) {
        int8_pass_q4<rows.value, false>(j, tile, x, acc);
      });
    case Fmt::kQ4_1:
      return int8_tiles_with<kRowsInt8>(j, t0, t1, [&](auto rows, int64_t tile, const XRows& x, float* acc) {
        int8_pass_q4<rows.value, true>(j, tile, x, acc);
      });
    case Fmt::kQ4_K:  // two accumulators a row
      return int8_tiles_with<std::max(1, kRowsInt8 / 2)>(
          j, t0, t1, [&](auto rows, int64_t tile, const XRows& x, float* acc) {
            int8_pass_q4_k<rows.value>(j, tile, x, acc);
          });
    default:
      TORCH_CHECK(false, "packed_linear: no int8 path for this format");
  }
}

#undef PACKED_EACH
