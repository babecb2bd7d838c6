// Typo suggestions for an unknown key or section: the known name closest by edit
// distance, or the same key in another section.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/train/config_field.hpp"
#include "tessera/train/config_keys.hpp"

namespace tessera::train {

namespace detail {

/// Optimal string alignment distance (edits, with adjacent transpositions).
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

inline bool close_enough(std::string_view typed, std::size_t distance) {
  return distance <= std::max<std::size_t>(1, typed.size() / 3);
}

/// The known key closest to `name` ("section.key"), or "" when none is close.
inline std::string suggest_key(std::string_view name) {
  auto dot = name.find('.');
  std::string_view sec = dot == std::string_view::npos ? std::string_view{} : name.substr(0, dot);
  std::string_view key = dot == std::string_view::npos ? name : name.substr(dot + 1);
  const ConfigKey* best = nullptr;
  std::size_t best_d = 0;
  for (const auto& k : config_keys()) {
    std::size_t d = edit_distance(name, k.name);
    if (!best || d < best_d) best = &k, best_d = d;
  }
  if (best && close_enough(key.empty() ? name : key, best_d)) return std::string(best->name);
  // The right key in the wrong section ("training.lr" for "optimizer.lr").
  for (const auto& k : config_keys())
    if (k.key() == key && k.section() != sec) return std::string(k.name);
  return {};
}

inline std::string suggest_section(std::string_view name) {
  std::string_view best;
  std::size_t best_d = 0;
  for (auto s : config_sections()) {
    std::size_t d = edit_distance(name, s);
    if (best.empty() || d < best_d) best = s, best_d = d;
  }
  return close_enough(name, best_d) ? std::string(best) : std::string{};
}

}  // namespace detail

}  // namespace tessera::train
