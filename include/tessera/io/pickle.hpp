// Python's pickle format, written: enough of it to hand Python tools a tree of dicts,
// lists, pairs, strings, integers, floats, booleans and None (a memory snapshot for
// PyTorch's memory_viz, io/memory_snapshot.hpp).
//
// The opcodes are those of protocol 4 that Python's pickle.load and memory_viz's own
// JavaScript reader both take: PROTO, EMPTY_DICT / EMPTY_LIST with MARK ... SETITEMS /
// APPENDS, TUPLE2, BINUNICODE, BININT, LONG1, BINFLOAT, NONE, NEWTRUE / NEWFALSE,
// MEMOIZE and BINGET / LONG_BINGET (one object written once and named again: the
// allocation contexts a snapshot repeats a thousand times), STOP. No frames: they are
// optional in protocol 4.
//
//   PickleWriter w;
//   w.begin_dict();
//   w.string("segments"); w.begin_list(); ... w.end_list();
//   w.end_dict();
//   std::string bytes = w.finish();
//
// Values are written as they come; the caller keeps dict entries as key, value pairs.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"
#include "tessera/io/utf8.hpp"

namespace tessera::io {

class PickleWriter {
 public:
  PickleWriter() { out_ = {'\x80', '\x04'}; }  // PROTO 4

  void none() { out_ += 'N'; }
  void boolean(bool b) { out_ += b ? '\x88' : '\x89'; }

  void integer(std::int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {  // BININT: 4 bytes, little-endian, signed
      out_ += 'J';
      le(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)), 4);
      return;
    }
    long1(static_cast<std::uint64_t>(v), v < 0);
  }
  void integer(std::uint64_t v) {
    if (v <= INT32_MAX) return integer(static_cast<std::int64_t>(v));
    long1(v, false);
  }
  void integer(int v) { integer(static_cast<std::int64_t>(v)); }

  void real(double v) {  // BINFLOAT: 8 bytes, big-endian
    out_ += 'G';
    const auto bits = std::bit_cast<std::uint64_t>(v);
    for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xFF);
  }

  /// BINUNICODE: a 4-byte little-endian length, then UTF-8 (ill-formed bytes become
  /// U+FFFD, io/utf8.hpp: Python refuses them).
  void string(std::string_view s) {
    const std::string text = valid_utf8(s);
    TESSERA_CHECK(text.size() <= UINT32_MAX, "pickle: a string of ", text.size(), " bytes (4 GiB at most)");
    out_ += 'X';
    le(static_cast<std::uint32_t>(text.size()), 4);
    out_ += text;
  }

  void begin_dict() { out_ += "}("; }  // EMPTY_DICT MARK
  void end_dict() { out_ += 'u'; }     // SETITEMS
  void begin_list() { out_ += "]("; }  // EMPTY_LIST MARK
  void end_list() { out_ += 'e'; }     // APPENDS
  /// Makes the last two values written one pair (a Python tuple).
  void pair() { out_ += '\x86'; }  // TUPLE2

  /// Names the value just written (MEMOIZE); get() writes it again by that name.
  std::uint32_t memoize() {
    out_ += '\x94';
    return memo_++;
  }
  void get(std::uint32_t id) {
    TESSERA_CHECK(id < memo_, "pickle: no value is memoized as ", id);
    if (id < 256) {
      out_ += 'h';  // BINGET
      out_ += static_cast<char>(id);
    } else {
      out_ += 'j';  // LONG_BINGET
      le(id, 4);
    }
  }

  /// The pickle (STOP appended); the writer is empty afterwards.
  std::string finish() {
    out_ += '.';
    std::string done = std::move(out_);
    out_ = {'\x80', '\x04'};
    memo_ = 0;
    return done;
  }

 private:
  void le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xFF);
  }
  /// LONG1: a byte count, then the value in two's complement, little-endian, in as few
  /// bytes as keep its sign.
  void long1(std::uint64_t v, bool negative) {
    int n = 8;
    while (n > 1) {
      const auto top = static_cast<std::uint8_t>(v >> (8 * (n - 1)));
      const auto next = static_cast<std::uint8_t>(v >> (8 * (n - 2)));
      if (negative ? (top == 0xFF && (next & 0x80)) : (top == 0 && !(next & 0x80))) --n;
      else break;
    }
    // A positive value with its top bit set needs a zero byte above it.
    const bool pad = !negative && n == 8 && (v >> 63) != 0;
    out_ += '\x8a';
    out_ += static_cast<char>(n + (pad ? 1 : 0));
    le(v, n);
    if (pad) out_ += '\0';
  }

  std::string out_;
  std::uint32_t memo_ = 0;
};

}  // namespace tessera::io
