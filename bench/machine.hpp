// What the benchmarks share: reading the machine (/proc/cpuinfo, /proc/stat, the
// process's CPU time), the date, medians and integer options.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
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


}  // namespace tessera::bench
