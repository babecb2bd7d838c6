// The backend concept: where tensors live, how GEMMs run, how per-row and
// per-element functors are launched.
//
// Layers are written against a Backend type parameter. They build functors from
// ops/ (plain structs of pointers and sizes with a TESSERA_HD call operator) and
// hand them to the backend: the CPU backend loops over them on every core, the CUDA
// backend launches them as kernels. GEMMs are row-major with explicit transposes.
#pragma once

#include <concepts>
#include <cstdint>

#include "tessera/core/memory.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

/// Whether a GEMM operand is used as stored or transposed.
enum class Trans : std::uint8_t { no, yes };

namespace detail {
/// A functor of one index, the shape every launchable op has.
struct IndexFunctorProbe {
  void operator()(std::int64_t) const {}
};
}  // namespace detail

template <class B>
concept Backend = requires(std::int64_t n, TensorView<const float> a, TensorView<float> c,
                           detail::IndexFunctorProbe f) {
  { B::device } -> std::convertible_to<Device>;
  { B::template empty<float>(Shape{}) } -> std::same_as<Tensor<float>>;
  { B::template zeros<float>(Shape{}) } -> std::same_as<Tensor<float>>;
  B::gemm(Trans::no, Trans::yes, 1.0f, a, a, 0.0f, c);
  B::for_each(n, f);
  B::synchronize();
};

}  // namespace tessera
