// A whole decode pass (one token per row) of a Llama-family decoder in one call, on AVX512-BF16.
//
// The compiled graph of such a pass spends ~1 ms outside its kernels on SmolLM2 (30 layers, 2
// cores): the Python wrapper's ~300 custom-op dispatches and allocations, and the graph's
// prologue fetching ~370 weights from the module tree. At one row that is a sixth of the pass.
// Here the weights are gathered once (`decode_step_new`), and each pass (`decode_step_run`) is a
// C++ loop over the layers that calls the same kernels (the weight-only matmuls, the decode
// attention, oneDNN's prepacked bf16 matmul where a projection is dense) and does the elementwise
// work itself, with the compiled graph's rounding: every fused elementwise chain (RMSNorm's
// normalisation, RoPE, SiLU(gate) x up, a residual add) computes in fp32 and rounds to bf16 once,
// where the graph stores a bf16 tensor.
//
// A model is a handle into a process-wide table (as `maskwire::packed_linear`'s weights): the
// Python side (`neuron_worker.model.fused_decode`) keeps the integer and frees it with the model.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

namespace {

// How a projection runs (`neuron_worker.model.fused_decode.PROJECTION_FORMS` in this order).
enum Form : int64_t { kInt4 = 0, kInt8 = 1, kInt4A8 = 2, kDense = 3 };

struct Projection {
  Form form;
  at::Tensor w;       // the kernel's packed weight, or oneDNN's prepacked one (kDense)
  at::Tensor params;  // the kernel's scales (undefined for kDense)
  at::Tensor bias;    // bf16 [out], or undefined
};

struct Layer {
  at::Tensor attention_norm, ffn_norm;  // bf16 [dim]
  Projection wqkv, wo, w13, w2;
  at::Tensor k_cache, v_cache;  // bf16 [slots, kv_heads, max_seq + 1, head_dim]
};

struct Model {
  int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq;
  float eps;
  at::Tensor embedding;   // bf16 [vocab, dim]
  at::Tensor cos, sin;    // bf16 [max_seq, head_dim]
  at::Tensor norm;        // bf16 [dim]
  Projection head;
  std::vector<Layer> layers;
};

std::mutex models_lock;
std::vector<std::shared_ptr<const Model>> models;  // by handle; freed entries are null

using Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DenseMatmul = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view, c10::List<std::optional<at::Scalar>>,
                               std::optional<std::string_view>);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// y = x @ W^T (+ bias), x bf16 [rows, in].
at::Tensor project(const Projection& p, const at::Tensor& x) {
  static const auto int4 = op<Matmul>("maskwire_kernels::int4_matmul");
  static const auto int8 = op<Matmul>("maskwire_kernels::int8_matmul");
  static const auto int4a8 = op<Matmul>("maskwire_kernels::int4_matmul_q8");
  static const auto dense = op<DenseMatmul>("mkldnn::_linear_pointwise");
  at::Tensor y;
  switch (p.form) {
    case kInt4: y = int4.call(x, p.w, p.params); break;
    case kInt8: y = int8.call(x, p.w, p.params); break;
    case kInt4A8: y = int4a8.call(x, p.w, p.params); break;
    case kDense:
      y = dense.call(x, p.w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                     std::nullopt);
      break;
  }
  if (p.bias.defined()) {  // as the layer's `y + bias` in bf16: one rounding
    auto* yp = y.mutable_data_ptr<c10::BFloat16>();
    const auto* bp = p.bias.const_data_ptr<c10::BFloat16>();
    const int64_t rows = y.size(0), n = y.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i)
        yp[r * n + i] = c10::BFloat16(to_float(yp[r * n + i]) + to_float(bp[i]));
  }
  return y;
}

inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// v rounded to bf16 and back: the graph's explicit cast
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// RMSNorm as `model.llama.RMSNorm`: bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))). dim % 16 == 0.
void rms_norm(const c10::BFloat16* x, const c10::BFloat16* weight, int64_t dim, float eps,
              c10::BFloat16* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = load16(x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(dim) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < dim; i += 16)
    store16(out + i, _mm512_mul_ps(load16(weight + i), round_bf16(_mm512_mul_ps(load16(x + i), rv))));
}

// Rotate-half RoPE of one head (`model.llama.apply_rope`), fp32 then one rounding; head_dim % 32
// == 0.
void rope(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
          int64_t head_dim, c10::BFloat16* out) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 a = load16(x + i), b = load16(x + half + i);
    // out[i] = a cos - b sin; out[half + i] = b cos + a sin
    store16(out + i, _mm512_fnmadd_ps(b, load16(sin + i),
                                      _mm512_mul_ps(a, load16(cos + i))));
    store16(out + half + i, _mm512_fmadd_ps(a, load16(sin + half + i),
                                            _mm512_mul_ps(b, load16(cos + half + i))));
  }
}

// x += y, one rounding per element; dim % 16 == 0.
void add_into(c10::BFloat16* x, const c10::BFloat16* y, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) store16(x + i, _mm512_add_ps(load16(x + i), load16(y + i)));
}

// silu(gate) * up for one row: exp of -|g| only (no overflow), 16 lanes at a time.
inline __m512 exp_negative(__m512 x) {  // Cephes' expf for x <= 0 (as the decode attention's)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}


void silu_times(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t n, c10::BFloat16* out) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 e = exp_negative(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    // sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) for g < 0
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
    const __m512 sig = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(g, sig), load16(up + i));
    store16(out + i, y);
  }
  for (; i < n; ++i) {
    const float g = to_float(gate[i]);
    out[i] = c10::BFloat16(g / (1.f + std::exp(-g)) * to_float(up[i]));
  }
}

// Rows [0, rows) of a pass in parallel where there are enough of them to pay a fork.
template <class Fn>
void over_rows(int64_t rows, Fn&& fn) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

std::shared_ptr<const Model> model_of(int64_t handle) {
  std::lock_guard<std::mutex> guard(models_lock);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(models.size()) && models[handle],
              "no decode step model ", handle);
  return models[handle];
}

Projection projection_from(const c10::List<std::optional<at::Tensor>>& t, int64_t at,
                           int64_t form) {
  TORCH_CHECK(form >= kInt4 && form <= kDense, "unknown projection form ", form);
  auto get = [&](int64_t i) {
    const std::optional<at::Tensor> v = t.get(at + i);
    return v.has_value() ? *v : at::Tensor();
  };
  Projection p{static_cast<Form>(form), get(0), get(1), get(2)};
  TORCH_CHECK(p.w.defined() && (form == kDense || p.params.defined()),
              "a projection needs its weight and, but for a dense one, its scales");
  TORCH_CHECK(!p.bias.defined() || (p.bias.scalar_type() == at::kBFloat16 && p.bias.dim() == 1 &&
                                    p.bias.is_contiguous()),
              "bias: contiguous bf16 [out]");
  return p;
}

void check_bf16(const at::Tensor& t, std::initializer_list<int64_t> shape, const char* name) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() &&
                  t.sizes() == at::IntArrayRef(shape),
              name, ": contiguous bf16 ", at::IntArrayRef(shape));
}

constexpr int64_t kGlobal = 4;     // embedding, cos, sin, norm
constexpr int64_t kPerLayer = 16;  // two norms, the K and V caches, 4 projections x 3
constexpr int64_t kPerProjection = 3;

// tensors: embedding, cos, sin, norm, head (weight, scales, bias), then per layer: attention
// norm, FFN norm, K cache, V cache, wqkv, wo, w13, w2 (weight, scales, bias each).
// forms: the head's, then per layer wqkv, wo, w13, w2. sizes: dim, heads, KV heads, head size,
// FFN size, max_seq.
int64_t decode_step_new(const c10::List<std::optional<at::Tensor>>& tensors,
                        at::IntArrayRef forms, at::IntArrayRef sizes, double eps) {
  TORCH_CHECK(sizes.size() == 6, "sizes: dim, heads, KV heads, head size, FFN size, max_seq");
  auto m = std::make_shared<Model>();
  m->dim = sizes[0], m->n_heads = sizes[1], m->n_kv_heads = sizes[2], m->head_dim = sizes[3];
  m->ffn_dim = sizes[4], m->max_seq = sizes[5];
  m->eps = static_cast<float>(eps);
  TORCH_CHECK(m->n_kv_heads > 0 && m->n_heads % m->n_kv_heads == 0,
              "heads must be a multiple of KV heads");
  TORCH_CHECK(m->head_dim % 32 == 0 && m->dim % 16 == 0, "head size a multiple of 32, dim of 16");
  const int64_t n_layers = (static_cast<int64_t>(tensors.size()) - kGlobal - kPerProjection) /
                           kPerLayer;
  TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(tensors.size()) ==
                                  kGlobal + kPerProjection + n_layers * kPerLayer,
              "tensors: 4 + 3 + 16 per layer");
  TORCH_CHECK(static_cast<int64_t>(forms.size()) == 1 + 4 * n_layers, "forms: 1 + 4 per layer");
  auto get = [&](int64_t i) {
    const std::optional<at::Tensor> v = tensors.get(i);
    TORCH_CHECK(v.has_value(), "tensor ", i, " is missing");
    return *v;
  };
  m->embedding = get(0), m->cos = get(1), m->sin = get(2), m->norm = get(3);
  TORCH_CHECK(m->embedding.dim() == 2, "embedding: [vocab, dim]");
  check_bf16(m->embedding, {m->embedding.size(0), m->dim}, "embedding");
  check_bf16(m->cos, {m->max_seq, m->head_dim}, "cos");
  check_bf16(m->sin, {m->max_seq, m->head_dim}, "sin");
  check_bf16(m->norm, {m->dim}, "norm");
  m->head = projection_from(tensors, kGlobal, forms[0]);
  const std::vector<int64_t> cache = {-1, m->n_kv_heads, m->max_seq + 1, m->head_dim};
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t at = kGlobal + kPerProjection + l * kPerLayer;
    Layer layer;
    layer.attention_norm = get(at), layer.ffn_norm = get(at + 1);
    layer.k_cache = get(at + 2), layer.v_cache = get(at + 3);
    check_bf16(layer.attention_norm, {m->dim}, "attention norm");
    check_bf16(layer.ffn_norm, {m->dim}, "FFN norm");
    for (const at::Tensor& c : {layer.k_cache, layer.v_cache})
      TORCH_CHECK(c.scalar_type() == at::kBFloat16 && c.is_contiguous() && c.dim() == 4 &&
                      c.size(1) == cache[1] && c.size(2) == cache[2] && c.size(3) == cache[3],
                  "K/V cache: contiguous bf16 [slots, KV heads, max_seq + 1, head size]");
    Projection* ps[4] = {&layer.wqkv, &layer.wo, &layer.w13, &layer.w2};
    for (int64_t i = 0; i < 4; ++i)
      *ps[i] = projection_from(tensors, at + 4 + i * kPerProjection, forms[1 + l * 4 + i]);
    m->layers.push_back(std::move(layer));
  }
  std::lock_guard<std::mutex> guard(models_lock);
  models.push_back(std::move(m));
  return static_cast<int64_t>(models.size()) - 1;
}

void decode_step_free(int64_t handle) {
  std::lock_guard<std::mutex> guard(models_lock);
  if (handle >= 0 && handle < static_cast<int64_t>(models.size())) models[handle].reset();
}

// One token per row: tokens, positions (-1: padding), slots: int64 [rows]; last: int64 [outputs]
// (rows whose logits are returned); the pass attends [0, kv_len). Returns fp32 [outputs, vocab].
at::Tensor decode_step_run(int64_t handle, const at::Tensor& tokens, const at::Tensor& positions,
                           const at::Tensor& slots, const at::Tensor& last, int64_t kv_len) {
  static const auto attention = op<Attention>("maskwire_kernels::decode_attention");
  const std::shared_ptr<const Model> model = model_of(handle);
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
  const auto options = m.embedding.options();
  at::Tensor x = at::empty({rows, dim}, options), xn = at::empty({rows, dim}, options);
  at::Tensor q = at::empty({rows, m.n_kv_heads, group, hd}, options);
  at::Tensor hidden = at::empty({rows, m.ffn_dim}, options);
  auto* xp = x.mutable_data_ptr<c10::BFloat16>();
  auto* xnp = xn.mutable_data_ptr<c10::BFloat16>();
  auto* qp = q.mutable_data_ptr<c10::BFloat16>();
  auto* hp = hidden.mutable_data_ptr<c10::BFloat16>();
  const auto* emb = m.embedding.const_data_ptr<c10::BFloat16>();
  const auto* cos = m.cos.const_data_ptr<c10::BFloat16>();
  const auto* sin = m.sin.const_data_ptr<c10::BFloat16>();
  over_rows(rows, [&](int64_t r) { std::copy_n(emb + tok[r] * dim, dim, xp + r * dim); });

  auto add_into_x = [&](const at::Tensor& y) {
    const auto* yp = y.const_data_ptr<c10::BFloat16>();
    over_rows(rows, [&](int64_t r) { add_into(xp + r * dim, yp + r * dim, dim); });
  };
  for (const Layer& layer : m.layers) {
    const auto* an = layer.attention_norm.const_data_ptr<c10::BFloat16>();
    over_rows(rows, [&](int64_t r) { rms_norm(xp + r * dim, an, dim, m.eps, xnp + r * dim); });
    const at::Tensor qkv = project(layer.wqkv, xn);
    const auto* qkvp = qkv.const_data_ptr<c10::BFloat16>();
    auto* kc = layer.k_cache.mutable_data_ptr<c10::BFloat16>();
    auto* vc = layer.v_cache.mutable_data_ptr<c10::BFloat16>();
    const int64_t slot_stride = layer.k_cache.stride(0), head_stride = layer.k_cache.stride(1);
    over_rows(rows, [&](int64_t r) {
      const c10::BFloat16* row = qkvp + r * (q_size + 2 * kv_size);
      const int64_t p = std::max<int64_t>(pos[r], 0);  // padding rotates as position 0
      const c10::BFloat16* c = cos + p * hd;
      const c10::BFloat16* s = sin + p * hd;
      for (int64_t h = 0; h < m.n_heads; ++h) rope(row + h * hd, c, s, hd, qp + r * q_size + h * hd);
      for (int64_t h = 0; h < m.n_kv_heads; ++h) {
        const int64_t at = slot[r] * slot_stride + h * head_stride + wp[r] * hd;
        rope(row + q_size + h * hd, c, s, hd, kc + at);
        std::copy_n(row + q_size + kv_size + h * hd, hd, vc + at);
      }
    });
    const at::Tensor y = attention.call(q, layer.k_cache.slice(2, 0, kv_len),
                                        layer.v_cache.slice(2, 0, kv_len), slots, write_pos);
    add_into_x(project(layer.wo, y.view({rows, q_size})));
    const auto* fn = layer.ffn_norm.const_data_ptr<c10::BFloat16>();
    over_rows(rows, [&](int64_t r) { rms_norm(xp + r * dim, fn, dim, m.eps, xnp + r * dim); });
    const at::Tensor gate_up = project(layer.w13, xn);
    const auto* gu = gate_up.const_data_ptr<c10::BFloat16>();
    over_rows(rows, [&](int64_t r) {
      silu_times(gu + r * 2 * m.ffn_dim, gu + r * 2 * m.ffn_dim + m.ffn_dim, m.ffn_dim,
                 hp + r * m.ffn_dim);
    });
    add_into_x(project(layer.w2, hidden));
  }
  const int64_t outputs = last.size(0);
  const int64_t* wanted = last.const_data_ptr<int64_t>();
  at::Tensor selected = at::empty({outputs, dim}, options);
  auto* sp = selected.mutable_data_ptr<c10::BFloat16>();
  const auto* norm = m.norm.const_data_ptr<c10::BFloat16>();
  for (int64_t o = 0; o < outputs; ++o) {
    TORCH_CHECK(wanted[o] >= 0 && wanted[o] < rows, "last: row ", wanted[o], " out of range");
    rms_norm(xp + wanted[o] * dim, norm, dim, m.eps, sp + o * dim);
  }
  return project(m.head, selected).to(at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(maskwire_kernels, m) {
  m.def("decode_step_new(Tensor?[] tensors, int[] forms, int[] sizes, float eps) -> int");
  m.def("decode_step_free(int handle) -> ()");
  m.def(
      "decode_step_run(int handle, Tensor tokens, Tensor positions, Tensor slots, Tensor last, "
      "int kv_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CatchAll, m) {
  m.impl("decode_step_new", &decode_step_new);
  m.impl("decode_step_free", &decode_step_free);
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) { m.impl("decode_step_run", &decode_step_run); }
