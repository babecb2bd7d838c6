// Errors carry their context: the file, key, tensor or rank they concern.
//
// Library code throws tessera::Error; binaries catch it at main, print its one-line
// message and exit non-zero. TESSERA_CHECK(cond, parts...) builds the message from
// any streamable parts only when the check fails.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace tessera

#define TESSERA_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::tessera::fail(__VA_ARGS__);    \
  } while (0)
