// A set of safetensors files that together hold one checkpoint, the way Hugging Face
// stores a model: either one `model.safetensors`, or shards `model-0000k-of-0000N.safetensors`
// listed by `model.safetensors.index.json`:
//
//   {"metadata": {"total_size": <bytes of tensor data>},
//    "weight_map": {"<tensor name>": "<shard file name>", ...}}
//
// ShardedSafetensors opens a directory in either layout, maps every shard (nothing is
// copied whole) and answers for tensors by name wherever they live. The index is
// checked at open: it must be a JSON object with a weight_map of strings, every shard
// it names must be a plain file name in the directory and a valid safetensors file, and
// every tensor it lists must be in the shard it names. Errors name the index or shard
// file and the tensor.
//
// write_sharded_safetensors splits tensors (in name order) into shards of at most
// max_shard_bytes of data (a larger tensor gets a shard of its own) and writes the index
// when there is more than one shard. It writes into a directory the caller has made for
// the purpose; see checkpoint/hf.hpp for the staged, all-or-nothing save.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"
#include "tessera/io/safetensors.hpp"

namespace tessera::io {

inline constexpr std::string_view kSafetensorsSingle = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndex = "model.safetensors.index.json";

class ShardedSafetensors {
 public:
  /// Opens `dir`: its model.safetensors.index.json when present, else its
  /// model.safetensors. Throws naming the directory when it has neither.
  static ShardedSafetensors open(const std::string& dir) {
    namespace fs = std::filesystem;
    ShardedSafetensors s;
    s.dir_ = dir;
    const fs::path index = fs::path(dir) / kSafetensorsIndex;
    const fs::path single = fs::path(dir) / kSafetensorsSingle;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) fail(dir, ": not a directory (expected a Hugging Face model directory)");
    if (fs::exists(index, ec)) {
      s.open_index(index.string());
    } else if (fs::exists(single, ec)) {
      s.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(single.string())));
      for (const TensorEntry& e : s.files_.back()->tensors()) s.where_.emplace(e.name, 0);
    } else {
      fail(dir, ": no ", kSafetensorsSingle, " and no ", kSafetensorsIndex);
    }
    return s;
  }

  const std::string& dir() const { return dir_; }

  /// Every tensor name, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    n.reserve(where_.size());
    for (const auto& [name, file] : where_) n.push_back(name);
    return n;
  }

  bool contains(std::string_view name) const { return where_.find(std::string(name)) != where_.end(); }

  /// The shard holding `name`; throws naming the directory when no shard does.
  const SafetensorsFile& file_of(std::string_view name) const {
    auto it = where_.find(std::string(name));
    if (it == where_.end()) fail(dir_, ": no tensor '", name, "' in this checkpoint (", where_.size(), " tensors)");
    return *files_[it->second];
  }

  const TensorEntry& entry(std::string_view name) const { return file_of(name).entry(name); }

  /// SafetensorsFile::read on the shard holding `name`.
  template <class T>
  void read(std::string_view name, std::span<T> dest, const std::vector<std::int64_t>& expected_shape) const {
    file_of(name).read(name, dest, expected_shape);
  }

  std::size_t shard_count() const { return files_.size(); }

 private:
  void open_index(const std::string& index_path) {
    namespace fs = std::filesystem;
    std::ifstream in(index_path, std::ios::binary);
    if (!in) fail(index_path, ": cannot open");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail(index_path, ": not valid JSON: ", e.what());
    }
    if (!j.is_object()) fail(index_path, ": not a JSON object but ", j.type_name());
    if (!j.contains("weight_map") || !j.at("weight_map").is_object()) {
      fail(index_path, ": no \"weight_map\" object");
    }
    std::map<std::string, std::size_t> shard_index;
    for (const auto& [name, value] : j.at("weight_map").items()) {
      if (!value.is_string()) fail(index_path, ": weight_map['", name, "'] is not a file name but ", value.dump());
      const std::string file = value.get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        fail(index_path, ": weight_map['", name, "'] = \"", file, "\" is not a file name in this directory");
      }
      auto [it, added] = shard_index.emplace(file, files_.size());
      if (added) {
        const std::string shard_path = (fs::path(dir_) / file).string();
        std::error_code ec;
        if (!fs::exists(shard_path, ec)) {
          fail(index_path, ": shard '", file, "' (holding '", name, "') is missing from ", dir_);
        }
        files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard_path)));
      }
      if (!files_[it->second]->contains(name)) {
        fail(index_path, ": weight_map puts '", name, "' in ", file, ", which has no such tensor");
      }
      where_.emplace(name, it->second);
    }
  }

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;  // stable addresses
  std::map<std::string, std::size_t> where_;            // tensor name -> files_ index
};

/// One tensor to write: a name, a row-major shape and its values (not copied until
/// its shard is written).
template <class V>
struct TensorToWrite {
  std::string name;
  std::vector<std::int64_t> shape;
  std::span<const V> values;
};

/// Writes `tensors` into the existing directory `dir` as model.safetensors, or as
/// shards of at most `max_shard_bytes` of data plus model.safetensors.index.json, stored
/// as `stored`. `metadata` goes into every shard's header. Returns the files written.
template <class V>
std::vector<std::string> write_sharded_safetensors(const std::string& dir, std::vector<TensorToWrite<V>> tensors,
                                                   StDtype stored, std::uint64_t max_shard_bytes,
                                                   const std::map<std::string, std::string>& metadata = {}) {
  namespace fs = std::filesystem;
  TESSERA_CHECK(max_shard_bytes > 0, dir, ": max_shard_bytes must be positive");
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    TESSERA_CHECK(tensors[i].name != tensors[i - 1].name, dir, ": tensor '", tensors[i].name, "' given twice");
  }

  // Greedy split in name order: the same tensors always give the same shards.
  std::vector<std::vector<std::size_t>> shards;
  std::uint64_t shard_bytes = 0, total_bytes = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uint64_t bytes = tensors[i].values.size() * size_of(stored);
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  if (shards.empty()) shards.emplace_back();

  auto shard_name = [&](std::size_t k) {
    if (shards.size() == 1) return std::string(kSafetensorsSingle);
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    return std::string(buf);
  };

  std::vector<std::string> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (std::size_t k = 0; k < shards.size(); ++k) {
    SafetensorsWriter w;  // one shard's copy in memory at a time
    for (const auto& [key, value] : metadata) w.set_metadata(key, value);
    for (std::size_t i : shards[k]) {
      w.add(tensors[i].name, stored, tensors[i].shape, tensors[i].values);
      weight_map[tensors[i].name] = shard_name(k);
    }
    w.write((fs::path(dir) / shard_name(k)).string());
    written.push_back(shard_name(k));
  }
  if (shards.size() > 1) {
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    const fs::path path = fs::path(dir) / kSafetensorsIndex;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << index.dump(2) << "\n";
    out.close();
    TESSERA_CHECK(out.good(), path.string(), ": cannot write");
    written.emplace_back(kSafetensorsIndex);
  }
  return written;
}

}  // namespace tessera::io
