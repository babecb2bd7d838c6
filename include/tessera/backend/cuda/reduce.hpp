// Moving and reducing rank buffers on a CUDA device for the in-process engines: what
// Cuda::memory_access() (cuda.hpp) hands to SelfEngine and ThreadEngine, so several
// virtual ranks (threads) share one GPU. comm/memory_access.hpp says what the engines
// ask of it; comm/reduce.hpp is the host reduction this one mirrors.
//
// Memory. A rank buffer is device memory (a tensor of the CUDA backend) or host memory
// (a value reduced across ranks on the host, such as a loss sum; a thread engine's
// parcel). cudaPointerGetAttributes tells which: device and managed memory is read by
// the kernel where it lies; host memory, registered or not, is staged through scratch
// from the device's caching allocator (memory.hpp). Device memory must be on the
// calling thread's current device: virtual ranks share one GPU.
//
// Order. Everything runs on the compute stream (memory.hpp), behind the kernels that
// wrote the buffers, and returns only when the stream has finished it: the engines
// treat copy and reduce as done when they return (another rank's thread reads the
// result next, and host results are read by the host).
//
// Arithmetic. dst[i] = op(dst[i], src[i]) with the host reduction's expressions (a + b;
// std::max's a < b ? b : a; std::min's b < a ? b : a), one element per thread, so a
// sum over ranks added in rank order (as ThreadEngine adds them) is the host's sum,
// bit for bit. f32, f64, bf16 (in fp32, rounded once), i32 and i64 reduce; u8 and u16 are refused by name, as the
// host reduction refuses them. Every CUDA call is checked and throws a tessera::Error
// naming the call.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/comm/engine.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"

namespace tessera::cuda {

namespace detail {

/// dst[i] = op(dst[i], src[i]), both in device memory.
template <class T>
struct ReduceInto {
  T* dst;
  const T* src;
  comm::ReduceOp op;

  TESSERA_HD void operator()(std::int64_t i) const {
    // bf16 is combined in fp32 and rounded once, as the host reduction does.
    const accum_t<T> a = to_accum(dst[i]), b = to_accum(src[i]);
    switch (op) {
      case comm::ReduceOp::sum: dst[i] = from_accum<T>(a + b); break;
      case comm::ReduceOp::max: dst[i] = from_accum<T>(a < b ? b : a); break;
      case comm::ReduceOp::min: dst[i] = from_accum<T>(b < a ? b : a); break;
    }
  }
};

/// Scratch bytes from the current device's caching allocator, given back when the
/// scope ends (blocks are reused in stream order, so work still reading it is safe).
class DeviceScratch {
 public:
  DeviceScratch(std::size_t bytes, const char* what) : p_(device_allocator().allocate(bytes, what)) {}
  ~DeviceScratch() {
    try {
      CachingAllocator::release_to_owner(p_);
    } catch (...) {  // a block this scope allocated always has an owner; a destructor cannot report
    }
  }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  void* data() const { return p_; }

 private:
  void* p_;
};

/// Whether a kernel on the current device reads `p` where it lies (device or managed
/// memory) rather than through a staged copy (host memory). Device memory of another
/// device is an error naming `what`.
inline bool device_resident(const void* p, const char* what) {
  cudaPointerAttributes attr{};
  const cudaError_t status = cudaPointerGetAttributes(&attr, p);
  if (status != cudaSuccess)
    fail("cudaPointerGetAttributes(", p, ") for the ", what, ": ", cudaGetErrorName(status), ": ",
         cudaGetErrorString(status));
  switch (attr.type) {
    case cudaMemoryTypeDevice: {
      const int current = current_device();
      TESSERA_CHECK(attr.device == current, "CUDA memory access: the ", what, " at ", p, " is memory of cuda:",
                    attr.device, ", but this thread runs on cuda:", current,
                    " (the ranks of an in-process engine share one device)");
      return true;
    }
    case cudaMemoryTypeManaged: return true;
    case cudaMemoryTypeHost:
    case cudaMemoryTypeUnregistered: return false;
  }
  fail("cudaPointerGetAttributes(", p, ") for the ", what, ": unknown memory type ", static_cast<int>(attr.type));
}

/// Launches dst[i] = op(dst[i], src[i]) over n elements of T in device memory.
template <class T>
void launch_reduce_typed(void* dst, const void* src, std::int64_t n, comm::ReduceOp op, cudaStream_t stream) {
  tessera::cuda::launch_op(n, ReduceInto<T>{static_cast<T*>(dst), static_cast<const T*>(src), op}, stream);
}

/// Launches dst[i] = op(dst[i], src[i]) on device memory for element type `t`.
inline void launch_reduce(void* dst, const void* src, std::size_t n, comm::DataType t, comm::ReduceOp op,
                          cudaStream_t stream) {
  TESSERA_CHECK(n <= static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()),
                "CUDA memory access: reduction of ", n, " elements is too long");
  const auto count = static_cast<std::int64_t>(n);
  switch (t) {
    case comm::DataType::f32: return launch_reduce_typed<float>(dst, src, count, op, stream);
    case comm::DataType::f64: return launch_reduce_typed<double>(dst, src, count, op, stream);
    case comm::DataType::i32: return launch_reduce_typed<std::int32_t>(dst, src, count, op, stream);
    case comm::DataType::i64: return launch_reduce_typed<std::int64_t>(dst, src, count, op, stream);
    case comm::DataType::bf16: return launch_reduce_typed<bf16>(dst, src, count, op, stream);
    case comm::DataType::u8:
    case comm::DataType::u16: break;
  }
  comm::check_reducible(t);
  fail("reduction over ", comm::name_of(t), " elements is not supported: reduce f32, f64, bf16, i32 or i64");
}

}  // namespace detail

/// `bytes` bytes from src to dst, each device or host memory (unified addressing lets
/// one cudaMemcpyDefault serve every pair), on `stream`; returns when the copy is done.
/// Ranges that overlap without being the same go through device scratch.
inline void copy_bytes(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0 || dst == src) return;
  require_device();
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) {
    detail::DeviceScratch scratch(bytes, "an overlapping copy between rank buffers");
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(scratch.data(), src, bytes, cudaMemcpyDefault, stream));
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, scratch.data(), bytes, cudaMemcpyDefault, stream));
  } else {
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  }
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

/// dst[i] = op(dst[i], src[i]) for n elements of type t, each buffer device or host
/// memory (host memory is staged through device scratch), on `stream`; returns when
/// the result is in dst. u8 and u16 are refused by name.
inline void reduce_into(void* dst, const void* src, std::size_t n, comm::DataType t, comm::ReduceOp op,
                        cudaStream_t stream) {
  comm::check_reducible(t);
  if (n == 0) return;
  require_device();
  TESSERA_CHECK(n <= std::numeric_limits<std::size_t>::max() / comm::size_of(t), "CUDA memory access: ", n,
                " elements of ", comm::name_of(t), " overflow the address space");
  const std::size_t bytes = n * comm::size_of(t);
  const bool dst_on_device = detail::device_resident(dst, "reduction's destination");
  const bool src_on_device = detail::device_resident(src, "reduction's source");
  if (dst_on_device && src_on_device) {
    detail::launch_reduce(dst, src, n, t, op, stream);
    TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return;
  }
  // Host operands through scratch: [dst staged | src staged], each at a 256-byte offset.
  const std::size_t dst_room = dst_on_device ? 0 : (bytes + 255) / 256 * 256;
  detail::DeviceScratch scratch(dst_room + (src_on_device ? 0 : bytes), "a reduction of host values");
  void* work_dst = dst;
  const void* work_src = src;
  if (!dst_on_device) {
    work_dst = scratch.data();
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(work_dst, dst, bytes, cudaMemcpyHostToDevice, stream));
  }
  if (!src_on_device) {
    void* staged = static_cast<char*>(scratch.data()) + dst_room;
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(staged, src, bytes, cudaMemcpyHostToDevice, stream));
    work_src = staged;
  }
  detail::launch_reduce(work_dst, work_src, n, t, op, stream);
  if (!dst_on_device) TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst, work_dst, bytes, cudaMemcpyDeviceToHost, stream));
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace tessera::cuda
