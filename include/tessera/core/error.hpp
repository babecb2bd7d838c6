// Errors carry their context: the file, key, tensor or rank they concern.
//
// Library code throws tessera::Error; binaries catch it at main, print its one-line
// message and exit non-zero. TESSERA_CHECK(cond, parts...) builds the message from
// any streamable parts only when the check fails.
#pragma once

#include <charconv>
#include <concepts>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Memory ran out, host or device. Its own type so that a caller who knows what the
/// memory was for (a binary's phase, the keys that size it) can catch it and say so,
/// where the allocator knows only the bytes and the tensor.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

namespace detail {
/// A part concat appends without a stream: text, a char, or an integer (not bool), each
/// written as operator<< writes it under the "C" locale.
template <class P>
concept AppendsDirectly =
    std::convertible_to<const P&, std::string_view> || std::same_as<std::remove_cvref_t<P>, char> ||
    (std::integral<std::remove_cvref_t<P>> && !std::same_as<std::remove_cvref_t<P>, bool> &&
     !std::same_as<std::remove_cvref_t<P>, signed char> && !std::same_as<std::remove_cvref_t<P>, unsigned char>);

template <class P>
void append(std::string& out, const P& part) {
  if constexpr (std::convertible_to<const P&, std::string_view>) {
    out += std::string_view(part);
  } else if constexpr (std::same_as<P, char>) {
    out += part;
  } else {
    char digits[24];  // the longest 64-bit integer, sign included, is 20 characters
    const auto end = std::to_chars(digits, digits + sizeof digits, part).ptr;
    out.append(digits, end);
  }
}

/// The parts written one after another, as `(stream << ... << parts)` writes them.
/// Text and integers are appended directly: a trace's operation names (plan/cost.hpp)
/// are built this way thousands of times a plan, where a stream's construction was a
/// tenth of llama-plan's time; any other part (a double, a type with its own operator<<)
/// takes the stream.
template <class... Parts>
std::string concat(Parts&&... parts) {
  if constexpr ((AppendsDirectly<Parts> && ...)) {
    std::string out;
    (append(out, parts), ...);
    return out;
  } else {
    std::ostringstream out;
    (out << ... << std::forward<Parts>(parts));
    return out.str();
  }
}
}  // namespace detail

namespace detail {
/// One part of an error message, by reference: text the caller holds (a literal, a
/// string), or a value and the function that writes it as `concat` would (an integer, a
/// double, a type with its own operator<<). Trivially destructible, so that a call of
/// `fail` only fills an array and makes one call.
struct MessagePart {
  MessagePart(std::string_view text) : text(text) {}
  template <class P>
    requires(!std::convertible_to<const P&, std::string_view>)
  MessagePart(const P& part) : value(&part), write(&write_part<P>) {}

  template <class P>
  static void write_part(std::string& out, const void* part) {
    out += concat(*static_cast<const P*>(part));
  }

  std::string_view text;
  const void* value = nullptr;
  void (*write)(std::string&, const void*) = nullptr;
};

/// The message of `fail`, joined: one function for every message, out of the callers'
/// way (cold: never on a path that does not fail).
[[gnu::cold, gnu::noinline]] inline std::string join_message(std::initializer_list<MessagePart> parts) {
  std::string message;
  for (const auto& part : parts) {
    if (part.write != nullptr) {
      part.write(message, part.value);
    } else {
      message += part.text;
    }
  }
  return message;
}

[[noreturn, gnu::cold, gnu::noinline]] inline void throw_error(std::initializer_list<MessagePart> parts) {
  throw Error(join_message(parts));
}

[[noreturn, gnu::cold, gnu::noinline]] inline void throw_out_of_memory(std::initializer_list<MessagePart> parts) {
  throw OutOfMemory(join_message(parts));
}
}  // namespace detail

/// Throws an Error whose message is the parts written one after another (as `concat`
/// writes them). Each part is written on its own, so a build compiles one short function
/// per list of part types and one writer per part type, not a message builder for every
/// call's types; a stream manipulator (std::hex) does not carry from one part to the next.
template <class... Parts>
[[noreturn, gnu::cold, gnu::noinline]] void fail(const Parts&... parts) {
  detail::throw_error({detail::MessagePart(parts)...});
}

/// `fail` for an allocator whose memory ran out: the same message, thrown as OutOfMemory.
template <class... Parts>
[[noreturn, gnu::cold, gnu::noinline]] void fail_out_of_memory(const Parts&... parts) {
  detail::throw_out_of_memory({detail::MessagePart(parts)...});
}

/// `fail` with context added to an error caught on the way (`parts` usually hold
/// cause.what()): thrown as the same kind, so an OutOfMemory stays one.
template <class... Parts>
[[noreturn, gnu::cold, gnu::noinline]] void fail_like(const std::exception& cause, const Parts&... parts) {
  if (dynamic_cast<const OutOfMemory*>(&cause) != nullptr) detail::throw_out_of_memory({detail::MessagePart(parts)...});
  detail::throw_error({detail::MessagePart(parts)...});
}

}  // namespace tessera

#define TESSERA_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::tessera::fail(__VA_ARGS__);    \
  } while (0)
