// Approximate head logits from an int8 copy of the head: deepinfer::int8_head_logits.
//
// Why: a greedy step of one to four rows only needs the head's argmax, and the head is a fifth of a SmolLM2 step's
// bytes (bf16: 56 MB of 270 MB). An int8 copy with one scale per vocabulary row holds it in half the bytes of bf16
// (a quarter of fp32); kernels/int8_head_screen.py bounds each approximate logit's distance from the exact one and
// the exact kernel then runs on the few tiles the bound leaves. This op is only the approximate pass.
//
// Arithmetic: each row of x to int16 levels (step = max|x| / x_levels, level = round(x / step)), so the sums over
// the int8 rows are exact int32 (x_levels keeps them from overflowing): y_j = float(S_j) * step * scale_j.
// VNNI's vpdpwssd takes 16 columns x 2 k a instruction, as many products as vdpbf16ps, on half the bytes.
//
// Layout (kernels/int8_head_screen.py: block_int8): [groups, ceil(H/2), 128] int8, group g's pair step p holds
// (q[64g + c, 2p], q[64g + c, 2p + 1]) for c in 0..63, so a thread's share is one contiguous stream, two 64-byte
// lines a step. Rows past the vocabulary are zeros with scale 0. Up to 4 activation rows per pass, the group's 4
// column tiles as independent chains (16 accumulators). Without VNNI a plain loop gives the same integers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 64;  // columns per k-pair step of the layout
constexpr int kMaxRows = 4;     // activation rows per pass (16 accumulators)

#if defined(__x86_64__)
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
bool has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// acc + dot(w, x) per int32 lane (vpdpwssd). Written out because GCC 12's intrinsic keeps the accumulator in the
// first 16 registers: with 16 accumulators it copied each one every step and spilled two to the stack.
TARGET_VNNI inline __attribute__((always_inline)) __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// acc [R][64] = sum_k xq[r][k] * q[c][k] over one column group, int32 (exact). xq holds each row's k pairs as
// int32 lanes (int16 x[2p] low, x[2p+1] high); q is the group's [pairs, 64 columns, 2] int8.
template <int R>
TARGET_VNNI void group_pass_vnni(const int32_t* xq, int64_t pairs, const int8_t* q, int32_t* acc) {
  __m512i a[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) a[r][t] = _mm512_setzero_si512();
  for (int64_t p = 0; p < pairs; ++p, q += 2 * kGroup) {
    _mm_prefetch(reinterpret_cast<const char*>(q) + 2048, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(q) + 2048 + 64, _MM_HINT_T1);
    __m512i w[4];
    for (int t = 0; t < 4; ++t) {
      w[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * t)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xk = _mm512_set1_epi32(xq[r * pairs + p]);
      for (int t = 0; t < 4; ++t) a[r][t] = dot_pairs(a[r][t], w[t], xk);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) _mm512_storeu_si512(acc + r * kGroup + 16 * t, a[r][t]);
}
#else
bool has_vnni() { return false; }
#endif

template <int R>
void group_pass_plain(const int32_t* xq, int64_t pairs, const int8_t* q, int32_t* acc) {
  for (int r = 0; r < R; ++r) std::fill(acc + r * kGroup, acc + r * kGroup + kGroup, 0);
  for (int64_t p = 0; p < pairs; ++p, q += 2 * kGroup) {
    for (int r = 0; r < R; ++r) {
      const int32_t lanes = xq[r * pairs + p];
      const int32_t x0 = static_cast<int16_t>(lanes & 0xFFFF), x1 = static_cast<int16_t>(lanes >> 16);
      for (int c = 0; c < kGroup; ++c) acc[r * kGroup + c] += x0 * q[2 * c] + x1 * q[2 * c + 1];
    }
  }
}

using GroupPass = void (*)(const int32_t*, int64_t, const int8_t*, int32_t*);

at::Tensor int8_head_logits(const at::Tensor& x_in,       // [B, H] float32 or bfloat16
                            const at::Tensor& q_in,       // [ceil(V/64), ceil(H/2), 128] int8
                            const at::Tensor& scales_in,  // [ceil(V/64) * 64] float32
                            int64_t vocab, int64_t x_levels,
                            c10::string_view isa) {  // "auto" (VNNI where the CPU has it) or "plain"
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "int8_head_logits: x must be [B, H] float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t rows = x_in.size(0), width = x_in.size(1), pairs = (width + 1) / 2;
  const int64_t groups = (vocab + kGroup - 1) / kGroup;
  TORCH_CHECK(vocab >= 1, "int8_head_logits: vocab must be >= 1, got ", vocab);
  TORCH_CHECK(x_levels >= 1 && x_levels <= 32767 && x_levels * 127 * pairs * 2 < (int64_t{1} << 31),
              "int8_head_logits: x_levels ", x_levels, " would overflow int32 sums over ", width, " features");
  TORCH_CHECK(q_in.dim() == 3 && q_in.size(0) == groups && q_in.size(1) == pairs && q_in.size(2) == 2 * kGroup &&
                  q_in.scalar_type() == at::kChar && q_in.is_contiguous(),
              "int8_head_logits: q must be a contiguous [", groups, ", ", pairs, ", 128] int8 tensor, got ",
              q_in.sizes(), " ", q_in.scalar_type());
  TORCH_CHECK(scales_in.dim() == 1 && scales_in.size(0) == groups * kGroup && scales_in.scalar_type() == at::kFloat,
              "int8_head_logits: scales must be [", groups * kGroup, "] float32, got ", scales_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), scales = scales_in.contiguous();
  // Each row to int16 levels: xq = round(x / step), step = max |x| / x_levels (kernels/int8_head_screen.py bounds it).
  std::vector<int32_t> xq(static_cast<size_t>(rows * pairs), 0);
  std::vector<float> steps(static_cast<size_t>(rows), 0.f);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float top = 0.f;
    for (int64_t i = 0; i < width; ++i) top = std::max(top, std::fabs(xp[r * width + i]));
    const float step = top / static_cast<float>(x_levels);
    steps[r] = step;
    if (!(step > 0.f) || !std::isfinite(step)) continue;  // zeros (or not finite: the caller checks the logits)
    for (int64_t i = 0; i < width; ++i) {
      const float v = xp[r * width + i];  // a NaN (max skips it) takes level 0: its row's screen returns None
      const int32_t level = std::isfinite(v) ? static_cast<int32_t>(std::nearbyint(v / step)) : 0;
      auto* lanes = reinterpret_cast<int16_t*>(&xq[r * pairs + i / 2]);
      lanes[i % 2] = static_cast<int16_t>(std::clamp<int32_t>(level, -32767, 32767));
    }
  }
  at::Tensor y = at::empty({rows, vocab}, x.options());
  const int8_t* qp = q_in.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = pairs * 2 * kGroup;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / group_bytes);
  TORCH_CHECK(isa == "auto" || isa == "plain", "int8_head_logits: isa must be 'auto' or 'plain', got ", isa);
  const bool vnni = isa == "auto" && has_vnni();
#if defined(__x86_64__)
  static constexpr GroupPass vnni_passes[kMaxRows] = {&group_pass_vnni<1>, &group_pass_vnni<2>,
                                                      &group_pass_vnni<3>, &group_pass_vnni<4>};
#else
  static constexpr GroupPass* vnni_passes = nullptr;
#endif
  static constexpr GroupPass plain_passes[kMaxRows] = {&group_pass_plain<1>, &group_pass_plain<2>,
                                                       &group_pass_plain<3>, &group_pass_plain<4>};
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kMaxRows * kGroup];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col0 = g * kGroup, cols = std::min<int64_t>(kGroup, vocab - col0);
      for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRows, rows - row0));
        const int32_t* xr = xq.data() + row0 * pairs;
        const int8_t* qg = qp + g * group_bytes;
        (vnni ? vnni_passes[r - 1] : plain_passes[r - 1])(xr, pairs, qg, acc);
        for (int i = 0; i < r; ++i) {
          float* out = yp + (row0 + i) * vocab + col0;
          const float step = steps[row0 + i];
          for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<float>(acc[i * kGroup + c]) * step * sp[col0 + c];
        }
      }
    }
  });
  return y;
}

std::string int8_head_isa() { return has_vnni() ? "avx512_vnni" : "plain"; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("int8_head_logits(Tensor x, Tensor q, Tensor scales, int vocab, int x_levels, str isa=\"auto\") -> Tensor");
  m.def("int8_head_isa() -> str", &int8_head_isa);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("int8_head_logits", &int8_head_logits);
}
