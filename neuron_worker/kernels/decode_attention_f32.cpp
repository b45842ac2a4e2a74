// `decode_attention.cpp`'s attention for fp32 caches on AVX2 + FMA: passes of one token per row,
// each row's cache slot read in place.
//
// Without it an fp32 decode pass gathers every row's slot into a new tensor (at 8 rows and ~200
// positions, ~0.4 ms of a ~1.3 ms layer on a 2-core AVX2 host) and runs SDPA on the copy. Here
// K and V are read where they are: the scores of all the query rows that share a KV head are taken
// over one tile of 8 keys while it is in L1, then an fp32 softmax and the weighted sum of V per
// query row (8 accumulators of 8 lanes: AVX2 has 16 registers, too few to hold several rows).
#include <immintrin.h>
#include <torch/library.h>

#include "decode_attention.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 8;

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lane j of the result = the sum of the 8 lanes of v[j].
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Softmax of s[0..count) in place, returning the normalizer (the caller divides by it).
inline float softmax_unnormalized(float* s, int64_t count) {
  const int64_t whole = count / kLanes * kLanes;
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t i = 0; i < whole; i += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i));
  float peak = max8(top);
  for (int64_t i = whole; i < count; ++i) peak = std::max(peak, s[i]);
  const __m256 peaks = _mm256_set1_ps(peak);
  __m256 total = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += kLanes) {
    const __m256 e = maskwire::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), peaks));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = sum8(total);
  for (int64_t i = whole; i < count; ++i) {
    s[i] = std::exp(s[i] - peak);
    sum += s[i];
  }
  return sum;
}

// Scores of one query row (q already scaled) against keys p0 .. p0 + n (n <= 8) into s[0..8).
template <int CH>
inline void score_tile(const float* q, const float* k, int64_t stride, int64_t n, float* s) {
  __m256 partial[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) partial[j] = _mm256_setzero_ps();
  if (n == kLanes) {  // the common case, fully unrolled
    for (int c = 0; c < CH; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + c * kLanes);
      for (int64_t j = 0; j < kLanes; ++j)
        partial[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + j * stride + c * kLanes), partial[j]);
    }
  } else {
    for (int c = 0; c < CH; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + c * kLanes);
      for (int64_t j = 0; j < n; ++j)
        partial[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + j * stride + c * kLanes), partial[j]);
    }
  }
  _mm256_storeu_ps(s, sum_lanes8(partial));
}

// out = sum_{p <= last} w[p] * v[p] * norm for one query row.
template <int CH>
inline void weigh_values(const float* w, const float* v, int64_t stride, int64_t last, float norm,
                         float* out) {
  __m256 acc[CH];
  for (int c = 0; c < CH; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t p = 0; p <= last; ++p) {
    const __m256 wp = _mm256_set1_ps(w[p]);
    for (int c = 0; c < CH; ++c)
      acc[c] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + p * stride + c * kLanes), acc[c]);
  }
  for (int c = 0; c < CH; ++c)
    _mm256_storeu_ps(out + c * kLanes, _mm256_mul_ps(acc[c], _mm256_set1_ps(norm)));
}

// One (row, KV head): `rows` query rows of CH x 8 dims each, in q (scaled) and out.
template <int CH>
void attend_head(const float* q, const float* k, const float* v, int64_t stride,
                 const int64_t* last, int64_t rows, int64_t span, float* scores,
                 int64_t scores_stride, float* out) {
  constexpr int64_t dim = CH * kLanes;
  for (int64_t p0 = 0; p0 < span; p0 += kLanes) {
    const int64_t n = std::min(kLanes, span - p0);
    for (int64_t r = 0; r < rows; ++r)
      if (p0 <= last[r])
        score_tile<CH>(q + r * dim, k + p0 * stride, stride, n, scores + r * scores_stride + p0);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * scores_stride;
    const float norm = 1.f / softmax_unnormalized(s, last[r] + 1);
    weigh_values<CH>(s, v, stride, last[r], norm, out + r * dim);
  }
}

using AttendFn = void (*)(const float*, const float*, const float*, int64_t, const int64_t*,
                          int64_t, int64_t, float*, int64_t, float*);

AttendFn attend_for(int64_t chunks) {
  switch (chunks) {
    case 4: return attend_head<4>;
    case 8: return attend_head<8>;
    case 16: return attend_head<16>;
    default: return nullptr;
  }
}

// `maskwire::attend_slots` (decode_attention.h) over fp32 q, K and V.
at::Tensor decode_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& slots, const at::Tensor& pos) {
  return maskwire::attend_slots<float>(
      q, k, v, slots, pos, at::kFloat, [](maskwire::HeadTask<float>& t) {
        // The query rows scaled, then every row's scores padded to whole tiles of 8 positions.
        const int64_t values = t.rows * t.dim;
        const int64_t padded = (t.span + kLanes - 1) / kLanes * kLanes;
        t.scratch.resize(values + t.rows * padded);
        float* scaled = t.scratch.data();
        for (int64_t i = 0; i < values; ++i) scaled[i] = t.q[i] * t.scale;
        attend_for(t.dim / kLanes)(scaled, t.k, t.v, t.pos_stride, t.last, t.rows, t.span,
                                   scaled + values, padded, t.out);
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(maskwire_kernels, m) {
  m.def("decode_attention_f32(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) {
  m.impl("decode_attention_f32", &decode_attention_f32);
}
