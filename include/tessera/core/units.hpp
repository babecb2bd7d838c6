// Byte counts, counts and durations as people read them: the one home of the formats
// the library's lines, messages and benchmarks print.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>

namespace tessera {

/// "512 B", "3.00 KiB", "1.50 GiB": binary units, the largest that keeps the value at least 1.
inline std::string binary_bytes(double b) {
  char s[32];
  constexpr const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (b < 1024) {
    std::snprintf(s, sizeof s, "%.0f B", b);
    return s;
  }
  double v = b / 1024;
  int unit = 0;
  while (v >= 1024 && unit < 3) {
    v /= 1024;
    ++unit;
  }
  std::snprintf(s, sizeof s, "%.2f %s", v, units[unit]);
  return s;
}

/// "512 B", "3.4 kB", "3.4 MB", "1.25 GB": decimal units (file sizes, transfer rates).
inline std::string decimal_bytes(double b) {
  char s[32];
  if (b < 1e3) std::snprintf(s, sizeof s, "%.0f B", b);
  else if (b < 1e6) std::snprintf(s, sizeof s, "%.1f kB", b / 1e3);
  else if (b < 1e9) std::snprintf(s, sizeof s, "%.1f MB", b / 1e6);
  else std::snprintf(s, sizeof s, "%.2f GB", b / 1e9);
  return s;
}

/// "812.5 MiB" below a GiB, "1.25 GiB" from there: memory as a step's line shows it.
inline std::string memory_bytes(double b) {
  char s[32];
  if (b >= double(1 << 30)) std::snprintf(s, sizeof s, "%.2f GiB", b / double(1 << 30));
  else std::snprintf(s, sizeof s, "%.1f MiB", b / double(1 << 20));
  return s;
}

/// "12.34 MiB": a table's column of memory, in one unit.
inline std::string mebibytes(double b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MiB", b / double(1 << 20));
  return s;
}

/// 1234567 -> "1.23M", "12.3k"; below 10000 the plain number (tokens, tokens/s).
inline std::string count_text(double n) {
  char s[32];
  if (n < 1e4) std::snprintf(s, sizeof s, "%.0f", n);
  else if (n < 1e6) std::snprintf(s, sizeof s, "%.1fk", n / 1e3);
  else if (n < 1e9) std::snprintf(s, sizeof s, "%.2fM", n / 1e6);
  else std::snprintf(s, sizeof s, "%.2fB", n / 1e9);
  return s;
}

/// "3m05s", "1h02m": how long a run took or has left, to the second.
inline std::string duration_text(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char t[32];
  if (s >= 3600) std::snprintf(t, sizeof t, "%lldh%02lldm", s / 3600, (s / 60) % 60);
  else std::snprintf(t, sizeof t, "%lldm%02llds", s / 60, s % 60);
  return t;
}

/// "3:05", "1:02:03": a clock's reading (a progress line's ETA).
inline std::string clock_text(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char t[32];
  if (s >= 3600) std::snprintf(t, sizeof t, "%lld:%02lld:%02lld", s / 3600, (s / 60) % 60, s % 60);
  else std::snprintf(t, sizeof t, "%lld:%02lld", s / 60, s % 60);
  return t;
}

}  // namespace tessera
