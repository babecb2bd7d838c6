// Every kernel, copy and fill the device runs while a KernelProfile records, with the
// Region (core/region.hpp) that was open on the thread that launched it, and the
// operation the backend was launching (backend/trace.hpp's Launching: a GEMM's or an
// attention call's kernels named as llama-plan names the operation): a step of the
// real code told by llama-plan's classes (plan/measured.hpp), to set against its
// prediction. Through CUPTI's activity API (the device's own start and end of each
// kernel, on every stream) and its callback API (the launching call's correlation id,
// taken with the region open at that moment on that thread).
//
//   cuda::KernelProfile profile;       // records from here
//   step();                            // launches on any thread, any stream
//   auto work = profile.stop();        // waits for the device; the activities, by start
//
// One profile records at a time in a process (CUPTI has one subscriber); a second
// throws, naming the first. Recording costs each CUDA call a callback, so a profiled
// step runs slower than a timed one: time steps apart, and read a profile for where the
// time goes. Needs libcupti (the toolkit's; bench-train links it where Meson finds it).
// A record CUPTI had to drop (its buffers full) fails stop(): a profile with holes
// would be silent garbage.
#pragma once

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/device_activity.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/region.hpp"

#define TESSERA_CUPTI_CHECK(expr)                                              \
  do {                                                                         \
    CUptiResult tessera_cupti_ = (expr);                                       \
    if (tessera_cupti_ != CUPTI_SUCCESS) {                                     \
      const char* tessera_cupti_text_ = nullptr;                               \
      cuptiGetResultString(tessera_cupti_, &tessera_cupti_text_);              \
      ::tessera::fail("CUPTI: ", #expr, ": ",                                  \
                      tessera_cupti_text_ ? tessera_cupti_text_ : "an error"); \
    }                                                                          \
  } while (0)

namespace tessera::cuda {

namespace detail {

/// What CUPTI hands over, shared by its callbacks (plain functions) and the profile.
struct ProfileState {
  std::mutex m;
  bool recording = false;
  CUpti_SubscriberHandle subscriber{};
  std::unordered_map<std::uint32_t, const char*> regions;  // launch's correlation id -> region name
  std::unordered_map<std::uint32_t, std::string> operations;  // -> the operation launching (trace::Launching)
  std::vector<DeviceActivity> activities;
};

inline ProfileState& profile_state() {
  static ProfileState s;
  return s;
}

inline std::string demangled(const char* name) {
  if (name == nullptr) return "(unnamed kernel)";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

/// On entry to every runtime and driver call: its correlation id, with the region open on
/// this thread (only inside one: the rest are classed by name) and the operation the
/// backend is launching (trace::Launching: a GEMM's or an attention call's kernels are
/// named as llama-plan names the operation).
inline void CUPTIAPI on_cuda_call(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId, const void* data) {
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API && domain != CUPTI_CB_DOMAIN_DRIVER_API) return;
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_ENTER) return;
  const char* region = Region::current_name();
  const trace::Op* op = trace::Launching::current();
  const bool in_region = region != nullptr && *region != '\0';
  if (!in_region && op == nullptr) return;
  std::string operation = op != nullptr ? trace::describe(*op) : std::string();
  auto* s = static_cast<ProfileState*>(userdata);
  std::lock_guard lock(s->m);
  if (in_region) s->regions.emplace(info->correlationId, region);
  if (op != nullptr) s->operations.emplace(info->correlationId, std::move(operation));
}

inline constexpr std::size_t kActivityBufferBytes = std::size_t{8} << 20;

inline void CUPTIAPI activity_buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  // CUPTI's records are 8-byte aligned; a buffer it cannot have makes it drop records,
  // which stop() then reports.
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kActivityBufferBytes));
  *size = *buffer ? kActivityBufferBytes : 0;
  *max_records = 0;
}

inline void CUPTIAPI activity_buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                                               std::size_t valid) {
  std::vector<DeviceActivity> got;
  std::vector<std::uint32_t> ids;
  CUpti_Activity* record = nullptr;
  while (buffer && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    DeviceActivity a;
    std::uint32_t id = 0;
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        a.name = demangled(k->name);
        a.start_ns = k->start, a.end_ns = k->end, id = k->correlationId;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        const auto kind = static_cast<CUpti_ActivityMemcpyKind>(c->copyKind);
        const bool host = kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD || kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ||
                          kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOA || kind == CUPTI_ACTIVITY_MEMCPY_KIND_ATOH ||
                          kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOH;
        a.work = host ? DeviceWork::host_copy : DeviceWork::device_copy;
        a.name = kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "copy host to device"
                 : kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "copy device to host"
                 : host                                    ? "copy through the host"
                 : kind == CUPTI_ACTIVITY_MEMCPY_KIND_PTOP ? "copy peer to peer"
                                                           : "copy on the device";
        a.start_ns = c->start, a.end_ns = c->end, a.bytes = c->bytes, id = c->correlationId;
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* f = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        a.work = DeviceWork::fill;
        a.name = "memset";
        a.start_ns = f->start, a.end_ns = f->end, a.bytes = f->bytes, id = f->correlationId;
        break;
      }
      default:
        continue;
    }
    got.push_back(std::move(a));
    ids.push_back(id);
  }
  std::free(buffer);
  ProfileState& s = profile_state();
  std::lock_guard lock(s.m);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (const auto it = s.regions.find(ids[i]); it != s.regions.end()) got[i].region = it->second;
    if (const auto it = s.operations.find(ids[i]); it != s.operations.end()) got[i].operation = it->second;
    s.activities.push_back(std::move(got[i]));
  }
}

inline constexpr CUpti_ActivityKind kProfiledKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                                        CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET};

}  // namespace detail

class KernelProfile {
 public:
  /// Starts recording every kernel, copy and fill of every device and stream.
  KernelProfile() {
    detail::ProfileState& s = detail::profile_state();
    {
      std::lock_guard lock(s.m);
      TESSERA_CHECK(!s.recording, "cuda::KernelProfile: a profile is already recording (one at a time)");
      s.recording = true;
      s.regions.clear();
      s.operations.clear();
      s.activities.clear();
    }
    try {
      // Once a process: CUPTI keeps the buffer callbacks for every later recording.
      static const bool registered = [] {
        TESSERA_CUPTI_CHECK(cuptiActivityRegisterCallbacks(detail::activity_buffer_requested,
                                                           detail::activity_buffer_completed));
        return true;
      }();
      (void)registered;
      TESSERA_CUPTI_CHECK(cuptiSubscribe(&s.subscriber, detail::on_cuda_call, &s));
      subscribed_ = true;
      TESSERA_CUPTI_CHECK(cuptiEnableDomain(1, s.subscriber, CUPTI_CB_DOMAIN_RUNTIME_API));
      TESSERA_CUPTI_CHECK(cuptiEnableDomain(1, s.subscriber, CUPTI_CB_DOMAIN_DRIVER_API));
      for (CUpti_ActivityKind k : detail::kProfiledKinds) TESSERA_CUPTI_CHECK(cuptiActivityEnable(k));
    } catch (...) {
      release();
      throw;
    }
  }
  KernelProfile(const KernelProfile&) = delete;
  KernelProfile& operator=(const KernelProfile&) = delete;
  ~KernelProfile() { release(); }

  /// Waits for the current device, stops recording and returns what ran, by start time.
  /// (A Region's name is read when CUPTI hands its records over: the library's are
  /// literals; a user's must live as long.)
  std::vector<DeviceActivity> stop() {
    TESSERA_CHECK(!stopped_, "cuda::KernelProfile::stop: already stopped");
    TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
    TESSERA_CUPTI_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    std::size_t dropped = 0;
    TESSERA_CUPTI_CHECK(cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped));
    release();
    TESSERA_CHECK(dropped == 0, "cuda::KernelProfile: CUPTI dropped ", dropped,
                  " records (no buffer to put them in): the profile has holes");
    detail::ProfileState& s = detail::profile_state();
    std::vector<DeviceActivity> out;
    {
      std::lock_guard lock(s.m);
      out.swap(s.activities);
      s.regions.clear();
      s.operations.clear();
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
    return out;
  }

 private:
  // Disables what the constructor enabled; never throws (a destructor calls it).
  void release() noexcept {
    if (stopped_) return;
    stopped_ = true;
    detail::ProfileState& s = detail::profile_state();
    for (CUpti_ActivityKind k : detail::kProfiledKinds) (void)cuptiActivityDisable(k);
    if (subscribed_) {
      (void)cuptiEnableDomain(0, s.subscriber, CUPTI_CB_DOMAIN_RUNTIME_API);
      (void)cuptiEnableDomain(0, s.subscriber, CUPTI_CB_DOMAIN_DRIVER_API);
      (void)cuptiUnsubscribe(s.subscriber);
      subscribed_ = false;
    }
    std::lock_guard lock(s.m);
    s.recording = false;
  }

  bool subscribed_ = false;
  bool stopped_ = false;
};

}  // namespace tessera::cuda
