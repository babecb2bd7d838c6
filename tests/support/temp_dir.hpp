// A fresh directory under the system's temporary directory, removed with everything in
// it when the object goes out of scope. For tests that write files.
#pragma once

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

namespace tessera::test {

struct TempDir {
  std::filesystem::path path;

  explicit TempDir(const std::string& prefix = "tessera_test") {
    std::random_device rd;
    for (int attempt = 0;; ++attempt) {
      path = std::filesystem::temp_directory_path() /
             (prefix + "_" + std::to_string(rd()) + "_" + std::to_string(attempt));
      if (std::filesystem::create_directory(path)) break;
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }

  /// The path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }

  /// Writes `bytes` to the file `name` inside the directory; returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = file(name);
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
};

}  // namespace tessera::test
