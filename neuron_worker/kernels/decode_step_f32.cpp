// The decode step (`decode_step.h`) for fp32 models on AVX2 + FMA: the 4- and 8-bit matmuls of
// `matmul_f32.cpp`, `decode_attention_f32.cpp`, and the elementwise work 8 lanes at a time in
// fp32, as the compiled fp32 graph computes it.
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "decode_step.h"
#include "vector_math.h"

namespace {

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

struct F32 {
  using T = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static constexpr int64_t kLanes = 8;
  static constexpr const char* kInt4 = "maskwire_kernels::int4_matmul_f32";
  static constexpr const char* kInt8 = "maskwire_kernels::int8_matmul_f32";
  static constexpr const char* kInt4A8 = "maskwire_kernels::int4_matmul_q8_f32";
  static constexpr const char* kAttention = "maskwire_kernels::decode_attention_f32";

  // `model.llama.RMSNorm` in fp32: weight * (x * rsqrt(mean(x^2) + eps)).
  static void rms_norm(const T* x, const T* weight, int64_t dim, float eps, T* out) {
    __m256 squares = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += kLanes) {
      const __m256 v = _mm256_loadu_ps(x + i);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 r = _mm256_set1_ps(1.f / std::sqrt(sum8(squares) / static_cast<float>(dim) + eps));
    for (int64_t i = 0; i < dim; i += kLanes)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
  }

  // Rotate-half RoPE of one head (`model.llama.apply_rope`).
  static void rope(const T* x, const T* cos, const T* sin, int64_t head_dim, T* out) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i += kLanes) {
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
      _mm256_storeu_ps(out + i, _mm256_fnmadd_ps(b, _mm256_loadu_ps(sin + i),
                                                 _mm256_mul_ps(a, _mm256_loadu_ps(cos + i))));
      _mm256_storeu_ps(out + half + i,
                       _mm256_fmadd_ps(a, _mm256_loadu_ps(sin + half + i),
                                       _mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i))));
    }
  }

  static void add_into(T* x, const T* y, int64_t dim) {
    for (int64_t i = 0; i < dim; i += kLanes)
      _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }

  // silu(gate) * up; sigmoid through e^-|g| (never overflows).
  static void silu_times(const T* gate, const T* up, int64_t n, T* out) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < n; i += kLanes) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = maskwire::exp_nonpositive(_mm256_or_ps(g, sign));  // e^-|g|
      const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
      const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
  }
};

}  // namespace

MASKWIRE_DECODE_STEP_OPS(decode_step_f32, F32)
