// llama-generate: samples text from a saved model.
//
//   llama-generate --checkpoint outputs/debug_model/model.safetensors [--prompt TEXT]
//                  [--tokenizer SPEC] [--max-new-tokens N] [--temperature T] [--top-k K]
//                  [--seed S]
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

using namespace tessera;
namespace fs = std::filesystem;

namespace {

int run(const std::vector<std::string>& args) {
  std::string checkpoint, prompt, tokenizer, chat, system, chat_format = "auto";
  bool chatting = false;
  nn::SampleOptions o;
  o.max_new_tokens = 200;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: llama-generate --checkpoint FILE.safetensors|DIR [--prompt TEXT] [--tokenizer SPEC]\n"
                  "                      [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]\n"
                  "       llama-generate --checkpoint ... --chat MESSAGE [--system TEXT] [--chat-format F]\n\n"
                  "--tokenizer defaults to the tokenizer.model beside the checkpoint file or in the directory,\n"
                  "else the byte tokenizer. --chat answers MESSAGE in a chat format (llama3, llama2, or auto:\n"
                  "llama3 when the tokenizer has its header tokens), after the --system message if given.\n");
      return 0;
    }
    static const std::vector<std::string> known = {"--checkpoint", "--prompt",  "--chat",        "--system",
                                                   "--chat-format", "--tokenizer", "--max-new-tokens", "--temperature",
                                                   "--top-k",      "--seed"};
    if (std::find(known.begin(), known.end(), a) == known.end()) fail("unknown option '", a, "' (see --help)");
    TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
    // Only text (a prompt, a message) may start with "--"; elsewhere it is the next option.
    const bool text = a == "--prompt" || a == "--chat" || a == "--system";
    TESSERA_CHECK(text || args[i + 1].rfind("--", 0) != 0, a, ": missing value (got the option '", args[i + 1], "')");
    const std::string& v = args[++i];
    if (a == "--checkpoint") checkpoint = v;
    else if (a == "--prompt") prompt = v;
    else if (a == "--chat") chat = v, chatting = true;
    else if (a == "--system") system = v;
    else if (a == "--chat-format") chat_format = v;
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
  TESSERA_CHECK(!chatting || prompt.empty(), "--chat and --prompt: give one (--chat answers a message, --prompt continues text)");
  TESSERA_CHECK(chatting || system.empty(), "--system: only with --chat");

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
  nn::Transformer<float, Cpu> model(a);
  train::load_saved_model(model, checkpoint);
  o.context = a.max_seq_len;
  if (chatting) {
    const io::ChatFormat format = io::resolve_chat_format(chat_format, *tok, "--chat-format");
    std::vector<io::ChatMessage> messages;
    if (!system.empty()) messages.push_back({"system", system});
    messages.push_back({"user", chat});
    std::printf("%s\n", nn::generate_chat_reply(model, *tok, format, messages, o).c_str());
    return 0;
  }
  std::printf("%s%s\n", prompt.c_str(), nn::generate_text(model, *tok, prompt, o).c_str());
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
