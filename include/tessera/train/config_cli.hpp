// Values from the command line: --section.key value, --section.key=value, a bare
// boolean --section.key, and --config FILE; each error is one line naming "command line"
// and the key.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <variant>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/utf8.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/config_keys.hpp"
#include "tessera/train/config_suggest.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

namespace detail {

struct Override {
  const ConfigKey* key;
  std::string value;
};

struct CommandLine {
  std::optional<std::string> config_file;
  std::vector<Override> overrides;
};

inline bool is_option(const std::string& word) { return word.size() >= 2 && word.compare(0, 2, "--") == 0; }

inline CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& word = args[i];
    TESSERA_CHECK(is_option(word) && word.size() > 2, "command line: unexpected argument '", word,
                  "' (settings look like --section.key value)");
    std::string name = word.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    bool next_is_value = i + 1 < args.size() && !is_option(args[i + 1]);
    if (name == "config" || name == "job.config_file") {
      if (!value && next_is_value) value = args[++i];
      TESSERA_CHECK(value && !value->empty(), "command line: --", name, " needs a value (the TOML file)");
      out.config_file = *value;
      continue;
    }
    const ConfigKey* key = find_config_key(name);
    if (!key) {
      std::string hint = suggest_key(name);
      if (!hint.empty()) fail("command line: unknown option --", name, " (did you mean --", hint, "?)");
      fail("command line: unknown option --", name, " (see --help for the keys)");
    }
    if (!value) {
      if (next_is_value)
        value = args[++i];
      else if (key->type == KeyType::Bool)
        value = "true";  // a bare boolean flag
      else
        fail("command line: --", name, " needs a value");
    }
    out.overrides.push_back({key, *value});
  }
  return out;
}

/// A string list from the command line: items separated by commas, each without the
/// spaces around it ("layers.4, layers.8"); "" is the empty list. An empty item (",,",
/// a comma at either end) is an error: an item cannot itself hold a comma.
inline std::vector<std::string> split_list(const ConfigKey& key, const std::string& text, const std::string& where) {
  std::vector<std::string> items;
  if (text.find_first_not_of(" \t") == std::string::npos) return items;
  std::size_t begin = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    std::string_view item(text.data() + begin, comma - begin);
    const auto first = item.find_first_not_of(" \t");
    TESSERA_CHECK(first != std::string_view::npos, where, ": --", key.name,
                  ": expected comma-separated strings (a,b,c; empty for none), got an empty item in '", text, "'");
    item = item.substr(first, item.find_last_not_of(" \t") - first + 1);
    items.emplace_back(item);
    if (comma == text.size()) break;
    begin = comma + 1;
  }
  return items;
}

inline Value value_from_text(const ConfigKey& key, const std::string& text, const std::string& where) {
  auto wrong = [&]() -> Value {
    fail(where, ": --", key.name, ": expected ", expected_name(key.type), ", got '", text, "'");
  };
  if (key.optional && (text == "none" || text == "None")) return std::monostate{};
  // A config's text is UTF-8, as TOML's is: other bytes would make the config it writes
  // back (job.print_config, a run's folder) a file no TOML reader takes.
  if ((key.type == KeyType::String || key.type == KeyType::StringList) && io::valid_utf8(text) != text)
    fail(where, ": --", key.name, ": not UTF-8 text, got '", io::valid_utf8(text),
         "' (U+FFFD marks the bytes that are not)");
  const char* first = text.data();
  const char* last = text.data() + text.size();
  switch (key.type) {
    case KeyType::Int: {
      std::int64_t v = 0;
      auto [ptr, ec] = std::from_chars(first, last, v);
      if (ec != std::errc{} || ptr != last || text.empty()) return wrong();
      return v;
    }
    case KeyType::Float: {
      double v = 0;
      auto [ptr, ec] = std::from_chars(first, last, v);
      if (ec != std::errc{} || ptr != last || text.empty() || !std::isfinite(v)) return wrong();
      return v;
    }
    case KeyType::Bool:
      if (text == "true") return true;
      if (text == "false") return false;
      return wrong();
    case KeyType::String:
      return text;
    case KeyType::StringList:
      return split_list(key, text, where);
    case KeyType::FloatList: {
      std::vector<double> items;
      for (const std::string& item : split_list(key, text, where)) {
        double v = 0;
        auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        if (ec != std::errc{} || ptr != item.data() + item.size() || !std::isfinite(v))
          fail(where, ": --", key.name, ": expected comma-separated numbers (0.7,0.3), got '", item, "' in '", text,
               "'");
        items.push_back(v);
      }
      return items;
    }
  }
  return wrong();
}

inline void apply_command_line(JobConfig& c, Origins& origins, const CommandLine& cl) {
  const std::string where = "command line";
  for (const auto& o : cl.overrides) {
    write_value(*o.key, c, value_from_text(*o.key, o.value, where));
    origins.by_key[std::string(o.key->name)] = where;
  }
}

}  // namespace detail

}  // namespace tessera::train
