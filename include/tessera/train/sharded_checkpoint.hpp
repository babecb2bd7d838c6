// Sharded model checkpoints: every rank writes the parameter values it holds, and any
// layout loads them, each rank reading only the elements it holds.
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
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/train/checkpoint.hpp"

namespace tessera::train {

namespace sharded {

inline constexpr const char* kCompleteMarker = "COMPLETE";

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
  nlohmann::json state;               // the training state (step, data position, ...), or null
};

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
      world = j.at("world_size").get<int>();
    } catch (const std::exception& e) {
      fail(marker.string(), ": not a valid marker (", e.what(), ")");
    }
    TESSERA_CHECK(world >= 1, marker.string(), ": world_size ", world, " is not a number of ranks");
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
    if (r == 0) {
      index.model_args = field("tessera.model_args");
      const nlohmann::json families = field("tessera.families"), state = field("tessera.state");
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
        for (const std::string& family : index.families) {
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
                    run.global < next ? "from " + std::to_string(run.global) + " are saved twice"
                                      : std::to_string(next) + " to " + std::to_string(run.global - 1) + " are missing");
      next = run.global + run.length;
    }
    std::int64_t numel = 1;
    for (std::int64_t d : index.shapes.at(name)) numel *= d;
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

/// Writes `dir`: this rank's file (the stretches it writes, and per stretch what
/// `add_state(h, key, writer)` adds under each of `families`), then rank 0's marker. A
/// collective over the model's world.
template <class Model, class AddState>
void save_folder(Model& model, const std::string& dir, const std::vector<std::string>& families,
                 const nlohmann::json& state, AddState&& add_state) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  namespace fs = std::filesystem;
  comm::Communicator* world = model.plan().mesh ? &model.plan().mesh->world() : nullptr;
  const int rank = world ? world->rank() : 0, size = world ? world->size() : 1;
  const fs::path folder(dir);
  io::SafetensorsWriter w;
  nlohmann::json stretches = nlohmann::json::array(), shapes = nlohmann::json::object();
  std::map<std::string, int> count;
  model.for_each_held_stretch([&](const auto& h) {
    if (!h.writer) return;
    const nn::Parameter<T>& p = *h.param;
    const std::string key = p.name + "@" + std::to_string(count[p.name]++);
    const Tensor<T> host = download<B>(h.local->value.slice(h.offset, Shape{h.n}));
    w.add(key, stored_dtype<T>(), {h.n}, std::span<const T>(host.data(), static_cast<std::size_t>(h.n)));
    add_state(h, key, w);
    stretches.push_back({p.name, key, h.where.first, h.where.whole_cols, h.where.piece_cols, h.where.row0,
                         h.where.col0, h.n});
    shapes[p.name] = dims(p.whole);
  });
  std::vector<std::string> stored = {""};  // the values themselves, then the state
  stored.insert(stored.end(), families.begin(), families.end());
  w.set_metadata("format", "pt");
  w.set_metadata("tessera.stretches", stretches.dump());
  w.set_metadata("tessera.shapes", shapes.dump());
  w.set_metadata("tessera.families", nlohmann::json(stored).dump());
  w.set_metadata("tessera.state", state.dump());
  w.set_metadata("tessera.model_args", model_args_to_json(model.args()).dump());
  w.set_metadata("tessera.rank", std::to_string(rank));
  w.set_metadata("tessera.world_size", std::to_string(size));
  if (rank == 0) {
    // A folder reused by a new save loses its marker first: a crash from here on leaves
    // it incomplete, never complete with a mix of two saves.
    std::error_code ec;
    fs::remove(folder / kCompleteMarker, ec);
  }
  if (world) world->barrier();
  B::synchronize();
  w.write((folder / file_name(rank, size)).string());  // to a temporary name, then renamed
  if (world) world->barrier();
  B::synchronize();  // every file is in place before the marker
  if (rank == 0) {
    const fs::path tmp = folder / (std::string(kCompleteMarker) + ".tmp");
    {
      std::ofstream out(tmp);
      out << nlohmann::json{{"world_size", size}, {"format", "tessera sharded checkpoint 1"}}.dump() << "\n";
      out.flush();
      TESSERA_CHECK(out.good(), tmp.string(), ": cannot write");
    }
    std::error_code ec;
    fs::rename(tmp, folder / kCompleteMarker, ec);
    TESSERA_CHECK(!ec, (folder / kCompleteMarker).string(), ": cannot rename into place: ", ec.message());
  }
  if (world) world->barrier();
  B::synchronize();  // no rank reads the folder before it is complete
}

/// Checks that `dir` (read into `index`) holds `model`'s parameters; then reads each
/// stretch `model` holds and calls load(h) for it.
template <class Model, class Load>
void load_folder(Model& model, const Index& index, const std::string& dir, Load&& load) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  const nn::ModelArgs saved = model_args_from_json(index.model_args, dir);
  const nn::ModelArgs& a = model.args();
  TESSERA_CHECK(saved.dim == a.dim && saved.n_layers == a.n_layers && saved.n_heads == a.n_heads &&
                    saved.kv_heads() == a.kv_heads() && saved.vocab_size == a.vocab_size &&
                    saved.ffn_hidden_dim() == a.ffn_hidden_dim() && saved.tie_embeddings == a.tie_embeddings,
                dir, ": the checkpoint's model (", saved.flavor, ", ", saved.num_params(),
                " parameters) is not this model (", a.flavor, ", ", a.num_params(), " parameters)");
  model.for_each_held_stretch([&](const auto& h) {
    const nn::Parameter<T>& p = *h.param;
    const auto shape = index.shapes.find(p.name);
    TESSERA_CHECK(shape != index.shapes.end(), dir, ": parameter '", p.name, "' is not in the checkpoint");
    TESSERA_CHECK(shape->second == dims(p.whole), dir, ": parameter '", p.name, "' has shape ",
                  io::detail::shape_str(shape->second), " in the checkpoint, the model's is ", p.whole.str());
    read_into<B>(index, dir, p.name, "", h.where, h.n, h.values());
    load(h);
  });
  B::synchronize();
}

}  // namespace sharded

/// Saves `model` as a sharded checkpoint in `dir`: a collective over the model's world
/// (every rank writes its file; rank 0 writes the marker once all have). The model may
/// be in any layout; nothing is gathered.
template <class Model>
void save_sharded_model(Model& model, const std::string& dir) {
  sharded::save_folder(model, dir, {}, nullptr, [](const auto&, const std::string&, io::SafetensorsWriter&) {});
}

/// Loads a sharded checkpoint saved under any layout into `model`, in its own layout:
/// each rank reads the elements it holds. A model without storage is given its share
/// first (never the whole). An incomplete folder, a missing file, a parameter missing,
/// saved twice or of another shape, or another model is refused by name.
template <class Model>
void load_sharded_model(Model& model, const std::string& dir) {
  sharded::load_folder(model, sharded::read_index(dir), dir, [](const auto&) {});
}

/// Saves the training state as a sharded checkpoint: the model's values, the
/// optimizer's state beside each stretch (its moments and masters, in their own element
/// types, under "exp_avg/", "exp_avg_sq/" and "master/"), and `state` (the trainer's:
/// step, data position; with the optimizer's step count added) in the metadata.
template <class Model, class Optimizer>
void save_sharded_checkpoint(Model& model, Optimizer& optimizer, const std::string& dir, nlohmann::json state) {
  using B = typename Model::backend_type;
  std::vector<std::string> families;
  for (std::string_view name : optimizer.state_names()) families.emplace_back(name);
  state["optimizer_steps"] = optimizer.steps_taken();
  sharded::save_folder(model, dir, families, state, [&](const auto& h, const std::string& key, io::SafetensorsWriter& w) {
    optimizer.for_each_state_tensor(*h.local, [&](std::string_view name, auto& t) {
      using M = typename std::remove_cvref_t<decltype(t)>::value_type;
      const Tensor<M> host = download<B>(t.slice(h.offset, Shape{h.n}));
      w.add(std::string(name) + "/" + key, sharded::stored_dtype<M>(), {h.n},
            std::span<const M>(host.data(), static_cast<std::size_t>(h.n)));
    });
  });
}

/// Loads a checkpoint save_sharded_checkpoint wrote, under any layout, into `model` and
/// `optimizer` (made for the model in its own layout); returns the saved state. A
/// folder without the optimizer's state is refused by name.
template <class Model, class Optimizer>
nlohmann::json load_sharded_checkpoint(Model& model, Optimizer& optimizer, const std::string& dir) {
  using B = typename Model::backend_type;
  const sharded::Index index = sharded::read_index(dir);
  // Everything the optimizer needs is there before anything is read.
  for (std::string_view name : optimizer.state_names())
    TESSERA_CHECK(std::find(index.families.begin(), index.families.end(), name) != index.families.end(), dir,
                  ": no optimizer state '", name, "' (a model-only checkpoint, or one saved without ", name,
                  "): it cannot resume training");
  TESSERA_CHECK(index.state.is_object() && index.state.contains("optimizer_steps"), dir,
                ": no training state in the metadata (a model-only checkpoint): it cannot resume training");
  sharded::load_folder(model, index, dir, [&](const auto& h) {
    optimizer.for_each_state_tensor(*h.local, [&](std::string_view name, auto& t) {
      sharded::read_into<B>(index, dir, h.param->name, std::string(name), h.where, h.n, t.data() + h.offset);
    });
  });
  optimizer.set_steps_taken(index.state.at("optimizer_steps").get<std::int64_t>());
  return index.state;
}

}  // namespace tessera::train
