// The CPU backend: OpenBLAS GEMMs and OpenMP loops over the ops/ functors.
//
// OpenBLAS is the OpenMP build (Debian's libopenblas0-openmp), so GEMMs called from
// inside a parallel region run single-threaded on their thread and GEMMs called
// outside use every core, with no oversubscription. Loops use a static schedule, so
// every reduction happens in the same order on every run: results are bitwise
// reproducible for a given thread count.
#pragma once

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/cpu/attention.hpp"
#include "tessera/backend/cpu/device_memory.hpp"
#include "tessera/backend/cpu/graph.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/host_sync.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera {

namespace cpu {
struct HostSide;
}

struct Cpu {
  static constexpr Device device = Device::cpu;
  /// Its host backend (backend/host.hpp): host pages beside the ones it counts as its device's.
  using Host = cpu::HostSide;

  /// A tensor the caller fills completely before reading it (not zeroed): host pages
  /// recorded as the backend's (cpu/device_memory.hpp), so a check can tell them from a
  /// host variable the way a GPU would.
  template <class T>
  static Tensor<T> empty(Shape shape) {
    const auto n = static_cast<std::size_t>(shape.numel());
    if (n == 0) return Tensor<T>(shape, Uninitialized{});
    T* p = static_cast<T*>(cpu::DeviceMemory::instance().allocate(n * sizeof(T)));
    return Tensor<T>(shape, Buffer<T>(p, n, Device::cpu, &cpu::DeviceMemory::release));
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    Tensor<T> t = empty<T>(shape);
    if (t.numel() == 0) return t;
    void* p = static_cast<void*>(t.data());
    const auto bytes = static_cast<std::size_t>(t.numel()) * sizeof(T);
    if (cpu::Capture* c = cpu::capturing())
      c->ops.push_back(cpu::RecordedOp::call([p, bytes] { std::memset(p, 0, bytes); }));
    else
      std::memset(p, 0, bytes);
    return t;
  }

  /// A memory snapshot's parts (profiling.enable_memory_snapshot, io/memory_snapshot.hpp):
  /// this thread's device (its rank's) records its history from now on; what it holds
  /// now, each tensor a segment of its own (cpu/device_memory.hpp); the device's index.
  static void record_memory_history(std::size_t max_entries) {
    cpu::DeviceMemory::instance().record_history(max_entries);
  }
  static const MemoryHistory* memory_history() { return cpu::DeviceMemory::instance().history(); }
  static AllocatorState memory_state() { return cpu::DeviceMemory::instance().state(); }
  static int memory_device() { return 0; }

  /// A stretch of the backend's work recorded once and replayed (cpu/graph.hpp).
  using Graph = cpu::Graph;

  /// Runs `body` with every launch, GEMM, attention call and zero fill it issues recorded
  /// and not run, and returns them as a graph to replay; nothing ran until the first
  /// replay, as with a captured CUDA graph. A host transfer or synchronisation inside
  /// `body` is an error; an error thrown by `body` abandons the capture.
  template <class F>
  static Graph capture(F&& body) {
    TESSERA_CHECK(cpu::capturing() == nullptr, "CPU backend: a graph capture inside a graph capture");
    cpu::Capture c;
    cpu::detail::capture = &c;
    try {
      body();
    } catch (...) {
      cpu::detail::capture = nullptr;
      throw;
    }
    cpu::detail::capture = nullptr;
    return std::move(c).finish();
  }

  /// How the in-process engines reach this backend's memory: the host's copies and
  /// reductions, and where() telling the backend's tensors from host memory (what the
  /// NCCL-rules check asks, comm/nccl_rules.hpp).
  static comm::MemoryAccess memory_access() {
    comm::MemoryAccess m;
    m.where = [](const void* p, std::size_t bytes) { return cpu::DeviceMemory::instance().where(p, bytes); };
    return m;
  }

  static int threads() { return omp_get_max_threads(); }

  /// The kernel family OpenBLAS chose for this CPU ("Haswell", "SkylakeX", ...). An old
  /// OpenBLAS falls back to "Prescott" (SSE3) on CPUs newer than it knows;
  /// OPENBLAS_CORETYPE=SkylakeX (or Haswell) in the environment overrides the choice.
  static const char* blas_kernels() { return openblas_get_corename(); }

  /// Below this many indices a loop runs on the calling thread: waking the team
  /// costs more than tiny loops gain, and hurts badly when cores are shared.
  static constexpr std::int64_t kMinParallel = 16;

  /// Calls f(i) for i in [0, n) on every core, in a fixed partition.
  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    if (n <= 0) return;
    if (cpu::Capture* c = cpu::capturing()) {
      static_assert(std::is_trivially_copyable_v<F>, "tessera: a launched functor is a trivially copyable struct");
      c->ops.push_back(cpu::RecordedOp::launch(&replay<F>, n, &f, sizeof(F)));
      return;
    }
    if constexpr (ops::FusesParts<F>) {  // each part its own loop, evenly spread (the parts in order)
      f.parts(n, [](const auto& part, std::int64_t m, const ops::Traffic&, bool) { for_each(m, part); });
    } else {
      each_index(n, f);
    }
  }

 private:
  /// for_each's loop for a functor of single indices (or ranges of them).
  template <class F>
  static void each_index(std::int64_t n, const F& f) {
    if constexpr (ops::RunsRanges<F>) {  // each thread its contiguous share, in one call
      if (n < kMinParallel || omp_in_parallel()) {
        f.range(0, n);
        return;
      }
#pragma omp parallel
      {
        const auto t = static_cast<std::int64_t>(omp_get_thread_num());
        const auto threads = static_cast<std::int64_t>(omp_get_num_threads());
        f.range(n * t / threads, n * (t + 1) / threads);
      }
      return;
    }
    if (n < kMinParallel || omp_in_parallel()) {
      for (std::int64_t i = 0; i < n; ++i) f(i);
      return;
    }
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }

 public:
  /// The host's work is done when each call returns; what is left are the waits an
  /// engine deferred to the host's next synchronisation (core/host_sync.hpp).
  static void synchronize() {
    outside_capture("a synchronisation");
    detail::run_deferred_host_waits();
  }

  /// Host transfers are copies: the CPU backend's memory is the host's. A copy to the
  /// host synchronises, as on a GPU.
  template <class T>
  static void copy_to_host(const T* src, T* dst, std::int64_t n) {
    outside_capture("a copy to the host");
    detail::run_deferred_host_waits();
    if (n > 0 && src != dst)
      std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), static_cast<std::size_t>(n) * sizeof(T));
  }
  template <class T>
  static void copy_from_host(const T* src, T* dst, std::int64_t n) {
    outside_capture("a copy from the host");
    if (n > 0 && src != dst)
      std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), static_cast<std::size_t>(n) * sizeof(T));
  }

  /// C = alpha * op(A) * op(B) + beta * C, row-major; each operand is a rank-2 view
  /// with unit column stride (its leading dimension may exceed its width). T is float
  /// or double (OpenBLAS), or bf16: its operands are widened to float, the product runs
  /// in float, and C is either bf16 (rounded once) or float (a weight gradient
  /// accumulated in fp32). C is T or accum_t<T>.
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<C> c) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                  "tessera: Cpu::gemm supports float, double and bf16");
    static_assert(std::is_same_v<C, T> || std::is_same_v<C, accum_t<T>>,
                  "tessera: Cpu::gemm writes C as its operands' type or their accumulation type");
    const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
    if (m == 0 || n == 0) return;
    if (cpu::Capture* cap = cpu::capturing()) {
      cap->ops.push_back(cpu::RecordedOp::call([=] { gemm<T, C>(ta, tb, alpha, a, b, beta, c); }));
      return;
    }
    if (k == 0) {
      scale_matrix(beta, c);
      return;
    }
    if constexpr (std::is_same_v<T, bf16>) {
      const Tensor<float> wa = widen(a), wb = widen(b);
      if constexpr (std::is_same_v<C, float>) {
        gemm(ta, tb, alpha, wa.cview(), wb.cview(), beta, c);
      } else {
        Tensor<float> wc(Shape{m, n});  // zeros: beta == 0 ignores what C held, NaN included
        if (beta != 0.0f)
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) wc.view()(i, j) = static_cast<float>(c(i, j));
        gemm(ta, tb, alpha, wa.cview(), wb.cview(), beta, wc.view());
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) c(i, j) = bf16(wc.cview()(i, j));
      }
    } else {
      auto lda = static_cast<blasint>(std::max<std::int64_t>(a.ld(), std::max<std::int64_t>(a.cols(), 1)));
      auto ldb = static_cast<blasint>(std::max<std::int64_t>(b.ld(), std::max<std::int64_t>(b.cols(), 1)));
      auto ldc = static_cast<blasint>(std::max<std::int64_t>(c.ld(), std::max<std::int64_t>(c.cols(), 1)));
      auto t = [](Trans x) { return x == Trans::no ? CblasNoTrans : CblasTrans; };
      if (m == 1) {  // one row of C (a decoded token's): op(B)'s product with a vector, read once, nothing packed
        gemv_row(tb, alpha, a.data(), ta == Trans::no ? 1 : lda, b.data(), ldb, n, k, beta, c.data());
        return;
      }
      if constexpr (std::is_same_v<T, float>) {
        cblas_sgemm(CblasRowMajor, t(ta), t(tb), static_cast<blasint>(m), static_cast<blasint>(n),
                    static_cast<blasint>(k), alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
      } else {
        cblas_dgemm(CblasRowMajor, t(ta), t(tb), static_cast<blasint>(m), static_cast<blasint>(n),
                    static_cast<blasint>(k), alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
      }
    }
  }

  /// The one row c (n) = alpha x op(B) + beta c, x the k values of op(A)'s row `incx` apart,
  /// B row-major with leading dimension ldb: (n, k) when tb is yes, (k, n) when no. With
  /// beta 0 the row is zeroed first (what c held, NaN included, is not read: as gemm).
  template <class T>
  static void gemv_row(Trans tb, T alpha, const T* x, blasint incx, const T* b, blasint ldb, std::int64_t n,
                       std::int64_t k, T beta, T* c) {
    if (beta == T(0)) std::fill(c, c + n, T(0));
    const auto rows = static_cast<blasint>(tb == Trans::yes ? n : k);
    const auto cols = static_cast<blasint>(tb == Trans::yes ? k : n);
    const auto trans = tb == Trans::yes ? CblasNoTrans : CblasTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemv(CblasRowMajor, trans, rows, cols, alpha, b, ldb, x, incx, beta, c, 1);
    else
      cblas_dgemv(CblasRowMajor, trans, rows, cols, alpha, b, ldb, x, incx, beta, c, 1);
  }

  /// D = alpha * op(A) * op(B) + beta * C, C read apart from D (backend.hpp's
  /// HasOutOfPlaceGemm), of D's shape and leading dimension, C unchanged. As cuBLASLt
  /// rounds it: the product rounded to D's type as the gemm above writes it, then beta C
  /// added and the sum rounded again (with a bf16 C the GPU's results match that to the
  /// bit: tests/gpu/test_gpu_backend.cpp's product_term). So a residual added here is
  /// bitwise the product followed by ops::Add.
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<const C> c, TensorView<C> d) {
    const auto [m, n, k] = check_gemm_out_of_place(ta, tb, a, b, c, d);
    if (c.data() == d.data()) {
      gemm(ta, tb, alpha, a, b, beta, d);
      return;
    }
    if (m == 0 || n == 0) return;
    if (cpu::Capture* cap = cpu::capturing()) {
      cap->ops.push_back(cpu::RecordedOp::call([=] { gemm<T, C>(ta, tb, alpha, a, b, beta, c, d); }));
      return;
    }
    gemm(ta, tb, alpha, a, b, accum_t<T>(0), d);
    if (beta == accum_t<T>(0)) return;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j)
        d(i, j) = from_accum<C>(to_accum(d(i, j)) + beta * to_accum(c(i, j)));
  }

  /// Grouped-query attention forward, causal or full (s.causal): o (B*T, H*hd) and lse (B, H, T).
  /// Takes the keys of a KV cache before the queries (s.past; attends_past_keys).
  static constexpr bool attention_takes_past_keys = true;
  template <class T>
  static void attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
    if (cpu::Capture* c = cpu::capturing()) {
      c->ops.push_back(cpu::RecordedOp::call([=] { detail::cpu_attention_forward<Cpu>(s, q, k, v, o, lse); }));
      return;
    }
    detail::cpu_attention_forward<Cpu>(s, q, k, v, o, lse);
  }

  /// Attention backward: dq, dk and dv overwritten.
  template <class T>
  static void attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                 TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                                 TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
    if (cpu::Capture* c = cpu::capturing()) {
      c->ops.push_back(
          cpu::RecordedOp::call([=] { detail::cpu_attention_backward<Cpu>(s, q, k, v, o, lse, d_o, dq, dk, dv); }));
      return;
    }
    detail::cpu_attention_backward<Cpu>(s, q, k, v, o, lse, d_o, dq, dk, dv);
  }

 private:
  /// A recorded launch, run again (cpu/graph.hpp).
  template <class F>
  static void replay(std::int64_t n, const void* f) {
    for_each(n, *static_cast<const F*>(f));
  }

  /// What a graph cannot hold: an error naming `what` while this thread captures.
  static void outside_capture(const char* what) {
    TESSERA_CHECK(cpu::capturing() == nullptr, "CPU backend: ", what,
                  " inside a graph capture: a graph replays the backend's work, not the host's (stage values before "
                  "the captured work and read them after its replay)");
  }

  template <class C, class S>
  static void scale_matrix(S beta, TensorView<C> c) {
    for (std::int64_t i = 0; i < c.rows(); ++i)
      for (std::int64_t j = 0; j < c.cols(); ++j)
        c(i, j) = beta == S(0) ? C(S(0)) : C(beta * static_cast<S>(c(i, j)));
  }

  /// A contiguous float copy of a bf16 operand.
  static Tensor<float> widen(TensorView<const bf16> v) {
    Tensor<float> w(Shape{v.rows(), v.cols()}, Uninitialized{});
    for (std::int64_t i = 0; i < v.rows(); ++i)
      for (std::int64_t j = 0; j < v.cols(); ++j) w.view()(i, j) = static_cast<float>(v(i, j));
    return w;
  }
};

static_assert(Backend<Cpu>, "tessera: Cpu must satisfy the Backend concept");

namespace cpu {
/// A host backend (backend/host.hpp) over host memory from `Pages` (static
/// allocate(bytes) -> void*, failing as out of memory; static release(void*)): the CPU
/// backend's loops and GEMMs, its tensors counted as Device::host, not as a device's.
/// `Self` is the backend type itself (its own host backend).
template <class Self, class Pages>
struct HostMemory : Cpu {
  static constexpr Device device = Device::host;
  static constexpr bool runs_on_host = true;
  using Host = Self;

  template <class T>
  static Tensor<T> empty(Shape shape) {
    const std::int64_t n = shape.numel();
    if (n == 0) return Tensor<T>(shape, Buffer<T>());
    void* p = Pages::allocate(static_cast<std::size_t>(n) * sizeof(T));
    return Tensor<T>(shape, Buffer<T>(static_cast<T*>(p), static_cast<std::size_t>(n), Device::host, &Pages::release));
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    Tensor<T> t = empty<T>(shape);
    if (t.numel() > 0) std::memset(static_cast<void*>(t.data()), 0, static_cast<std::size_t>(t.numel()) * sizeof(T));
    return t;
  }
};

/// Plain host pages, 64-byte aligned.
struct PlainPages {
  static void* allocate(std::size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) fail_out_of_memory("out of host memory allocating ", bytes, " bytes to offload");
    return p;
  }
  static void release(void* p) { std::free(p); }
};

/// The host backend of the CPU backend and of backends like it: plain host pages, apart
/// from the ones the CPU backend counts as its device's (cpu::DeviceMemory). What an
/// offloaded shard lives in on the CPU.
struct HostSide : HostMemory<HostSide, PlainPages> {};
}  // namespace cpu

static_assert(Backend<cpu::HostSide>, "tessera: cpu::HostSide must satisfy the Backend concept");
static_assert(is_host_backend<cpu::HostSide> && !is_host_backend<Cpu>);

}  // namespace tessera
