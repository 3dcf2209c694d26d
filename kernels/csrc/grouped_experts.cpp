// Routed MoE experts on the host CPU in one call: deepinfer::blocked_grouped_experts.
//
// Why: at decode each expert sees a few rows (batch 32, top-4 of 16: ~8), so the experts are a stream over their
// weights; torch._grouped_mm on CPU runs one sgemm per expert on transposed weights and reached about half the
// read bandwidth, plus the sort / gather / scatter ops around it. Here the weights are blocked once at load
// (kernels/gemv.py's layout per expert, stacked) and one call does the routing bookkeeping, the gather, both
// projections (gemv.cpp's micro-kernels), the clipped SwiGLU and the weighted scatter-add.
//
// Order: every (token, choice) pair of expert e, in ascending pair index, for e = 0, 1, ...; each token's
// output accumulates its experts in ascending expert id: the order of the torch form (kernels/grouped_experts.py,
// a stable sort by expert then index_add_). Pairs whose id lies outside [0, E) (experts other ranks hold under
// expert parallelism) are skipped; so are experts with no pairs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace deepinfer {
void blocked_gemm_f32(const float* x, int64_t rows, int64_t in, const void* w, bool w_bf16, int64_t tiles,
                      int64_t out_features, float* y);
}

namespace {

using deepinfer::blocked_gemm_f32;
constexpr int64_t kTile = 16;

// Checks one stacked blocked weight [E, tiles, steps, lanes] against [E, out, in]; returns its tile count.
int64_t check_blocked(const at::Tensor& w, const char* name, int64_t experts, int64_t out, int64_t in) {
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous(), "blocked_grouped_experts: ", name,
              " must be a contiguous [E, tiles, steps, lanes] tensor from kernels/grouped_experts.py, got ",
              w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "blocked_grouped_experts: ", name,
              " must be float32 or bfloat16, got ", w.scalar_type());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const int64_t tiles = (out + kTile - 1) / kTile;
  TORCH_CHECK(w.size(0) == experts && w.size(1) == tiles && w.size(2) == (bf16 ? (in + 1) / 2 : in) &&
                  w.size(3) == (bf16 ? 2 : 1) * kTile,
              "blocked_grouped_experts: ", name, " ", w.sizes(), " does not hold ", experts, " experts of [", out,
              ", ", in, "]");
  return tiles;
}

at::Tensor blocked_grouped_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& local_ids,
                                   const at::Tensor& gate_up, const at::Tensor& down, int64_t inter,
                                   double limit) {
  TORCH_CHECK(x.dim() == 2, "blocked_grouped_experts: x must be [T, hidden], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "blocked_grouped_experts: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(local_ids.dim() == 2 && local_ids.size(0) == tokens && local_ids.scalar_type() == at::kLong,
              "blocked_grouped_experts: local_ids must be int64 [T, k] with T = ", tokens, ", got ",
              local_ids.sizes(), " ", local_ids.scalar_type());
  TORCH_CHECK(weights.sizes() == local_ids.sizes(), "blocked_grouped_experts: weights ", weights.sizes(),
              " must match local_ids ", local_ids.sizes());
  TORCH_CHECK(inter >= 1, "blocked_grouped_experts: inter must be >= 1, got ", inter);
  const int64_t experts = gate_up.size(0), top_k = local_ids.size(1);
  const int64_t gu_tiles = check_blocked(gate_up, "gate_up", experts, 2 * inter, hidden);
  const int64_t down_tiles = check_blocked(down, "down", experts, hidden, inter);
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "blocked_grouped_experts: gate_up and down must share "
              "one dtype, got ", gate_up.scalar_type(), " and ", down.scalar_type());
  const bool w_bf16 = gate_up.scalar_type() == at::kBFloat16;

  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wf = weights.to(at::kFloat).contiguous();
  const at::Tensor ids = local_ids.contiguous();
  at::Tensor out = at::zeros({tokens, hidden}, xf.options());
  const int64_t pairs = tokens * top_k;
  if (pairs == 0) return out.to(x.scalar_type());

  // Counting sort of the pairs by expert, stable (ascending pair index within an expert).
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p)
    if (id[p] >= 0 && id[p] < experts) ++start[id[p] + 1];
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    most = std::max(most, start[e + 1]);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> order(start[experts]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p)
    if (id[p] >= 0 && id[p] < experts) order[fill[id[p]]++] = p;
  if (most == 0) return out.to(x.scalar_type());

  std::vector<float> rows_in(most * hidden), gu(most * 2 * inter), h(most * inter), y(most * hidden);
  const float* xs = xf.data_ptr<float>();
  const float* ws = wf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const char* gu_w = static_cast<const char*>(gate_up.data_ptr());
  const char* down_w = static_cast<const char*>(down.data_ptr());
  const int64_t gu_bytes = gate_up[0].numel() * gate_up.element_size();
  const int64_t down_bytes = down[0].numel() * down.element_size();
  const float lim = static_cast<float>(limit);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* mine = order.data() + start[e];
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(xs + (mine[r] / top_k) * hidden, hidden, rows_in.data() + r * hidden);
    blocked_gemm_f32(rows_in.data(), n, hidden, gu_w + e * gu_bytes, w_bf16, gu_tiles, 2 * inter, gu.data());
    for (int64_t r = 0; r < n; ++r) {
      const float* g = gu.data() + r * 2 * inter;
      float* hr = h.data() + r * inter;
      for (int64_t j = 0; j < inter; ++j) {
        const float gate = std::min(g[j], lim);
        const float up = std::min(std::max(g[inter + j], -lim), lim);
        hr[j] = gate / (1.f + std::exp(-gate)) * up;
      }
    }
    blocked_gemm_f32(h.data(), n, inter, down_w + e * down_bytes, w_bf16, down_tiles, hidden, y.data());
    for (int64_t r = 0; r < n; ++r) {
      const float scale = ws[mine[r]];
      const float* yr = y.data() + r * hidden;
      float* dst = o + (mine[r] / top_k) * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] += yr[c] * scale;
    }
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("blocked_grouped_experts(Tensor x, Tensor weights, Tensor local_ids, Tensor gate_up, Tensor down, "
        "int inter, float limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("blocked_grouped_experts", &blocked_grouped_experts);
}
