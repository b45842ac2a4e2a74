// 4- and 8-bit weights x bf16 activations for passes of a few rows, on AVX512-BF16 CPUs.
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
// (16 channels x 2 inputs). Then per block and group: 16 scales and 16 zeros (fp32).
//
// Q8_0 (`int8_matmul`, the embedded model's tied LM head as its GGUF stores it): w = scale * q,
// q in -128..127, widened through fp32 to bf16 (exact: 8 significant bits). Per group of 32
// inputs: y += scale * sum(q x). Weight layout (`neuron_worker.kernels.pack_int8`): for each
// block of 16 output channels and each group of 32 inputs, 16 chunks of 32 bytes; byte i of
// chunk j holds weight (channel i / 2, input 2j + i % 2): one `vdpbf16ps` operand. Then per block
// and group 16 scales (fp32).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output channels per register
constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int64_t kChunks = kGroup / 4;
constexpr int64_t kMaxRows = 8;  // rows per pass over the weights (accumulators in registers)

// Lane q (0..15) holds bf16(q - 8): the lookup table for a nibble.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int q = 0; q < 32; ++q) {
    const float f = static_cast<float>((q & 15) - 8);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[q] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(t);
}

// Output channel blocks [nb_begin, nb_end) for M rows of x (bf16 [M, k], group sums xsum).
template <int M>
void blocks_for_rows(const uint16_t* x, const float* xsum, int64_t k, const uint8_t* w,
                     const float* scale_zero, int64_t nb_begin, int64_t nb_end, uint16_t* out,
                     int64_t n) {
  const int64_t groups = k / kGroup;
  const __m512i table = nibble_table();
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + (nb * groups + g) * kChunks * 32;
      __m512 dot[M], dot_hi[M];
      for (int m = 0; m < M; ++m) dot[m] = dot_hi[m] = _mm512_setzero_ps();
      for (int64_t j = 0; j < kChunks; ++j) {
        const __m512i wide =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 32)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(wide, nibble), table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
        const int64_t at = g * kGroup + 4 * j;
        for (int m = 0; m < M; ++m) {
          int32_t pair_lo, pair_hi;  // inputs (at, at + 1) and (at + 2, at + 3) of row m
          std::memcpy(&pair_lo, x + m * k + at, 4);
          std::memcpy(&pair_hi, x + m * k + at + 2, 4);
          dot[m] = _mm512_dpbf16_ps(dot[m], lo, (__m512bh)_mm512_set1_epi32(pair_lo));
          dot_hi[m] = _mm512_dpbf16_ps(dot_hi[m], hi, (__m512bh)_mm512_set1_epi32(pair_hi));
        }
      }
      const float* sz = scale_zero + (nb * groups + g) * 2 * kBlock;
      const __m512 scale = _mm512_loadu_ps(sz);
      const __m512 zero = _mm512_loadu_ps(sz + kBlock);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(dot[m], dot_hi[m]), scale, acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), zero, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n + nb * kBlock),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

using BlocksFn = void (*)(const uint16_t*, const float*, int64_t, const uint8_t*, const float*,
                          int64_t, int64_t, uint16_t*, int64_t);
constexpr BlocksFn kForRows[kMaxRows + 1] = {
    nullptr,            blocks_for_rows<1>, blocks_for_rows<2>, blocks_for_rows<3>,
    blocks_for_rows<4>, blocks_for_rows<5>, blocks_for_rows<6>, blocks_for_rows<7>,
    blocks_for_rows<8>};

// x: bf16 [rows, K]; w: uint8 [N/16, K/32, 8, 32]; scale_zero: fp32 [N/16, K/32, 2, 16].
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [rows, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kByte && w.size(2) == kChunks &&
                  w.size(3) == 32 && w.is_contiguous(),
              "w: contiguous uint8 [N/16, K/32, 8, 32]");
  TORCH_CHECK(scale_zero.scalar_type() == at::kFloat && scale_zero.is_contiguous() &&
                  scale_zero.sizes() == at::IntArrayRef({w.size(0), w.size(1), 2, kBlock}),
              "scale_zero: contiguous fp32 [N/16, K/32, 2, 16]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " inputs, the weight ", groups * kGroup);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>());
  // Group sums of x for the zeros: sum_i w_i x_i = scale * sum (q - 8) x + zero * sum x.
  // A bf16 value is the top half of its fp32 value: 32 of them are 16 even + 16 odd fp32 lanes.
  std::vector<float> xsum(rows * groups);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < rows * groups; ++i) {
    const __m512i v = _mm512_loadu_si512(xp + i * kGroup);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
    xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  }
  const auto* wp = w.const_data_ptr<uint8_t>();
  const auto* szp = scale_zero.const_data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  for (int64_t row = 0; row < rows; row += kMaxRows) {
    const BlocksFn fn = kForRows[std::min(kMaxRows, rows - row)];
    // Grain 4 blocks (64 channels): even the smallest projection runs on every thread.
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      fn(xp + row * k, xsum.data() + row * groups, k, wp, szp, b0, b1, op + row * n, n);
    });
  }
  return out;
}

// Chunk j of a Q8_0 group as one bf16 operand (16 channels x inputs 2j, 2j + 1), exact.
inline __m512bh q8_operand(const uint8_t* group, int64_t j) {
  const auto* p = reinterpret_cast<const __m128i*>(group + j * 32);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0..15 from lo
}

// Q8_0 output channel blocks [nb_begin, nb_end) for M rows of x (bf16 [M, k]). A group's sum is
// two chains per row (even and odd chunks, added at the group's end): one chain of 16 dependent
// `vdpbf16ps` would leave a single row waiting on their latency. The same order for every M, so
// a row's result does not depend on how many rows share the pass.
template <int M>
void q8_blocks_for_rows(const uint16_t* x, int64_t k, const uint8_t* w, const float* scales,
                        int64_t nb_begin, int64_t nb_end, uint16_t* out, int64_t n) {
  constexpr int64_t kChunks8 = kGroup / 2;
  const int64_t groups = k / kGroup;
  for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* wg = w + (nb * groups + g) * kChunks8 * 32;
      __m512 even[M], odd[M];
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int64_t j = 0; j < kChunks8; j += 2) {
        const __m512bh a = q8_operand(wg, j);
        const __m512bh b = q8_operand(wg, j + 1);
        const int64_t at = g * kGroup + 2 * j;
        for (int m = 0; m < M; ++m) {
          int32_t pair_a, pair_b;  // inputs (at, at + 1) and (at + 2, at + 3) of row m
          std::memcpy(&pair_a, x + m * k + at, 4);
          std::memcpy(&pair_b, x + m * k + at + 2, 4);
          even[m] = _mm512_dpbf16_ps(even[m], a, (__m512bh)_mm512_set1_epi32(pair_a));
          odd[m] = _mm512_dpbf16_ps(odd[m], b, (__m512bh)_mm512_set1_epi32(pair_b));
        }
      }
      const __m512 scale = _mm512_loadu_ps(scales + (nb * groups + g) * kBlock);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_add_ps(even[m], odd[m]), scale, acc[m]);
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * n + nb * kBlock),
                          (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

using Q8BlocksFn = void (*)(const uint16_t*, int64_t, const uint8_t*, const float*, int64_t,
                            int64_t, uint16_t*, int64_t);
constexpr Q8BlocksFn kQ8ForRows[kMaxRows + 1] = {
    nullptr,               q8_blocks_for_rows<1>, q8_blocks_for_rows<2>, q8_blocks_for_rows<3>,
    q8_blocks_for_rows<4>, q8_blocks_for_rows<5>, q8_blocks_for_rows<6>, q8_blocks_for_rows<7>,
    q8_blocks_for_rows<8>};

// x: bf16 [rows, K]; w: int8 [N/16, K/32, 16, 32]; scale: fp32 [N/16, K/32, 16].
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bf16 [rows, K]");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.size(2) == kGroup / 2 &&
                  w.size(3) == 32 && w.is_contiguous(),
              "w: contiguous int8 [N/16, K/32, 16, 32]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.sizes() == at::IntArrayRef({w.size(0), w.size(1), kBlock}),
              "scale: contiguous fp32 [N/16, K/32, 16]");
  const int64_t rows = x.size(0), k = x.size(1), blocks = w.size(0), groups = w.size(1);
  TORCH_CHECK(groups * kGroup == k, "x has ", k, " inputs, the weight ", groups * kGroup);
  const int64_t n = blocks * kBlock;
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint8_t*>(w.const_data_ptr<int8_t>());
  const auto* sp = scale.const_data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  for (int64_t row = 0; row < rows; row += kMaxRows) {
    const Q8BlocksFn fn = kQ8ForRows[std::min(kMaxRows, rows - row)];
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      fn(xp + row * k, k, wp, sp, b0, b1, op + row * n, n);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(maskwire_kernels, m) {
  m.def("int4_matmul(Tensor x, Tensor w, Tensor scale_zero) -> Tensor");
  m.def("int8_matmul(Tensor x, Tensor w, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(maskwire_kernels, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int8_matmul", &int8_matmul);
}
