// bench-train: training steps of Llama 3 models in bf16 on one GPU — tokens/s, MFU and
// peak memory, against the targets of the CUDA backend.
//
//   bench-train [--flavors llama3.2_1b,llama3.2_3b,llama3_8b] [--batch 1] [--seq 8192]
//               [--ac selective|selective:N|full|none] [--attention auto|cudnn|tessera]
//               [--state-dtype float32|bfloat16] [--steps 10] [--warmup 3]
//               [--peak-tflops 989] [--json FILE] [--markdown] [--commit HASH]
//               [--profile] [--plan-json FLAVOR=FILE ...] [--graph]
//               [--float8 tensorwise|rowwise|rowwise_with_gw_hp]
//
// The model is what llama-train builds, over the CUDA backend and bf16:
// Transformer<bf16, Cuda, Parallel<LlamaBlock<bf16, Cuda>, ..., Checkpoint<Dynamic>>>,
// bf16 activations and parameters, fp32 gradients, AdamW with fp32 masters and moments
// (--state-dtype bfloat16: moments in bf16, optimizer.state_dtype's layout). Attention is
// what training.attention = --attention picks, by llama-train's own rule and call
// (backend/cuda/select_attention.hpp): cuDNN's fused attention where it runs, else tessera's
// flash kernels; each flavor's line says which and why.
// A step is the trainer's: zero_grad, forward_backward over one micro-batch of batch x
// seq tokens, the gradient norm and its clipping coefficient (max norm 1), one AdamW
// update, the loss, norm and coefficient kept on the device (train/step_scalars.hpp); the tokens are drawn uniformly from the vocabulary once (the arithmetic does
// not depend on their values). --ac selective is per op (matmul outputs kept), --ac
// selective:N recomputes every N-th block whole (activation_checkpoint.selective_ac_option
// = N). --warmup untimed steps, then --steps timed ones back to
// back; the step time is their median. Each step is timed on the device, as
// bench/torch_llama.py times PyTorch's: a CUDA event recorded on the compute stream where
// each timed step begins and one after the last, read after one synchronisation at the
// end, so the time between steps that the host spends launching is counted as the
// device sees it, and no synchronisation is added between steps (nor is there one inside
// a step: the loss and the gradient norm are read once, after the last).
// --graph replays the step from a CUDA graph, as training.cuda_graph does: the micro-batch
// staged once at fixed addresses (nn::StagedBatch), the warm-up steps eager, then one
// capture, and each timed step one copy of AdamW's scalars (AdamW::stage) and one
// cudaGraphLaunch.
// --float8 RECIPE runs the blocks' linear layers on cuBLASLt's float8 matmul by torchao's
// recipe (model.converters = ["float8"], float8.emulate = false, the output projection
// kept in bf16 as torchtitan's default filter_fqns does); MFU stays against the bf16 peak
// (--peak-tflops), as torchtitan reports it, and each line says "float8".
//
// Reported per flavor:
//   tokens/s, the median step time;
//   MFU by torchtitan's formula (6 N_non-embedding + 12 L H head_dim T FLOPs per token,
//   no causal halving) against --peak-tflops (989: an H100/H200's dense bf16 peak), and
//   the figure with the attention term halved (the FLOPs a causal kernel does);
//   the peak of device memory the caching allocator handed out during the timed steps,
//   and what it held from the device then (its segments: the replay llama-plan predicts),
//   with how it takes memory (training.expandable_segments' default, backend/cuda/memory.hpp);
//   the target (MFU >= 45% at 1B, >= 50% at 3B, >= 42% at 8B; 8B is measured with
//   --ac full), PASS or MISS.
// --json writes one object per flavor in a list; each has the fields bench/torch_llama.py
// reads with --tessera-json (flavor, batch, seq_len, tokens_per_sec), so the PyTorch
// ratio comes from the same run. A flavor that does not fit in the device's memory is
// reported with the allocator's message, and the exit status is then 1.
//
// --profile runs one more step under CUPTI (backend/cuda/kernel_profile.hpp) and tells
// its device time by llama-plan's classes (plan/measured.hpp: GEMMs, attention,
// memory-bound kernels, loss head, optimizer, host synchronisations), with the time the
// device was busy, the costliest kernels by name and the kernels by the operation they
// belong to (a GEMM or attention call by its shape, tessera's kernels by functor); the
// profiled step runs slower than a
// timed one (a callback on every CUDA call), so its classes are read as shares of the
// device's time. --plan-json FLAVOR=FILE (llama-plan --json for that flavor's run on one
// device, as bench/predicted_gpu_step.sh makes it) prints the prediction beside, class
// by class and operation by operation (as many as the plan's --plan.top listed), measured
// over predicted. --json then holds "profile" (and "plan") per flavor.
// A profile that fails (CUPTI refused, records dropped) is reported with its reason
// beside the flavor's timed figures, which stand, and the exit status is 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "cuda_device.hpp"
#include "machine.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#if TESSERA_HAVE_CUPTI
#include "tessera/backend/cuda/kernel_profile.hpp"
#endif
#include "tessera/backend/cuda/select_attention.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/region.hpp"
#include "tessera/core/units.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/plan/measured.hpp"
#include "tessera/train/step_scalars.hpp"

using namespace tessera;
using namespace tessera::bench;

namespace {

using Block = Parallel<nn::LlamaBlock<bf16, Cuda>, Sharding<Dynamic>, TensorParallel<dynamic>, Pipeline<dynamic>,
                       Checkpoint<Dynamic>>;
using Model = nn::Transformer<bf16, Cuda, Block>;

struct Options {
  std::vector<std::string> flavors = {"llama3.2_1b", "llama3.2_3b", "llama3_8b"};
  std::int64_t batch = 1, seq = 8192, steps = 10, warmup = 3;
  parallel::CheckpointMode ac{parallel::CheckpointMode::Kind::selective_op, 0};
  bool recompute_swiglu = false;  // activation_checkpoint.recompute_swiglu
  bool early_step = false;        // optimizer.early_step_in_backward
  bool fuse_projections = true;   // model.fuse_projections
  double peak_tflops = 989;
  std::string attention = "auto";  // training.attention
  DType state_dtype = DType::f32;  // optimizer.state_dtype
  std::string json_path, commit = "-";
  bool markdown = false;
  bool profile = false;                             // one more step under CUPTI
  bool graph = false;                               // timed steps replayed from a captured graph
  std::optional<ops::Float8Recipe> float8;          // the linear layers' GEMMs in float8, by this recipe
  std::int64_t lora_rank = 0;                       // > 0: LoRA adapters of this rank, the rest frozen
  std::map<std::string, nlohmann::json> plan_json;  // --plan-json's, read at start: a bad file costs no GPU time
};

/// The checkpoint mode, and the SwiGLU output's recompute where it is on.
std::string checkpointing_text(const Options& o) {
  return o.ac.str() + (o.recompute_swiglu ? ", SwiGLU output recomputed" : "") +
         (o.early_step ? ", early step (each unit updated in the backward, no clipping)" : "") +
         (o.lora_rank > 0 ? ", LoRA rank " + std::to_string(o.lora_rank) + " (every linear layer)" : "") +
         (o.fuse_projections ? "" : ", projections one by one");
}

void usage() {
  std::printf(
      "usage: bench-train [--flavors A,B,...] [--batch N] [--seq N] [--ac selective|selective:N|full|none]\n"
      "                   [--recompute-swiglu] [--separate-projections] [--early-step]\n"
      "                   [--attention auto|cudnn|tessera] [--state-dtype float32|bfloat16]\n"
      "                   [--steps N] [--warmup N] [--peak-tflops X] [--json FILE] [--markdown] [--commit HASH]\n"
      "                   [--profile] [--plan-json FLAVOR=FILE ...] [--graph]\n"
      "                   [--float8 tensorwise|rowwise|rowwise_with_gw_hp] [--lora RANK]\n"
      "Training steps of Llama models in bf16 on one GPU: tokens/s, MFU (torchtitan's formula), peak memory.\n"
      "--profile: one more step under CUPTI, its device time by llama-plan's classes and kernels;\n"
      "--plan-json FLAVOR=FILE: llama-plan --json of that flavor's run, printed beside the profile;\n"
      "--graph: the timed steps replayed from a CUDA graph of the step (training.cuda_graph);\n"
      "--recompute-swiglu: the feed-forward's SwiGLU output made again in the backward, not kept\n"
      "  (activation_checkpoint.recompute_swiglu);\n"
      "--early-step: AdamW updates each unit in the backward as its gradient is final, and frees the unit's\n"
      "  gradient (optimizer.early_step_in_backward; nothing clipped);\n"
      "--separate-projections: wq, wk and wv, and w1 and w3, one GEMM a weight, and each residual added by a\n"
      "  pass of its own (model.fuse_projections = false; by default each group runs as one GEMM a direction\n"
      "  and wo's and w2's GEMMs add the residuals);\n"
      "--float8 RECIPE: the blocks' linear layers on cuBLASLt's float8 matmul (MFU against the bf16 peak);\n"
      "--lora RANK: LoRA adapters of that rank (alpha 16) beside every linear layer, the rest frozen\n"
      "  (model.converters = [\"lora\"]; MFU counts a frozen weight's FLOPs 4 times its parameters).\n");
}

/// llama-plan's --json for one device: its step and its time by class, checked.
nlohmann::json read_plan(const std::string& flavor, const std::string& file, const Options& o) {
  std::ifstream in(file);
  TESSERA_CHECK(in.good(), "--plan-json ", flavor, "=", file, ": cannot open it");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  TESSERA_CHECK(!j.is_discarded() && j.is_object(), "--plan-json ", file, ": not a JSON object (llama-plan --json)");
  TESSERA_CHECK(j.contains("breakdown") && j["breakdown"].contains("time") && j.contains("step_seconds"),
                "--plan-json ", file, ": no breakdown.time and step_seconds (llama-plan --json for one device)");
  const auto same = [&](const char* key, const nlohmann::json& want) {
    TESSERA_CHECK(!j.contains(key) || j[key] == want, "--plan-json ", file, ": ", key, " is ", j[key].dump(),
                  ", this run's is ", want.dump());
  };
  same("flavor", flavor);
  same("training.seq_len", o.seq);
  same("training.local_batch_size", o.batch);
  return j;
}

Options parse_options(int argc, char** argv) {
  Options o;
  std::vector<std::pair<std::string, std::string>> plans;  // --plan-json FLAVOR=FILE, read once --flavors is known
  for (Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--help" || flag == "-h") {
      usage();
      std::exit(0);
    } else if (flag == "--flavors") {
      o.flavors.clear();
      for (std::string_view name : split_commas(f.value())) {
        TESSERA_CHECK(!name.empty(), "--flavors: an empty name in the list");
        (void)nn::model_flavor(std::string(name));  // an unknown name fails here, naming it
        o.flavors.emplace_back(name);
      }
    } else if (flag == "--batch") {
      o.batch = parse_count(flag, f.value(), 1);
    } else if (flag == "--seq") {
      o.seq = parse_count(flag, f.value(), 1);
    } else if (flag == "--steps") {
      o.steps = parse_count(flag, f.value(), 1);
    } else if (flag == "--warmup") {
      o.warmup = parse_count(flag, f.value(), 0);
    } else if (flag == "--ac") {
      const std::string_view v = f.value();
      using K = parallel::CheckpointMode::Kind;
      if (v == "selective") o.ac = {K::selective_op, 0};
      else if (v == "full") o.ac = {K::full, 0};
      else if (v == "none") o.ac = {K::none, 0};
      else if (v.starts_with("selective:"))  // every N-th block recomputed whole, torchtitan's layer option
        o.ac = parallel::parse_checkpoint("selective", v.substr(10));
      else fail("--ac: '", v, "' is not one of selective, selective:N, full, none");
    } else if (flag == "--recompute-swiglu") {
      o.recompute_swiglu = true;
    } else if (flag == "--early-step") {
      o.early_step = true;
    } else if (flag == "--separate-projections") {
      o.fuse_projections = false;
    } else if (flag == "--attention") {
      o.attention = std::string(f.value());
      TESSERA_CHECK(o.attention == "auto" || o.attention == "cudnn" || o.attention == "tessera", "--attention: '",
                    o.attention, "' is not one of auto, cudnn, tessera");
    } else if (flag == "--state-dtype") {
      const std::string_view v = f.value();
      if (v == "float32") o.state_dtype = DType::f32;
      else if (v == "bfloat16") o.state_dtype = DType::bf16;
      else fail("--state-dtype: '", v, "' is not one of float32, bfloat16");
    } else if (flag == "--peak-tflops") {
      o.peak_tflops = parse_positive(flag, f.value(), "TFLOP/s");
    } else if (flag == "--json") {
      o.json_path = std::string(f.value());
    } else if (flag == "--commit") {
      o.commit = std::string(f.value());
    } else if (flag == "--markdown") {
      o.markdown = true;
    } else if (flag == "--graph") {
      o.graph = true;
    } else if (flag == "--float8") {
      o.float8 = ops::parse_float8_recipe(f.value(), "--float8");
    } else if (flag == "--lora") {
      o.lora_rank = static_cast<std::int64_t>(parse_positive(flag, f.value(), "rank"));
    } else if (flag == "--profile") {
#if TESSERA_HAVE_CUPTI
      o.profile = true;
#else
      fail("--profile: this bench-train was built without CUPTI (Meson found no libcupti beside the CUDA toolkit)");
#endif
    } else if (flag == "--plan-json") {
      const std::string v(f.value());
      const std::size_t eq = v.find('=');
      TESSERA_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < v.size(), "--plan-json: '", v,
                    "' is not FLAVOR=FILE");
      plans.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    } else {
      f.unknown();
    }
  }
  TESSERA_CHECK(!(o.early_step && o.graph), "--early-step: the units' updates come with their gradients, which a "
                "captured step does not replay; give --graph or --early-step");
  for (const auto& [flavor, file] : plans) {
    TESSERA_CHECK(std::find(o.flavors.begin(), o.flavors.end(), flavor) != o.flavors.end(), "--plan-json ", flavor,
                  "=", file, ": ", flavor, " is not among --flavors");
    TESSERA_CHECK(o.profile, "--plan-json ", flavor, "=", file, ": is set beside a profile; give --profile too");
    o.plan_json[flavor] = read_plan(flavor, file, o);
  }
  return o;
}

/// Seconds of each of `steps` runs of step() on the device: events recorded on the compute
/// stream before each and after the last, read after one synchronisation.
template <class Step>
std::vector<double> device_step_seconds(std::int64_t steps, Step&& step) {
  std::vector<cudaEvent_t> marks(static_cast<std::size_t>(steps + 1), nullptr);
  auto destroy = [&] {
    for (cudaEvent_t e : marks)
      if (e != nullptr) (void)cudaEventDestroy(e);  // on the way out: its status cannot be reported
  };
  try {
    for (cudaEvent_t& e : marks) TESSERA_CUDA_CHECK(cudaEventCreate(&e));
    for (std::int64_t s = 0; s < steps; ++s) {
      TESSERA_CUDA_CHECK(cudaEventRecord(marks[static_cast<std::size_t>(s)], Cuda::stream()));
      step();
    }
    TESSERA_CUDA_CHECK(cudaEventRecord(marks.back(), Cuda::stream()));
    TESSERA_CUDA_CHECK(cudaEventSynchronize(marks.back()));
    std::vector<double> seconds;
    for (std::size_t s = 0; s + 1 < marks.size(); ++s) {
      float ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[s], marks[s + 1]));
      seconds.push_back(ms * 1e-3);
    }
    destroy();
    return seconds;
  } catch (...) {
    destroy();
    throw;
  }
}

/// The MFU target of a flavor, in percent (0: none).
double target_mfu(const std::string& flavor) {
  if (flavor == "llama3.2_1b") return 45;
  if (flavor == "llama3.2_3b") return 50;
  if (flavor == "llama3_8b") return 42;
  return 0;
}

struct Result {
  std::string flavor;
  std::int64_t params = 0;
  double step_seconds = 0, tokens_per_sec = 0, mfu = 0, mfu_causal = 0, loss = 0;
  std::size_t peak_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::string attention;  // the attention it ran and why (training.attention's start-up words)
  std::string error;      // why it did not run (does not fit, ...), else empty
  bool profiled = false;
  std::string profile_error;        // why --profile gave nothing, else empty
  double profile_wall_seconds = 0;  // the profiled step, from launch to synchronisation
  plan::MeasuredStep profile;
  nlohmann::json plan;              // --plan-json's, where given
};

Result run_flavor(const std::string& flavor, const Options& o) {
  Result r;
  r.flavor = flavor;
  nn::ModelArgs args = nn::model_flavor(flavor);
  args.max_seq_len = std::max(args.max_seq_len, o.seq);
  r.attention = cuda::select_attention(
                    o.attention, true, AttentionShape{o.batch, o.seq, args.n_heads, args.kv_heads(), args.head_dim()},
                    false)
                    .text;
  parallel::Plan plan;
  plan.checkpoint = o.ac;
  plan.recompute_swiglu = o.recompute_swiglu;
  plan.fuse_projections = o.fuse_projections;
  plan.early_step = o.early_step;
  plan.param_dtype = DType::bf16;
  if (o.lora_rank > 0) plan.lora = nn::LoraPolicy{true, o.lora_rank, 16.0, {}};
  if (o.float8) {
    plan.float8.enabled = true;
    plan.float8.recipe = *o.float8;
    plan.float8.emulate = false;
  }
  Model model(args, plan);
  r.params = model.num_params();
  model.init_weights(0);
  model.shard();
  optim::AdamWOptions adamw;
  adamw.param_dtype = DType::bf16;
  adamw.state_dtype = o.state_dtype;
  optim::AdamW<bf16, Cuda> optimizer(model, adamw);
  // The early step: each unit handed to AdamW as its gradient is reduced (as the trainer
  // does it, train/trainer.hpp), for as long as this run's model and optimizer live.
  if (o.early_step)
    model.update_in_backward([&](std::span<nn::Parameter<bf16>* const> params, const void* group) {
      optimizer.apply_to(group, params);
    });

  const std::int64_t tokens = o.batch * o.seq;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens + 1));
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto& id : ids) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    id = static_cast<std::int32_t>((x >> 33) % static_cast<std::uint64_t>(args.vocab_size));
  }
  const std::span<const std::int32_t> inputs(ids.data(), static_cast<std::size_t>(tokens));
  const std::span<const std::int32_t> targets(ids.data() + 1, static_cast<std::size_t>(tokens));
  const nn::Geometry g{o.batch, o.seq};

  train::StepScalars<Cuda, float> scalars;
  auto step = [&] {
    model.zero_grad();
    scalars.begin();
    if (o.early_step) {
      optimizer.stage(adamw.lr);
      model.forward_backward(inputs, targets, g, 1.0 / static_cast<double>(tokens), true, scalars.loss_sum());
      Region optimizer_region(region::kOptimizer);
      model.squared_grad_norm(scalars.squared_norm());  // the units' norms, taken at their updates
      scalars.clip(0.0);
      return;
    }
    model.forward_backward(inputs, targets, g, 1.0 / static_cast<double>(tokens), true, scalars.loss_sum());
    {
      // The region llama-train's trainer opens: the profile counts the norm and AdamW as
      // the optimizer, the class llama-plan prices them in.
      Region optimizer_region(region::kOptimizer);
      model.squared_grad_norm(scalars.squared_norm());
      scalars.clip(1.0);
      optimizer.step(adamw.lr, scalars.grad_scale());
    }
  };
  for (std::int64_t s = 0; s < o.warmup; ++s) step();
  std::function<void()> timed = step;
  Cuda::Graph graph;
  auto staged = Model::staged_batch_type::fixed_layout();
  if (o.graph) {
    // The trainer's graphed step (train/trainer.hpp): what the host gives it staged, the
    // launches captured once, each step AdamW's scalars staged and the graph replayed.
    model.stage(inputs, targets, g, 1.0 / static_cast<double>(tokens), staged);
    cuda::graph_allocator(cuda::current_device()).reset_peak();
    graph = Cuda::capture([&] {
      model.zero_grad();
      scalars.begin();
      model.forward_backward(staged, true, scalars.loss_sum());
      Region optimizer_region(region::kOptimizer);
      model.squared_grad_norm(scalars.squared_norm());
      scalars.clip(1.0);
      optimizer.apply(scalars.grad_scale());
    });
    timed = [&] {
      optimizer.stage(adamw.lr);
      graph.replay();
    };
  }
  Cuda::synchronize();
  cuda::device_allocator().reset_peak();
  const std::vector<double> seconds = device_step_seconds(o.steps, timed);
  CachingAllocator::Stats held = cuda::device_allocator().stats();
  if (o.graph) {
    // The step's own tensors came from the graph's pool when it was captured; the
    // parameters, gradients and optimizer state, allocated before, stay in the device's.
    const CachingAllocator::Stats pool = cuda::graph_allocator(cuda::current_device()).stats();
    held.peak_allocated += pool.peak_allocated;
    held.peak_reserved += pool.peak_reserved;
  }
#if TESSERA_HAVE_CUPTI
  if (o.profile) {
    // A profile that fails (CUPTI refused, records dropped) costs the profile, not the
    // timed steps above: its reason is reported beside them.
    try {
      cuda::KernelProfile profile;
      const auto t0 = std::chrono::steady_clock::now();
      timed();
      Cuda::synchronize();
      r.profile_wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      r.profile = plan::measure_step(profile.stop());
      r.profiled = true;
    } catch (const std::exception& e) {
      r.profile_error = e.what();
    }
  }
#endif
  // The last step's loss (the step reads nothing back itself): it must be finite, as
  // the trainer requires.
  const auto read = scalars.read();
  r.loss = read.loss_sum / static_cast<double>(tokens);
  TESSERA_CHECK(read.finite(), r.flavor, ": the last step's loss sum ", read.loss_sum, " or gradient norm ",
                read.grad_norm, " is not finite");
  r.peak_bytes = held.peak_allocated;
  r.reserved_bytes = held.peak_reserved;
  r.step_seconds = median(seconds);
  r.tokens_per_sec = static_cast<double>(tokens) / r.step_seconds;
  const double peak = o.peak_tflops * 1e12;
  r.mfu = 100 * r.tokens_per_sec * model.flops_per_token(o.seq) / peak;
  r.mfu_causal = 100 * r.tokens_per_sec * model.flops_per_token(o.seq, true) / peak;
  return r;
}

/// The kinds of operation llama-plan's --json lists ("costliest": as many as its --plan.top
/// asked for), or none without a plan.
std::vector<plan::OpTotal> predicted_kinds(const Result& r) {
  std::vector<plan::OpTotal> kinds;
  if (r.plan.is_null() || !r.plan.contains("costliest")) return kinds;
  for (const nlohmann::json& k : r.plan["costliest"])
    kinds.push_back({k["what"].get<std::string>(), k["class"].get<std::string>(), k["seconds"].get<double>(),
                     k["count"].get<std::int64_t>()});
  return kinds;
}

/// The profiled step by class, with llama-plan's prediction beside where there is one.
void print_profile(const Result& r) {
  const plan::MeasuredStep& m = r.profile;
  std::printf("%-12s | profiled step %.3f s (CUPTI recording): device busy %.3f s (%.1f%%), kernels and copies %.3f s\n",
              r.flavor.c_str(), r.profile_wall_seconds, m.busy_seconds,
              r.profile_wall_seconds > 0 ? 100 * m.busy_seconds / r.profile_wall_seconds : 0.0, m.device_seconds);
  const bool plan = !r.plan.is_null();
  const nlohmann::json* t = plan ? &r.plan["breakdown"]["time"] : nullptr;
  std::printf("%-12s |   %-24s %10s %7s %6s%s\n", r.flavor.c_str(), "class", "measured", "share", "count",
              plan ? "   predicted   share  measured/predicted" : "");
  const double pstep = plan ? r.plan["step_seconds"].get<double>() : 0;
  for (const auto& [name, ct] : m.by_class) {
    std::printf("%-12s |   %-24s %8.2f ms %6.1f%% %6lld", r.flavor.c_str(), name.c_str(), ct.seconds * 1e3,
                m.device_seconds > 0 ? 100 * ct.seconds / m.device_seconds : 0.0, static_cast<long long>(ct.count));
    if (plan && t->contains(name)) {
      const double ps = (*t)[name]["seconds"].get<double>();
      std::printf("   %8.2f ms %6.1f%%", ps * 1e3, pstep > 0 ? 100 * ps / pstep : 0.0);
      if (ps > 0) std::printf("  %6.3f", ct.seconds / ps);
    }
    std::printf("\n");
  }
  for (std::size_t i = 0; i < std::min<std::size_t>(m.top.size(), 10); ++i)
    std::printf("%-12s |     %8.2f ms x%-5lld %-20s %.110s\n", r.flavor.c_str(), m.top[i].seconds * 1e3,
                static_cast<long long>(m.top[i].count), m.top[i].cls.c_str(), m.top[i].what.c_str());
  // The kernels by the operation they belong to (each GEMM and attention call by its
  // shape, tessera's kernels by functor), beside the prediction's: what a class's gap is
  // made of.
  std::printf("%-12s |   %-48s %-20s %10s %7s%s\n", r.flavor.c_str(), "by operation", "class", "measured",
              "kernels", plan ? "   predicted  calls  measured/predicted" : "");
  for (const plan::OperationComparison& f : plan::compare_operations(m.operations, predicted_kinds(r))) {
    std::printf("%-12s |     %-46.46s %-20s %7.3f ms %7lld", r.flavor.c_str(), f.what.c_str(), f.cls.c_str(),
                f.measured_seconds * 1e3, static_cast<long long>(f.measured_count));
    if (plan) {
      std::printf("   %7.3f ms %6lld", f.predicted_seconds * 1e3, static_cast<long long>(f.predicted_count));
      if (f.predicted_seconds > 0 && f.measured_count > 0) std::printf("  %6.3f", f.measured_seconds / f.predicted_seconds);
    }
    std::printf("\n");
  }
}

nlohmann::json profile_json(const Result& r) {
  const plan::MeasuredStep& m = r.profile;
  nlohmann::json classes = nlohmann::json::object(), top = nlohmann::json::array();
  for (const auto& [name, ct] : m.by_class) classes[name] = {{"seconds", ct.seconds}, {"count", ct.count}};
  for (const auto& o : m.top) top.push_back({{"what", o.what}, {"class", o.cls}, {"seconds", o.seconds}, {"count", o.count}});
  nlohmann::json operations = nlohmann::json::array();
  for (const plan::OperationComparison& f : plan::compare_operations(m.operations, predicted_kinds(r)))
    operations.push_back({{"what", f.what}, {"class", f.cls}, {"measured_seconds", f.measured_seconds},
                          {"measured_kernels", f.measured_count}, {"predicted_seconds", f.predicted_seconds},
                          {"predicted_calls", f.predicted_count}});
  return {{"wall_seconds", r.profile_wall_seconds}, {"device_seconds", m.device_seconds},
          {"busy_seconds", m.busy_seconds}, {"classes", classes}, {"costliest", top}, {"operations", operations}};
}

int run(const Options& o) {
  const std::string device = cuda_device_name(), date = utc_date();
  (void)cuda::device_allocator();  // created now, so that its mode is known
  std::printf("bench-train: %s, %s, commit %s | batch %lld x seq %lld, activation checkpointing %s, AdamW moments "
              "%s, peak %.0f TFLOP/s | memory: %s\n",
              device.c_str(), date.c_str(), o.commit.c_str(), static_cast<long long>(o.batch),
              static_cast<long long>(o.seq), checkpointing_text(o).c_str(), std::string(name_of(o.state_dtype)).c_str(),
              o.peak_tflops, cuda::expandable_segments_status(cuda::current_device()).c_str());
  std::vector<Result> results;
  bool failed = false;
  for (const std::string& flavor : o.flavors) {
    Result r;
    try {
      r = run_flavor(flavor, o);
      if (const auto it = o.plan_json.find(flavor); it != o.plan_json.end()) r.plan = it->second;
    } catch (const std::exception& e) {
      r.flavor = flavor;
      r.error = e.what();
      failed = true;
    }
    // What the flavor held is freed by now; give the cached blocks back for the next.
    cuda::device_allocator().empty_cache();
    if (!r.attention.empty()) std::printf("%-12s | attention: %s\n", r.flavor.c_str(), r.attention.c_str());
    if (o.graph) std::printf("%-12s | steps replayed from a CUDA graph (--graph)\n", r.flavor.c_str());
    if (o.float8)
      std::printf("%-12s | float8 %s GEMMs (cuBLASLt), MFU against the bf16 peak\n", r.flavor.c_str(),
                  std::string(ops::name_of(*o.float8)).c_str());
    if (!r.error.empty()) {
      std::printf("%-12s | did not run: %s\n", r.flavor.c_str(), r.error.c_str());
    } else {
      const double target = target_mfu(r.flavor);
      std::printf("%-12s | %6.2fB params | step %8.3f s | %9.0f tokens/s | MFU %5.1f%% (causal %5.1f%%) | peak %s "
                  "(reserved %s) | loss %.3f | target %s\n",
                  r.flavor.c_str(), static_cast<double>(r.params) / 1e9, r.step_seconds, r.tokens_per_sec, r.mfu,
                  r.mfu_causal, mebibytes(static_cast<double>(r.peak_bytes)).c_str(),
                  mebibytes(static_cast<double>(r.reserved_bytes)).c_str(), r.loss,
                  target == 0 ? "-" : (r.mfu >= target ? "PASS" : "MISS"));
      if (r.profiled) print_profile(r);
      if (!r.profile_error.empty()) {
        std::printf("%-12s | no profile: %s\n", r.flavor.c_str(), r.profile_error.c_str());
        failed = true;  // what was asked for is missing; the timed figures above stand
      }
    }
    results.push_back(r);
  }
  if (o.markdown) {
    std::printf("\n| date | commit | device | flavor | batch x seq | AC | tokens/s | MFU | MFU (causal) | peak memory | target |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Result& r : results) {
      if (!r.error.empty()) continue;
      const double target = target_mfu(r.flavor);
      std::printf("| %s | %s | %s | %s | %lld x %lld | %s | %.0f | %.1f%% | %.1f%% | %s | %s |\n", date.c_str(),
                  o.commit.c_str(), device.c_str(),
                  (r.flavor + (o.float8 ? " (float8 " + std::string(ops::name_of(*o.float8)) + ")" : "")).c_str(),
                  static_cast<long long>(o.batch),
                  static_cast<long long>(o.seq), checkpointing_text(o).c_str(), r.tokens_per_sec, r.mfu, r.mfu_causal,
                  mebibytes(static_cast<double>(r.peak_bytes)).c_str(),
                  target == 0 ? "-" : (std::string(r.mfu >= target ? "PASS" : "MISS") + " (>= " +
                                       std::to_string(static_cast<int>(target)) + "%)")
                                          .c_str());
    }
  }
  if (!o.json_path.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const Result& r : results) {
      nlohmann::json j = {{"flavor", r.flavor},
                          {"batch", o.batch},
                          {"seq_len", o.seq},
                          {"activation_checkpoint", checkpointing_text(o)},
                          {"attention", r.attention},
                          {"state_dtype", name_of(o.state_dtype)},
                          {"cuda_graph", o.graph},
                          {"early_step", o.early_step},
                          {"lora_rank", o.lora_rank},
                          {"float8", o.float8 ? std::string(ops::name_of(*o.float8)) : std::string("none")},
                          {"device", device},
                          {"date", date},
                          {"commit", o.commit},
                          {"path", "tessera bench-train"}};
      if (r.error.empty()) {
        j["tokens_per_sec"] = r.tokens_per_sec;
        j["step_seconds"] = r.step_seconds;
        j["mfu_pct"] = r.mfu;
        j["mfu_causal_pct"] = r.mfu_causal;
        j["peak_memory_bytes"] = r.peak_bytes;
        j["reserved_memory_bytes"] = r.reserved_bytes;
        j["num_params"] = r.params;
        if (r.profiled) j["profile"] = profile_json(r);
        if (!r.profile_error.empty()) j["profile_error"] = r.profile_error;
        if (!r.plan.is_null()) j["plan"] = r.plan;
      } else {
        j["error"] = r.error;
      }
      out.push_back(j);
    }
    std::ofstream f(o.json_path);
    TESSERA_CHECK(f.good(), "--json ", o.json_path, ": cannot open it for writing");
    f << out.dump(2) << "\n";
    TESSERA_CHECK(f.good(), "--json ", o.json_path, ": writing failed");
  }
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_options(argc, argv);
    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    if (status != cudaSuccess || devices <= 0) {
      std::fprintf(stderr, "bench-train: no CUDA device is visible (cudaGetDeviceCount: %s)\n",
                   status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
      return 1;
    }
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-train: %s\n", e.what());
    return 1;
  }
}
