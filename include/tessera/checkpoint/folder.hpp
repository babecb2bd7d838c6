// A run's checkpoint folder: `step-<N>` folders, each a sharded training checkpoint
// (checkpoint/sharded.hpp), complete once its COMPLETE marker is there. Which one
// a rerun resumes from (and which resumes would lose or mix saved work), and which ones
// keep_latest_k lets go.
//
// Only names this library writes are looked at: `step-<digits>` folders, and the
// `step-<digits>.partial` folders of saves (or removals) a crash interrupted. Anything
// else a user puts in the folder stays untouched; a file (not a folder) under one of
// those names is refused by name rather than replaced by a save.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "tessera/checkpoint/sharded.hpp"
#include "tessera/core/error.hpp"

namespace tessera::train {

struct SavedStep {
  std::int64_t step = 0;
  std::filesystem::path path;
  bool complete = false;  // its COMPLETE marker is there
  bool partial = false;   // a `.partial` folder: a save that never finished
};

/// N of a folder named `step-<N>` or `step-<N>.partial`, or nothing for any other name.
inline std::optional<std::int64_t> step_folder_number(std::string name) {
  if (name.size() > 8 && name.compare(name.size() - 8, 8, ".partial") == 0) name.resize(name.size() - 8);
  const std::string digits = name.rfind("step-", 0) == 0 ? name.substr(5) : "";
  if (digits.empty() || digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::stoll(digits);
}

/// Whether `name` is the partial folder of a save (`step-<N>.partial`).
inline bool is_partial_folder_name(const std::string& name) {
  return step_folder_number(name) && name.size() > 8 && name.compare(name.size() - 8, 8, ".partial") == 0;
}

/// The path of step `step`'s checkpoint in `folder`.
inline std::filesystem::path step_path(const std::filesystem::path& folder, std::int64_t step) {
  return folder / ("step-" + std::to_string(step));
}

/// Every checkpoint folder in `folder` (none if it does not exist), by step.
inline std::vector<SavedStep> list_saved_steps(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::vector<SavedStep> steps;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return steps;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const auto n = step_folder_number(name);
    if (!n) continue;
    // A save replaces a step's folder (and removes an interrupted one's): a file under
    // such a name is not the library's, and would be lost.
    TESSERA_CHECK(e.is_directory(ec), e.path().string(), ": a file where a checkpoint's folder goes (step-<N> and "
                  "step-<N>.partial are the checkpoints' names); move it out of the checkpoint folder");
    const bool partial = is_partial_folder_name(name);
    steps.push_back({*n, e.path(), !partial && fs::exists(e.path() / sharded::kCompleteMarker, ec), partial});
  }
  TESSERA_CHECK(!ec, folder.string(), ": cannot list: ", ec.message());
  std::sort(steps.begin(), steps.end(), [](const SavedStep& a, const SavedStep& b) {
    return a.step != b.step ? a.step < b.step : a.partial < b.partial;
  });
  return steps;
}

/// The checkpoint a run resumes from: step `load_step`'s (which must be there and
/// complete), or with load_step = -1 the latest complete one, or none. Each folder
/// skipped because it is incomplete is passed to `skipped` (to warn about).
inline std::optional<SavedStep> resume_point(const std::filesystem::path& folder, std::int64_t load_step,
                                             const std::function<void(const SavedStep&)>& skipped = {}) {
  const std::vector<SavedStep> steps = list_saved_steps(folder);
  if (load_step >= 0) {
    for (const SavedStep& s : steps)
      if (s.step == load_step && !s.partial) {
        TESSERA_CHECK(s.complete, s.path.string(), ": checkpoint.load_step = ", load_step,
                      " names a checkpoint whose save did not finish (no ", sharded::kCompleteMarker, " marker)");
        return s;
      }
    fail(step_path(folder, load_step).string(), ": checkpoint.load_step = ", load_step,
         " names a checkpoint that is not there");
  }
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    if (it->complete) return *it;
    if (skipped) skipped(*it);
  }
  return std::nullopt;
}

/// Refuses a resume that would lose or mix saved work, before the run writes anything:
/// one from a step past the run's end (`steps`, training.steps: the run would train
/// nothing and write the older state over its final model), and one from an earlier step
/// than complete checkpoints still in `folder` (checkpoint.load_step going back): the
/// run's saves would sit beside the abandoned run's newer ones, keep_latest_k would keep
/// those (the newest) over the run's own, and the next rerun would resume from them.
inline void check_resume(const std::filesystem::path& folder, const SavedStep& from, std::int64_t steps) {
  TESSERA_CHECK(from.step <= steps, from.path.string(), ": the run would resume at step ", from.step,
                ", past its end (training.steps = ", steps, "): raise training.steps to train on, or give "
                "checkpoint.load_step to go back to an earlier step");
  std::string newer;
  for (const SavedStep& s : list_saved_steps(folder))
    if (s.complete && s.step > from.step) newer += (newer.empty() ? "" : ", ") + s.path.filename().string();
  TESSERA_CHECK(newer.empty(), folder.string(), ": checkpoint.load_step = ", from.step, " goes back past ", newer,
                ", saved by the run this one would branch from: this run's saves would be mixed with them, and "
                "checkpoint.keep_latest_k would keep them over this run's; move them out of the folder to branch "
                "from step ", from.step);
}

/// Removes all but the latest `keep` complete checkpoints (keep <= 0: keeps them all),
/// and the partial folders of interrupted saves older than the latest complete one.
/// The latest complete checkpoint is never removed, nor anything newer than it (an
/// incomplete folder is a user's to look at; a newer partial one may be being written).
///
/// A checkpoint is first renamed to its partial name, then removed: a run killed while
/// removing one leaves a partial folder, which the next prune removes, where removing it
/// in place could leave a `step-<N>` folder without its marker, an incomplete checkpoint
/// that no later prune would touch.
inline void prune_checkpoints(const std::filesystem::path& folder, std::int64_t keep) {
  namespace fs = std::filesystem;
  if (keep <= 0) return;
  const std::vector<SavedStep> steps = list_saved_steps(folder);
  std::vector<const SavedStep*> complete;
  for (const SavedStep& s : steps)
    if (s.complete) complete.push_back(&s);
  if (complete.empty()) return;
  const std::int64_t latest = complete.back()->step;
  std::error_code ec;
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < complete.size(); ++i) {
    const fs::path& path = complete[i]->path;
    const fs::path doomed = fs::path(path).concat(".partial");
    fs::remove_all(doomed, ec);  // an earlier save of the same step that never finished
    if (!ec) fs::rename(path, doomed, ec);
    if (!ec) fs::remove_all(doomed, ec);
    TESSERA_CHECK(!ec, path.string(), ": cannot remove (checkpoint.keep_latest_k = ", keep, "): ", ec.message());
  }
  for (const SavedStep& s : steps)
    if (s.partial && s.step < latest) fs::remove_all(s.path, ec);
}

}  // namespace tessera::train
