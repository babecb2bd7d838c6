// TensorBoard event files with scalar summaries, written and read without a protobuf
// library.
//
// TensorBoard reads a directory of files named events.out.tfevents.*. Each file is a
// sequence of TFRecord records, each holding one serialized tensorflow.Event:
//
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes |
//   length bytes of data          | uint32 masked CRC-32C of the data
//
// where mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. The few messages needed are
// small enough to encode by hand (field numbers from TensorBoard's
// compat/proto/event.proto and summary.proto):
//
//   Event      { double wall_time = 1; int64 step = 2; string file_version = 3;
//                Summary summary = 5; SessionLog session_log = 7; ... }
//   Summary    { repeated Value value = 1; }
//   Value      { string tag = 1; float simple_value = 2; ... }
//   SessionLog { SessionStatus status = 1; ... }   START = 1
//
// A file starts with an event whose file_version is "brain.Event:2", then a SessionLog
// START event (below). Each call to add_scalars writes one event holding every value of
// that step, in a single write() straight to the kernel, so a run that is killed loses
// at most the event being written (a half-written last record, which TensorBoard and
// read_tensorboard_events both notice).
//
// Resuming: a resumed run opens a new file in the same directory; TensorBoard merges
// the files of a directory, reading them in name order. A run that resumes from a
// checkpoint taken after step S replays steps S+1, S+2, ... which an earlier file may
// already hold (the run went on past its last checkpoint before it stopped). So every
// file's second event is a SessionLog START at step S+1 (resumed_from_step = S; step 0
// for a fresh run, whose resumed_from_step is -1), and TensorBoard drops the events
// with step >= S+1 that it read before it: each step shows once, from the run that is
// continued. How each of TensorBoard's readers gets there (checked with TensorBoard
// 2.21):
//  - EventAccumulator (tensorboard.backend.event_processing.event_accumulator) purges
//    on every START;
//  - the accumulator behind `tensorboard --load_fast=false` purges on every START but
//    the first of a run, which it takes for the start of the original session; hence
//    a START in a fresh run's file too, not only in a resumed one's;
//  - the data server behind the default `tensorboard --logdir` ignores START, but
//    when the steps go back it drops what it holds from the lower step on, which
//    comes to the same.
// A fresh run started over in a directory that holds an older run's files (rather than
// resumed) therefore hides all of that run's events: it replaces it.
//
// To keep name order the order of creation, the seconds in a new file's name are later
// than those of every events file already in the directory.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"

namespace tessera::train {

/// One scalar read back from an events file.
struct TensorBoardScalar {
  std::int64_t step = 0;
  std::string tag;
  double value = 0;  // stored as a float: this is the float's value
  double wall_time = 0;
};

/// One event read back from an events file: the parts of it this header writes.
struct TensorBoardEvent {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;  // empty unless this is the file's version event
  int session_status = 0;    // SessionLog status: 0 none, 1 START, 2 STOP, 3 CHECKPOINT
  std::vector<std::pair<std::string, double>> scalars;  // (tag, simple_value)
};

namespace detail::tensorboard {

inline constexpr std::string_view kFileVersion = "brain.Event:2";
inline constexpr std::string_view kFilePrefix = "events.out.tfevents.";
inline constexpr int kSessionStart = 1;

// Protobuf wire types.
inline constexpr unsigned kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

/// The CRC TFRecord stores: rotated and offset, because a CRC of data that itself
/// contains CRCs is weak (the TFRecord format's own reason).
inline std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t c = io::crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

inline void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFu));
}

inline std::uint64_t get_le(const char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

inline void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7Fu) | 0x80u));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

inline void put_key(std::string& out, unsigned field, unsigned wire_type) { put_varint(out, (field << 3) | wire_type); }

inline void put_double(std::string& out, unsigned field, double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

inline void put_float(std::string& out, unsigned field, float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

/// An int64 as protobuf writes it: a negative value is its two's complement, ten bytes.
inline void put_int64(std::string& out, unsigned field, std::int64_t v) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<std::uint64_t>(v));
}

inline void put_bytes(std::string& out, unsigned field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

/// The TFRecord record holding `data`.
inline std::string frame(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  put_le(record, data.size(), 8);
  put_le(record, masked_crc32c(record.data(), 8), 4);
  record.append(data);
  put_le(record, masked_crc32c(data.data(), data.size()), 4);
  return record;
}

/// Reads protobuf fields from one message, for the reader below. Errors name the file
/// and the byte offset of the record the message came from.
class FieldReader {
 public:
  FieldReader(std::string_view bytes, const std::string& file, std::uint64_t record_offset)
      : bytes_(bytes), file_(file), record_offset_(record_offset) {}

  bool done() const { return pos_ >= bytes_.size(); }

  /// The next field's number and wire type.
  std::pair<std::uint64_t, unsigned> key() {
    const std::uint64_t k = varint();
    const std::uint64_t field = k >> 3;
    if (field == 0) bad("field number 0");
    return {field, static_cast<unsigned>(k & 7u)};
  }

  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) bad("a varint runs past the end of its message");
      const auto b = static_cast<unsigned char>(bytes_[pos_++]);
      v |= std::uint64_t{b & 0x7Fu} << shift;
      if ((b & 0x80u) == 0) return v;
    }
    bad("a varint longer than ten bytes");
  }

  std::uint64_t fixed(int bytes) {
    if (bytes_.size() - pos_ < static_cast<std::size_t>(bytes)) bad("a fixed-width field runs past the end of its message");
    const std::uint64_t v = get_le(bytes_.data() + pos_, bytes);
    pos_ += static_cast<std::size_t>(bytes);
    return v;
  }

  std::string_view length_delimited() {
    const std::uint64_t n = varint();
    if (n > bytes_.size() - pos_) bad("a length-delimited field runs past the end of its message");
    const std::string_view v = bytes_.substr(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return v;
  }

  double read_double() {
    const std::uint64_t bits = fixed(8);
    double v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }

  float read_float() {
    const auto bits = static_cast<std::uint32_t>(fixed(4));
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }

  /// Passes over a field this reader does not use, whatever its type: protobuf lets
  /// writers add fields (TensorFlow adds source_metadata, metadata, ...).
  void skip(unsigned wire_type) {
    switch (wire_type) {
      case kVarint: (void)varint(); return;
      case kFixed64: (void)fixed(8); return;
      case kLengthDelimited: (void)length_delimited(); return;
      case kFixed32: (void)fixed(4); return;
      default: bad("wire type " + std::to_string(wire_type) + " (groups are not used by these messages)");
    }
  }

  void expect(unsigned wire_type, unsigned wanted, const char* field) {
    if (wire_type != wanted) bad(std::string(field) + " has wire type " + std::to_string(wire_type));
  }

  FieldReader sub(std::string_view bytes) const { return FieldReader(bytes, file_, record_offset_); }

  [[noreturn]] void bad(const std::string& what) const {
    fail(file_, ": the event in the record at byte offset ", record_offset_, " is malformed: ", what);
  }

 private:
  std::string_view bytes_;
  const std::string& file_;
  std::uint64_t record_offset_;
  std::size_t pos_ = 0;
};

inline TensorBoardEvent decode_event(FieldReader r) {
  TensorBoardEvent e;
  while (!r.done()) {
    const auto [field, wire] = r.key();
    if (field == 1) {
      r.expect(wire, kFixed64, "Event.wall_time");
      e.wall_time = r.read_double();
    } else if (field == 2) {
      r.expect(wire, kVarint, "Event.step");
      e.step = static_cast<std::int64_t>(r.varint());
    } else if (field == 3) {
      r.expect(wire, kLengthDelimited, "Event.file_version");
      e.file_version = std::string(r.length_delimited());
    } else if (field == 5) {
      r.expect(wire, kLengthDelimited, "Event.summary");
      FieldReader summary = r.sub(r.length_delimited());
      while (!summary.done()) {
        const auto [sf, sw] = summary.key();
        if (sf != 1) {
          summary.skip(sw);
          continue;
        }
        summary.expect(sw, kLengthDelimited, "Summary.value");
        FieldReader value = summary.sub(summary.length_delimited());
        std::string tag;
        bool has_simple = false;
        double simple = 0;
        while (!value.done()) {
          const auto [vf, vw] = value.key();
          if (vf == 1) {
            value.expect(vw, kLengthDelimited, "Summary.Value.tag");
            tag = std::string(value.length_delimited());
          } else if (vf == 2) {
            value.expect(vw, kFixed32, "Summary.Value.simple_value");
            simple = static_cast<double>(value.read_float());
            has_simple = true;
          } else {
            value.skip(vw);
          }
        }
        // Values of other kinds (images, histograms, tensors) are not scalars here.
        if (has_simple) e.scalars.emplace_back(std::move(tag), simple);
      }
    } else if (field == 7) {
      r.expect(wire, kLengthDelimited, "Event.session_log");
      FieldReader log = r.sub(r.length_delimited());
      while (!log.done()) {
        const auto [lf, lw] = log.key();
        if (lf == 1) {
          log.expect(lw, kVarint, "SessionLog.status");
          e.session_status = static_cast<int>(log.varint());
        } else {
          log.skip(lw);
        }
      }
    } else {
      r.skip(wire);
    }
  }
  return e;
}

/// The seconds field of an events file's name ("events.out.tfevents.<seconds>...."),
/// or -1 when the name has none.
inline std::int64_t seconds_in_name(const std::string& name) {
  if (name.rfind(kFilePrefix, 0) != 0) return -1;
  std::int64_t s = 0;
  std::size_t i = kFilePrefix.size();
  const std::size_t start = i;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i - start < 18; ++i) s = s * 10 + (name[i] - '0');
  return i == start ? -1 : s;
}

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace detail::tensorboard

/// Writes scalars to a new TensorBoard events file in a directory.
class TensorBoardWriter {
 public:
  /// Creates `dir` if needed and a new events file in it. resumed_from_step is the step
  /// of the checkpoint a resumed run starts from (-1: a fresh run); TensorBoard shows
  /// nothing that earlier files in `dir` hold from the step after it on.
  explicit TensorBoardWriter(const std::string& dir, std::int64_t resumed_from_step = -1) {
    namespace tb = detail::tensorboard;
    namespace fs = std::filesystem;
    TESSERA_CHECK(resumed_from_step >= -1 && resumed_from_step < std::numeric_limits<std::int64_t>::max(), dir, ": TensorBoardWriter: resumed_from_step is ", resumed_from_step,
                  "; it is -1 for a fresh run or the step a resumed run starts from");
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) fail(dir, ": cannot create the TensorBoard directory: ", ec.message());

    // Later seconds than every events file already here, so that name order (the order
    // TensorBoard reads files in) is creation order even for a run resumed within the
    // second its predecessor started.
    auto seconds = static_cast<std::int64_t>(tb::now_seconds());
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      seconds = std::max(seconds, tb::seconds_in_name(it->path().filename().string()) + 1);
    if (ec) fail(dir, ": cannot list the TensorBoard directory: ", ec.message());

    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
    const std::string pid = std::to_string(::getpid());

    // O_EXCL: never append to (or truncate) a file another writer has; on a clash, the
    // next second.
    for (int attempt = 0;; ++attempt, ++seconds) {
      path_ = (fs::path(dir) / (std::string(tb::kFilePrefix) + std::to_string(seconds) + "." + host + "." + pid +
                                ".tessera"))
                  .string();
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ >= 0) break;
      const int err = errno;
      if (err != EEXIST || attempt >= 100) fail(path_, ": cannot create the TensorBoard events file: ", std::strerror(err));
    }

    // A constructor that throws runs no destructor: close the file here.
    try {
      std::string version;
      tb::put_double(version, 1, tb::now_seconds());
      tb::put_bytes(version, 3, tb::kFileVersion);
      write_event(version);

      std::string status;
      tb::put_key(status, 1, tb::kVarint);
      tb::put_varint(status, tb::kSessionStart);
      std::string start;
      tb::put_double(start, 1, tb::now_seconds());
      tb::put_int64(start, 2, resumed_from_step + 1);
      tb::put_bytes(start, 7, status);
      write_event(start);
    } catch (...) {
      close_fd();
      throw;
    }
  }

  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  TensorBoardWriter(TensorBoardWriter&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}
  TensorBoardWriter& operator=(TensorBoardWriter&& o) noexcept {
    if (this != &o) {
      close_fd();
      path_ = std::move(o.path_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~TensorBoardWriter() { close_fd(); }

  /// The events file this writer writes.
  const std::string& path() const { return path_; }

  /// Writes one event for `step` holding every (tag, value) pair, each as a float
  /// simple_value (what TensorBoard's scalar plugin reads). `wall_time` is seconds since
  /// the Unix epoch.
  void add_scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time) {
    namespace tb = detail::tensorboard;
    std::string summary;
    for (const auto& [tag, value] : values) {
      std::string v;
      tb::put_bytes(v, 1, tag);
      tb::put_float(v, 2, static_cast<float>(value));
      tb::put_bytes(summary, 1, v);
    }
    std::string event;
    tb::put_double(event, 1, wall_time);
    tb::put_int64(event, 2, step);
    tb::put_bytes(event, 5, summary);
    write_event(event);
  }

  /// Makes what was written durable. Every event already reaches the kernel when it is
  /// written (nothing is buffered here), so a killed process loses nothing; this also
  /// survives the machine going down.
  void flush() {
    TESSERA_CHECK(fd_ >= 0, "TensorBoardWriter: flush on a moved-from writer");
    if (::fsync(fd_) != 0) {
      const int err = errno;
      fail(path_, ": fsync of the TensorBoard events file failed: ", std::strerror(err));
    }
  }

 private:
  void write_event(std::string_view event) {
    TESSERA_CHECK(fd_ >= 0, "TensorBoardWriter: write on a moved-from writer");
    const std::string record = detail::tensorboard::frame(event);
    const char* p = record.data();
    std::size_t left = record.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        fail(path_, ": write to the TensorBoard events file failed: ", std::strerror(err));
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }

  void close_fd() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  std::string path_;
  int fd_ = -1;
};

/// Every event of an events file, in order. Both CRCs of every record are checked; a
/// mismatch, a truncated record or a malformed event throws, naming the file and the
/// byte offset of the record.
inline std::vector<TensorBoardEvent> read_tensorboard_events(const std::string& file) {
  namespace tb = detail::tensorboard;
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in, file, ": cannot open the TensorBoard events file");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TESSERA_CHECK(!in.bad(), file, ": cannot read the TensorBoard events file");

  std::vector<TensorBoardEvent> events;
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    const std::size_t left = bytes.size() - pos;
    TESSERA_CHECK(left >= 12, file, ": truncated record at byte offset ", pos, ": ", left,
                  " bytes where a 12-byte record header belongs");
    const std::uint64_t length = tb::get_le(bytes.data() + pos, 8);
    const auto length_crc = static_cast<std::uint32_t>(tb::get_le(bytes.data() + pos + 8, 4));
    TESSERA_CHECK(length_crc == tb::masked_crc32c(bytes.data() + pos, 8), file,
                  ": CRC mismatch in the length of the record at byte offset ", pos);
    TESSERA_CHECK(length <= left - 12 && left - 12 - length >= 4, file, ": truncated record at byte offset ", pos,
                  ": it holds ", length, " bytes of data but only ", left - 12, " bytes follow its header");
    const char* data = bytes.data() + pos + 12;
    const auto data_crc = static_cast<std::uint32_t>(tb::get_le(data + length, 4));
    TESSERA_CHECK(data_crc == tb::masked_crc32c(data, static_cast<std::size_t>(length)), file,
                  ": CRC mismatch in the data of the record at byte offset ", pos);
    events.push_back(tb::decode_event(tb::FieldReader(std::string_view(data, static_cast<std::size_t>(length)), file, pos)));
    pos += 12 + static_cast<std::size_t>(length) + 4;
  }
  return events;
}

/// Every scalar of an events file, in the order written (the checks of
/// read_tensorboard_events).
inline std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& file) {
  std::vector<TensorBoardScalar> out;
  for (auto& e : read_tensorboard_events(file))
    for (auto& [tag, value] : e.scalars) out.push_back(TensorBoardScalar{e.step, std::move(tag), value, e.wall_time});
  return out;
}

}  // namespace tessera::train
