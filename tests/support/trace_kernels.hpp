// The kernels of a trace whose functor name starts with a prefix: how many, and the
// bytes they move. For tests of trace rewrites (plan/eager.hpp and the runtimes').
#pragma once

#include <cstdint>
#include <string_view>

#include "tessera/backend/trace.hpp"

namespace tessera::test {

inline std::int64_t kernels_named(const trace::Trace& t, std::string_view prefix) {
  std::int64_t n = 0;
  for (const auto& k : t.all<trace::Kernel>()) n += std::string_view(k.functor).starts_with(prefix);
  return n;
}

inline double bytes_of_kernels_named(const trace::Trace& t, std::string_view prefix) {
  double b = 0;
  for (const auto& k : t.all<trace::Kernel>())
    if (std::string_view(k.functor).starts_with(prefix)) b += k.traffic.bytes();
  return b;
}

}  // namespace tessera::test
