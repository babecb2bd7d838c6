// Making bytes valid UTF-8 for printing, the way Python's
// bytes.decode("utf-8", errors="replace") does (which Hugging Face's decode uses).
//
// A model samples token ids, not characters: a byte-level vocabulary can emit a lead
// byte without its continuation bytes, a stray continuation byte, or a sequence that
// is not UTF-8 at all (an overlong form, a surrogate, a code point above U+10FFFF).
// Printed raw, those bytes garble a terminal or break a JSON log. valid_utf8 replaces
// each maximal subpart of an ill-formed sequence with U+FFFD, the practice the Unicode
// standard recommends (chapter 3, "U+FFFD Substitution of Maximal Subparts") and that
// Python, WHATWG and W3C follow: the longest run that starts like a well-formed
// sequence but stops short becomes one U+FFFD, and every other offending byte its own.
// So E2 82 at the end is one U+FFFD, E2 28 A1 is U+FFFD "(" U+FFFD, and the overlong
// C0 80, the surrogate ED A0 80 and F4 90 80 80 (above U+10FFFF) are one U+FFFD per
// byte, since no well-formed sequence starts C0, ED A0 or F4 90.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tessera::io {

/// `bytes` with every ill-formed UTF-8 subsequence replaced by U+FFFD (EF BF BD), as
/// Python's decode("utf-8", errors="replace"); valid UTF-8 comes back unchanged.
inline std::string valid_utf8(std::string_view bytes) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  const std::size_t n = bytes.size();
  auto byte = [&](std::size_t i) { return static_cast<unsigned char>(bytes[i]); };
  std::size_t i = 0;
  while (i < n) {
    const unsigned char lead = byte(i);
    if (lead < 0x80) {
      out.push_back(static_cast<char>(lead));
      ++i;
      continue;
    }
    // The number of continuation bytes the lead byte announces, and the range its first
    // continuation byte must fall in: narrower than 80..BF after E0 and F0 (which would
    // otherwise allow overlong forms), ED (surrogates) and F4 (above U+10FFFF).
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      need = 1;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      need = 2;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      need = 3;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    } else {
      // 80..BF (a continuation byte with no lead), C0, C1 (only ever overlong), F5..FF.
      out += kReplacement;
      ++i;
      continue;
    }
    std::size_t len = 1;  // bytes of the sequence that are well-formed so far
    while (len <= need && i + len < n) {
      const unsigned char c = byte(i + len);
      if (c < lo || c > hi) break;
      ++len;
      lo = 0x80, hi = 0xBF;  // only the first continuation byte has a narrower range
    }
    if (len == need + 1) {
      out.append(bytes.substr(i, len));
    } else {
      // A maximal subpart: a prefix of a well-formed sequence cut short by a byte that
      // cannot continue it (which is looked at again, as the start of what follows) or
      // by the end of the input.
      out += kReplacement;
    }
    i += len;
  }
  return out;
}

}  // namespace tessera::io
