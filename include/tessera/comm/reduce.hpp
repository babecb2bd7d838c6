// Element-wise reduction of one buffer into another, for the engines that reduce on
// the host (thread ranks, and the single rank).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "tessera/comm/engine.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

namespace detail {
/// bf16: each element widened to fp32, combined, and rounded once.
inline void reduce_typed(bf16* dst, const bf16* src, std::size_t n, ReduceOp op) {
  for (std::size_t i = 0; i < n; ++i) {
    const float a = static_cast<float>(dst[i]), b = static_cast<float>(src[i]);
    switch (op) {
      case ReduceOp::sum: dst[i] = bf16(a + b); break;
      case ReduceOp::max: dst[i] = bf16(std::max(a, b)); break;
      case ReduceOp::min: dst[i] = bf16(std::min(a, b)); break;
    }
  }
}

template <class T>
void reduce_typed(T* dst, const T* src, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) dst[i] = std::min(dst[i], src[i]);
      break;
  }
}
}  // namespace detail

/// Refuses element types that have no reduction.
inline void check_reducible(DataType t) {
  TESSERA_CHECK(t != DataType::u8 && t != DataType::u16, "reduction over ", name_of(t),
                " elements is not supported: reduce f32, f64, bf16, i32 or i64");
}

/// dst[i] = op(dst[i], src[i]) for n elements of type t.
inline void reduce_into(void* dst, const void* src, std::size_t n, DataType t, ReduceOp op) {
  switch (t) {
    case DataType::f32: detail::reduce_typed(static_cast<float*>(dst), static_cast<const float*>(src), n, op); return;
    case DataType::f64: detail::reduce_typed(static_cast<double*>(dst), static_cast<const double*>(src), n, op); return;
    case DataType::i32:
      detail::reduce_typed(static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n, op);
      return;
    case DataType::i64:
      detail::reduce_typed(static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n, op);
      return;
    case DataType::bf16: detail::reduce_typed(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n, op); return;
    case DataType::u8:
    case DataType::u16: break;
  }
  fail("reduction over ", name_of(t), " elements is not supported: reduce f32, f64, bf16, i32 or i64");
}

}  // namespace tessera::comm
