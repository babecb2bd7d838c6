// A per-rank log of a run's phases (debug.enable_structured_logging, torchtitan's
// structured logging): one JSON line as each phase starts and ends, on every rank, so
// that a run's stragglers and the phase a hung rank never finished can be read after the
// fact, from every rank side by side (tools/rank_log.py).
//
// The phases are the coarse spans the library opens anyway (core/profile.hpp), under
// torchtitan's event names:
//
//   step             "step N", the whole step            fetching_batch   "data"
//   fwd_bwd          "micro-batch i"                     optim            the optimizer region
//   eval             "validation"                        checkpoint_save  "checkpoint"
//   checkpoint_load  "checkpoint load"
//
// and instants: structured_logger_started (the log opened) and those the caller marks
// (training_start, training_end). Each line has
// torchtitan's fields:
//
//   {"rank": 3, "local_rank": 3, "host_name": "node7", "pid": 4121, "source": "training",
//    "step": 12, "log_type_name": "fwd_bwd_end", "value": 41.7, "time_us": 1796000000123456}
//
// `value` is the phase's duration in milliseconds (on _end and _error lines), `time_us`
// the wall clock (so hosts line up as well as their clocks do). A phase an exception left
// (the rank failed, or the world aborted under it) ends with an _error line, as
// torchtitan's. A span is the host's side of the phase (on a GPU: its launches, and the
// waits that hold the host). Each line is written and flushed as it happens, so a rank
// that hangs or is killed leaves its last _start line alone. A write that fails stops the
// log with one warning; it never stops the run.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/core/region.hpp"

namespace tessera::train {

class RankLog final : public profile::PhaseSink {
 public:
  /// Opens (appending: a resumed run goes on in the same file) `folder`/rank_<rank>.jsonl;
  /// throws tessera::Error naming the file when it cannot.
  RankLog(const std::filesystem::path& folder, int rank) : rank_(rank) {
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    path_ = (folder / ("rank_" + std::to_string(rank) + ".jsonl")).string();
    TESSERA_CHECK(!ec, "debug.enable_structured_logging: cannot create ", folder.string(), ": ", ec.message());
    file_ = std::fopen(path_.c_str(), "a");
    if (!file_) {
      const int err = errno;
      fail("debug.enable_structured_logging: cannot open ", path_, " for writing: ", std::strerror(err));
    }
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown");
    // The launcher's local rank: torchrun's, Open MPI's, Slurm's; else the rank.
    int local = rank;
    for (const char* var : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
      if (const char* v = std::getenv(var)) {
        local = std::atoi(v);
        break;
      }
    prefix_ = "{\"rank\": " + std::to_string(rank) + ", \"local_rank\": " + std::to_string(local) +
              ", \"host_name\": \"" + escaped(host) + "\", \"pid\": " + std::to_string(::getpid()) +
              ", \"source\": \"training\"";
    instant("structured_logger_started");
  }
  RankLog(const RankLog&) = delete;
  RankLog& operator=(const RankLog&) = delete;
  ~RankLog() override {
    if (file_) std::fclose(file_);
  }

  const std::string& path() const { return path_; }

  /// The step the lines that follow belong to.
  void set_step(std::int64_t step) { step_ = step; }

  /// A point in time: training_start, training_end.
  void instant(const char* name) noexcept { write(name, "", -1); }

  // profile::PhaseSink: the coarse spans, under torchtitan's names.
  bool takes(const char* category) const override {
    return std::strcmp(category, "step") == 0 || std::strcmp(category, "region") == 0;
  }
  const char* event(std::string_view name) const override {
    if (name.starts_with("step ")) return "step";
    if (name.starts_with("micro-batch ")) return "fwd_bwd";
    if (name == "data") return "fetching_batch";
    if (name == region::kOptimizer) return "optim";
    if (name == "validation") return "eval";
    if (name == "checkpoint") return "checkpoint_save";
    if (name == "checkpoint load") return "checkpoint_load";
    return nullptr;
  }
  void begin(const char* event) noexcept override { write(event, "_start", -1); }
  void end(const char* event, std::int64_t duration_ns, bool failed) noexcept override {
    write(event, failed ? "_error" : "_end", duration_ns);
  }

 private:
  static std::string escaped(std::string_view s) {
    std::string out;
    profile::detail::append_escaped(out, s);
    return out;
  }

  // One line, flushed; a failure warns once and stops the log.
  void write(const char* event, const char* suffix, std::int64_t duration_ns) noexcept {
    if (!file_) return;
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                        std::chrono::system_clock::now().time_since_epoch())
                        .count();
    char tail[192];
    int n = duration_ns >= 0
                ? std::snprintf(tail, sizeof tail, ", \"value\": %.3f, \"time_us\": %lld}\n",
                                static_cast<double>(duration_ns) / 1e6, static_cast<long long>(us))
                : std::snprintf(tail, sizeof tail, ", \"time_us\": %lld}\n", static_cast<long long>(us));
    char middle[160];
    const int m = std::snprintf(middle, sizeof middle, ", \"step\": %lld, \"log_type_name\": \"%s%s\"",
                                static_cast<long long>(step_), event, suffix);
    const bool ok = n > 0 && m > 0 && std::fputs(prefix_.c_str(), file_) >= 0 && std::fputs(middle, file_) >= 0 &&
                    std::fputs(tail, file_) >= 0 && std::fflush(file_) == 0;
    if (!ok) {
      std::fprintf(stderr, "warning: rank %d: writing %s failed (%s); the structured log stops here\n", rank_,
                   path_.c_str(), std::strerror(errno));
      std::fclose(file_);
      file_ = nullptr;
    }
  }

  int rank_;
  std::string path_;
  std::FILE* file_ = nullptr;
  std::string prefix_;
  std::int64_t step_ = 0;
};

}  // namespace tessera::train
