// Host-side declarations of the GPU op launchers (defined in ops_launchers.cu): device
// arrays the checks fill and read, and launches of ops/ functors through the lowered
// kernels (cuda::launch_op, backend/cuda/row_kernels.cuh) or the per-index kernel
// (cuda::for_each). Every launch waits for the device and checks its errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace tessera::gpu_test {

int device_count();
/// Whether CrossEntropyRow's one-read kernel (a cluster of blocks per row) runs on this
/// GPU for float logits and a bf16 gradient (its sm_90 code is in the binary and the GPU
/// runs it); where it does not, rows of any length take the row kernel's passes.
bool cross_entropy_one_read_runs();
/// The current GPU's compute capability, major part.
int device_compute_major();

/// Raw device memory for DeviceArray (cudaMalloc / cudaFree / blocking copies).
void* device_allocate(std::size_t bytes);
void device_release(void* p);
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);

/// A copy of a host vector in device memory, starting `offset` elements into a fresh
/// cudaMalloc block (256-byte aligned): offset 0 is 16-byte aligned, an odd offset
/// misaligns the array for 16-byte loads.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host, std::size_t offset = 0)
      : size_(host.size()), offset_(offset), block_(device_allocate((host.size() + offset) * sizeof(T) + 16)) {
    copy_to_device(data(), host.data(), size_ * sizeof(T));
  }
  ~DeviceArray() { device_release(block_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return static_cast<T*>(block_) + offset_; }
  std::vector<T> download() const {
    std::vector<T> host(size_);
    copy_to_host(host.data(), data(), size_ * sizeof(T));
    return host;
  }

 private:
  std::size_t size_;
  std::size_t offset_;
  void* block_;
};

/// cuda::launch_op(n, f) on the compute stream: F's own kernel where it has one.
template <class F>
void launch_op(std::int64_t n, const F& f);

/// cuda::launch_op(n, f) on a new non-blocking stream (destroyed after).
template <class F>
void launch_op_on_side_stream(std::int64_t n, const F& f);

/// cuda::for_each(n, f): one index per thread, whatever F is.
template <class F>
void launch_per_index(std::int64_t n, const F& f);

/// ops::AdamWStep from zero moments on device copies; returns the parameters.
std::vector<float> adamw_step(std::vector<float> p, const std::vector<float>& g, float lr);

}  // namespace tessera::gpu_test
