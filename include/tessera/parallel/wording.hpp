// How a run-time check names the setting it refuses. A value from a config is named by
// its key ("parallelism.tensor_parallel_degree = 3"): the line to change. A value a
// program set in code (a comm::MeshShape, a Plan's fields, the batch it hands the model)
// has no key, and naming one would send the reader to a file that does not exist; it is
// named in words ("the mesh's tensor-parallel degree 3"). A Plan knows which it is
// (Plan::from_config, set by train::make_plan) and gives its checks the Wording.
#pragma once

#include <string>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera::parallel {

/// A setting a run-time check may refuse: its config key, and the words for it when a
/// program set it in code.
struct Setting {
  std::string_view key;
  std::string_view words;
};

/// The settings the model's run-time checks name.
namespace settings {
inline constexpr Setting tensor_parallel_degree{"parallelism.tensor_parallel_degree",
                                                "the mesh's tensor-parallel degree"};
inline constexpr Setting context_parallel_degree{"parallelism.context_parallel_degree",
                                                 "the mesh's context-parallel degree"};
inline constexpr Setting pipeline_parallel_degree{"parallelism.pipeline_parallel_degree", "the mesh's pipeline degree"};
inline constexpr Setting microbatch_size{"parallelism.pipeline_parallel_microbatch_size",
                                         "the pipeline microbatch size"};
inline constexpr Setting split_points{"parallelism.pipeline_parallel_split_points", "the pipeline split points"};
inline constexpr Setting layers_per_stage{"parallelism.pipeline_parallel_layers_per_stage",
                                          "the pipeline's layers per stage"};
inline constexpr Setting first_stage_less_layers{"parallelism.pipeline_parallel_first_stage_less_layers",
                                                 "the layers the embedding counts as"};
inline constexpr Setting last_stage_less_layers{"parallelism.pipeline_parallel_last_stage_less_layers",
                                                "the layers the output counts as"};
inline constexpr Setting schedule{"parallelism.pipeline_parallel_schedule", "the pipeline schedule"};
inline constexpr Setting schedule_csv{"parallelism.pipeline_parallel_schedule_csv", "the pipeline schedule's table"};
inline constexpr Setting local_batch_size{"training.local_batch_size", "the batch size"};
inline constexpr Setting seq_len{"training.seq_len", "the sequence length"};
inline constexpr Setting cpu_offload{"training.enable_cpu_offload", "the plan's CPU offload"};
inline constexpr Setting early_step{"optimizer.early_step_in_backward", "the plan's early_step"};
}  // namespace settings

/// Whether a check names settings by config key (`from_config`) or in words.
struct Wording {
  bool from_config = false;

  /// The setting's key, or its words.
  std::string_view operator()(const Setting& s) const { return from_config ? s.key : s.words; }
  /// The setting with its value: "key = value", or "words value".
  template <class V>
  std::string operator()(const Setting& s, const V& value) const {
    return from_config ? detail::concat(s.key, " = ", value) : detail::concat(s.words, " ", value);
  }
  /// `config` or `code`, for a phrase a Setting does not cover.
  std::string_view pick(std::string_view config, std::string_view code) const { return from_config ? config : code; }
};

/// Settings named by their config keys: how llama-plan and the benchmarks, which check
/// configs, call the checks below the model (split_stages, check_schedule_shape, ...).
inline constexpr Wording config_keys{true};
/// Settings named in words: a program's own values.
inline constexpr Wording code_words{false};

}  // namespace tessera::parallel
