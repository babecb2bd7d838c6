// The configuration as text: to_toml(), every key with its effective value, and
// config_help(), every key with its type, default and meaning.
#pragma once

#include <string>
#include <string_view>
#include <variant>

#include "tessera/core/error.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/config_keys.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// The effective configuration as TOML, every key; load_config reads it back equal.
/// Unset optional keys are written as comments saying what unset means.
inline std::string to_toml(const JobConfig& c) {
  std::string out = "# tessera job configuration: every key, with its effective value.\n";
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      out += tessera::detail::concat("\n[", section, "]\n");
    }
    detail::Value v = detail::read_value(k, c);
    if (std::holds_alternative<std::monostate>(v)) {
      out += tessera::detail::concat("# ", k.key(), ": unset, ", k.unset_means);
      if (k.args_value) out += tessera::detail::concat(" (", k.args_value(c), ")");
      out += "\n";
    } else {
      out += tessera::detail::concat(k.key(), " = ", detail::format_value(v), "\n");
    }
  }
  return out;
}

/// Every key with its type, default and meaning (for --help).
inline std::string config_help() {
  const JobConfig defaults;
  std::string out =
      "Configuration: a TOML file given with --config FILE (or --job.config_file FILE), then\n"
      "--section.key VALUE or --section.key=VALUE on the command line, which win over the file.\n"
      "A boolean may be given bare (--section.key means true). An optional key takes 'none'.\n"
      "A string list takes comma-separated items (--section.key a,b); an empty value is the empty list.\n";
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      out += tessera::detail::concat("\n[", section, "]\n");
    }
    detail::Value v = detail::read_value(k, defaults);
    std::string def = std::holds_alternative<std::monostate>(v)
                          ? tessera::detail::concat("unset: ", k.unset_means)
                          : detail::format_value(v);
    out += tessera::detail::concat("  --", k.name, " <", key_type_name(k.type), k.optional ? ", optional" : "",
                                   ">  (default ", def, ")\n");
    out += tessera::detail::concat("      ", k.help);
    if (!k.choices.empty()) out += tessera::detail::concat(" One of: ", detail::join(k.choices, ", "), ".");
    std::string range = detail::describe_range(k);
    if (!range.empty())
      out += tessera::detail::concat(" Must be ", k.minus_one_means.empty() ? "" : "-1 (", k.minus_one_means,
                                     k.minus_one_means.empty() ? "" : ") or ", range, ".");
    out += "\n";
  }
  return out;
}

}  // namespace tessera::train
