// Sinkhorn-Knopp normalization of mHC's comb mixes on the host CPU: deepinfer::sinkhorn.
//
// Why: each normalization is three tiny torch ops over [T, hc, hc] (hc = 4); 20 iterations are ~120 ops per mHC
// site and ~1.5k per decode step of a 6-layer model, a few microseconds of dispatch each for a few nanoseconds of
// arithmetic. Here one call does the whole loop per token, in the torch form's order (kernels/hyper_connections.py):
// columns, then rows and columns ``iters - 1`` times; each sum runs in ascending index, then ``+ eps``, then a
// division, as torch computes them for these sizes, so the result is the same to the bit in practice.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

at::Tensor sinkhorn(const at::Tensor& comb, int64_t iters, double eps) {
  TORCH_CHECK(comb.dim() == 3 && comb.size(1) == comb.size(2), "sinkhorn: comb must be [T, hc, hc], got ",
              comb.sizes());
  TORCH_CHECK(comb.scalar_type() == at::kFloat, "sinkhorn: comb must be float32, got ", comb.scalar_type());
  TORCH_CHECK(iters >= 1, "sinkhorn: iters must be >= 1, got ", iters);
  at::Tensor out = comb.contiguous().clone();
  const int64_t tokens = out.size(0), n = out.size(1);
  const float e = static_cast<float>(eps);
  float* base = out.data_ptr<float>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(n);
    for (int64_t t = begin; t < end; ++t) {
      float* m = base + t * n * n;
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
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("sinkhorn(Tensor comb, int iters, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("sinkhorn", &sinkhorn);
}
