// libFuzzer target: the job config reader (train::parse_config: TOML text, torchtitan's
// schema and tessera's, every key's type and range, the flavor and the checks across keys)
// and the command line's overrides. The input up to its first NUL byte is the TOML file;
// after it, each line is one command-line word (--section.key, a value, --key=value).
//
// When the text is accepted, the config is written back (to_toml) and must read back to
// the same config: what llama-train prints with job.print_config, and what a checkpoint
// folder keeps, is a config that reproduces the run.
//
// Contract: reading either succeeds or throws tessera::Error (the file, line and key in
// its message); an accepted config writes back and reads back equal. Any other exception,
// a crash, a leak, undefined behaviour, a timeout, or a broken invariant above (reported
// on stderr, then abort) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/config_help.hpp"

namespace {

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_config: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tessera::train;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = input.find('\0');
  const std::string_view text = input.substr(0, nul);
  std::vector<std::string> args;
  if (nul != std::string_view::npos)
    for (std::string_view rest = input.substr(nul + 1); !rest.empty();) {
      const std::size_t end = rest.find('\n');
      args.emplace_back(rest.substr(0, end));
      rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + 1);
    }
  JobConfig c;
  try {
    c = parse_config(text, "fuzz.toml", args);
  } catch (const tessera::Error&) {
    return 0;  // refused with a message: the contract
  }
  std::string written;
  try {
    written = to_toml(c);
    if (!(parse_config(written, "written.toml") == c))
      finding("an accepted config does not read back to itself", written);
  } catch (const tessera::Error& e) {
    finding(e.what(), written);
  }
  return 0;
}
