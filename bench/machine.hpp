// What the benchmarks share: reading the machine (/proc/cpuinfo, /proc/stat, the
// process's CPU time), the date, medians, their command lines (Flags and the parsers of
// counts, numbers with units and lists) and the debug job the thread-rank ones train.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::bench {

/// The value of the first "key : value" line of /proc/cpuinfo whose key is `key`.
inline std::string cpuinfo_field(std::string_view key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || colon == 0) continue;
    const auto end = line.find_last_not_of(" \t", colon - 1);
    if (end == std::string::npos || std::string_view(line).substr(0, end + 1) != key) continue;
    const auto start = line.find_first_not_of(" \t", colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "unknown";
}

/// CPU seconds every process on the machine has used (busy time in /proc/stat), or -1.
inline double machine_busy_seconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (!(in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu") return -1;
  return (user + nice + system + irq + softirq + steal) / double(sysconf(_SC_CLK_TCK));
}

/// User plus system CPU seconds this process has used.
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto sec = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
  return sec(u.ru_utime) + sec(u.ru_stime);
}

inline std::string utc_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char s[32];
  std::strftime(s, sizeof s, "%Y-%m-%d %H:%M UTC", &tm);
  return s;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline std::int64_t parse_count(std::string_view flag, std::string_view text, std::int64_t min) {
  std::int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  TESSERA_CHECK(ec == std::errc{} && end == text.data() + text.size() && v >= min, flag, ": expected an integer >= ",
                min, ", got '", text, "'");
  return v;
}

/// The job the thread-rank benchmarks (bench-data-parallel, bench-policy-matrix) train:
/// the debug model on the embedded corpus with its 1024-token BPE, in fp32; each adds
/// its layout, batch and checkpointing as command-line keys.
inline constexpr const char* kDebugModelJob = R"(
    [model]
    flavor = "debugmodel"
    tokenizer = "synthetic_bpe"
    vocab_size = 1024
    [optimizer]
    lr = 3e-3
    [lr_scheduler]
    warmup_steps = 1
    [training]
    max_norm = 1.0
    seed = 0
    mixed_precision_param = "float32"
    synthetic_documents = 400
  )";

/// A benchmark's command line, flag by flag:
///
///   for (Flags f(argc, argv); f.next();) {
///     const std::string_view flag = f.flag();
///     if (flag == "--steps") o.steps = parse_count(flag, f.value(), 1);
///     else if (flag == "--help") ...
///     else f.unknown();
///   }
///
/// value() takes the word after the flag, or fails naming the flag; flag() stays the flag.
class Flags {
 public:
  Flags(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) words_.emplace_back(argv[i]);
  }
  explicit Flags(std::vector<std::string_view> words) : words_(std::move(words)) {}

  /// Steps to the next flag; false past the last word.
  bool next() {
    if (next_ >= words_.size()) return false;
    flag_ = words_[next_++];
    return true;
  }
  std::string_view flag() const { return flag_; }
  /// The word after the flag, taken.
  std::string_view value() {
    TESSERA_CHECK(next_ < words_.size(), flag_, ": missing value");
    return words_[next_++];
  }
  /// Fails naming the flag.
  [[noreturn]] void unknown(std::string_view hint = "try --help") const {
    fail("unknown option '", flag_, "' (", hint, ")");
  }

 private:
  std::vector<std::string_view> words_;
  std::size_t next_ = 0;
  std::string_view flag_;
};

/// `text`, the value of `flag`, as a positive finite number of `unit`s.
inline double parse_positive(std::string_view flag, std::string_view text, std::string_view unit) {
  const std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TESSERA_CHECK(end != s.c_str() && *end == '\0' && v > 0 && std::isfinite(v), flag, ": expected a positive number of ",
                unit, ", got '", text, "'");
  return v;
}

/// The items of a comma-separated command-line list ("a,b,c"), empty items included.
inline std::vector<std::string_view> split_commas(std::string_view text) {
  std::vector<std::string_view> out;
  while (true) {
    const auto comma = text.find(',');
    out.push_back(text.substr(0, comma));
    if (comma == std::string_view::npos) return out;
    text.remove_prefix(comma + 1);
  }
}

/// The items of the comma list `text`, each the item of `all` whose key (key(item)) it is;
/// an unknown word fails naming `flag` and the known keys.
template <class Item, class Key>
std::vector<Item> parse_keyed(std::string_view flag, std::string_view text, const std::vector<Item>& all, Key key) {
  std::vector<Item> out;
  for (std::string_view word : split_commas(text)) {
    const auto it = std::find_if(all.begin(), all.end(), [&](const Item& i) { return std::string_view(key(i)) == word; });
    if (it == all.end()) {
      std::string known;
      for (const Item& i : all) (known += known.empty() ? "" : ", ") += std::string_view(key(i));
      fail(flag, ": unknown item '", word, "' (known: ", known, ")");
    }
    out.push_back(*it);
  }
  return out;
}

}  // namespace tessera::bench
