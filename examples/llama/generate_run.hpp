// llama-generate's sampling over any model type: a continuation of --prompt, or with --chat
// an answer in a chat format. llama_generate.cpp runs it on the CPU and, where the build
// has CUDA, generate_cuda.cpp on one GPU.
#pragma once

#include <string>
#include <vector>

#include "tessera/io/chat.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/generate.hpp"

namespace tessera::llama_generate {

/// What to sample: the text to continue, or (chatting) the message to answer after an
/// optional system message, and how.
struct Request {
  std::string prompt;
  bool chatting = false;
  std::string chat, system, chat_format = "auto";
  nn::SampleOptions options;
};

/// The text llama-generate prints: the prompt and its continuation, or the chat answer.
template <class Model>
std::string sample_text(Model& model, const io::Tokenizer& tok, const Request& r) {
  nn::SampleOptions o = r.options;
  o.context = model.args().max_seq_len;
  if (r.chatting) {
    const io::ChatFormat format = io::resolve_chat_format(r.chat_format, tok, "--chat-format");
    std::vector<io::ChatMessage> messages;
    if (!r.system.empty()) messages.push_back({"system", r.system});
    messages.push_back({"user", r.chat});
    return nn::generate_chat_reply(model, tok, format, messages, o);
  }
  return r.prompt + nn::generate_text(model, tok, r.prompt, o);
}

}  // namespace tessera::llama_generate
