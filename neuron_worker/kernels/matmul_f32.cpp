// 4- and 8-bit weights x fp32 activations for passes of a few rows, on AVX2 + FMA CPUs.
//
// Where bf16 is emulated (no AVX512-BF16 or AMX) the worker runs fp32, and a decode pass reads
// every fp32 weight (4 bytes) for a handful of rows: the time is the bytes over the memory
// bandwidth. These kernels read llama.cpp's block formats (half a byte or a byte per weight, plus
// fp32 parameters per 32) once for up to 8 rows, turn each quant into its exact fp32 value and
// sum in fp32: the weights are exactly the checkpoint's, the arithmetic fp32 like the dense
// path's (only the order of the additions differs). aten's int4 kernel has no fp32 vector path.
// `int4_matmul_q8_f32` (below) is the Q4_1 weights times 8-bit activations, llama.cpp's
// arithmetic on AVX2: integer products, a quarter of the instructions per weight.
//
// Per group of 32 inputs of a row x:
//   Q4_1 (w = scale * q + low, q in 0..15):  y += scale * sum(q x) + low * sum(x)
//   Q8_0 (w = scale * q, q in -128..127):     y += scale * sum(q x)
//
// Weight layout (built by `neuron_worker.kernels.pack_int4_f32` / `pack_int8_f32`): for each block
// of 8 output channels and each group of 32 inputs, chunks of 8 bytes, byte c of a chunk for
// channel c. Q4_1: 16 chunks, chunk j holds input j in its low nibble and input 16 + j in its high
// nibble. Q8_0: 32 chunks, chunk j holds input j. Widened to 32-bit lanes, a chunk (or a nibble
// half) is one 8-channel fp32 vector. Then per block and group the fp32 parameters: Q4_1 8 scales
// and 8 lows, Q8_0 8 scales.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "matmul.h"

namespace {

constexpr int64_t kBlock = 8;   // output channels per register
constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int64_t kHalf = kGroup / 2;

inline __m128i chunk_at(const uint8_t* group, int64_t j) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + j * kBlock));
}

struct Q4_1 {
  static constexpr int64_t kChunks = kHalf;
  static constexpr int64_t kParams = 2;  // scale, low
  // Inputs j and 16 + j of the group, 8 channels each.
  static inline void load(const uint8_t* group, int64_t j, __m256& lo, __m256& hi) {
    const __m256i wide = _mm256_cvtepu8_epi32(chunk_at(group, j));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0x0f)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
  }
};

struct Q8_0 {
  static constexpr int64_t kChunks = kGroup;
  static constexpr int64_t kParams = 1;  // scale
  static inline void load(const uint8_t* group, int64_t j, __m256& lo, __m256& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(chunk_at(group, j)));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(chunk_at(group, kHalf + j)));
  }
};

// The dot products of U consecutive groups (weights wg, U x 32 inputs from xg) with M rows of x,
// each group's in one fixed order: input j, then 16 + j, for j = 0..15.
template <class F, int M, int U>
inline void group_dots(const uint8_t* wg, const float* xg, int64_t k, __m256 (&dot)[U][M]) {
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < M; ++m) dot[u][m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < kHalf; ++j)
    for (int u = 0; u < U; ++u) {
      __m256 lo, hi;
      F::load(wg + u * F::kChunks * kBlock, j, lo, hi);
      const float* xu = xg + u * kGroup;
      for (int m = 0; m < M; ++m) {
        dot[u][m] = _mm256_fmadd_ps(lo, _mm256_broadcast_ss(xu + m * k + j), dot[u][m]);
        dot[u][m] = _mm256_fmadd_ps(hi, _mm256_broadcast_ss(xu + m * k + kHalf + j), dot[u][m]);
      }
    }
}

// Output channel blocks [nb_begin, nb_end) for M rows of x (fp32 [M, k], group sums xsum).
// Every row's sums run in the same order whatever M is, so a row's result does not depend on how
// many rows share the pass (greedy output does not depend on batching). A group's sum is one
// chain of dependent FMAs per row, so few rows would leave the FMA units waiting on latency: U
// groups run in flight, U x M chains (U divides the 18 and 48 groups of SmolLM2's 576 and 1536
// inputs). Each group's sum and the order they are added in stay the same for every U, so the
// result does too. Measured on 2 AVX2 cores, SmolLM2's 120 projections: 1 row 5.1 -> 4.7 ms,
// 3-4 rows -17%, 5 rows -5%; from 6 rows on the rows' own chains suffice.
// From 7 rows the M dot products alone take half of AVX2's 16 vector registers, and the rows'
// running sums beside them spilled in every group's inner loop: they live in `out` instead (a
// load and a store per row and group, the same arithmetic). Measured on a 2-core AVX2-only EPYC:
// the 120 projections at 7 / 8 rows 18.4 / 20.1 -> 12.7 / 14.5 ms, the Q8_0 head 4.4 / 4.8 ->
// 3.0 / 3.5 ms (with them in registers at 2-6 rows as well: 0-10% slower there).
template <class F, int M>
void blocks_for_rows(const float* x, const float* xsum, int64_t k, const uint8_t* w,
                     const float* params, int64_t nb_begin, int64_t nb_end, float* out,
                     int64_t n) {
  constexpr int U = M == 1 ? 6 : M == 2 ? 3 : M <= 6 ? 2 : 1;
  constexpr bool kSumsInOut = M >= 7;
  const int64_t groups = k / kGroup;
  const int64_t group_bytes = F::kChunks * kBlock;
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    float* const sums = out + nb * kBlock;  // row m's at sums + m * n
    __m256 acc[kSumsInOut ? 1 : M];
    for (int m = 0; m < M; ++m) {
      if constexpr (kSumsInOut)
        _mm256_storeu_ps(sums + m * n, _mm256_setzero_ps());
      else
        acc[m] = _mm256_setzero_ps();
    }
    const auto accumulate = [&](int64_t g, const __m256* dot) {
      const float* p = params + (nb * groups + g) * F::kParams * kBlock;
      const __m256 scale = _mm256_loadu_ps(p);
      for (int m = 0; m < M; ++m) {
        __m256 a = kSumsInOut ? _mm256_loadu_ps(sums + m * n) : acc[m];
        a = _mm256_fmadd_ps(dot[m], scale, a);
        if constexpr (F::kParams == 2)
          a = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * groups + g]), _mm256_loadu_ps(p + kBlock),
                              a);
        if constexpr (kSumsInOut)
          _mm256_storeu_ps(sums + m * n, a);
        else
          acc[m] = a;
      }
    };
    int64_t g = 0;
    for (; g + U <= groups; g += U) {
      __m256 dot[U][M];
      group_dots<F, M, U>(w + (nb * groups + g) * group_bytes, x + g * kGroup, k, dot);
      for (int u = 0; u < U; ++u) accumulate(g + u, dot[u]);
    }
    for (; g < groups; ++g) {
      __m256 dot[1][M];
      group_dots<F, M, 1>(w + (nb * groups + g) * group_bytes, x + g * kGroup, k, dot);
      accumulate(g, dot[0]);
    }
    if constexpr (!kSumsInOut)
      for (int m = 0; m < M; ++m) _mm256_storeu_ps(sums + m * n, acc[m]);
  }
}

// Sum of each group of 32 values of x (rows * groups of them).
std::vector<float> group_sums(const float* x, int64_t count) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; ++i) {
    __m256 s = _mm256_setzero_ps();
    for (int64_t j = 0; j < kGroup; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * kGroup + j));
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sums[i] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
  return sums;
}

// x: fp32 [rows, K]; w: [N/8, K/32, chunks, 8] of quant_type; params: fp32 [N/8, K/32, P, 8].
template <class F>
at::Tensor matmul_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params,
                      at::ScalarType quant_type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [rows, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == quant_type && w.size(2) == F::kChunks &&
                  w.size(3) == kBlock && w.is_contiguous(),
              "w: contiguous ", quant_type, " [N/8, K/32, ", F::kChunks, ", 8]");
  TORCH_CHECK(params.scalar_type() == at::kFloat && params.is_contiguous() &&
                  params.sizes() == at::IntArrayRef({w.size(0), w.size(1), F::kParams, kBlock}),
              "params: contiguous fp32 [N/8, K/32, ", F::kParams, ", 8]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " inputs, the weight ", groups * kGroup);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  const std::vector<float> xsum = group_sums(xp, F::kParams == 2 ? rows * groups : 0);
  const auto* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const auto* pp = params.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  // Grain 8 blocks (64 channels): even the smallest projection runs on every thread.
  const int64_t block_bytes = groups * (F::kChunks * kBlock + F::kParams * kBlock * 4);
  maskwire::over_rows_and_blocks(rows, blocks, block_bytes, 8, [&](auto m, int64_t row, int64_t b0,
                                                                   int64_t b1) {
    const float* row_sums = xsum.empty() ? nullptr : xsum.data() + row * groups;
    blocks_for_rows<F, decltype(m)::value>(xp + row * k, row_sums, k, wp, pp, b0, b1, op + row * n,
                                           n);
  });
  return out;
}

// Q4_1 weights x 8-bit activations (`int4_matmul_q8_f32`, `--quantize int4a8`): each row's
// inputs quantized per group of 32 to int8 with one fp32 scale sx (llama.cpp's Q8 activations,
// |a| <= 127), and `vpmaddubsw` multiplies unsigned nibbles by them in pairs into 16-bit sums
// (8 chunks of a group add up to at most 8 x 2 x 15 x 127 = 30,480: no saturation), which one
// `vpmaddwd` widens to int32: the group's sum(q a) is exact. Per group, centred as in the bf16
// path so that the two terms do not cancel: y += scale * sx * (sum(q a) - 8 sum(a)) +
// zero * sum(x), zero = low + 8 * scale, the last sum over the exact inputs. A row's result does
// not depend on the rows beside it. Weight layout (`neuron_worker.kernels.pack_int4_q8_f32`): for
// each block of 8 output channels and each group of 32 inputs, 4 chunks of 32 bytes; byte 4c + e
// of chunk t holds channel c's input 8t + e in its low nibble and 8t + 4 + e in its high one, so
// a 32-bit lane of either nibble half is 4 consecutive inputs of one channel, against 4
// consecutive int8 activations broadcast. Then per block and group 8 scales and 8 zeros (fp32).
using maskwire::RowsQ8;

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

RowsQ8 quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  RowsQ8 out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
             group_sums(x, rows * groups), std::vector<int32_t>(rows * groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // `vpackssdw` / `vpacksswb` interleave their 128-bit lanes; this puts the 32 bytes in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* xg = x + i * kGroup;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], magnitude));
    }
    const float a = hmax8(amax);
    const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest
    out.scale[i] = a / 127.0f;
    out.qsum[i] = hsum8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * kGroup),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  return out;
}

// Output channel blocks [nb_begin, nb_end) for M rows (`RowsQ8` from the pass's first row). Each
// chunk's nibbles are unpacked once for the M rows; as in `blocks_for_rows`, from 7 rows the
// rows' running sums live in `out` (in registers beside the M 16-bit sums they would spill).
template <int M>
void blocks_q8_for_rows(const int8_t* xq, const float* sx, const float* xsum, const int32_t* qsum,
                        int64_t k, const uint8_t* w, const float* params, int64_t nb_begin,
                        int64_t nb_end, float* out, int64_t n) {
  constexpr bool kSumsInOut = M >= 7;
  constexpr int64_t kChunks = 4, kChunkBytes = 32;
  const int64_t groups = k / kGroup;
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    float* const sums = out + nb * kBlock;  // row m's at sums + m * n
    __m256 acc[kSumsInOut ? 1 : M];
    for (int m = 0; m < M; ++m) {
      if constexpr (kSumsInOut)
        _mm256_storeu_ps(sums + m * n, _mm256_setzero_ps());
      else
        acc[m] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + (nb * groups + g) * kChunks * kChunkBytes;
      __m256i dot16[M];
      for (int m = 0; m < M; ++m) dot16[m] = _mm256_setzero_si256();
      for (int64_t t = 0; t < kChunks; ++t) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + t * kChunkBytes));
        const __m256i lo = _mm256_and_si256(c, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
        for (int m = 0; m < M; ++m) {
          int32_t a0, a1;  // inputs 8t .. 8t + 3 and 8t + 4 .. 8t + 7
          std::memcpy(&a0, xq + m * k + g * kGroup + 8 * t, 4);
          std::memcpy(&a1, xq + m * k + g * kGroup + 8 * t + 4, 4);
          dot16[m] = _mm256_add_epi16(dot16[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a0)));
          dot16[m] = _mm256_add_epi16(dot16[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a1)));
        }
      }
      const float* p = params + (nb * groups + g) * 2 * kBlock;
      const __m256 scale = _mm256_loadu_ps(p), zero = _mm256_loadu_ps(p + kBlock);
      for (int m = 0; m < M; ++m) {
        const __m256i centred = _mm256_sub_epi32(_mm256_madd_epi16(dot16[m], ones),
                                                 _mm256_set1_epi32(8 * qsum[m * groups + g]));
        __m256 a = kSumsInOut ? _mm256_loadu_ps(sums + m * n) : acc[m];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred),
                            _mm256_mul_ps(scale, _mm256_set1_ps(sx[m * groups + g])), a);
        a = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * groups + g]), zero, a);
        if constexpr (kSumsInOut)
          _mm256_storeu_ps(sums + m * n, a);
        else
          acc[m] = a;
      }
    }
    if constexpr (!kSumsInOut)
      for (int m = 0; m < M; ++m) _mm256_storeu_ps(sums + m * n, acc[m]);
  }
}

// x: fp32 [rows, K]; w: uint8 [N/8, K/32, 4, 32]; scale_zero: fp32 [N/8, K/32, 2, 8].
at::Tensor int4_matmul_q8_f32(const at::Tensor& x, const at::Tensor& w,
                              const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: fp32 [rows, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kByte && w.size(2) == 4 && w.size(3) == 32 &&
                  w.is_contiguous(),
              "w: contiguous uint8 [N/8, K/32, 4, 32]");
  TORCH_CHECK(scale_zero.scalar_type() == at::kFloat && scale_zero.is_contiguous() &&
                  scale_zero.sizes() == at::IntArrayRef({w.size(0), w.size(1), 2, kBlock}),
              "scale_zero: contiguous fp32 [N/8, K/32, 2, 8]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " inputs, the weight ", groups * kGroup);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const RowsQ8 xq = quantize_rows(xc.const_data_ptr<float>(), rows, k);
  const auto* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const auto* pp = scale_zero.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t block_bytes = groups * (4 * 32 + 2 * kBlock * 4);
  maskwire::over_rows_and_blocks(rows, blocks, block_bytes, 8, [&](auto m, int64_t row, int64_t b0,
                                                                   int64_t b1) {
    blocks_q8_for_rows<decltype(m)::value>(xq.q.data() + row * k, xq.scale.data() + row * groups,
                                           xq.sum.data() + row * groups,
                                           xq.qsum.data() + row * groups, k, wp, pp, b0, b1,
                                           op + row * n, n);
  });
  return out;
}

at::Tensor int4_matmul_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_low) {
  return matmul_f32<Q4_1>(x, w, scale_low, at::kByte);
}

at::Tensor int8_matmul_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return matmul_f32<Q8_0>(x, w, scale, at::kChar);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(maskwire_kernels, m) {
  m.def("int4_matmul_f32(Tensor x, Tensor w, Tensor scale_low) -> Tensor");
  m.def("int8_matmul_f32(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_matmul_q8_f32(Tensor x, Tensor w, Tensor scale_zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) {
  m.impl("int4_matmul_f32", &int4_matmul_f32);
  m.impl("int8_matmul_f32", &int8_matmul_f32);
  m.impl("int4_matmul_q8_f32", &int4_matmul_q8_f32);
}
