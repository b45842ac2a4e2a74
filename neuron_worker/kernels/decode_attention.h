// What the decode attention kernels (`decode_attention.cpp` for bf16, `decode_attention_f32.cpp`
// for fp32) share: the checks on their inputs, which positions each query row attends, and the
// split of the work into (row, KV head) tasks over torch's intra-op threads. Each kernel supplies
// the arithmetic for one task.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace maskwire {

// One (row, KV head) task: `rows` query rows of `dim` values (q, out), the row's slot of K and V
// (positions `pos_stride` apart), and for each query row the last position it attends (`last`,
// all < span). `scratch` is the calling thread's, reused from task to task.
template <class T>
struct HeadTask {
  const T* q;
  const T* k;
  const T* v;
  int64_t pos_stride;
  const int64_t* last;
  int64_t rows;
  int64_t dim;
  int64_t span;
  float scale;  // 1 / sqrt(dim), as SDPA's default
  T* out;
  std::vector<float>& scratch;
};

// q: [B, H, R, D] of `type`, query row r of row b at token r % T; k, v: [slots, H, L, D] of
// `type` (views of the cache; the last dimension contiguous); slots: int64 [B]; pos: int64
// [B, T]. Query (b, r) attends positions 0..pos[b, r % T] of slot slots[b]; a position outside
// [0, L) is a padding token's (negative, or the scratch position past the cache) and attends
// position 0 only, as the masked path's padding does, so padding rows cost one position, not L.
// `attend(HeadTask<T>&)` computes one (b, KV head).
template <class T, class Attend>
at::Tensor attend_slots(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& slots, const at::Tensor& pos, at::ScalarType type,
                        Attend attend) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == type, "q: ", type, " [B, H, R, D]");
  TORCH_CHECK(k.dim() == 4 && k.scalar_type() == type && k.sizes() == v.sizes() &&
                  k.strides() == v.strides() && k.stride(3) == 1,
              "k, v: ", type, " [slots, H, L, D] with the same strides, D contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t length = k.size(2);
  TORCH_CHECK(k.size(1) == heads && k.size(3) == dim, "q and k disagree on heads or head size");
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "head size must be 32, 64 or 128");
  TORCH_CHECK(length > 0, "k, v: no positions");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch,
              "slots: int64 [B]");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.dim() == 2 && pos.size(0) == batch &&
                  pos.size(1) > 0 && rows % pos.size(1) == 0,
              "pos: int64 [B, T] with R a multiple of T");
  const int64_t tokens = pos.size(1);
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), pc = pos.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  const T* qp = qc.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const int64_t* slot_of = sc.const_data_ptr<int64_t>();
  const int64_t* pos_of = pc.const_data_ptr<int64_t>();
  T* op = out.mutable_data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(slot_of[b] >= 0 && slot_of[b] < k.size(0), "slot ", slot_of[b], " out of range");
  const int64_t slot_stride = k.stride(0), head_stride = k.stride(1), pos_stride = k.stride(2);
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<int64_t> last(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / heads, h = task % heads;
      const int64_t base = slot_of[b] * slot_stride + h * head_stride;
      int64_t span = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t p = pos_of[b * tokens + r % tokens];
        last[r] = p >= 0 && p < length ? p : 0;
        span = std::max(span, last[r] + 1);
      }
      const int64_t offset = task * rows * dim;
      HeadTask<T> t{qp + offset, kp + base, vp + base, pos_stride, last.data(), rows, dim,
                    span,        scale,      op + offset, scratch};
      attend(t);
    }
  });
  return out;
}

}  // namespace maskwire
