// Device memory for the CUDA backend: the device check, the compute stream, and one
// caching allocator per device.
//
// Device check. require_device() asks cudaGetDeviceCount once per process; every entry
// point of the backend calls it first, so using the backend where no device is visible
// (no GPU, no driver, CUDA_VISIBLE_DEVICES empty) throws a tessera::Error that says so
// instead of failing somewhere inside CUDA.
//
// The compute stream. Every kernel, GEMM, memset and copy of the backend runs on one
// stream per device, compute_stream(): a stream created on first use, blocking (so it
// stays ordered with anything issued to the legacy default stream), which the NCCL
// engine orders its communication stream against when given it (comm/nccl.hpp; the
// trainers give it). Being one stream, work runs in the order the host issues it, and
// that is what makes the allocator's reuse of blocks safe (below); being a created
// stream, work issued to it can be captured as a CUDA graph. Changing the stream is a
// change here alone.
//
// Allocators. Each device gets one CachingAllocator (backend/caching_allocator.hpp),
// created on its first allocation and shared by every thread of the process (thread
// ranks on one device share it). Its upstream is cudaMalloc and cudaFree on that
// device: cudaErrorMemoryAllocation becomes nullptr (the allocator then empties its
// cache and retries, and otherwise throws its out-of-memory error naming the tensor);
// every other error throws naming the call, the device and CUDA's text. Allocators are
// never destroyed: a tensor held in static storage may be freed during the process's
// exit, after a function-local allocator would have been, and the driver takes the
// memory back when the process ends.
//
// Expandable segments (set_expandable_segments, on unless a job sets
// training.expandable_segments = false before its first allocation): the allocator's
// large pool is then one segment over an address range (cuMemAddressReserve) of four
// times the device's size (pages unmapped inside the segment leave address space behind
// them), grown at its end in pages of the driver's allocation
// granularity, at least 2 MiB: each page its own physical allocation (cuMemCreate),
// mapped (cuMemMap) and made readable and writable by the device (cuMemSetAccess); pages
// are unmapped and released one by one, after a device synchronisation (cudaFree waits
// for the kernels that may still use a block the host released; cuMemUnmap does not). cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY is the
// upstream's "no more" (the allocator then empties its cache and retries), every other
// error throws naming the call. The driver's calls come through the runtime
// (cudaGetDriverEntryPointByVersion), so nothing links libcuda; where the driver lacks
// them or the device does not support virtual memory management, the allocator takes
// a cudaMalloc segment per block as before (expandable_segments_status says why).
// Collectives need no peer access to these pages: NCCL copies through its own buffers
// unless a buffer is registered with it, and tessera registers none. A Buffer's deleter is
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

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/core/buffer.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::cuda {

/// The most devices one process addresses (device indices 0 .. kMaxDevices - 1).
inline constexpr int kMaxDevices = 64;

namespace detail {
/// Each device's compute stream, created on first use and never destroyed (work may be
/// issued during static teardown).
struct ComputeStreams {
  std::array<std::atomic<cudaStream_t>, kMaxDevices> stream{};
  std::mutex create;
};
inline ComputeStreams& compute_streams() {
  static ComputeStreams* streams = new ComputeStreams;  // immortal
  return *streams;
}
}  // namespace detail

/// The stream every piece of the CUDA backend runs on, one per device (the current
/// one's). A created stream, so that a step issued to it can be captured as a CUDA graph
/// (the legacy default stream cannot be); a blocking one (cudaStreamDefault), so that
/// work anything else issues to the legacy default stream (a cudaMemcpy, a library's
/// own) stays ordered with it, as it was when the backend ran on that stream.
inline cudaStream_t compute_stream() {
  int device = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&device));
  TESSERA_CHECK(0 <= device && device < kMaxDevices, "CUDA backend: device ", device, " out of range");
  auto& streams = detail::compute_streams();
  std::atomic<cudaStream_t>& slot = streams.stream[static_cast<std::size_t>(device)];
  if (cudaStream_t s = slot.load(std::memory_order_acquire)) return s;
  std::lock_guard lock(streams.create);
  if (cudaStream_t s = slot.load(std::memory_order_acquire)) return s;
  cudaStream_t s = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  slot.store(s, std::memory_order_release);
  return s;
}

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

/// The driver's virtual memory management calls, fetched through the runtime once; the
/// name of the first the driver did not give, if any.
struct VmmCalls {
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  std::string missing;
};

inline const VmmCalls& vmm_calls() {
  static const VmmCalls calls = [] {
    VmmCalls c;
    auto get = [&c](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
      // 12000: each call's ABI as of CUDA 12.0 (the _v10020 and older signatures above).
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess || p == nullptr) {
        (void)cudaGetLastError();
        if (c.missing.empty()) c.missing = name;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get("cuMemAddressReserve", c.address_reserve);
    get("cuMemAddressFree", c.address_free);
    get("cuMemCreate", c.create);
    get("cuMemRelease", c.release);
    get("cuMemMap", c.map);
    get("cuMemUnmap", c.unmap);
    get("cuMemSetAccess", c.set_access);
    get("cuMemGetAllocationGranularity", c.granularity);
    get("cuDeviceGetAttribute", c.device_attribute);
    get("cuGetErrorName", c.error_name);
    return c;
  }();
  return calls;
}

/// Throws naming the driver call, the device and the driver's error, unless it succeeded.
inline void check_driver(CUresult r, const char* call, int device) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (vmm_calls().error_name == nullptr || vmm_calls().error_name(r, &name) != CUDA_SUCCESS) name = nullptr;
  fail(call, " on cuda:", device, ": ", name != nullptr ? name : "CUresult", " (", static_cast<int>(r), ")");
}

/// Device memory of `device`, as its expandable segment's pages are created.
inline CUmemAllocationProp device_pages(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

/// One device's pages of its expandable segment: a physical allocation each, by address.
struct ExpandablePages {
  int device = 0;
  std::size_t page = 0;
  std::map<CUdeviceptr, CUmemGenericAllocationHandle> handles;

  /// Unmaps and releases the pages of [at, at + bytes), each mapped before.
  void unmap(CUdeviceptr at, std::size_t bytes) {
    const VmmCalls& v = vmm_calls();
    for (CUdeviceptr p = at; p < at + bytes; p += page) {
      auto it = handles.find(p);
      if (it == handles.end()) fail("CUDA backend: unmapping a page at ", p, " on cuda:", device, " that is not mapped");
      check_driver(v.unmap(p, page), "cuMemUnmap", device);
      check_driver(v.release(it->second), "cuMemRelease", device);
      handles.erase(it);
    }
  }

  /// Maps [at, at + bytes) page by page; false, with nothing left mapped, when the device
  /// has no memory for one of them.
  bool map(CUdeviceptr at, std::size_t bytes) {
    const VmmCalls& v = vmm_calls();
    const CUmemAllocationProp prop = device_pages(device);
    for (CUdeviceptr p = at; p < at + bytes; p += page) {
      CUmemGenericAllocationHandle h{};
      const CUresult r = v.create(&h, page, &prop, 0);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        unmap(at, p - at);
        return false;
      }
      check_driver(r, "cuMemCreate", device);
      if (const CUresult m = v.map(p, page, 0, h, 0); m != CUDA_SUCCESS) {
        (void)v.release(h);
        unmap(at, p - at);
        check_driver(m, "cuMemMap", device);
      }
      handles.emplace(p, h);
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (const CUresult r = v.set_access(at, bytes, &access, 1); r != CUDA_SUCCESS) {
      unmap(at, bytes);
      check_driver(r, "cuMemSetAccess", device);
    }
    return true;
  }
};

/// The expandable segment of `device` as an upstream's part, or why it cannot be had.
inline std::optional<CachingAllocator::Upstream::Expandable> cuda_expandable(int device, std::string& why) {
  const VmmCalls& v = vmm_calls();
  if (!v.missing.empty()) {
    why = "the driver does not give " + v.missing;
    return std::nullopt;
  }
  int supported = 0;
  check_driver(v.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device),
               "cuDeviceGetAttribute", device);
  if (supported == 0) {
    why = "cuda:" + std::to_string(device) + " does not support virtual memory management";
    return std::nullopt;
  }
  const CUmemAllocationProp prop = device_pages(device);
  std::size_t granularity = 0;
  check_driver(v.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity",
               device);
  TESSERA_CHECK(granularity > 0, "CUDA backend: cuda:", device, " gives an allocation granularity of 0");
  std::size_t free_bytes = 0, total_bytes = 0;
  {
    DeviceScope scope(device);
    TESSERA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  }
  CachingAllocator::Upstream::Expandable x;
  x.page_bytes = (std::max<std::size_t>(granularity, CachingAllocator::kLargeRound) + granularity - 1) / granularity *
                 granularity;
  // Four times the device: pages unmapped inside the segment leave address space behind
  // them, and a step whose live bytes fit may still need a span past the device's size.
  x.range_bytes = (4 * total_bytes + x.page_bytes - 1) / x.page_bytes * x.page_bytes;
  auto pages = std::make_shared<ExpandablePages>();
  pages->device = device;
  pages->page = x.page_bytes;
  x.reserve = [device, page = x.page_bytes](std::size_t bytes) -> void* {
    DeviceScope scope(device);
    CUdeviceptr p = 0;
    check_driver(vmm_calls().address_reserve(&p, bytes, page, 0, 0), "cuMemAddressReserve", device);
    return reinterpret_cast<void*>(p);
  };
  x.map = [pages](void* at, std::size_t bytes) {
    DeviceScope scope(pages->device);
    return pages->map(reinterpret_cast<CUdeviceptr>(at), bytes);
  };
  x.unmap = [pages](void* at, std::size_t bytes) {
    DeviceScope scope(pages->device);
    // The allocator hands blocks out again in host order, so kernels still queued may
    // read these pages; cudaFree waits for them, cuMemUnmap does not.
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    pages->unmap(reinterpret_cast<CUdeviceptr>(at), bytes);
  };
  x.free_range = [device](void* base, std::size_t bytes) {
    check_driver(vmm_calls().address_free(reinterpret_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree", device);
  };
  return x;
}

/// The per-device allocators, created on first use and never destroyed; whether they
/// grow expandable segments, and for each device why not where it was asked and cannot.
struct DeviceAllocators {
  std::array<std::once_flag, kMaxDevices> once;
  std::array<CachingAllocator*, kMaxDevices> allocator{};
  std::atomic<bool> expandable{true};
  std::atomic<bool> any_created{false};
  std::array<std::string, kMaxDevices> expandable_status;
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

/// Devices visible to this process (0 when there is no driver or no GPU), unchecked.
inline int device_count() { return detail::device_count_result().count; }

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

namespace detail {
/// A new allocator for `device`, with expandable segments when they are on and the device
/// has them; `status` says which it runs.
inline CachingAllocator* new_allocator(int device, std::string& status) {
  auto& all = device_allocators();
  CachingAllocator::Upstream up = cuda_upstream(device);
  if (all.expandable) {
    std::string why;
    up.expandable = cuda_expandable(device, why);
    status = up.expandable ? "expandable segments" : "a segment per block (" + why + ")";
  } else {
    status = "a segment per block (training.expandable_segments = false)";
  }
  all.any_created = true;
  return new CachingAllocator(std::move(up));
}

inline void check_device_index(int device) {
  TESSERA_CHECK(0 <= device && device < visible_devices() && device < kMaxDevices, "CUDA backend: device ",
                device, " is not one of the ", visible_devices(), " visible devices");
}

/// Each device's graph pool (graph_allocator), created on first use and never destroyed.
struct GraphAllocators {
  std::array<std::once_flag, kMaxDevices> once;
  std::array<CachingAllocator*, kMaxDevices> allocator{};
};
inline GraphAllocators& graph_allocators() {
  static GraphAllocators* all = new GraphAllocators;  // immortal, as the device allocators
  return *all;
}

/// The pool a graph capture on this thread allocates from (cuda/graph.hpp), or null.
inline thread_local CachingAllocator* capture_allocator = nullptr;
}  // namespace detail

/// The caching allocator of `device`, created on first use.
inline CachingAllocator& device_allocator(int device) {
  require_device();
  detail::check_device_index(device);
  auto& all = detail::device_allocators();
  const auto d = static_cast<std::size_t>(device);
  std::call_once(all.once[d], [&] { all.allocator[d] = detail::new_allocator(device, all.expandable_status[d]); });
  return *all.allocator[d];
}

/// The private pool of graph captures on `device` (cuda/graph.hpp): a capture allocates
/// from it, and its blocks go back to it, so what a captured graph writes is handed to
/// no other work while the graph may replay.
inline CachingAllocator& graph_allocator(int device) {
  require_device();
  detail::check_device_index(device);
  auto& pools = detail::graph_allocators();
  const auto d = static_cast<std::size_t>(device);
  std::call_once(pools.once[d], [&] {
    std::string status;
    pools.allocator[d] = detail::new_allocator(device, status);
  });
  return *pools.allocator[d];
}

/// Whether the device allocators, all created after this call, grow expandable segments
/// (the default) or take a cudaMalloc segment per block (training.expandable_segments).
/// Once an allocator exists the mode is fixed: asking for the other is an error.
inline void set_expandable_segments(bool on) {
  auto& all = detail::device_allocators();
  if (all.expandable == on) return;
  TESSERA_CHECK(!all.any_created, "CUDA backend: training.expandable_segments = ", on ? "true" : "false",
                " must be set before the first device allocation (the allocators already run ",
                all.expandable ? "expandable segments" : "a segment per block", ")");
  all.expandable = on;
}

/// How `device`'s allocator takes memory: "expandable segments", or "a segment per block
/// (why)"; empty before its first allocation (ask after it, on any thread).
inline std::string expandable_segments_status(int device) {
  TESSERA_CHECK(0 <= device && device < kMaxDevices, "CUDA backend: device ", device, " is out of range");
  auto& all = detail::device_allocators();
  if (all.allocator[static_cast<std::size_t>(device)] == nullptr) return {};
  return all.expandable_status[static_cast<std::size_t>(device)];
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
  // Inside a graph capture, from the graph's pool (cuda/graph.hpp).
  CachingAllocator& from = detail::capture_allocator != nullptr ? *detail::capture_allocator : device_allocator();
  void* p = from.allocate(n * sizeof(T), what);
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
