// The training job's configuration, in torchtitan's TOML sections and keys.
//
// JobConfig holds one plain struct per section ([job], [model], [optimizer],
// [lr_scheduler], [training], [parallelism], [activation_checkpoint], [checkpoint],
// [metrics], [comm]) with torchtitan's defaults. ONE table, config_keys(), describes every key
// once: its "section.key" name, its type, where it lives in JobConfig, what it means and
// which values it accepts. TOML parsing, --section.key overrides, to_toml() and
// config_help() all walk that table, so a key added there is parsed, overridable,
// dumped, listed and checked at once.
//
// A key holds an int, a float, a bool, a string or a list of strings. A list is a TOML
// array of strings in the file (["layers.4", "layers.8"]) and comma-separated items on
// the command line (--section.key layers.4,layers.8; an empty value is the empty list).
//
// Loading a config resolves model.args (the flavor with the [model] overrides applied,
// then nn::ModelArgs::validate) and checks every value. Each error is one line naming
// where the value came from ("file.toml:LINE:COL" or "command line") and the key.
//
// The pieces: train/config_field.hpp (a key and its field), config_keys.hpp (the table),
// config_suggest.hpp (typo suggestions), config_toml.hpp and config_cli.hpp (values from
// a file and from the command line), config_check.hpp (the checks) and config_help.hpp
// (to_toml, config_help). This header includes them all and holds the entry points.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/train/config_check.hpp"
#include "tessera/train/config_cli.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/config_help.hpp"
#include "tessera/train/config_keys.hpp"
#include "tessera/train/config_suggest.hpp"
#include "tessera/train/config_toml.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

namespace detail {

inline JobConfig build(std::string_view text, std::string_view source, const CommandLine& cl) {
  JobConfig c;
  Origins origins;
  origins.fallback = source.empty() ? "command line" : std::string(source);
  if (!source.empty() || !text.empty()) apply_toml(c, origins, text, source.empty() ? "config" : source);
  apply_command_line(c, origins, cl);
  finalize(c, origins, origins.fallback);
  return c;
}

}  // namespace detail

/// Resolves config.model.args from the flavor and the [model] overrides and checks every
/// value, for a JobConfig built in code; errors name `source`.
inline void finalize_config(JobConfig& config, std::string_view source = "config") {
  detail::Origins origins;
  origins.fallback = std::string(source);
  detail::finalize(config, origins, source);
}

/// A config from TOML text (errors name `source_name`), then the --section.key overrides
/// in `args`. --config / --job.config_file are not accepted here: use load_config.
inline JobConfig parse_config(std::string_view toml_text, std::string_view source_name,
                              const std::vector<std::string>& args = {}) {
  auto cl = detail::parse_command_line(args);
  TESSERA_CHECK(!cl.config_file, "command line: --config is only read by load_config");
  return detail::build(toml_text, source_name, cl);
}

/// A config from the TOML file `path` (may be empty: defaults only), then the command-line
/// words `args` (after the program name): --section.key value, --section.key=value, bare
/// boolean --section.key, and --config PATH / --job.config_file PATH, which select the
/// file instead of `path`.
inline JobConfig load_config(const std::string& path, const std::vector<std::string>& args = {}) {
  auto cl = detail::parse_command_line(args);
  std::string file = cl.config_file ? *cl.config_file : path;
  if (file.empty()) return detail::build({}, {}, cl);
  std::error_code ec;
  auto status = std::filesystem::status(file, ec);
  TESSERA_CHECK(std::filesystem::exists(status), file, ": config file not found");
  TESSERA_CHECK(!std::filesystem::is_directory(status), file, ": is a folder, not a TOML config file");
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in.good(), file, ": cannot open config file");
  std::ostringstream text;
  text << in.rdbuf();
  TESSERA_CHECK(!in.bad(), file, ": cannot read config file");
  return detail::build(text.str(), file, cl);
}

/// True when every key has the same value (model.args follows from them).
inline bool operator==(const JobConfig& a, const JobConfig& b) {
  for (const auto& k : config_keys())
    if (!detail::same_value(k, a, b)) return false;
  return true;
}

}  // namespace tessera::train
