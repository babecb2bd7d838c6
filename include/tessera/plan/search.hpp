// Searching the layouts of a cluster: every way llama-train can lay a model over N GPUs,
// each predicted from a trace of its own ranks, ranked by tokens/s.
//
// enumerate_layouts(base, space) lists the layouts: replicate x shard x context x tensor x
// pipeline degrees that multiply to the GPUs (tensor parallelism within a node; context
// parallelism where each rank keeps at least SearchSpace::min_context_tokens of a
// sequence, in 2 cp equal chunks), and for each the pipeline schedules, the microbatch
// sizes (sequences per microbatch with pipelining, per forward otherwise), the activation
// checkpoint modes and the FSDP reshard policies (FSDP shards over dp_shard x cp);
// and, where the space asks for it (SearchSpace::float8_recipes), the linear layers'
// GEMMs in bf16 or in float8 by each of torchao's recipes, on the GPU's float8 matmul.
// The global batch (the training's hyperparameter) is held; a layout whose data-parallel
// degree does not divide it is not a layout of this training.
//
// search_layouts prices them. A layout is the traces of its pipeline positions, replayed
// on the network (plan/layout.hpp); tracing 126 blocks of Llama 3.1 405B through 16
// microbatches for each of thousands of layouts would take hours, so a layout is traced
// small and extrapolated:
//
//   depth   every stage holds its blocks less d: traced at two depths (the shallowest
//           stage at 3 and 4 blocks; with every N-th block recomputed, d a multiple of N
//           so that each stage keeps its pattern), the step's time, each position's
//           memory peak and its waits are affine in d, extrapolated to d = 0;
//   batch   microbatches (pipelining: 2 pp and 3 pp, where the schedule is in its steady
//           state; at pp the first stage holds fewer in flight) or accumulation steps (1
//           and 2): affine again, extrapolated to the layout's own count;
//   degree  a deep pipeline on 3 and 4 ranks (interleaved: 4 and 8), its stages as the
//           layout's first, second and last: affine in the degree.
//
// Eight small traces at most (fewer where a dimension is small) stand for the layout; the
// layout the search ranks first is then predicted in full, from the traces of its real
// depth and batch, and reported with the gap between the two: the extrapolation's
// exactness checked on the answer itself (tests/plan/test_search.cpp checks it on every
// kind of layout against full traces).
//
// Shortcuts keep the search small, each exact in the cost model. A variant of a
// layout doing less work (less recomputation, parameters kept gathered after forward)
// holds at least as much live memory, so pricing one settles others: one that fits
// settles those doing more work (they rank below it and are not listed), one whose
// live peak alone is over the usable memory settles those doing less; the lightest
// variant (full recomputation, parameters freed after forward) is priced first, then
// those that settled the layout before it. And live memory grows with the microbatch
// and falls with the shard degree, so past a family whose lightest variant is over the
// larger microbatches, and past a degree where that holds of the smallest the smaller
// degrees, are not priced.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tessera/backend/meta/meta.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/parallel/tensor_parallel.hpp"
#include "tessera/plan/traced_step.hpp"
#include "tessera/plan/layout.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::plan {

/// The float8 recipes a search may take (torchao's, float8.recipe_name): one scale a
/// tensor; one a row (powers of two); rowwise with the weight gradient's GEMM in bf16.
inline constexpr const char* kFloat8Recipes[] = {"tensorwise", "rowwise", "rowwise_with_gw_hp"};

/// What --search enumerates on.
struct SearchSpace {
  int gpus = 1;
  int gpus_per_node = 8;               // tensor parallelism stays within a node
  std::int64_t max_microbatch = 8;     // sequences per microbatch (or per forward without pipelining)
  int threads = 1;                     // layouts priced side by side
  /// Context-parallel degrees cp > 1 are taken where each rank keeps at least this many
  /// tokens of a sequence (seq_len / cp): below it the ring's blocks are short attention
  /// calls and its steps short transfers, the memory they save is small beside the
  /// parameters', and every degree multiplies the layouts. The default leaves searches at
  /// 8,192 tokens and under as they were, and takes cp 2 to 16 at 128k.
  std::int64_t min_context_tokens = 8192;
  /// Float8 as a dimension: each layout without float8 and with model.converters =
  /// ["float8"] by each of these recipes (float8.emulate = false: the GPU's float8 GEMMs,
  /// priced at the profile's float8 rates). Empty: the base's own converters and
  /// [float8], whatever they are, and no float8 dimension.
  std::vector<std::string> float8_recipes;
};

/// One layout the search priced: its config (every degree and batch resolved) and the
/// prediction, extrapolated or (the first) from its full traces.
struct SearchResult {
  train::JobConfig config;
  comm::MeshShape mesh;
  double step_seconds = 0;
  double tokens_per_sec = 0;  // per GPU
  double mfu_pct = 0;
  std::size_t peak_memory_bytes = 0;      // the largest position's live bytes
  std::size_t reserved_memory_bytes = 0;  // the largest position's allocator reservation
  bool fits = false;                      // every position's reservation within the usable memory
  double exposed_comm_seconds = 0;
  double pipeline_wait_seconds = 0;
  double collective_sm_seconds = 0;  // what the collectives' SMs add to the GEMMs beside them
  bool extrapolated = false;
  int dry_runs = 0;     // ranks traced to price it
  std::size_t index = 0;  // its place in enumerate_layouts' list: ties rank in that order
};

struct SearchReport {
  std::vector<SearchResult> layouts;  // fitting ones first, fastest first; then those that do not fit
  std::size_t enumerated = 0;         // layouts of the space
  std::size_t priced = 0;             // ... priced (the rest have a variant doing less work that
                                      // fits, or one doing more whose live peak is over)
  std::size_t dominated = 0;          // ... of those, fitting but not listed: a variant doing less work fits
  std::size_t refused = 0;            // ... that the runtime refuses (first reason below)
  std::string first_refusal;
  int dry_runs = 0;
  // The first layout predicted in full against its extrapolation (relative gaps).
  double check_step_gap = 0, check_memory_gap = 0;
  bool checked = false;
};

namespace detail {

inline std::vector<std::int64_t> divisors(std::int64_t n) {
  std::vector<std::int64_t> d;
  for (std::int64_t i = 1; i * i <= n; ++i)
    if (n % i == 0) {
      d.push_back(i);
      if (i != n / i) d.push_back(n / i);
    }
  std::sort(d.begin(), d.end());
  return d;
}

/// Checkpoint modes from least recomputation to most: a layout is priced with a mode only
/// when none before it fits ("selective" every second block and per op recompute
/// different things, so both are tried before "full"). No block recomputed but the
/// SwiGLU output remade in the backward (activation_checkpoint.recompute_swiglu) comes
/// second: a few percent of the step for the largest tensor a block keeps, where keeping
/// everything is just over (Llama 3 8B at 8192 tokens on one H200). The selective modes
/// go without it: their recomputed blocks keep no SwiGLU output as it is.
struct AcMode {
  const char* mode;
  const char* option;
  int rank;  // 0 none, 1 selective, 2 full
  bool recompute_swiglu = false;
};
inline constexpr AcMode kAcModes[] = {
    {"none", "2", 0}, {"none", "2", 0, true}, {"selective", "op", 1}, {"selective", "2", 1}, {"full", "2", 2}};

/// `c` with no say on where its stages begin, for split points to follow: they place
/// every block, so the even split's layers per stage and weights go too.
inline void clear_stage_split(train::JobConfig& c) {
  c.parallelism.pipeline_parallel_split_points.clear();
  c.parallelism.pipeline_parallel_layers_per_stage.reset();
  c.parallelism.pipeline_parallel_first_stage_less_layers = 1;
  c.parallelism.pipeline_parallel_last_stage_less_layers = 1;
}

/// Blocks per stage of `c` (every stage of every rank, in stage order).
inline std::vector<int> stage_blocks(const train::JobConfig& c) {
  const parallel::PipelineOptions o = train::pipeline_options(c);
  const int pp = static_cast<int>(c.parallelism.pipeline_parallel_degree), L = static_cast<int>(c.model.args.n_layers);
  std::vector<int> blocks;
  if (pp == 1) return {L};
  for (const auto& s : parallel::pipeline_stages(o.schedule, o, L, pp).stages) blocks.push_back(s.blocks());
  return blocks;
}

/// `c` with every stage `d` blocks shorter, its split given explicitly.
inline train::JobConfig shallower(train::JobConfig c, int d) {
  if (d == 0) return c;
  const std::vector<int> blocks = stage_blocks(c);
  c.model.args.n_layers -= static_cast<std::int64_t>(blocks.size()) * d;
  clear_stage_split(c);
  if (blocks.size() > 1) {
    int at = 0;
    for (std::size_t s = 0; s + 1 < blocks.size(); ++s) {
      at += blocks[s] - d;
      c.parallelism.pipeline_parallel_split_points.push_back("layers." + std::to_string(at));
    }
  }
  return c;
}

/// The microbatches of a pipelined layout, or the accumulation steps of one without.
inline std::int64_t batch_count(const train::JobConfig& c, const comm::MeshShape& mesh) {
  const std::int64_t local = c.training.local_batch_size, global = c.training.global_batch_size;
  if (mesh.pp > 1) return local / c.parallelism.pipeline_parallel_microbatch_size;
  return global / (local * mesh.dp());
}

/// `c` with `n` microbatches (pipelining) or accumulation steps: the global batch changed.
inline train::JobConfig with_batch_count(train::JobConfig c, const comm::MeshShape& mesh, std::int64_t n) {
  if (mesh.pp > 1) {
    c.training.local_batch_size = n * c.parallelism.pipeline_parallel_microbatch_size;
    c.training.global_batch_size = c.training.local_batch_size * mesh.dp();
  } else {
    c.training.global_batch_size = n * c.training.local_batch_size * mesh.dp();
  }
  return c;
}

/// `c` on `pp` pipeline ranks (the other degrees kept): its first, second and last
/// stages as c's, every other stage as c's second, the split given explicitly.
inline train::JobConfig with_pipeline_degree(train::JobConfig c, int pp) {
  const std::vector<int> blocks = stage_blocks(c);
  const int per_rank = static_cast<int>(blocks.size()) / static_cast<int>(c.parallelism.pipeline_parallel_degree);
  const int stages = pp * per_rank;
  const int middle = *std::max_element(blocks.begin() + 1, blocks.end() - 1);
  std::vector<int> now(static_cast<std::size_t>(stages), middle);
  now.front() = blocks.front();
  now.back() = blocks.back();
  c.parallelism.pipeline_parallel_degree = pp;
  clear_stage_split(c);
  int at = 0;
  for (int s = 0; s + 1 < stages; ++s) {
    at += now[static_cast<std::size_t>(s)];
    c.parallelism.pipeline_parallel_split_points.push_back("layers." + std::to_string(at));
  }
  c.model.args.n_layers = at + now.back();
  return c;
}

inline double lerp_to(double x1, double f1, double x2, double f2, double x) {
  return x2 == x1 ? f1 : f1 + (f2 - f1) * (x - x1) / (x2 - x1);
}

/// `c` with its linear layers' GEMMs in float8 by `recipe` on the GPU's float8 matmul
/// (model.converters holds "float8", float8.emulate = false), or without float8 (`recipe`
/// empty): "float8" taken out of model.converters.
inline void set_float8(train::JobConfig& c, const std::string& recipe) {
  auto& conv = c.model.converters;
  conv.erase(std::remove(conv.begin(), conv.end(), std::string("float8")), conv.end());
  if (recipe.empty()) return;
  conv.push_back("float8");
  c.float8.recipe_name = recipe;
  c.float8.emulate = false;
}

}  // namespace detail

/// The float8 recipe `c` trains its linear layers' GEMMs by, or "" without float8.
inline std::string float8_recipe(const train::JobConfig& c) {
  return train::float8_enabled(c) ? c.float8.recipe_name : std::string();
}

/// Whether layout `a` does no more work than `b`, a variant of the same layout: no more
/// recomputation (a checkpoint mode of less, or the same mode and option; the SwiGLU
/// output remade only where b remakes it too) and its parameters kept gathered after
/// forward at least as long. It then holds at least as
/// much live memory, though not always as much reserved: the caching allocator's
/// rounding and free blocks differ between variants (search_layouts relies on the live
/// peak alone; tests/plan/test_search.cpp checks it against pricing every layout). Layouts
/// of different float8 settings are not variants of each other: their GEMMs and the casts'
/// saved tensors differ, so neither settles the other.
inline bool less_work(const train::JobConfig& a, const train::JobConfig& b) {
  if (float8_recipe(a) != float8_recipe(b)) return false;
  const auto rank = [](const train::JobConfig& c) {
    return c.activation_checkpoint.mode == "none" ? 0 : c.activation_checkpoint.mode == "selective" ? 1 : 2;
  };
  const auto &x = a.activation_checkpoint, &y = b.activation_checkpoint;
  const bool less_recompute =
      (rank(a) < rank(b) || (x.mode == y.mode && x.selective_ac_option == y.selective_ac_option)) &&
      (!x.recompute_swiglu || y.recompute_swiglu);
  const bool kept_longer =
      a.parallelism.fsdp_reshard_after_forward != "always" || b.parallelism.fsdp_reshard_after_forward == "always";
  return less_recompute && kept_longer;
}

/// Traces world rank `rank` of the layout `c` on `world` ranks (llama_plan::trace_step).
using TraceRank = std::function<StepTrace(const train::JobConfig& c, int world, int rank)>;

/// The context-parallel degrees a search takes for sequences of `seq_len` tokens on the
/// `ranks` GPUs left beside tensor and pipeline parallelism: 1, and each divisor cp of
/// `ranks` that splits a sequence into 2 cp equal chunks while each rank keeps at least
/// `min_tokens` of it.
inline std::vector<std::int64_t> context_degrees(std::int64_t ranks, std::int64_t seq_len, std::int64_t min_tokens) {
  std::vector<std::int64_t> out;
  for (std::int64_t cp : detail::divisors(ranks))
    if (cp == 1 || (seq_len % (2 * cp) == 0 && seq_len / cp >= min_tokens)) out.push_back(cp);
  return out;
}

/// Every layout of `base` on `space.gpus` GPUs, global batch `global_batch` sequences:
/// base's model, training and every other key, with the degrees, local batch, pipeline
/// schedule and microbatch, checkpoint mode and reshard policy of each layout, and its
/// float8 recipe where the space has them. Degrees the model cannot take (tensor
/// parallelism over the heads, more stages than layers) and settings the runtime refuses
/// (float8 on wk and wv with more tensor-parallel ranks than kv heads) are left to the
/// pricing, which names what refuses them.
inline std::vector<train::JobConfig> enumerate_layouts(const train::JobConfig& base, const SearchSpace& space,
                                                       std::int64_t global_batch) {
  std::vector<train::JobConfig> out;
  const std::int64_t n = space.gpus;
  // The float8 settings: "" without float8, else a recipe; none given, the base's own.
  std::vector<std::optional<std::string>> float8s{std::nullopt};
  if (!space.float8_recipes.empty()) {
    float8s = {std::string()};
    for (const std::string& r : space.float8_recipes) float8s.emplace_back(r);
  }
  for (std::int64_t tp : detail::divisors(n)) {
    if (tp > space.gpus_per_node) continue;
    for (std::int64_t pp : detail::divisors(n / tp)) {
      if (pp > base.model.args.n_layers + 2) continue;
      for (std::int64_t cp : context_degrees(n / (tp * pp), base.training.seq_len, space.min_context_tokens)) {
        const std::int64_t dp = n / (tp * pp * cp);  // the context-parallel ranks share their sequences
        if (global_batch % dp != 0) continue;
        const std::int64_t per_rank = global_batch / dp;  // sequences per data-parallel rank per step
        for (std::int64_t shard : detail::divisors(dp)) {
          // FSDP shards over dp_shard x cp: with either, its reshard policy is a choice.
          const std::vector<const char*> reshards =
              shard * cp > 1 ? std::vector<const char*>{"never", "always"} : std::vector<const char*>{"default"};
          const std::vector<const char*> schedules =
              pp > 1 ? std::vector<const char*>{"1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble",
                                                "ZBVZeroBubble"}
                     : std::vector<const char*>{"1F1B"};
          for (std::int64_t mb : detail::divisors(per_rank)) {
            if (mb > space.max_microbatch) continue;
            for (const auto& float8 : float8s)
              for (const char* schedule : schedules)
                for (const char* reshard : reshards)
                  for (const auto& ac : detail::kAcModes) {
                    train::JobConfig c = base;
                    if (float8) detail::set_float8(c, *float8);
                    auto& p = c.parallelism;
                    p.data_parallel_replicate_degree = dp / shard;
                    p.data_parallel_shard_degree = shard;
                    p.tensor_parallel_degree = tp;
                    p.pipeline_parallel_degree = pp;
                    p.context_parallel_degree = cp;
                    p.pipeline_parallel_schedule = schedule;
                    p.pipeline_parallel_schedule_csv.clear();  // a file's order is for its own degree and batch
                    p.pipeline_parallel_split_points.clear();
                    p.pipeline_parallel_layers_per_stage.reset();  // the schedule's stages per rank
                    p.fsdp_reshard_after_forward = reshard;
                    c.activation_checkpoint.mode = ac.mode;
                    c.activation_checkpoint.selective_ac_option = ac.option;
                    c.activation_checkpoint.recompute_swiglu = ac.recompute_swiglu;
                    c.training.global_batch_size = global_batch;
                    if (pp > 1) {
                      c.training.local_batch_size = per_rank;
                      p.pipeline_parallel_microbatch_size = mb;
                    } else {
                      c.training.local_batch_size = mb;
                      p.pipeline_parallel_microbatch_size = 1;
                    }
                    out.push_back(std::move(c));
                  }
          }
        }
      }
    }
  }
  return out;
}

/// Prices layout `c` (every degree and batch resolved) on `world` ranks from small traces
/// extrapolated in depth and batch (`full`: from the traces of its real depth and batch).
inline SearchResult price_layout(const train::JobConfig& c, int world, const TraceRank& trace_rank,
                                 const Pricer& compute, const Network& net, bool full = false) {
  const comm::MeshShape mesh = check_dry_run(c, world);
  // What the runtime would refuse, refused before anything is traced: the runtime's own
  // check of a model of Llama blocks (their element type and backend do not enter it).
  parallel::check_tensor_parallel<nn::LlamaBlock<float, Meta>>(c.model.args, {},
                                                               parallel::mesh_degree(mesh.tp, parallel::config_keys),
                                                               !c.parallelism.disable_loss_parallel,
                                                               parallel::config_keys);
  if (mesh.pp > 1) {
    const parallel::PipelineOptions o = train::pipeline_options(c);
    const int v = parallel::pipeline_stages(o.schedule, o, static_cast<int>(c.model.args.n_layers), mesh.pp).per_rank;
    parallel::check_schedule_shape(o.schedule, mesh.pp, v,
                                   static_cast<int>(c.training.local_batch_size / c.parallelism.pipeline_parallel_microbatch_size));
  }
  SearchResult r;
  r.config = c;
  r.mesh = mesh;
  const std::int64_t count = detail::batch_count(c, mesh);
  // Pipeline degree: a pipeline of one stage per rank deeper than 4 ranks is traced on 3
  // and 4, every stage as the layout's first, second and last are (the middle ones as its
  // second), at 8 and 12 microbatches (past the warm-up of both) where the layout is
  // itself past its warm-up (2 pp microbatches or more), else along the line of its own
  // microbatches per pipeline rank. With several stages per rank (schedules that run the
  // microbatches in rounds of pp, affine in the degree only from about 4 ranks: traced on
  // 3 and 4 they miss by 14%), or where 3 ranks would not get whole microbatches, a
  // pipeline deeper than 8 is traced on 4 and 8 along that line (or on the first pair
  // of 8 and 16, 16 and 32, 32 and 64 below the layout's degree where 4 ranks would get
  // a single microbatch).
  std::vector<int> pps{mesh.pp};
  std::vector<std::int64_t> counts{count};
  bool on_ray = false;  // counts[0] is microbatches per pipeline rank, scaled by each degree
  std::vector<int> blocks = detail::stage_blocks(c);
  const bool interleaved = blocks.size() > static_cast<std::size_t>(mesh.pp);
  if (!full && !interleaved && mesh.pp > 4) {
    if (count >= 2 * mesh.pp) {
      pps = {3, 4};
      counts = {8, 12};
    } else if (count % mesh.pp == 0) {
      pps = {3, 4};
      on_ray = true;
    }
  }
  // Along the ray, the smaller degree keeps two microbatches at least (else 8 and 16
  // ranks are traced, or 16 and 32, or 32 and 64; else the layout in full): with one
  // microbatch the first stage's peak falls in another phase of the step, before every
  // gradient is allocated (GPipe over FSDP 2 with full checkpointing, 4 microbatches of
  // 2 on 16 ranks: 2.38, 2.66 and 2.73 MB at 4, 8 and 16; from 4 and 8, 3.22 MB).
  for (int lo : {4, 8, 16, 32}) {
    if (full || pps.size() > 1 || mesh.pp <= 2 * lo || (count * lo) % mesh.pp != 0 || count * lo / mesh.pp < 2) continue;
    pps = {lo, 2 * lo};
    on_ray = true;
  }
  const auto count_at = [&](std::size_t p, std::size_t j) {
    return on_ray ? count * pps[p] / mesh.pp : counts[j];
  };
  // Batch, at the layout's own degree: 2 pp and 3 pp microbatches (at pp the first
  // stage's warm-up is not yet at its steady depth), or 1 and 2 accumulation steps; 3 and
  // 4 under the early step, whose gradients live a unit at a time in the last micro-batch
  // and every unit's through the others: its peak is a micro-batch's backward beside the
  // whole gradient only from 3 micro-batches on (one before the last), constant after.
  const bool early = c.optimizer.early_step_in_backward;
  const std::int64_t c1 = mesh.pp > 1 ? 2 * mesh.pp : (early ? 3 : 1), c2 = mesh.pp > 1 ? 3 * mesh.pp : c1 + 1;
  if (!full && pps.size() == 1 && count > c2) counts = {c1, c2};
  // Depth: the shallowest stage keeps 3 and 4 blocks (at 2, with full checkpointing and
  // FSDP freeing after forward, the peak falls in another phase of the step: Llama 3.1
  // 405B on tp 8 x FSDP 512, 7.15, 7.48, 7.55, 7.85 GiB at 2, 3, 4 and 8 blocks). Selective
  // checkpointing of every N-th block recomputes by block index: the depths step by N,
  // so that every stage keeps its pattern.
  if (pps.size() > 1) blocks = {blocks.front(), *std::max_element(blocks.begin() + 1, blocks.end() - 1), blocks.back()};
  const int least_blocks = *std::min_element(blocks.begin(), blocks.end());
  const auto& ac = c.activation_checkpoint;
  const int step = ac.mode == "selective" && ac.selective_ac_option != "op" ? std::stoi(ac.selective_ac_option) : 1;
  const int d1 = (least_blocks - 3) / step * step, d2 = d1 - step;
  std::vector<int> depths{0};
  if (!full && d2 >= 1) depths = {d1, d2};
  struct Sample {
    double step = 0, exposed = 0, wait = 0, sms = 0;
    std::vector<double> peaks;  // per position; with the degree reduced: the first, second and last
    std::vector<double> slack;  // ... what the allocator reserves beyond them, the same positions
  };
  const std::size_t n_counts = on_ray ? 1 : counts.size();
  std::vector<Sample> grid(depths.size() * pps.size() * n_counts);
  auto cell = [&](std::size_t i, std::size_t p, std::size_t j) -> Sample& {
    return grid[(i * pps.size() + p) * n_counts + j];
  };
  for (std::size_t i = 0; i < depths.size(); ++i)
    for (std::size_t p = 0; p < pps.size(); ++p)
      for (std::size_t j = 0; j < n_counts; ++j) {
        train::JobConfig small = c;
        int w = world;
        comm::MeshShape m = mesh;
        if (pps[p] != mesh.pp) {
          small = detail::with_pipeline_degree(c, pps[p]);
          w = world / mesh.pp * pps[p];
          m.pp = pps[p];
        }
        small = detail::with_batch_count(detail::shallower(small, depths[i]), m, count_at(p, j));
        std::vector<StepTrace> traces;
        for (int rank : distinct_ranks(m, small)) traces.push_back(trace_rank(small, w, rank));
        r.dry_runs += static_cast<int>(traces.size());
        const LayoutPrediction l = predict_layout(traces, compute, net, 0);  // no operation lists: a third of the search
        Sample& s = cell(i, p, j);
        s.step = l.step_seconds;
        s.exposed = l.exposed_comm_seconds;
        s.wait = l.pipeline_wait_seconds;
        s.sms = l.collective_sm_seconds;
        std::vector<std::size_t> kept;
        for (std::size_t k = 0; k < l.positions.size(); ++k) kept.push_back(k);
        if (pps.size() > 1) kept = {0, 1, l.positions.size() - 1};
        for (std::size_t k : kept) {
          s.peaks.push_back(static_cast<double>(l.positions[k].compute.peak_memory_bytes));
          s.slack.push_back(static_cast<double>(l.positions[k].compute.reserved_memory_bytes -
                                                l.positions[k].compute.peak_memory_bytes));
        }
      }
  // Affine in depth (d = 0 is the layout's own), then in the batch count, then in the
  // pipeline degree.
  auto at = [&](auto get) {
    std::vector<double> by_pp;
    for (std::size_t p = 0; p < pps.size(); ++p) {
      std::vector<double> by_count;
      for (std::size_t j = 0; j < n_counts; ++j)
        by_count.push_back(depths.size() == 1 ? get(cell(0, p, j))
                                              : detail::lerp_to(depths[0], get(cell(0, p, j)), depths[1],
                                                                get(cell(1, p, j)), 0));
      by_pp.push_back(n_counts == 1 ? by_count[0]
                                    : detail::lerp_to(static_cast<double>(counts[0]), by_count[0],
                                                      static_cast<double>(counts[1]), by_count[1],
                                                      static_cast<double>(count)));
    }
    return pps.size() == 1 ? by_pp[0] : detail::lerp_to(pps[0], by_pp[0], pps[1], by_pp[1], mesh.pp);
  };
  r.extrapolated = depths.size() > 1 || pps.size() > 1 || n_counts > 1;
  r.step_seconds = at([](const Sample& s) { return s.step; });
  r.exposed_comm_seconds = std::max(0.0, at([](const Sample& s) { return s.exposed; }));
  r.pipeline_wait_seconds = std::max(0.0, at([](const Sample& s) { return s.wait; }));
  r.collective_sm_seconds = std::max(0.0, at([](const Sample& s) { return s.sms; }));
  const double usable = compute.usable_bytes();
  r.fits = true;
  // With the degree reduced, the middle positions hold no more than the second: its
  // blocks, and fewer microbatches in flight.
  // The live peak is affine in depth and batch; what the allocator reserves beyond it
  // is not (its free blocks depend on which sizes meet), and an affine extrapolation
  // from a few blocks would multiply its wobble by the depth: the most any sample
  // reserved beyond its peak stands for the layout's (Llama 3.1 405B, tp 4 x FSDP 32:
  // 2.4 GiB at 6 blocks, 2.6 at 32, 3.0 at all 126).
  for (std::size_t k = 0; k < grid.front().peaks.size(); ++k) {
    const double peak = at([k](const Sample& s) { return s.peaks[k]; });
    double slack = 0;
    for (const Sample& s : grid) slack = std::max(slack, s.slack[k]);
    const double reserved = peak + slack;
    r.peak_memory_bytes = std::max(r.peak_memory_bytes, static_cast<std::size_t>(std::max(0.0, peak)));
    r.reserved_memory_bytes = std::max(r.reserved_memory_bytes, static_cast<std::size_t>(std::max(0.0, reserved)));
    r.fits = r.fits && reserved <= usable;
  }
  const std::int64_t tokens = c.training.global_batch_size * c.training.seq_len;
  // A GPU trains a bf16 model unless float32 is asked for ("auto": train::resolve_mixed_precision).
  // A float8 layout's model is bf16 too: its MFU is against the bf16 peak (GpuPricer::peak_flops).
  const DType dtype = c.training.mixed_precision_param == "float32" ? DType::f32 : DType::bf16;
  r.tokens_per_sec = r.step_seconds > 0 ? static_cast<double>(tokens) / r.step_seconds / world : 0;
  // (A layout LoRA refuses was refused by its dry run above: this does not throw.)
  r.mfu_pct = 100 * r.tokens_per_sec *
              nn::training_flops_per_token(c.model.args, train::lora_policy(c), c.training.seq_len) /
              compute.peak_flops(dtype);
  return r;
}

/// Prices every layout of `base` on `space` (plan/search.hpp's head says how), fitting
/// ones ranked by tokens/s, and predicts the first in full.
inline SearchReport search_layouts(const train::JobConfig& base, const SearchSpace& space, std::int64_t global_batch,
                                   const TraceRank& trace_rank, const Pricer& compute, const Network& net) {
  SearchReport report;
  // Float8 layouts are priced at the machine's float8 rates: refused up front where it has none.
  if (!space.float8_recipes.empty()) compute.require_float8("the search's float8 layouts (SearchSpace::float8_recipes)");
  const std::vector<train::JobConfig> all = enumerate_layouts(base, space, global_batch);
  report.enumerated = all.size();
  // A family: one layout but for its checkpoint mode and reshard policy. A group: the
  // families of one tensor, pipeline and context degree, schedule and float8 recipe, by
  // shard degree (most first) and microbatch size (smallest first).
  struct Family {
    std::int64_t shard = 0, microbatch = 0;
    std::vector<const train::JobConfig*> variants;  // least work first (enumeration order)
  };
  std::map<std::string, std::map<std::pair<std::int64_t, std::int64_t>, Family>> groups;
  for (const auto& c : all) {
    const auto& p = c.parallelism;
    const std::string group = std::to_string(p.tensor_parallel_degree) + "/" + std::to_string(p.pipeline_parallel_degree) +
                              "/" + std::to_string(p.context_parallel_degree) + "/" + p.pipeline_parallel_schedule + "/" +
                              float8_recipe(c);
    const std::int64_t mb = p.pipeline_parallel_degree > 1 ? p.pipeline_parallel_microbatch_size : c.training.local_batch_size;
    Family& f = groups[group][{-p.data_parallel_shard_degree, mb}];
    f.shard = p.data_parallel_shard_degree;
    f.microbatch = mb;
    f.variants.push_back(&c);
  }
  std::vector<const std::map<std::pair<std::int64_t, std::int64_t>, Family>*> order;
  for (const auto& [key, g] : groups) order.push_back(&g);
  std::mutex m;
  std::atomic<std::size_t> next{0};
  // A variant of a family: its checkpoint mode, option and SwiGLU recompute, and its
  // reshard policy.
  using VariantKey = std::tuple<std::string, std::string, bool, std::string>;
  auto variant_key = [](const train::JobConfig& c) {
    return VariantKey{c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option,
                      c.activation_checkpoint.recompute_swiglu,
                      c.parallelism.fsdp_reshard_after_forward};
  };
  auto work = [&] {
    for (std::size_t g = next++; g < order.size(); g = next++) {
      std::vector<SearchResult> priced;
      int dry_runs = 0;
      std::size_t refused = 0, dominated = 0;
      std::string refusal;
      auto price = [&](const train::JobConfig* c) -> std::optional<SearchResult> {
        try {
          SearchResult r = price_layout(*c, space.gpus, trace_rank, compute, net);
          r.index = static_cast<std::size_t>(c - all.data());
          dry_runs += r.dry_runs;
          priced.push_back(r);
          return r;
        } catch (const std::exception& e) {
          ++refused;
          if (refusal.empty()) refusal = e.what();
          return std::nullopt;
        }
      };
      // What pricing a variant settles. A variant doing less work (less_work) holds at
      // least as much live memory, so one that fits settles those doing more work (they
      // are dominated), and one whose live peak alone is over the usable memory settles
      // those doing less (their reservations, at least their live peaks, are over too).
      // One whose reservation is over but not its live peak settles nothing: what the
      // caching allocator reserves beyond the live bytes, its rounding and free blocks,
      // differs between variants (the debug model's every-second-block checkpointing
      // reserves 4.0 MiB where full checkpointing, holding less, reserves 4.7).
      enum class Verdict { fits, over, reserved_over, refused };
      const double usable = compute.usable_bytes();
      auto verdict = [&](const std::optional<SearchResult>& r) {
        if (!r) return Verdict::refused;
        if (r->fits) return Verdict::fits;
        return static_cast<double>(r->peak_memory_bytes) > usable ? Verdict::over : Verdict::reserved_over;
      };
      // Prices the variants of `f` that might fit and that no fitting variant doing less
      // work dominates, as few others as it can, in this order:
      //   1. The lightest (full recomputation, parameters freed after forward): if it is
      //      over (or refused), none fits.
      //   2. The variants that settled the family priced before it in this group (`hint`,
      //      its neighbour in shard degree or microbatch): neighbours mostly fit alike,
      //      so these mostly settle the rest.
      //   3. The rest, least work first.
      // Of those that fit, the family lists its lightest and those no other dominates (a
      // variant the order priced before one that dominates it is left out). Llama 3.1
      // 405B on 16,384 H100s, where mostly only full recomputation fits: 2,458 layouts
      // priced from 50,523 traces, where least work first alone priced 4,247 from 90,427;
      // Llama 3 8B on 64 H100s, where mostly all but no recomputation fit: 2,419 where it
      // priced 2,479. The same layouts listed, to the last bit. Returns `fits` where any
      // variant fits, else the lightest's verdict.
      auto price_family = [&](const Family& f, std::vector<VariantKey>& hint) {
        const std::size_t first = priced.size();
        const train::JobConfig* lightest = f.variants.back();
        std::vector<std::pair<const train::JobConfig*, Verdict>> known{{lightest, verdict(price(lightest))}};
        if (known.front().second == Verdict::over || known.front().second == Verdict::refused)
          return known.front().second;
        // Whether `k` settles `c`.
        auto settles = [&](const std::pair<const train::JobConfig*, Verdict>& k, const train::JobConfig* c) {
          return k.first == c || (k.second == Verdict::fits && less_work(*k.first, *c)) ||
                 (k.second == Verdict::over && less_work(*c, *k.first));
        };
        auto try_variant = [&](const train::JobConfig* c) {
          if (std::any_of(known.begin(), known.end(), [&](const auto& k) { return settles(k, c); })) return;
          known.emplace_back(c, verdict(price(c)));
        };
        for (const VariantKey& k : hint)
          for (const train::JobConfig* c : f.variants)
            if (variant_key(*c) == k) try_variant(c);
        for (const train::JobConfig* c : f.variants) try_variant(c);
        // What settled this family, for the next: the variants that fit with none doing
        // less work fitting, then those over with none doing more work over.
        hint.clear();
        for (const Verdict v : {Verdict::fits, Verdict::over})
          for (const auto& k : known)
            if (k.second == v && std::none_of(known.begin(), known.end(), [&](const auto& o) {
                  return o.first != k.first && o.second == v && settles(o, k.first);
                }))
              hint.push_back(variant_key(*k.first));
        const auto shadowed = [&](const SearchResult& r) {
          const train::JobConfig* c = &all[r.index];
          return c != lightest && r.fits && std::any_of(known.begin(), known.end(), [&](const auto& k) {
                   return k.first != c && k.second == Verdict::fits && less_work(*k.first, *c);
                 });
        };
        const auto kept = std::remove_if(priced.begin() + static_cast<std::ptrdiff_t>(first), priced.end(), shadowed);
        dominated += static_cast<std::size_t>(priced.end() - kept);
        priced.erase(kept, priced.end());
        const bool any = std::any_of(known.begin(), known.end(), [](const auto& k) { return k.second == Verdict::fits; });
        return any ? Verdict::fits : known.front().second;
      };
      // Live memory grows with the microbatch and falls with the shard degree: past a
      // family whose lightest variant is over (or refused: fewer microbatches), the larger
      // microbatches are not priced, and past a shard degree where the smallest
      // microbatch is over, the smaller degrees are not. A refusal says nothing of a
      // smaller shard degree (LoRA refuses FSDP, and runs unsharded).
      std::int64_t shard = 0;
      std::vector<VariantKey> hint;
      bool shard_over = false;  // this shard degree's smallest microbatch is over
      bool heavier = false;     // a family of this degree was: its larger microbatches are skipped
      for (const auto& [key, f] : *order[g]) {
        const bool smallest = f.shard != shard;
        if (smallest) {
          if (shard_over) break;
          shard = f.shard;
          heavier = false;
        }
        if (heavier) continue;
        const Verdict v = price_family(f, hint);
        heavier = v == Verdict::over || v == Verdict::refused;
        if (smallest) shard_over = v == Verdict::over;
      }
      std::lock_guard<std::mutex> lock(m);
      report.priced += priced.size() + dominated;
      report.dominated += dominated;
      report.dry_runs += dry_runs;
      report.refused += refused;
      if (report.first_refusal.empty()) report.first_refusal = refusal;
      for (auto& r : priced) report.layouts.push_back(std::move(r));
    }
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < std::max(1, space.threads); ++t) workers.emplace_back(work);
  work();
  for (auto& t : workers) t.join();
  // Fitting ones first, fastest first; the others smallest first; ties in enumeration
  // order, so that the ranking does not depend on which thread finished first.
  const auto ranks_before = [](const SearchResult& a, const SearchResult& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits && a.tokens_per_sec != b.tokens_per_sec) return a.tokens_per_sec > b.tokens_per_sec;
    if (!a.fits && a.reserved_memory_bytes != b.reserved_memory_bytes)
      return a.reserved_memory_bytes < b.reserved_memory_bytes;
    return a.index < b.index;
  };
  std::sort(report.layouts.begin(), report.layouts.end(), ranks_before);
  if (!report.layouts.empty() && report.layouts.front().fits && report.layouts.front().extrapolated) {
    SearchResult& top = report.layouts.front();
    SearchResult exact = price_layout(top.config, space.gpus, trace_rank, compute, net, true);
    report.checked = true;
    report.check_step_gap = top.step_seconds / exact.step_seconds - 1;
    report.check_memory_gap =
        static_cast<double>(top.peak_memory_bytes) / static_cast<double>(exact.peak_memory_bytes) - 1;
    report.dry_runs += exact.dry_runs;
    exact.index = top.index;
    top = std::move(exact);
    std::sort(report.layouts.begin(), report.layouts.end(), ranks_before);
  }
  return report;
}

}  // namespace tessera::plan
