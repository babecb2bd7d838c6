// Token ids tokenized elsewhere, read for a token shard (llama-tokenize --import):
//
//   NumPy .npy   a one-dimensional array in C order of little-endian unsigned or signed
//                integers of 2, 4 or 8 bytes (numpy.save of a token array: '<u2', '<u4',
//                '<i4', '<i8', ...), format versions 1.0, 2.0 and 3.0
//   llm.c .bin   a header of 256 little-endian int32 (magic, version, the id count),
//                then the ids: magic 20240520 version 1, uint16 ids (GPT-2's
//                vocabulary); magic 20240801 version 7, uint32 ids (Llama 3's)
//
// The format is told by the file's first bytes, not its name. Every id is checked as it
// is read: not negative and below the vocabulary, an error naming the file and the id's
// index otherwise; a header that promises more (or fewer) ids than the file holds is an
// error before any id is read.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::io {

/// llm.c's token files: the header's magic and version, and the bytes of an id.
struct LlmcTokenFormat {
  std::int32_t magic, version;
  unsigned id_bytes;
};
inline constexpr LlmcTokenFormat kLlmcTokenFormats[] = {{20240520, 1, 2}, {20240801, 7, 4}};
inline constexpr std::uint64_t kLlmcHeaderBytes = 256 * 4;

/// Reads one file of token ids from start to end, a block at a time.
class TokenArrayReader {
 public:
  explicit TokenArrayReader(std::string path) : path_(std::move(path)) {
    in_.open(path_, std::ios::binary);
    TESSERA_CHECK(in_.is_open(), path_, ": cannot open it for reading");
    std::error_code ec;
    const std::uint64_t size = std::filesystem::file_size(path_, ec);
    TESSERA_CHECK(!ec, path_, ": cannot read its size: ", ec.message());
    char head[12] = {};
    in_.read(head, sizeof head);
    const auto got = static_cast<std::uint64_t>(in_.gcount());
    if (got >= 6 && std::memcmp(head, "\x93NUMPY", 6) == 0) {
      open_npy(head, got, size);
    } else if (got >= 12 && llmc_format(head) != nullptr) {
      open_llmc(*llmc_format(head), head, size);
    } else {
      fail(path_, ": neither a NumPy .npy file nor an llm.c token file (its first bytes are not \\x93NUMPY, nor "
           "llm.c's magic 20240520 or 20240801)");
    }
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset_));
    TESSERA_CHECK(in_.good(), path_, ": cannot seek to its first id at byte ", offset_);
  }

  const std::string& path() const { return path_; }
  /// How many ids the file holds.
  std::uint64_t count() const { return count_; }
  /// What the file is: "llm.c, uint16 ids", "NumPy '<i8'".
  const std::string& description() const { return description_; }

  /// The next ids (at most out.size()) as uint32, each checked: not negative and below
  /// `vocab_size`. Returns how many were read: 0 once every id has been.
  std::size_t read(std::span<std::uint32_t> out, std::uint64_t vocab_size) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(out.size(), count_ - next_));
    if (n == 0) return 0;
    raw_.resize(n * id_bytes_);
    in_.read(reinterpret_cast<char*>(raw_.data()), static_cast<std::streamsize>(raw_.size()));
    TESSERA_CHECK(static_cast<std::size_t>(in_.gcount()) == raw_.size(), path_, ": reading ids ", next_, " to ",
                  next_ + n - 1, " failed (the file was shortened while it was read?)");
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint8_t* b = raw_.data() + i * id_bytes_;
      std::uint64_t u = 0;
      for (unsigned k = 0; k < id_bytes_; ++k) u |= std::uint64_t{b[k]} << (8 * k);
      const bool negative = signed_ && (b[id_bytes_ - 1] & 0x80) != 0;
      if (negative || u >= vocab_size) {
        std::int64_t shown = static_cast<std::int64_t>(u);
        if (negative && id_bytes_ < 8) shown = static_cast<std::int64_t>(u) - (std::int64_t{1} << (8 * id_bytes_));
        fail(path_, ": id ", next_ + i, " is ", negative ? std::to_string(shown) : std::to_string(u),
             negative ? ", a negative id" : ", not below the vocabulary size " + std::to_string(vocab_size));
      }
      out[i] = static_cast<std::uint32_t>(u);
    }
    next_ += n;
    return n;
  }

 private:
  static std::int32_t i32_le(const char* p) {
    std::uint32_t u = 0;
    for (int k = 0; k < 4; ++k) u |= std::uint32_t{static_cast<unsigned char>(p[k])} << (8 * k);
    return static_cast<std::int32_t>(u);
  }
  static const LlmcTokenFormat* llmc_format(const char* head) {
    for (const LlmcTokenFormat& f : kLlmcTokenFormats)
      if (i32_le(head) == f.magic) return &f;
    return nullptr;
  }

  void open_llmc(const LlmcTokenFormat& f, const char* head, std::uint64_t size) {
    const std::int32_t version = i32_le(head + 4), count = i32_le(head + 8);
    TESSERA_CHECK(version == f.version, path_, ": an llm.c token file with magic ", f.magic, " is version ", f.version,
                  ", not ", version);
    TESSERA_CHECK(count >= 0, path_, ": llm.c header: a negative id count (", count, ")");
    id_bytes_ = f.id_bytes;
    count_ = static_cast<std::uint64_t>(count);
    offset_ = kLlmcHeaderBytes;
    description_ = std::string("llm.c, uint") + std::to_string(8 * id_bytes_) + " ids";
    check_size(size, "its llm.c header");
  }

  void open_npy(const char* head, std::uint64_t got, std::uint64_t size) {
    TESSERA_CHECK(got >= 10, path_, ": a NumPy .npy file shorter than its preamble");
    const auto major = static_cast<unsigned char>(head[6]);
    TESSERA_CHECK(major >= 1 && major <= 3, path_, ": NumPy format version ", unsigned{major}, " (1, 2 and 3 are read)");
    std::uint64_t header_len = 0, start = 0;
    if (major == 1) {
      header_len = static_cast<unsigned char>(head[8]) | (unsigned{static_cast<unsigned char>(head[9])} << 8);
      start = 10;
    } else {
      TESSERA_CHECK(got >= 12, path_, ": a NumPy .npy file shorter than its preamble");
      header_len = static_cast<std::uint32_t>(i32_le(head + 8));
      start = 12;
    }
    TESSERA_CHECK(start + header_len <= size, path_, ": its NumPy header runs past the end of the file");
    std::string header(static_cast<std::size_t>(header_len), '\0');
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(start));
    in_.read(header.data(), static_cast<std::streamsize>(header_len));
    TESSERA_CHECK(static_cast<std::uint64_t>(in_.gcount()) == header_len, path_, ": cannot read its NumPy header");
    const std::string descr = npy_value(header, "descr");
    TESSERA_CHECK(descr.size() == 5 && descr.front() == '\'' && descr.back() == '\'', path_,
                  ": NumPy header: 'descr' is ", descr, ", not a dtype string");
    const std::string_view dtype(descr.data() + 1, 3);
    TESSERA_CHECK(dtype[0] != '>', path_, ": NumPy dtype '", dtype, "' is big-endian (save the array little-endian: "
                  "array.astype('<", dtype.substr(1), "'))");
    TESSERA_CHECK(dtype[0] == '<' && (dtype[1] == 'u' || dtype[1] == 'i') &&
                      (dtype[2] == '2' || dtype[2] == '4' || dtype[2] == '8'),
                  path_, ": NumPy dtype '", dtype, "' is not an array of token ids (2, 4 or 8-byte integers: '<u2', "
                  "'<u4', '<i4', '<i8', ...)");
    signed_ = dtype[1] == 'i';
    id_bytes_ = static_cast<unsigned>(dtype[2] - '0');
    TESSERA_CHECK(npy_value(header, "fortran_order") == "False", path_,
                  ": NumPy header: 'fortran_order' is not False (a one-dimensional array is saved in C order)");
    const std::string shape = npy_value(header, "shape");
    // "(N,)": one dimension.
    const std::size_t comma = shape.find(',');
    TESSERA_CHECK(shape.size() >= 4 && shape.front() == '(' && shape.back() == ')' && comma != std::string::npos &&
                      shape.find_first_not_of(" )", comma + 1) == std::string::npos,
                  path_, ": NumPy array of shape ", shape, ", not one dimension of token ids");
    const std::string n = shape.substr(1, comma - 1);
    TESSERA_CHECK(!n.empty() && n.size() <= 19 && n.find_first_not_of("0123456789") == std::string::npos, path_,
                  ": NumPy header: shape ", shape);
    count_ = std::stoull(n);
    offset_ = start + header_len;
    description_ = "NumPy '" + std::string(dtype) + "'";
    check_size(size, "its NumPy shape");
  }

  /// The value of `key` in a NumPy header (a Python dict literal), as written: "'<u2'",
  /// "False", "(1000,)".
  std::string npy_value(const std::string& header, const char* key) const {
    const std::string quoted = std::string("'") + key + "'";
    std::size_t at = header.find(quoted);
    TESSERA_CHECK(at != std::string::npos, path_, ": NumPy header has no ", quoted, ": ", header);
    at = header.find(':', at + quoted.size());
    TESSERA_CHECK(at != std::string::npos, path_, ": NumPy header: no value for ", quoted);
    at = header.find_first_not_of(' ', at + 1);
    TESSERA_CHECK(at != std::string::npos, path_, ": NumPy header: no value for ", quoted);
    const std::size_t end = header[at] == '(' ? header.find(')', at) + 1 : header.find_first_of(",}", at);
    TESSERA_CHECK(end != std::string::npos && end > at, path_, ": NumPy header: no end to ", quoted, "'s value");
    return header.substr(at, end - at);
  }

  void check_size(std::uint64_t size, const char* what) const {
    TESSERA_CHECK(count_ <= (size - std::min(size, offset_)) / id_bytes_ && size - offset_ == count_ * id_bytes_, path_,
                  ": ", what, " says ", count_, " ids of ", id_bytes_, " bytes from byte ", offset_, ", ",
                  offset_ + count_ * id_bytes_, " bytes in all; the file holds ", size,
                  size < offset_ + count_ * id_bytes_ ? " (truncated)" : "");
  }

  std::string path_;
  std::ifstream in_;
  std::string description_;
  unsigned id_bytes_ = 2;
  bool signed_ = false;
  std::uint64_t count_ = 0, offset_ = 0, next_ = 0;
  std::vector<std::uint8_t> raw_;
};

}  // namespace tessera::io
