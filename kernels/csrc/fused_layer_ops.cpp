// The small per-layer steps of a Llama decoder as one host op each: deepinfer::llama_rms_norm, llama_add_rms_norm,
// silu_and_mul and rope_qkv_to_cache.
//
// Why: eagerly, torch runs RMSNorm as ~8 ops (casts, pow, mean, add, rsqrt, two products), RoPE on q and k as ~12
// and the two KV-cache writes as two index_copy_ calls; at SmolLM2's decode sizes (32 x 576 activations) each op
// costs more in dispatch and in touching a fresh output than in arithmetic: ~0.3 ms a layer, 8-10 ms of a batch-32
// step (more in bf16, where every norm casts to fp32 and back). Compiled regions fuse these themselves and keep
// the torch forms; these ops serve eager host steps.
//
// Every result equals the torch form's bit for bit except for summation order in the norm's mean (16 partial
// sums) and exp in SiLU (a polynomial, ~2 ulp): products and sums are rounded where torch rounds them, bf16 intermediates to bf16
// (round to nearest even) where torch stores a bf16 tensor, and no product is fused into an FMA
// (fp-contract=off on the functions that would otherwise contract).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "attention_math.h"

namespace {

namespace attention_math = deepinfer::attention_math;

#define NO_FMA __attribute__((optimize("fp-contract=off")))

// A value as torch would store it in a tensor of scalar_t (bf16: round to nearest even).
template <typename scalar_t>
inline float stored(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// Rows per task: a few rows (up to 16k elements: 28 rows of a 576-wide norm, 17 of SmolLM2's RoPE) stay on one
// thread, where an OpenMP region would cost more than the work; more split evenly across the threads (a grain of
// 455 rows split a 512-row chunk 455 + 57). The limit was 256k elements, which kept a batch-32 decode step's norms,
// RoPE + KV writes and SiLU on the main thread (RoPE alone ~40 us a layer) while the other waited: Zen 4, 2
// threads, same process, steps alternating: bf16 batch 32 0.98x the step time (two runs), fp32 0.97-1.00x.
inline int64_t row_grain(int64_t rows, int64_t row_elems) {
  return rows * row_elems <= 16384 ? std::max<int64_t>(rows, 1) : 1;
}

// Whether scalar_t's loops below take 16 lanes at a time. Why: GCC leaves the bf16 loops scalar (each conversion
// back to bf16 checks for NaN), ~1.4 ns an element: the norms and RoPE of a batch-32 bf16 SmolLM2 step took
// ~1.5 ms on the main thread while the other one waited. The lanes do the scalar loops' operations in their order
// (products and sums unfused, bf16 rounded to nearest even), so both forms give the same bits.
#ifdef __AVX512F__
template <typename scalar_t>
constexpr bool kLanes16 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
using attention_math::load16;
using attention_math::store16;
using attention_math::stored16;
#else
template <typename scalar_t>
constexpr bool kLanes16 = false;
#endif

// torch's RMSNorm (kernels/norm.py): h = x in fp32; h * rsqrt(mean(h^2) + eps) stored in x's dtype; times weight.
// The mean's sum: 16 partial sums over the 16-aligned body, added in lane order, then the tail.
template <typename scalar_t>
NO_FMA void norm_row(const scalar_t* xr, const scalar_t* weight, scalar_t* o, int64_t hidden, float eps) {
  float lanes[16] = {};
  int64_t i = 0;
  if constexpr (kLanes16<scalar_t>) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= hidden; i += 16) {
      const __m512 v = load16(xr + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    _mm512_storeu_ps(lanes, acc);
#endif
  } else {
    for (; i + 16 <= hidden; i += 16) {
      for (int l = 0; l < 16; ++l) {
        const float v = static_cast<float>(xr[i + l]);
        lanes[l] += v * v;
      }
    }
  }
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  for (; i < hidden; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  int64_t j = 0;
  if constexpr (kLanes16<scalar_t>) {
#ifdef __AVX512F__
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; j + 16 <= hidden; j += 16) {
      const __m512 h = stored16(_mm512_mul_ps(load16(xr + j), inv16), scalar_t{});
      store16(o + j, _mm512_mul_ps(load16(weight + j), h));
    }
#endif
  }
  for (; j < hidden; ++j) {
    const float h = stored<scalar_t>(static_cast<float>(xr[j]) * inv);
    o[j] = static_cast<scalar_t>(static_cast<float>(weight[j]) * h);
  }
}

template <typename scalar_t>
void norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, row_grain(rows, hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + r * hidden, weight, out + r * hidden, hidden, eps);
  });
}

// s = a + b, each sum rounded to scalar_t.
template <typename scalar_t>
void add_stored_range(const scalar_t* a, const scalar_t* b, scalar_t* s, int64_t n) {
  int64_t i = 0;
  if constexpr (kLanes16<scalar_t>) {
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) store16(s + i, _mm512_add_ps(load16(a + i), load16(b + i)));
#endif
  }
  for (; i < n; ++i) s[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// Decode sizes on one thread; a prefill chunk in 16-aligned ranges over the threads.
template <typename scalar_t>
void add_stored(const scalar_t* a, const scalar_t* b, scalar_t* s, int64_t n) {
  at::parallel_for(0, (n + 15) / 16, n <= 262144 ? std::max<int64_t>((n + 15) / 16, 1) : 4096,
                   [&](int64_t begin, int64_t end) {
                     const int64_t first = begin * 16, last = std::min(end * 16, n);
                     add_stored_range(a + first, b + first, s + first, last - first);
                   });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "llama_rms_norm: x must be [T, hidden] float32 or bfloat16, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "llama_rms_norm: weight must be [", x.size(1), "] of x's dtype, got ", weight.sizes(), " ",
              weight.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_norm_args(x_in, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                        x.size(1), static_cast<float>(eps));
  });
  return out;
}

// (rms_norm(x + residual), x + residual): the residual add and the next norm of a decoder layer.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x_in, weight);
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() && residual_in.scalar_type() == x_in.scalar_type(),
              "llama_add_rms_norm: residual must match x (", x_in.sizes(), " ", x_in.scalar_type(), "), got ",
              residual_in.sizes(), " ", residual_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous();
  at::Tensor summed = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    scalar_t* s = summed.data_ptr<scalar_t>();
    add_stored(a, b, s, x.numel());
  });
  return {rms_norm(summed, weight, eps), summed};
}

// [T, 2I] = [gate | up] -> silu(gate) * up, silu stored in x's dtype first as torch does.
// The scalar loop below costs ~25 operations an element (GCC does not vectorize exp_poly): 6 ms of a batch-32
// SmolLM2 step; 16 lanes at a time it is ~1.7 ms. Returns how many leading elements it wrote (0 without AVX-512).
#ifdef __AVX512F__
template <typename scalar_t>
int64_t silu_and_mul_avx512(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  int64_t i = 0;
  if constexpr (!std::is_same_v<scalar_t, double>) {  // the dispatch's double takes the scalar loop only
    for (; i + 16 <= n; i += 16) {
      store16(out + i, _mm512_mul_ps(attention_math::silu16(load16(gate + i), scalar_t{}), load16(up + i)));
    }
  }
  return i;
}
#else
template <typename scalar_t>
int64_t silu_and_mul_avx512(const scalar_t*, const scalar_t*, scalar_t*, int64_t) {
  return 0;
}
#endif
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0 &&
                  (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "silu_and_mul: x must be [T, 2 * I] float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(rows, 2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * 2 * inter;
        const scalar_t* up = gate + inter;
        int64_t i = silu_and_mul_avx512(gate, up, op + r * inter, inter);
        for (; i < inter; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float act = stored<scalar_t>(g / (1.f + attention_math::exp_poly(-g > -87.3f ? -g : -87.3f)));
          op[r * inter + i] = static_cast<scalar_t>(act * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

// Pair (i, i + D/2) of one head rotated as kernels/rope.py's rotate: x1 c - x2 s, x2 c + x1 s, every product and
// sum stored in scalar_t.
template <typename scalar_t>
NO_FMA void rotate_head(const scalar_t* src, const scalar_t* cos, const scalar_t* sin, scalar_t* dst, int64_t half) {
  int64_t i = 0;
  if constexpr (kLanes16<scalar_t>) {
#ifdef __AVX512F__
    const scalar_t tag{};
    for (; i + 16 <= half; i += 16) {
      const __m512 x1 = load16(src + i), x2 = load16(src + half + i), c = load16(cos + i), s = load16(sin + i);
      store16(dst + i, _mm512_sub_ps(stored16(_mm512_mul_ps(x1, c), tag), stored16(_mm512_mul_ps(x2, s), tag)));
      store16(dst + half + i,
              _mm512_add_ps(stored16(_mm512_mul_ps(x2, c), tag), stored16(_mm512_mul_ps(x1, s), tag)));
    }
#endif
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(src[i]), x2 = static_cast<float>(src[half + i]);
    const float c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
    dst[i] = static_cast<scalar_t>(stored<scalar_t>(x1 * c) - stored<scalar_t>(x2 * s));
    dst[half + i] = static_cast<scalar_t>(stored<scalar_t>(x2 * c) + stored<scalar_t>(x1 * s));
  }
}

// qkv [T, (H + 2 Hkv) D] (the fused projection's output) -> rotated q [T, H, D]; rotated k and v are written to
// their cache slots. slot_mapping [T] int64; caches [num_slots, Hkv, D].
at::Tensor rope_qkv_to_cache(const at::Tensor& qkv, const at::Tensor& cos_in, const at::Tensor& sin_in,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping_in,
                             int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "rope_qkv_to_cache: caches must be contiguous [num_slots, ", num_kv_heads, ", D] of one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t dim = k_cache.size(2), half = dim / 2, tokens = qkv.size(0), slots = k_cache.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim && qkv.stride(1) == 1,
              "rope_qkv_to_cache: qkv must be [T, ", (num_heads + 2 * num_kv_heads) * dim,
              "] with contiguous rows, got ", qkv.sizes());
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "rope_qkv_to_cache: qkv and the caches must share one dtype, float32 or bfloat16");
  const at::Tensor cos = cos_in.reshape({tokens, half}).contiguous(), sin = sin_in.reshape({tokens, half}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_qkv_to_cache: cos and sin must have qkv's dtype");
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slot_mapping.numel() == tokens, "rope_qkv_to_cache: slot_mapping must have one slot per token");
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // all checked before any write: a bad slot leaves the caches untouched
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < slots, "rope_qkv_to_cache: slot ", slot_ptr[t],
                " outside the cache (", slots, " slots)");
  }
  at::Tensor q = at::empty({tokens, num_heads, dim}, qkv.options());
  const int64_t row_stride = qkv.stride(0), kv_row = num_kv_heads * dim;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_qkv_to_cache", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, row_grain(tokens, (num_heads + 2 * num_kv_heads) * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slot_ptr[t];
        const scalar_t* row = src + t * row_stride;
        const scalar_t* ct = cp + t * half;
        const scalar_t* st = sp + t * half;
        for (int64_t h = 0; h < num_heads; ++h) rotate_head(row + h * dim, ct, st, qp + (t * num_heads + h) * dim, half);
        const scalar_t* k_src = row + num_heads * dim;
        for (int64_t h = 0; h < num_kv_heads; ++h) rotate_head(k_src + h * dim, ct, st, kp + slot * kv_row + h * dim, half);
        std::copy_n(k_src + kv_row, kv_row, vp + slot * kv_row);
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("llama_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("llama_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_qkv_to_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("llama_rms_norm", &rms_norm);
  m.impl("llama_add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_qkv_to_cache", &rope_qkv_to_cache);
}
