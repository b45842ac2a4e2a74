// What the weight-only matmul kernels (`matmul_bf16.cpp`, `matmul_f32.cpp`) share: passes of up
// to kMaxRows rows over the weights, each pass split into blocks of output channels over torch's
// intra-op threads, and a row count turned into the template argument of each kernel's block
// function (its accumulators live in registers). Each kernel supplies the arithmetic of a block.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace maskwire {

constexpr int64_t kMaxRows = 8;  // rows per pass over the weights

// `call(std::integral_constant<int, M>{})` for M == m (1 <= m <= kMaxRows).
template <int M = 1, class Call>
inline void with_rows(int64_t m, Call&& call) {
  if constexpr (M < kMaxRows) {
    if (m != M) return with_rows<M + 1>(m, call);
  }
  call(std::integral_constant<int, M>{});
}

// For each pass of up to kMaxRows rows starting at `row`: `blocks_fn(rows_in_pass, row, b0, b1)`
// over output channel blocks [b0, b1) on the intra-op threads, `grain` blocks at least per task.
template <class BlocksFn>
void over_rows_and_blocks(int64_t rows, int64_t blocks, int64_t grain, BlocksFn&& blocks_fn) {
  for (int64_t row = 0; row < rows; row += kMaxRows) {
    const int64_t m = std::min(kMaxRows, rows - row);
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      with_rows(m, [&](auto rows_in_pass) { blocks_fn(rows_in_pass, row, b0, b1); });
    });
  }
}

}  // namespace maskwire
