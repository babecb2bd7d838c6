// Device memory for the CUDA backend: the device check, the compute stream, and one
// caching allocator per device.
//
// Device check. require_device() asks cudaGetDeviceCount once per process; every entry
// point of the backend calls it first, so using the backend where no device is visible
// (no GPU, no driver, CUDA_VISIBLE_DEVICES empty) throws a tessera::Error that says so
// instead of failing somewhere inside CUDA.
//
// The compute stream. Every kernel, GEMM, memset and copy of the backend runs on one
// stream, compute_stream(): the legacy default stream (nullptr), which is also the
// default compute stream the NCCL engine orders its communication stream against
// (comm/nccl.hpp). Being one stream, work runs in the order the host issues it, and
// that is what makes the allocator's reuse of blocks safe (below). Changing the stream
// is a change here alone. (tessera is not compiled with nvcc's --default-stream
// per-thread, under which nullptr would name another stream.)
//
// Allocators. Each device gets one CachingAllocator (backend/caching_allocator.hpp),
// created on its first allocation and shared by every thread of the process (thread
// ranks on one device share it). Its upstream is cudaMalloc and cudaFree on that
// device: cudaErrorMemoryAllocation becomes nullptr (the allocator then empties its
// cache and retries, and otherwise throws its out-of-memory error naming the tensor);
// every other error throws naming the call, the device and CUDA's text. Allocators are
// never destroyed: a tensor held in static storage may be freed during the process's
// exit, after a function-local allocator would have been, and the driver takes the
// memory back when the process ends. A Buffer's deleter is
// CachingAllocator::release_to_owner, which finds the allocator that handed the block
// out, so a tensor may be freed from any thread with any device current.
//
// Blocks are reused in host order with no events (see the allocator's header): a block
// freed while a kernel on the compute stream still reads it goes only to work enqueued
// after that kernel. Memory another stream uses (a collective's buffers) is kept alive
// by its owner until that stream's work is ordered before later compute work.
//
// Uploads without a synchronisation. copy_from_host_staged() copies the host bytes into
// a pinned staging slot, issues the host-to-device copy from that slot on the compute
// stream and records an event after it; the caller may reuse its source at once, and
// the host does not wait for the device. Each device has one ring of kStagingSlots
// slots of kStagingSlotBytes (pinned, portable, allocated on its first upload, never
// freed); a slot is written again only once the event recorded after its last copy has
// completed (cudaEventSynchronize on that event alone: the host waits only when it is a
// whole ring of uploads ahead of the device). A copy larger than a slot goes through
// consecutive slots. A mutex per ring makes it safe for thread ranks sharing a device.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cuda/launch.cuh"
#include "tessera/core/buffer.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::cuda {

/// The most devices one process addresses (device indices 0 .. kMaxDevices - 1).
inline constexpr int kMaxDevices = 64;

/// The stream every piece of the CUDA backend runs on: the legacy default stream.
inline cudaStream_t compute_stream() { return nullptr; }

namespace detail {

/// What cudaGetDeviceCount said when first asked.
struct DeviceCountResult {
  cudaError_t status = cudaSuccess;
  int count = 0;
};

inline const DeviceCountResult& device_count_result() {
  static const DeviceCountResult result = [] {
    DeviceCountResult r;
    r.status = cudaGetDeviceCount(&r.count);
    if (r.status != cudaSuccess) {
      (void)cudaGetLastError();  // leave no error behind for a later, unrelated check
      r.count = 0;
    }
    return r;
  }();
  return result;
}

/// Throws the "no device" error when cudaGetDeviceCount gave `status` and `count`.
inline void check_device_count(cudaError_t status, int count) {
  if (status != cudaSuccess)
    fail("CUDA backend: no CUDA device is visible (cudaGetDeviceCount: ", cudaGetErrorName(status), ": ",
         cudaGetErrorString(status), ")");
  if (count <= 0) fail("CUDA backend: no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
}

/// Makes `device` current for a scope and restores the previous one after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    TESSERA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TESSERA_CUDA_CHECK(cudaSetDevice(device));
      restore_ = true;
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);  // a destructor cannot report
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

/// cudaMalloc and cudaFree on `device`, as a CachingAllocator upstream.
inline CachingAllocator::Upstream cuda_upstream(int device) {
  CachingAllocator::Upstream up;
  up.device = "cuda:" + std::to_string(device);
  up.allocate = [device](std::size_t bytes) -> void* {
    DeviceScope scope(device);
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear it: out of memory is an answer here, not a failure
      return nullptr;
    }
    if (status != cudaSuccess)
      fail("cudaMalloc(", bytes, " bytes) on cuda:", device, ": ", cudaGetErrorName(status), ": ",
           cudaGetErrorString(status));
    return p;
  };
  up.release = [device](void* p, std::size_t bytes) {
    DeviceScope scope(device);
    const cudaError_t status = cudaFree(p);
    // At process exit the runtime may already be gone; the driver reclaims the memory.
    if (status == cudaErrorCudartUnloading) return;
    if (status != cudaSuccess)
      fail("cudaFree(", p, ", ", bytes, " bytes) on cuda:", device, ": ", cudaGetErrorName(status), ": ",
           cudaGetErrorString(status));
  };
  up.device_free_bytes = [device]() -> std::size_t {
    DeviceScope scope(device);
    std::size_t free_bytes = 0, total_bytes = 0;
    TESSERA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;
  };
  return up;
}

/// The per-device allocators, created on first use and never destroyed.
struct DeviceAllocators {
  std::array<std::once_flag, kMaxDevices> once;
  std::array<CachingAllocator*, kMaxDevices> allocator{};
};

inline DeviceAllocators& device_allocators() {
  static DeviceAllocators* all = new DeviceAllocators;  // immortal: see the header comment
  return *all;
}

/// "float32", "bfloat16", ... or "<n>-byte" for other element types.
template <class T>
std::string element_name() {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>)
    return std::string(name_of(dtype_of<T>()));
  else
    return std::to_string(sizeof(T)) + "-byte";
}

}  // namespace detail

/// Throws a tessera::Error unless at least one CUDA device is visible.
inline void require_device() {
  const auto& r = detail::device_count_result();
  if (r.count > 0) return;
  detail::check_device_count(r.status, r.count);
}

/// Devices visible to this process, checked (at least one).
inline int visible_devices() {
  require_device();
  return detail::device_count_result().count;
}

/// The calling thread's current device.
inline int current_device() {
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

/// The caching allocator of `device`, created on first use.
inline CachingAllocator& device_allocator(int device) {
  require_device();
  TESSERA_CHECK(0 <= device && device < visible_devices() && device < kMaxDevices, "CUDA backend: device ",
                device, " is not one of the ", visible_devices(), " visible devices");
  auto& all = detail::device_allocators();
  std::call_once(all.once[static_cast<std::size_t>(device)], [&] {
    all.allocator[static_cast<std::size_t>(device)] = new CachingAllocator(detail::cuda_upstream(device));
  });
  return *all.allocator[static_cast<std::size_t>(device)];
}

/// The caching allocator of the calling thread's current device.
inline CachingAllocator& device_allocator() { return device_allocator(current_device()); }

/// `n` elements of device memory on the current device, not initialised, from its
/// caching allocator; `what` names the request in an out-of-memory error. n == 0
/// allocates nothing (a null Buffer still marked as CUDA memory).
template <class T>
Buffer<T> device_buffer(std::size_t n, std::string_view what = {}) {
  static_assert(std::is_trivially_copyable_v<T>, "tessera: device buffers hold trivially copyable elements");
  require_device();
  if (n == 0) return Buffer<T>(nullptr, 0, Device::cuda, &CachingAllocator::release_to_owner);
  TESSERA_CHECK(n <= std::numeric_limits<std::size_t>::max() / sizeof(T), "CUDA backend: ", n,
                " elements of ", sizeof(T), " bytes", what.empty() ? "" : " for ", what,
                " overflow the address space");
  void* p = device_allocator().allocate(n * sizeof(T), what);
  return Buffer<T>(static_cast<T*>(p), n, Device::cuda, &CachingAllocator::release_to_owner);
}

/// Bytes of one pinned staging slot, and slots per device (copy_from_host_staged).
inline constexpr std::size_t kStagingSlotBytes = std::size_t{1} << 20;
inline constexpr int kStagingSlots = 16;

namespace detail {

/// One device's ring of pinned staging slots, each with the event recorded after the
/// last copy out of it.
struct StagingRing {
  std::mutex mutex;
  unsigned char* host = nullptr;  // kStagingSlots * kStagingSlotBytes, pinned
  std::array<cudaEvent_t, kStagingSlots> copied{};
  std::array<bool, kStagingSlots> in_use{};
  int next = 0;
};

struct StagingRings {
  std::array<std::once_flag, kMaxDevices> once;
  std::array<StagingRing*, kMaxDevices> ring{};
};

/// The staging ring of `device`, allocated on first use and never freed (like the
/// allocators: an upload may come during static teardown).
inline StagingRing& staging_ring(int device) {
  static StagingRings* all = new StagingRings;
  TESSERA_CHECK(0 <= device && device < kMaxDevices, "CUDA backend: device ", device, " out of range");
  const auto d = static_cast<std::size_t>(device);
  std::call_once(all->once[d], [&] {
    DeviceScope scope(device);
    auto* ring = new StagingRing;
    void* p = nullptr;
    TESSERA_CUDA_CHECK(cudaHostAlloc(&p, kStagingSlotBytes * kStagingSlots, cudaHostAllocPortable));
    ring->host = static_cast<unsigned char*>(p);
    for (cudaEvent_t& e : ring->copied) TESSERA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    all->ring[d] = ring;
  });
  return *all->ring[d];
}

}  // namespace detail

/// `bytes` from host memory `src` to device memory `dst` on the current device, on
/// `stream`, through the device's pinned staging ring (see the header comment): src may
/// be reused when this returns; the copy completes in stream order, and the host waits
/// only for a slot whose previous copy has not run yet.
inline void copy_from_host_staged(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  detail::StagingRing& ring = detail::staging_ring(current_device());
  std::lock_guard lock(ring.mutex);
  auto* to = static_cast<unsigned char*>(dst);
  const auto* from = static_cast<const unsigned char*>(src);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t piece = std::min(kStagingSlotBytes, bytes - done);
    const auto slot = static_cast<std::size_t>(ring.next);
    ring.next = (ring.next + 1) % kStagingSlots;
    if (ring.in_use[slot]) TESSERA_CUDA_CHECK(cudaEventSynchronize(ring.copied[slot]));
    unsigned char* staged = ring.host + slot * kStagingSlotBytes;
    std::memcpy(staged, from + done, piece);
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(to + done, staged, piece, cudaMemcpyHostToDevice, stream));
    TESSERA_CUDA_CHECK(cudaEventRecord(ring.copied[slot], stream));
    ring.in_use[slot] = true;
    done += piece;
  }
}

}  // namespace tessera::cuda
