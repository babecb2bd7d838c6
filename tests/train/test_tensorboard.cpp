// TensorBoard events files: scalars written and read back, the TFRecord framing checked
// byte by byte against the format, damaged files refused, and the SessionLog START
// event that makes TensorBoard drop the steps a resumed run replays.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "tessera/io/crc32.hpp"
#include "tessera/train/tensorboard.hpp"

namespace test_tensorboard {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
namespace fs = std::filesystem;
using tessera::test::TempDir;
using Values = std::vector<std::pair<std::string, double>>;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void spit(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Written out here from the format's definition rather than taken from the header, so
// that the framing test checks the header against the format, not against itself.
std::uint32_t masked(const std::string& bytes) {
  const std::uint32_t c = io::crc32c(bytes.data(), bytes.size());
  return static_cast<std::uint32_t>(((c >> 15) | (c << 17)) + 0xa282ead8u);
}

std::uint64_t le(const std::string& bytes, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= std::uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
  return v;
}

// The events files in `dir`, in name order (the order TensorBoard reads them in).
std::vector<std::string> events_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

// The first two records of every file: the version event (24 bytes of data) and the
// START event (15 bytes while its step fits one varint byte), each with 16 of framing.
constexpr std::size_t kVersionRecord = 40;
constexpr std::size_t kHeaderRecords = kVersionRecord + 31;

}  // namespace

TEST_CASE("tensorboard: scalars of several steps and tags round-trip") {
  TempDir tmp;
  const std::string dir = tmp.file("runs/a");  // a directory that does not exist yet
  std::string path;
  {
    train::TensorBoardWriter w(dir);
    path = w.path();
    for (std::int64_t step = 1; step <= 4; ++step)
      w.add_scalars(step, {{"loss", 4.0 - 0.25 * static_cast<double>(step)}, {"lr", 3e-4 * static_cast<double>(step)},
                           {"grad/norm", 0.1}},
                    1.7e9 + static_cast<double>(step) + 0.125);
    w.add_scalars(-3, {{"loss", 1.5}}, 1.8e9);  // a negative step is a ten-byte varint
    w.flush();
  }
  const std::string name = fs::path(path).filename().string();
  CHECK(fs::path(path).parent_path() == fs::path(dir));
  CHECK(name.rfind("events.out.tfevents.", 0) == 0);
  CHECK(name.find("." + std::to_string(::getpid()) + ".tessera") != std::string::npos);
  CHECK(name.size() > std::string(".tessera").size());
  CHECK(name.substr(name.size() - 8) == ".tessera");

  const auto events = train::read_tensorboard_events(path);
  REQUIRE(events.size() == 7);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[0].scalars.empty());
  CHECK(events[0].wall_time > 1.6e9);
  CHECK(events[0].session_status == 0);
  // A fresh run's START is at step 0 (see the header for why a fresh run has one).
  CHECK(events[1].session_status == 1);
  CHECK(events[1].step == 0);
  CHECK(events[1].scalars.empty());
  for (std::size_t i = 2; i < events.size(); ++i) CHECK(events[i].session_status == 0);

  const auto s = train::read_tensorboard_scalars(path);
  REQUIRE(s.size() == 13);
  for (std::int64_t step = 1; step <= 4; ++step) {
    const auto i = static_cast<std::size_t>(3 * (step - 1));
    CHECK(s[i].step == step);
    CHECK(s[i].tag == "loss");
    CHECK(s[i].value == 4.0 - 0.25 * static_cast<double>(step));  // exact in a float
    CHECK(s[i + 1].tag == "lr");
    CHECK(s[i + 1].value == static_cast<double>(static_cast<float>(3e-4 * static_cast<double>(step))));
    CHECK(s[i + 2].tag == "grad/norm");
    CHECK(s[i + 2].value == static_cast<double>(0.1f));
    for (std::size_t j = i; j < i + 3; ++j) CHECK(s[j].wall_time == 1.7e9 + static_cast<double>(step) + 0.125);
  }
  CHECK(s[12].step == -3);
  CHECK(s[12].tag == "loss");
  CHECK(s[12].value == 1.5);
  CHECK(s[12].wall_time == 1.8e9);
}

TEST_CASE("tensorboard: the first record is framed as TFRecord defines it") {
  TempDir tmp;
  std::string path;
  {
    train::TensorBoardWriter w(tmp.file("run"));
    path = w.path();
  }
  const std::string bytes = slurp(path);
  // Event{wall_time (field 1, fixed64): 9 bytes; file_version (field 3, bytes): key,
  // length 13, "brain.Event:2"}: 24 bytes of data, 40 with the framing; then the
  // START event.
  REQUIRE(bytes.size() == kHeaderRecords);
  CHECK(le(bytes, 0, 8) == 24);
  CHECK(le(bytes, 8, 4) == masked(bytes.substr(0, 8)));
  const std::string data = bytes.substr(12, 24);
  CHECK(static_cast<unsigned char>(data[0]) == 0x09);  // field 1, wire type 1
  double wall_time;
  const std::uint64_t bits = le(data, 1, 8);
  std::memcpy(&wall_time, &bits, sizeof wall_time);
  CHECK(wall_time > 1.6e9);
  CHECK(static_cast<unsigned char>(data[9]) == 0x1a);  // field 3, wire type 2
  CHECK(static_cast<unsigned char>(data[10]) == 13);
  CHECK(data.substr(11) == "brain.Event:2");
  CHECK(le(bytes, 36, 4) == masked(data));

  // Event{wall_time; step 0; session_log (field 7) {status (field 1) START = 1}}.
  CHECK(le(bytes, 40, 8) == 15);
  CHECK(le(bytes, 48, 4) == masked(bytes.substr(40, 8)));
  const std::string start = bytes.substr(52, 15);
  CHECK(static_cast<unsigned char>(start[0]) == 0x09);
  CHECK(start.substr(9) == std::string("\x10\x00\x3a\x02\x08\x01", 6));
  CHECK(le(bytes, 67, 4) == masked(start));
  // A check of the check: the CRC-32C of "123456789" is E3069283 (the standard's value).
  CHECK(io::crc32c("123456789", 9) == 0xE3069283u);
}

TEST_CASE("tensorboard: a scalar event has the wire layout TensorBoard expects") {
  TempDir tmp;
  std::string path;
  {
    train::TensorBoardWriter w(tmp.file("run"));
    path = w.path();
    w.add_scalars(5, {{"ab", 0.5}}, 2.0);
  }
  const std::string bytes = slurp(path).substr(kHeaderRecords);
  REQUIRE(bytes.size() >= 12);
  const std::uint64_t n = le(bytes, 0, 8);
  REQUIRE(bytes.size() == 12 + n + 4);
  const std::string data = bytes.substr(12, n);
  // wall_time 2.0; step 5; summary { value { tag "ab"; simple_value 0.5f } }.
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\x00\x40", 9) + "\x10\x05" +
                               "\x2a\x0b" + "\x0a\x09" + "\x0a\x02" "ab" + std::string("\x15\x00\x00\x00\x3f", 5);
  CHECK(data == expected);
  CHECK(le(bytes, 12 + n, 4) == masked(data));
}

TEST_CASE("tensorboard: a damaged or truncated file is refused, naming the file and the record") {
  TempDir tmp;
  std::string path;
  {
    train::TensorBoardWriter w(tmp.file("run"));
    path = w.path();
    w.add_scalars(1, {{"loss", 2.0}}, 1.0);
    w.add_scalars(2, {{"loss", 1.0}}, 2.0);
  }
  const std::string good = slurp(path);
  REQUIRE(train::read_tensorboard_scalars(path).size() == 2);
  const std::size_t second = kHeaderRecords;
  const std::size_t third = second + 12 + le(good, second, 8) + 4;
  REQUIRE(third < good.size());

  SUBCASE("a flipped byte in a record's data") {
    std::string bad = good;
    bad[second + 12 + 3] ^= 0x01;
    spit(path, bad);
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), path);
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), "CRC mismatch in the data of the record at byte offset " + std::to_string(second));
  }
  SUBCASE("a flipped byte in a record's length") {
    std::string bad = good;
    bad[third] ^= 0x04;
    spit(path, bad);
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), path);
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path),
                         "CRC mismatch in the length of the record at byte offset " + std::to_string(third));
  }
  SUBCASE("a flipped byte in a stored CRC") {
    std::string bad = good;
    bad[third - 1] ^= 0x80;
    spit(path, bad);
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), "CRC mismatch in the data of the record at byte offset " + std::to_string(second));
  }
  SUBCASE("the last record cut short, as a killed run leaves it") {
    for (std::size_t cut : {std::size_t{1}, std::size_t{4}, good.size() - third - 12, good.size() - third - 5}) {
      CAPTURE(cut);
      spit(path, good.substr(0, good.size() - cut));
      CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), path);
      CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path),
                           "truncated record at byte offset " + std::to_string(third));
    }
  }
  SUBCASE("a missing file") {
    CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(tmp.file("nothing")), tmp.file("nothing"));
  }
}

TEST_CASE("tensorboard: the reader skips fields it does not use, by wire type") {
  namespace tb = train::detail::tensorboard;
  TempDir tmp;
  // An event as a newer writer might send it: extra fields of every wire type around
  // the ones read, and a Value with metadata (field 9) before its simple_value.
  std::string value;
  tb::put_bytes(value, 9, "plugin data");
  tb::put_bytes(value, 1, "acc");
  tb::put_float(value, 2, 0.75f);
  tb::put_key(value, 15, 0), tb::put_varint(value, 300);
  std::string summary;
  tb::put_bytes(summary, 1, value);
  std::string event;
  tb::put_key(event, 99, 0), tb::put_varint(event, ~std::uint64_t{0});
  tb::put_double(event, 1, 3.5);
  tb::put_key(event, 20, 5), event.append("\x01\x02\x03\x04", 4);
  tb::put_int64(event, 2, 123456789012LL);
  tb::put_double(event, 21, -1.0);
  tb::put_bytes(event, 10, "source metadata");
  tb::put_bytes(event, 5, summary);
  const std::string path = tmp.write("events.out.tfevents.1.host.1.test", tb::frame(event));
  const auto s = train::read_tensorboard_scalars(path);
  REQUIRE(s.size() == 1);
  CHECK(s[0].step == 123456789012LL);
  CHECK(s[0].tag == "acc");
  CHECK(s[0].value == 0.75);
  CHECK(s[0].wall_time == 3.5);

  // A group (wire type 3) is not a thing these messages hold: an error, not a guess.
  std::string group;
  tb::put_key(group, 4, 3);
  spit(path, tb::frame(group));
  CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), path);
  CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), "record at byte offset 0 is malformed: wire type 3");
  // A length running past its message.
  std::string overrun;
  tb::put_key(overrun, 5, 2), tb::put_varint(overrun, 50), overrun += "short";
  spit(path, tb::frame(overrun));
  CHECK_ERROR_CONTAINS(train::read_tensorboard_scalars(path), "runs past the end of its message");
}

TEST_CASE("tensorboard: a resumed run starts a later file with a START event at the step after the checkpoint") {
  TempDir tmp;
  const std::string dir = tmp.file("run");
  std::string first, second;
  {
    train::TensorBoardWriter w(dir);
    first = w.path();
    for (std::int64_t step = 1; step <= 8; ++step) w.add_scalars(step, {{"loss", 10.0 - static_cast<double>(step)}}, 1.0);
  }
  {
    // Same process, same second: the name must still be new and sort after the first.
    train::TensorBoardWriter w(dir, 5);
    second = w.path();
    for (std::int64_t step = 6; step <= 10; ++step) w.add_scalars(step, {{"loss", 20.0 - static_cast<double>(step)}}, 2.0);
  }
  CHECK(first != second);
  CHECK(events_files(dir) == std::vector<std::string>{first, second});
  CHECK(train::read_tensorboard_events(first).size() == 10);  // the first file is untouched

  const auto events = train::read_tensorboard_events(second);
  REQUIRE(events.size() == 7);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[1].session_status == 1);  // SessionLog.START
  CHECK(events[1].step == 6);
  CHECK(events[1].scalars.empty());
  CHECK(events[1].file_version.empty());
  CHECK(events[2].step == 6);
  CHECK(events[2].session_status == 0);

  // The START event's bytes: wall_time, step 6, session_log (field 7) { status 1 }.
  const std::string bytes = slurp(second).substr(kVersionRecord);
  const std::uint64_t n = le(bytes, 0, 8);
  const std::string data = bytes.substr(12, n);
  REQUIRE(n == 9 + 2 + 4);
  CHECK(static_cast<unsigned char>(data[0]) == 0x09);
  CHECK(data.substr(9) == std::string("\x10\x06\x3a\x02\x08\x01", 6));

  // A resume from step 0 starts at step 1; a large step is a longer varint.
  train::TensorBoardWriter w0(dir, 0);
  const auto e0 = train::read_tensorboard_events(w0.path());
  REQUIRE(e0.size() == 2);
  CHECK(e0[1].session_status == 1);
  CHECK(e0[1].step == 1);
  train::TensorBoardWriter big(dir, 5'000'000'000LL);
  const auto eb = train::read_tensorboard_events(big.path());
  REQUIRE(eb.size() == 2);
  CHECK(eb[1].step == 5'000'000'001LL);
  CHECK(events_files(dir).size() == 4);

  // Below -1 is not a step: refused before any file is made.
  CHECK_ERROR_CONTAINS(train::TensorBoardWriter(dir, -2), "resumed_from_step is -2");
  CHECK_ERROR_CONTAINS(train::TensorBoardWriter(dir, -2), dir);
  CHECK(events_files(dir).size() == 4);
}

TEST_CASE("tensorboard: a new file's name sorts after every events file already in the directory") {
  // Another host's file stamped later than this clock (skew, or a run started within
  // the same second): TensorBoard reads files in name order, so the new file must
  // still come after it for its START to apply to what that file holds.
  TempDir tmp;
  const std::string dir = tmp.file("run");
  fs::create_directories(dir);
  const std::string other = tmp.write("run/events.out.tfevents.4000000000.otherhost.1.v2", "");
  train::TensorBoardWriter w(dir, 3);
  CHECK(fs::path(w.path()).filename().string().rfind("events.out.tfevents.4000000001.", 0) == 0);
  CHECK(events_files(dir) == std::vector<std::string>{other, w.path()});
}

TEST_CASE("tensorboard: a directory that cannot be made is an error naming it") {
  TempDir tmp;
  const std::string file = tmp.write("plain", "x");
  CHECK_ERROR_CONTAINS(train::TensorBoardWriter(file + "/sub"), file + "/sub");
}

}  // namespace test_tensorboard
