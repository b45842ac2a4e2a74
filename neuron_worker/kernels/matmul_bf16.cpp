// 4- and 8-bit weights x bf16 activations for passes of a few rows, on AVX512-BF16 CPUs; and
// 4-bit weights x 8-bit activations with AVX512-VNNI (`int4_matmul_q8`, below).
//
// aten's `_weight_int4pack_mm_for_cpu` works in blocks of 4 rows and dequantizes the weights once
// per block, so 8 rows cost twice what 4 do and are no faster than bf16 weights. These kernels
// read each weight once for up to 8 rows, turn each quant into its exact bf16 value, and one
// `vdpbf16ps` per row multiplies 32 of them by the row's bf16 activations into fp32 sums, so the
// products are exact and only the fp32 sums round.
//
// Q4_1 (`int4_matmul`, the layers): two table lookups turn 64 nibbles into bf16 values (q - 8,
// exact). Per group of 32 inputs: y += scale * sum((q - 8) x) + zero * sum(x), with
// w = scale * (q - 8) + zero (Q4_1's w = scale * q + low, zero = low + 8 * scale). A group's sum
// is two chains per row (low and high nibbles, added at the group's end), the same for every row
// count: 8 dependent `vdpbf16ps` instead of 16 (SmolLM2's 120 projections, 2 threads: 4 rows
// 3.67 -> 3.31 ms, 8 rows 5.71 -> 5.47, 1-2 rows bandwidth-bound either way).
// Weight layout (built by `neuron_worker.kernels.pack_int4`): for each block of 16 output
// channels and each group of 32 inputs, 8 chunks of 32 bytes. Byte i of chunk j holds weight
// (channel i / 2, input 4j + i % 2) in its low nibble and (channel i / 2, input 4j + 2 + i % 2) in
// its high nibble: zero-extended to 16-bit lanes, each nibble half is one `vdpbf16ps` operand
// (16 channels x 2 inputs). Then per block and group: 16 scales and 16 minimums, fp16 where the
// checkpoint's are (GGUF stores them so) and fp32 otherwise; the kernel forms each zero as
// low + 8 * scale in fp32 (exact but for one rounding). At one row the weights stream from
// memory, and fp16 parameters are 5 bits per weight instead of 6.
//
// Q8_0 (`int8_matmul`, the embedded model's tied LM head as its GGUF stores it): w = scale * q,
// q in -128..127, widened through fp32 to bf16 (exact: 8 significant bits). Per group of 32
// inputs: y += scale * sum(q x). Weight layout (`neuron_worker.kernels.pack_int8`): for each
// block of 16 output channels and each group of 32 inputs, 16 chunks of 32 bytes; byte i of
// chunk j holds weight (channel i / 2, input 2j + i % 2): one `vdpbf16ps` operand. Then per block
// and group 16 scales (fp16 where exact, else fp32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "matmul.h"

namespace {

constexpr int64_t kBlock = 16;  // output channels per register
constexpr int64_t kGroup = 32;  // inputs per scale

// The two bf16 inputs (at, at + 1) of row m as one 32-bit lane pattern, broadcast.
inline __m512bh input_pair(const uint16_t* x, int64_t k, int m, int64_t at) {
  int32_t pair;
  std::memcpy(&pair, x + m * k + at, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// 16 per-channel parameters as fp32: stored fp32, or fp16 (exact).
inline __m512 load_params(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_params(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Q4_1's zeros, w = scale * (q - 8) + zero: low + 8 * scale, exact but for one rounding.
inline __m512 zero_of(__m512 scale, __m512 low) {
  return _mm512_fmadd_ps(_mm512_set1_ps(8.0f), scale, low);
}

struct Q4_1 {
  static constexpr int64_t kChunks = kGroup / 4;  // 32 bytes each
  static constexpr int64_t kParams = 2;           // scale, low
  static constexpr const char* kLayout = "uint8 [N/16, K/32, 8, 32]";
  static constexpr at::ScalarType kType = at::kByte;

  // Lane q (0..15) holds bf16(q - 8): the lookup table for a nibble.
  __m512i table;

  Q4_1() {
    alignas(64) uint16_t t[32];
    for (int q = 0; q < 32; ++q) {
      const float f = static_cast<float>((q & 15) - 8);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      t[q] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
    }
    table = _mm512_load_si512(t);
  }

  // One group's two chains per row: low nibbles into a, high nibbles into b.
  template <int M>
  inline void group_dots(const uint8_t* wg, const uint16_t* x, int64_t k, int64_t at0,
                         __m512 (&a)[M], __m512 (&b)[M]) const {
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    for (int64_t j = 0; j < kChunks; ++j) {
      const __m512i wide =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 32)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(wide, nibble), table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
      const int64_t at = at0 + 4 * j;
      for (int m = 0; m < M; ++m) {
        a[m] = _mm512_dpbf16_ps(a[m], lo, input_pair(x, k, m, at));
        b[m] = _mm512_dpbf16_ps(b[m], hi, input_pair(x, k, m, at + 2));
      }
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kChunks = kGroup / 2;  // 32 bytes each
  static constexpr int64_t kParams = 1;           // scale
  static constexpr const char* kLayout = "int8 [N/16, K/32, 16, 32]";
  static constexpr at::ScalarType kType = at::kChar;

  // Chunk j of a group as one bf16 operand (16 channels x inputs 2j, 2j + 1), exact.
  static inline __m512bh operand(const uint8_t* wg, int64_t j) {
    const auto* p = reinterpret_cast<const __m128i*>(wg + j * 32);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from lo
  }

  // One group's two chains per row: even chunks into a, odd chunks into b.
  template <int M>
  inline void group_dots(const uint8_t* wg, const uint16_t* x, int64_t k, int64_t at0,
                         __m512 (&a)[M], __m512 (&b)[M]) const {
    for (int64_t j = 0; j < kChunks; j += 2) {
      const __m512bh even = operand(wg, j);
      const __m512bh odd = operand(wg, j + 1);
      const int64_t at = at0 + 2 * j;
      for (int m = 0; m < M; ++m) {
        a[m] = _mm512_dpbf16_ps(a[m], even, input_pair(x, k, m, at));
        b[m] = _mm512_dpbf16_ps(b[m], odd, input_pair(x, k, m, at + 2));
      }
    }
  }
};

// Each group first prefetches the weights and parameters of the group `weight_prefetch` groups
// ahead in the task's range (2 KB of Q4_1, 4 KB of Q8_0 at the default 8): with the hardware
// prefetcher alone the one-row pass read its 85 MB in ~3.6 ms on the AVX512-BF16 host, where a
// plain two-thread read of as many bytes takes 2.4-3.2 ms; 1.02-1.10x by row count
// (`bench/weight_prefetch.py`).
std::atomic<int64_t> weight_prefetch{8};

// Output channel blocks [nb_begin, nb_end) for M rows of x (bf16 [M, k]; xsum: its group sums,
// for Q4_1's zeros). A group's sum is two chains per row, added at the group's end: one chain of
// 16 dependent `vdpbf16ps` would leave a single row waiting on their latency. The same order for
// every M, so a row's result does not depend on how many rows share the pass.
template <class F, int M, class P>
void blocks_for_rows(const uint16_t* x, const float* xsum, int64_t k, const uint8_t* w,
                     const P* params, int64_t nb_begin, int64_t nb_end, uint16_t* out,
                     int64_t n) {
  const int64_t groups = k / kGroup;
  const F format;  // its constants (Q4_1's nibble table), built once per task
  const int64_t ahead = weight_prefetch.load(std::memory_order_relaxed);
  const int64_t w_group = F::kChunks * 32, p_group = F::kParams * kBlock;
  const int64_t task_end = nb_end * groups;
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = nb * groups + g;
      if (ahead > 0 && at + ahead < task_end) {
        const auto* wn = reinterpret_cast<const char*>(w + (at + ahead) * w_group);
        for (int64_t line = 0; line < w_group; line += 64) _mm_prefetch(wn + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(params + (at + ahead) * p_group), _MM_HINT_T0);
      }
      __m512 a[M], b[M];
      for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
      format.template group_dots<M>(w + at * w_group, x, k, g * kGroup, a, b);
      const P* p = params + at * p_group;
      const __m512 scale = load_params(p);
      __m512 zero = scale;
      if constexpr (F::kParams == 2) zero = zero_of(scale, load_params(p + kBlock));
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(a[m], b[m]), scale, acc[m]);
        if constexpr (F::kParams == 2)
          acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), zero, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n + nb * kBlock),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

// Sum of each group of 32 values of x (count groups). A bf16 value is the top half of its fp32
// value: 32 of them are 16 even + 16 odd fp32 lanes.
std::vector<float> group_sums(const uint16_t* x, int64_t count) {
  std::vector<float> sums(count);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < count; ++i) {
    const __m512i v = _mm512_loadu_si512(x + i * kGroup);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
  return sums;
}

// x: bf16 [rows, K]; w: F::kLayout; params: fp16 or fp32 [N/16, K/32, 2, 16] (Q4_1: scales,
// minimums), or [N/16, K/32, 16] (Q8_0: scales).
// The inputs' checks, shared by every matmul of a weight format F.
template <class F>
void check_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [rows, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == F::kType && w.size(2) == F::kChunks &&
                  w.size(3) == 32 && w.is_contiguous(),
              "w: contiguous ", F::kLayout);
  const auto want = F::kParams == 2
                        ? std::vector<int64_t>{w.size(0), w.size(1), 2, kBlock}
                        : std::vector<int64_t>{w.size(0), w.size(1), kBlock};
  TORCH_CHECK((params.scalar_type() == at::kFloat || params.scalar_type() == at::kHalf) &&
                  params.is_contiguous() && params.sizes() == at::IntArrayRef(want),
              "scales: contiguous fp16 or fp32 ", at::IntArrayRef(want));
  TORCH_CHECK(w.size(1) * kGroup == x.size(1), "x has ", x.size(1), " inputs, the weight ",
              w.size(1) * kGroup);
}

// `call(params pointer)` with the parameters' element type (fp16 or fp32).
template <class Call>
void with_params(const at::Tensor& params, Call&& call) {
  if (params.scalar_type() == at::kHalf)
    call(params.const_data_ptr<c10::Half>());
  else
    call(params.const_data_ptr<float>());
}

template <class F>
at::Tensor matmul_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& params) {
  check_inputs<F>(x, w, params);
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>());
  // Q4_1's zeros: sum_i w_i x_i = scale * sum (q - 8) x + zero * sum x.
  const std::vector<float> xsum = group_sums(xp, F::kParams == 2 ? rows * groups : 0);
  const auto* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  with_params(params, [&](const auto* pp) {
    // Grain 4 blocks (64 channels): even the smallest projection runs on every thread.
    const int64_t block_bytes = groups * (F::kChunks * 32 + F::kParams * kBlock * sizeof(*pp));
    maskwire::over_rows_and_blocks(rows, blocks, block_bytes, 4, [&](auto m, int64_t row,
                                                                     int64_t b0, int64_t b1) {
      const float* row_sums = xsum.empty() ? nullptr : xsum.data() + row * groups;
      blocks_for_rows<F, decltype(m)::value>(xp + row * k, row_sums, k, wp, pp, b0, b1,
                                             op + row * n, n);
    });
  });
  return out;
}

// Q4_1 weights x 8-bit activations (`int4_matmul_q8`, AVX512-VNNI), on the same weight layout:
// each row's inputs are quantized per group of 32 to int8 with one fp32 scale sx (llama.cpp's Q8
// activations), and one `vpdpbusd` per row multiplies 16 channels x 4 inputs of unsigned nibbles
// by them into exact int32 sums: half the multiply instructions of the bf16 path, and a nibble
// needs no table lookup. Per group: y += scale * sx * (sum(q a) - 8 sum(a)) + zero * sum(x), the
// last sum over the exact inputs: centred as in the bf16 path, so that the two terms do not
// cancel in fp32. A chunk's 16-bit lane i (byte i) becomes the bytes (low
// nibble, high nibble): inputs (4j + i % 2, 4j + 2 + i % 2) of channel i / 2, so a 32-bit lane
// holds channel c's inputs in the order 4j, 4j + 2, 4j + 1, 4j + 3; the quantized activations are
// stored in that order.
using maskwire::RowsQ8;

RowsQ8 quantize_rows(const uint16_t* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  RowsQ8 out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
             std::vector<float>(rows * groups), std::vector<int32_t>(rows * groups)};
  // Within each 4 bytes: 0, 2, 1, 3.
  const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t i = 0; i < rows * groups; ++i) {
    const uint16_t* xg = x + i * kGroup;
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))), 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    out.scale[i] = amax / 127.0f;
    out.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i ilo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, s));
    const __m512i ihi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, s));
    out.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(ilo, ihi));
    const __m128i qlo = _mm512_cvtsepi32_epi8(ilo);
    const __m128i qhi = _mm512_cvtsepi32_epi8(ihi);
    int8_t* dst = out.q.data() + i * kGroup;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(qlo, order));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_shuffle_epi8(qhi, order));
  }
  return out;
}

// Output channel blocks [nb_begin, nb_end) for M rows (`RowsQ8` from the pass's first row). Two int32 chains per row (even and odd chunks), added at the group's end: exact, so
// a row's result does not depend on how many rows share the pass.
template <int M, class P>
void blocks_q8_for_rows(const int8_t* xq, const float* sx, const float* xsum, const int32_t* qsum,
                        int64_t k, const uint8_t* w, const P* params, int64_t nb_begin, int64_t nb_end,
                        uint16_t* out, int64_t n) {
  const int64_t groups = k / kGroup;
  const __m512i low4 = _mm512_set1_epi16(0x000f);
  const __m512i high4 = _mm512_set1_epi16(0x00f0);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + (nb * groups + g) * Q4_1::kChunks * 32;
      __m512i a[M], b[M];
      for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_si512();
      for (int64_t j = 0; j < Q4_1::kChunks; j += 2) {
        const __m512i w0 =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 32)));
        const __m512i w1 = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (j + 1) * 32)));
        const __m512i even = _mm512_or_si512(_mm512_and_si512(w0, low4),
                                             _mm512_slli_epi16(_mm512_and_si512(w0, high4), 4));
        const __m512i odd = _mm512_or_si512(_mm512_and_si512(w1, low4),
                                            _mm512_slli_epi16(_mm512_and_si512(w1, high4), 4));
        const int64_t at = g * kGroup + 4 * j;
        for (int m = 0; m < M; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, xq + m * k + at, 4);
          std::memcpy(&x1, xq + m * k + at + 4, 4);
          a[m] = _mm512_dpbusd_epi32(a[m], even, _mm512_set1_epi32(x0));
          b[m] = _mm512_dpbusd_epi32(b[m], odd, _mm512_set1_epi32(x1));
        }
      }
      const P* p = params + (nb * groups + g) * 2 * kBlock;
      const __m512 scale = load_params(p);
      const __m512 zero = zero_of(scale, load_params(p + kBlock));
      for (int m = 0; m < M; ++m) {
        // sum((q - 8) a), exact
        const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(a[m], b[m]),
                                                 _mm512_set1_epi32(8 * qsum[m * groups + g]));
        const __m512 dots = _mm512_cvtepi32_ps(centred);
        const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(sx[m * groups + g]));
        acc[m] = _mm512_fmadd_ps(dots, row_scale, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), zero, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n + nb * kBlock),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

at::Tensor int4_matmul_q8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_low) {
  check_inputs<Q4_1>(x, w, scale_low);
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const RowsQ8 xq =
      quantize_rows(reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>()), rows, k);
  const auto* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  with_params(scale_low, [&](const auto* pp) {
    const int64_t block_bytes = groups * (Q4_1::kChunks * 32 + 2 * kBlock * sizeof(*pp));
    maskwire::over_rows_and_blocks(rows, blocks, block_bytes, 4, [&](auto m, int64_t row,
                                                                     int64_t b0, int64_t b1) {
      blocks_q8_for_rows<decltype(m)::value>(xq.q.data() + row * k, xq.scale.data() + row * groups,
                                             xq.sum.data() + row * groups,
                                             xq.qsum.data() + row * groups, k, wp, pp, b0, b1,
                                             op + row * n, n);
    });
  });
  return out;
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_low) {
  return matmul_bf16<Q4_1>(x, w, scale_low);
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return matmul_bf16<Q8_0>(x, w, scale);
}

// Sets the weight prefetch distance in groups (0: none) where `groups` >= 0; returns the one
// before.
int64_t set_weight_prefetch(int64_t groups) {
  return groups >= 0 ? weight_prefetch.exchange(groups) : weight_prefetch.load();
}

}  // namespace

TORCH_LIBRARY(maskwire_kernels, m) {
  m.def("int4_matmul(Tensor x, Tensor w, Tensor scale_low) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_matmul_q8(Tensor x, Tensor w, Tensor scale_low) -> Tensor");
  m.def("set_weight_prefetch(int groups) -> int");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CatchAll, m) {
  m.impl("set_weight_prefetch", &set_weight_prefetch);
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int4_matmul_q8", &int4_matmul_q8);
}
