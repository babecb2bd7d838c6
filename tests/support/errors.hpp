// Checking the message of a tessera::Error, for tests of bad input.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "tessera/core/error.hpp"

namespace tessera::testing {

/// The message of the tessera::Error that `f` throws, or a marker when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tessera::Error& e) {
    return e.what();
  }
  return "<no tessera::Error thrown>";
}

}  // namespace tessera::testing

/// Checks that `expr` throws a tessera::Error whose message contains `text`.
#define CHECK_ERROR_CONTAINS(expr, text)                                            \
  do {                                                                              \
    std::string message_ = ::tessera::testing::error_of([&] { (void)(expr); });     \
    INFO("message: ", message_);                                                    \
    CHECK(message_.find(text) != std::string::npos);                                \
  } while (0)
