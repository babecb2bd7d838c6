// A run's checkpoint folder (checkpoint/folder.hpp): which checkpoint a rerun
// resumes from, which resumes are refused (past the run's end, back past newer
// checkpoints), what keep_latest_k removes; and a resumed run's metrics.jsonl and
// TensorBoard files (train/metrics.hpp), which go on from the resumed step.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "tessera/checkpoint/folder.hpp"
#include "tessera/train/metrics.hpp"
#include "tessera/train/tensorboard.hpp"

namespace test_checkpoint_folder {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
namespace fs = std::filesystem;

/// A step folder in `folder`: complete (with its marker) or not; `suffix` ".partial"
/// for the folder of a save a crash interrupted.
void make_step(const fs::path& folder, std::int64_t step, bool complete, const std::string& suffix = "") {
  const fs::path p = folder / ("step-" + std::to_string(step) + suffix);
  fs::create_directories(p);
  std::ofstream(p / "model-rank0-of-1.safetensors") << "x";
  if (complete) std::ofstream(p / train::sharded::kCompleteMarker) << "{\"world_size\": 1}\n";
}

std::vector<std::string> names(const fs::path& folder) {
  std::vector<std::string> out;
  for (const auto& s : train::list_saved_steps(folder)) out.push_back(s.path.filename().string());
  return out;
}

TEST_CASE("checkpoint folder: a rerun resumes from the latest complete checkpoint, or load_step's") {
  tessera::test::TempDir dir;
  const fs::path folder = dir.path / "checkpoint";
  CHECK_FALSE(train::resume_point(folder, -1).has_value());  // no folder yet: a fresh start
  make_step(folder, 2, true);
  make_step(folder, 10, true);
  make_step(folder, 4, true);
  make_step(folder, 12, false);              // a save that did not finish
  make_step(folder, 14, false, ".partial");  // a save a crash interrupted
  fs::create_directories(folder / "step-x");  // not a name this library writes
  fs::create_directories(folder / "notes");
  CHECK(names(folder) == std::vector<std::string>{"step-2", "step-4", "step-10", "step-12", "step-14.partial"});

  std::vector<std::string> skipped;
  const auto latest = train::resume_point(folder, -1, [&](const train::SavedStep& s) {
    skipped.push_back(s.path.filename().string());
  });
  REQUIRE(latest.has_value());
  CHECK(latest->step == 10);
  CHECK(skipped == std::vector<std::string>{"step-14.partial", "step-12"});

  CHECK(train::resume_point(folder, 4)->step == 4);
  CHECK_ERROR_CONTAINS(train::resume_point(folder, 6), "step-6: checkpoint.load_step = 6 names a checkpoint that is not there");
  CHECK_ERROR_CONTAINS(train::resume_point(folder, 12), "step-12: checkpoint.load_step = 12 names a checkpoint whose save did not finish");
  CHECK_ERROR_CONTAINS(train::resume_point(folder, 14), "not there");  // a partial folder is no checkpoint
}

TEST_CASE("checkpoint folder: a file under a checkpoint's name is refused, not replaced by a save") {
  tessera::test::TempDir dir;
  const fs::path folder = dir.path / "checkpoint";
  make_step(folder, 2, true);
  std::ofstream(folder / "step-4") << "a user's notes";
  CHECK_ERROR_CONTAINS(train::resume_point(folder, -1),
                       "step-4: a file where a checkpoint's folder goes (step-<N> and step-<N>.partial are the "
                       "checkpoints' names); move it out of the checkpoint folder");
  CHECK(fs::is_regular_file(folder / "step-4"));
  fs::remove(folder / "step-4");
  std::ofstream(folder / "step-6.partial") << "x";
  CHECK_ERROR_CONTAINS(names(folder), "step-6.partial: a file where a checkpoint's folder goes");
  fs::remove(folder / "step-6.partial");
  std::ofstream(folder / "step-6.txt") << "not a checkpoint's name: left alone";
  CHECK(names(folder) == std::vector<std::string>{"step-2"});
}

TEST_CASE("checkpoint folder: a resume past the run's end, or back past newer checkpoints, is refused") {
  tessera::test::TempDir dir;
  const fs::path folder = dir.path / "checkpoint";
  make_step(folder, 5, true);
  make_step(folder, 10, true);
  make_step(folder, 15, true);
  make_step(folder, 20, false);              // incomplete: no checkpoint to lose
  make_step(folder, 25, false, ".partial");  // nor an interrupted save
  const train::SavedStep latest = *train::resume_point(folder, -1);
  CHECK_NOTHROW(train::check_resume(folder, latest, 20));
  CHECK_NOTHROW(train::check_resume(folder, latest, 15));  // done: the final model is saved again, the same
  CHECK_ERROR_CONTAINS(train::check_resume(folder, latest, 10),
                       "step-15: the run would resume at step 15, past its end (training.steps = 10)");
  CHECK_ERROR_CONTAINS(train::check_resume(folder, *train::resume_point(folder, 5), 20),
                       "checkpoint.load_step = 5 goes back past step-10, step-15, saved by the run this one would branch from");
  CHECK_ERROR_CONTAINS(train::check_resume(folder, *train::resume_point(folder, 10), 20), "goes back past step-15,");
  CHECK_NOTHROW(train::check_resume(folder, *train::resume_point(folder, 15), 20));  // the latest, named
}

TEST_CASE("checkpoint folder: keep_latest_k counts complete checkpoints and never removes the latest") {
  tessera::test::TempDir dir;
  const fs::path folder = dir.path / "checkpoint";
  make_step(folder, 2, true);
  make_step(folder, 3, false, ".partial");  // older than the latest complete one: removed
  make_step(folder, 4, true);
  make_step(folder, 6, true);
  make_step(folder, 8, false);              // incomplete, newer: a user's to look at
  make_step(folder, 9, false, ".partial");  // newer: may be being written
  fs::create_directories(folder / "notes");
  train::prune_checkpoints(folder, 0);  // 0: keep all
  CHECK(names(folder).size() == 6);
  train::prune_checkpoints(folder, 2);
  CHECK(names(folder) == std::vector<std::string>{"step-4", "step-6", "step-8", "step-9.partial"});
  train::prune_checkpoints(folder, 1);
  CHECK(names(folder) == std::vector<std::string>{"step-6", "step-8", "step-9.partial"});
  train::prune_checkpoints(folder, 1);  // the only complete checkpoint stays
  CHECK(names(folder) == std::vector<std::string>{"step-6", "step-8", "step-9.partial"});
  CHECK(fs::exists(folder / "notes"));
}

TEST_CASE("checkpoint folder: a checkpoint is removed through its partial name, so a killed prune leaves no half checkpoint") {
  tessera::test::TempDir dir;
  const fs::path folder = dir.path / "checkpoint";
  make_step(folder, 2, true);
  make_step(folder, 2, true, ".partial");  // what a prune killed while removing step-2 leaves
  make_step(folder, 4, true);
  make_step(folder, 6, true);
  // step-2's removal renames it onto its partial name, which is there: that goes first.
  train::prune_checkpoints(folder, 2);
  CHECK(names(folder) == std::vector<std::string>{"step-4", "step-6"});
  // A partial folder left by a killed removal is older than the latest: the next prune
  // removes it, whatever it holds (its marker included).
  make_step(folder, 4, true, ".partial");
  fs::remove_all(folder / "step-4");
  train::prune_checkpoints(folder, 2);
  CHECK(names(folder) == std::vector<std::string>{"step-6"});
}

std::vector<std::int64_t> logged_steps(const std::string& path) {
  std::vector<std::int64_t> steps;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line).at("step").get<std::int64_t>());
  return steps;
}

train::StepMetrics metrics(std::int64_t step) {
  train::StepMetrics m;
  m.step = step;
  m.loss = 10.0 - static_cast<double>(step);
  return m;
}

TEST_CASE("metrics: a resumed run keeps the steps up to its checkpoint and appends, in metrics.jsonl and TensorBoard") {
  tessera::test::TempDir dir;
  const std::string path = dir.file("metrics.jsonl"), tb = dir.file("tb");
  {
    train::MetricsLogger log(path, 10, 100, false, 0, tb);
    for (std::int64_t s = 1; s <= 7; ++s) log.log(metrics(s));
  }
  std::ofstream(path, std::ios::app) << "{\"step\": 8, \"lo";  // the line a kill cut short
  {
    // Resumed from the checkpoint of step 5: steps 6 and 7 are trained again.
    train::MetricsLogger log(path, 10, 100, false, 5, tb);
    CHECK(logged_steps(path) == std::vector<std::int64_t>{1, 2, 3, 4, 5});
    for (std::int64_t s = 6; s <= 10; ++s) log.log(metrics(s));
  }
  CHECK(logged_steps(path) == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  {
    train::MetricsLogger fresh(path, 10, 100, false, 0);  // a fresh start begins the file again
  }
  CHECK(logged_steps(path).empty());

  // Two event files: the first run's (steps 1-7), and the resumed one's, which starts
  // with a SessionLog START at step 6, so TensorBoard drops the first file's 6 and 7.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(tb)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() == 2);
  const auto first = train::read_tensorboard_scalars(files[0].string());
  const auto second = train::read_tensorboard_events(files[1].string());
  CHECK(first.back().step == 7);
  bool loss_at_6 = false, start_at_6 = false;
  for (const auto& e : second) {
    start_at_6 = start_at_6 || (e.session_status == 1 && e.step == 6);  // SessionLog START
    for (const auto& [tag, value] : e.scalars) loss_at_6 = loss_at_6 || (tag == "loss" && e.step == 6 && value == 4.0);
  }
  CHECK(start_at_6);
  CHECK(loss_at_6);
}

int pinned = 0, unpinned = 0;
void count_pin(void*, std::size_t) { ++pinned; }
void count_unpin(void*) { ++unpinned; }

TEST_CASE("host buffers: made (and pinned) once, reused by size, back from a file when it goes, unpinned at the end") {
  {
    train::sharded::HostBuffers pool({&count_pin, &count_unpin});
    std::vector<std::byte> a = pool.take(100), b = pool.take(200), none = pool.take(0);
    CHECK(pinned == 2);  // an empty buffer has nothing to pin
    const std::byte* where = a.data();
    {
      train::sharded::RankFile file;
      file.pool = &pool;
      file.writer.add_bytes("a", io::StDtype::f32, {25}, std::move(a));
      file.writer.add_bytes("b", io::StDtype::f32, {50}, std::move(b));
      train::sharded::RankFile moved = std::move(file);  // one owner gives them back, once
    }
    CHECK(pool.bytes() == 300);
    std::vector<std::byte> again = pool.take(100);
    CHECK(again.data() == where);  // the same memory, not pinned again
    CHECK(pinned == 2);
    pool.give_back({});
    std::vector<std::vector<std::byte>> back;
    back.push_back(std::move(again));
    pool.give_back(std::move(back));
    CHECK(unpinned == 0);
  }
  CHECK(unpinned == 2);
}

}  // namespace test_checkpoint_folder
