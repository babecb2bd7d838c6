// The number flags of the command-line tools (llama-eval, llama-generate,
// llama-tokenize): the whole text read as a number in range, or one line naming the
// flag, what it takes and what it got.
#pragma once

#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>

#include "tessera/core/error.hpp"

namespace tessera::cli {

/// `text`, the value of `flag`, as a V (an integer or floating-point type) in [lo, hi],
/// finite; else the error "FLAG: expected EXPECTED, got 'TEXT'".
template <class V>
V parse_number(const std::string& flag, const std::string& text, const char* expected,
               V lo = std::numeric_limits<V>::lowest(), V hi = std::numeric_limits<V>::max()) {
  std::size_t used = 0;
  V v{};
  try {
    if constexpr (std::is_floating_point_v<V>) {
      v = static_cast<V>(std::stod(text, &used));
    } else if constexpr (std::is_unsigned_v<V>) {
      const unsigned long long u = text.empty() || text[0] == '-' ? 0 : std::stoull(text, &used);
      if (u > std::numeric_limits<V>::max()) used = 0;
      v = static_cast<V>(u);
    } else {
      v = static_cast<V>(std::stoll(text, &used));
    }
  } catch (const std::exception&) {
    used = 0;
  }
  bool ok = used > 0 && used == text.size() && v >= lo && v <= hi;
  if constexpr (std::is_floating_point_v<V>) ok = ok && std::isfinite(v);
  TESSERA_CHECK(ok, flag, ": expected ", expected, ", got '", text, "'");
  return v;
}

}  // namespace tessera::cli
