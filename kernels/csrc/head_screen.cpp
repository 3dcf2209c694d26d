// Greedy decoding's tokens from a cheap head and a few exact tiles: deepinfer::screened_argmax (the bf16 copy of
// an fp32 head, exact tiles here), deepinfer::screen_tiles and deepinfer::pick_screened (the int8 screen of
// kernels/int8_head_screen.py: the candidate tiles, then the token from the head kernel's logits on them).
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
#include <tuple>
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
  for (int64_t k = 0; k < width; ++k) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(tile + k * kTile), _mm512_set1_ps(x[k]), acc);
  }
  _mm512_storeu_ps(out, acc);
#else
  std::fill(out, out + kTile, 0.f);
  for (int64_t k = 0; k < width; ++k) {
    for (int c = 0; c < kTile; ++c) out[c] = std::fma(tile[k * kTile + c], x[k], out[c]);
  }
#endif
}

// Row r's bound scale k (bound of column j: k * norms_j) and the lower bound every candidate must reach, with
// this kernel's own fp32 roundings of a_j -+ k * norms_j (a few ulps of the largest term) taken off it. False
// when a logit, the norm of x or a bound is not finite or past 1e30 (the caller computes every logit).
bool row_threshold(const float* ar, const float* xr, const float* norms, int64_t vocab, int64_t width,
                   double coefficient, float& k, float& threshold) {
  double squares = 0.0;
  for (int64_t i = 0; i < width; ++i) squares += static_cast<double>(xr[i]) * xr[i];
  const double k_exact = coefficient * std::sqrt(squares) * (1.0 + 1e-6);  // rounded up: the bound only grows
  k = static_cast<float>(k_exact);
  float best = 0.f, largest = 0.f, norm_max = 0.f;
  if (!std::isfinite(k) || !lower_bound_max(ar, norms, vocab, k, best, largest, norm_max) ||
      k_exact * norm_max > 1e30) {
    return false;
  }
  threshold = static_cast<float>(best - (8.0 * std::ldexp(1.0, -24) * (largest + k_exact * norm_max) + 1e-30));
  return true;
}

void check_screen_inputs(const at::Tensor& approx, const at::Tensor& x, const at::Tensor& norms, double coefficient,
                         const char* op) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kFloat, op, ": approx must be [B, V] float32, got ",
              approx.sizes(), " ", approx.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(0) == approx.size(0) && x.scalar_type() == at::kFloat, op, ": x must be [",
              approx.size(0), ", H] float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(norms.dim() == 1 && norms.size(0) == approx.size(1) && norms.scalar_type() == at::kFloat, op,
              ": norms must be [", approx.size(1), "] float32, got ", norms.sizes());
  TORCH_CHECK(coefficient > 0 && std::isfinite(coefficient), op, ": coefficient must be > 0");
}

// (reach [B, ceil(V/16)] bool, tiles [n] int64): tile t of row b holds a column whose interval reaches the row's
// best lower bound (the tiles an exact pass must cover), and the tiles some row reaches, ascending; both empty
// when some row's values are not finite (row_threshold).
std::tuple<at::Tensor, at::Tensor> screen_tiles(const at::Tensor& approx_in,  // [B, V] float32, the cheap logits
                                                const at::Tensor& x_in,       // [B, H] float32, the head's input
                                                const at::Tensor& norms_in,   // [V] float32: bound = c ||x|| norms_j
                                                double coefficient) {
  check_screen_inputs(approx_in, x_in, norms_in, coefficient, "screen_tiles");
  const at::Tensor approx = approx_in.contiguous(), x = x_in.contiguous(), norms = norms_in.contiguous();
  const int64_t rows = approx.size(0), vocab = approx.size(1), width = x.size(1), tiles = (vocab + kTile - 1) / kTile;
  at::Tensor reach = at::empty({rows, tiles}, at::kBool);  // every entry written below, or not returned
  bool* out = reach.data_ptr<bool>();
  std::vector<uint8_t> row_ok(static_cast<size_t>(rows), 1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {  // a row's two passes: ~60 us on Zen 4
    for (int64_t r = begin; r < end; ++r) {
      const float* ar = approx.data_ptr<float>() + r * vocab;
      float k = 0.f, threshold = 0.f;
      if (!row_threshold(ar, x.data_ptr<float>() + r * width, norms.data_ptr<float>(), vocab, width, coefficient,
                         k, threshold)) {
        row_ok[r] = 0;
        continue;
      }
      for (int64_t t = 0; t < tiles; ++t) {
        out[r * tiles + t] = tile_reaches(ar, norms.data_ptr<float>(), t * kTile, vocab, k, threshold);
      }
    }
  });
  if (std::find(row_ok.begin(), row_ok.end(), 0) != row_ok.end()) {
    return {at::empty({0, tiles}, at::kBool), at::empty({0}, at::kLong)};
  }
  std::vector<int64_t> any;
  std::vector<uint8_t> seen(static_cast<size_t>(tiles), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < tiles; ++t) seen[t] |= out[r * tiles + t];
  }
  for (int64_t t = 0; t < tiles; ++t) {
    if (seen[t]) any.push_back(t);
  }
  at::Tensor union_tiles = at::empty({static_cast<int64_t>(any.size())}, at::kLong);
  std::copy(any.begin(), any.end(), union_tiles.data_ptr<int64_t>());
  return {reach, union_tiles};
}

// Each row's token from the exact logits of the gathered tiles: the first column, among the row's own reaching
// tiles and below vocab, holding the largest value. [B] int64; empty when such a value is not finite.
at::Tensor pick_screened(const at::Tensor& exact_in,  // [B, n * 16] float32, the exact head on tiles' columns
                         const at::Tensor& tiles_in,  // [n] int64, ascending (screen_tiles' second value)
                         const at::Tensor& reach_in,  // [B, T] bool (screen_tiles' first value)
                         int64_t vocab) {
  const int64_t n = tiles_in.numel();
  TORCH_CHECK(exact_in.dim() == 2 && exact_in.size(1) == n * kTile && exact_in.scalar_type() == at::kFloat &&
                  reach_in.dim() == 2 && reach_in.size(0) == exact_in.size(0) && reach_in.scalar_type() == at::kBool &&
                  tiles_in.scalar_type() == at::kLong,
              "pick_screened: exact [B, n*16] float32, tiles [n] int64 and reach [B, T] bool, got ", exact_in.sizes(),
              ", ", tiles_in.sizes(), ", ", reach_in.sizes());
  const at::Tensor exact = exact_in.contiguous(), tiles = tiles_in.contiguous(), reach = reach_in.contiguous();
  const int64_t rows = exact.size(0), all_tiles = reach.size(1);
  at::Tensor tokens = at::empty({rows}, at::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    const float* er = exact.data_ptr<float>() + r * n * kTile;
    float top = 0.f;
    int64_t token = -1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = tiles.data_ptr<int64_t>()[i];
      TORCH_CHECK(t >= 0 && t < all_tiles, "pick_screened: tile ", t, " outside the ", all_tiles, " tiles");
      if (!reach.data_ptr<bool>()[r * all_tiles + t]) continue;
      for (int64_t c = 0; c < kTile && t * kTile + c < vocab; ++c) {
        const float v = er[i * kTile + c];
        if (!std::isfinite(v)) return at::empty({0}, at::kLong);
        if (token < 0 || v > top) {  // strictly larger: the first column of a tie keeps it
          top = v;
          token = t * kTile + c;
        }
      }
    }
    tokens.data_ptr<int64_t>()[r] = token;
  }
  return tokens;
}

at::Tensor screened_argmax(const at::Tensor& approx_in,      // [B, V] float32, the cheap head's logits
                           const at::Tensor& x_in,           // [B, H] float32, the head's input rows
                           const at::Tensor& norms_in,       // [V] float32, ||W_j||, rounded up
                           const at::Tensor& exact_head_in,  // [ceil(V/16), H, 16] float32, kernels.gemv's layout
                           double coefficient) {
  check_screen_inputs(approx_in, x_in, norms_in, coefficient, "screened_argmax");
  const int64_t rows = approx_in.size(0), vocab = approx_in.size(1), tiles = (vocab + kTile - 1) / kTile;
  const int64_t width = x_in.size(1);
  TORCH_CHECK(exact_head_in.dim() == 3 && exact_head_in.size(0) == tiles && exact_head_in.size(1) == width &&
                  exact_head_in.size(2) == kTile && exact_head_in.scalar_type() == at::kFloat,
              "screened_argmax: exact_head must be [", tiles, ", ", width, ", 16] float32, got ",
              exact_head_in.sizes(), " ", exact_head_in.scalar_type());
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
      const float* ar = a + r * vocab;
      float k = 0.f, threshold = 0.f;
      if (!row_threshold(ar, xr, np, vocab, width, coefficient, k, threshold)) {
        row_ok[r] = 0;
        continue;
      }
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
  m.def("screen_tiles(Tensor approx, Tensor x, Tensor norms, float coefficient) -> (Tensor, Tensor)");
  m.def("pick_screened(Tensor exact, Tensor tiles, Tensor reach, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("screened_argmax", &screened_argmax);
  m.impl("screen_tiles", &screen_tiles);
  m.impl("pick_screened", &pick_screened);
}
