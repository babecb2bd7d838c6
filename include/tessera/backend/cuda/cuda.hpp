// The CUDA backend: device tensors from a caching allocator, ops/ functors launched as
// kernels, cuBLASLt GEMMs and flash attention, all on one compute stream.
//
// It mirrors the CPU backend (backend/cpu/cpu.hpp) member for member, so a layer
// written against a Backend runs on either. What differs:
//
// - Memory. empty() and zeros() return tensors in device memory on the calling thread's
//   current device, from that device's caching allocator (memory.hpp); host code never
//   dereferences them. Values cross with copy_to_host() and copy_from_host() (and
//   upload() / download() in backend.hpp). A zero-size tensor allocates nothing.
// - Ordering. Every launch, GEMM, memset and copy goes to stream(), the device's compute
//   stream (cuda::compute_stream(), memory.hpp): work runs in issue order, asynchronously
//   to the host, and the NCCL engine orders its collectives against this same stream
//   (comm/nccl.hpp). Calls return
//   before the device has finished, except copy_to_host(), which returns when the host
//   may read the destination (it synchronises the stream). copy_from_host() returns
//   when the host may reuse the source without waiting for the device: the bytes go
//   through a pinned staging ring and the copy runs in stream order (memory.hpp).
//   synchronize() waits for all of it.
// - GEMMs are cuBLASLt's (gemm.hpp): float in exact fp32 (no TF32) and bf16 with fp32
//   accumulation; the operand checks and messages are the CPU backend's.
// - Attention is the flash-attention kernels' (flash_attention.cuh), for float and bf16
//   tensors; the log-sum-exp is accum_t<T> (fp32) in both cases, as on the CPU backend.
//   bf16 attention runs on the engine a program installed instead, when it installed
//   one (attention_engine.hpp: cuDNN's fused SDPA, cudnn_attention.hpp). Decoding after
//   a KV cache's keys (AttentionShape::past) always runs on the flash kernels.
// - Errors. Every CUDA and cuBLASLt return code is checked and throws a tessera::Error
//   naming the call. The first use of the backend where no device is visible throws
//   "CUDA backend: no CUDA device is visible (...)". A kernel's own failure surfaces at
//   the next checked call that waits for it (a copy or synchronize()).
// - Virtual ranks. memory_access() is how SelfEngine and ThreadEngine move and reduce
//   the backend's buffers (reduce.hpp), so several thread ranks train on one GPU.
// - Kernels. This header is host C++: it declares the kernels it launches
//   (kernels.hpp) and g++ compiles it. Their definitions are CUDA: a .cu file includes
//   tessera/backend/cuda/cuda.cuh to get them (kernels.hpp says how a program compiles
//   them once).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/backend/cuda/graph.hpp"
#include "tessera/backend/cuda/attention_engine.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/gemm.hpp"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/backend/cuda/reduce.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/flash_attention.hpp"
#include "tessera/ops/ragged_documents.hpp"

namespace tessera {

namespace cuda {
struct PinnedHost;
}

struct Cuda {
  static constexpr Device device = Device::cuda;
  /// Its host backend (backend/host.hpp): page-locked host memory, the CPU's loops
  /// (pinned_host.hpp).
  using Host = cuda::PinnedHost;

  /// The stream all of the backend's work runs on (memory.hpp says why it is this one).
  static cudaStream_t stream() { return cuda::compute_stream(); }

  /// A memory snapshot's parts (profiling.enable_memory_snapshot, io/memory_snapshot.hpp):
  /// the current device's allocator records its history from now on; what it holds now;
  /// the device's index. A graph capture's private pool (training.cuda_graph) is apart.
  static void record_memory_history(std::size_t max_entries) { cuda::device_allocator().record_history(max_entries); }
  static const MemoryHistory* memory_history() { return cuda::device_allocator().history(); }
  static AllocatorState memory_state() { return cuda::device_allocator().state(); }
  static int memory_device() { return cuda::current_device(); }

  /// A device tensor the caller fills completely before reading it (not zeroed).
  template <class T>
  static Tensor<T> empty(Shape shape) {
    cuda::require_device();
    const auto n = static_cast<std::size_t>(shape.numel());
    if (n == 0) return Tensor<T>(shape, cuda::device_buffer<T>(0));
    // The request is named only when it fails: building the name on every call would
    // cost more than handing out a cached block.
    try {
      return Tensor<T>(shape, cuda::device_buffer<T>(n));
    } catch (const Error& e) {
      fail_like(e, e.what(), " (for Cuda::empty<", cuda::detail::element_name<T>(), ">", shape.str(), ")");
    }
  }

  /// A device tensor of zeros (set on the compute stream).
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    Tensor<T> t = empty<T>(shape);
    if (t.numel() > 0) TESSERA_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.bytes(), stream()));
    return t;
  }

  /// Calls f(i) for i in [0, n) on the device: the functor's own kernel where
  /// row_kernels.cuh lowers F (rows per warp or block, vector loads), else one index
  /// per thread.
  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    cuda::require_device();
    cuda::launch_op(n, f, stream());
  }

  /// A stretch of the compute stream's work captured once and replayed (cuda/graph.hpp).
  using Graph = cuda::Graph;

  /// Captures the work `body` issues as a graph, nothing of it run until the first
  /// replay. A host transfer or synchronisation inside `body` is an error; an error
  /// thrown by `body` abandons the capture.
  template <class F>
  static Graph capture(F&& body) {
    cuda::require_device();
    return cuda::capture(stream(), cuda::current_device(), std::forward<F>(body));
  }

  /// A point of the compute stream's work (an event recorded there): wait() returns once
  /// everything issued before it has finished, whatever was issued after (HasFences).
  class Fence {
   public:
    Fence() = default;
    Fence(Fence&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
    Fence& operator=(Fence&& o) noexcept {
      if (this != &o) {
        destroy();
        event_ = std::exchange(o.event_, nullptr);
      }
      return *this;
    }
    Fence(const Fence&) = delete;
    Fence& operator=(const Fence&) = delete;
    ~Fence() { destroy(); }

    /// Waits for the stream to reach the fence (at once for a fence moved from).
    void wait() {
      if (event_ != nullptr) TESSERA_CUDA_CHECK(cudaEventSynchronize(event_));
    }

   private:
    friend struct Cuda;
    void destroy() noexcept {
      if (event_ != nullptr) (void)cudaEventDestroy(event_);  // from destructors: nothing to report
      event_ = nullptr;
    }
    cudaEvent_t event_ = nullptr;
  };

  /// A fence at the end of the work issued to the compute stream so far.
  static Fence fence() {
    cuda::require_device();
    outside_capture("a fence for the host");
    Fence f;
    TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&f.event_, cudaEventDisableTiming));
    TESSERA_CUDA_CHECK(cudaEventRecord(f.event_, stream()));
    return f;
  }

  /// Waits until every piece of work issued to the compute stream has finished.
  static void synchronize() {
    cuda::require_device();
    outside_capture("a synchronisation");
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }

  /// The current device's memory in all (cudaMemGetInfo's total), what layers size their
  /// working sets from (backend.hpp: device_memory_bytes).
  static std::size_t device_memory_bytes() {
    cuda::require_device();
    std::size_t free = 0, total = 0;
    TESSERA_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return total;
  }

  /// n elements from device memory to host memory; the host may read dst on return.
  template <class T>
  static void copy_to_host(const T* src, T* dst, std::int64_t n) {
    cuda::require_device();
    outside_capture("a copy to the host");
    if (n <= 0) return;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(static_cast<void*>(dst), static_cast<const void*>(src),
                                       static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, stream()));
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream()));
  }

  /// Page-locks `bytes` of host memory at `p` (cudaHostRegister, portable: every
  /// device's copies see it so), for host buffers kept across uses
  /// (train::sharded::HostBuffers): a device-to-host copy into it runs at the bus's
  /// rate, not through the driver's pageable bounce buffer. unpin_host(p) before the
  /// memory is freed.
  static void pin_host(void* p, std::size_t bytes) {
    cuda::require_device();
    TESSERA_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
  }
  /// Undoes pin_host; called from destructors, so it reports nothing.
  static void unpin_host(void* p) noexcept { (void)cudaHostUnregister(p); }

  /// n elements from host memory to device memory; the host may reuse src on return.
  /// The copy is staged in pinned memory and runs in stream order: no synchronisation.
  template <class T>
  static void copy_from_host(const T* src, T* dst, std::int64_t n) {
    cuda::require_device();
    outside_capture("a copy from the host");
    if (n <= 0) return;
    cuda::copy_from_host_staged(static_cast<void*>(dst), static_cast<const void*>(src),
                                static_cast<std::size_t>(n) * sizeof(T), stream());
  }

  /// n elements from page-locked host memory (its host backend's, backend/host.hpp) to
  /// device memory, in stream order, straight from `src` (no staging, no
  /// synchronisation): the host must not change src before the stream has passed the copy.
  template <class T>
  static void copy_from_pinned(const T* src, T* dst, std::int64_t n) {
    cuda::require_device();
    outside_capture("a copy from offloaded host memory");
    if (n <= 0) return;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(static_cast<void*>(dst), static_cast<const void*>(src),
                                       static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyHostToDevice, stream()));
  }
  /// n elements from device memory to page-locked host memory, in stream order, without
  /// a synchronisation: dst holds them once synchronize() returns.
  template <class T>
  static void copy_to_pinned(const T* src, T* dst, std::int64_t n) {
    cuda::require_device();
    outside_capture("a copy to offloaded host memory");
    if (n <= 0) return;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(static_cast<void*>(dst), static_cast<const void*>(src),
                                       static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, stream()));
  }

  /// C = alpha * op(A) * op(B) + beta * C, row-major; each operand is a rank-2 view
  /// with unit column stride (its leading dimension may exceed its width). T is float
  /// or bf16; C is T, or float from bf16 operands (fp32 weight gradients and logits).
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<C> c) {
    const GemmSizes s = check_gemm(ta, tb, a, b, c);
    // Its kernels named as llama-plan names the GEMM, for a device profile.
    const trace::Launching launching(
        trace::Gemm{s.m, s.n, s.k, ta, tb, dtype_of<T>(), dtype_of<C>(), beta != accum_t<T>(0)});
    cuda::gemm<T, C>(ta, tb, alpha, a, b, beta, c);
  }

  /// D = alpha * op(A) * op(B) + beta * C, C read apart from D (backend.hpp's
  /// HasOutOfPlaceGemm): cuBLASLt's C and D, one pass, a bf16 D rounded once.
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b,
                   accum_t<T> beta, TensorView<const C> c, TensorView<C> d) {
    const GemmSizes s = check_gemm_out_of_place(ta, tb, a, b, c, d);
    const trace::Launching launching(
        trace::Gemm{s.m, s.n, s.k, ta, tb, dtype_of<T>(), dtype_of<C>(), beta != accum_t<T>(0)});
    cuda::gemm<T, C>(ta, tb, alpha, a, b, beta, c, d);
  }

  /// C = (A B^T) scaled + beta C for float8 operands (backend.hpp's Float8GemmOperand),
  /// through cuBLASLt's float8 matmul (cuda/gemm.hpp); C bf16 or float.
  template <class C>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<C> c,
                          bool fast_accumulation) {
    const GemmSizes s = check_float8_gemm(a, b, c);
    const trace::Launching launching(
        trace::Gemm{s.m, s.n, s.k, Trans::no, Trans::yes, a.format, dtype_of<C>(), beta != 0.0f});
    cuda::gemm_float8<C>(a, b, beta, c, fast_accumulation);
  }
  /// The same, C read apart from the D written (of D's shape and leading dimension).
  template <class C>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<const C> c,
                          TensorView<C> d, bool fast_accumulation) {
    const GemmSizes s = check_float8_gemm(a, b, d);
    const trace::Launching launching(
        trace::Gemm{s.m, s.n, s.k, Trans::no, Trans::yes, a.format, dtype_of<C>(), beta != 0.0f});
    cuda::gemm_float8<C>(a, b, beta, c, d, fast_accumulation);
  }

  /// Grouped-query attention forward, causal or full (s.causal): o (B*T, H*hd) and lse
  /// (B, H, T) in accum_t<T> (float for float and bf16 tensors). bf16 runs on the
  /// installed attention engine when there is one (cuda::attention_engine()); over packed
  /// documents (s.documents) only when the engine takes them ragged and the call has its
  /// document table (whole sequences), else on the project's kernels, which mask any.
  /// Decoding after a KV cache's keys (s.past; attends_past_keys) runs on the project's
  /// kernels, each row's keys in runs merged at the end (cuda/flash_attention.cuh).
  static constexpr bool attention_takes_past_keys = true;
  template <class T>
  static void attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                  "tessera: Cuda attention supports float and bf16 tensors");
    cuda::require_device();
    const trace::Launching launching(trace::Attention{s, dtype_of<T>(), false});  // for a device profile
    if (s.past > 0) {
      // The runs' scratch; freed blocks are reused in stream order, so it may go back to
      // the allocator while the kernels still run.
      Tensor<float> scratch = empty<float>({ops::flash_split_scratch(s)});
      cuda::flash_attention_forward<T>(s, q, k, v, o, lse, stream(), scratch.data());
      return;
    }
    if constexpr (std::is_same_v<T, bf16>) {
      if (const cuda::AttentionEngine* engine = engine_for(s)) {
        const int device = cuda::current_device();
        CachingAllocator* allocator = &cuda::device_allocator(device);
        if (!s.documents) {
          engine->forward({s, q, k, v, o, lse, stream(), device, allocator});
          return;
        }
        const RaggedStage r = stage_ragged(s, {q.ld(), k.ld(), v.ld(), o.ld(), 0, 0, 0, 0, s.n_heads});
        engine->forward({s, q, k, v, o, lse, stream(), device, allocator, &r.call});
        for_each(s.rows() * s.n_heads, ops::StatsLayout{r.call.stats, lse, s.seq_len, s.n_heads, false});
        return;
      }
    }
    cuda::flash_attention_forward<T>(s, q, k, v, o, lse, stream());
  }

  /// Attention backward: dq, dk and dv overwritten.
  template <class T>
  static void attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                 TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                                 TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>,
                  "tessera: Cuda attention supports float and bf16 tensors");
    TESSERA_CHECK(s.past == 0, "Cuda attention backward: keys before the queries (a KV cache's) are for decoding "
                               "only");
    cuda::require_device();
    const trace::Launching launching(trace::Attention{s, dtype_of<T>(), true});  // for a device profile
    if constexpr (std::is_same_v<T, bf16>) {
      if (const cuda::AttentionEngine* engine = engine_for(s)) {
        const int device = cuda::current_device();
        CachingAllocator* allocator = &cuda::device_allocator(device);
        if (!s.documents) {
          engine->backward({s, q, k, v, o, lse, d_o, dq, dk, dv, stream(), device, allocator});
          return;
        }
        const RaggedStage r = stage_ragged(
            s, {q.ld(), k.ld(), v.ld(), o.ld(), d_o.ld(), dq.ld(), dk.ld(), dv.ld(), s.n_heads});
        for_each(s.rows() * s.n_heads, ops::StatsLayout{lse, r.call.stats, s.seq_len, s.n_heads, true});
        engine->backward({s, q, k, v, o, r.call.stats, d_o, dq, dk, dv, stream(), device, allocator, &r.call});
        return;
      }
    }
    // The key pass adds into dk and dv: start them from zero (operands checked first).
    ops::flash_check_backward<T>(s, q, k, v, o, d_o, dq, dk, dv);
    zero_rows(dk, s.rows(), s.n_kv_heads * s.head_dim);
    zero_rows(dv, s.rows(), s.n_kv_heads * s.head_dim);
    // (B, H, T) row sums of dO * O, the kernels' scratch; freed blocks are reused in
    // stream order, so it may go back to the allocator while the kernels still run.
    Tensor<float> delta = empty<float>({s.batch, s.n_heads, s.seq_len});
    cuda::flash_attention_backward<T>(s, q, k, v, o, lse, d_o, dq, dk, dv, delta.data(), stream());
  }

  /// How the in-process engines (comm::SelfEngine, comm::ThreadEngine through
  /// ThreadOptions::memory) move this backend's buffers: copies between any mix of
  /// device and host memory, reductions into device or host memory (host operands
  /// staged on the device), scratch from the caching allocator; all on stream(),
  /// finished when they return (reduce.hpp).
  static comm::MemoryAccess memory_access() {
    comm::MemoryAccess m;
    m.copy = [](void* dst, const void* src, std::size_t bytes) { cuda::copy_bytes(dst, src, bytes, stream()); };
    m.reduce = [](void* dst, const void* src, std::size_t n, comm::DataType t, comm::ReduceOp op) {
      cuda::reduce_into(dst, src, n, t, op, stream());
    };
    m.allocate = [](std::size_t bytes) -> void* {
      return cuda::device_allocator().allocate(bytes, "a collective's scratch on thread ranks");
    };
    m.release = [](void* p) { CachingAllocator::release_to_owner(p); };
    return m;
  }

 private:
  /// What a graph cannot hold: an error naming `what` while this thread captures
  /// (cuda/graph.hpp).
  static void outside_capture(const char* what) {
    TESSERA_CHECK(!cuda::capturing(), "CUDA backend: ", what,
                  " inside a graph capture: a graph replays the device's work, not the host's (stage values before "
                  "the captured work and read them after its replay)");
  }

  /// The installed attention engine for a bf16 call of shape `s`: none over packed
  /// documents unless it takes them ragged and the call carries its document table.
  static const cuda::AttentionEngine* engine_for(const AttentionShape& s) {
    const cuda::AttentionEngine* engine = cuda::attention_engine();
    if (engine != nullptr && s.documents != nullptr && !(engine->ragged && s.document_table != nullptr))
      return nullptr;
    return engine;
  }

  /// A call's packed documents in the ragged layout: offsets and lengths made from the
  /// document table on the stream (`scale`: each ops::RaggedTensor's leading dimension,
  /// the heads for the statistics), and the token-major statistics' scratch. The tensors
  /// go back to the allocator when it ends, reused in stream order after the call.
  struct RaggedStage {
    Tensor<std::int64_t> offsets;
    Tensor<std::int32_t> lengths;
    Tensor<float> stats;
    cuda::RaggedDocuments call;
  };
  static RaggedStage stage_ragged(const AttentionShape& s, const std::array<std::int64_t, ops::kRaggedTensors>& scale) {
    TESSERA_CHECK(s.document_slots > 0, "CUDA backend: ragged attention without a document table");
    RaggedStage r;
    const std::int64_t entries = s.batch * s.document_slots;
    r.offsets = empty<std::int64_t>(Shape{ops::kRaggedTensors * (entries + 1)});
    r.lengths = empty<std::int32_t>(Shape{entries});
    r.stats = empty<float>(Shape{s.rows(), s.n_heads});
    ops::RaggedOffsets f{s.document_table, entries, s.document_slots, s.seq_len};
    for (int t = 0; t < ops::kRaggedTensors; ++t) f.scale[t] = scale[static_cast<std::size_t>(t)];
    f.offsets = r.offsets.data();
    f.lengths = r.lengths.data();
    for_each(entries + 1, f);
    r.call = {entries, r.offsets.data(), r.lengths.data(), r.stats.data()};
    return r;
  }

  /// Sets the first `cols` columns of `rows` rows of m (leading dimension m.ld()) to zero.
  template <class T>
  static void zero_rows(TensorView<T> m, std::int64_t rows, std::int64_t cols) {
    if (rows <= 0 || cols <= 0 || m.data() == nullptr) return;
    TESSERA_CUDA_CHECK(cudaMemset2DAsync(m.data(), static_cast<std::size_t>(m.ld()) * sizeof(T), 0,
                                         static_cast<std::size_t>(cols) * sizeof(T), static_cast<std::size_t>(rows),
                                         stream()));
  }
};

static_assert(Backend<Cuda>, "tessera: Cuda must satisfy the Backend concept");
static_assert(HasFloat8Gemm<Cuda>, "tessera: Cuda must run float8 GEMMs");

}  // namespace tessera

// The host backend (its loops are the CPU backend's): complete wherever Cuda is, so that
// every translation unit, nvcc's too, sees the same classes that name it.
#include "tessera/backend/cuda/pinned_host.hpp"
