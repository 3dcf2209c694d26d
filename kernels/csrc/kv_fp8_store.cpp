// The fp8 KV cache's store on the host: deepinfer::rope_qkv_to_cache_fp8, RoPE on q and k with K and V written to
// their cache slots as e4m3 codes (kv_cache_dtype=fp8_e4m3; kernels/kv_fp8.py).
//
// Why: the fp8 cache's eager store was torch's quantize_kv (~15 small ops: frexp, ldexp, round, casts) twice a
// layer after the unfused RoPE, and it kept fp8 models off the one-op decode loop (llama_decode.cpp), so a batch-32
// SmolLM2 step paid ~30 layers x ~40 dispatched ops more than the bf16 cache's step.
//
// The codes are kernels/kv_fp8.py's e4m3_codes(x / scale) bit for bit (tests/test_kv_fp8_store.py compares every
// code, ties and saturation): x / scale in fp32 (a division, as torch divides by the scalar), clamped to
// +-fp8_max, rounded to nearest even. RoPE itself is deepinfer::rope_qkv_to_cache (fused_layer_ops.cpp), called
// into a small scratch of the step's tokens, so the rotated values are those of the bf16 / fp32 path.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_math.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr float kMinNormal = 0x1p-6f;  // e4m3's smallest normal: below it the codes are multiples of 2^-9

// The e4m3 code of v (already divided by the scale), clamped to +-fp8_max (<= 448), round to nearest even.
// Normal: the fp32's bits rounded to 3 mantissa bits (a carry moves into the exponent, as rounding up a binade
// does), the exponent rebiased from 127 to 7. Below 2^-6: the multiple of 2^-9, rounded (v * 512 is exact).
inline uint8_t e4m3_code(float v, float fp8_max) {
  v = v < -fp8_max ? -fp8_max : (v > fp8_max ? fp8_max : v);
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t sign = (bits >> 24) & 0x80, magnitude_bits = bits & 0x7FFFFFFF;
  float magnitude;
  std::memcpy(&magnitude, &magnitude_bits, sizeof magnitude);
  uint32_t code;
  if (magnitude >= kMinNormal) {
    code = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - (120u << 3);
  } else {
    code = static_cast<uint32_t>(std::nearbyint(magnitude * 512.f));
  }
  return static_cast<uint8_t>(code | sign);
}

#ifdef __AVX512F__
// e4m3_code on 16 lanes, the same steps.
inline __m128i e4m3_codes16(__m512 v, __m512 fp8_max) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_sub_ps(_mm512_setzero_ps(), fp8_max)), fp8_max);
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i magnitude_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 magnitude = _mm512_castsi512_ps(magnitude_bits);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude_bits, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(magnitude_bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFFF))), 20),
      _mm512_set1_epi32(120 << 3));
  const __m512i small = _mm512_cvt_roundps_epi32(_mm512_mul_ps(magnitude, _mm512_set1_ps(512.f)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 is_normal = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(kMinNormal), _CMP_GE_OQ);
  return _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_mask_blend_epi32(is_normal, small, normal), sign));
}
#endif

// n values of src / scale as codes into dst.
template <typename scalar_t>
void store_codes(const scalar_t* src, uint8_t* dst, int64_t n, float scale, float fp8_max) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 scale16 = _mm512_set1_ps(scale), max16 = _mm512_set1_ps(fp8_max);
  for (; i + 16 <= n; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     e4m3_codes16(_mm512_div_ps(deepinfer::attention_math::load16(src + i), scale16), max16));
  }
#endif
  for (; i < n; ++i) dst[i] = e4m3_code(static_cast<float>(src[i]) / scale, fp8_max);
}

using RopeToCache = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                               const at::Tensor&, int64_t, int64_t);

at::Tensor rope_qkv_to_cache_fp8(const at::Tensor& qkv,           // [T, (H + 2 Hkv) D] float32 or bfloat16
                                 const at::Tensor& cos,           // [T, 1, D/2] qkv's dtype
                                 const at::Tensor& sin,           // [T, 1, D/2]
                                 at::Tensor& k_cache,             // [num_slots, Hkv, D] uint8 e4m3, written
                                 at::Tensor& v_cache,             // [num_slots, Hkv, D] uint8 e4m3, written
                                 const at::Tensor& slot_mapping_in,  // [T] int64
                                 int64_t num_heads, int64_t num_kv_heads, double k_scale, double v_scale,
                                 double fp8_max) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte,
              "rope_qkv_to_cache_fp8: caches must be contiguous uint8 [num_slots, ", num_kv_heads,
              ", D] of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_scale > 0 && v_scale > 0 && fp8_max > 0 && fp8_max <= 448.0,
              "rope_qkv_to_cache_fp8: scales must be > 0 and fp8_max in (0, 448]");
  const int64_t tokens = qkv.size(0), dim = k_cache.size(2), slots = k_cache.size(0), row = num_kv_heads * dim;
  const at::Tensor slot_mapping = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK(slot_mapping.numel() == tokens, "rope_qkv_to_cache_fp8: slot_mapping must have one slot per token");
  const int64_t* slot_ptr = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // all checked before any write: a bad slot leaves the caches untouched
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < slots, "rope_qkv_to_cache_fp8: slot ", slot_ptr[t],
                " outside the cache (", slots, " slots)");
  }
  // The rotation (and its checks) is rope_qkv_to_cache's, into a scratch holding this step's tokens in order.
  static const auto rope = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("deepinfer::rope_qkv_to_cache", "")
                               .typed<RopeToCache>();
  at::Tensor k_rows = at::empty({tokens, num_kv_heads, dim}, qkv.options());
  at::Tensor v_rows = at::empty_like(k_rows);
  const at::Tensor in_order = at::arange(tokens, slot_mapping.options());
  at::Tensor q = rope.call(qkv, cos, sin, k_rows, v_rows, in_order, num_heads, num_kv_heads);
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale), top = static_cast<float>(fp8_max);
  uint8_t* kp = k_cache.data_ptr<uint8_t>();
  uint8_t* vp = v_cache.data_ptr<uint8_t>();
  auto store = [&](auto tag) {  // float or bf16: rope_qkv_to_cache has checked qkv's dtype
    using scalar_t = decltype(tag);
    const scalar_t* k_src = k_rows.data_ptr<scalar_t>();
    const scalar_t* v_src = v_rows.data_ptr<scalar_t>();
    // A batch-32 step's 32 rows are a few microseconds of work: one thread (an OpenMP region would cost more).
    at::parallel_for(0, tokens, tokens * row <= 16384 ? std::max<int64_t>(tokens, 1) : 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        store_codes(k_src + t * row, kp + slot_ptr[t] * row, row, ks, top);
        store_codes(v_src + t * row, vp + slot_ptr[t] * row, row, vs, top);
      }
    });
  };
  if (qkv.scalar_type() == at::kBFloat16) {
    store(c10::BFloat16{});
  } else {
    store(float{});
  }
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("rope_qkv_to_cache_fp8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads, float k_scale, float v_scale, float fp8_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("rope_qkv_to_cache_fp8", &rope_qkv_to_cache_fp8);
}
