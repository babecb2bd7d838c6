// Device-tagged owning storage.
//
// A Buffer owns `size` elements on one device. The CPU allocation lives here; a
// backend that owns other memory (CUDA) constructs Buffers from its own pointer and
// deleter, so this header needs no device headers. Buffers move, never copy. Each
// counts its bytes in memory_stats(device), under the MemoryUse open on its thread
// when it was made (core/memory.hpp).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"

namespace tessera {

/// Tag for an allocation whose elements the caller will overwrite before reading.
struct Uninitialized {};

template <class T>
class Buffer {
 public:
  using Deleter = void (*)(void*);

  Buffer() = default;

  /// Allocates `size` zero-initialised elements in host memory, 64-byte aligned.
  explicit Buffer(std::size_t size) : Buffer(size, Uninitialized{}) {
    if (data_ != nullptr) std::memset(static_cast<void*>(data_), 0, round_up(size * sizeof(T)));
  }

  /// Allocates `size` elements in host memory, 64-byte aligned, left as they are.
  Buffer(std::size_t size, Uninitialized) : size_(size), device_(Device::cpu), deleter_(&host_free) {
    if (size == 0) return;
    data_ = static_cast<T*>(std::aligned_alloc(64, round_up(size * sizeof(T))));
    if (data_ == nullptr) fail_out_of_memory("out of host memory allocating ", size * sizeof(T), " bytes");
    stats_ = &memory_stats(device_);
    stats_->on_alloc(size_ * sizeof(T), use_);
  }

  /// Adopts memory a backend allocated; `deleter` releases it.
  Buffer(T* data, std::size_t size, Device device, Deleter deleter)
      : data_(data), size_(size), device_(device), deleter_(deleter), stats_(&memory_stats(device)) {
    stats_->on_alloc(size_ * sizeof(T), use_);
  }

  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }
  Device device() const { return device_; }
  MemoryUse use() const { return use_; }
  bool empty() const { return size_ == 0; }

  void release() {
    if (data_ != nullptr) {
      stats_->on_free(size_ * sizeof(T), use_);
      deleter_(data_);
    }
    data_ = nullptr;
    size_ = 0;
  }

 private:
  static void host_free(void* p) { std::free(p); }
  static std::size_t round_up(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

  void swap(Buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(device_, o.device_);
    std::swap(deleter_, o.deleter_);
    std::swap(stats_, o.stats_);
    std::swap(use_, o.use_);
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  Device device_ = Device::cpu;
  Deleter deleter_ = &host_free;
  MemoryStats* stats_ = nullptr;  // where the allocation was counted: it is uncounted there
  MemoryUse use_ = current_memory_use();
};

}  // namespace tessera
