// bench-checkpoint-io: how fast a training checkpoint is saved and loaded, against the
// disk's own bandwidth measured in the same run, and what an asynchronous save holds the
// step for.
//
// For each rank count (thread ranks, FSDP over all of them), the model is made, sharded
// and given its AdamW state, then:
//   disk write  every rank writes and fsyncs a file as large as its checkpoint file at
//               once (4 MiB writes), twice, the faster counting: the disk's bandwidth
//               under the same concurrency;
//   snapshot    train::snapshot_checkpoint: the copy to host memory, which is all an
//               asynchronous save holds the step for; into reused buffers, as every
//               save after a run's first (that one's, with fresh buffers, in brackets);
//   write       sharded::write_folder: the checksums, the files, fsynced, the marker
//               and the rename;
//   save        snapshot + write: what a synchronous save holds the step for;
//   load        the files evicted from the page cache (posix_fadvise DONTNEED, so they
//               are read from the disk), then train::load_sharded_checkpoint into a
//               fresh model and optimizer, every tensor read checked against its CRC.
// Rates are per rank: the bytes of the rank's file over the rank's seconds.
//
//   bench-checkpoint-io [--flavor F] [--layers N] [--ranks 1,2] [--dir DIR] [--commit HASH]
//
// The default model is Llama 3.2 1B's shape cut to 4 layers (506M parameters: 8 GB of
// fp32 values, moments and gradients, plus the host copy of a save): the largest that
// leaves a 24 GiB machine room for a second model to load into.
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "machine.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/sharded.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/instances.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/trainer.hpp"

namespace {

using namespace tessera;
namespace fs = std::filesystem;
using Model = DynamicModel<float, Cpu>;
using clock_type = std::chrono::steady_clock;

struct Options {
  std::string flavor = "llama3.2_1b";
  std::int64_t layers = 4;
  std::vector<int> ranks = {1, 2};
  std::string dir;
  std::string commit = "-";
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (bench::Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--flavor") o.flavor = std::string(f.value());
    else if (flag == "--layers") o.layers = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--dir") o.dir = std::string(f.value());
    else if (flag == "--commit") o.commit = std::string(f.value());
    else if (flag == "--ranks") {
      o.ranks.clear();
      for (std::string_view r : bench::split_commas(f.value()))
        o.ranks.push_back(static_cast<int>(bench::parse_count(flag, r, 1)));
    } else if (flag == "--help") {
      std::printf("usage: bench-checkpoint-io [--flavor F] [--layers N] [--ranks 1,2] [--dir DIR] [--commit HASH]\n");
      std::exit(0);
    } else {
      f.unknown();
    }
  }
  return o;
}

double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

/// Writes `bytes` to `path` in 4 MiB writes and fsyncs it; returns the seconds.
double disk_write(const fs::path& path, std::uint64_t bytes) {
  std::vector<char> chunk(std::size_t{4} << 20, 'x');
  const auto t0 = clock_type::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TESSERA_CHECK(fd >= 0, path.string(), ": cannot open");
  for (std::uint64_t done = 0; done < bytes;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), bytes - done));
    const ssize_t w = ::write(fd, chunk.data(), n);
    TESSERA_CHECK(w > 0, path.string(), ": write failed");
    done += static_cast<std::uint64_t>(w);
  }
  TESSERA_CHECK(::fsync(fd) == 0, path.string(), ": fsync failed");
  ::close(fd);
  return since(t0);
}

/// Drops `folder`'s files from the page cache, so the next read comes from the disk.
void evict(const fs::path& folder) {
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

train::JobConfig job(const Options& o, int ranks) {
  return train::load_config("", {"--model.flavor", o.flavor, "--model.n_layers", std::to_string(o.layers),
                                 "--parallelism.data_parallel_shard_degree", std::to_string(ranks)});
}

struct Row {
  int ranks = 0;
  double params = 0, file_bytes = 0;  // file_bytes: rank 0's
  double disk = 0, first_snapshot = 0, snapshot = 0, write = 0, load = 0;
};

Row measure(const Options& o, int ranks, const fs::path& root) {
  const train::JobConfig c = job(o, ranks);
  Row row;
  row.ranks = ranks;
  row.params = static_cast<double>(c.model.args.num_params());
  const fs::path folder = root / ("step-" + std::to_string(ranks));
  std::vector<Row> per(static_cast<std::size_t>(ranks));
  comm::run_thread_ranks(ranks, [&](comm::Communicator& world) {
    omp_set_num_threads(std::max(1, Cpu::threads() / ranks));
    Row& r = per[static_cast<std::size_t>(world.rank())];
    comm::DeviceMesh mesh(world, comm::mesh_shape(ranks, 1, ranks, 1, 1));
    const parallel::Plan plan = train::make_plan(c, &mesh);
    const optim::AdamWOptions adamw;
    {
      Model model(c.model.args, plan);
      model.init_weights(1);
      model.shard();
      optim::AdamW<float, Cpu> optimizer(model, adamw);
      const nlohmann::json state = {{"step", 1}, {"lr_step", 1}, {"data_position", 0}, {"config", nlohmann::json::object()}};
      // The disk alone, every rank at once, as much as its checkpoint file.
      // The first save's copy pays its buffers' page faults; every later one reuses them
      // (train::sharded::HostBuffers, as the Trainer keeps): the stall of a save is the
      // second's.
      train::sharded::HostBuffers pool;
      auto t0 = clock_type::now();
      {
        const train::sharded::RankFile first = train::snapshot_checkpoint(model, optimizer, state, &pool);
        r.first_snapshot = since(t0);
      }  // its buffers go back to the pool
      t0 = clock_type::now();
      train::sharded::RankFile file = train::snapshot_checkpoint(model, optimizer, state, &pool);
      r.snapshot = since(t0);
      r.file_bytes = static_cast<double>(file.bytes());
      world.barrier();
      // Twice, the faster counting: on a thin-provisioned disk the first write into fresh
      // blocks is slower than any later one (the checkpoint's write reuses these).
      const fs::path probe = root / ("probe-" + std::to_string(world.rank()));
      r.disk = disk_write(probe, file.bytes());
      world.barrier();
      r.disk = std::min(r.disk, disk_write(probe, file.bytes()));
      fs::remove(probe);
      world.barrier();
      t0 = clock_type::now();
      train::sharded::write_folder<Cpu>(&world, file, folder.string());
      r.write = since(t0);
    }
    world.barrier();
    if (world.rank() == 0) evict(folder);
    world.barrier();
    Model fresh(c.model.args, plan);
    fresh.shard();
    optim::AdamW<float, Cpu> optimizer(fresh, adamw);
    const auto t0 = clock_type::now();
    train::load_sharded_checkpoint(fresh, optimizer, folder.string());
    r.load = since(t0);
  });
  fs::remove_all(folder);
  // The slowest rank's times: a save or load is done when every rank is.
  row.file_bytes = per[0].file_bytes;
  for (const Row& r : per) {
    row.disk = std::max(row.disk, r.disk);
    row.snapshot = std::max(row.snapshot, r.snapshot);
    row.first_snapshot = std::max(row.first_snapshot, r.first_snapshot);
    row.write = std::max(row.write, r.write);
    row.load = std::max(row.load, r.load);
  }
  return row;
}

int run(const Options& o) {
  const fs::path root = o.dir.empty() ? fs::temp_directory_path() / ("bench-checkpoint-io-" + std::to_string(::getpid()))
                                      : fs::path(o.dir);
  fs::create_directories(root);
  std::vector<Row> rows;
  for (int ranks : o.ranks) {
    std::fprintf(stderr, "%d rank(s)...\n", ranks);
    rows.push_back(measure(o, ranks, root));
  }
  if (o.dir.empty()) fs::remove_all(root);
  const train::JobConfig c = job(o, 1);
  std::printf("%s | commit %s | %s, %ld cores | %s, %lld layers (%.0fM parameters), fp32 with fp32 AdamW moments\n\n",
              bench::utc_date().c_str(), o.commit.c_str(), bench::cpuinfo_field("model name").c_str(),
              sysconf(_SC_NPROCESSORS_ONLN), o.flavor.c_str(), static_cast<long long>(o.layers),
              static_cast<double>(c.model.args.num_params()) / 1e6);
  std::printf("| ranks | file per rank | disk write | save (sync) | snapshot: async stall (first save) | write | load (from disk) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const double gb = r.file_bytes / 1e9;
    std::printf("| %d | %.2f GB | %.2f GB/s | %.2f s, %.2f GB/s | %.2f s (%.2f s) | %.2f s, %.2f GB/s | %.2f s, %.2f GB/s |\n",
                r.ranks, gb, gb / r.disk, r.snapshot + r.write, gb / (r.snapshot + r.write), r.snapshot,
                r.first_snapshot, r.write, gb / r.write, r.load, gb / r.load);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-checkpoint-io: %s\n", e.what());
    return 1;
  }
}
