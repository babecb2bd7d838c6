// The on-disk format of a sharded model checkpoint, and reading it: the names of a
// folder's files, its index (read and checked), and the values of any stretch of a
// parameter. checkpoint/sharded.hpp saves and loads models and training state in it.
//
// A folder holds one safetensors file per rank of the world that saved it,
// `model-rank<R>-of-<N>.safetensors`, and `COMPLETE`, written by rank 0 last, once
// every file is in place (a folder without it is an interrupted save and is refused).
// A rank's file holds the stretches it is the writer of (nn::Transformer::HeldStretch:
// each element of the model has exactly one writer over the world, so replicas and
// tensor-parallel ranks holding the same values write them once). Each stretch is a 1-D
// tensor `<parameter name>@<k>` in the parameter's own element type, and the file's
// metadata says where its values lie in the whole parameter:
//
//   "tessera.stretches": [[parameter, key, first, whole_cols, piece_cols, row0, col0, n], ...]
//   "tessera.shapes":    {parameter: whole shape, ...}
//   "tessera.model_args", "tessera.rank", "tessera.world_size"
//   "tessera.crc32c":    {tensor: CRC-32C of its stored bytes, ...}
//   "tessera.index_crc32c": CRC-32C of the index (the stretches, shapes, families,
//                        state, model arguments and checksums, in that order)
//
// A loading rank checks each tensor's checksum the first time it reads from it, so a
// rank reads (and checks) only the files and tensors that hold its share; a flipped
// byte, a truncated file or an index that does not cover each parameter exactly once
// is refused by name, never loaded.
//
// Value i of a stretch is element (row0 + e / piece_cols) * whole_cols + col0 +
// e % piece_cols of the whole (row-major), e = first + i: ops::PieceIndex, the map
// initialisation uses. Loading cuts every stretch, saved and wanted, into runs that are
// contiguous in the whole and copies the overlaps, so no layout converts to another
// and no rank ever holds more than its share. docs/checkpoints.md has the format.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/ops/init.hpp"

namespace tessera::train {

namespace sharded {

inline constexpr const char* kCompleteMarker = "COMPLETE";
/// The marker's "format": what this reader reads.
inline constexpr const char* kFormat = "tessera sharded checkpoint 1";
/// The most ranks a marker may name.
inline constexpr std::int64_t kMaxWorld = std::int64_t{1} << 24;

inline std::string file_name(int rank, int world) {
  return "model-rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

/// Calls f(global, length, index) for each maximal run of a stretch (n values, value i
/// at element where(i) of the whole) that is contiguous in the whole: `length` values
/// from value `index`, elements global, global + 1, ... A stretch of a whole or of a
/// row piece is one run; one of a column piece, a run per row it touches.
template <class F>
void for_each_run(const ops::PieceIndex& where, std::int64_t n, F&& f) {
  if (n <= 0) return;
  if (where.piece_cols == where.whole_cols) {
    f(static_cast<std::int64_t>(where(0)), n, std::int64_t{0});
    return;
  }
  const auto cols = static_cast<std::int64_t>(where.piece_cols);
  for (std::int64_t i = 0; i < n;) {
    const std::int64_t e = static_cast<std::int64_t>(where.first) + i;
    const std::int64_t length = std::min(n - i, cols - e % cols);
    f(static_cast<std::int64_t>(where(static_cast<std::uint64_t>(i))), length, i);
    i += length;
  }
}

template <class T>
constexpr io::StDtype stored_dtype() {
  if constexpr (std::is_same_v<T, bf16>) return io::StDtype::bf16;
  else if constexpr (std::is_same_v<T, double>) return io::StDtype::f64;
  else return io::StDtype::f32;
}

inline std::vector<std::int64_t> dims(const Shape& s) { return {s.dims.begin(), s.dims.begin() + s.rank}; }

/// A run of saved values: elements [global, global + length) of a parameter, stored
/// from value `index` of tensor `key` in file `file`.
struct SavedRun {
  std::int64_t global, length;
  std::size_t file;
  std::string key;
  std::int64_t index;
};

/// What a complete folder holds: its files and, per parameter, its whole shape and its
/// saved runs in order of their first element, checked to cover the whole once.
struct Index {
  std::vector<io::SafetensorsFile> files;
  std::map<std::string, std::vector<std::int64_t>> shapes;
  std::map<std::string, std::vector<SavedRun>> runs;
  nlohmann::json model_args;
  std::vector<std::string> families;  // the state saved beside each stretch ("exp_avg", ...)
  std::set<std::string> values_only;  // parameters saved frozen (LoRA): no state beside them
  nlohmann::json state;               // the training state (step, data position, ...), or null
  std::vector<std::map<std::string, std::uint32_t>> crcs;  // per file: each tensor's CRC-32C

  /// Checks tensor `key` of file `file` against its checksum, once.
  void check(std::size_t file, const std::string& key) const {
    if (!checked_.insert({file, key}).second) return;
    const io::SafetensorsFile& f = files[file];
    const auto it = crcs[file].find(key);
    TESSERA_CHECK(it != crcs[file].end(), f.path(), ": tensor '", key, "' has no checksum in tessera.crc32c");
    const std::span<const std::byte> bytes = f.raw(key);
    const std::uint32_t crc = io::crc32c(bytes.data(), bytes.size());
    TESSERA_CHECK(crc == it->second, f.path(), ": tensor '", key, "' is corrupt: its bytes have CRC-32C ",
                  crc, ", the file's index says ", it->second, " (the file changed after it was saved)");
  }

  /// Checks every tensor of every file; returns the bytes checked.
  std::uint64_t check_all() const {
    std::uint64_t bytes = 0;
    for (std::size_t i = 0; i < files.size(); ++i)
      for (const auto& [key, crc] : crcs[i]) {
        check(i, key);
        bytes += files[i].raw(key).size();
      }
    return bytes;
  }

 private:
  mutable std::set<std::pair<std::size_t, std::string>> checked_;
};

/// The CRC-32C that "tessera.index_crc32c" holds: of the index's metadata strings.
inline std::uint32_t index_crc(const std::map<std::string, std::string>& meta) {
  std::uint32_t crc = 0;
  for (const char* key : {"tessera.stretches", "tessera.shapes", "tessera.families", "tessera.state",
                          "tessera.model_args", "tessera.crc32c"}) {
    const auto it = meta.find(key);
    const std::string_view text = it == meta.end() ? std::string_view() : std::string_view(it->second);
    crc = io::crc32c_update(crc, text.data(), text.size());
  }
  return crc;
}

/// How a file's training state reads in an error: "saved at step 3 (data position 12)",
/// or "saved with no training state (a model saved alone)" for a model's save.
inline std::string saved_with(const nlohmann::json& state) {
  if (state.is_null()) return "saved with no training state (a model saved alone)";
  if (!state.is_object()) return "saved with the training state " + state.dump();
  return "saved at step " + state.value("step", nlohmann::json()).dump() + " (data position " +
         state.value("data_position", nlohmann::json()).dump() + ")";
}

inline Index read_index(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path folder(dir);
  std::error_code ec;
  TESSERA_CHECK(fs::is_directory(folder, ec), dir, ": not a directory (expected a sharded checkpoint folder)");
  const fs::path marker = folder / kCompleteMarker;
  TESSERA_CHECK(fs::exists(marker, ec), dir, ": no ", kCompleteMarker,
                " marker: the save that wrote this folder did not finish, so it is not loaded");
  int world = 0;
  {
    std::ifstream in(marker);
    nlohmann::json j;
    try {
      in >> j;
    } catch (const std::exception& e) {
      fail(marker.string(), ": not a valid marker (", e.what(), ")");
    }
    TESSERA_CHECK(j.is_object() && j.contains("world_size"), marker.string(), ": not a valid marker (no world_size)");
    const nlohmann::json& w = j["world_size"];
    TESSERA_CHECK(w.is_number_integer() && w.get<std::int64_t>() >= 1 && w.get<std::int64_t>() <= kMaxWorld,
                  marker.string(), ": world_size ", w.dump(), " is not a number of ranks (1 to ", kMaxWorld, ")");
    world = w.get<int>();
    // Absent in the first markers; where present, the format this reader reads.
    TESSERA_CHECK(!j.contains("format") || j["format"] == kFormat, marker.string(), ": format ", j.value("format", nlohmann::json()).dump(),
                  " is not \"", kFormat, "\" (written by another version of tessera?)");
  }
  Index index;
  for (int r = 0; r < world; ++r) {
    const fs::path path = folder / file_name(r, world);
    TESSERA_CHECK(fs::exists(path, ec), path.string(), ": missing (the checkpoint was saved by ", world,
                  " ranks, each writing one file)");
    index.files.push_back(io::SafetensorsFile::open(path.string()));
    const io::SafetensorsFile& f = index.files.back();
    const auto& meta = f.metadata();
    auto field = [&](const char* key) -> nlohmann::json {
      auto it = meta.find(key);
      TESSERA_CHECK(it != meta.end(), f.path(), ": no ", key, " in the metadata (not a tessera sharded checkpoint)");
      try {
        return nlohmann::json::parse(it->second);
      } catch (const nlohmann::json::exception& e) {
        fail(f.path(), ": ", key, " is not valid JSON: ", e.what());
      }
    };
    {
      const nlohmann::json stored = field("tessera.index_crc32c");
      TESSERA_CHECK(stored.is_number_unsigned() && stored.get<std::uint64_t>() == index_crc(meta), f.path(),
                    ": the index in its header is corrupt (its CRC-32C is ", index_crc(meta),
                    ", tessera.index_crc32c says ", stored.dump(), ")");
      try {
        index.crcs.push_back(field("tessera.crc32c").get<std::map<std::string, std::uint32_t>>());
      } catch (const nlohmann::json::exception& e) {
        fail(f.path(), ": tessera.crc32c is not a map of checksums: ", e.what());
      }
    }
    // Every file of one save holds the same training state (its step, its data position):
    // a file from another save (copied in, or left by another run) would mix two models.
    const nlohmann::json state = field("tessera.state");
    if (r > 0)
      TESSERA_CHECK(state == index.state, f.path(), ": ", saved_with(state), ", where ", index.files.front().path(),
                    " was ", saved_with(index.state), ": the files come from different saves");
    if (r == 0) {
      index.model_args = field("tessera.model_args");
      const nlohmann::json families = field("tessera.families");
      try {
        index.families = families.get<std::vector<std::string>>();
      } catch (const nlohmann::json::exception& e) {
        fail(f.path(), ": tessera.families is not a list of names: ", e.what());
      }
      index.state = state;
    }
    const nlohmann::json shapes = field("tessera.shapes"), stretches = field("tessera.stretches");
    try {
      for (const auto& [name, shape] : shapes.items()) {
        const auto s = shape.get<std::vector<std::int64_t>>();
        auto [it, fresh] = index.shapes.emplace(name, s);
        TESSERA_CHECK(fresh || it->second == s, f.path(), ": parameter '", name, "' has shape ",
                      io::detail::shape_str(s), ", another file gives ", io::detail::shape_str(it->second));
      }
      for (const auto& s : stretches) {
        const auto name = s.at(0).get<std::string>();
        const auto key = s.at(1).get<std::string>();
        const ops::PieceIndex where{s.at(2).get<std::uint64_t>(), s.at(3).get<std::uint64_t>(),
                                    s.at(4).get<std::uint64_t>(), s.at(5).get<std::uint64_t>(),
                                    s.at(6).get<std::uint64_t>()};
        const auto n = s.at(7).get<std::int64_t>();
        // A stretch may list what is stored for it (a frozen parameter: its values alone).
        std::vector<std::string> own = index.families;
        if (s.size() > 8) {
          own = s.at(8).get<std::vector<std::string>>();
          TESSERA_CHECK(own == std::vector<std::string>{""}, f.path(), ": stretch '", key, "' lists ", s.at(8).dump(),
                        " (a stretch's own list holds its values alone: [\"\"])");
          if (index.families.size() > 1) index.values_only.insert(name);
        }
        for (const std::string& family : own) {
          const std::string stored = family.empty() ? key : family + "/" + key;
          TESSERA_CHECK(f.contains(stored), f.path(), ": stretch '", stored, "' is listed but not stored");
          TESSERA_CHECK(f.entry(stored).numel() == n, f.path(), ": stretch '", stored, "' holds ",
                        f.entry(stored).numel(), " values, the index says ", n);
        }
        TESSERA_CHECK(where.piece_cols >= 1 && where.whole_cols >= where.piece_cols, f.path(), ": stretch '", key,
                      "' has an impossible index map");
        auto& runs = index.runs[name];
        for_each_run(where, n, [&](std::int64_t global, std::int64_t length, std::int64_t i) {
          runs.push_back(SavedRun{global, length, static_cast<std::size_t>(r), key, i});
        });
      }
    } catch (const nlohmann::json::exception& e) {
      fail(f.path(), ": malformed stretch index: ", e.what());
    }
  }
  // Every parameter covered exactly once: sorted, the runs must tile [0, numel).
  for (auto& [name, runs] : index.runs) {
    TESSERA_CHECK(index.shapes.count(name), dir, ": parameter '", name, "' has stretches but no shape");
    std::sort(runs.begin(), runs.end(), [](const SavedRun& a, const SavedRun& b) { return a.global < b.global; });
    std::int64_t next = 0;
    for (const SavedRun& run : runs) {
      TESSERA_CHECK(run.global == next, dir, ": parameter '", name, "': elements ",
                    run.global < next
                        ? "from " + std::to_string(run.global) + " are saved twice"
                        : std::to_string(next) + " to " + std::to_string(run.global - 1) + " are missing");
      next = run.global + run.length;
    }
    // The shape's element count, refused where it is no tensor's (a negative size, or a
    // count past int64: the runs, each a stored tensor's, could never reach it).
    std::int64_t numel = 1;
    for (std::int64_t d : index.shapes.at(name)) {
      TESSERA_CHECK(d >= 0 && (d == 0 || numel <= std::numeric_limits<std::int64_t>::max() / d), dir,
                    ": parameter '", name, "' has shape ", io::detail::shape_str(index.shapes.at(name)),
                    ", which no tensor has");
      numel *= d;
    }
    TESSERA_CHECK(next == numel, dir, ": parameter '", name, "': elements ", next, " to ", numel - 1, " are missing");
  }
  for (const auto& [name, shape] : index.shapes)
    TESSERA_CHECK(index.runs.count(name), dir, ": parameter '", name, "' has no saved values");
  return index;
}

/// Copies n values into `dst` (B's memory), value i being element where(i) of
/// parameter `param`'s whole as saved under `family` ("" for the parameter's own
/// values), converting the stored element type to U.
template <Backend B, class U>
void read_into(const Index& index, const std::string& dir, const std::string& param, const std::string& family,
               const ops::PieceIndex& where, std::int64_t n, U* dst) {
  const std::vector<SavedRun>& runs = index.runs.at(param);
  TESSERA_CHECK(family.empty() || !index.values_only.count(param), dir, ": parameter '", param, "' was saved frozen "
                "(model.converters = [\"lora\"]: no optimizer state '", family, "' beside it); a run that trains it "
                "cannot resume training it from this checkpoint");
  std::vector<U> host(static_cast<std::size_t>(n));
  for_each_run(where, n, [&](std::int64_t global, std::int64_t length, std::int64_t i) {
    // The saved runs overlapping [global, global + length), in order.
    auto it = std::upper_bound(runs.begin(), runs.end(), global,
                               [](std::int64_t g, const SavedRun& r) { return g < r.global; });
    if (it != runs.begin()) --it;
    for (; it != runs.end() && it->global < global + length; ++it) {
      const std::int64_t lo = std::max(global, it->global), hi = std::min(global + length, it->global + it->length);
      if (lo >= hi) continue;
      const io::SafetensorsFile& f = index.files[it->file];
      const std::string key = family.empty() ? it->key : family + "/" + it->key;
      index.check(it->file, key);
      const io::TensorEntry& e = f.entry(key);
      TESSERA_CHECK(io::is_floating(e.dtype), dir, ": ", f.path(), ": stretch '", key, "' is stored as ",
                    io::name_of(e.dtype), ", not a floating type");
      const std::size_t width = io::size_of(e.dtype);
      const std::byte* from = f.raw(key).data() + static_cast<std::size_t>(it->index + (lo - it->global)) * width;
      U* to = host.data() + (i + (lo - global));
      if (e.dtype == stored_dtype<U>() && std::endian::native == std::endian::little)
        std::memcpy(static_cast<void*>(to), from, static_cast<std::size_t>(hi - lo) * sizeof(U));
      else
        for (std::int64_t k = 0; k < hi - lo; ++k)
          to[k] = io::detail::load_float_element<U>(e.dtype, from + static_cast<std::size_t>(k) * width);
    }
  });
  B::copy_from_host(host.data(), dst, n);
}

}  // namespace sharded

}  // namespace tessera::train
