// A whole decode pass (one token per row) of a Llama-family decoder in one call: what the bf16
// (`decode_step.cpp`) and fp32 (`decode_step_f32.cpp`) steps share. Each supplies an `Arith`: its
// element type, the names of its kernels, and the elementwise work with its dtype's rounding.
//
// The compiled graph of such a pass spends 1-2 ms outside its kernels on SmolLM2 (30 layers, 2
// cores): the Python wrapper's ~300 custom-op dispatches and allocations, and the graph's
// prologue fetching ~370 weights from the module tree. At one row that is a third of the pass.
// Here the weights are gathered once (`create`), and each pass (`run`) is a C++ loop over the
// layers that calls the same kernels (the weight-only matmuls, the decode attention, oneDNN's
// prepacked matmul where a projection is dense) and does the elementwise work itself, as the
// compiled graph rounds: every fused elementwise chain (RMSNorm's normalisation, RoPE,
// SiLU(gate) x up, a residual add) computes in fp32 and rounds once, where the graph stores a
// tensor of the model's dtype.
//
// A model is a handle into a process-wide table per element type (as `maskwire::packed_linear`'s
// weights): the Python side (`neuron_worker.model.fused_decode`) keeps the integer and frees it
// with the model.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/Scalar.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace maskwire::decode_step {

// How a projection runs (`neuron_worker.model.fused_decode`'s forms, in this order).
enum Form : int64_t { kInt4 = 0, kInt8 = 1, kInt4A8 = 2, kDense = 3 };

struct Projection {
  Form form;
  at::Tensor w;       // the kernel's packed weight, or oneDNN's prepacked one (kDense)
  at::Tensor params;  // the kernel's scales (undefined for kDense)
  at::Tensor bias;    // [out] of the model's dtype, or undefined
};

struct Layer {
  at::Tensor attention_norm, ffn_norm;  // [dim]
  Projection wqkv, wo, w13, w2;
  at::Tensor k_cache, v_cache;  // [slots, kv_heads, max_seq + 1, head_dim]
};

struct Model {
  int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq;
  float eps;
  at::Tensor embedding;  // [vocab, dim]
  at::Tensor cos, sin;   // [max_seq, head_dim]
  at::Tensor norm;       // [dim]
  Projection head;
  std::vector<Layer> layers;
};

template <class Arith>
struct Registry {
  std::mutex lock;
  std::vector<std::shared_ptr<const Model>> models;  // by handle; freed entries are null

  static Registry& get() {
    static Registry registry;
    return registry;
  }
};

using Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DenseMatmul = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, std::string_view,
                               c10::List<std::optional<at::Scalar>>,
                               std::optional<std::string_view>);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// y = x @ W^T (+ bias), x [rows, in].
template <class Arith>
at::Tensor project(const Projection& p, const at::Tensor& x) {
  using T = typename Arith::T;
  at::Tensor y;
  if (p.form == kDense) {
    static const auto dense = op<DenseMatmul>("mkldnn::_linear_pointwise");
    y = dense.call(x, p.w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                   std::nullopt);
  } else {
    using Handle = c10::TypedOperatorHandle<Matmul>;
    static const Handle int4 = op<Matmul>(Arith::kInt4);
    static const Handle int8 = op<Matmul>(Arith::kInt8);
    static const std::optional<Handle> int4a8 =
        Arith::kInt4A8 ? std::optional<Handle>(op<Matmul>(Arith::kInt4A8)) : std::nullopt;
    const Handle& matmul = p.form == kInt4 ? int4 : p.form == kInt8 ? int8 : *int4a8;
    y = matmul.call(x, p.w, p.params);
  }
  if (p.bias.defined()) {  // as the layer's `y + bias`: one rounding
    auto* yp = y.mutable_data_ptr<T>();
    const auto* bp = p.bias.const_data_ptr<T>();
    const int64_t rows = y.size(0), n = y.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i)
        yp[r * n + i] = T(static_cast<float>(yp[r * n + i]) + static_cast<float>(bp[i]));
  }
  return y;
}

// Rows [0, rows) of a pass in parallel where there are enough of them to pay a fork.
template <class Fn>
void over_rows(int64_t rows, Fn&& fn) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

inline Projection projection_from(const c10::List<std::optional<at::Tensor>>& t, int64_t at,
                                  int64_t form, bool has_int4a8, at::ScalarType type) {
  TORCH_CHECK(form >= kInt4 && form <= kDense && (form != kInt4A8 || has_int4a8),
              "unknown projection form ", form);
  auto get = [&](int64_t i) {
    const std::optional<at::Tensor> v = t.get(at + i);
    return v.has_value() ? *v : at::Tensor();
  };
  Projection p{static_cast<Form>(form), get(0), get(1), get(2)};
  TORCH_CHECK(p.w.defined() && (form == kDense || p.params.defined()),
              "a projection needs its weight and, but for a dense one, its scales");
  TORCH_CHECK(!p.bias.defined() ||
                  (p.bias.scalar_type() == type && p.bias.dim() == 1 && p.bias.is_contiguous()),
              "bias: contiguous ", type, " [out]");
  return p;
}

inline void check_tensor(const at::Tensor& t, at::ScalarType type, at::IntArrayRef shape,
                         const char* name) {
  TORCH_CHECK(t.defined() && t.scalar_type() == type && t.is_contiguous() && t.sizes() == shape,
              name, ": contiguous ", type, " ", shape);
}

constexpr int64_t kGlobal = 4;     // embedding, cos, sin, norm
constexpr int64_t kPerLayer = 16;  // two norms, the K and V caches, 4 projections x 3
constexpr int64_t kPerProjection = 3;

// tensors: embedding, cos, sin, norm, head (weight, scales, bias), then per layer: attention
// norm, FFN norm, K cache, V cache, wqkv, wo, w13, w2 (weight, scales, bias each).
// forms: the head's, then per layer wqkv, wo, w13, w2. sizes: dim, heads, KV heads, head size,
// FFN size, max_seq.
template <class Arith>
int64_t create(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef forms,
               at::IntArrayRef sizes, double eps) {
  const at::ScalarType type = Arith::kType;
  TORCH_CHECK(sizes.size() == 6, "sizes: dim, heads, KV heads, head size, FFN size, max_seq");
  auto m = std::make_shared<Model>();
  m->dim = sizes[0], m->n_heads = sizes[1], m->n_kv_heads = sizes[2], m->head_dim = sizes[3];
  m->ffn_dim = sizes[4], m->max_seq = sizes[5];
  m->eps = static_cast<float>(eps);
  TORCH_CHECK(m->n_kv_heads > 0 && m->n_heads % m->n_kv_heads == 0,
              "heads must be a multiple of KV heads");
  TORCH_CHECK(m->head_dim % (2 * Arith::kLanes) == 0 && m->dim % Arith::kLanes == 0 &&
                  m->ffn_dim % Arith::kLanes == 0,
              "head size a multiple of ", 2 * Arith::kLanes, ", dim and FFN size of ",
              Arith::kLanes);
  const int64_t count = static_cast<int64_t>(tensors.size());
  const int64_t n_layers = (count - kGlobal - kPerProjection) / kPerLayer;
  TORCH_CHECK(n_layers > 0 && count == kGlobal + kPerProjection + n_layers * kPerLayer,
              "tensors: 4 + 3 + 16 per layer");
  TORCH_CHECK(static_cast<int64_t>(forms.size()) == 1 + 4 * n_layers, "forms: 1 + 4 per layer");
  auto get = [&](int64_t i) {
    const std::optional<at::Tensor> v = tensors.get(i);
    TORCH_CHECK(v.has_value(), "tensor ", i, " is missing");
    return *v;
  };
  m->embedding = get(0), m->cos = get(1), m->sin = get(2), m->norm = get(3);
  TORCH_CHECK(m->embedding.dim() == 2, "embedding: [vocab, dim]");
  check_tensor(m->embedding, type, {m->embedding.size(0), m->dim}, "embedding");
  check_tensor(m->cos, type, {m->max_seq, m->head_dim}, "cos");
  check_tensor(m->sin, type, {m->max_seq, m->head_dim}, "sin");
  check_tensor(m->norm, type, {m->dim}, "norm");
  m->head = projection_from(tensors, kGlobal, forms[0], Arith::kInt4A8 != nullptr, type);
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t at = kGlobal + kPerProjection + l * kPerLayer;
    Layer layer;
    layer.attention_norm = get(at), layer.ffn_norm = get(at + 1);
    layer.k_cache = get(at + 2), layer.v_cache = get(at + 3);
    check_tensor(layer.attention_norm, type, {m->dim}, "attention norm");
    check_tensor(layer.ffn_norm, type, {m->dim}, "FFN norm");
    for (const at::Tensor& c : {layer.k_cache, layer.v_cache})
      TORCH_CHECK(c.scalar_type() == type && c.is_contiguous() && c.dim() == 4 &&
                      c.size(1) == m->n_kv_heads && c.size(2) == m->max_seq + 1 &&
                      c.size(3) == m->head_dim,
                  "K/V cache: contiguous ", type, " [slots, KV heads, max_seq + 1, head size]");
    Projection* ps[4] = {&layer.wqkv, &layer.wo, &layer.w13, &layer.w2};
    for (int64_t i = 0; i < 4; ++i)
      *ps[i] = projection_from(tensors, at + 4 + i * kPerProjection, forms[1 + l * 4 + i],
                               Arith::kInt4A8 != nullptr, type);
    m->layers.push_back(std::move(layer));
  }
  Registry<Arith>& registry = Registry<Arith>::get();
  std::lock_guard<std::mutex> guard(registry.lock);
  registry.models.push_back(std::move(m));
  return static_cast<int64_t>(registry.models.size()) - 1;
}

template <class Arith>
void release(int64_t handle) {
  Registry<Arith>& registry = Registry<Arith>::get();
  std::lock_guard<std::mutex> guard(registry.lock);
  if (handle >= 0 && handle < static_cast<int64_t>(registry.models.size()))
    registry.models[handle].reset();
}

template <class Arith>
std::shared_ptr<const Model> model_of(int64_t handle) {
  Registry<Arith>& registry = Registry<Arith>::get();
  std::lock_guard<std::mutex> guard(registry.lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.models.size()) &&
                  registry.models[handle],
              "no decode step model ", handle);
  return registry.models[handle];
}

// One token per row: tokens, positions (-1: padding), slots: int64 [rows]; last: int64 [outputs]
// (rows whose logits are returned); the pass attends [0, kv_len). Returns fp32 [outputs, vocab].
template <class Arith>
at::Tensor run(int64_t handle, const at::Tensor& tokens, const at::Tensor& positions,
               const at::Tensor& slots, const at::Tensor& last, int64_t kv_len) {
  using T = typename Arith::T;
  static const auto attention = op<Attention>(Arith::kAttention);
  const std::shared_ptr<const Model> model = model_of<Arith>(handle);
  const Model& m = *model;
  for (const at::Tensor* t : {&tokens, &positions, &slots, &last})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "tokens, positions, slots, last: contiguous int64 [n]");
  const int64_t rows = tokens.size(0);
  TORCH_CHECK(rows > 0 && positions.size(0) == rows && slots.size(0) == rows,
              "tokens, positions and slots: one per row");
  TORCH_CHECK(kv_len > 0 && kv_len <= m.max_seq, "kv_len outside (0, max_seq]");
  const int64_t dim = m.dim, hd = m.head_dim, q_size = m.n_heads * hd;
  const int64_t kv_size = m.n_kv_heads * hd, group = m.n_heads / m.n_kv_heads;
  const int64_t vocab = m.embedding.size(0), slot_count = m.layers[0].k_cache.size(0);
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  // Padding writes its K/V to the scratch position past the cache (never attended).
  at::Tensor write_pos = at::empty({rows, 1}, tokens.options());
  int64_t* wp = write_pos.mutable_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(tok[r] >= 0 && tok[r] < vocab, "token ", tok[r], " outside the vocabulary");
    TORCH_CHECK(slot[r] >= 0 && slot[r] < slot_count, "slot ", slot[r], " out of range");
    TORCH_CHECK(pos[r] < kv_len, "position ", pos[r], " past kv_len ", kv_len);
    wp[r] = pos[r] >= 0 ? pos[r] : m.max_seq;
  }
  const int64_t outputs = last.size(0);
  const int64_t* wanted = last.const_data_ptr<int64_t>();
  for (int64_t o = 0; o < outputs; ++o)
    TORCH_CHECK(wanted[o] >= 0 && wanted[o] < rows, "last: row ", wanted[o], " out of range");
  const auto options = m.embedding.options();
  at::Tensor x = at::empty({rows, dim}, options), xn = at::empty({rows, dim}, options);
  at::Tensor q = at::empty({rows, m.n_kv_heads, group, hd}, options);
  at::Tensor hidden = at::empty({rows, m.ffn_dim}, options);
  T* xp = x.mutable_data_ptr<T>();
  T* xnp = xn.mutable_data_ptr<T>();
  T* qp = q.mutable_data_ptr<T>();
  T* hp = hidden.mutable_data_ptr<T>();
  const T* emb = m.embedding.const_data_ptr<T>();
  const T* cos = m.cos.const_data_ptr<T>();
  const T* sin = m.sin.const_data_ptr<T>();
  over_rows(rows, [&](int64_t r) { std::copy_n(emb + tok[r] * dim, dim, xp + r * dim); });
  auto add_into_x = [&](const at::Tensor& y) {
    const T* yp = y.const_data_ptr<T>();
    over_rows(rows, [&](int64_t r) { Arith::add_into(xp + r * dim, yp + r * dim, dim); });
  };
  for (const Layer& layer : m.layers) {
    const T* an = layer.attention_norm.const_data_ptr<T>();
    over_rows(rows, [&](int64_t r) { Arith::rms_norm(xp + r * dim, an, dim, m.eps, xnp + r * dim); });
    const at::Tensor qkv = project<Arith>(layer.wqkv, xn);
    const T* qkvp = qkv.const_data_ptr<T>();
    T* kc = layer.k_cache.mutable_data_ptr<T>();
    T* vc = layer.v_cache.mutable_data_ptr<T>();
    const int64_t slot_stride = layer.k_cache.stride(0), head_stride = layer.k_cache.stride(1);
    over_rows(rows, [&](int64_t r) {
      const T* row = qkvp + r * (q_size + 2 * kv_size);
      const int64_t p = std::max<int64_t>(pos[r], 0);  // padding rotates as position 0
      const T* c = cos + p * hd;
      const T* s = sin + p * hd;
      for (int64_t h = 0; h < m.n_heads; ++h)
        Arith::rope(row + h * hd, c, s, hd, qp + r * q_size + h * hd);
      for (int64_t h = 0; h < m.n_kv_heads; ++h) {
        const int64_t at = slot[r] * slot_stride + h * head_stride + wp[r] * hd;
        Arith::rope(row + q_size + h * hd, c, s, hd, kc + at);
        std::copy_n(row + q_size + kv_size + h * hd, hd, vc + at);
      }
    });
    const at::Tensor y = attention.call(q, layer.k_cache.slice(2, 0, kv_len),
                                        layer.v_cache.slice(2, 0, kv_len), slots, write_pos);
    add_into_x(project<Arith>(layer.wo, y.view({rows, q_size})));
    const T* fn = layer.ffn_norm.const_data_ptr<T>();
    over_rows(rows, [&](int64_t r) { Arith::rms_norm(xp + r * dim, fn, dim, m.eps, xnp + r * dim); });
    const at::Tensor gate_up = project<Arith>(layer.w13, xn);
    const T* gu = gate_up.const_data_ptr<T>();
    over_rows(rows, [&](int64_t r) {
      Arith::silu_times(gu + r * 2 * m.ffn_dim, gu + r * 2 * m.ffn_dim + m.ffn_dim, m.ffn_dim,
                        hp + r * m.ffn_dim);
    });
    add_into_x(project<Arith>(layer.w2, hidden));
  }
  at::Tensor selected = at::empty({outputs, dim}, options);
  T* sp = selected.mutable_data_ptr<T>();
  const T* norm = m.norm.const_data_ptr<T>();
  for (int64_t o = 0; o < outputs; ++o)
    Arith::rms_norm(xp + wanted[o] * dim, norm, dim, m.eps, sp + o * dim);
  return project<Arith>(m.head, selected).to(at::kFloat);
}

}  // namespace maskwire::decode_step

// The three ops of one element type: `<prefix>_new`, `<prefix>_free`, `<prefix>_run`.
#define MASKWIRE_DECODE_STEP_OPS(prefix, Arith)                                                  \
  TORCH_LIBRARY_FRAGMENT(maskwire_kernels, m) {                                                  \
    m.def(#prefix "_new(Tensor?[] tensors, int[] forms, int[] sizes, float eps) -> int");       \
    m.def(#prefix "_free(int handle) -> ()");                                                    \
    m.def(#prefix                                                                                \
          "_run(int handle, Tensor tokens, Tensor positions, Tensor slots, Tensor last, "       \
          "int kv_len) -> Tensor");                                                             \
  }                                                                                              \
  TORCH_LIBRARY_IMPL(maskwire_kernels, CatchAll, m) {                                            \
    m.impl(#prefix "_new", &maskwire::decode_step::create<Arith>);                              \
    m.impl(#prefix "_free", &maskwire::decode_step::release<Arith>);                            \
  }                                                                                              \
  TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) {                                                 \
    m.impl(#prefix "_run", &maskwire::decode_step::run<Arith>);                                 \
  }
