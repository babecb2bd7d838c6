// A whole file mapped read-only into memory (POSIX mmap), released on destruction.
//
// Checkpoints are read through the mapping so a multi-gigabyte file is never copied
// whole: the kernel pages in what is touched. MappedFile is move-only; an empty file
// is valid and has size() == 0 and a null data(). Failures throw tessera::Error naming
// the path and the system's reason. The file must not be truncated by someone else
// while it is mapped (touching the lost pages raises SIGBUS, as with any mapping).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>

#include "tessera/core/error.hpp"

namespace tessera::io {

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
    }
    ::close(fd);  // the mapping stays valid without the descriptor
    return file;
  }

  MappedFile(MappedFile&& other) noexcept
      : path_(std::move(other.path_)),
        data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)) {}

  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      release();
      path_ = std::move(other.path_);
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
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
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
  }

  std::string path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace tessera::io
