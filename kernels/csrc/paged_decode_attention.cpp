// Paged decode attention for the host CPU: deepinfer::cpu_paged_decode_attention.
//
// Why a hand-written kernel: decode attention streams the KV cache from DRAM, and both torch forms waste
// bandwidth. Eagerly, gathering the blocks copies K and V out before SDPA reads them again; under inductor, the
// fused form reads every padded position of the width bucket and runs its softmax reductions one OpenMP region
// per batch row. Here one task per request reads each visible K and V slot row (all KV heads, contiguous) exactly
// once, for all its query rows, with the scores in a small per-task buffer.
//
// Why chunks of 16 keys: the first form of this kernel spent its time on instructions, not bytes (bf16, half the
// bytes, was barely faster): per key and query head a 64-float dot product ending in a horizontal reduce, then
// that head's accumulator loaded and stored, and a block-id check per key. Now a query row's 16 dot products of a
// chunk end in one transpose-add tree (attention_math.h), its accumulator stays in registers across the chunk,
// block ids are checked once per block, and exp runs 16 lanes at a time (GCC left it scalar). What then bounds a
// core is its DRAM stream, so the score pass prefetches the chunk's V rows (read again after the softmax) and the
// next chunk's K rows, and a request goes in softmax segments of 256 keys so that those V rows are still in L2
// (1.17-1.25x on top at 2,048 tokens, fp32, one thread). SmolLM2 layer at batch 32, 100-150-token contexts,
// DRAM-resident 512 MiB pools, 2 threads on a shared 2-core Xeon (load 0.3-2.1, four runs;
// benchmarks/results/decode_attention.md): fp32 0.50-0.53 -> 0.31-0.33 ms (1.58-1.68x) with each request's blocks
// adjacent, 0.55-0.61 -> 0.36-0.40 ms (1.51-1.67x) scattered, 80-85% of the read bandwidth x.sum() reached then;
// bf16 0.38-0.42 -> 0.23-0.25 ms (1.63-1.69x) and 0.44-0.52 -> 0.26-0.30 ms (1.68-1.79x), bound by instructions
// (the widening) again.
// On Zen 4 (2 cores, x.sum() 30 GB/s) the same layer took 0.35-0.44 ms fp32: a sampling profile put a third of it
// on the prefetch instructions, issued as one burst per chunk: they filled the miss buffers and stalled the core,
// and memory then idled while it computed. Now the prefetches go out a slice at a time between the score pass's
// steps, the last V pass of a request prefetches the next request's first K chunk, the query heads that share a
// KV head are served by one load of each key and value vector (three FMA chains instead of one), and bf16 rows are
// widened in registers, not through a scratch copy (benchmarks/results/decode_attention_zen4.md): fp32 0.41 ->
// 0.31 ms adjacent (1.31x), 0.43 -> 0.32 scattered (1.33x); bf16 0.29 -> 0.16 (1.82x) and 0.36 -> 0.22 (1.66x);
// 1.17-1.37x and 1.5-2.0x over all sizes. The results are the same bits as before.
// Then requests past 1,024 keys split into parts that the threads share, merged afterwards
// (benchmarks/results/decode_attention_parts_zen4.md): one stream at 2,048 tokens fp32 1.51-1.63x, bf16 1.59-1.60x,
// every other size within the noise (0.96-1.03x).
// Tried and dropped: prefetching the next request's K during the V pass as one burst (-14% on the Xeon; paced and
// limited to its first chunk it gains 1.05-1.08x on Zen 4), K prefetched two chunks ahead (no change, both
// machines), and a one-pass online softmax (K and V of a chunk read together: +9% with blocks scattered, -9% on
// adjacent bf16 blocks, within the noise otherwise).
// Long contexts (512-32k keys, batch 1 and 8, benchmarks/results/long_context_decode*.md, this VM's Xeon, whose
// x.sum() reads 12 GB/s on one core and 22-24 on two): the kernel is bound by memory, not by its math. fp32 on one
// thread reads 9 GB/s of K + V with blocks scattered over a 4 KiB-page pool and 12 GB/s (x.sum()'s) with each
// request's blocks adjacent on 2 MiB pages; two threads twice that; the same at 8k as at 32k. In L2 the math takes
// 17 ns a key and KV head (fp32), 12 (bf16), 16 (fp8), against 57 / 30 / 22 ns from DRAM with blocks scattered:
// prefetch hints T0 / T1 / T2 and K two chunks ahead change nothing there (the core's outstanding misses are the
// limit), and prefetching the next segment's K during the V pass made it 1.1-1.2x slower. fp8 alone comes near
// its math (7 GB/s of codes at best), about half of which is the e4m3 widening, hence load16_over256.
//
// Semantics are those of kernels/attention.py's paged_decode_attention: query i of a request sits at position
// max(seq_len - Q + i, 0) and sees keys 0..position; query head h reads KV head h / (H / Hkv).
//
// Element types: float32, or bfloat16 q / caches / output with every product, the softmax and the accumulators
// in fp32. bf16 K and V vectors are widened to fp32 as they are loaded (exact: a bf16 is the top half of an
// fp32; the portable loops widen a chunk into a scratch copy), so the math is the fp32 kernel's and only the loads
// differ; widening needs AVX-512F (or plain shifts), no bf16 instructions, so every x86 CPU runs it. The output is
// rounded to bf16 once, at the end (round to nearest even).
// fp8 caches (kv_cache_dtype=fp8_e4m3; the *_fp8 ops): K and V rows are e4m3 codes (one byte a value, a per-tensor
// k_scale / v_scale), widened to fp32 as they are loaded like bf16 (attention_math.h: load16 / fp8_to_float, exact),
// never dequantized into a copy; k_scale folds into the score scale and v_scale into the final normalization, so at
// scales of 1 (or powers of two) the result is the fp32 / bf16 kernel's over the dequantized cache, to the bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_math.h"
#include "attention_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using namespace deepinfer::attention_math;
using namespace deepinfer::attention_rows;

constexpr int64_t kSegment = 256;  // keys per softmax segment: 192 KB of fp32 V rows (SmolLM2) stay in L2
constexpr int64_t kPart = 4 * kSegment;  // keys per task: longer requests split into parts the threads share

// Where each request's queries are in q: Q each (decode), or from query_starts [B + 1] (prefill chunks).
struct QueryLayout {
  int64_t query_len;              // Q of every request when starts is null
  const int64_t* starts = nullptr;
  int64_t start(int64_t b) const { return starts ? starts[b] : b * query_len; }
  int64_t count(int64_t b) const { return starts ? starts[b + 1] - starts[b] : query_len; }
};

template <typename scalar_t, typename cache_t, typename Rows>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, QueryLayout layout,
                      int64_t block_size, float scale_f, float out_scale, Rows math, float* lse_ptr) {
  scale_f *= Rows::template unit<cache_t>();  // the rows' widened values are the cache's / unit (exact)
  out_scale *= Rows::template unit<cache_t>();
  const int64_t num_reqs = tables.size(0), width = tables.size(1);
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t num_blocks = k_cache.size(0) / block_size;
  const int64_t group = heads / kv_heads;
  int64_t max_queries = 0;
  for (int64_t b = 0; b < num_reqs; ++b) max_queries = std::max(max_queries, layout.count(b));
  const int64_t max_rows = max_queries * heads;  // one row per (query, head) of a request
  const int64_t max_keys = width * block_size;
  // A task's scores cover its part only, a row's kPart keys padded by a line: 36 KB for SmolLM2's 9 rows, reused
  // part after part from L1 / L2. Sized by the whole context (and zeroed, as a std::vector is) they were 590 KB
  // a thread at 16k tokens, freshly written lines each part, and rows 64 KB apart that alias in L1.
  const int64_t score_stride = std::min(max_keys, kPart) + 16;
  const int64_t slot_stride = kv_heads * head_dim;
  const int64_t chunk_keys = std::min(kChunk, block_size);  // a chunk never crosses a block
  auto lines_of = [&](int64_t slots) { return (slots * slot_stride * int64_t(sizeof(cache_t)) + 63) / 64; };
  auto as_bytes = [](const cache_t* p) { return reinterpret_cast<const char*>(p); };
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = reinterpret_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = reinterpret_cast<const cache_t*>(v_cache.data_ptr());
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  // One task per request part of up to kPart keys: a chunk of up to 16 slots inside one block is one contiguous
  // read of all KV heads, and the blocks of a part stream in order. Parts let one long request spread over the
  // threads (one stream at 2,048 tokens of context: its attention was one core's work). A part's rows end
  // unnormalized (sums, maximum, denominator) and a request of several parts merges them in part order afterwards,
  // so the result depends on kPart, never on the thread count; a request within one part (most) is normalized in
  // place, as before.
  auto keys_of = [&](int64_t b) { return std::min<int64_t>(std::max<int64_t>(len_ptr[b] - 1, 0) + 1, max_keys); };
  std::vector<int64_t> first_task(num_reqs + 1, 0);
  for (int64_t b = 0; b < num_reqs; ++b) first_task[b + 1] = first_task[b] + (keys_of(b) + kPart - 1) / kPart;
  const int64_t part_tasks = first_task[num_reqs];
  const int64_t partial_stride = max_rows * (head_dim + 2);  // a part's rows: sums, then maxima, then denominators
  std::vector<float> partials(part_tasks > num_reqs ? part_tasks * partial_stride : 0);
  // With fewer parts than threads (a lone request of up to 1,024 keys: one stream, speculative verification),
  // each part splits into one task per KV head: disjoint rows and the same arithmetic a row, so the same bits.
  // Zen 4, 2 threads, 30 layers, one request at 150 tokens with 8 queries (fp32, bf16): 0.75-0.93x the time (medians;
  // one pair of eight even). Not with more parts: each task then streams a third of every slot row and prefetches
  // all of it (2,048 tokens: 1.4-1.6x slower).
  const int64_t kv_split = part_tasks < at::get_num_threads() ? kv_heads : 1;
  const int64_t num_tasks = part_tasks * kv_split;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scores(new float[max_rows * score_stride]);  // row r = i * heads + h; no zeroing
    std::vector<float> acc(max_rows * head_dim);
    std::vector<float> top(max_rows), denominators(max_rows);  // running maximum and softmax denominator per row
    std::vector<float> q_scratch(max_rows * head_dim), chunk_scratch(kChunk * slot_stride);  // widened bf16
    std::vector<int64_t> visible(max_queries);  // query i sees positions 0 .. visible[i] - 1
    for (int64_t t = begin; t < end; ++t) {
      const int64_t part_task = t / kv_split, slice = t % kv_split;
      const int64_t b = std::upper_bound(first_task.begin(), first_task.end(), part_task) - first_task.begin() - 1;
      const int64_t part = part_task - first_task[b], parts = first_task[b + 1] - first_task[b];
      const int64_t kv_first = kv_split > 1 ? slice : 0, kv_count = kv_split > 1 ? 1 : kv_heads;
      auto in_slice = [&](int64_t r) { return kv_split == 1 || (r % heads) / group == slice; };
      const int64_t query_len = layout.count(b), rows = query_len * heads;
      const int32_t* table = table_ptr + b * width;
      const int64_t q_offset = layout.start(b) * heads * head_dim;
      const float* q_req = as_float(q_ptr + q_offset, q_scratch.data(), rows * head_dim);
      for (int64_t i = 0; i < query_len; ++i) {
        const int64_t position = std::max<int64_t>(len_ptr[b] - query_len + i, 0);
        visible[i] = std::min(position + 1, max_keys);
      }
      const int64_t num_keys = visible[query_len - 1];
      const int64_t part_first = part * kPart, part_last = std::min(part_first + kPart, num_keys);
      // The query rows in groups that share a KV head, and with it one load of each key and value vector:
      // body(query, KV head, first row, rows).
      auto for_each_row_group = [&](auto&& body) {
        for (int64_t i = 0; i < query_len; ++i) {
          for (int64_t kv = kv_first; kv < kv_first + kv_count; ++kv) {
            for (int64_t h = 0; h < group; h += Rows::kMaxRows) {
              body(i, kv, i * heads + kv * group + h, std::min<int64_t>(Rows::kMaxRows, group - h));
            }
          }
        }
      };
      const int64_t row_groups = query_len * kv_count * ((group + Rows::kMaxRows - 1) / Rows::kMaxRows);
      auto slot_offset = [&](int64_t s) { return (table[s / block_size] * block_size + s % block_size) * slot_stride; };
      // Chunks never cross a block, so the slots of one are contiguous and its block id is read (and checked:
      // a bad one would read outside the cache) once per block, where it is used.
      auto for_each_chunk = [&](const cache_t* cache, int64_t first, int64_t last, auto&& body) {
        for (int64_t s0 = first; s0 < last;) {
          const int64_t block = table[s0 / block_size], in_block = s0 % block_size;
          if (in_block == 0) {
            TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables holds a block id outside the cache (",
                        num_blocks, " blocks): ", block);
          }
          const int64_t n = std::min({kChunk, block_size - in_block, last - s0});
          const int64_t offset = (block * block_size + in_block) * slot_stride;
          body(s0, n, offset, Rows::chunk_rows(cache + offset, chunk_scratch.data(), n * slot_stride));
          s0 += n;
        }
      };
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
      std::fill(top.begin(), top.begin() + rows, -INFINITY);
      std::fill(denominators.begin(), denominators.begin() + rows, 0.f);
      // Segments of kSegment keys, the softmax rescaled between them: a segment's V rows, prefetched during its
      // score pass, still sit in L2 for its V pass (a 2,048-token request's 1.5 MB of fp32 V rows would not).
      for (int64_t first = part_first; first < part_last; first += kSegment) {
        const int64_t last = std::min(first + kSegment, part_last);
        // Scores of every query row for keys a later query sees too (finite: those slots hold this step's tokens);
        // the softmax below reads only each row's visible ones.
        for_each_chunk(k_ptr, first, last, [&](int64_t s0, int64_t n, int64_t offset, const auto* keys) {
          // The chunk's V rows, towards L2 for the pass after the softmax (two streams from DRAM at once instead of
          // one: 1.4x on one thread with the pool in DRAM), and the next chunk's K rows, into L2 (Zen 4: 1.05-1.17x
          // over L1): the hardware prefetcher restarts at every block. Slices go out from inside scores(), between
          // its steps (Rows::kPrefetchSlices a call).
          // A prefetch never faults, so the next block id is checked where it is used, not here.
          const int64_t next = s0 + n;
          PacedPrefetch prefetch{as_bytes(v_ptr + offset),
                                 next < num_keys ? as_bytes(k_ptr + slot_offset(next)) : nullptr,
                                 lines_of(n), row_groups * Rows::kPrefetchSlices};
          for_each_row_group([&](int64_t /*query*/, int64_t kv, int64_t r, int64_t count) {
            math.scores(q_req + r * head_dim, count, keys + kv * head_dim, slot_stride, n, scale_f,
                        scores.get() + r * score_stride + (s0 - part_first), score_stride, prefetch);
          });
        });
        for (int64_t r = 0; r < rows; ++r) {  // softmax numerators; the division comes last, on the output
          if (!in_slice(r)) continue;
          float* row = scores.get() + r * score_stride + (first - part_first);
          const int64_t n = std::min(visible[r / heads], last) - first;
          if (n <= 0) continue;
          const float old_top = top[r], new_top = std::max(old_top, max_of(row, n));
          exp_shifted_inplace(row, n, new_top);
          if (first > part_first && new_top != old_top) {  // what earlier segments summed, to the new maximum
            float factor = old_top;
            exp_shifted_inplace(&factor, 1, new_top);
            for (int64_t d = 0; d < head_dim; ++d) acc[r * head_dim + d] *= factor;
            denominators[r] *= factor;
          }
          top[r] = new_top;
          denominators[r] += sum_of(row, n);
        }
        // A part's last V pass prefetches the next part's first K chunk, which that task's score pass reads before
        // its own prefetches start (1.05-1.08x): a slice per chunk, while memory would idle.
        PacedPrefetch next_request;
        if (last == part_last && t + 1 < end && (t + 1) / kv_split != part_task) {
          const int64_t next_b = part + 1 < parts ? b : b + 1, from = part + 1 < parts ? part_last : 0;
          const int64_t next_keys = std::clamp<int64_t>(keys_of(next_b) - from, 1,
                                                        std::min(kChunk, block_size - from % block_size));
          const int64_t block = table_ptr[next_b * width + from / block_size];
          next_request = {as_bytes(k_ptr + (block * block_size + from % block_size) * slot_stride), nullptr,
                          lines_of(next_keys), (last - first + chunk_keys - 1) / chunk_keys};
        }
        for_each_chunk(v_ptr, first, last, [&](int64_t s0, int64_t n, int64_t /*offset*/, const auto* values) {
          next_request.issue();
          for_each_row_group([&](int64_t query, int64_t kv, int64_t r, int64_t count) {
            const int64_t seen = std::min(n, visible[query] - s0);  // this query's keys in the chunk
            if (seen <= 0) return;
            math.accumulate(acc.data() + r * head_dim, count, scores.get() + r * score_stride + (s0 - part_first),
                            score_stride, values + kv * head_dim, slot_stride, seen);
          });
        });
      }
      if (parts > 1) {  // merged below (a part's KV-head tasks fill disjoint rows of its partial)
        float* partial = partials.data() + part_task * partial_stride;
        for (int64_t r = 0; r < rows; ++r) {
          if (!in_slice(r)) continue;
          std::copy_n(acc.data() + r * head_dim, head_dim, partial + r * head_dim);
          partial[rows * head_dim + r] = top[r];
          partial[rows * (head_dim + 1) + r] = denominators[r];
        }
        continue;
      }
      scalar_t* out_req = out_ptr + q_offset;
      for (int64_t r = 0; r < rows; ++r) {
        if (!in_slice(r)) continue;
        if (lse_ptr) lse_ptr[layout.start(b) * heads + r] = top[r] + std::log(denominators[r]);
        const float inv = out_scale / denominators[r];
        for (int64_t d = 0; d < head_dim; ++d) {
          out_req[r * head_dim + d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
        }
      }
    }
  });
  if (partials.empty()) return;
  // Requests of several parts: each row's parts rescaled to their common maximum and summed in part order.
  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(head_dim);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t parts = first_task[b + 1] - first_task[b];
      if (parts == 1) continue;
      const int64_t rows = layout.count(b) * heads;
      const float* first_part = partials.data() + first_task[b] * partial_stride;
      scalar_t* out_req = out_ptr + layout.start(b) * heads * head_dim;
      for (int64_t r = 0; r < rows; ++r) {
        float top = -INFINITY, denominator = 0.f;
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, first_part[p * partial_stride + rows * head_dim + r]);
        std::fill(sums.begin(), sums.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* partial = first_part + p * partial_stride;
          float factor = partial[rows * head_dim + r];
          if (factor == -INFINITY) continue;  // none of this part's keys is visible to the row
          exp_shifted_inplace(&factor, 1, top);
          denominator += partial[rows * (head_dim + 1) + r] * factor;
          for (int64_t d = 0; d < head_dim; ++d) sums[d] += partial[r * head_dim + d] * factor;
        }
        if (lse_ptr) lse_ptr[layout.start(b) * heads + r] = top + std::log(denominator);
        const float inv = out_scale / denominator;
        for (int64_t d = 0; d < head_dim; ++d) out_req[r * head_dim + d] = static_cast<scalar_t>(sums[d] * inv);
      }
    }
  });
}

// The AVX-512 forms for head_dim 16, 32, 64 or 128; any other, or a build without AVX-512, takes the loops.
template <typename scalar_t, typename cache_t>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, QueryLayout layout,
                       int64_t block_size, float scale, float out_scale, float* lse) {
  const int64_t head_dim = q.size(2);
#ifdef __AVX512F__
  switch (head_dim) {
    case 16: return decode_attention<scalar_t, cache_t>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                               scale, out_scale, Avx512Rows<1>{}, lse);
    case 32: return decode_attention<scalar_t, cache_t>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                               scale, out_scale, Avx512Rows<2>{}, lse);
    case 64: return decode_attention<scalar_t, cache_t>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                               scale, out_scale, Avx512Rows<4>{}, lse);
    case 128: return decode_attention<scalar_t, cache_t>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                                scale, out_scale, Avx512Rows<8>{}, lse);
    default: break;
  }
#endif
  decode_attention<scalar_t, cache_t>(q, k_cache, v_cache, tables, lens, out, layout, block_size, scale,
                                      out_scale, PortableRows{head_dim}, lse);
}

// Both ops: q [rows, H, D] with each request's queries the last positions of its context (causal among them).
// fp8: the caches hold e4m3 codes (uint8) of K / k_scale and V / v_scale.
struct CacheCodes {
  bool fp8 = false;
  double k_scale = 1.0, v_scale = 1.0;
};

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, QueryLayout layout,
                           int64_t block_size, double scale, CacheCodes codes = {}, at::Tensor* lse = nullptr) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and the caches must be 3-D");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16, got ", q_in.scalar_type());
  const auto cache_type = codes.fp8 ? at::kByte : q_in.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == cache_type && v_cache.scalar_type() == cache_type,
              "the caches must be ", cache_type, codes.fp8 ? " (e4m3 codes)" : " (q's dtype)", ", got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(codes.k_scale > 0 && codes.v_scale > 0, "k_scale and v_scale must be > 0");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "the caches must be contiguous and of one shape");
  const int64_t num_reqs = block_tables.size(0), width = block_tables.size(1);
  const int64_t heads = q_in.size(1), head_dim = q_in.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(q_in.size(0) == layout.start(num_reqs), "q must have one row per query (", layout.start(num_reqs),
              "), got ", q_in.size(0));
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(2) == head_dim, "q and the caches disagree on heads / dim");
  TORCH_CHECK(seq_lens.size(0) == num_reqs && width >= 1, "seq_lens must have one entry per block-table row");
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty_like(q);
  float* lse_ptr = nullptr;  // [rows, H] each row's log-sum-exp, when asked for
  if (lse != nullptr) {
    *lse = at::empty({q.size(0), heads}, q.options().dtype(at::kFloat));
    lse_ptr = lse->data_ptr<float>();
  }
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const float score_scale = static_cast<float>(scale * codes.k_scale), out_scale = static_cast<float>(codes.v_scale);
  if (q.scalar_type() == at::kBFloat16) {
    if (codes.fp8) {
      dispatch_head_dim<at::BFloat16, Fp8E4M3>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                               score_scale, out_scale, lse_ptr);
    } else {
      dispatch_head_dim<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, tables, lens, out, layout, block_size,
                                                    score_scale, 1.f, lse_ptr);
    }
  } else if (codes.fp8) {
    dispatch_head_dim<float, Fp8E4M3>(q, k_cache, v_cache, tables, lens, out, layout, block_size, score_scale,
                                      out_scale, lse_ptr);
  } else {
    dispatch_head_dim<float, float>(q, k_cache, v_cache, tables, lens, out, layout, block_size, score_scale,
                                    1.f, lse_ptr);
  }
  return out;
}

at::Tensor cpu_paged_decode_attention(const at::Tensor& q,             // [B*Q, H, D] float32 or bfloat16
                                      const at::Tensor& k_cache,       // [num_slots, Hkv, D] q's dtype
                                      const at::Tensor& v_cache,       // [num_slots, Hkv, D] q's dtype
                                      const at::Tensor& block_tables,  // [B, nb] int32
                                      const at::Tensor& seq_lens,      // [B] int32
                                      int64_t query_len, int64_t block_size, double scale) {
  TORCH_CHECK(query_len >= 1, "query_len must be >= 1, got ", query_len);
  return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, QueryLayout{query_len}, block_size, scale);
}

at::Tensor cpu_paged_decode_attention_fp8(const at::Tensor& q,             // [B*Q, H, D] float32 or bfloat16
                                          const at::Tensor& k_cache,       // [num_slots, Hkv, D] uint8 e4m3
                                          const at::Tensor& v_cache,       // [num_slots, Hkv, D] uint8 e4m3
                                          const at::Tensor& block_tables,  // [B, nb] int32
                                          const at::Tensor& seq_lens,      // [B] int32
                                          int64_t query_len, int64_t block_size, double scale, double k_scale,
                                          double v_scale) {
  TORCH_CHECK(query_len >= 1, "query_len must be >= 1, got ", query_len);
  return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, QueryLayout{query_len}, block_size, scale,
                         CacheCodes{true, k_scale, v_scale});
}

// One query a request (decode), with each row's log-sum-exp of its scaled scores beside the output: context
// parallelism's partial attention over the blocks a rank holds (kernels/context_attention.py merges the ranks').
std::tuple<at::Tensor, at::Tensor> cpu_paged_decode_attention_lse(
    const at::Tensor& q,             // [B, H, D] float32 or bfloat16
    const at::Tensor& k_cache,       // [num_slots, Hkv, D] q's dtype, or uint8 e4m3 codes when fp8
    const at::Tensor& v_cache,       // [num_slots, Hkv, D]
    const at::Tensor& block_tables,  // [B, nb] int32
    const at::Tensor& seq_lens,      // [B] int32, each >= 1
    int64_t block_size, double scale, double k_scale, double v_scale, bool fp8) {
  at::Tensor lse;
  at::Tensor out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, QueryLayout{1}, block_size, scale,
                                   CacheCodes{fp8, fp8 ? k_scale : 1.0, fp8 ? v_scale : 1.0}, &lse);
  return {out, lse};
}

// Prefill chunks of different lengths in one call (threads over requests): request b's queries are rows
// query_starts[b] .. query_starts[b + 1] - 1 of q.
at::Tensor prefill_attention(const at::Tensor& q,             // [sum(Q_b), H, D]
                             const at::Tensor& k_cache,       // [num_slots, Hkv, D] q's dtype (or e4m3 codes)
                             const at::Tensor& v_cache,       // [num_slots, Hkv, D]
                             const at::Tensor& block_tables,  // [P, nb] int32
                             const at::Tensor& seq_lens,      // [P] int32
                             const at::Tensor& query_starts,  // [P + 1] int64, from 0
                             int64_t block_size, double scale, CacheCodes codes) {
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_starts.dim() == 1 &&
                  query_starts.size(0) == block_tables.size(0) + 1,
              "query_starts must be int64 [P + 1] for P block-table rows");
  const at::Tensor starts = query_starts.contiguous();
  const int64_t* s = starts.data_ptr<int64_t>();
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.size(0) == block_tables.size(0),
              "seq_lens must be int32 with one entry per block-table row");
  const at::Tensor lens_c = seq_lens.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  TORCH_CHECK(s[0] == 0, "query_starts must start at 0");
  for (int64_t b = 0; b < block_tables.size(0); ++b) {
    TORCH_CHECK(s[b + 1] > s[b] && s[b + 1] - s[b] <= lens[b], "prefill request ", b, ": its query count (",
                s[b + 1] - s[b], ") must be in [1, seq_len=", lens[b], "]");
  }
  return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, QueryLayout{0, s}, block_size, scale, codes);
}

at::Tensor cpu_paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                       const at::Tensor& query_starts, int64_t block_size, double scale) {
  return prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_starts, block_size, scale, {});
}

at::Tensor cpu_paged_prefill_attention_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                           const at::Tensor& query_starts, int64_t block_size, double scale,
                                           double k_scale, double v_scale) {
  return prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_starts, block_size, scale,
                           CacheCodes{true, k_scale, v_scale});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("cpu_paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int query_len, int block_size, float scale) -> Tensor");
  m.def("cpu_paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_starts, int block_size, float scale) -> Tensor");
  m.def("cpu_paged_decode_attention_fp8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int query_len, int block_size, float scale, float k_scale, float v_scale) -> Tensor");
  m.def("cpu_paged_prefill_attention_fp8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_starts, int block_size, float scale, float k_scale, float v_scale) -> Tensor");
  m.def("cpu_paged_decode_attention_lse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, int block_size, float scale, float k_scale, float v_scale, bool fp8) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("cpu_paged_decode_attention", &cpu_paged_decode_attention);
  m.impl("cpu_paged_prefill_attention", &cpu_paged_prefill_attention);
  m.impl("cpu_paged_decode_attention_fp8", &cpu_paged_decode_attention_fp8);
  m.impl("cpu_paged_prefill_attention_fp8", &cpu_paged_prefill_attention_fp8);
  m.impl("cpu_paged_decode_attention_lse", &cpu_paged_decode_attention_lse);
}
