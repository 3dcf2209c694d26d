// Greedy decoding's tokens from a cheap head and a few exact tiles: deepinfer::screened_argmax.
//
// Why: an fp32 model's head is its largest GEMM (SmolLM2: 49152 x 576, ~10 ms of a 57 ms batch-32 step on Zen 4,
// 113 MB of a one-stream step's 540 MB), yet a greedy step only needs the argmax. A bf16 copy of the head gives
// approximate logits at half the bytes and twice the FLOP rate; with a rigorous bound on each approximate logit's
// distance from the exact one, only the columns whose interval reaches the best lower bound can hold the exact
// maximum, and the exact fp32 kernel runs on those columns' tiles alone (kernels/head_screen.py).
//
// The bound of column j in row b: coefficient * ||x_b|| * ||W_j|| (Cauchy-Schwarz on sum_i |x_i W_ji|, times the
// relative error of the bf16 roundings and of both fp32 accumulations; kernels/head_screen.py derives it), plus a
// slack for this kernel's own fp32 roundings. A row's tiles (16 columns) holding a candidate get their exact fp32
// logits here, each column one FMA chain over k from zero as kernels/csrc/gemv.cpp's AVX2 and AVX-512 passes compute
// it (so the same bits; the Python side uses this op only where the blocked kernel takes those passes), and the
// row's token is the first column holding the largest. Returns [B] int64 tokens; empty when a logit, a norm or a
// bound is not finite (the caller then computes every logit).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;  // columns per tile of kernels/gemv.py's blocked layout

// max_j (a_j - k * norms_j), max_j |a_j| and max_j norms_j in one pass; false when some a_j is not finite.
bool lower_bound_max(const float* a, const float* norms, int64_t n, float k, float& best, float& largest,
                     float& norm_max) {
  float top = -std::numeric_limits<float>::infinity(), big = 0.f, nmax = 0.f;
  bool finite = true;
  int64_t j = 0;
#ifdef __AVX512F__
  if (n >= 16) {
    const __m512 kv = _mm512_set1_ps(k), zero = _mm512_setzero_ps();
    __m512 top16 = _mm512_set1_ps(top), big16 = zero, nmax16 = zero;
    __mmask16 bad = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(a + j);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_NEQ_UQ);  // NaN or +-inf
      const __m512 w = _mm512_loadu_ps(norms + j);
      top16 = _mm512_max_ps(top16, _mm512_sub_ps(v, _mm512_mul_ps(kv, w)));
      big16 = _mm512_max_ps(big16, _mm512_abs_ps(v));
      nmax16 = _mm512_max_ps(nmax16, w);
    }
    finite = bad == 0;
    top = _mm512_reduce_max_ps(top16);
    big = _mm512_reduce_max_ps(big16);
    nmax = _mm512_reduce_max_ps(nmax16);
  }
#endif
  for (; j < n; ++j) {
    finite = finite && std::isfinite(a[j]);
    top = std::max(top, a[j] - k * norms[j]);
    big = std::max(big, std::fabs(a[j]));
    nmax = std::max(nmax, norms[j]);
  }
  best = top;
  largest = big;
  norm_max = nmax;
  return finite;
}

// Whether some column of the 16 starting at j has a_j + k * norms_j >= threshold.
bool tile_reaches(const float* a, const float* norms, int64_t j, int64_t n, float k, float threshold) {
#ifdef __AVX512F__
  if (j + 16 <= n) {
    const __m512 upper = _mm512_add_ps(_mm512_loadu_ps(a + j), _mm512_mul_ps(_mm512_set1_ps(k),
                                                                              _mm512_loadu_ps(norms + j)));
    return _mm512_cmp_ps_mask(upper, _mm512_set1_ps(threshold), _CMP_GE_OQ) != 0;
  }
#endif
  for (int64_t c = j; c < std::min(j + kTile, n); ++c) {
    if (a[c] + k * norms[c] >= threshold) return true;
  }
  return false;
}

// The exact logits of one tile: out[c] = fma chain over k of x[k] * tile[k][c], from zero.
void exact_tile(const float* x, const float* tile, int64_t width, float* out) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < width; ++k) acc = _mm512_fmadd_ps(_mm512_loadu_ps(tile + k * kTile), _mm512_set1_ps(x[k]), acc);
  _mm512_storeu_ps(out, acc);
#else
  std::fill(out, out + kTile, 0.f);
  for (int64_t k = 0; k < width; ++k) {
    for (int c = 0; c < kTile; ++c) out[c] = std::fma(tile[k * kTile + c], x[k], out[c]);
  }
#endif
}

at::Tensor screened_argmax(const at::Tensor& approx_in,      // [B, V] float32, the cheap head's logits
                           const at::Tensor& x_in,           // [B, H] float32, the head's input rows
                           const at::Tensor& norms_in,       // [V] float32, ||W_j||, rounded up
                           const at::Tensor& exact_head_in,  // [ceil(V/16), H, 16] float32, kernels.gemv's layout
                           double coefficient) {
  TORCH_CHECK(approx_in.dim() == 2 && approx_in.scalar_type() == at::kFloat,
              "screened_argmax: approx must be [B, V] float32, got ", approx_in.sizes(), " ",
              approx_in.scalar_type());
  const int64_t rows = approx_in.size(0), vocab = approx_in.size(1), tiles = (vocab + kTile - 1) / kTile;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == rows && x_in.scalar_type() == at::kFloat,
              "screened_argmax: x must be [", rows, ", H] float32, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t width = x_in.size(1);
  TORCH_CHECK(norms_in.dim() == 1 && norms_in.size(0) == vocab && norms_in.scalar_type() == at::kFloat,
              "screened_argmax: norms must be [", vocab, "] float32, got ", norms_in.sizes());
  TORCH_CHECK(exact_head_in.dim() == 3 && exact_head_in.size(0) == tiles && exact_head_in.size(1) == width &&
                  exact_head_in.size(2) == kTile && exact_head_in.scalar_type() == at::kFloat,
              "screened_argmax: exact_head must be [", tiles, ", ", width, ", 16] float32, got ",
              exact_head_in.sizes(), " ", exact_head_in.scalar_type());
  TORCH_CHECK(coefficient > 0 && std::isfinite(coefficient), "screened_argmax: coefficient must be > 0");
  const at::Tensor approx = approx_in.contiguous(), x = x_in.contiguous(), norms = norms_in.contiguous();
  const at::Tensor exact_head = exact_head_in.contiguous();
  const float* a = approx.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const float* wp = exact_head.data_ptr<float>();
  at::Tensor tokens = at::empty({rows}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  std::vector<uint8_t> row_ok(static_cast<size_t>(rows), 1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float exact[kTile];
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * width;
      double squares = 0.0;
      for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(xr[i]) * xr[i];
      // k rounded up: the bound only grows.
      const double k_exact = coefficient * std::sqrt(squares) * (1.0 + 1e-6);
      const float k = static_cast<float>(k_exact);
      float best = 0.f, largest = 0.f, norm_max = 0.f;
      const float* ar = a + r * vocab;
      if (!std::isfinite(k) || !lower_bound_max(ar, np, vocab, k, best, largest, norm_max) ||
          k_exact * norm_max > 1e30) {
        row_ok[r] = 0;
        continue;
      }
      // This kernel's fp32 roundings of a_j -+ k * norms_j: a few ulps of the largest term, taken off the threshold.
      const float threshold =
          static_cast<float>(best - (8.0 * std::ldexp(1.0, -24) * (largest + k_exact * norm_max) + 1e-30));
      float top = -std::numeric_limits<float>::infinity();
      int64_t token = -1;
      for (int64_t t = 0; t < tiles; ++t) {
        if (!tile_reaches(ar, np, t * kTile, vocab, k, threshold)) continue;
        exact_tile(xr, wp + t * width * kTile, width, exact);
        for (int64_t c = 0; c < std::min(kTile, vocab - t * kTile); ++c) {
          if (exact[c] > top || token < 0) {  // strictly larger: the first column of a tie keeps it
            top = exact[c];
            token = t * kTile + c;
          }
        }
      }
      out[r] = token;
    }
  });
  if (std::find(row_ok.begin(), row_ok.end(), 0) != row_ok.end()) {
    return at::empty({0}, at::kLong);
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("screened_argmax(Tensor approx, Tensor x, Tensor norms, Tensor exact_head, float coefficient) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("screened_argmax", &screened_argmax);
}
