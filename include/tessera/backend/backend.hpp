// The backend concept: where tensors live, how GEMMs run, how per-row and
// per-element functors are launched.
//
// Layers are written against a Backend type parameter. They build functors from
// ops/ (plain structs of pointers and sizes with a TESSERA_HD call operator) and
// hand them to the backend: the CPU backend loops over them on every core, the CUDA
// backend launches them as kernels. GEMMs are row-major with explicit transposes.
//
// Memory a backend allocates (B::empty, B::zeros) is its own: host code never reads
// or writes it directly. Values cross between the host and the backend only through
// B::copy_to_host and B::copy_from_host (upload() and download() below wrap them for
// whole tensors); on the CPU backend they are plain copies, on the CUDA backend
// cudaMemcpy. tests/support/guarded_cpu.hpp is a CPU backend whose memory faults when
// host code touches it outside a backend call: the test that proves the model keeps
// this rule without a GPU.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

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
                           detail::IndexFunctorProbe f, const float* src, float* dst) {
  { B::device } -> std::convertible_to<Device>;
  { B::template empty<float>(Shape{}) } -> std::same_as<Tensor<float>>;
  { B::template zeros<float>(Shape{}) } -> std::same_as<Tensor<float>>;
  B::gemm(Trans::no, Trans::yes, 1.0f, a, a, 0.0f, c);
  B::for_each(n, f);
  B::copy_to_host(src, dst, n);    // n elements, backend memory -> host memory
  B::copy_from_host(src, dst, n);  // n elements, host memory -> backend memory
  B::synchronize();
};

/// A tensor in B's memory holding `host`'s elements (`host` itself when B's memory is
/// the host's and `host` already lives there).
template <Backend B, class T>
Tensor<T> upload(const Tensor<T>& host) {
  if (host.empty() || host.device() == B::device) return host;
  Tensor<T> t = B::template empty<T>(host.shape());
  B::copy_from_host(host.data(), t.data(), host.numel());
  return t;
}

/// A rank-1 tensor in B's memory holding a copy of host elements (token ids, targets).
template <Backend B, class T>
Tensor<T> upload(std::span<const T> host) {
  Tensor<T> t = B::template empty<T>(Shape{static_cast<std::int64_t>(host.size())});
  B::copy_from_host(host.data(), t.data(), t.numel());
  return t;
}

/// A host tensor holding the elements of `t`, which lives in B's memory (`t` itself
/// when that is host memory).
template <Backend B, class T>
Tensor<T> download(const Tensor<T>& t) {
  if (t.empty() || t.device() == Device::cpu) return t;
  Tensor<T> host(t.shape(), Uninitialized{});
  B::copy_to_host(t.data(), host.data(), t.numel());
  return host;
}

/// One element of B's memory, read on the host.
template <Backend B, class T>
T read_one(const T* p) {
  T v{};
  B::copy_to_host(p, &v, 1);
  return v;
}

}  // namespace tessera
