// A whole file mapped read-only into memory (POSIX mmap), released on destruction.
//
// Checkpoints and token shards are read through the mapping so a multi-gigabyte file is
// never copied whole: the kernel pages in what is touched. MappedFile is move-only; an
// empty file is valid and has size() == 0 and a null data(). Failures throw
// tessera::Error naming the path and the system's reason.
//
// A page of a mapping that cannot be read (the file was shortened under the process, or
// the device returned an I/O error where read() would have returned EIO) raises SIGBUS,
// which would end the process with no word of why. While a file is mapped, a SIGBUS
// handler looks the faulting address up among the live mappings and, when it falls in
// one, writes one line naming the program, the file and the byte, and exits with status
// 1 (files a run saved are written elsewhere and renamed whole, so none is lost). A
// SIGBUS elsewhere goes on to the handler installed before (or the default action).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "tessera/core/error.hpp"

namespace tessera::io {

namespace detail {

// The live mappings a SIGBUS is looked up in: a fixed table the handler can read without
// locks or allocation. A slot is claimed (1), filled, then published (2); released, it
// goes back to free (0). Past the table's size a mapping is simply not watched.
struct WatchedMapping {
  std::atomic<int> state{0};
  std::uintptr_t begin = 0, end = 0;
  const char* path = nullptr;  // owned by the MappedFile, stable across its moves
};
inline constexpr int watched_mappings = 4096;
inline WatchedMapping watched[watched_mappings];
inline struct sigaction sigbus_before {};

// Async-signal-safe writes to stderr.
inline void signal_write(const char* text) {
  std::size_t n = 0;
  while (text[n] != '\0') ++n;
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w, n -= static_cast<std::size_t>(w);
  }
}
inline void signal_write_number(std::uintptr_t v) {
  char digits[24];
  char* p = digits + sizeof digits;
  *--p = '\0';
  do {
    *--p = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  signal_write(p);
}

inline void on_sigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (const WatchedMapping& m : watched) {
    if (m.state.load(std::memory_order_acquire) != 2 || addr < m.begin || addr >= m.end) continue;
    signal_write(program_invocation_short_name);
    signal_write(": error: '");
    signal_write(m.path);
    signal_write("': reading byte ");
    signal_write_number(addr - m.begin);
    signal_write(" of the mapped file failed (SIGBUS): it was shortened or rewritten in place under "
                 "this process, or its device returned an I/O error\n");
    ::_exit(1);
  }
  // Not a mapping of ours: what was there before.
  if ((sigbus_before.sa_flags & SA_SIGINFO) != 0 && sigbus_before.sa_sigaction != nullptr) {
    sigbus_before.sa_sigaction(sig, info, context);
    return;
  }
  if (sigbus_before.sa_handler != SIG_DFL && sigbus_before.sa_handler != SIG_IGN &&
      sigbus_before.sa_handler != nullptr) {
    sigbus_before.sa_handler(sig);
    return;
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

/// Installs on_sigbus once per process, keeping the handler it replaces.
inline void watch_sigbus() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = &on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &sigbus_before);
  });
}

/// Publishes [begin, begin + size) under `path`; returns the slot, or -1 when the table is full.
inline int watch_mapping(const void* begin, std::size_t size, const char* path) {
  watch_sigbus();
  for (int i = 0; i < watched_mappings; ++i) {
    int expected = 0;
    if (!watched[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    watched[i].begin = reinterpret_cast<std::uintptr_t>(begin);
    watched[i].end = watched[i].begin + size;
    watched[i].path = path;
    watched[i].state.store(2, std::memory_order_release);
    return i;
  }
  return -1;
}

inline void unwatch_mapping(int slot) {
  if (slot < 0) return;
  watched[slot].state.store(1, std::memory_order_release);
  watched[slot].begin = watched[slot].end = 0;
  watched[slot].path = nullptr;
  watched[slot].state.store(0, std::memory_order_release);
}

}  // namespace detail

class MappedFile {
 public:
  MappedFile() = default;

  /// Maps `path` read-only; throws tessera::Error naming the path when it cannot.
  static MappedFile open(const std::string& path) {
    MappedFile file;
    file.path_ = path;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      fail(path, ": cannot open for reading: ", std::strerror(err));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      fail(path, ": cannot stat: ", std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(path, ": not a regular file");
    }
    file.size_ = static_cast<std::size_t>(st.st_size);
    if (file.size_ > 0) {
      void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        fail(path, ": cannot map ", file.size_, " bytes into memory: ", std::strerror(err));
      }
      file.data_ = static_cast<const std::byte*>(p);
      file.watched_path_ = std::make_unique<char[]>(path.size() + 1);
      std::memcpy(file.watched_path_.get(), path.c_str(), path.size() + 1);
      file.slot_ = detail::watch_mapping(p, file.size_, file.watched_path_.get());
    }
    ::close(fd);  // the mapping stays valid without the descriptor
    return file;
  }

  MappedFile(MappedFile&& other) noexcept
      : path_(std::move(other.path_)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        watched_path_(std::move(other.watched_path_)),
        slot_(std::exchange(other.slot_, -1)) {}

  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      release();
      path_ = std::move(other.path_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      watched_path_ = std::move(other.watched_path_);
      slot_ = std::exchange(other.slot_, -1);
    }
    return *this;
  }

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  ~MappedFile() { release(); }

  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

  /// Lets the process's page tables drop the whole pages of [offset, offset + size): they
  /// stay in the page cache, and reading them again maps them back (the mapping is
  /// read-only, so nothing is lost). A pass over a large file calls it behind itself, so
  /// the pages read do not count in the process's resident set.
  void drop(std::size_t offset, std::size_t size) const {
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    if (data_ == nullptr || offset >= size_) return;
    size = std::min(size, size_ - offset);
    const std::size_t begin = (offset + page - 1) / page * page;
    const std::size_t end = offset + size == size_ ? size_ : (offset + size) / page * page;
    if (end > begin) ::madvise(const_cast<std::byte*>(data_) + begin, end - begin, MADV_DONTNEED);
  }

 private:
  void release() noexcept {
    detail::unwatch_mapping(std::exchange(slot_, -1));  // before the range can be mapped again
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
    watched_path_.reset();
  }

  std::string path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::unique_ptr<char[]> watched_path_;  // the path the SIGBUS handler names
  int slot_ = -1;                          // this mapping's entry in detail::watched
};

}  // namespace tessera::io
