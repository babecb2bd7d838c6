// The files a dataset_path names: each entry a file, or a glob pattern standing for its
// matches in name order; and those files as a resume must find them again.
#pragma once

#include <glob.h>

#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"

namespace tessera::train {

/// Whether a dataset_path entry is a glob pattern rather than a file's name.
inline bool is_pattern(const std::string& entry) { return entry.find_first_of("*?[") != std::string::npos; }

/// The files of one dataset_path entry: the entry itself, or a pattern's matches in name
/// order (a pattern that matches nothing is an error naming `key`).
inline std::vector<std::string> expand_entry(const std::string& entry, const std::string& key) {
  if (!is_pattern(entry)) return {entry};
  glob_t g{};
  const int rc = ::glob(entry.c_str(), 0, nullptr, &g);  // unreadable folders hold no match
  std::vector<std::string> files;
  if (rc == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  TESSERA_CHECK(rc == 0 || rc == GLOB_NOMATCH, key, ": cannot list the files of '", entry, "' (out of memory)");
  TESSERA_CHECK(!files.empty(), key, ": '", entry, "' matches no file");
  return files;
}

/// The files of every entry of `paths`, entry by entry.
inline std::vector<std::vector<std::string>> expand_entries(const std::vector<std::string>& paths,
                                                            const std::string& key) {
  std::vector<std::vector<std::string>> out;
  for (const std::string& entry : paths) out.push_back(expand_entry(entry, key));
  return out;
}

/// The files `paths` names as a resume must find them again (so that one finding other
/// files under a pattern is refused): one file as its path, the files of one stream as a
/// list, a weighted mix's (`weighted`) as a list per entry.
inline nlohmann::json kept_files(const std::vector<std::string>& paths, bool weighted, const std::string& key) {
  const std::vector<std::vector<std::string>> entries = expand_entries(paths, key);
  if (weighted) return nlohmann::json(entries);
  std::vector<std::string> all;
  for (const auto& files : entries) all.insert(all.end(), files.begin(), files.end());
  return all.size() == 1 ? nlohmann::json(all.front()) : nlohmann::json(all);
}

}  // namespace tessera::train
