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
#include <optional>
#include <source_location>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/elementwise.hpp"

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

/// The sizes of D = alpha op(A) op(B) + beta C where C is read apart from the D written
/// (gemm_out_of_place): check_gemm's of A, B and D, and C of D's shape and leading
/// dimension (cuBLASLt gives the two one layout). Every backend's checks with these messages.
namespace detail {
/// C of D's shape, unit column stride and leading dimension, or an error starting `what`.
template <class TC>
void check_c_like_d(const char* what, const TensorView<const TC>& c, const TensorView<TC>& d) {
  TESSERA_CHECK(c.rank() == 2 && c.rows() == d.rows() && c.cols() == d.cols() && (c.cols() <= 1 || c.stride(1) == 1) &&
                    c.ld() == d.ld(),
                what, ": C read apart from D needs D's shape and leading dimension: C ", c.rows(), "x", c.cols(),
                " (leading dimension ", c.ld(), "), D ", d.rows(), "x", d.cols(), " (", d.ld(), ")");
}
}  // namespace detail

template <class TA, class TB, class TC>
GemmSizes check_gemm_out_of_place(Trans ta, Trans tb, const TensorView<TA>& a, const TensorView<TB>& b,
                                  const TensorView<const TC>& c, const TensorView<TC>& d) {
  const GemmSizes s = check_gemm(ta, tb, a, b, d);
  detail::check_c_like_d("gemm", c, d);
  return s;
}


/// One operand of a float8 GEMM as a backend multiplies it: `rows` x `k` values of
/// `format` (float8_e4m3fn or float8_e5m2), row-major and contiguous, the GEMM's
/// reduction running along each row (cuBLASLt's "TN" layout, the only one its float8
/// matmul takes on Hopper), and the factors that bring them back: `inverse[0]` for every
/// row, or `inverse[r]` for row r when `per_row`.
struct Float8GemmOperand {
  const void* data = nullptr;
  DType format = DType::f8e4m3;
  std::int64_t rows = 0, k = 0;
  const float* inverse = nullptr;
  bool per_row = false;
};

/// The sizes of a float8 GEMM, C (a.rows x b.rows) = (a b^T) scaled, once its operands
/// are checked: formats, shapes that chain, scales alike (both per row or both single),
/// not both e5m2 (cuBLASLt multiplies e4m3 x e4m3, e4m3 x e5m2 and e5m2 x e4m3). Every
/// backend's gemm_float8 checks with these messages (`scales_alike` false: all but the
/// scales, for a caller that spreads a single scale itself).
template <class C>
GemmSizes check_float8_gemm(const Float8GemmOperand& a, const Float8GemmOperand& b, const TensorView<C>& c,
                            bool scales_alike = true) {
  auto float8 = [](DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; };
  TESSERA_CHECK(float8(a.format) && float8(b.format), "gemm_float8: operands of ", name_of(a.format), " and ",
                name_of(b.format), " (float8_e4m3fn or float8_e5m2 expected)");
  TESSERA_CHECK(!(a.format == DType::f8e5m2 && b.format == DType::f8e5m2),
                "gemm_float8: both operands float8_e5m2 (one must be float8_e4m3fn)");
  TESSERA_CHECK(c.rank() == 2 && (c.cols() <= 1 || c.stride(1) == 1),
                "gemm_float8: C must be rank 2 with unit column stride");
  TESSERA_CHECK(a.k == b.k && c.rows() == a.rows && c.cols() == b.rows, "gemm_float8: shapes do not chain: A ",
                a.rows, "x", a.k, ", B ", b.rows, "x", b.k, " (used transposed), C ", c.rows(), "x", c.cols());
  TESSERA_CHECK(!scales_alike || a.per_row == b.per_row, "gemm_float8: one operand scaled by row and the other by one scale");
  return {a.rows, b.rows, a.k};
}

/// A float8 GEMM's C read apart from the D it writes (`d`, already checked against the
/// operands): of D's shape and leading dimension. Every backend's checks with this message.
template <class C>
void check_float8_gemm_input(const TensorView<const C>& c, const TensorView<C>& d) {
  detail::check_c_like_d("gemm_float8", c, d);
}

/// Whether B multiplies float8 operands itself: B::gemm_float8(a, b, beta, c,
/// fast_accumulation) sets C = (a b^T) * a.inverse[.] * b.inverse[.] + beta C, C of
/// bfloat16 or float32 (the CUDA backend through cuBLASLt's float8 matmul; the dry run).
/// A backend without it runs float8 GEMMs emulated (nn/float8.hpp).
template <class B>
concept HasFloat8Gemm = requires(const Float8GemmOperand& a, TensorView<float> c) {
  B::gemm_float8(a, a, 0.0f, c, false);
};

/// Whether B's float8 GEMM also reads C apart from the D it writes:
/// B::gemm_float8(a, b, beta, c, d, fast_accumulation), D = (a b^T) scaled + beta C
/// (cuBLASLt's out-of-place matmul; the dry run).
template <class B>
concept HasOutOfPlaceFloat8Gemm = requires(const Float8GemmOperand& a, TensorView<const float> c, TensorView<float> d) {
  B::gemm_float8(a, a, 0.0f, c, d, false);
};

/// Whether B's gemm reads C apart from the D it writes: B::gemm(ta, tb, alpha, a, b, beta,
/// c, d) sets D = alpha op(A) op(B) + beta C in one pass, C unchanged (cuBLASLt's C and D;
/// the CPU backend's). What a layer uses to add a residual in its GEMM (nn::Linear::forward_adding).
template <class B>
concept HasOutOfPlaceGemm = requires(TensorView<const float> a, TensorView<float> d) {
  B::gemm(Trans::no, Trans::yes, 1.0f, a, a, 1.0f, a, d);
};

/// Whether B's attention takes keys before its queries (AttentionShape::past: a KV cache's,
/// for decoding: layer/kv_cache.hpp), which it says by declaring `static constexpr bool
/// attention_takes_past_keys = true` (the CPU backend's). Elsewhere nn::generate runs the
/// whole window again for each token.
template <class B>
inline constexpr bool attends_past_keys = requires { requires B::attention_takes_past_keys; };

/// Whether B can mark a point of its work for the host to wait on alone: B::fence()
/// gives a B::Fence (movable) whose wait() returns once the work B was given before the
/// fence is done, while what came after it may still run (a GPU's event on its stream).
template <class B>
concept HasFences = requires(typename B::Fence& f) {
  { B::fence() } -> std::same_as<typename B::Fence>;
  f.wait();
};

namespace detail {
template <class B>
struct fence_type {
  struct None {};
  using type = None;
};
template <HasFences B>
struct fence_type<B> {
  using type = typename B::Fence;
};
}  // namespace detail

/// A point of B's work the host may wait for (FenceOf<B>::now()): B's own fence where it
/// has them, else a wait for all of B's work (B::synchronize(): on a backend whose work
/// is done when it returns, nothing).
template <Backend B>
class FenceOf {
 public:
  FenceOf() = default;
  /// Marks the end of the work B was given so far.
  static FenceOf now() {
    FenceOf f;
    if constexpr (HasFences<B>) f.fence_.emplace(B::fence());
    f.set_ = true;
    return f;
  }
  /// Waits for the marked point; again, or for a fence never set, nothing.
  void wait() {
    if (!std::exchange(set_, false)) return;
    if constexpr (HasFences<B>) {
      fence_->wait();
      fence_.reset();
    } else {
      B::synchronize();
    }
  }
  bool set() const { return set_; }

 private:
  std::optional<typename detail::fence_type<B>::type> fence_;
  bool set_ = false;
};

/// d += beta c, the C of a GEMM read apart from the D it writes, added after the product
/// was written to D (by a backend without an out-of-place GEMM): C and D of one shape,
/// contiguous. `what` names the GEMM in the error.
namespace detail {
/// D (and so C, of its layout) contiguous, as add_scaled needs them, or an error starting `what`.
template <class C>
void check_addable(const TensorView<C>& d, std::string_view what) {
  TESSERA_CHECK(d.rows() <= 1 || d.ld() == d.cols(), what,
                ": C read apart from D is added after the product here, which needs C and D contiguous");
}
}  // namespace detail

template <Backend B, class C>
void add_scaled(accum_t<C> beta, TensorView<const C> c, TensorView<C> d, std::string_view what) {
  detail::check_addable(d, what);
  B::for_each(d.rows() * d.cols(), ops::Axpy<C>{beta, c.data(), d.data()});
}

/// D = alpha op(A) op(B) + beta C, C read apart from D (check_gemm_out_of_place): B's own
/// where it has one (HasOutOfPlaceGemm: one pass), else B's gemm writing the product into
/// D and a pass adding beta C (C and D contiguous there). Either way the product is
/// rounded to D's type before beta C is added, as cuBLASLt does with a bf16 C.
template <Backend B, class T, class C>
void gemm_out_of_place(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                       accum_t<T> beta, TensorView<const C> c, TensorView<C> d) {
  if constexpr (HasOutOfPlaceGemm<B>) {
    B::gemm(ta, tb, alpha, a, b, beta, c, d);
  } else {
    check_gemm_out_of_place(ta, tb, a, b, c, d);
    if (c.data() == d.data()) {
      B::gemm(ta, tb, alpha, a, b, beta, d);
      return;
    }
    detail::check_addable(d, "gemm_out_of_place");
    B::gemm(ta, tb, alpha, a, b, accum_t<T>(0), d);
    if (beta != accum_t<T>(0)) add_scaled<B>(static_cast<accum_t<C>>(beta), c, d, "gemm_out_of_place");
  }
}

}  // namespace tessera
