// llama-train: trains a Llama model from a TOML config, torchtitan style.
//
//   llama-train --config examples/configs/debug_model.toml [--section.key value ...]
//
// Writes <dump_folder>/config.toml (the effective config), <dump_folder>/metrics.jsonl
// (one JSON object per step), <dump_folder>/model.safetensors (the final model) and,
// with [checkpoint] enable, <dump_folder>/<folder>/step-N/model.safetensors every
// `interval` steps; <dump_folder>/tokenizer.model when the tokenizer has a file; with
// checkpoint.last_save_in_hf, <dump_folder>/hf (a Hugging Face Llama directory); then
// prints text sampled from the trained model. checkpoint.initial_load_path may name a
// Hugging Face Llama directory to start from: its config.json then defines the model.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

using Model = nn::Transformer<float, Cpu>;

void usage() {
  std::printf(
      "usage: llama-train [--config FILE.toml] [--section.key value ...]\n\n"
      "Trains a Llama model on the CPU. Every config key can be overridden on the command line.\n\n%s",
      train::config_help().c_str());
}

void prune_checkpoints(const fs::path& folder, std::int64_t keep) {
  if (keep <= 0 || !fs::exists(folder)) return;
  std::vector<std::pair<long long, fs::path>> steps;
  for (const auto& e : fs::directory_iterator(folder)) {
    // Only folders this program names ("step-<digits>"); anything else a user put there stays.
    const std::string name = e.path().filename().string();
    const std::string digits = name.size() > 5 && name.rfind("step-", 0) == 0 ? name.substr(5) : "";
    if (e.is_directory() && !digits.empty() && digits.size() < 19 &&
        digits.find_first_not_of("0123456789") == std::string::npos)
      steps.emplace_back(std::stoll(digits), e.path());
  }
  std::sort(steps.begin(), steps.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) fs::remove_all(steps[i].second);
}

int run(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
  const train::JobConfig c = train::load_config("", args);
  train::check_supported(c, 1);
  const fs::path dump = c.job.dump_folder;
  if (c.job.print_config) std::printf("%s\n", train::to_toml(c).c_str());

  const std::string& init = c.checkpoint.initial_load_path;
  const bool init_hf = !init.empty() && train::is_hf_directory(init);
  TESSERA_CHECK(!c.checkpoint.initial_load_in_hf || init_hf, "checkpoint.initial_load_in_hf = true: initial_load_path '",
                init, "' is not a Hugging Face model directory (a folder with config.json)");
  // A Hugging Face directory brings its own model arguments: its config.json.
  const nn::ModelArgs a = init_hf ? train::read_hf_config(init) : c.model.args;
  TESSERA_CHECK(c.training.seq_len <= a.max_seq_len, "training.seq_len = ", c.training.seq_len, " exceeds the model's ",
                init_hf ? "max_position_embeddings (" + init + "/config.json) = " : "max_seq_len = ", a.max_seq_len);
  const std::unique_ptr<io::Tokenizer> tok = data::make_tokenizer(c.model.tokenizer);
  TESSERA_CHECK(tok->vocab_size() <= a.vocab_size, "model.tokenizer '", c.model.tokenizer, "' has ", tok->vocab_size(),
                " ids, more than the model's vocabulary of ", a.vocab_size,
                init_hf ? " (vocab_size in " + init + "/config.json)" : " (model.vocab_size)");
  Model model(a);
  if (init_hf) {
    train::load_hf_model(model, init);
  } else if (!init.empty()) {
    const nn::ModelArgs saved = train::read_model_args(init);
    TESSERA_CHECK(saved.num_params() == a.num_params() && saved.dim == a.dim && saved.n_layers == a.n_layers, init,
                  ": the checkpoint's model (", saved.flavor, ", ", saved.num_params(),
                  " parameters) does not match [model] (", a.flavor, ", ", a.num_params(), " parameters)");
    train::load_model(model, init);
  } else {
    model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  }

  std::vector<std::uint32_t> tokens = train::load_training_tokens(c, *tok);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    TESSERA_CHECK(tokens[i] < static_cast<std::uint32_t>(a.vocab_size), c.training.dataset == "shard" ? c.training.dataset_path : "synthetic corpus",
                  ": token id ", tokens[i], " at index ", i, " is outside the model's vocabulary (model.vocab_size = ",
                  a.vocab_size, ")");
  data::DataLoader loader(std::move(tokens), c.training.seq_len, c.training.local_batch_size);

  const bool measured_peak = c.metrics.peak_tflops <= 0;
  const double peak = measured_peak ? train::measure_gemm_flops<Cpu>() : c.metrics.peak_tflops * 1e12;
  std::fprintf(stderr,
               "tessera llama-train: %s | %lld layers, dim %lld, %lld heads (%lld kv), vocab %lld | %.2fM parameters\n"
               "  %lld tokens/step (batch %lld x seq %lld), %lld windows per epoch | %d threads | peak %.1f GFLOP/s (%s, "
               "OpenBLAS %s kernels)\n",
               a.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
               static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
               static_cast<long long>(a.vocab_size), static_cast<double>(model.num_params()) / 1e6,
               static_cast<long long>(c.training.local_batch_size * c.training.seq_len),
               static_cast<long long>(c.training.local_batch_size), static_cast<long long>(c.training.seq_len),
               static_cast<long long>(loader.windows_per_epoch()), Cpu::threads(), peak / 1e9,
               measured_peak ? "measured sgemm" : "metrics.peak_tflops", Cpu::blas_kernels());

  // Only now, with every input checked, does the run touch its dump folder.
  fs::create_directories(dump);
  {
    std::ofstream out(dump / "config.toml");
    out << train::to_toml(c);
    TESSERA_CHECK(out.good(), (dump / "config.toml").string(), ": cannot write");
  }
  // The tokenizer travels with the models saved here (none for "byte").
  const std::string tokenizer_copy = (dump / "tokenizer.model").string();
  const bool has_tokenizer_file = data::save_tokenizer_file(c.model.tokenizer, tokenizer_copy);
  train::Trainer<Model> trainer(model, c, std::move(loader), peak);
  train::MetricsLogger log((dump / "metrics.jsonl").string(), c.training.steps, c.metrics.log_freq,
                           isatty(STDERR_FILENO) != 0);
  const DType export_dtype = parse_dtype(c.checkpoint.export_dtype, "checkpoint.export_dtype");
  const fs::path ckpt = dump / c.checkpoint.folder;
  for (std::int64_t s = 1; s <= c.training.steps; ++s) {
    log.log(trainer.step());
    if (c.checkpoint.enable && (s % c.checkpoint.interval == 0 || s == c.training.steps)) {
      train::save_model(model, (ckpt / ("step-" + std::to_string(s)) / "model.safetensors").string(), export_dtype);
      prune_checkpoints(ckpt, c.checkpoint.keep_latest_k);
    }
  }
  const std::string final_path = (dump / "model.safetensors").string();
  train::save_model(model, final_path, export_dtype);
  std::fprintf(stderr, "saved %s\n", final_path.c_str());
  if (c.checkpoint.last_save_in_hf) {
    const std::string hf_dir = (dump / "hf").string();
    train::save_hf_model(model, hf_dir, {export_dtype, 5'000'000'000ull, has_tokenizer_file ? tokenizer_copy : ""});
    std::fprintf(stderr, "saved %s (Hugging Face Llama directory)\n", hf_dir.c_str());
  }

  // A sample from the trained model, seeded from the run's seed.
  nn::SampleOptions o;
  o.max_new_tokens = 300;
  o.temperature = 0.7;
  o.seed = static_cast<std::uint64_t>(c.training.seed);
  o.context = c.training.seq_len;
  std::printf("--- sample (temperature %.1f) ---\n%s\n", o.temperature, nn::generate_text(model, *tok, "", o).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nllama-train: error: %s\n", e.what());
    return 1;
  }
}
