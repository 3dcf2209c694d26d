// An eager host decode step through all of a Llama model's decoder layers as one op: deepinfer::llama_decode_layers.
//
// Why: at one stream a SmolLM2-135M bf16 step was ~9 ms of weight streaming and ~4 ms of everything else, ~1.3 ms
// of it Python around the ops by wall clocks (~10 module calls, wrappers and boxed dispatcher calls a layer, 30
// layers); from this loop the step took 2.6 ms less (fp32: 3.5 ms less at one stream, 4.4 at 32, same process).
// Here the layer loop runs in C++ and calls the very same ops (typed dispatcher handles, looked up once),
// in the order backend_lib/models/llama.py's eager host path calls them, so the result is that path's to the bit:
// rms_norm -> qkv (blocked) -> RoPE + KV write -> decode attention -> o_proj (blocked) -> add + rms_norm ->
// gate_up with SiLU-and-multiply (blocked) -> down_proj with the residual add (blocked).
//
// Scope (the caller checks it): decode-only steps on one rank, no biases, every projection of the step on one GEMM
// path (blocked kernel, oneDNN packed, or plain F.linear).
// fp8 KV caches (uint8 e4m3 codes, kv_cache_dtype=fp8_e4m3) take the same loop with the store and the attention
// on their fp8 ops (rope_qkv_to_cache_fp8, cpu_paged_decode_attention_fp8) and each layer's k_scale / v_scale:
// the eager fp8 path's ops again, so its bits.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace {

using Tensor = at::Tensor;
using OptTensor = c10::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops a layer calls (registered by the other sources of this library).
struct LayerOps {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      find_op<Tensor(const Tensor&, const Tensor&, double)>("deepinfer::llama_rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
          "deepinfer::llama_add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                                  int64_t, int64_t)>
      rope_to_cache = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                                     int64_t, int64_t)>("deepinfer::rope_qkv_to_cache");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                  int64_t, double)>
      attention = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                 int64_t, double)>("deepinfer::cpu_paged_decode_attention");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                                  int64_t, int64_t, double, double, double)>
      rope_to_fp8_cache = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&,
                                         int64_t, int64_t, double, double, double)>("deepinfer::rope_qkv_to_cache_fp8");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                                  int64_t, double, double, double)>
      attention_fp8 = find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     int64_t, int64_t, double, double, double)>(
          "deepinfer::cpu_paged_decode_attention_fp8");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t, c10::string_view)> linear =
      find_op<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t, c10::string_view)>(
          "deepinfer::blocked_linear");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t, const Tensor&,
                                  c10::string_view)>
      linear_add = find_op<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t, const Tensor&,
                                  c10::string_view)>("deepinfer::blocked_linear_add");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, c10::string_view)> linear_silu_mul =
      find_op<Tensor(const Tensor&, const Tensor&, int64_t, c10::string_view)>("deepinfer::blocked_linear_silu_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      find_op<Tensor(const Tensor&)>("deepinfer::silu_and_mul");
  c10::OperatorHandle onednn_linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
};

const LayerOps& layer_ops() {
  static const LayerOps ops;
  return ops;
}

// Where a step's projections run, as backend_lib/models/layers.py's linear() picks for its row count, or the
// packed quantized weights' GEMM (weight_format=packed: Linear.set_quantized).
enum class GemmPath : int64_t { kBlocked = 0, kOneDnnPacked = 1, kPlain = 2, kQuantized = 3 };

// deepinfer::packed_linear lives in its own extension (kernels/cpu_kernels.py: load_packed_kernels), loaded
// before a packed model's first step: looked up on first use, not with the other ops.
using PackedLinearFn = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, c10::string_view, int64_t,
                              at::IntArrayRef, c10::string_view, c10::string_view);
const c10::TypedOperatorHandle<PackedLinearFn>& packed_linear_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("deepinfer::packed_linear", "").typed<PackedLinearFn>();
  return op;
}

// A projection as the eager path runs it: the blocked kernel; oneDNN's GEMM on its packed weight
// (kernels/onednn_gemm.py's packed_linear: mkldnn::_linear_pointwise, a boxed call: its Scalar?[] argument has
// no fixed C++ type); or at::linear on the plain weight (F.linear).
struct Projection {
  const LayerOps& ops;
  GemmPath path;
  std::string packed_fmt, packed_path;  // kQuantized: the format (q4_1, ...) and kernels/packed_gemm.py's path
  Tensor no_scales;                      // GGUF formats keep their scales inside the blocks
  Tensor operator()(const Tensor& x, const Tensor& weight, int64_t out_features) const {
    switch (path) {
      case GemmPath::kQuantized:
        return packed_linear_op().call(x, weight, no_scales, c10::nullopt, packed_fmt, out_features, {},
                                       packed_path, "auto");
      case GemmPath::kBlocked: return ops.linear.call(x, weight, c10::nullopt, out_features, "auto");
      case GemmPath::kOneDnnPacked: {
        torch::jit::Stack stack{x, weight, c10::IValue(), "none", c10::List<c10::optional<c10::Scalar>>(),
                                c10::IValue(std::string())};
        ops.onednn_linear.callBoxed(&stack);
        return stack.back().toTensor();
      }
      default: return at::linear(x, weight);
    }
  }
  Tensor silu_mul(const Tensor& x, const Tensor& weight, int64_t intermediate) const {
    return path == GemmPath::kBlocked ? ops.linear_silu_mul.call(x, weight, intermediate, "auto")
                                      : ops.silu_and_mul.call((*this)(x, weight, 2 * intermediate));
  }
  Tensor add(const Tensor& x, const Tensor& weight, int64_t out_features, const Tensor& residual) const {
    return path == GemmPath::kBlocked ? ops.linear_add.call(x, weight, c10::nullopt, out_features, residual, "auto")
                                      : (*this)(x, weight, out_features) + residual;
  }
};

Tensor llama_decode_layers(const Tensor& hidden_in,     // [T, hidden]
                           const Tensor& cos,           // [T, 1, D/2] (kernels.rope.rope_at)
                           const Tensor& sin,           // [T, 1, D/2]
                           Tensor& k_caches,            // [L, num_slots, Hkv, D], written in place
                           Tensor& v_caches,            // [L, num_slots, Hkv, D]
                           const Tensor& slot_mapping,  // [T] int64
                           const Tensor& block_tables,  // [B, nb] int32
                           const Tensor& seq_lens,      // [B] int32
                           int64_t query_len, int64_t block_size, double scale, int64_t num_heads,
                           int64_t num_kv_heads, int64_t intermediate, double eps,
                           at::TensorList norms,        // 2L: layer i's input norm [hidden], then its post-attention one
                           at::TensorList projections,  // 4L: layer i's qkv, o, gate_up, down weights
                           int64_t gemm_path,           // GemmPath: the weights blocked, oneDNN-packed, plain or
                           c10::string_view packed_fmt,  // packed GGUF tiles (then packed_fmt: q4_1, ... and
                           c10::string_view packed_path,  // packed_path: auto, fp32 or int8)
                           at::ArrayRef<double> k_scales,  // fp8 caches (uint8): layer i's k_scale / v_scale
                           at::ArrayRef<double> v_scales, double fp8_max) {
  const int64_t layers = k_caches.dim() == 4 ? k_caches.size(0) : -1;
  TORCH_CHECK(hidden_in.dim() == 2 && layers >= 0 && v_caches.sizes() == k_caches.sizes(),
              "llama_decode_layers: hidden must be [T, hidden] and the caches [L, num_slots, Hkv, D] of one shape, "
              "got ", hidden_in.sizes(), ", ", k_caches.sizes(), " and ", v_caches.sizes());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(projections.size()) == 4 * layers,
              "llama_decode_layers: norms must hold 2 and projections 4 tensors a layer (", layers, " layers), got ",
              norms.size(), " and ", projections.size());
  const bool fp8 = k_caches.scalar_type() == at::kByte;
  TORCH_CHECK(!fp8 || (static_cast<int64_t>(k_scales.size()) == layers &&
                       static_cast<int64_t>(v_scales.size()) == layers),
              "llama_decode_layers: fp8 (uint8) caches need one k_scale and one v_scale a layer (", layers,
              " layers), got ", k_scales.size(), " and ", v_scales.size());
  const LayerOps& ops = layer_ops();
  TORCH_CHECK(gemm_path >= 0 && gemm_path <= 3, "llama_decode_layers: gemm_path must be 0 (blocked), 1 (oneDNN "
              "packed), 2 (plain) or 3 (packed quantized), got ", gemm_path);
  TORCH_CHECK(gemm_path != 3 || packed_fmt.rfind("q", 0) == 0, "llama_decode_layers: gemm_path 3 takes packed GGUF "
              "weights (packed_fmt q8_0, q4_0, q4_1 or q4_k), got packed_fmt '", packed_fmt, "'");
  const Projection project{ops, static_cast<GemmPath>(gemm_path), std::string(packed_fmt), std::string(packed_path),
                           at::empty({0}, hidden_in.options().dtype(at::kByte))};
  const int64_t tokens = hidden_in.size(0), width = hidden_in.size(1), head_dim = k_caches.size(3);
  const int64_t qkv_out = (num_heads + 2 * num_kv_heads) * head_dim;
  Tensor hidden = hidden_in;
  for (int64_t i = 0; i < layers; ++i) {
    Tensor k_cache = k_caches.select(0, i), v_cache = v_caches.select(0, i);
    const Tensor* w = projections.data() + 4 * i;  // qkv, o, gate_up, down
    const Tensor normed = ops.rms_norm.call(hidden, norms[2 * i], eps);
    const Tensor qkv = project(normed, w[0], qkv_out);
    Tensor attended;
    if (fp8) {
      const Tensor q = ops.rope_to_fp8_cache.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                  num_kv_heads, k_scales[i], v_scales[i], fp8_max);
      attended = ops.attention_fp8.call(q, k_cache, v_cache, block_tables, seq_lens, query_len, block_size, scale,
                                        k_scales[i], v_scales[i]);
    } else {
      const Tensor q = ops.rope_to_cache.call(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                              num_kv_heads);
      attended = ops.attention.call(q, k_cache, v_cache, block_tables, seq_lens, query_len, block_size, scale);
    }
    const Tensor attn = project(attended.reshape({tokens, num_heads * head_dim}), w[1], width);
    auto [mlp_in, residual] = ops.add_rms_norm.call(attn, hidden, norms[2 * i + 1], eps);
    hidden = project.add(project.silu_mul(mlp_in, w[2], intermediate), w[3], width, residual);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer, m) {
  m.def("llama_decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) k_caches, Tensor(b!) v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int query_len, int block_size, float scale, "
        "int num_heads, int num_kv_heads, int intermediate, float eps, Tensor[] norms, Tensor[] projections, "
        "int gemm_path, str packed_fmt=\"\", str packed_path=\"auto\", float[] k_scales=[], float[] v_scales=[], "
        "float fp8_max=448.) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {
  m.impl("llama_decode_layers", &llama_decode_layers);
}

// oneDNN-packed weights in the list make the dispatcher pick this key.
TORCH_LIBRARY_IMPL(deepinfer, MkldnnCPU, m) {
  m.impl("llama_decode_layers", &llama_decode_layers);
}
