// The decode step (`decode_step.h`) for bf16 models on AVX512-BF16: the 4- and 8-bit matmuls of
// `matmul_bf16.cpp`, `decode_attention.cpp`, and the elementwise work 16 lanes at a time with the
// compiled bf16 graph's rounding (fp32 within a chain, bf16 where the graph stores a tensor).
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "decode_step.h"
#include "vector_math.h"

namespace {

inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// v rounded to bf16 and back (the graph's explicit cast).
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

struct Bf16 {
  using T = c10::BFloat16;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static constexpr int64_t kLanes = 16;
  static constexpr const char* kInt4 = "maskwire_kernels::int4_matmul";
  static constexpr const char* kInt8 = "maskwire_kernels::int8_matmul";
  static constexpr const char* kInt4A8 = "maskwire_kernels::int4_matmul_q8";
  static constexpr const char* kAttention = "maskwire_kernels::decode_attention";

  // `model.llama.RMSNorm`: bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))).
  static void rms_norm(const T* x, const T* weight, int64_t dim, float eps, T* out) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += kLanes) {
      const __m512 v = load16(x + i);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < dim; i += kLanes)
      store16(out + i, _mm512_mul_ps(load16(weight + i), round_bf16(_mm512_mul_ps(load16(x + i), r))));
  }

  // Rotate-half RoPE of one head (`model.llama.apply_rope`).
  static void rope(const T* x, const T* cos, const T* sin, int64_t head_dim, T* out) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i += kLanes) {
      const __m512 a = load16(x + i), b = load16(x + half + i);
      // out[i] = a cos - b sin; out[half + i] = b cos + a sin
      store16(out + i, _mm512_fnmadd_ps(b, load16(sin + i), _mm512_mul_ps(a, load16(cos + i))));
      store16(out + half + i,
              _mm512_fmadd_ps(a, load16(sin + half + i), _mm512_mul_ps(b, load16(cos + half + i))));
    }
  }

  static void add_into(T* x, const T* y, int64_t dim) {
    for (int64_t i = 0; i < dim; i += kLanes)
      store16(x + i, _mm512_add_ps(load16(x + i), load16(y + i)));
  }

  // silu(gate) * up; sigmoid through e^-|g| (never overflows).
  static void silu_times(const T* gate, const T* up, int64_t n, T* out) {
    const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += kLanes) {
      const __m512 g = load16(gate + i);
      const __m512 e = maskwire::exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
      // sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) for g < 0
      const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
      const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
      store16(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), load16(up + i)));
    }
  }
};

}  // namespace

MASKWIRE_DECODE_STEP_OPS(decode_step, Bf16)
