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
//
// deepinfer::ring_sink_attention: the same for decode rows, with the sliding-window keys read where they lie (the
// layer's ring for positions before the token's chunk, this step's fresh rows after) instead of a gathered copy:
// the gather and its index and mask arithmetic were ~20 small torch ops and a [T, window, D] copy per layer.
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

// One token: softmax over the keys ``rows[0 .. n)`` plus the sink, per head; adds the weighted keys to ``out``
// [H, D] (zeros on entry). ``scores``: scratch of >= H * n floats, ``heads_of``: of >= H pointers. Key-major: each
// key is read once for all heads' scores and once for all heads' outputs (head-major read every key 2H times, from
// L2: that bound the op at batch 32). Every score and output element is still summed in the same order (dot's order;
// keys ascending), so the bits do not depend on the loop order.
void attend_token(const float* qt, const float* const* rows, int64_t n, int64_t heads, int64_t dim,
                  const float* sinks, float scale, float* scores, const float** heads_of, float* out) {
  for (int64_t h = 0; h < heads; ++h) heads_of[h] = qt + h * dim;
  float head_scores[64];
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h0 = 0; h0 < heads; h0 += 64) {
      const int64_t count = std::min<int64_t>(64, heads - h0);
      dots_of_rows(rows[i], heads_of + h0, count, dim, head_scores);
      for (int64_t h = 0; h < count; ++h) scores[(h0 + h) * n + i] = head_scores[h] * scale;
    }
  }
  float inv_of[64];
  for (int64_t h0 = 0; h0 < heads; h0 += 64) {
    const int64_t count = std::min<int64_t>(64, heads - h0);
    for (int64_t h = h0; h < h0 + count; ++h) {
      float* s = scores + h * n;
      float top = sinks[h];
      for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
      float sink = sinks[h];
      exp_shifted_inplace(&sink, 1, top);
      exp_shifted_inplace(s, n, top);
      inv_of[h - h0] = 1.f / (sink + sum_of(s, n));
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* kr = rows[i];
      for (int64_t h = h0; h < h0 + count; ++h) {
        const float p = scores[h * n + i] * inv_of[h - h0];
        float* oh = out + h * dim;
        for (int64_t c = 0; c < dim; ++c) oh[c] += p * kr[c];
      }
    }
  }
}

void check_sinks(const at::Tensor& q, const at::Tensor& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "sink_attention: q must be float32 [T, H, D], got ",
              q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == q.size(1), "sink_attention: sinks must be [", q.size(1),
              "], got ", sinks.sizes());
}

at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& allowed,
                          const at::Tensor& extra, const at::Tensor& extra_allowed, const at::Tensor& sinks,
                          double scale) {
  check_sinks(q, sinks);
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  check_keys(keys, allowed, "keys", tokens, dim);
  check_keys(extra, extra_allowed, "extra", tokens, dim);
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
    std::vector<const float*> rows(total), heads_of(heads);
    for (int64_t t = begin; t < end; ++t) {
      int64_t n = 0;
      const float* base1 = k1p + (shared1 ? 0 : t) * n1 * dim;
      const float* base2 = k2p + (shared2 ? 0 : t) * n2 * dim;
      for (int64_t k = 0; k < n1; ++k)
        if (a1p[t * n1 + k]) rows[n++] = base1 + k * dim;
      for (int64_t k = 0; k < n2; ++k)
        if (a2p[t * n2 + k]) rows[n++] = base2 + k * dim;
      attend_token(qp + t * heads * dim, rows.data(), n, heads, dim, sp, sc, scores.data(), heads_of.data(),
                   op + t * heads * dim);
    }
  });
  return out;
}

// Decode rows ``first .. first + L`` of the step (q holds just these rows): token t's window is positions
// ``pos - window + 1 .. pos`` (those >= 0); a position before the token's chunk start lies in the ring (row
// ``slot``, entry ``position mod C``; a slot of -1 reads the scratch row), a later one is the step's fresh row
// ``t - (pos - position)``. Then the allowed ``extra`` keys (compressed entries), as in sink_attention.
at::Tensor ring_sink_attention(const at::Tensor& q, const at::Tensor& ring, const at::Tensor& fresh,
                               const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& positions,
                               int64_t first, int64_t window, const at::Tensor& extra,
                               const at::Tensor& extra_allowed, const at::Tensor& sinks, double scale) {
  check_sinks(q, sinks);
  const int64_t count = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(ring.dim() == 3 && ring.size(2) == dim && ring.scalar_type() == at::kFloat && ring.is_contiguous(),
              "ring_sink_attention: ring must be contiguous float32 [S + 1, C, ", dim, "], got ", ring.sizes(), " ",
              ring.scalar_type());
  TORCH_CHECK(fresh.dim() == 2 && fresh.size(1) == dim && fresh.scalar_type() == at::kFloat,
              "ring_sink_attention: fresh must be float32 [T, ", dim, "], got ", fresh.sizes(), " ",
              fresh.scalar_type());
  const int64_t steps = fresh.size(0);
  TORCH_CHECK(first >= 0 && first + count <= steps && window >= 1, "ring_sink_attention: rows [", first, ", ",
              first + count, ") of a ", steps, "-row step, window ", window);
  for (const at::Tensor* t : {&slots, &starts, &positions})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == steps && t->scalar_type() == at::kLong,
                "ring_sink_attention: slots, starts and positions must be int64 [", steps, "], got ", t->sizes(),
                " ", t->scalar_type());
  check_keys(extra, extra_allowed, "extra", count, dim);
  const at::Tensor qc = q.contiguous(), fc = fresh.contiguous(), k2 = extra.contiguous();
  const at::Tensor a2 = extra_allowed.contiguous(), sk = sinks.to(at::kFloat).contiguous();
  const at::Tensor sl = slots.contiguous(), st = starts.contiguous(), ps = positions.contiguous();
  at::Tensor out = at::zeros({count, heads, dim}, q.options());
  const int64_t capacity = ring.size(1), scratch = ring.size(0) - 1, n2 = k2.size(1);
  const float* qp = qc.data_ptr<float>();
  const float* rp = ring.data_ptr<float>();
  const float* fp = fc.data_ptr<float>();
  const float* k2p = k2.data_ptr<float>();
  const bool* a2p = a2.data_ptr<bool>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* stp = st.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  const float* sp = sk.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const bool shared2 = k2.size(0) == 1;
  for (int64_t t = first; t < first + count; ++t)  // checked here: an exception must not leave a parallel region
    TORCH_CHECK(slp[t] <= scratch, "ring_sink_attention: state slot ", slp[t], " outside the ring's ", scratch + 1,
                " rows");
  at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * (window + n2));
    std::vector<const float*> rows(window + n2), heads_of(heads);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = first + i, pos = pp[t], start = stp[t];
      const int64_t slot = slp[t] < 0 ? scratch : slp[t];
      const float* ring_row = rp + slot * capacity * dim;
      int64_t n = 0;
      for (int64_t p = std::max<int64_t>(pos - window + 1, 0); p <= pos; ++p) {
        if (p < start) {
          rows[n++] = ring_row + (p % capacity) * dim;
        } else {
          const int64_t row = std::min(std::max<int64_t>(t - (pos - p), 0), steps - 1);
          rows[n++] = fp + row * dim;
        }
      }
      const float* base2 = k2p + (shared2 ? 0 : i) * n2 * dim;
      for (int64_t k = 0; k < n2; ++k)
        if (a2p[i * n2 + k]) rows[n++] = base2 + k * dim;
      attend_token(qp + i * heads * dim, rows.data(), n, heads, dim, sp, sc, scores.data(), heads_of.data(),
                   op + i * heads * dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("sink_attention(Tensor q, Tensor keys, Tensor allowed, Tensor extra, Tensor extra_allowed, Tensor sinks, "
        "float scale) -> Tensor");
  m.def("ring_sink_attention(Tensor q, Tensor ring, Tensor fresh, Tensor slots, Tensor starts, Tensor positions, "
        "int first, int window, Tensor extra, Tensor extra_allowed, Tensor sinks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("sink_attention", &sink_attention);
  m.impl("ring_sink_attention", &ring_sink_attention);
}
