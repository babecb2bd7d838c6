// Splitting the Llama model over pipeline stages.
//
// The model is a chain of units: the embedding, the transformer blocks 0 .. n_layers-1,
// then the output (final norm + head). For balance the embedding and the output each
// count as some layers, one each by default as torchtitan counts them
// (pipeline_parallel_first_stage_less_layers and _last_stage_less_layers, StageWeights),
// so there are n_layers + 2 units to place on n_stages stages (n_stages = pipeline degree
// x virtual stages per rank).
//
// Default split: every stage gets units / n_stages units and the first units % n_stages
// stages one more; stage 0 therefore starts with the embedding and the last stage ends
// with the output, each holding as many blocks fewer as those count for. With 8 blocks on
// 4 stages (10 units): 3, 3, 2, 2 units, that is embedding + blocks 0-1 | blocks 2-4 |
// blocks 5-6 | block 7 + output.
//
// Explicit split: torchtitan's `pipeline_parallel_split_points` names the block where each
// new stage begins ("layers.3"). n_stages - 1 strictly increasing points in [0, n_layers]
// are needed; 0 leaves stage 0 the embedding alone, n_layers the last stage the output
// alone. Which stages a rank holds, and in what order they run, is parallel/schedule.hpp.
#pragma once

#include <charconv>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/wording.hpp"

namespace tessera::parallel {

/// What one pipeline stage holds: blocks [first_block, end_block), plus the embedding
/// before them (stage 0 only) and the output after them (the last stage only).
struct StageRange {
  int first_block = 0;
  int end_block = 0;
  bool embedding = false;
  bool output = false;

  /// The transformer blocks in this stage.
  [[nodiscard]] int blocks() const { return end_block - first_block; }
  /// Blocks plus the embedding and the output, each counted as one layer.
  [[nodiscard]] int units() const { return blocks() + (embedding ? 1 : 0) + (output ? 1 : 0); }

  friend bool operator==(const StageRange&, const StageRange&) = default;
};

/// How many layers the embedding and the output count as when the blocks are split
/// evenly (torchtitan's pipeline_parallel_first_stage_less_layers and
/// _last_stage_less_layers): the first stage holds `embedding` blocks fewer than its
/// share, the last `output` fewer. One each by default.
struct StageWeights {
  int embedding = 1;
  int output = 1;
  friend bool operator==(const StageWeights&, const StageWeights&) = default;
};

namespace detail {

inline void check_stage_shape(int n_layers, int n_stages, Wording w) {
  TESSERA_CHECK(n_layers >= 1, "pipeline stages: the model needs at least one layer, got n_layers = ", n_layers);
  TESSERA_CHECK(n_stages >= 1, w.pick(settings::pipeline_parallel_degree.key, "pipeline stages"),
                ": the pipeline needs at least one stage, got ", n_stages);
}

/// "8 layers + embedding + output = 10 units", or with other weights
/// "8 layers + 2 for the embedding + 0 for the output = 10 units".
inline std::string unit_count(int n_layers, StageWeights w) {
  const int units = n_layers + w.embedding + w.output;
  if (w == StageWeights{})
    return ::tessera::detail::concat(n_layers, " layers + embedding + output = ", units, " units");
  return ::tessera::detail::concat(n_layers, " layers + ", w.embedding, " for the embedding + ", w.output,
                                   " for the output = ", units, " units");
}

}  // namespace detail

/// Splits n_layers blocks (plus the embedding and the output) over n_stages stages.
/// Without `split_points`: equal unit counts (the embedding and the output counting as
/// `weights` say), the remainder to the early stages. With them: stage i + 1 begins at
/// block split_points[i]; exactly n_stages - 1 strictly increasing points in
/// [0, n_layers], and the weights are not used. Throws naming the setting (by config key,
/// unless `wording` says the values were set in code) and the numbers when a stage would
/// be empty, a weight is more than a stage's share, or the points are malformed.
inline std::vector<StageRange> split_stages(int n_layers, int n_stages, std::span<const int> split_points = {},
                                            Wording wording = config_keys, StageWeights weights = {}) {
  detail::check_stage_shape(n_layers, n_stages, wording);
  std::vector<StageRange> stages;
  stages.reserve(static_cast<std::size_t>(n_stages));
  if (split_points.empty()) {
    TESSERA_CHECK(weights.embedding >= 0 && weights.output >= 0, wording.pick("parallelism", "pipeline"),
                  ": the embedding and the output count as at least 0 layers, got ", weights.embedding, " and ",
                  weights.output);
    const int units = n_layers + weights.embedding + weights.output;
    TESSERA_CHECK(n_stages <= units, wording.pick(settings::pipeline_parallel_degree.key, "pipeline stages"),
                  ": pipeline degree larger than the layer count: ", n_stages, " stages for ",
                  detail::unit_count(n_layers, weights), ", and each stage needs at least one");
    const int base = units / n_stages, extra = units % n_stages;
    if (n_stages > 1) {
      TESSERA_CHECK(weights.embedding <= base, wording(settings::first_stage_less_layers, weights.embedding),
                    ": more than the ", base, " layers of a stage (", detail::unit_count(n_layers, weights), " over ",
                    n_stages, " stages)");
      TESSERA_CHECK(weights.output <= base, wording(settings::last_stage_less_layers, weights.output),
                    ": more than the ", base, " layers of a stage (", detail::unit_count(n_layers, weights), " over ",
                    n_stages, " stages)");
    }
    int block = 0;
    for (int s = 0; s < n_stages; ++s) {
      StageRange r;
      r.embedding = s == 0;
      r.output = s == n_stages - 1;
      const int share = base + (s < extra ? 1 : 0);
      const int blocks = share - (r.embedding ? weights.embedding : 0) - (r.output ? weights.output : 0);
      r.first_block = block;
      r.end_block = block + blocks;
      block = r.end_block;
      stages.push_back(r);
    }
    return stages;
  }
  const int n_points = static_cast<int>(split_points.size());
  const std::string_view points = wording(settings::split_points);
  TESSERA_CHECK(n_points == n_stages - 1, points, ": ", n_points, " split points make ", n_points + 1,
                " stages, but the pipeline has ", n_stages, " (",
                wording.pick("pipeline_parallel_degree", "the pipeline degree"), " x stages per rank); give ",
                n_stages - 1);
  for (int i = 0; i < n_points; ++i) {
    const int p = split_points[static_cast<std::size_t>(i)];
    TESSERA_CHECK(p >= 0 && p <= n_layers, points, ": layers.", p,
                  " is out of range: the model has blocks layers.0 .. layers.", n_layers - 1,
                  " (a split point may be 0 .. ", n_layers, ")");
    if (i > 0) {
      const int prev = split_points[static_cast<std::size_t>(i - 1)];
      TESSERA_CHECK(p != prev, points, ": stage ", i, " would hold nothing: split point layers.", p,
                    " is given twice");
      TESSERA_CHECK(p > prev, points, ": split points must be strictly increasing, got layers.", prev,
                    " before layers.", p);
    }
  }
  // Stage s covers blocks [start(s), start(s + 1)); stage 0 adds the embedding, the last the output.
  for (int s = 0; s < n_stages; ++s) {
    StageRange r;
    r.first_block = s == 0 ? 0 : split_points[static_cast<std::size_t>(s - 1)];
    r.end_block = s == n_stages - 1 ? n_layers : split_points[static_cast<std::size_t>(s)];
    r.embedding = s == 0;
    r.output = s == n_stages - 1;
    stages.push_back(r);
  }
  return stages;
}

/// Parses torchtitan's split points ("layers.3") into block indices, in the given order
/// (split_stages checks the order and the range). Throws naming the key and the string.
inline std::vector<int> parse_split_points(std::span<const std::string> names) {
  std::vector<int> points;
  points.reserve(names.size());
  constexpr std::string_view prefix = "layers.";
  for (const std::string& name : names) {
    const std::string_view s = name;
    const std::string_view digits = s.substr(s.starts_with(prefix) ? prefix.size() : s.size());
    int value = -1;
    const char* end = digits.data() + digits.size();
    const auto [ptr, ec] = std::from_chars(digits.data(), end, value);
    TESSERA_CHECK(s.starts_with(prefix) && !digits.empty() && digits.size() <= 9 && ec == std::errc() && ptr == end &&
                      digits.front() != '-' && (digits.size() == 1 || digits.front() != '0'),
                  "parallelism.pipeline_parallel_split_points: \"", name,
                  "\" is not a block name of the form layers.<index> (e.g. \"layers.3\")");
    points.push_back(value);
  }
  return points;
}

}  // namespace tessera::parallel
