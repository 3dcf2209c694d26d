// DeepSeek-V4's interleaved tail RoPE on the host CPU: deepinfer::tail_rope.
//
// Why: the torch form (kernels/interleaved_rope.py) is ~14 small ops (the cos / sin widened to pairs, the rotated
// half stacked, products, a concatenation with the untouched channels), called four or five times per layer and
// step; here one pass copies each row and rotates its last P channels: pair (x0, x1) -> (x0 c - x1 s, x1 c + x0 s).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

at::Tensor tail_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() >= 2 && x.scalar_type() == at::kFloat, "tail_rope: x must be float32 [T, ..., D], got ",
              x.sizes(), " ", x.scalar_type());
  const int64_t tokens = x.size(0), dim = x.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "tail_rope: cos and sin must be float32 [", tokens, ", P / 2], got ", cos.sizes(), " and ", sin.sizes());
  const int64_t half = cos.size(1), first = dim - 2 * half;
  TORCH_CHECK(first >= 0, "tail_rope: 2 * cos.size(1) = ", 2 * half, " exceeds the head dim ", dim);
  const at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t per_token = xc.numel() / std::max<int64_t>(tokens, 1), heads = per_token / dim;
  const float* xp = xc.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * half;
      const float* st = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* src = xp + (t * heads + h) * dim;
        float* dst = op + (t * heads + h) * dim;
        std::copy_n(src, first, dst);
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = src[first + 2 * i], x1 = src[first + 2 * i + 1];
          dst[first + 2 * i] = x0 * ct[i] + -x1 * st[i];
          dst[first + 2 * i + 1] = x1 * ct[i] + x0 * st[i];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("tail_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("tail_rope", &tail_rope);
}
