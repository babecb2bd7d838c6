// llama-eval: the mean next-token cross-entropy of a model over a token file.
//
//   llama-eval --model DIR|FILE.safetensors --tokens FILE [--seq-len N] [--batch B]
//
// --model is a Hugging Face Llama directory (config.json + safetensors) or a
// model.safetensors written by llama-train. --tokens is a token shard (llama-tokenize's
// output) or a headerless little-endian uint32 array named *.u32 (numpy's tofile). The
// file is cut into consecutive windows of N tokens (default: the model's
// max_position_embeddings), each predicting its own next tokens (train/evaluate.hpp).
// The last line printed is exactly `loss=<float> ppl=<float> tokens=<int>`.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/instances.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/train/evaluate.hpp"
#include "flags.hpp"

using namespace tessera;

namespace {

void usage() {
  std::printf(
      "usage: llama-eval --model DIR|FILE.safetensors --tokens FILE [--seq-len N] [--batch B]\n\n"
      "Mean next-token cross-entropy of the model over FILE (a token shard, or a headerless\n"
      "little-endian uint32 array named *.u32), in consecutive windows of N tokens (default:\n"
      "the model's max_position_embeddings), each window predicting its own next tokens.\n"
      "B windows go through the model at once (default: as many as make about 8192 tokens).\n"
      "The last line is: loss=<float> ppl=<float> tokens=<int>\n");
}

int run(const std::vector<std::string>& args) {
  std::string model_path, tokens_path;
  std::int64_t seq_len = 0, batch = 0;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
    TESSERA_CHECK(a == "--model" || a == "--tokens" || a == "--seq-len" || a == "--batch", "unknown option '", a,
                  "' (see --help)");
    TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
    const std::string& v = args[++i];
    if (a == "--model") model_path = v;
    else if (a == "--tokens") tokens_path = v;
    else if (a == "--seq-len") seq_len = cli::parse_number<std::int64_t>(a, v, "a positive integer", 1);
    else batch = cli::parse_number<std::int64_t>(a, v, "a positive integer", 1);
  }
  TESSERA_CHECK(!model_path.empty(), "--model: required (a Hugging Face Llama directory or a model.safetensors)");
  TESSERA_CHECK(!tokens_path.empty(), "--tokens: required (a token shard or a .u32 file)");

  const nn::ModelArgs a = train::read_saved_model_args(model_path);
  if (seq_len == 0) seq_len = a.max_seq_len;
  TESSERA_CHECK(seq_len >= 2, "--seq-len: windows of ", seq_len, " tokens make no prediction (need at least 2)");
  TESSERA_CHECK(seq_len - 1 <= a.max_seq_len, "--seq-len ", seq_len, ": the model ", model_path, " takes at most ",
                a.max_seq_len, " positions");
  const std::vector<std::uint32_t> tokens = io::read_token_file(tokens_path);
  TESSERA_CHECK(tokens.size() >= 2, tokens_path, ": ", tokens.size(), " tokens: nothing to predict");
  if (batch == 0) batch = std::max<std::int64_t>(1, 8192 / seq_len);

  nn::Transformer<float, Cpu> model(a);
  train::load_saved_model(model, model_path);
  std::fprintf(stderr, "llama-eval: %s (%lld layers, dim %lld, vocab %lld), %zu tokens of %s, windows of %lld\n",
               a.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
               static_cast<long long>(a.vocab_size), tokens.size(), tokens_path.c_str(),
               static_cast<long long>(seq_len));

  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto start = std::chrono::steady_clock::now();
  const train::EvalResult r =
      train::evaluate(model, tokens, seq_len, batch, tokens_path, [&](std::int64_t done, std::int64_t total) {
        if (!tty) return;
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::fprintf(stderr, "\r  %lld / %lld tokens  %.0f tokens/s   ", static_cast<long long>(done),
                     static_cast<long long>(total), s > 0 ? static_cast<double>(done) / s : 0.0);
      });
  if (tty) std::fprintf(stderr, "\n");
  std::printf("loss=%.6f ppl=%.6f tokens=%lld\n", r.loss(), r.perplexity(), static_cast<long long>(r.tokens));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-eval: error: %s\n", e.what());
    return 1;
  }
}
