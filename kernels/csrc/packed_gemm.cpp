// GEMMs on weights that stay in their checkpoint's quantized format: deepinfer::packed_linear,
// y [rows, out] = x [rows, in] @ W^T (+ bias), W one of
//   fp8  float8_e4m3fn with a scale per (block_n x block_k) block (DeepSeek's 128x128; ue8m0 or fp32 scales),
//   fp4  e2m1, two codes a byte, an e8m0 scale per row per 32 inputs (DeepSeek-V4's routed experts),
//   GGUF Q8_0, Q4_0, Q4_1 (32-input blocks) and Q4_K (256-input super-blocks),
// each repacked once at load into 16-row tiles of the same bytes (kernels/packed_weights.py documents the
// layouts), read here and widened in registers. Two paths:
//   fp32  the weights widened to fp32 exactly as the reference dequantizes them, FMA with fp32 activations:
//         the reference's function up to summation order (every format);
//   int8  GGUF only: each activation row quantized to int8 per 32 inputs (d = amax / 127, round half to even:
//         llama.cpp's Q8 activations), integer dot products (VNNI vpdpbusd, else vpmaddubsw), the block's scales
//         applied to the int32 sums: the reference's function of the rounded activations.
// Instruction sets, picked at run time from the CPU's flags (whatever flags built the file; each set's code is
// compiled under its own `#pragma GCC target`): fp32 path avx512 > avx2 > scalar; int8 path avx512_vnni >
// avx_vnni > avx512 (vpmaddubsw) > avx2 (vpmaddubsw) > scalar. The kernel bodies are written once
// (packed/body.h) over per-set primitives (packed/isa_*.h). Threads take disjoint ranges of output tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PACKED_X86 1
#endif

#define PACKED_INLINE inline __attribute__((always_inline))

namespace deepinfer::packed {

constexpr int64_t kTile = 16;  // output rows per tile

enum class Fmt { kFp8, kFp4, kQ8_0, kQ4_0, kQ4_1, kQ4_K };

// e2m1 code -> value (kernels/fp4.py's E2M1_VALUES); the AVX2 path reads the first 8 as magnitudes.
alignas(64) constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                         -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Job {
  Fmt fmt;
  const uint8_t* data;         // the packed bytes
  const float* fp8_scale;      // fp8: [ceil(out / block_n), scale_cols] fp32
  const uint8_t* fp4_scale;    // fp4: [tiles, in / 32, 16] e8m0 exponents
  int64_t scale_cols, block_n, block_k;  // fp8
  int64_t blocks, block_bytes;           // GGUF: blocks per row, bytes per (tile, block)
  int64_t in, out, rows;
  const float* x;              // fp32 path: [rows, in]
  const int8_t* xq;            // int8 path: [rows, in]
  const float* xd;             // [rows, in / 32]
  const int32_t* xsum;         // [rows, in / 32]
  const float* xs;             // [rows, in / 32] = xd * xsum
  const float* bias;           // [out] or null
  void* y;                     // [rows, out]
  bool y_bf16;
};

// A tile's sums for rows [row0, row0 + nrows) (acc rows kTile floats apart) + bias into y.
void store_rows(const Job& j, int64_t tile, int64_t row0, int64_t nrows, const float* acc) {
  const int64_t col0 = tile * kTile, cols = std::min<int64_t>(kTile, j.out - col0);
  for (int64_t r = 0; r < nrows; ++r) {
    const float* a = acc + r * kTile;
    const int64_t at = (row0 + r) * j.out + col0;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = j.bias != nullptr ? a[c] + j.bias[col0 + c] : a[c];
      if (j.y_bf16) {
        static_cast<c10::BFloat16*>(j.y)[at + c] = c10::BFloat16(v);
      } else {
        static_cast<float*>(j.y)[at + c] = v;
      }
    }
  }
}

namespace scalar_isa {
#define PACKED_VNNI 0
#define PACKED_WIDEN 1
#include "packed/isa_scalar.h"
#include "packed/body.h"
#undef PACKED_VNNI
#undef PACKED_WIDEN
}  // namespace scalar_isa

#ifdef PACKED_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2_isa {
#define PACKED_VNNI 0
#define PACKED_WIDEN 1
#include "packed/isa_avx2.h"
#include "packed/body.h"
#undef PACKED_VNNI
#undef PACKED_WIDEN
}  // namespace avx2_isa
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace avx_vnni_isa {
#define PACKED_VNNI 1
#define PACKED_WIDEN 0
#include "packed/isa_avx2.h"
#include "packed/body.h"
#undef PACKED_VNNI
#undef PACKED_WIDEN
}  // namespace avx_vnni_isa
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512_isa {
#define PACKED_VNNI 0
#define PACKED_WIDEN 1
#include "packed/isa_avx512.h"
#include "packed/body.h"
#undef PACKED_VNNI
#undef PACKED_WIDEN
}  // namespace avx512_isa
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace avx512_vnni_isa {
#define PACKED_VNNI 1
#define PACKED_WIDEN 0
#include "packed/isa_avx512.h"
#include "packed/body.h"
#undef PACKED_VNNI
#undef PACKED_WIDEN
}  // namespace avx512_vnni_isa
#pragma GCC pop_options
#endif  // PACKED_X86

// ------------------------------------------------------------------------------------------- dispatch -------
// Best first; an Isa runs the int8 path with its own dot product and the fp32 path with its base set's kernels.
enum class Isa { kAvx512Vnni, kAvxVnni, kAvx512, kAvx2, kScalar };
constexpr Isa kIsas[] = {Isa::kAvx512Vnni, Isa::kAvxVnni, Isa::kAvx512, Isa::kAvx2, Isa::kScalar};

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvxVnni: return "avx_vnni";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

bool isa_supported(Isa isa) {
#ifdef PACKED_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    default: return true;
  }
#else
  return isa == Isa::kScalar;
#endif
}

Isa best_isa() {
  for (Isa isa : kIsas)
    if (isa_supported(isa)) return isa;
  return Isa::kScalar;
}

Isa parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  for (Isa isa : kIsas) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(isa_supported(isa), "packed_linear: isa '", name, "' is not supported by this CPU (supported: ",
                  "see packed_linear_isas(); best: ", isa_name(best_isa()), ")");
      return isa;
    }
  }
  TORCH_CHECK(false, "packed_linear: isa must be auto, avx512_vnni, avx_vnni, avx512, avx2 or scalar, got '", name,
              "'");
}

using TileFn = void (*)(const Job&, int64_t, int64_t);

TileFn widen_fn(Isa isa) {
#ifdef PACKED_X86
  if (isa == Isa::kAvx512Vnni || isa == Isa::kAvx512) return &avx512_isa::widen_tiles;
  if (isa == Isa::kAvxVnni || isa == Isa::kAvx2) return &avx2_isa::widen_tiles;
#endif
  return &scalar_isa::widen_tiles;
}

TileFn int8_fn(Isa isa) {
#ifdef PACKED_X86
  switch (isa) {
    case Isa::kAvx512Vnni: return &avx512_vnni_isa::int8_tiles;
    case Isa::kAvxVnni: return &avx_vnni_isa::int8_tiles;
    case Isa::kAvx512: return &avx512_isa::int8_tiles;
    case Isa::kAvx2: return &avx2_isa::int8_tiles;
    default: break;
  }
#endif
  return &scalar_isa::int8_tiles;
}

struct FmtInfo {
  const char* name;
  Fmt fmt;
  int64_t block_k;      // GGUF: inputs per block (fp8: from the block argument; fp4: 32 per scale)
  int64_t block_bytes;  // GGUF: bytes per (tile, block) = 16 rows x the file's block bytes
};
constexpr FmtInfo kFormats[] = {
    {"fp8_e4m3", Fmt::kFp8, 0, 0},   {"fp4_e2m1", Fmt::kFp4, 32, 0},   {"q8_0", Fmt::kQ8_0, 32, 16 * 34},
    {"q4_0", Fmt::kQ4_0, 32, 16 * 18}, {"q4_1", Fmt::kQ4_1, 32, 16 * 20}, {"q4_k", Fmt::kQ4_K, 256, 16 * 144},
};

const FmtInfo& parse_fmt(const std::string& name) {
  for (const FmtInfo& f : kFormats)
    if (name == f.name) return f;
  TORCH_CHECK(false, "packed_linear: fmt must be fp8_e4m3, fp4_e2m1, q8_0, q4_0, q4_1 or q4_k, got '", name, "'");
}

bool is_gguf(Fmt fmt) { return fmt != Fmt::kFp8 && fmt != Fmt::kFp4; }

// llama.cpp's Q8 activation blocks: per row per 32 inputs d = amax / 127, q = round_half_even(x / d) (x * (1 / d),
// as llama.cpp computes it; |q| <= 127), sum = sum(q), s = d * sum.
void quantize_rows(const float* x, int64_t rows, int64_t in, int8_t* q, float* d, int32_t* sum, float* s) {
  const int64_t nb = in / 32;
  // A decode step's few rows take ~microseconds: a second parallel region would cost more than it saves.
  at::parallel_for(0, rows * nb, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb;
      const float* xb = x + r * in + 32 * b;
      float amax = 0.f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float dd = amax / 127.f;
      const float id = dd != 0.f ? 1.f / dd : 0.f;
      int8_t* qb = q + r * in + 32 * b;
      int32_t total = 0;
      for (int k = 0; k < 32; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * id));
        qb[k] = static_cast<int8_t>(v);
        total += v;
      }
      d[i] = dd;
      sum[i] = total;
      s[i] = dd * static_cast<float>(total);
    }
  });
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& bias, c10::string_view fmt_name, int64_t out_features,
                         at::IntArrayRef block, c10::string_view path_name, c10::string_view isa_name_arg) {
  const FmtInfo& info = parse_fmt(std::string(fmt_name));
  const Isa isa = parse_isa(std::string(isa_name_arg));
  const std::string path(path_name);
  TORCH_CHECK(path == "auto" || path == "fp32" || path == "int8", "packed_linear: path must be auto, fp32 or int8, "
              "got '", path, "'");
  TORCH_CHECK(path != "int8" || is_gguf(info.fmt), "packed_linear: the int8 path is for GGUF formats (q8_0, q4_0, "
              "q4_1, q4_k), not ", info.name);
  // auto: int8 for GGUF (kernels/packed_gemm.py: measured faster at 1 and 32 rows), fp32 for fp8 / fp4.
  const bool int8 = path == "int8" || (path == "auto" && is_gguf(info.fmt));
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [rows, in], got ", x.dim(), " dims");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "packed_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.is_contiguous(),
              "packed_linear: data must be a contiguous uint8 [tiles, ., .] tensor from kernels/packed_weights.py, "
              "got ", data.scalar_type(), " ", data.sizes());
  const int64_t rows = x.size(0), in = x.size(1), tiles = data.size(0);
  TORCH_CHECK(in >= 1, "packed_linear: in_features must be >= 1, got ", in);
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, "packed_linear: out_features ",
              out_features, " does not fit ", tiles, " tiles of ", kTile);
  Job j{};
  j.fmt = info.fmt;
  j.in = in;
  j.out = out_features;
  j.rows = rows;
  at::Tensor scale_f32;
  if (info.fmt == Fmt::kFp8) {
    TORCH_CHECK(block.size() == 2 && block[0] >= kTile && block[0] % kTile == 0 && block[1] >= 1,
                "packed_linear: fp8 needs block [block_n, block_k] with block_n a multiple of ", kTile, ", got ",
                block);
    j.block_n = block[0];
    j.block_k = block[1];
    TORCH_CHECK(data.size(1) == in && data.size(2) == kTile, "packed_linear: fp8 data ", data.sizes(),
                " does not match x's in_features ", in);
    const int64_t grid_rows = (out_features + j.block_n - 1) / j.block_n, grid_cols = (in + j.block_k - 1) / j.block_k;
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == grid_rows && scales.size(1) == grid_cols,
                "packed_linear: fp8 scales must be [", grid_rows, ", ", grid_cols, "], got ", scales.sizes());
    scale_f32 = scales.to(at::kFloat).contiguous();
    j.fp8_scale = scale_f32.data_ptr<float>();
    j.scale_cols = grid_cols;
  } else if (info.fmt == Fmt::kFp4) {
    TORCH_CHECK(in % 32 == 0 && data.size(1) == in / 2 && data.size(2) == kTile, "packed_linear: fp4 data ",
                data.sizes(), " does not match x's in_features ", in, " (a multiple of 32)");
    TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 3 &&
                    scales.size(0) == tiles && scales.size(1) == in / 32 && scales.size(2) == kTile,
                "packed_linear: fp4 scales must be contiguous uint8 [", tiles, ", ", in / 32, ", ", kTile, "], got ",
                scales.scalar_type(), " ", scales.sizes());
    j.fp4_scale = scales.data_ptr<uint8_t>();
  } else {
    TORCH_CHECK(in % info.block_k == 0 && data.size(1) == in / info.block_k && data.size(2) == info.block_bytes,
                "packed_linear: ", info.name, " data ", data.sizes(), " does not match x's in_features ", in,
                " (a multiple of ", info.block_k, ": [tiles, in / ", info.block_k, ", ", info.block_bytes, "])");
    j.blocks = in / info.block_k;
    j.block_bytes = info.block_bytes;
  }
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "packed_linear: bias must be [", out_features,
                "], got ", bias->sizes());
    bias_f32 = bias->to(at::kFloat).contiguous();
    j.bias = bias_f32.data_ptr<float>();
  }
  j.data = data.data_ptr<uint8_t>();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  j.y = y.data_ptr();
  j.y_bf16 = y.scalar_type() == at::kBFloat16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  if (int8) {  // the quantized rows in per-thread buffers kept across calls (no allocation per call)
    struct Activations {
      std::vector<int8_t> q;
      std::vector<float> d, s;
      std::vector<int32_t> sum;
    };
    thread_local Activations act;
    const int64_t nb = in / 32;
    act.q.resize(rows * in);
    act.d.resize(rows * nb);
    act.s.resize(rows * nb);
    act.sum.resize(rows * nb);
    quantize_rows(xf.data_ptr<float>(), rows, in, act.q.data(), act.d.data(), act.sum.data(), act.s.data());
    j.xq = act.q.data();
    j.xd = act.d.data();
    j.xsum = act.sum.data();
    j.xs = act.s.data();
  } else {
    j.x = xf.data_ptr<float>();
  }
  const TileFn fn = int8 ? int8_fn(isa) : widen_fn(isa);
  const int64_t tile_bytes = data.size(1) * data.size(2);
  // Below ~64 KiB of packed weights a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, tile_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) { fn(j, begin, end); });
  return y;
}

// (q int8 [rows, in], d [rows, in / 32], sum int32 [rows, in / 32]): the int8 path's activation blocks (tests).
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, "packed_quantize_rows: x must be [rows, in] with in % 32 == 0, "
              "got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), in = x.size(1), nb = in / 32;
  at::Tensor q = at::empty({rows, in}, xf.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, nb}, xf.options()), s = at::empty({rows, nb}, xf.options());
  at::Tensor sum = at::empty({rows, nb}, xf.options().dtype(at::kInt));
  quantize_rows(xf.data_ptr<float>(), rows, in, q.data_ptr<int8_t>(), d.data_ptr<float>(), sum.data_ptr<int32_t>(),
                s.data_ptr<float>());
  return {q, d, sum};
}

// The instruction sets this CPU runs, best first, comma-separated ("avx2,scalar").
std::string packed_linear_isas() {
  std::string names;
  for (Isa isa : kIsas) {
    if (!isa_supported(isa)) continue;
    if (!names.empty()) names += ",";
    names += isa_name(isa);
  }
  return names;
}

}  // namespace deepinfer::packed

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("packed_linear(Tensor x, Tensor data, Tensor scales, Tensor? bias, str fmt, int out_features, int[] block, "
        "str path=\"auto\", str isa=\"auto\") -> Tensor");
  m.def("packed_quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("packed_linear_isas() -> str", &deepinfer::packed::packed_linear_isas);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("packed_linear", &deepinfer::packed::packed_linear);
  m.impl("packed_quantize_rows", &deepinfer::packed::packed_quantize_rows);
}
