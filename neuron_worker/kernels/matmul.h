// What the weight-only matmul kernels (`matmul_bf16.cpp`, `matmul_f32.cpp`) share: blocks of
// output channels split over torch's intra-op threads, passes of up to kMaxRows rows over each
// tile of a task's blocks, and a row count turned into the template argument of each kernel's
// block function (its accumulators live in registers). Each kernel supplies the arithmetic of a
// block.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace maskwire {

constexpr int64_t kMaxRows = 8;  // rows per pass over the weights
// Weights a tile's row passes share: the first pass reads them from memory, the next ones find
// them in the core's cache (L2 on every x86 core this runs on holds it with the rows' inputs).
constexpr int64_t kTileBytes = 64 * 1024;

// A pass's rows quantized per group of 32 inputs to int8 with one fp32 scale each (llama.cpp's
// Q8 activations), as the 8-bit-activation kernels take them.
struct RowsQ8 {
  std::vector<int8_t> q;      // [rows, k], each 4 inputs in the order the kernel's weights take
  std::vector<float> scale;   // [rows, k / 32]
  std::vector<float> sum;     // [rows, k / 32]: sums of the exact inputs
  std::vector<int32_t> qsum;  // [rows, k / 32]: sums of the int8 values
};

// `call(std::integral_constant<int, M>{})` for M == m (1 <= m <= kMaxRows).
template <int M = 1, class Call>
inline void with_rows(int64_t m, Call&& call) {
  if constexpr (M < kMaxRows) {
    if (m != M) return with_rows<M + 1>(m, call);
  }
  call(std::integral_constant<int, M>{});
}

// `blocks_fn(rows_in_pass, row, b0, b1)` for output channel blocks [b0, b1) and the pass of up to
// kMaxRows rows starting at `row`: the blocks split over the intra-op threads (`grain` blocks at
// least per task, `block_bytes` of weights each), each task's blocks in tiles of kTileBytes, every
// row pass over a tile before the next tile. So a pass of more than kMaxRows rows (a draft
// verification at c8: 8 rows x 5 positions) reads weights too large for the cache from memory
// once, not once per pass of rows: SmolLM2's Q8_0 LM head (30 MB), 40 rows 8.3 -> 6.7 ms and 24
// rows 5.3 -> 4.4 ms on 2 AVX512-BF16 cores (its projections, a thread's share of each already
// in L2, unchanged). The rows' sums are the same either way.
template <class BlocksFn>
void over_rows_and_blocks(int64_t rows, int64_t blocks, int64_t block_bytes, int64_t grain,
                          BlocksFn&& blocks_fn) {
  // One pass of rows (a decode step) takes a task's blocks in one call: tiles measured 10-15%
  // slower there.
  const int64_t tile = std::max<int64_t>(1, rows <= kMaxRows ? blocks : kTileBytes / block_bytes);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = b0; t0 < b1; t0 += tile) {
      const int64_t t1 = std::min(b1, t0 + tile);
      for (int64_t row = 0; row < rows; row += kMaxRows) {
        const int64_t m = std::min(kMaxRows, rows - row);
        with_rows(m, [&](auto rows_in_pass) { blocks_fn(rows_in_pass, row, t0, t1); });
      }
    }
  });
}

}  // namespace maskwire
