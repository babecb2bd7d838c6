// Traced<B>: backend B, with every call recorded into the trace of the Recording open on
// the calling thread (backend/trace.hpp), then made on B.
//
// It satisfies the Backend concept whenever B does, so any model runs on it unchanged:
// Traced<Cpu> trains for real and leaves a trace of what it did; Traced<Meta> (the dry
// run, backend/meta/meta.hpp) computes nothing and leaves the same trace. Outside a
// Recording it is B. What is recorded:
//   gemm                  m, n, k, transposes, operand and result dtypes, accumulation
//   gemm_float8           as gemm, the operands' dtype the first one's float8 format
//   attention_forward/backward   the AttentionShape and dtype
//   for_each(n, f)        the functor's name, n, its ops::Traffic (when F has traffic()),
//                         the CUDA kernel's where it differs (cuda_traffic()), and the
//                         kernel class Cuda::for_each would use for F; a functor that
//                         fuses others' passes (ops::FusesParts) as those functors,
//                         the fused kernel's traffic on them
//   zeros                 a fill of the tensor's bytes (empty records nothing: the
//                         allocation itself comes from the memory counters)
//   copy_to_host/from_host  the bytes, the library line that asked (upload, download), and
//                         whether the CUDA backend waits for the device (to the host only)
//   copy_to/from_pinned   as a transfer that does not wait (backend/host.hpp's copies)
//   synchronize
//   fence, and its wait   a trace::Fence and a trace::FenceWait of one id
// Traced<B::Host> (B's host backend, backend/host.hpp) records its loops as host work
// (trace::Kernel::on_host) and nothing else: its copies and fills stay in host memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera {

template <Backend B>
struct Traced;

namespace detail {
template <class B>
struct traced_host {
  using type = void;  // B names no host backend
};
template <class B>
  requires requires { typename B::Host; }
struct traced_host<B> {
  using type = Traced<typename B::Host>;
};
}  // namespace detail

template <Backend B>
struct Traced {
  using inner_type = B;
  static constexpr Device device = B::device;
  static constexpr bool runs_on_host = is_host_backend<B>;
  static constexpr bool attention_takes_past_keys = attends_past_keys<B>;
  using Host = typename detail::traced_host<B>::type;

  template <class T>
  static Tensor<T> empty(Shape shape) {
    return B::template empty<T>(shape);
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    if constexpr (!runs_on_host) trace::record(trace::Fill{shape.numel() * static_cast<std::int64_t>(sizeof(T))});
    return B::template zeros<T>(shape);
  }

  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    if (trace::current() && n > 0) {
      if constexpr (ops::FusesParts<F>) {
        f.parts(n, [](const auto& part, std::int64_t m, const ops::Traffic& cuda, bool own_launch) {
          if (m > 0) record_kernel(part, m, cuda, own_launch);
        });
      } else {
        std::optional<ops::Traffic> cuda;
        if constexpr (ops::HasCudaTraffic<F>) cuda = f.cuda_traffic(n);
        record_kernel(f, n, cuda);
      }
    }
    B::for_each(n, f);
  }

  template <class F>
  static void record_kernel(const F& f, std::int64_t n, std::optional<ops::Traffic> cuda, bool own_launch = true) {
    trace::Kernel k;
    k.functor = trace::functor_name<F>();
    k.n = n;
    k.own_launch = own_launch;
    if constexpr (ops::HasTraffic<F>) k.traffic = f.traffic(n);
    else k.priced = false;
    k.cuda_traffic = cuda;
    k.cuda_class = cuda_kernel_class<F>;
    k.on_host = runs_on_host;
    trace::record(k);
  }

  static void synchronize() {
    if constexpr (!runs_on_host) trace::record(trace::Synchronize{});
    B::synchronize();
  }

  /// B's fence (FenceOf<B>: its own, or a wait for all its work), recorded as a
  /// trace::Fence and its wait as a trace::FenceWait of the same id.
  class Fence {
   public:
    void wait() {
      if (!inner_.set()) return;
      trace::record(trace::FenceWait{id_});
      inner_.wait();
    }

   private:
    friend struct Traced;
    std::uint64_t id_ = 0;
    FenceOf<B> inner_;
  };
  static Fence fence() {
    static std::atomic<std::uint64_t> next{0};
    Fence f;
    f.id_ = ++next;
    trace::record(trace::Fence{f.id_});
    f.inner_ = FenceOf<B>::now();
    return f;
  }

  template <class T>
  static void copy_to_host(const T* src, T* dst, std::int64_t n) {
    if constexpr (!runs_on_host) record_transfer(n * static_cast<std::int64_t>(sizeof(T)), true, true);
    B::copy_to_host(src, dst, n);
  }
  template <class T>
  static void copy_from_host(const T* src, T* dst, std::int64_t n) {
    if constexpr (!runs_on_host) record_transfer(n * static_cast<std::int64_t>(sizeof(T)), false, false);
    B::copy_from_host(src, dst, n);
  }
  /// B's copies to and from its host backend's memory (backend/host.hpp), neither
  /// waiting for the device.
  template <class T>
  static void copy_from_pinned(const T* src, T* dst, std::int64_t n) {
    record_transfer(n * static_cast<std::int64_t>(sizeof(T)), false, false);
    copy_from_host_memory<B>(src, dst, n);
  }
  template <class T>
  static void copy_to_pinned(const T* src, T* dst, std::int64_t n) {
    record_transfer(n * static_cast<std::int64_t>(sizeof(T)), true, false);
    copy_to_host_memory<B>(src, dst, n);
  }

  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<C> c) {
    if (trace::current()) {
      const GemmSizes s = check_gemm(ta, tb, a, b, c);
      trace::record(trace::Gemm{s.m, s.n, s.k, ta, tb, dtype_of<T>(), dtype_of<C>(), beta != accum_t<T>(0)});
    }
    B::gemm(ta, tb, alpha, a, b, beta, c);
  }
  /// B's out-of-place GEMM, where B has one: recorded as the GEMM reading C (beta nonzero).
  template <class T, class C>
    requires HasOutOfPlaceGemm<B>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<const C> c, TensorView<C> d) {
    if (trace::current()) {
      const GemmSizes s = check_gemm_out_of_place(ta, tb, a, b, c, d);
      trace::record(trace::Gemm{s.m, s.n, s.k, ta, tb, dtype_of<T>(), dtype_of<C>(), beta != accum_t<T>(0)});
    }
    B::gemm(ta, tb, alpha, a, b, beta, c, d);
  }

  /// B's float8 GEMM, where B has one: recorded as a GEMM of float8 operands (A's
  /// format), in cuBLASLt's layout (op(A) = A, op(B) = B^T).
  template <class C>
    requires HasFloat8Gemm<B>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<C> c,
                          bool fast_accumulation) {
    if (trace::current()) {
      const GemmSizes s = check_float8_gemm(a, b, c);
      trace::record(trace::Gemm{s.m, s.n, s.k, Trans::no, Trans::yes, a.format, dtype_of<C>(), beta != 0.0f});
    }
    B::gemm_float8(a, b, beta, c, fast_accumulation);
  }
  /// B's out-of-place float8 GEMM, where B has one: recorded as the GEMM reading C.
  template <class C>
    requires HasOutOfPlaceFloat8Gemm<B>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<const C> c,
                          TensorView<C> d, bool fast_accumulation) {
    if (trace::current()) {
      const GemmSizes s = check_float8_gemm(a, b, d);
      trace::record(trace::Gemm{s.m, s.n, s.k, Trans::no, Trans::yes, a.format, dtype_of<C>(), beta != 0.0f});
    }
    B::gemm_float8(a, b, beta, c, d, fast_accumulation);
  }

  template <class T>
  static void attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
    trace::record(trace::Attention{s, dtype_of<T>(), false});
    B::attention_forward(s, q, k, v, o, lse);
  }

  template <class T>
  static void attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                 TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                                 TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
    trace::record(trace::Attention{s, dtype_of<T>(), true});
    B::attention_backward(s, q, k, v, o, lse, d_o, dq, dk, dv);
  }

  /// How in-process engines move this backend's buffers: B's way.
  static std::size_t device_memory_bytes() { return tessera::device_memory_bytes<B>(); }

  static comm::MemoryAccess memory_access()
    requires requires { B::memory_access(); }
  {
    return B::memory_access();
  }

 private:
  static void record_transfer(std::int64_t bytes, bool to_host, bool synchronizes) {
    if (!trace::current()) return;
    trace::Transfer t{bytes, to_host, "", 0, synchronizes};
    if (const std::source_location* site = detail::transfer_site) {
      t.file = site->file_name();
      t.line = site->line();
    }
    trace::record(t);
  }
};

}  // namespace tessera
