// Values from TOML text: each [section] key = value written into a JobConfig; each error
// is one line naming "file.toml:LINE:COL" and the key.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>  // toml++ v3 (Debian ships this name, not toml.hpp)

#include "tessera/core/error.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/config_keys.hpp"
#include "tessera/train/config_suggest.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

namespace detail {

inline const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

inline std::string position(std::string_view source, const toml::source_region& r) {
  std::string s(source);
  if (r.begin.line > 0) s += tessera::detail::concat(":", r.begin.line, ":", r.begin.column);
  return s;
}

inline Value value_from_toml(const ConfigKey& key, const toml::node& n, const std::string& where) {
  auto wrong = [&]() -> Value {
    fail(where, ": ", key.name, ": expected ", expected_name(key.type), ", got ", toml_type_name(n));
  };
  switch (key.type) {
    case KeyType::Int:
      if (auto v = n.as_integer()) return v->get();
      return wrong();
    case KeyType::Float: {
      double d;
      if (auto v = n.as_floating_point())
        d = v->get();
      else if (auto i = n.as_integer())
        d = static_cast<double>(i->get());
      else
        return wrong();
      TESSERA_CHECK(std::isfinite(d), where, ": ", key.name, ": expected a finite number, got ", d);
      return d;
    }
    case KeyType::Bool:
      if (auto v = n.as_boolean()) return v->get();
      return wrong();
    case KeyType::String:
      if (auto v = n.as_string()) return v->get();
      return wrong();
    case KeyType::StringList: {
      if (const auto* one = n.as_string(); one && key.one_string_is_a_list) return std::vector<std::string>{one->get()};
      const auto* array = n.as_array();
      if (!array) return wrong();
      std::vector<std::string> items;
      items.reserve(array->size());
      for (std::size_t i = 0; i < array->size(); ++i) {
        const toml::node& item = *array->get(i);
        const auto* s = item.as_string();
        if (!s) {
          // Point at the item itself: an array may span several lines.
          const auto& r = item.source();
          std::string item_where = where;
          if (r.path && r.begin.line > 0) item_where = position(*r.path, r);
          fail(item_where, ": ", key.name, ": expected ", expected_name(key.type), ", got ", toml_type_name(item),
               " at index ", i);
        }
        items.push_back(s->get());
      }
      return items;
    }
    case KeyType::FloatList: {
      const auto* array = n.as_array();
      if (!array) return wrong();
      std::vector<double> items;
      items.reserve(array->size());
      for (std::size_t i = 0; i < array->size(); ++i) {
        const toml::node& item = *array->get(i);
        std::optional<double> d;
        if (auto v = item.as_floating_point()) d = v->get();
        if (auto v = item.as_integer()) d = static_cast<double>(v->get());
        if (!d || !std::isfinite(*d)) {
          const auto& r = item.source();
          std::string item_where = where;
          if (r.path && r.begin.line > 0) item_where = position(*r.path, r);
          fail(item_where, ": ", key.name, ": expected ", expected_name(key.type), ", got ",
               d ? tessera::detail::concat(*d) : std::string(toml_type_name(item)), " at index ", i);
        }
        items.push_back(*d);
      }
      return items;
    }
  }
  return wrong();
}

inline void apply_toml(JobConfig& c, Origins& origins, std::string_view text, std::string_view source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail(position(source, e.source()), ": TOML syntax error: ", e.description());
  }
  // torchtitan's [quantize.linear.float8] is tessera's [float8]: its keys are read as those.
  if (toml::table* quantize = root["quantize"].as_table()) {
    const std::string where = position(source, quantize->source());
    toml::table* linear = (*quantize)["linear"].as_table();
    for (auto&& [key, node] : *quantize)
      if (key.str() != "linear" || !linear)
        fail(position(source, key.source()), ": unknown section [quantize.", key.str(),
             "] (tessera reads torchtitan's [quantize.linear.float8], or [float8])");
    // An empty [quantize] (no [quantize.linear]) sets nothing, nor does an empty [quantize.linear].
    if (linear)
      for (auto&& [key, node] : *linear)
        if (key.str() != "float8" || !node.is_table())
          fail(position(source, key.source()), ": unknown section [quantize.linear.", key.str(),
               "] (tessera's float8 recipes are [quantize.linear.float8]'s; MX formats need Blackwell GPUs)");
    if (toml::table* float8 = linear ? (*linear)["float8"].as_table() : nullptr) {
      TESSERA_CHECK(!root.contains("float8"), where,
                    ": [quantize.linear.float8] and [float8] both set the float8 keys: keep one");
      toml::table moved = *float8;
      root.erase("quantize");
      root.insert("float8", std::move(moved));
    } else {
      root.erase("quantize");
    }
  }
  for (auto&& [section_key, section_node] : root) {
    std::string section(section_key.str());
    std::string where = position(source, section_key.source());
    auto sections = config_sections();
    bool known_section = std::find(sections.begin(), sections.end(), section) != sections.end();
    auto* table = section_node.as_table();
    if (!table) {
      if (known_section) fail(where, ": [", section, "] must be a table, got ", toml_type_name(section_node));
      const ConfigKey* elsewhere = nullptr;
      for (const auto& k : config_keys())
        if (k.key() == section) elsewhere = elsewhere ? elsewhere : &k;
      if (elsewhere)
        fail(where, ": key '", section, "' is outside any section (did you mean '", elsewhere->name, "'?)");
      fail(where, ": key '", section, "' is outside any section (keys go under [job], [model], [training], ...)");
    }
    if (!known_section) {
      std::string hint = suggest_section(section);
      if (!hint.empty()) fail(where, ": unknown section [", section, "] (did you mean [", hint, "]?)");
      fail(where, ": unknown section [", section, "] (known: ", join(sections, ", "), ")");
    }
    for (auto&& [key, node] : *table) {
      std::string name = tessera::detail::concat(section, ".", key.str());
      std::string key_where = position(source, key.source());
      const ConfigKey* k = find_config_key(name);
      if (!k) {
        std::string hint = suggest_key(name);
        if (!hint.empty()) fail(key_where, ": unknown key '", name, "' (did you mean '", hint, "'?)");
        fail(key_where, ": unknown key '", name, "'");
      }
      std::string value_where = position(source, node.source());
      write_value(*k, c, value_from_toml(*k, node, value_where));
      origins.by_key[std::string(k->name)] = value_where;
    }
  }
}

}  // namespace detail

}  // namespace tessera::train
