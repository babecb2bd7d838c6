// A configuration key and the JobConfig field it names: the key's type, the field's
// accessors, the key's value read from and written to a JobConfig, that value as TOML
// text, the type and range as error messages and help say them, and where each value
// came from. The keys themselves are in train/config_keys.hpp.
#pragma once

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/train/job_config.hpp"

namespace tessera::train {

enum class KeyType { Int, Float, Bool, String, StringList, FloatList };

inline const char* key_type_name(KeyType t) {
  switch (t) {
    case KeyType::Int: return "int";
    case KeyType::Float: return "float";
    case KeyType::Bool: return "bool";
    case KeyType::String: return "string";
    case KeyType::StringList: return "string list";
    case KeyType::FloatList: return "float list";
  }
  return "?";
}

namespace detail {

/// Where one key's field lives: accessors generated from two member pointers.
template <class T>
struct FieldRef {
  T& (*get)(JobConfig&);
  const T& (*cget)(const JobConfig&);
};

using AnyField = std::variant<FieldRef<std::int64_t>, FieldRef<double>, FieldRef<bool>, FieldRef<std::string>,
                              FieldRef<std::vector<std::string>>, FieldRef<std::vector<double>>,
                              FieldRef<std::optional<std::int64_t>>,
                              FieldRef<std::optional<double>>, FieldRef<std::optional<bool>>>;

template <auto Section, auto Field>
auto& field_get(JobConfig& c) {
  return (c.*Section).*Field;
}
template <auto Section, auto Field>
const auto& field_cget(const JobConfig& c) {
  return (c.*Section).*Field;
}
template <auto Section, auto Field>
AnyField field() {
  using T = std::remove_cvref_t<decltype(field_get<Section, Field>(std::declval<JobConfig&>()))>;
  return FieldRef<T>{&field_get<Section, Field>, &field_cget<Section, Field>};
}

/// One value as read from TOML or the command line; monostate means "unset".
using Value =
    std::variant<std::monostate, std::int64_t, double, bool, std::string, std::vector<std::string>, std::vector<double>>;

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class T>
KeyType key_type_of() {
  if constexpr (is_optional<T>::value) {
    return key_type_of<typename T::value_type>();
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return KeyType::Int;
  } else if constexpr (std::is_same_v<T, double>) {
    return KeyType::Float;
  } else if constexpr (std::is_same_v<T, bool>) {
    return KeyType::Bool;
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return KeyType::StringList;
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    return KeyType::FloatList;
  } else {
    static_assert(std::is_same_v<T, std::string>,
                  "config fields are int64, double, bool, string, string list or float list");
    return KeyType::String;
  }
}

}  // namespace detail

/// One configuration key: everything the parser, the overrides, the dump and the help need.
struct ConfigKey {
  std::string_view name;  // "section.key"
  KeyType type = KeyType::Int;
  bool optional = false;  // may be left unset (std::optional field)
  std::string_view help;
  // Accepted values: numbers within [min, max] (bounds open where *_open), -1 as well
  // when minus_one_means is set; strings among `choices` when it is not empty.
  std::optional<double> min, max;
  bool min_open = false, max_open = false;
  std::string_view minus_one_means;
  std::vector<std::string_view> choices;
  bool one_string_is_a_list = false;  // a string list given one plain string: the list of it
  std::string_view unset_means;  // for optional keys
  detail::AnyField field;
  // [model] overrides: copies the set value into model.args, and reads the flavor's value.
  void (*apply_to_args)(JobConfig&) = nullptr;
  std::string (*args_value)(const JobConfig&) = nullptr;

  std::string_view section() const { return name.substr(0, name.find('.')); }
  std::string_view key() const { return name.substr(name.find('.') + 1); }
};

namespace detail {

/// The shortest text that reads back as exactly `v`: plain digits for everyday
/// magnitudes, else "1e-8" style; always a TOML float (never "3", always "3.0").
inline std::string format_float(double v) {
  char buf[64];
  double mag = std::fabs(v);
  bool plain = mag == 0 || (mag >= 1e-4 && mag < 1e15);
  auto res = plain ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed)
                   : std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  if (auto e = s.find('e'); e != std::string::npos) {  // "1e-08" -> "1e-8", "1e+20" -> "1e20"
    std::string out = s.substr(0, e + 1);
    std::size_t i = e + 1;
    if (s[i] == '-') out.push_back('-');
    if (s[i] == '-' || s[i] == '+') ++i;
    while (i + 1 < s.size() && s[i] == '0') ++i;
    out.append(s, i, std::string::npos);
    return out;
  }
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

/// A TOML basic string literal.
inline std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          static const char* hex = "0123456789ABCDEF";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

inline std::string format_value(const Value& v) {
  struct {
    std::string operator()(std::monostate) const { return "unset"; }
    std::string operator()(std::int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const { return format_float(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return quote(x); }
    std::string operator()(const std::vector<std::string>& xs) const {  // a TOML array: ["a", "b"]
      std::string out = "[";
      for (std::size_t i = 0; i < xs.size(); ++i) out += (i > 0 ? ", " : "") + quote(xs[i]);
      return out + "]";
    }
    std::string operator()(const std::vector<double>& xs) const {  // a TOML array: [0.7, 0.3]
      std::string out = "[";
      for (std::size_t i = 0; i < xs.size(); ++i) out += (i > 0 ? ", " : "") + format_float(xs[i]);
      return out + "]";
    }
  } visitor;
  return std::visit(visitor, v);
}

inline Value read_value(const ConfigKey& key, const JobConfig& c) {
  return std::visit(
      [&](auto ref) -> Value {
        const auto& v = ref.cget(c);
        using T = std::remove_cvref_t<decltype(v)>;
        if constexpr (is_optional<T>::value) {
          if (!v) return std::monostate{};
          return Value{*v};
        } else {
          return Value{v};
        }
      },
      key.field);
}

/// Stores `v`, whose alternative matches key.type (or is monostate for optional keys).
inline void write_value(const ConfigKey& key, JobConfig& c, const Value& v) {
  std::visit(
      [&](auto ref) {
        auto& dst = ref.get(c);
        using T = std::remove_cvref_t<decltype(dst)>;
        if constexpr (is_optional<T>::value) {
          if (std::holds_alternative<std::monostate>(v))
            dst.reset();
          else
            dst = std::get<typename T::value_type>(v);
        } else {
          dst = std::get<T>(v);
        }
      },
      key.field);
}

inline bool same_value(const ConfigKey& key, const JobConfig& a, const JobConfig& b) {
  return read_value(key, a) == read_value(key, b);
}

inline const char* expected_name(KeyType t) {
  switch (t) {
    case KeyType::Int: return "an integer";
    case KeyType::Float: return "a number";
    case KeyType::Bool: return "a boolean (true or false)";
    case KeyType::String: return "a string";
    case KeyType::StringList: return "an array of strings";
    case KeyType::FloatList: return "an array of numbers";
  }
  return "?";
}

inline std::string describe_range(const ConfigKey& k) {
  std::ostringstream s;
  if (k.min && k.max) {
    s << "in " << (k.min_open ? "(" : "[") << *k.min << ", " << *k.max << (k.max_open ? ")" : "]");
  } else if (k.min) {
    if (*k.min == 0 && k.min_open)
      s << "positive";
    else
      s << (k.min_open ? "> " : ">= ") << *k.min;
  } else if (k.max) {
    s << (k.max_open ? "< " : "<= ") << *k.max;
  }
  return s.str();
}

inline std::string join(const std::vector<std::string_view>& items, std::string_view sep) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += sep;
    out += items[i];
  }
  return out;
}

/// Where each key's value came from, for error messages.
struct Origins {
  std::string fallback;  // keys left at their defaults
  std::map<std::string, std::string, std::less<>> by_key;
  const std::string& of(std::string_view key) const {
    auto it = by_key.find(key);
    return it == by_key.end() ? fallback : it->second;
  }
};

}  // namespace detail

}  // namespace tessera::train
