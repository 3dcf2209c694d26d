// Paged decode attention for the host CPU: deepinfer::cpu_paged_decode_attention.
//
// Why a hand-written kernel: decode attention streams the fp32 KV cache from DRAM, and both torch forms waste
// bandwidth. Eagerly, gathering the blocks copies K and V out before SDPA reads them again; under inductor, the
// fused form reads every padded position of the width bucket and runs its softmax reductions one OpenMP region
// per batch row. Here one task per request reads each visible K and V slot row (all KV heads, contiguous) exactly
// once, for all its query rows, with the scores in a small per-task buffer. SmolLM2 layer at batch 32 with
// 120-token contexts in a DRAM-resident pool: 0.22-0.25 ms with each request's blocks adjacent, against 0.40 ms
// for gather + SDPA; 0.57 ms with blocks scattered at random (the hardware prefetcher restarts at every 12 KB
// block; software prefetch of the next block won 14% there but lost 23% on adjacent blocks, so it is not used).
//
// Semantics are those of kernels/attention.py's paged_decode_attention: query i of a request sits at position
// max(seq_len - Q + i, 0) and sees keys 0..position; query head h reads KV head h / (H / Hkv).
//
// Element types: float32, or bfloat16 q / caches / output with every product, the softmax and the accumulators
// in fp32. A bf16 slot row is widened to fp32 once (exact: a bf16 is the top half of an fp32) and then serves
// all the query heads of its KV heads, so the math is the fp32 kernel's and only the loads differ; widening
// needs AVX-512F (or plain shifts), no bf16 instructions, so every x86 CPU runs it. The output is rounded to
// bf16 once, at the end (round to nearest even).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using namespace deepinfer::attention_math;

// n values as fp32: float rows are read in place; bf16 rows are widened into ``scratch``.
inline const float* as_float(const float* src, float* /*scratch*/, int64_t /*n*/) { return src; }

inline const float* as_float(const at::BFloat16* src, float* scratch, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(scratch + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}

template <typename scalar_t>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, int64_t query_len,
                      int64_t block_size, float scale_f) {
  const int64_t num_reqs = tables.size(0), width = tables.size(1);
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t group = heads / kv_heads;
  const int64_t rows = query_len * heads;  // one row per (query, head) of a request
  const int64_t max_keys = width * block_size;
  const int64_t slot_stride = kv_heads * head_dim;
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // One task per request: a slot's K (or V) row for every head is one contiguous read, and the blocks of a
  // request stream in order.
  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(rows * max_keys);  // row r = i * heads + h
    std::vector<float> acc(rows * head_dim);
    std::vector<float> denominators(rows);
    std::vector<float> q_scratch(rows * head_dim), row_scratch(slot_stride);  // widened bf16 (unused for fp32)
    std::vector<int64_t> visible(query_len);  // query i sees positions 0 .. visible[i] - 1
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* table = table_ptr + b * width;
      // Offset of position s's slot row in a cache; every block id read is checked (a bad one would read
      // outside the cache), where it is used rather than by extra reductions over the table per call.
      auto slot_offset = [&](int64_t s) {
        const int64_t block = table[s / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables holds a block id outside the cache (",
                    num_blocks, " blocks): ", block);
        return (block * block_size + s % block_size) * slot_stride;
      };
      const float* q_req = as_float(q_ptr + b * rows * head_dim, q_scratch.data(), rows * head_dim);
      for (int64_t i = 0; i < query_len; ++i) {
        const int64_t position = std::max<int64_t>(len_ptr[b] - query_len + i, 0);
        visible[i] = std::min(position + 1, max_keys);
      }
      const int64_t num_keys = visible[query_len - 1];
      for (int64_t s = 0; s < num_keys; ++s) {  // scores: each K row read once
        const float* key = as_float(k_ptr + slot_offset(s), row_scratch.data(), slot_stride);
        for (int64_t i = 0; i < query_len; ++i) {
          if (s >= visible[i]) continue;
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t r = i * heads + h;
            scores[r * max_keys + s] = dot(q_req + r * head_dim, key + (h / group) * head_dim, head_dim) * scale_f;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {  // softmax numerators; the division comes last, on the output
        float* row = scores.data() + r * max_keys;
        const int64_t n = visible[r / heads];
        exp_shifted_inplace(row, n, max_of(row, n));
        denominators[r] = sum_of(row, n);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < num_keys; ++s) {  // weighted values: each V row read once
        const float* value_row = as_float(v_ptr + slot_offset(s), row_scratch.data(), slot_stride);
        for (int64_t i = 0; i < query_len; ++i) {
          if (s >= visible[i]) continue;
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t r = i * heads + h;
            const float p = scores[r * max_keys + s];
            const float* value = value_row + (h / group) * head_dim;
            float* a = acc.data() + r * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
          }
        }
      }
      scalar_t* out_req = out_ptr + b * rows * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / denominators[r];
        for (int64_t d = 0; d < head_dim; ++d) {
          out_req[r * head_dim + d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
        }
      }
    }
  });
}

at::Tensor cpu_paged_decode_attention(const at::Tensor& q_in,          // [B*Q, H, D] float32 or bfloat16
                                      const at::Tensor& k_cache,       // [num_slots, Hkv, D] q's dtype
                                      const at::Tensor& v_cache,       // [num_slots, Hkv, D] q's dtype
                                      const at::Tensor& block_tables,  // [B, nb] int32
                                      const at::Tensor& seq_lens,      // [B] int32
                                      int64_t query_len, int64_t block_size, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16, got ", q_in.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == q_in.scalar_type() && v_cache.scalar_type() == q_in.scalar_type(),
              "the caches must have q's dtype (", q_in.scalar_type(), "), got ", k_cache.scalar_type(), " and ",
              v_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "the caches must be contiguous and of one shape");
  const int64_t num_reqs = block_tables.size(0), width = block_tables.size(1);
  const int64_t heads = q_in.size(1), head_dim = q_in.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(query_len >= 1 && q_in.size(0) == num_reqs * query_len, "q must have B * query_len rows");
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(2) == head_dim, "q and the caches disagree on heads / dim");
  TORCH_CHECK(seq_lens.size(0) == num_reqs && width >= 1, "seq_lens must have one entry per block-table row");
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    decode_attention<at::BFloat16>(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), out,
                                   query_len, block_size, static_cast<float>(scale));
  } else {
    decode_attention<float>(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), out,
                            query_len, block_size, static_cast<float>(scale));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("cpu_paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int query_len, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("cpu_paged_decode_attention", &cpu_paged_decode_attention);
}
