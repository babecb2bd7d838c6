// bench-data-loading: what reading a large token shard costs a rank: the start, the
// checks, the memory held, and the rate windows are copied out at.
//
// A shard of --tokens random ids (vocabulary 128256) is written to --dir (version 3,
// chunked), then:
//   open                          io::MappedTokenShard::open: the header and the chunk
//                                 table, what a training run's start pays
//   check (1 thread), check (all) check_all() on a fresh open, on 1 thread and on every
//                                 core: every chunk's CRC and ids, one pass over the file
//                                 (what opening a version 1 or 2 shard costs)
//   read whole                    io::read_token_stream, the shard loaded into memory
//   batches, first / again        a DataLoader over the mapped shard: global batches of
//                                 --batch x --seq tokens, this process's one rank of
//                                 eight, the rate its windows are copied out at; the
//                                 first time, each chunk a window touches is checked
//   mix replay                    a two-entry mix seeked to 10^8 windows: what a resume
//                                 of a mix spends replaying its order
// The resident set (/proc/self/statm) is read after each: mapped, the process holds only
// what it copied out; loaded, the whole shard. The file is in the page cache (just
// written): the figures are the reader's, not the disk's.
//
//   bench-data-loading [--tokens N] [--dir DIR] [--seq N] [--batch N] [--commit HASH]
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "machine.hpp"
#include "tessera/data/corpus.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"

namespace {

using namespace tessera;
using clock_type = std::chrono::steady_clock;

struct Options {
  std::int64_t tokens = 500'000'000;  // 2 GB
  std::string dir;
  std::int64_t seq = 8192, batch = 8;
  std::string commit = "-";
};

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// This process's resident set, in GB.
double resident_gb() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1e9;
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  for (bench::Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--tokens") o.tokens = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--dir") o.dir = f.value();
    else if (flag == "--seq") o.seq = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--batch") o.batch = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--commit") o.commit = f.value();
    else if (flag == "--help") {
      std::printf("bench-data-loading [--tokens N] [--dir DIR] [--seq N] [--batch N] [--commit HASH]\n");
      return 0;
    } else f.unknown();
  }
  const std::filesystem::path dir = o.dir.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(o.dir);
  const std::string path = (dir / ("bench-data-loading-" + std::to_string(::getpid()) + ".tshard")).string();
  struct Remove {
    std::string p;
    ~Remove() { std::filesystem::remove(p); }
  } remove{path};

  const auto n = static_cast<std::uint64_t>(o.tokens);
  auto t0 = clock_type::now();
  {
    io::TokenShardWriter w(path, 128256);
    std::vector<std::uint32_t> chunk(1 << 20);
    std::uint32_t x = 12345;
    for (std::uint64_t done = 0; done < n; done += chunk.size()) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), n - done));
      for (std::size_t i = 0; i < k; ++i) {
        x = x * 1664525u + 1013904223u;
        chunk[i] = (x >> 8) % 128256u;
      }
      w.append(std::span<const std::uint32_t>(chunk.data(), k));
    }
    w.commit();
  }
  const double write_s = seconds_since(t0);
  const double gb = 4e-9 * static_cast<double>(n);
  const double base = resident_gb();

  t0 = clock_type::now();
  io::MappedTokenShard shard = io::MappedTokenShard::open(path);
  const double open_s = seconds_since(t0);
  const double after_open = resident_gb();
  t0 = clock_type::now();
  io::MappedTokenShard::open(path).check_all(1);
  const double check1 = seconds_since(t0);
  const unsigned cores = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  t0 = clock_type::now();
  io::MappedTokenShard::open(path).check_all(cores);
  const double check_all = seconds_since(t0);
  const double after_check = resident_gb();

  // One rank of eight: its windows of 8 global batches (or as many as the shard holds).
  data::TokenCorpus corpus;
  corpus.append(std::move(shard));
  const std::int64_t windows = static_cast<std::int64_t>(n / static_cast<std::uint64_t>(o.seq + 1));
  TESSERA_CHECK(windows >= 8 * o.batch, "--tokens ", o.tokens, " holds ", windows, " windows of --seq ", o.seq,
                ": fewer than one global batch of 8 ranks x --batch ", o.batch);
  data::DataLoader loader(corpus, o.seq, o.batch, 3, 8);
  const int batches = static_cast<int>(std::min<std::int64_t>(8, windows / (8 * o.batch)));
  t0 = clock_type::now();
  for (int b = 0; b < batches; ++b) loader.next();
  const double first_batch_s = seconds_since(t0) / batches;
  loader.seek(0);
  t0 = clock_type::now();
  for (int b = 0; b < batches; ++b) loader.next();
  const double batch_s = seconds_since(t0) / batches;
  const double after_batches = resident_gb();
  const double rank_tokens = static_cast<double>(o.batch * o.seq);

  t0 = clock_type::now();
  data::DataLoader mix(std::vector<data::TokenCorpus>{corpus, corpus}, std::vector<double>{0.7, 0.3}, o.seq, o.batch, 0, 8);
  mix.seek(100'000'000);
  mix.next();
  const double replay_s = seconds_since(t0);

  t0 = clock_type::now();
  const io::TokenStream whole = io::read_token_stream(path);
  const double read_s = seconds_since(t0);
  const double after_read = resident_gb();
  TESSERA_CHECK(whole.ids.size() == n, "read back ", whole.ids.size(), " tokens, wrote ", n);

  std::printf("bench-data-loading: a %.2f GB shard (%lld tokens) written in %.2f s; resident %.2f GB before\n", gb,
              static_cast<long long>(o.tokens), write_s, base);
  std::printf("\n| date | commit | machine | shard | open | resident after it | check, 1 thread | "
              "check, %u threads | resident after it | batches (rank 3 of 8, %lld x %lld), first read | again | "
              "resident after them | mix replay to 10^8 windows | read whole | resident after it |\n",
              cores, static_cast<long long>(o.batch), static_cast<long long>(o.seq));
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %s | %s | %.2f GB | %.2f ms | +%.3f GB | %.2f s (%.2f GB/s) | %.2f s (%.2f GB/s) | +%.3f GB | "
              "%.2f ms a batch (%.0f M tokens/s) | %.2f ms (%.0f M tokens/s) | +%.3f GB | %.2f s | %.2f s (%.2f GB/s) | "
              "+%.2f GB |\n",
              bench::utc_date().c_str(), o.commit.c_str(), bench::cpuinfo_field("model name").c_str(), gb,
              1e3 * open_s, after_open - base, check1, gb / check1, check_all, gb / check_all, after_check - base,
              1e3 * first_batch_s, rank_tokens / first_batch_s / 1e6, 1e3 * batch_s, rank_tokens / batch_s / 1e6,
              after_batches - base, replay_s, read_s, gb / read_s, after_read - base);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench-data-loading: error: %s\n", e.what());
  return 1;
}
