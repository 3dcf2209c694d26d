// mHC's mixes on the host CPU: deepinfer::hc_mixes (the whole of kernels/hyper_connections.py's hc_mixes per
// token: RMS norm of the flattened streams, the (2 + hc) * hc mix logits, pre / post sigmoids, comb's softmax and
// Sinkhorn loop), in one call.
//
// Why: each normalization is three tiny torch ops over [T, hc, hc] (hc = 4); 20 iterations are ~120 ops per mHC
// site and ~1.5k per decode step of a 6-layer model, a few microseconds of dispatch each for a few nanoseconds of
// arithmetic. Here one call does the whole loop per token, in the torch form's order (kernels/hyper_connections.py):
// columns, then rows and columns ``iters - 1`` times; each sum runs in ascending index, then ``+ eps``, then a
// division, as torch computes them for these sizes, so the result is the same to the bit in practice.
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

// One token's [n, n] comb in place: columns, then rows and columns ``iters - 1`` times.
void sinkhorn_one(float* m, int64_t n, int64_t iters, float e, float* sums) {
  auto columns = [&] {
    for (int64_t j = 0; j < n; ++j) sums[j] = m[j];
    for (int64_t i = 1; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) sums[j] += m[i * n + j];
    for (int64_t j = 0; j < n; ++j) sums[j] += e;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) m[i * n + j] /= sums[j];
  };
  columns();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < n; ++i) {
      float s = m[i * n];
      for (int64_t j = 1; j < n; ++j) s += m[i * n + j];
      s += e;
      for (int64_t j = 0; j < n; ++j) m[i * n + j] /= s;
    }
    columns();
  }
}

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_mixes(const at::Tensor& streams, const at::Tensor& fn,
                                                        const at::Tensor& base, const at::Tensor& scale,
                                                        int64_t iters, double hc_eps, double norm_eps) {
  TORCH_CHECK(streams.dim() == 3, "hc_mixes: streams must be [T, hc, D], got ", streams.sizes());
  const int64_t tokens = streams.size(0), hc = streams.size(1), width = hc * streams.size(2);
  const int64_t mixes = (2 + hc) * hc;
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == mixes && fn.size(1) == width && fn.scalar_type() == at::kFloat,
              "hc_mixes: fn must be float32 [", mixes, ", ", width, "], got ", fn.sizes(), " ", fn.scalar_type());
  TORCH_CHECK(base.numel() == mixes && scale.numel() == 3, "hc_mixes: base must have ", mixes,
              " values and scale 3, got ", base.sizes(), " and ", scale.sizes());
  TORCH_CHECK(iters >= 1, "hc_mixes: iters must be >= 1, got ", iters);
  const at::Tensor x = streams.to(at::kFloat).contiguous(), w = fn.contiguous();
  const at::Tensor b = base.to(at::kFloat).contiguous(), sc = scale.to(at::kFloat).contiguous();
  const auto options = x.options();
  at::Tensor pre = at::empty({tokens, hc}, options), post = at::empty({tokens, hc}, options);
  at::Tensor comb = at::empty({tokens, hc, hc}, options);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float s0 = sc.data_ptr<float>()[0], s1 = sc.data_ptr<float>()[1], s2 = sc.data_ptr<float>()[2];
  float* prep = pre.data_ptr<float>();
  float* postp = post.data_ptr<float>();
  float* combp = comb.data_ptr<float>();
  const float he = static_cast<float>(hc_eps), ne = static_cast<float>(norm_eps);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(width), mixed(mixes), sums(hc);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      const float r = 1.f / std::sqrt(deepinfer::attention_math::dot(row, row, width) / width + ne);
      for (int64_t c = 0; c < width; ++c) normed[c] = row[c] * r;
      for (int64_t j = 0; j < mixes; ++j) mixed[j] = deepinfer::attention_math::dot(normed.data(), wp + j * width,
                                                                                     width);
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
      sinkhorn_one(m, hc, iters, he, sums.data());
    }
  });
  return {pre, post, comb};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("hc_mixes(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, float norm_eps) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("hc_mixes", &hc_mixes);
}
