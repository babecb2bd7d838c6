// llama-generate: samples text from a saved model.
//
//   llama-generate --checkpoint outputs/debug_model/model.safetensors [--prompt TEXT]
//                  [--tokenizer SPEC] [--max-new-tokens N] [--temperature T] [--top-k K]
//                  [--seed S] [--device cpu|cuda] [--dtype float32|bfloat16]
//   llama-generate --checkpoint ... --chat MESSAGE [--system TEXT] [--chat-format F]
//
// With --chat the model answers MESSAGE as an instruct model does: the conversation
// (an optional system message, then the user's) in a chat format (io/chat.hpp; F is
// llama3, llama2, or auto: the tokenizer's), and the answer ends with the turn.
//
// --checkpoint is a model.safetensors written by llama-train (the model's shape comes
// from its metadata) or a Hugging Face Llama directory (from its config.json). Text goes
// through --tokenizer, by default the tokenizer.model beside the file or inside the
// directory (or its tokenizer.json), else the byte tokenizer; the prompt follows a BOS
// token and generation stops at EOS.
//
// The model samples on the CPU in float32, or with --device cuda on one GPU (a build with
// CUDA) with its weights in float32 or, --dtype bfloat16, in bf16; either way each new
// token's forward runs over its own row through a KV cache.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/instances.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"
#include "flags.hpp"
#include "generate_run.hpp"
#ifndef TESSERA_WITH_CUDA
#define TESSERA_WITH_CUDA 0
#endif
#if TESSERA_WITH_CUDA
#include "generate_cuda.hpp"
#endif

using namespace tessera;
namespace fs = std::filesystem;

namespace {

int run(const std::vector<std::string>& args) {
  std::string checkpoint, tokenizer, device = "cpu", dtype = "float32";
  llama_generate::Request r;
  nn::SampleOptions& o = r.options;
  o.max_new_tokens = 200;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: llama-generate --checkpoint FILE.safetensors|DIR [--prompt TEXT] [--tokenizer SPEC]\n"
                  "                      [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]\n"
                  "                      [--device cpu|cuda] [--dtype float32|bfloat16]\n"
                  "       llama-generate --checkpoint ... --chat MESSAGE [--system TEXT] [--chat-format F]\n\n"
                  "--tokenizer defaults to the tokenizer.model beside the checkpoint file or in the directory,\n"
                  "else the byte tokenizer. --chat answers MESSAGE in a chat format (llama3, llama2, or auto:\n"
                  "llama3 when the tokenizer has its header tokens), after the --system message if given.\n"
                  "--device cuda samples on one GPU (a build with CUDA), its weights in float32 or, with\n"
                  "--dtype bfloat16, in bf16; the CPU samples in float32.\n"
                  "This build samples on: %s.\n",
                  TESSERA_WITH_CUDA ? "cpu, cuda" : "cpu (built without CUDA)");
      return 0;
    }
    static const std::vector<std::string> known = {"--checkpoint", "--prompt",  "--chat",        "--system",
                                                   "--chat-format", "--tokenizer", "--max-new-tokens", "--temperature",
                                                   "--top-k",      "--seed",      "--device",         "--dtype"};
    if (std::find(known.begin(), known.end(), a) == known.end()) fail("unknown option '", a, "' (see --help)");
    TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
    // Only text (a prompt, a message) may start with "--"; elsewhere it is the next option.
    const bool text = a == "--prompt" || a == "--chat" || a == "--system";
    TESSERA_CHECK(text || args[i + 1].rfind("--", 0) != 0, a, ": missing value (got the option '", args[i + 1], "')");
    const std::string& v = args[++i];
    if (a == "--checkpoint") checkpoint = v;
    else if (a == "--prompt") r.prompt = v;
    else if (a == "--chat") r.chat = v, r.chatting = true;
    else if (a == "--system") r.system = v;
    else if (a == "--chat-format") r.chat_format = v;
    else if (a == "--device") device = v;
    else if (a == "--dtype") dtype = v;
    else if (a == "--tokenizer") tokenizer = v;
    else if (a == "--max-new-tokens") o.max_new_tokens = cli::parse_number<std::int64_t>(a, v, "a whole number");
    else if (a == "--temperature") o.temperature = cli::parse_number<double>(a, v, "a number");
    else if (a == "--top-k") o.top_k = cli::parse_number<std::int64_t>(a, v, "a whole number");
    else if (a == "--seed") o.seed = cli::parse_number<std::uint64_t>(a, v, "a whole number >= 0");
    else fail("unknown option '", a, "' (see --help)");
  }
  TESSERA_CHECK(!checkpoint.empty(),
                "--checkpoint: required (a model.safetensors written by llama-train, or a Hugging Face directory)");
  TESSERA_CHECK(o.max_new_tokens >= 0 && o.temperature >= 0 && o.top_k >= 0,
                "--max-new-tokens, --temperature and --top-k must not be negative");
  TESSERA_CHECK(!r.chatting || r.prompt.empty(),
                "--chat and --prompt: give one (--chat answers a message, --prompt continues text)");
  TESSERA_CHECK(r.chatting || r.system.empty(), "--system: only with --chat");
  TESSERA_CHECK(device == "cpu" || device == "cuda", "--device '", device, "': expected cpu or cuda");
  TESSERA_CHECK(dtype == "float32" || dtype == "bfloat16", "--dtype '", dtype, "': expected float32 or bfloat16");
  TESSERA_CHECK(dtype == "float32" || device == "cuda", "--dtype bfloat16: only with --device cuda (the CPU samples "
                                                          "in float32)");
#if !TESSERA_WITH_CUDA
  TESSERA_CHECK(device == "cpu", "--device cuda: this llama-generate was built without CUDA (meson setup -Dcuda=enabled "
                                 "where the CUDA toolkit is installed)");
#endif

  const nn::ModelArgs a = train::read_saved_model_args(checkpoint);
  if (tokenizer.empty()) {
    const fs::path dir = train::is_hf_directory(checkpoint) ? fs::path(checkpoint) : fs::path(checkpoint).parent_path();
    // What io::tokenizer_file finds there (tokenizer.model, tokenizer.json, original/...),
    // else the byte tokenizer.
    std::error_code ec;
    tokenizer = "byte";
    for (const char* name : {"tokenizer.model", "tokenizer.json", "original/tokenizer.model"})
      if (fs::is_regular_file(dir / name, ec)) {
        tokenizer = (dir / name).string();
        break;
      }
  }
  const std::unique_ptr<io::Tokenizer> tok = data::make_tokenizer(tokenizer);
  TESSERA_CHECK(a.vocab_size >= tok->vocab_size(), checkpoint, ": vocabulary of ", a.vocab_size,
                " is smaller than the tokenizer's (", tokenizer, ") ", tok->vocab_size());
#if TESSERA_WITH_CUDA
  if (device == "cuda") {
    std::printf("%s\n", llama_generate::sample_on_cuda(a, checkpoint, dtype == "bfloat16", *tok, r).c_str());
    return 0;
  }
#endif
  nn::Transformer<float, Cpu> model(a);
  train::load_saved_model(model, checkpoint);
  std::printf("%s\n", llama_generate::sample_text(model, *tok, r).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-generate: error: %s\n", e.what());
    return 1;
  }
}
