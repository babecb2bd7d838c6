// Sharded model checkpoints: every rank writes the parameter values it holds, and any
// layout loads them, each rank reading only the elements it holds. The folder's format
// and its reading: checkpoint/sharded_format.hpp.
//
// A save writes into `<folder>.partial`; every file is fsynced; rank 0 writes the
// marker, fsyncs it and the folder, and only then renames `<folder>.partial` to
// `<folder>`: a crash at any moment leaves either no folder or a complete one, and the
// checkpoints saved before it untouched.
#pragma once

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/checkpoint/sharded_format.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/parallel/host_values.hpp"

namespace tessera::train {

namespace sharded {

/// The world a model's plan spans (null on a plan without a mesh: one rank).
template <class Model>
comm::Communicator* world_of(Model& model) {
  return model.plan().mesh ? &model.plan().mesh->world() : nullptr;
}

/// Host buffers that saves copy into, kept from one save to the next. A fresh buffer
/// costs its first-touch page faults, which on this project's CPU machine make copying
/// a checkpoint to host memory several times slower than the copy itself; a reused
/// one costs only the copy. On a GPU each buffer is also page-locked once, when it is
/// made (`pin`, cudaHostRegister: Cuda::pin_host), so the device-to-host copy runs at
/// the bus's rate, and unlocked (`unpin`) when the pool is destroyed. Every save of a
/// model asks for the same sizes in the same order, so buffers are matched by size.
/// Buffers come back from any thread (a RankFile returns its own when destroyed).
class HostBuffers {
 public:
  struct Pinning {
    void (*pin)(void*, std::size_t) = nullptr;
    void (*unpin)(void*) = nullptr;
  };

  HostBuffers() = default;
  explicit HostBuffers(Pinning pinning) : pinning_(pinning) {}
  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;
  /// Every buffer must be back (the owner outlives the saves it lends to).
  ~HostBuffers() {
    if (!pinning_.unpin) return;
    for (auto& [size, b] : free_)
      if (size > 0) pinning_.unpin(b.data());
  }

  std::vector<std::byte> take(std::size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.find(bytes);
      if (it != free_.end()) {
        std::vector<std::byte> b = std::move(it->second);
        free_.erase(it);
        return b;
      }
    }
    std::vector<std::byte> b(bytes);
    if (pinning_.pin && bytes > 0) pinning_.pin(b.data(), bytes);
    return b;
  }
  void give_back(std::vector<std::vector<std::byte>> buffers) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& b : buffers) free_.emplace(b.size(), std::move(b));
  }
  std::uint64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::uint64_t n = 0;
    for (const auto& [size, b] : free_) n += size;
    return n;
  }

 private:
  Pinning pinning_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, std::vector<std::byte>> free_;
};

/// B's way of page-locking host buffers (Cuda::pin_host), or none (the CPU's memory is
/// the host's).
template <Backend B>
HostBuffers::Pinning host_pinning() {
  if constexpr (requires(void* p, std::size_t n) {
                  B::pin_host(p, n);
                  B::unpin_host(p);
                })
    return {&B::pin_host, &B::unpin_host};
  else
    return {};
}

/// One rank's file of a save, copied to host memory: what a save takes from the device
/// before it writes a byte (an asynchronous save writes it while training goes on). The
/// copy is all a save holds the step for: the checksums and the index are made by
/// write_rank_file, on whichever thread writes. Its buffers go back to the pool that
/// lent them when it is destroyed.
struct RankFile {
  io::SafetensorsWriter writer;
  std::map<std::string, std::string> index;  // the metadata, but for the checksums
  int rank = 0, world = 1;
  HostBuffers* pool = nullptr;

  RankFile() = default;
  RankFile(RankFile&& o) noexcept
      : writer(std::move(o.writer)), index(std::move(o.index)), rank(o.rank), world(o.world),
        pool(std::exchange(o.pool, nullptr)) {}
  RankFile& operator=(RankFile&& o) noexcept {
    if (this != &o) {
      release();
      writer = std::move(o.writer);
      index = std::move(o.index);
      rank = o.rank;
      world = o.world;
      pool = std::exchange(o.pool, nullptr);
    }
    return *this;
  }
  ~RankFile() { release(); }

  std::uint64_t bytes() const { return writer.file_bytes(); }

 private:
  void release() noexcept {
    if (pool) pool->give_back(writer.take_buffers());
    pool = nullptr;
  }
};

/// n values of T at `from` (B's memory), copied to host bytes as safetensors stores them,
/// into a buffer from `pool` when one is given.
template <Backend B, class T>
std::vector<std::byte> host_bytes(const T* from, std::int64_t n, HostBuffers* pool = nullptr) {
  static_assert(std::endian::native == std::endian::little, "checkpoint bytes are little-endian, as stored");
  const std::size_t size = static_cast<std::size_t>(n) * sizeof(T);
  std::vector<std::byte> bytes = pool ? pool->take(size) : std::vector<std::byte>(size);
  B::copy_to_host(from, reinterpret_cast<T*>(bytes.data()), n);
  return bytes;
}

/// This rank's file of a save of `model`: the stretches it writes and, per stretch,
/// what `add_state(h, key, writer)` adds under each of `families`. No collective.
template <class Model, class AddState>
RankFile snapshot(Model& model, const std::vector<std::string>& families, const nlohmann::json& state,
                  AddState&& add_state, HostBuffers* pool = nullptr) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  comm::Communicator* world = world_of(model);
  RankFile out;
  out.pool = pool;
  out.rank = world ? world->rank() : 0;
  out.world = world ? world->size() : 1;
  io::SafetensorsWriter& w = out.writer;
  nlohmann::json stretches = nlohmann::json::array(), shapes = nlohmann::json::object();
  std::map<std::string, int> count;
  std::vector<std::string> stored = {""};  // the values themselves, then the state
  stored.insert(stored.end(), families.begin(), families.end());
  model.for_each_held_stretch([&](const auto& h) {
    if (!h.writer) return;
    const nn::Parameter<T>& p = *h.param;
    const std::string key = p.name + "@" + std::to_string(count[p.name]++);
    w.add_bytes(key, stored_dtype<T>(), {h.n}, with_backend<B>(on_host(h.local->value), [&]<class X>() {
                  return host_bytes<X>(h.local->value.data() + h.offset, h.n, pool);
                }));
    add_state(h, key, w);
    nlohmann::json stretch = {p.name, key, h.where.first, h.where.whole_cols, h.where.piece_cols, h.where.row0,
                              h.where.col0, h.n};
    // A frozen parameter (LoRA) has no optimizer state: its values alone, said so.
    if (p.frozen && families.size() > 0) stretch.push_back(nlohmann::json::array({""}));
    stretches.push_back(std::move(stretch));
    shapes[p.name] = dims(p.whole);
  });
  B::synchronize();  // the copies are on the host before the step goes on
  out.index = {{"tessera.stretches", stretches.dump()},
               {"tessera.shapes", shapes.dump()},
               {"tessera.families", nlohmann::json(stored).dump()},
               {"tessera.state", state.dump()},
               {"tessera.model_args", model_args_to_json(model.args()).dump()}};
  return out;
}

/// Where a save of `dir` is written until it is complete.
inline std::string partial_path(const std::string& dir) { return dir + ".partial"; }

/// Flushes `path` (a file or a folder) to the disk.
inline void sync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, path.string(), ": cannot open to flush it to the disk: ", std::strerror(errno));
  const int synced = ::fsync(fd), err = errno;
  ::close(fd);
  // Some file systems cannot fsync a folder (EINVAL): their renames are what they are.
  TESSERA_CHECK(synced == 0 || err == EINVAL, path.string(), ": fsync failed: ", std::strerror(err));
}

/// The start of a save of `dir`, on rank 0: an earlier save of the same folder that a
/// crash interrupted is removed, and its partial folder made.
inline void begin_save(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::remove_all(partial_path(dir), ec);
  TESSERA_CHECK(!ec, partial_path(dir), ": cannot remove what an interrupted save left: ", ec.message());
  fs::create_directories(partial_path(dir), ec);
  TESSERA_CHECK(!ec, partial_path(dir), ": cannot create: ", ec.message());
}

/// Writes `file` into the partial folder of `dir` (written to a temporary name,
/// fsynced, renamed), with every tensor's checksum and the index's. No collective.
inline void write_rank_file(RankFile& file, const std::string& dir) {
  io::SafetensorsWriter& w = file.writer;
  std::map<std::string, std::string> meta = file.index;
  meta["tessera.crc32c"] = nlohmann::json(w.crc32cs()).dump();  // every stretch of every family
  w.set_metadata("tessera.index_crc32c", std::to_string(index_crc(meta)));
  for (auto& [key, value] : meta) w.set_metadata(key, std::move(value));
  w.set_metadata("format", "pt");
  w.set_metadata("tessera.rank", std::to_string(file.rank));
  w.set_metadata("tessera.world_size", std::to_string(file.world));
  w.write((std::filesystem::path(partial_path(dir)) / file_name(file.rank, file.world)).string());
}

/// The end of a save of `dir` by `world` ranks, on rank 0 once every rank's file is
/// written: the marker, fsynced, then the atomic rename of the partial folder. A
/// folder saved before under the same name is replaced only by the rename.
inline void commit_save(const std::string& dir, int world) {
  namespace fs = std::filesystem;
  const fs::path folder(dir), partial(partial_path(dir));
  for (int r = 0; r < world; ++r)
    TESSERA_CHECK(fs::exists(partial / file_name(r, world)), (partial / file_name(r, world)).string(),
                  ": missing when the save of ", dir, " was to be committed");
  const fs::path tmp = partial / (std::string(kCompleteMarker) + ".tmp");
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"world_size", world}, {"format", kFormat}}.dump() << "\n";
    out.flush();
    TESSERA_CHECK(out.good(), tmp.string(), ": cannot write");
  }
  sync_path(tmp);
  std::error_code ec;
  fs::rename(tmp, partial / kCompleteMarker, ec);
  TESSERA_CHECK(!ec, (partial / kCompleteMarker).string(), ": cannot rename into place: ", ec.message());
  sync_path(partial);
  const fs::path old = dir + ".old";
  if (fs::exists(folder)) {
    fs::remove_all(old, ec);
    fs::rename(folder, old, ec);
    TESSERA_CHECK(!ec, dir, ": cannot move the earlier save aside: ", ec.message());
  }
  fs::rename(partial, folder, ec);
  TESSERA_CHECK(!ec, dir, ": cannot rename ", partial.string(), " into place: ", ec.message());
  sync_path(folder.has_parent_path() ? folder.parent_path() : fs::path("."));
  fs::remove_all(old, ec);
}

/// Every rank waits for every other, the host included.
template <Backend B>
void hold(comm::Communicator* world) {
  if (world) world->barrier();
  B::synchronize();  // a barrier orders the stream (NCCL); this holds the host
}

/// Writes `dir` from every rank's `file`: each rank its file, rank 0 the marker once
/// all are in place, then the rename. A collective over `world`.
template <Backend B>
void write_folder(comm::Communicator* world, RankFile& file, const std::string& dir) {
  if (file.rank == 0) begin_save(dir);
  hold<B>(world);
  write_rank_file(file, dir);
  hold<B>(world);  // every file is in place before the marker
  if (file.rank == 0) commit_save(dir, file.world);
  hold<B>(world);  // no rank reads the folder before it is complete
}

/// A save whose file a background thread writes while training goes on
/// (checkpoint.async_mode = "async"). start() takes the host copy (RankFile) and
/// returns; poll(), which every rank calls after each step, commits the save once every
/// rank's file is on the disk (rank 0 writes the marker and renames the folder). Until
/// then the save is `<dir>.partial`, which no resume loads: a crash while it is written
/// loses it and nothing else. A rank whose write fails fails every rank at the poll.
template <Backend B>
class AsyncSave {
 public:
  AsyncSave() = default;
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;
  ~AsyncSave() {
    if (writing_.valid()) writing_.wait();  // the thread must not outlive what it writes
  }

  /// A save is started and not yet committed (the same on every rank).
  bool pending() const { return file_ != nullptr; }
  const std::string& dir() const { return dir_; }
  /// The bytes this rank's file holds.
  std::uint64_t bytes() const { return file_ ? file_->bytes() : 0; }

  /// A collective: starts writing `file` into `dir` (a save still pending is committed
  /// first, waiting for it).
  void start(comm::Communicator* world, RankFile file, std::string dir) {
    if (pending()) poll(world, true);
    if (file.rank == 0) begin_save(dir);
    hold<B>(world);  // the partial folder exists before any rank writes into it
    file_ = std::make_shared<RankFile>(std::move(file));
    dir_ = std::move(dir);
    writing_ = std::async(std::launch::async, [f = file_, d = dir_] { write_rank_file(*f, d); });
  }

  /// Waits for this rank's write of the pending save, and keeps its failure for poll().
  /// Not a collective: poll() still commits the save.
  void wait_written() {
    if (!pending() || written_) return;
    try {
      writing_.get();
    } catch (...) {
      error_ = std::current_exception();
    }
    written_ = true;
  }

  /// A collective: true when this call committed the pending save. With `wait`, waits
  /// for this rank's write (then the save is committed, or every rank throws).
  bool poll(comm::Communicator* world, bool wait = false) {
    if (!pending()) return false;
    using namespace std::chrono_literals;
    if (wait || (!written_ && writing_.wait_for(0s) == std::future_status::ready)) wait_written();
    // 0: written; 1: still writing; 2: failed. The most behind rank decides for all.
    const double mine = error_ ? 2.0 : written_ ? 0.0 : 1.0;
    const double all = world && world->size() > 1 ? parallel::all_reduce_host<B>(*world, mine, comm::ReduceOp::max)
                                                   : mine;
    if (all == 1.0) return false;
    const std::shared_ptr<RankFile> file = file_;
    const std::exception_ptr error = error_;
    const std::string dir = dir_;
    file_.reset();
    written_ = false;
    error_ = nullptr;
    if (error) std::rethrow_exception(error);
    TESSERA_CHECK(all == 0.0, partial_path(dir), ": another rank could not write its file (its own message says why)");
    if (file->rank == 0) commit_save(dir, file->world);
    return true;
  }

 private:
  std::shared_ptr<RankFile> file_;
  std::string dir_;
  std::future<void> writing_;
  bool written_ = false;
  std::exception_ptr error_;
};

/// Runs f() on every rank of `world`; if it throws on any, it throws on every one (the
/// rank that failed with its own error, the others naming it), so no rank goes on to a
/// collective that another will never join. One all-reduce.
template <Backend B, class F>
void on_every_rank_or_none(comm::Communicator* world, const std::string& what, F&& f) {
  std::exception_ptr error;
  try {
    f();
  } catch (...) {
    error = std::current_exception();
  }
  if (!world || world->size() == 1) {
    if (error) std::rethrow_exception(error);
    return;
  }
  const double failed = parallel::all_reduce_host<B>(*world, error ? static_cast<double>(world->rank() + 1) : 0.0,
                                                     comm::ReduceOp::max);
  if (error) std::rethrow_exception(error);
  TESSERA_CHECK(failed == 0, what, ": rank ", static_cast<int>(failed) - 1, " failed (its own message says why)");
}

/// Checks that `dir` (read into `index`) holds `model`'s parameters; then, for each
/// stretch `model` holds, reads its values (unless `values` is false; from family
/// `values_family`, "" for the values themselves) and calls load(h).
template <class Model, class Load>
void load_folder(Model& model, const Index& index, const std::string& dir, Load&& load, bool values = true,
                 const std::string& values_family = "") {
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
    // A frozen parameter (LoRA) was saved with its values alone: they are its masters too.
    if (values)
      with_backend<B>(on_host(h.local->value), [&]<class X>() {
        read_into<X>(index, dir, p.name, index.values_only.count(p.name) ? std::string() : values_family, h.where, h.n,
                     h.values());
      });
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
  using B = typename Model::backend_type;
  sharded::RankFile file =
      sharded::snapshot(model, {}, nullptr, [](const auto&, const std::string&, io::SafetensorsWriter&) {});
  sharded::write_folder<B>(sharded::world_of(model), file, dir);
}

/// Loads a sharded checkpoint saved under any layout into `model`, in its own layout:
/// each rank reads the elements it holds. A model without storage is given its share
/// first (never the whole). An incomplete folder, a missing file, a corrupt tensor, a
/// parameter missing, saved twice or of another shape, or another model is refused by
/// name, on every rank (a collective).
/// With `masters`, a training checkpoint of bf16 parameters gives its fp32 masters
/// (the optimizer's full-precision copy) rather than the rounded values, where it has
/// them; returns whether it did.
template <class Model>
bool load_sharded_model(Model& model, const std::string& dir, bool masters = false) {
  using B = typename Model::backend_type;
  bool from_masters = false;
  sharded::on_every_rank_or_none<B>(sharded::world_of(model), dir, [&] {
    const sharded::Index index = sharded::read_index(dir);
    from_masters = masters && std::find(index.families.begin(), index.families.end(), "master") != index.families.end();
    sharded::load_folder(model, index, dir, [](const auto&) {}, true, from_masters ? "master" : "");
  });
  return from_masters;
}

/// This rank's file of a training checkpoint, in host memory: the model's values, the
/// optimizer's state beside each stretch (its moments and masters, in their own element
/// types, under "exp_avg/", "exp_avg_sq/" and "master/"), and `state` (the trainer's:
/// step, data position; with the optimizer's step count added) in the metadata. No
/// collective: write it with sharded::write_folder, now or from another thread.
/// `pool` (kept by the caller from one save to the next) lends the host buffers.
template <class Model, class Optimizer>
sharded::RankFile snapshot_checkpoint(Model& model, Optimizer& optimizer, nlohmann::json state,
                                      sharded::HostBuffers* pool = nullptr) {
  using B = typename Model::backend_type;
  std::vector<std::string> families;
  for (std::string_view name : optimizer.state_names()) families.emplace_back(name);
  state["optimizer_steps"] = optimizer.steps_taken();
  auto add_state = [&](const auto& h, const std::string& key, io::SafetensorsWriter& w) {
    optimizer.for_each_state_tensor(*h.local, [&](std::string_view name, auto& t) {
      using M = typename std::remove_cvref_t<decltype(t)>::value_type;
      w.add_bytes(std::string(name) + "/" + key, sharded::stored_dtype<M>(), {h.n},
                  with_backend<B>(on_host(t), [&]<class X>() { return sharded::host_bytes<X>(t.data() + h.offset, h.n, pool); }));
    });
  };
  return sharded::snapshot(model, families, state, add_state, pool);
}

/// Saves the training state as a sharded checkpoint in `dir` (snapshot_checkpoint,
/// then write_folder): a collective over the model's world.
template <class Model, class Optimizer>
void save_sharded_checkpoint(Model& model, Optimizer& optimizer, const std::string& dir, nlohmann::json state,
                             sharded::HostBuffers* pool = nullptr) {
  using B = typename Model::backend_type;
  sharded::RankFile file = snapshot_checkpoint(model, optimizer, std::move(state), pool);
  sharded::write_folder<B>(sharded::world_of(model), file, dir);
}

/// What a resume loads of a training checkpoint (checkpoint.exclude_from_loading): the
/// model (its values, and the optimizer's fp32 masters of bf16 values) and the
/// optimizer (its moments and step count). What is not loaded keeps the value it has.
struct LoadParts {
  bool model = true;
  bool optimizer = true;
};

/// Loads a checkpoint save_sharded_checkpoint wrote, under any layout, into `model` and
/// `optimizer` (made for the model in its own layout); returns the saved state. A
/// folder without the optimizer's state is refused by name. A collective: a rank that
/// cannot read its share fails every rank.
/// `check_state(state)`, when given, sees the saved state before anything is read, and
/// throws to refuse it.
template <class Model, class Optimizer>
nlohmann::json load_sharded_checkpoint(Model& model, Optimizer& optimizer, const std::string& dir,
                                       LoadParts parts = {},
                                       const std::function<void(const nlohmann::json&)>& check_state = {}) {
  using B = typename Model::backend_type;
  nlohmann::json state;
  sharded::on_every_rank_or_none<B>(sharded::world_of(model), dir, [&] {
    const sharded::Index index = sharded::read_index(dir);
    // Everything the optimizer needs is there before anything is read; the caller's
    // check of the settings comes first, as it names the setting that changed.
    TESSERA_CHECK(index.state.is_object() && index.state.contains("optimizer_steps"), dir,
                  ": no training state in the metadata (a model-only checkpoint): it cannot resume training");
    if (check_state) check_state(index.state);
    for (std::string_view name : optimizer.state_names())
      TESSERA_CHECK(std::find(index.families.begin(), index.families.end(), name) != index.families.end(), dir,
                    ": no optimizer state '", name, "' (saved by a run without ", name, "): it cannot resume training");
    sharded::load_folder(
        model, index, dir,
        [&](const auto& h) {
          optimizer.for_each_state_tensor(*h.local, [&](std::string_view name, auto& t) {
            // The masters are the model's values at full precision: they go with the model.
            if (!(name == "master" ? parts.model : parts.optimizer)) return;
            with_backend<B>(on_host(t), [&]<class X>() {
              sharded::read_into<X>(index, dir, h.param->name, std::string(name), h.where, h.n, t.data() + h.offset);
            });
          });
        },
        parts.model);
    state = index.state;
  });
  if (parts.optimizer) optimizer.set_steps_taken(state.at("optimizer_steps").get<std::int64_t>());
  return state;
}

}  // namespace tessera::train
