// RMS norm on the host CPU: deepinfer::rms_norm, y = weight * (x / sqrt(mean(x^2) + eps)), fp32 math, rounded once
// to x's dtype (DeepSeek-V4's convention: fp32 weights, transformers' DeepseekV4RMSNorm); no weight: unweighted.
//
// Why: the torch form is ~7 small ops (cast, square, mean, add, rsqrt, two products); a V4 decode step runs ~36
// norms (block inputs, q LoRA, per-head q, kv, compressors), ~250 dispatches for a few microseconds of arithmetic.
// The sum of squares runs in attention_math's dot order, not torch's: results differ from the torch form in the
// last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "attention_math.h"

namespace {

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x must be float32 or bfloat16 [..., D], got ", x.sizes(), " ", x.scalar_type());
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor w;
  if (weight.has_value()) {
    w = weight->to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == dim, "rms_norm: weight must have ", dim, " values, got ", weight->sizes());
  }
  at::Tensor out = at::empty_like(xf);
  const float* xp = xf.data_ptr<float>();
  const float* wp = weight.has_value() ? w.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * dim;
      float* o = op + r * dim;
      const float scale = 1.f / std::sqrt(deepinfer::attention_math::dot(row, row, dim) / dim + e);
      if (wp != nullptr) {
        for (int64_t c = 0; c < dim; ++c) o[c] = wp[c] * (row[c] * scale);
      } else {
        for (int64_t c = 0; c < dim; ++c) o[c] = row[c] * scale;
      }
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
