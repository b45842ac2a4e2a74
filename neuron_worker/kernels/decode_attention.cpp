// Attention for passes of one token per row, reading each row's cache slot in place.
//
// A decode pass has a handful of query rows per KV head (the query heads that share it), and the
// generic path gathers every row's slot into a new tensor and runs SDPA's flash kernel, which is
// built for long query blocks: at 8 rows and 192 positions that is ~280 us per layer for ~600 KB of
// K/V. This kernel reads K and V where they are, once per (row, KV head), and computes the scores,
// an fp32 softmax and the weighted sum of V for all the query rows that share the head.
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "decode_attention.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kLanes = 16;

inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Softmax of s[0..count) in place, returning the normalizer (the caller divides by it).
inline float softmax_unnormalized(float* s, int64_t count) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 m = count - i >= kLanes ? 0xffff : (1u << (count - i)) - 1;
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, s + i));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 m = count - i >= kLanes ? 0xffff : (1u << (count - i)) - 1;
    const __m512 e = maskwire::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), peak));
    _mm512_mask_storeu_ps(s + i, m, e);
    total = _mm512_mask_add_ps(total, m, total, e);
  }
  return _mm512_reduce_add_ps(total);
}

// Lane j of the result = the sum of the 16 lanes of v[j] (a transposing add tree: ~3 instructions
// per vector instead of a full horizontal reduction each).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xdd));
}

// One (row, KV head): NR query rows (<= 4, accumulators in registers) of CH x 16 dims each.
template <int NR, int CH>
void attend_rows(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                 int64_t stride, const int64_t* last, int64_t span, float* scores,
                 int64_t scores_stride, float scale, c10::BFloat16* out) {
  constexpr int64_t dim = CH * kLanes;
  __m512 qr[NR][CH];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c)
      qr[r][c] = _mm512_mul_ps(load_bf16(q + r * dim + c * kLanes), _mm512_set1_ps(scale));
  // Scores, 16 positions at a time; positions past `span` count as zero keys.
  for (int64_t p0 = 0; p0 < span; p0 += kLanes) {
    __m512 partial[NR][kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (p0 + j >= span) {
        for (int r = 0; r < NR; ++r) partial[r][j] = _mm512_setzero_ps();
        continue;
      }
      const c10::BFloat16* kp = k + (p0 + j) * stride;
      __m512 kc[CH];
      for (int c = 0; c < CH; ++c) kc[c] = load_bf16(kp + c * kLanes);
      for (int r = 0; r < NR; ++r) {
        __m512 s = _mm512_mul_ps(qr[r][0], kc[0]);
        for (int c = 1; c < CH; ++c) s = _mm512_fmadd_ps(qr[r][c], kc[c], s);
        partial[r][j] = s;
      }
    }
    for (int r = 0; r < NR; ++r)
      _mm512_storeu_ps(scores + r * scores_stride + p0, sum_lanes16(partial[r]));
  }
  float norm[NR];
  for (int r = 0; r < NR; ++r)
    norm[r] = 1.f / softmax_unnormalized(scores + r * scores_stride, last[r] + 1);
  // out[r] = sum_p softmax[r, p] * v[p], reading each V row once for all NR query rows.
  __m512 acc[NR][CH];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < span; ++p) {
    __m512 vc[CH];
    for (int c = 0; c < CH; ++c) vc[c] = load_bf16(v + p * stride + c * kLanes);
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(p <= last[r] ? scores[r * scores_stride + p] : 0.f);
      for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_fmadd_ps(w, vc[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * dim + c * kLanes),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], _mm512_set1_ps(norm[r]))));
}

using AttendFn = void (*)(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                          const int64_t*, int64_t, float*, int64_t, float, c10::BFloat16*);

template <int CH>
constexpr AttendFn kAttend[5] = {nullptr, attend_rows<1, CH>, attend_rows<2, CH>,
                                 attend_rows<3, CH>, attend_rows<4, CH>};

AttendFn attend_for(int64_t rows, int64_t chunks) {
  switch (chunks) {
    case 2: return kAttend<2>[rows];
    case 4: return kAttend<4>[rows];
    case 8: return kAttend<8>[rows];
    default: return nullptr;
  }
}

// `maskwire::attend_slots` (decode_attention.h) over bf16 q, K and V.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slots, const at::Tensor& pos) {
  return maskwire::attend_slots<c10::BFloat16>(
      q, k, v, slots, pos, at::kBFloat16, [](maskwire::HeadTask<c10::BFloat16>& t) {
        // 4 query rows' scores at a time, each padded to whole tiles of 16 positions.
        const int64_t padded = (t.span + kLanes - 1) / kLanes * kLanes;
        t.scratch.resize(4 * padded);
        for (int64_t r0 = 0; r0 < t.rows; r0 += 4) {
          const int64_t nr = std::min<int64_t>(4, t.rows - r0);
          attend_for(nr, t.dim / kLanes)(t.q + r0 * t.dim, t.k, t.v, t.pos_stride, t.last + r0,
                                         t.span, t.scratch.data(), padded, t.scale,
                                         t.out + r0 * t.dim);
        }
      });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(maskwire_kernels, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor pos) -> Tensor");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) { m.impl("decode_attention", &decode_attention); }
