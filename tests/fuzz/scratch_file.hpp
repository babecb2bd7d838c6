// The scratch file (or folder) of a fuzz target whose entry point reads a file by name
// (the readers map files, or open them themselves): one a process, in /dev/shm when there
// is one, removed when the process exits normally (held in a function's static, its
// destructor runs at exit).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

namespace fuzz {

class ScratchFile {
 public:
  /// "tessera-fuzz-<target>-<pid><suffix>"; `target` also names the fuzzer in errors.
  ScratchFile(std::string_view target, std::string_view suffix) : target_(target) {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
    path_ = std::string(dir != nullptr ? dir : "/tmp") + "/tessera-fuzz-" + target_ + "-" +
            std::to_string(::getpid()) + std::string(suffix);
  }
  /// A folder: the file's path is the folder's, with `file` inside it.
  ScratchFile(std::string_view target, std::string_view suffix, std::string_view file)
      : ScratchFile(target, suffix) {
    std::error_code ec;
    folder_ = path_;
    std::filesystem::create_directories(folder_, ec);
    if (ec) fail("cannot create the scratch folder");
    path_ = (std::filesystem::path(folder_) / file).string();
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  ~ScratchFile() {
    std::error_code ec;
    if (folder_.empty()) std::filesystem::remove(path_, ec);
    else std::filesystem::remove_all(folder_, ec);
  }

  const std::string& path() const { return path_; }
  /// The folder holding the file (made for it when constructed with a file's name).
  std::string folder() const { return folder_.empty() ? std::filesystem::path(path_).parent_path().string() : folder_; }

  /// Replaces the file's bytes with `size` bytes at `data`; aborts when it cannot.
  void write(const void* data, std::size_t size) const {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) fail("cannot open the scratch file");
    const auto* at = static_cast<const unsigned char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd, at, size);
      if (n <= 0) fail("cannot write the scratch file");
      at += n;
      size -= static_cast<std::size_t>(n);
    }
    ::close(fd);
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    std::perror(("fuzz_" + target_ + ": " + what + " " + path_).c_str());
    std::abort();
  }

  std::string target_, path_, folder_;
};

}  // namespace fuzz
