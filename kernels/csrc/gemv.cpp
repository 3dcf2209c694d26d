// Few-row GEMM on pre-blocked weights for the host CPU: deepinfer::blocked_linear.
//
// Why: a decode step with a few rows is a weight stream; every weight byte is used T times, so the step runs at
// memory bandwidth or not at all. MKL's sgemm and oneDNN's packed GEMM reach 35-60% of the read bandwidth at
// T = 1. Here the weight is blocked once at load (kernels/gemv.py) into tiles of 16 output rows, each tile
// stored k-major: fp32 [tiles, in, 16] (one 64-byte line per k), bf16 [tiles, ceil(in/2), 32] (the 16 rows' pair
// (k, k+1) in each 32-bit lane, vdpbf16ps's operand layout). A thread's range of tiles is one contiguous stream
// with no per-call packing; each k step is one weight vector times a broadcast activation per row, into 16
// fp32 accumulators per row (no horizontal sums). Threads take disjoint tile ranges (at::parallel_for).
//
// The same layout is the packed-B panel of a GEMM micro-kernel, so larger T loops over row blocks of 8 (AVX-512)
// or 4 (AVX2) with two tiles (32 columns) per pass: 16 accumulators, 2 weight loads and 8 broadcasts per 16 FMAs.
//
// ISA: chosen at run time from the CPU's flags (never from the build machine): AVX-512 (F/BW/VL/DQ) with
// vdpbf16ps for bf16 x bf16 where avx512_bf16 exists, else bf16 -> fp32 by shifts and FMA; AVX2 + FMA; plain C++.
// Functions carry target attributes, so one build holds every path whatever flags the file is compiled with.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "gemm_amx.h"
#include "gemm_epilogues.h"
#include "gemm_micro_kernels.h"

namespace {

using namespace deepinfer::gemm_micro;
static_assert(kMaxTiles * kTile == deepinfer::gemm_epilogues::kAccStride, "the epilogues read acc rows of two tiles");
using deepinfer::gemm_epilogues::store_add_block;
using deepinfer::gemm_epilogues::store_block;
using deepinfer::gemm_epilogues::store_silu_block;

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

#ifdef DEEPINFER_X86
bool cpu_has(const char* feature_set) {
  // __builtin_cpu_supports needs literal names; the sets below are what each path's target attribute uses.
  const std::string set(feature_set);
  if (set == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (set == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && cpu_has("avx2");
  if (set == "avx512bf16") return cpu_has("avx512") && __builtin_cpu_supports("avx512bf16");
  return false;
}
#else
bool cpu_has(const char*) { return false; }
#endif  // DEEPINFER_X86

Isa best_isa() {
  static const Isa isa = cpu_has("avx512bf16") ? Isa::kAvx512Bf16
                         : cpu_has("avx512")   ? Isa::kAvx512
                         : cpu_has("avx2")     ? Isa::kAvx2
                                               : Isa::kScalar;
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// "amx_bf16" (bf16 x bf16 on AMX tiles, gemm_amx.cpp) is not an Isa of the micro-kernel table: its other kinds run
// the best table there is.
Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  if (name == "amx_bf16") {
    TORCH_CHECK(deepinfer::amx_bf16_usable(), "blocked_linear: isa 'amx_bf16' is not supported by this CPU (best: ",
                isa_name(best_isa()), ")");
    return best_isa();
  }
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best_isa()), "blocked_linear: isa '", name,
                  "' is not supported by this CPU (best: ", isa_name(best_isa()), ")");
      return isa;
    }
  }
  TORCH_CHECK(false, "blocked_linear: isa must be auto, amx_bf16, avx512_bf16, avx512, avx2 or scalar, got '", name,
              "'");
}

// The micro-kernel table of one (ISA, kind): [rows - 1][tiles - 1], and its row / tile block sizes.
struct KernelSet {
  MicroKernel fn[kMaxRows][kMaxTiles] = {};
  int max_rows = 1;
  int max_tiles = 1;
};

template <template <int, int, Kind> class Maker, Kind K, int R, int NT>
void fill_rows(KernelSet& set) {  // entries (R, 1..NT)
  set.fn[R - 1][NT - 1] = Maker<R, NT, K>::fn;
  if constexpr (NT > 1) fill_rows<Maker, K, R, NT - 1>(set);
}

template <template <int, int, Kind> class Maker, Kind K, int R, int MaxNT>
void fill_all(KernelSet& set) {
  fill_rows<Maker, K, R, MaxNT>(set);
  if constexpr (R > 1) fill_all<Maker, K, R - 1, MaxNT>(set);
}

template <template <int, int, Kind> class Maker, Kind K, int MaxR, int MaxNT>
KernelSet make_set() {
  KernelSet set;
  set.max_rows = MaxR;
  set.max_tiles = MaxNT;
  fill_all<Maker, K, MaxR, MaxNT>(set);
  return set;
}

template <int R, int NT, Kind K> struct ScalarMaker { static constexpr MicroKernel fn = &micro_scalar<R, NT, K>; };
#ifdef DEEPINFER_X86
template <int R, int NT, Kind K> struct Avx2Maker { static constexpr MicroKernel fn = &micro_avx2<R, NT, K>; };
template <int R, int NT, Kind K> struct Avx512Maker { static constexpr MicroKernel fn = &micro_avx512<R, NT, K>; };
template <int R, int NT, Kind K> struct Avx512Bf16Maker {
  static constexpr MicroKernel fn = &micro_avx512_bf16<R, NT, K>;
};
#endif

const KernelSet& kernels_for(Isa isa, Kind kind) {
  static const KernelSet scalar[3] = {make_set<ScalarMaker, Kind::kF32, 4, 1>(),
                                      make_set<ScalarMaker, Kind::kBf16W, 4, 1>(),
                                      make_set<ScalarMaker, Kind::kBf16WX, 4, 1>()};
#ifdef DEEPINFER_X86
  static const KernelSet avx2[2] = {make_set<Avx2Maker, Kind::kF32, 4, 1>(), make_set<Avx2Maker, Kind::kBf16W, 4, 1>()};
  static const KernelSet avx512[2] = {make_set<Avx512Maker, Kind::kF32, kMaxRows, kMaxTiles>(),
                                      make_set<Avx512Maker, Kind::kBf16W, kMaxRows, kMaxTiles>()};
  static const KernelSet avx512_bf16 = make_set<Avx512Bf16Maker, Kind::kBf16WX, kMaxRows, kMaxTiles>();
  if (kind == Kind::kBf16WX && isa == Isa::kAvx512Bf16) return avx512_bf16;
  if (kind != Kind::kBf16WX) {  // bf16 activations without vdpbf16ps are widened to fp32 by the caller
    if (isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16) return avx512[static_cast<int>(kind)];
    if (isa == Isa::kAvx2) return avx2[static_cast<int>(kind)];
  }
#endif
  return scalar[static_cast<int>(kind)];
}

// What a pass's sums become: y (+ bias); that plus a residual; or SiLU(gate) * up of a (gate, up) tile pair.
enum class Epilogue { kStore, kAddResidual, kSiluMul, kArgmax };

// A row's best (value, column) so far, as torch's max(dim).indices ranks them: a NaN above every number (the
// first NaN wins), otherwise the larger value, and on a tie the lower column.
struct Best {
  float value = 0.f;
  int64_t column = -1;

  void offer(float v, int64_t c) {
    if (column < 0) {
      value = v, column = c;
      return;
    }
    const bool v_nan = std::isnan(v), best_nan = std::isnan(value);
    const bool better = v_nan ? (!best_nan || c < column) : (!best_nan && (v > value || (v == value && c < column)));
    if (better) value = v, column = c;
  }

  // Up to 32 values of columns col0.. : the block's first NaN, else its largest (first column), then one offer.
  void offer_block(const float* v, int64_t n, int64_t col0) {
    int64_t arg = 0;
#ifdef __AVX512F__
    if (n == 32) {
      const __m512 lo = _mm512_loadu_ps(v), hi = _mm512_loadu_ps(v + 16);
      const uint32_t nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) |
                           (static_cast<uint32_t>(_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) << 16);
      if (nan != 0) {
        arg = __builtin_ctz(nan);
      } else {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(lo, hi)));
        const uint32_t at = _mm512_cmp_ps_mask(lo, top, _CMP_EQ_OQ) |
                            (static_cast<uint32_t>(_mm512_cmp_ps_mask(hi, top, _CMP_EQ_OQ)) << 16);
        arg = __builtin_ctz(at);
      }
      offer(v[arg], col0 + arg);
      return;
    }
#endif
    for (int64_t c = 1; c < n && !std::isnan(v[arg]); ++c) {
      if (std::isnan(v[c]) || v[c] > v[arg]) arg = c;
    }
    offer(v[arg], col0 + arg);
  }
};

// out_features counts the weight's rows (gate and up together for kSiluMul, whose y has half as many columns).
// float_out: y in fp32 whatever x's dtype (values rounded to x's dtype first).
// kArgmax: y is [rows] int64, each row's argmax over the values float_out would store, none stored.
template <Epilogue E>
at::Tensor run_blocked(const at::Tensor& x, const at::Tensor& blocked, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, c10::string_view isa_name_arg, const at::Tensor* residual,
                       bool float_out = false) {
  TORCH_CHECK(x.dim() == 2, "blocked_linear: x must be [rows, in], got ", x.dim(), " dims");
  TORCH_CHECK(blocked.dim() == 3 && blocked.is_contiguous(),
              "blocked_linear: blocked must be a contiguous [tiles, k, lanes] tensor from kernels/gemv.py");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "blocked_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  const bool w_bf16 = blocked.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w_bf16 || blocked.scalar_type() == at::kFloat, "blocked_linear: blocked weight must be float32 or "
              "bfloat16, got ", blocked.scalar_type());
  const int64_t rows = x.size(0), in = x.size(1), tiles = blocked.size(0);
  TORCH_CHECK(in > 0, "blocked_linear: in_features must be >= 1, got ", in);
  const int64_t in_blocked = w_bf16 ? (in + 1) / 2 : in;
  TORCH_CHECK(blocked.size(1) == in_blocked && blocked.size(2) == (w_bf16 ? 2 : 1) * kTile,
              "blocked_linear: blocked weight ", blocked.sizes(), " does not match x's in_features ", in);
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, "blocked_linear: out_features ",
              out_features, " does not fit ", tiles, " tiles of ", kTile);
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "blocked_linear: bias must be [", out_features,
                "], got ", bias->sizes());
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const Isa isa = parse_isa(std::string(isa_name_arg));
  at::Tensor xc = x.contiguous();
  Kind kind = !w_bf16 ? Kind::kF32 : (xc.scalar_type() == at::kBFloat16 ? Kind::kBf16WX : Kind::kBf16W);
  if (kind == Kind::kBf16WX && isa != Isa::kAvx512Bf16 && isa != Isa::kScalar) {
    xc = xc.to(at::kFloat);  // no vdpbf16ps: widen the (few) activation rows, then bf16 -> fp32 by shifts
    kind = Kind::kBf16W;
  } else if (kind == Kind::kF32 && xc.scalar_type() == at::kBFloat16) {
    xc = xc.to(at::kFloat);
  }
  const int64_t y_cols = E == Epilogue::kSiluMul ? out_features / 2 : out_features;
  at::Tensor y = E == Epilogue::kArgmax ? at::empty({rows}, x.options().dtype(at::kLong))
                 : at::empty({rows, y_cols}, float_out ? x.options().dtype(at::kFloat) : x.options());
  const bool round_bf16 = (float_out || E == Epilogue::kArgmax) && x.scalar_type() == at::kBFloat16;
  if (rows == 0) return y;
  // kArgmax: each thread's best per row over the units it ran; merged by finish().
  const int64_t threads = at::get_num_threads();
  std::vector<Best> best(E == Epilogue::kArgmax ? static_cast<size_t>(threads * rows) : 0);
  auto finish = [&]() -> at::Tensor {
    if constexpr (E == Epilogue::kArgmax) {
      for (int64_t row = 0; row < rows; ++row) {
        Best all;
        for (int64_t t = 0; t < threads; ++t) {
          const Best& b = best[t * rows + row];
          if (b.column >= 0) all.offer(b.value, b.column);
        }
        y.data_ptr<int64_t>()[row] = all.column;
      }
    }
    return y;
  };
  const KernelSet& set = kernels_for(isa, kind);
  // AMX tiles for bf16 x bf16 from 2 rows (0.65-0.70x oneDNN's time and below vdpbf16ps's from 2 to 32 rows;
  // one row stays on vdpbf16ps, as fast there), or when asked by name; whole 32-wide k blocks only.
  const bool amx = kind == Kind::kBf16WX && in % 32 == 0 &&
                   (isa_name_arg == "amx_bf16" || (isa_name_arg == "auto" && rows > 1)) &&
                   deepinfer::amx_bf16_usable();
  if (amx && rows % 16 != 0) {  // A tiles read whole 16-row blocks: pad with zero rows
    at::Tensor padded = at::zeros({(rows + 15) / 16 * 16, in}, xc.options());
    padded.narrow(0, 0, rows).copy_(xc);
    xc = padded;
  }
  const int64_t tile_stride = blocked.size(1) * blocked.size(2);  // elements per tile
  const int64_t tile_bytes = tile_stride * blocked.element_size();
  // A unit is the tiles one micro-kernel pass covers: max_tiles adjacent tiles, or a (gate j, up j) pair whose
  // second tile lies tiles / 2 tiles further on (the pass's tile stride says so).
  const int64_t tiles_per_unit = E == Epilogue::kSiluMul ? 2 : set.max_tiles;
  const int64_t units = E == Epilogue::kSiluMul ? tiles / 2 : (tiles + set.max_tiles - 1) / set.max_tiles;
  // Below ~64 KiB of weights a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (tile_bytes * tiles_per_unit));
  // From a unit's first tile to the next unit's (a gate tile's neighbour is the next gate tile).
  const int64_t next_unit_bytes = (E == Epilogue::kSiluMul ? 1 : tiles_per_unit) * tile_bytes;
  const char* x_ptr = static_cast<const char*>(xc.data_ptr());
  const int64_t x_row_bytes = in * xc.element_size();
  const char* w_ptr = static_cast<const char*>(blocked.data_ptr());
  const float* bias_ptr = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const bool y_bf16 = y.scalar_type() == at::kBFloat16;
  void* y_ptr = y.data_ptr();
  const void* residual_ptr = residual != nullptr ? residual->data_ptr() : nullptr;
  // A pass's sums (rows [row0, row0 + r), columns [col0, col0 + cols); acc rows 32 floats apart) into y.
  auto store = [&](const float* acc, int64_t row0, int r, int64_t col0, int64_t cols) {
    if constexpr (E == Epilogue::kArgmax) {
      Best* mine = best.data() + at::get_thread_num() * rows + row0;
      float values[deepinfer::gemm_epilogues::kAccStride];
      for (int i = 0; i < r; ++i) {
        const float* a = acc + i * deepinfer::gemm_epilogues::kAccStride;
        if (round_bf16) {  // the values blocked_linear_float would store
          for (int64_t c = 0; c < cols; ++c) values[c] = static_cast<float>(c10::BFloat16(a[c]));
        }
        mine[i].offer_block(round_bf16 ? values : a, cols, col0);
      }
    } else if constexpr (E == Epilogue::kSiluMul) {
      if (y_bf16) {
        store_silu_block(acc, static_cast<c10::BFloat16*>(y_ptr), y_cols, row0, r, col0);
      } else {
        store_silu_block(acc, static_cast<float*>(y_ptr), y_cols, row0, r, col0);
      }
    } else if constexpr (E == Epilogue::kAddResidual) {
      if (y_bf16) {
        store_add_block(acc, bias_ptr, static_cast<const c10::BFloat16*>(residual_ptr),
                        static_cast<c10::BFloat16*>(y_ptr), out_features, row0, r, col0, cols);
      } else {
        store_add_block(acc, bias_ptr, static_cast<const float*>(residual_ptr), static_cast<float*>(y_ptr),
                        out_features, row0, r, col0, cols);
      }
    } else if (y_bf16) {
      store_block(acc, bias_ptr, static_cast<c10::BFloat16*>(y_ptr), out_features, row0, r, col0, cols);
    } else if (round_bf16) {
      store_block<float, c10::BFloat16>(acc, bias_ptr, static_cast<float*>(y_ptr), out_features, row0, r, col0,
                                        cols);
    } else {
      store_block(acc, bias_ptr, static_cast<float*>(y_ptr), out_features, row0, r, col0, cols);
    }
  };
  // The unit's first tile, its tile count, and where its second tile starts.
  auto unit_tiles = [&](int64_t unit) {
    const int64_t tile0 = E == Epilogue::kSiluMul ? unit : unit * tiles_per_unit;
    const int nt = static_cast<int>(std::min<int64_t>(tiles_per_unit, tiles - tile0));
    const int64_t second = E == Epilogue::kSiluMul ? tile0 + tiles / 2 : tile0 + (nt > 1 ? 1 : 0);
    return std::make_tuple(tile0, nt, second);
  };
  if (amx) {
    const auto* xb = static_cast<const c10::BFloat16*>(xc.data_ptr());
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
      deepinfer::amx_configure_thread();
      alignas(64) float acc[32 * kMaxTiles * kTile];
      for (int64_t unit = begin; unit < end; ++unit) {
        const auto [tile0, nt, second] = unit_tiles(unit);
        const auto* w0 = reinterpret_cast<const c10::BFloat16*>(w_ptr + tile0 * tile_bytes);
        const auto* w1 = reinterpret_cast<const c10::BFloat16*>(w_ptr + second * tile_bytes);
        const int64_t col0 = tile0 * kTile, cols = std::min<int64_t>(nt * kTile, out_features - col0);
        for (int64_t row0 = 0; row0 < rows; row0 += 32) {
          const int r = static_cast<int>(std::min<int64_t>(32, rows - row0));
          deepinfer::amx_tile_pair(xb + row0 * in, in, (r + 15) / 16, w0, w1, in, acc);
          store(acc, row0, r, col0, cols);
        }
      }
      deepinfer::amx_release_thread();
    });
    return finish();
  }
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows * kMaxTiles * kTile];
    alignas(64) float up_acc[kMaxRows * kMaxTiles * kTile];
    for (int64_t unit = begin; unit < end; ++unit) {
      const auto [tile0, nt, second] = unit_tiles(unit);
      const int64_t col0 = tile0 * kTile, cols = std::min<int64_t>(nt * kTile, out_features - col0);
      // The pass's tile stride reaches the unit's second tile (the next one, or gate j's up tile).
      const int64_t pass_stride = (nt > 1 ? second - tile0 : 1) * tile_stride;
      for (int64_t row0 = 0, pass = 0; row0 < rows; row0 += set.max_rows, ++pass) {
        const int r = static_cast<int>(std::min<int64_t>(set.max_rows, rows - row0));
        const char* xr = x_ptr + row0 * x_row_bytes;
        const char* w0 = w_ptr + tile0 * tile_bytes;
        // Only a unit's first pass waits on DRAM; the second, reading L2, fetches the next unit's tiles for it
        // (Zen 4, fp32, SmolLM2's layers streamed: 0.95x the time at 32 rows, 0.93x at 16).
        const int64_t prefetch = pass == 1 ? next_unit_bytes : kPrefetchBytes;
        if (E == Epilogue::kSiluMul && set.max_tiles < 2) {  // one tile a pass: up's sums go beside gate's
          set.fn[r - 1][0](xr, in, w0, tile_stride, in, acc, prefetch);
          set.fn[r - 1][0](xr, in, w_ptr + second * tile_bytes, tile_stride, in, up_acc, prefetch);
          for (int row = 0; row < r; ++row) {
            std::memcpy(acc + row * kMaxTiles * kTile + kTile, up_acc + row * kMaxTiles * kTile, kTile * 4);
          }
        } else {
          set.fn[r - 1][nt - 1](xr, in, w0, pass_stride, in, acc, prefetch);
        }
        store(acc, row0, r, col0, cols);
      }
    }
  });
  return finish();
}

at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& blocked, const c10::optional<at::Tensor>& bias,
                          int64_t out_features, c10::string_view isa) {
  return run_blocked<Epilogue::kStore>(x, blocked, bias, out_features, isa, nullptr);
}

// blocked_linear(x, blocked, None, out_features).float() without a second pass over the [rows, out] output (a
// bf16 model's fp32 logits for the sampler).
at::Tensor blocked_linear_float(const at::Tensor& x, const at::Tensor& blocked, int64_t out_features,
                                c10::string_view isa) {
  return run_blocked<Epilogue::kStore>(x, blocked, c10::nullopt, out_features, isa, nullptr, true);
}

// row_argmax(blocked_linear_float(x, blocked, out_features)) [rows] int64 without storing the logits: greedy
// steps of a head no screen covers (a bf16 head past 4 rows: its [32, 49152] fp32 logits cost ~0.6 ms to store
// and 0.3 ms to scan on Zen 4). The same passes give each column the same bits.
at::Tensor blocked_linear_argmax(const at::Tensor& x, const at::Tensor& blocked, int64_t out_features,
                                 c10::string_view isa) {
  return run_blocked<Epilogue::kArgmax>(x, blocked, c10::nullopt, out_features, isa, nullptr);
}

// x @ W^T (+ bias) + residual [rows, out_features] of x's dtype, rounded as the two unfused ops round it.
at::Tensor blocked_linear_add(const at::Tensor& x, const at::Tensor& blocked, const c10::optional<at::Tensor>& bias,
                              int64_t out_features, const at::Tensor& residual_in, c10::string_view isa) {
  TORCH_CHECK(residual_in.dim() == 2 && residual_in.size(0) == x.size(0) && residual_in.size(1) == out_features &&
                  residual_in.scalar_type() == x.scalar_type(),
              "blocked_linear_add: residual must be [", x.size(0), ", ", out_features, "] of x's dtype (",
              x.scalar_type(), "), got ", residual_in.sizes(), " ", residual_in.scalar_type());
  const at::Tensor residual = residual_in.contiguous();
  return run_blocked<Epilogue::kAddResidual>(x, blocked, bias, out_features, isa, &residual);
}

// silu(x @ Wg^T) * (x @ Wu^T) [rows, intermediate] for a gate_up weight blocked as one [gate; up] matrix: the
// [rows, 2 * intermediate] product is never stored. Equal to the bit to blocked_linear, then silu_and_mul.
at::Tensor blocked_linear_silu_mul(const at::Tensor& x, const at::Tensor& blocked, int64_t intermediate,
                                   c10::string_view isa) {
  TORCH_CHECK(intermediate >= 1 && intermediate % kTile == 0 && blocked.dim() == 3 &&
                  blocked.size(0) * kTile == 2 * intermediate,
              "blocked_linear_silu_mul: intermediate (", intermediate, ") must be a multiple of ", kTile,
              " and the blocked weight must hold its gate and up rows (", 2 * intermediate / kTile, " tiles), got ",
              blocked.sizes());
  return run_blocked<Epilogue::kSiluMul>(x, blocked, c10::nullopt, 2 * intermediate, isa, nullptr);
}

std::string blocked_linear_isa() {
  return best_isa() == Isa::kAvx512Bf16 && deepinfer::amx_bf16_usable() ? "amx_bf16" : isa_name(best_isa());
}

}  // namespace

namespace deepinfer {

// y [rows, out_features] (row stride out_features) = x [rows, in] (row stride in, fp32) @ W^T, W blocked as
// kernels/gemv.py lays it out (fp32, or bf16 pairs); the best ISA of this CPU, threads over tile ranges.
// For other C++ ops that run many small GEMMs on blocked weights (grouped_experts.cpp).
void blocked_gemm_f32(const float* x, int64_t rows, int64_t in, const void* w, bool w_bf16, int64_t tiles,
                      int64_t out_features, float* y) {
  const KernelSet& set = kernels_for(best_isa(), w_bf16 ? Kind::kBf16W : Kind::kF32);
  const int64_t units = (tiles + set.max_tiles - 1) / set.max_tiles;
  const int64_t tile_stride = (w_bf16 ? (in + 1) / 2 * 2 : in) * kTile;  // elements per tile
  const int64_t tile_bytes = tile_stride * (w_bf16 ? 2 : 4);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (tile_bytes * set.max_tiles));
  const char* w_ptr = static_cast<const char*>(w);
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows * kMaxTiles * kTile];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t tile0 = unit * set.max_tiles;
      const int nt = static_cast<int>(std::min<int64_t>(set.max_tiles, tiles - tile0));
      const int64_t col0 = tile0 * kTile, cols = std::min<int64_t>(nt * kTile, out_features - col0);
      for (int64_t row0 = 0, pass = 0; row0 < rows; row0 += set.max_rows, ++pass) {
        const int r = static_cast<int>(std::min<int64_t>(set.max_rows, rows - row0));
        const int64_t prefetch = pass == 1 ? set.max_tiles * tile_bytes : kPrefetchBytes;  // as in run_blocked
        set.fn[r - 1][nt - 1](x + row0 * in, in, w_ptr + tile0 * tile_bytes, tile_stride, in, acc, prefetch);
        store_block(acc, nullptr, y, out_features, row0, r, col0, cols);
      }
    }
  });
}

}  // namespace deepinfer

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("blocked_linear(Tensor x, Tensor blocked, Tensor? bias, int out_features, str isa=\"auto\") -> Tensor");
  m.def("blocked_linear_add(Tensor x, Tensor blocked, Tensor? bias, int out_features, Tensor residual, "
        "str isa=\"auto\") -> Tensor");
  m.def("blocked_linear_float(Tensor x, Tensor blocked, int out_features, str isa=\"auto\") -> Tensor");
  m.def("blocked_linear_argmax(Tensor x, Tensor blocked, int out_features, str isa=\"auto\") -> Tensor");
  m.def("blocked_linear_silu_mul(Tensor x, Tensor blocked, int intermediate, str isa=\"auto\") -> Tensor");
  m.def("blocked_linear_isa() -> str", &blocked_linear_isa);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("blocked_linear", &blocked_linear);
  m.impl("blocked_linear_add", &blocked_linear_add);
  m.impl("blocked_linear_float", &blocked_linear_float);
  m.impl("blocked_linear_argmax", &blocked_linear_argmax);
  m.impl("blocked_linear_silu_mul", &blocked_linear_silu_mul);
}
