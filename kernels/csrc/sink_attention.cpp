// DeepSeek-V4 attention with per-head sinks on the host CPU: deepinfer::sink_attention.
//
// Why: at decode every token attends its own keys (sliding window + compressed entries, one K = V head), so the
// torch form is a batched matmul of [H, D] x [D, K] per token (MKL's small batched GEMM), a concatenation of the
// two key sets, the mask, the sink column, the softmax and a second batched matmul: ~1 ms per layer at batch 32
// for ~10 M multiply-adds. Here one pass per token reads its keys once from both sets (no concatenation), in
// fp32, the softmax over the allowed keys plus the sink logit (which takes mass and carries no value).
//
// Keys: ``keys`` [G, K, D] and ``extra`` [G, E, D] (G = T: per-token keys; G = 1: shared by a prefill chunk's
// queries); ``allowed`` [T, K] and ``extra_allowed`` [T, E] mask them. Disallowed keys get probability exactly 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace deepinfer::attention_math;

void check_keys(const at::Tensor& keys, const at::Tensor& allowed, const char* name, int64_t tokens, int64_t dim) {
  TORCH_CHECK(keys.dim() == 3 && (keys.size(0) == tokens || keys.size(0) == 1) && keys.size(2) == dim &&
                  keys.scalar_type() == at::kFloat,
              "sink_attention: ", name, " must be float32 [T or 1, K, ", dim, "] with T = ", tokens, ", got ",
              keys.sizes(), " ", keys.scalar_type());
  TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == tokens && allowed.size(1) == keys.size(1) &&
                  allowed.scalar_type() == at::kBool,
              "sink_attention: the mask of ", name, " must be bool [", tokens, ", ", keys.size(1), "], got ",
              allowed.sizes(), " ", allowed.scalar_type());
}

at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& allowed,
                          const at::Tensor& extra, const at::Tensor& extra_allowed, const at::Tensor& sinks,
                          double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "sink_attention: q must be float32 [T, H, D], got ",
              q.sizes(), " ", q.scalar_type());
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  check_keys(keys, allowed, "keys", tokens, dim);
  check_keys(extra, extra_allowed, "extra", tokens, dim);
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == heads, "sink_attention: sinks must be [", heads, "], got ",
              sinks.sizes());
  const at::Tensor qc = q.contiguous(), k1 = keys.contiguous(), k2 = extra.contiguous();
  const at::Tensor a1 = allowed.contiguous(), a2 = extra_allowed.contiguous();
  const at::Tensor sk = sinks.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({tokens, heads, dim}, q.options());
  const int64_t n1 = k1.size(1), n2 = k2.size(1), total = n1 + n2;
  const float* qp = qc.data_ptr<float>();
  const float* k1p = k1.data_ptr<float>();
  const float* k2p = k2.data_ptr<float>();
  const bool* a1p = a1.data_ptr<bool>();
  const bool* a2p = a2.data_ptr<bool>();
  const float* sp = sk.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool shared1 = k1.size(0) == 1, shared2 = k2.size(0) == 1;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * total);
    std::vector<const float*> rows(total);
    std::vector<int64_t> live;
    live.reserve(total);
    for (int64_t t = begin; t < end; ++t) {
      live.clear();
      const float* base1 = k1p + (shared1 ? 0 : t) * n1 * dim;
      const float* base2 = k2p + (shared2 ? 0 : t) * n2 * dim;
      for (int64_t k = 0; k < n1; ++k)
        if (a1p[t * n1 + k]) { rows[live.size()] = base1 + k * dim; live.push_back(k); }
      for (int64_t k = 0; k < n2; ++k)
        if (a2p[t * n2 + k]) { rows[live.size()] = base2 + k * dim; live.push_back(n1 + k); }
      const int64_t n = static_cast<int64_t>(live.size());
      const float* qt = qp + t * heads * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = qt + h * dim;
        float* s = scores.data() + h * total;
        float top = sp[h];
        for (int64_t i = 0; i < n; ++i) {
          s[i] = dot(qh, rows[i], dim) * sc;
          top = std::max(top, s[i]);
        }
        float sink = sp[h];
        exp_shifted_inplace(&sink, 1, top);
        exp_shifted_inplace(s, n, top);
        const float inv = 1.f / (sink + sum_of(s, n));
        float* oh = op + (t * heads + h) * dim;
        for (int64_t i = 0; i < n; ++i) {
          const float p = s[i] * inv;
          const float* kr = rows[i];
          for (int64_t c = 0; c < dim; ++c) oh[c] += p * kr[c];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("sink_attention(Tensor q, Tensor keys, Tensor allowed, Tensor extra, Tensor extra_allowed, Tensor sinks, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("sink_attention", &sink_attention);
}
