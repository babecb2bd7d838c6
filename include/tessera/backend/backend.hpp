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
// cudaMemcpyAsync (a copy to the host synchronises the stream; a copy from the host is
// staged in pinned memory and does not). tests/support/guarded_cpu.hpp is a CPU backend whose memory faults when
// host code touches it outside a backend call: the test that proves the model keeps
// this rule without a GPU.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <source_location>
#include <span>

#include "tessera/core/error.hpp"
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

namespace detail {
/// The library line that asked for the host transfer now under way on this thread (set
/// by upload, download and read_one for the duration of the copy): a dry run's trace
/// names each place the host reads device values, each a synchronisation on a GPU.
inline thread_local const std::source_location* transfer_site = nullptr;

class TransferSite {
 public:
  explicit TransferSite(const std::source_location& site) : previous_(transfer_site) { transfer_site = &site; }
  ~TransferSite() { transfer_site = previous_; }
  TransferSite(const TransferSite&) = delete;
  TransferSite& operator=(const TransferSite&) = delete;

 private:
  const std::source_location* previous_;
};
}  // namespace detail

/// A tensor in B's memory holding `host`'s elements (`host` itself when B's memory is
/// the host's and `host` already lives there).
template <Backend B, class T>
Tensor<T> upload(const Tensor<T>& host, const std::source_location& site = std::source_location::current()) {
  if (host.empty() || host.device() == B::device) return host;
  Tensor<T> t = B::template empty<T>(host.shape());
  detail::TransferSite at(site);
  B::copy_from_host(host.data(), t.data(), host.numel());
  return t;
}

/// A rank-1 tensor in B's memory holding a copy of host elements (token ids, targets).
template <Backend B, class T>
Tensor<T> upload(std::span<const T> host, const std::source_location& site = std::source_location::current()) {
  Tensor<T> t = B::template empty<T>(Shape{static_cast<std::int64_t>(host.size())});
  detail::TransferSite at(site);
  B::copy_from_host(host.data(), t.data(), t.numel());
  return t;
}

/// `host`'s elements in `t`, in B's memory: copied into `t` itself when `keep` and it has
/// their count (its address unchanged, as a replayed graph needs), else into a new tensor.
template <Backend B, class T>
void upload_into(Tensor<T>& t, std::span<const T> host, bool keep,
                 const std::source_location& site = std::source_location::current()) {
  if (!keep || t.numel() != static_cast<std::int64_t>(host.size())) {
    t = upload<B>(host, site);
    return;
  }
  detail::TransferSite at(site);
  B::copy_from_host(host.data(), t.data(), t.numel());
}

/// A host tensor holding the elements of `t`, which lives in B's memory (`t` itself
/// when that is host memory).
template <Backend B, class T>
Tensor<T> download(const Tensor<T>& t, const std::source_location& site = std::source_location::current()) {
  if (t.empty() || t.device() == Device::cpu) return t;
  Tensor<T> host(t.shape(), Uninitialized{});
  detail::TransferSite at(site);
  B::copy_to_host(t.data(), host.data(), t.numel());
  return host;
}

/// One element of B's memory, read on the host.
template <Backend B, class T>
T read_one(const T* p, const std::source_location& site = std::source_location::current()) {
  T v{};
  detail::TransferSite at(site);
  B::copy_to_host(p, &v, 1);
  return v;
}

/// Bytes of memory the device B's tensors live on has in all (cudaMemGetInfo's total on
/// a GPU, the machine profile's capacity on a dry run), or 0 where B's memory is the
/// host's or B does not say: what layers size their working sets from, so that the same
/// model takes GPU-sized steps on a GPU and cache-sized steps on a CPU.
template <Backend B>
std::size_t device_memory_bytes() {
  if constexpr (requires { { B::device_memory_bytes() } -> std::convertible_to<std::size_t>; })
    return B::device_memory_bytes();
  else
    return 0;
}

/// The sizes of C = op(A) op(B) (m, n, k), once the operands are checked: rank 2, shapes
/// that chain, unit column stride. Every backend's gemm checks with these messages.
struct GemmSizes {
  std::int64_t m, n, k;
};
template <class TA, class TB, class TC>
GemmSizes check_gemm(Trans ta, Trans tb, const TensorView<TA>& a, const TensorView<TB>& b, const TensorView<TC>& c) {
  TESSERA_CHECK(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "gemm: operands must be rank 2");
  const std::int64_t m = c.rows(), n = c.cols();
  const std::int64_t k = ta == Trans::no ? a.cols() : a.rows();
  const std::int64_t am = ta == Trans::no ? a.rows() : a.cols();
  const std::int64_t bk = tb == Trans::no ? b.rows() : b.cols();
  const std::int64_t bn = tb == Trans::no ? b.cols() : b.rows();
  TESSERA_CHECK(am == m && bk == k && bn == n, "gemm: shapes do not chain: op(A) ", am, "x", k, ", op(B) ", bk, "x", bn,
                ", C ", m, "x", n);
  TESSERA_CHECK((a.cols() <= 1 || a.stride(1) == 1) && (b.cols() <= 1 || b.stride(1) == 1) &&
                    (c.cols() <= 1 || c.stride(1) == 1),
                "gemm: operands need unit column stride");
  return {m, n, k};
}

}  // namespace tessera
