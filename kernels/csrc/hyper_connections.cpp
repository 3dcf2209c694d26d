// mHC's mixes on the host CPU: deepinfer::hc_mixes (the whole of kernels/hyper_connections.py's hc_mixes per
// token: RMS norm of the flattened streams, the (2 + hc) * hc mix logits, pre / post sigmoids, comb's softmax and
// Sinkhorn loop), in one call.
//
// Why: each normalization is three tiny torch ops over [T, hc, hc] (hc = 4); 20 iterations are ~120 ops per mHC
// site and ~1.5k per decode step of a 6-layer model, a few microseconds of dispatch each for a few nanoseconds of
// arithmetic. Here one call does the whole loop per token, in the torch form's order (kernels/hyper_connections.py):
// columns, then rows and columns ``iters - 1`` times; each sum runs in ascending index, then ``+ eps``, then a
// division, as torch computes them for these sizes, so the result is the same to the bit in practice.
//
// deepinfer::hc_pre is hc_mixes plus the collapse of the streams by ``pre`` (the block's input) in the same pass
// over a token, and deepinfer::hc_post the expansion (``post`` spreads the block output, ``comb`` mixes the
// residual streams): eagerly each was 3-5 small torch ops per site over [T, hc, D] (~12 us apiece at batch 32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "attention_math.h"

namespace {

// The [n, n] combs of kTokens tokens in place: columns, then rows and columns ``iters - 1`` times. Token-minor
// (``m[e * kTokens + l]``: element e of token l's comb), so the compiler vectorizes across tokens: each token's
// values still go through the torch form's operations in its order (the same bits as one token at a time), 16
// tokens per instruction instead of one scalar division at a time (that loop was ~60% of the op at batch 32).
constexpr int64_t kTokens = 16;

void sinkhorn_tokens(float* m, int64_t n, int64_t iters, float e, float* sums /* [n * kTokens] */) {
  auto columns = [&] {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t l = 0; l < kTokens; ++l) sums[j * kTokens + l] = m[j * kTokens + l];
    for (int64_t i = 1; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t l = 0; l < kTokens; ++l) sums[j * kTokens + l] += m[(i * n + j) * kTokens + l];
    for (int64_t j = 0; j < n * kTokens; ++j) sums[j] += e;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t l = 0; l < kTokens; ++l) m[(i * n + j) * kTokens + l] /= sums[j * kTokens + l];
  };
  columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < n; ++i) {
      float* row = m + i * n * kTokens;
      float s[kTokens];
      for (int64_t l = 0; l < kTokens; ++l) s[l] = row[l];
      for (int64_t j = 1; j < n; ++j)
        for (int64_t l = 0; l < kTokens; ++l) s[l] += row[j * kTokens + l];
      for (int64_t l = 0; l < kTokens; ++l) s[l] += e;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t l = 0; l < kTokens; ++l) row[j * kTokens + l] /= s[l];
    }
    columns();
  }
}

// Sinkhorn over the combs of tokens [begin, end) ([T, n, n] in ``comb``), kTokens at a time through a token-minor
// copy; a last partial group pads its lanes with ones (computed and dropped).
void sinkhorn_range(float* comb, int64_t begin, int64_t end, int64_t n, int64_t iters, float e) {
  const int64_t cells = n * n;
  std::vector<float> block(cells * kTokens), sums(n * kTokens);
  for (int64_t t0 = begin; t0 < end; t0 += kTokens) {
    const int64_t count = std::min(kTokens, end - t0);
    std::fill(block.begin(), block.end(), 1.f);
    for (int64_t l = 0; l < count; ++l)
      for (int64_t c = 0; c < cells; ++c) block[c * kTokens + l] = comb[(t0 + l) * cells + c];
    sinkhorn_tokens(block.data(), n, iters, e, sums.data());
    for (int64_t l = 0; l < count; ++l)
      for (int64_t c = 0; c < cells; ++c) comb[(t0 + l) * cells + c] = block[c * kTokens + l];
  }
}

// dots() for four tokens at once: out[k * rows + j] = dot(x[k], w + j * n, n), each in dot's order (the same bits).
// One token at a time streams all of ``fn`` ((2 + hc) * hc rows of hc * D floats, ~200 KB at hc 4, D 512) from L2
// per token; a 4-token x 6-row register tile reads each weight vector once per four tokens.
void dots4(const float* const* x, const float* w, int64_t rows, int64_t n, float* out) {
  int64_t j = 0;
#ifdef __AVX512F__
  if (n % 16 == 0) {
    constexpr int64_t kRows = 6, kTok = 4;
    for (; j + kRows <= rows; j += kRows) {
      const float* wj = w + j * n;
      __m512 acc[kTok][kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 wv = _mm512_loadu_ps(wj + r * n);
        for (int64_t k = 0; k < kTok; ++k) acc[k][r] = _mm512_mul_ps(_mm512_loadu_ps(x[k]), wv);
      }
      for (int64_t i = 16; i < n; i += 16) {
        __m512 xv[kTok];
        for (int64_t k = 0; k < kTok; ++k) xv[k] = _mm512_loadu_ps(x[k] + i);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 wv = _mm512_loadu_ps(wj + r * n + i);
          for (int64_t k = 0; k < kTok; ++k) acc[k][r] = _mm512_fmadd_ps(xv[k], wv, acc[k][r]);
        }
      }
      for (int64_t k = 0; k < kTok; ++k)
        for (int64_t r = 0; r < kRows; ++r) out[k * rows + j + r] = _mm512_reduce_add_ps(acc[k][r]);
    }
  }
#endif
  for (int64_t k = 0; k < 4; ++k)
    for (int64_t r = j; r < rows; ++r) out[k * rows + r] = deepinfer::attention_math::dot(x[k], w + r * n, n);
}

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// out[j] = dot(x, w + j * n, n) for j < rows, each row summed in attention_math::dot's order (so the same bits),
// eight rows at a time: one dot is a chain of dependent FMAs (latency-bound, ~8x below the FMA throughput); eight
// independent chains keep both FMA ports busy and load x once for all of them.
void dots(const float* x, const float* w, int64_t rows, int64_t n, float* out) {
  int64_t j = 0;
#ifdef __AVX512F__
  if (n % 16 == 0) {
    constexpr int64_t kRows = 8;
    for (; j + kRows <= rows; j += kRows) {
      const float* wj = w + j * n;
      __m512 acc[kRows];
      const __m512 x0 = _mm512_loadu_ps(x);
      for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_mul_ps(x0, _mm512_loadu_ps(wj + r * n));
      for (int64_t i = 16; i < n; i += 16) {
        const __m512 xi = _mm512_loadu_ps(x + i);
        for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(xi, _mm512_loadu_ps(wj + r * n + i), acc[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) out[j + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
#endif
  for (; j < rows; ++j) out[j] = deepinfer::attention_math::dot(x, w + j * n, n);
}

// The mixes of every token; with ``collapsed`` (float32 [T, D]) also sum_j pre[j] * stream j, while the token's
// streams are in cache.
void mixes_of(const at::Tensor& x,  // [T, hc, D] float32 contiguous
              const at::Tensor& fn, const at::Tensor& base, const at::Tensor& scale, int64_t iters, double hc_eps,
              double norm_eps, at::Tensor& pre, at::Tensor& post, at::Tensor& comb, float* collapsed) {
  const int64_t tokens = x.size(0), hc = x.size(1), dim = x.size(2), width = hc * dim;
  const int64_t mixes = (2 + hc) * hc;
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == mixes && fn.size(1) == width && fn.scalar_type() == at::kFloat,
              "hc_mixes: fn must be float32 [", mixes, ", ", width, "], got ", fn.sizes(), " ", fn.scalar_type());
  TORCH_CHECK(base.numel() == mixes && scale.numel() == 3, "hc_mixes: base must have ", mixes,
              " values and scale 3, got ", base.sizes(), " and ", scale.sizes());
  TORCH_CHECK(iters >= 1, "hc_mixes: iters must be >= 1, got ", iters);
  const at::Tensor w = fn.contiguous();
  const at::Tensor b = base.to(at::kFloat).contiguous(), sc = scale.to(at::kFloat).contiguous();
  const auto options = x.options();
  pre = at::empty({tokens, hc}, options);
  post = at::empty({tokens, hc}, options);
  comb = at::empty({tokens, hc, hc}, options);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float s0 = sc.data_ptr<float>()[0], s1 = sc.data_ptr<float>()[1], s2 = sc.data_ptr<float>()[2];
  float* prep = pre.data_ptr<float>();
  float* postp = post.data_ptr<float>();
  float* combp = comb.data_ptr<float>();
  const float he = static_cast<float>(hc_eps), ne = static_cast<float>(norm_eps);
  // one token's pre / post / comb (before Sinkhorn) from its mix logits, and its collapse
  auto token_mixes = [&](int64_t t, const float* mixed) {
    const float* row = xp + t * width;
    for (int64_t j = 0; j < hc; ++j) {
      prep[t * hc + j] = sigmoid(mixed[j] * s0 + bp[j]) + he;
      postp[t * hc + j] = 2.f * sigmoid(mixed[hc + j] * s1 + bp[hc + j]);
    }
    float* m = combp + t * hc * hc;
    for (int64_t i = 0; i < hc; ++i) {
      float* mr = m + i * hc;
      float top = -INFINITY;
      for (int64_t j = 0; j < hc; ++j) {
        mr[j] = mixed[2 * hc + i * hc + j] * s2 + bp[2 * hc + i * hc + j];
        top = std::max(top, mr[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < hc; ++j) total += (mr[j] = std::exp(mr[j] - top));
      for (int64_t j = 0; j < hc; ++j) mr[j] = mr[j] / total + he;
    }
    if (collapsed != nullptr) {
      float* out = collapsed + t * dim;
      const float* pt = prep + t * hc;
      for (int64_t c = 0; c < dim; ++c) out[c] = pt[0] * row[c];
      for (int64_t j = 1; j < hc; ++j)
        for (int64_t c = 0; c < dim; ++c) out[c] += pt[j] * row[j * dim + c];
    }
  };
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    constexpr int64_t kGroup = 4;  // tokens whose mix logits one pass over fn computes (dots4)
    std::vector<float> normed(kGroup * width), mixed(kGroup * mixes);
    for (int64_t g = begin; g < end; g += kGroup) {
      const int64_t count = std::min(kGroup, end - g);
      for (int64_t k = 0; k < count; ++k) {
        const float* row = xp + (g + k) * width;
        const float r = 1.f / std::sqrt(deepinfer::attention_math::dot(row, row, width) / width + ne);
        for (int64_t c = 0; c < width; ++c) normed[k * width + c] = row[c] * r;
      }
      if (count == kGroup) {
        const float* xs[kGroup] = {normed.data(), normed.data() + width, normed.data() + 2 * width,
                                   normed.data() + 3 * width};
        dots4(xs, wp, mixes, width, mixed.data());
      } else {
        for (int64_t k = 0; k < count; ++k) dots(normed.data() + k * width, wp, mixes, width, mixed.data() + k * mixes);
      }
      for (int64_t k = 0; k < count; ++k) token_mixes(g + k, mixed.data() + k * mixes);
    }
    sinkhorn_range(combp, begin, end, hc, iters, he);
  });
}

void check_streams(const at::Tensor& streams, const char* op) {
  TORCH_CHECK(streams.dim() == 3, op, ": streams must be [T, hc, D], got ", streams.sizes());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_mixes(const at::Tensor& streams, const at::Tensor& fn,
                                                        const at::Tensor& base, const at::Tensor& scale,
                                                        int64_t iters, double hc_eps, double norm_eps) {
  check_streams(streams, "hc_mixes");
  at::Tensor pre, post, comb;
  mixes_of(streams.to(at::kFloat).contiguous(), fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb, nullptr);
  return {pre, post, comb};
}

// (the block input sum_j pre[j] * stream j [T, D] in streams' dtype, post [T, hc], comb [T, hc, hc])
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams, const at::Tensor& fn,
                                                      const at::Tensor& base, const at::Tensor& scale, int64_t iters,
                                                      double hc_eps, double norm_eps) {
  check_streams(streams, "hc_pre");
  const at::Tensor x = streams.to(at::kFloat).contiguous();
  at::Tensor collapsed = at::empty({x.size(0), x.size(2)}, x.options());
  at::Tensor pre, post, comb;
  mixes_of(x, fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb, collapsed.data_ptr<float>());
  return {collapsed.to(streams.scalar_type()), post, comb};
}

// New streams [T, hc, D] in streams' dtype: out stream k = post[k] * block_out + sum_j comb[j, k] * stream j.
at::Tensor hc_post(const at::Tensor& block_out, const at::Tensor& streams, const at::Tensor& post,
                   const at::Tensor& comb) {
  check_streams(streams, "hc_post");
  const int64_t tokens = streams.size(0), hc = streams.size(1), dim = streams.size(2);
  TORCH_CHECK(block_out.dim() == 2 && block_out.size(0) == tokens && block_out.size(1) == dim,
              "hc_post: block_out must be [", tokens, ", ", dim, "], got ", block_out.sizes());
  TORCH_CHECK(post.numel() == tokens * hc && comb.numel() == tokens * hc * hc, "hc_post: post must be [", tokens,
              ", ", hc, "] and comb [", tokens, ", ", hc, ", ", hc, "], got ", post.sizes(), " and ", comb.sizes());
  const at::Tensor x = streams.to(at::kFloat).contiguous(), y = block_out.to(at::kFloat).contiguous();
  const at::Tensor pp = post.to(at::kFloat).contiguous(), cp = comb.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({tokens, hc, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* postp = pp.data_ptr<float>();
  const float* combp = cp.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xt = xp + t * hc * dim;
      const float* yt = yp + t * dim;
      const float* ct = combp + t * hc * hc;
      for (int64_t k = 0; k < hc; ++k) {
        float* ok = op + (t * hc + k) * dim;
        const float pk = postp[t * hc + k];
        for (int64_t c = 0; c < dim; ++c) ok[c] = ct[k] * xt[c];
        for (int64_t j = 1; j < hc; ++j) {
          const float cjk = ct[j * hc + k];
          const float* xj = xt + j * dim;
          for (int64_t c = 0; c < dim; ++c) ok[c] += cjk * xj[c];
        }
        for (int64_t c = 0; c < dim; ++c) ok[c] += pk * yt[c];
      }
    }
  });
  return streams.scalar_type() == at::kFloat ? out : out.to(streams.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("hc_mixes(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, float norm_eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("hc_pre(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, float norm_eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("hc_post(Tensor block_out, Tensor streams, Tensor post, Tensor comb) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("hc_mixes", &hc_mixes);
  m.impl("hc_pre", &hc_pre);
  m.impl("hc_post", &hc_post);
}
