// libFuzzer target: a chat data set's line (io::parse_chat_line: one JSON object of
// messages) and the ids and loss mask a conversation becomes (io::chat_tokens), in both
// chat formats, with and without the generation prompt, over a byte-level tiktoken
// vocabulary with Llama 3's special tokens.
//
// Contract: reading and encoding either succeed or throw tessera::Error (the file and
// line in its message). For a conversation encoded: one mask value an id, every id
// inside the vocabulary, the mask set only with an assistant message among them (and
// set somewhere when one is, the generation prompt aside), and each message's text,
// stripped, among the decoded ids. Any other exception, a crash, a leak, undefined
// behaviour, a timeout, or a broken invariant above (reported on stderr, then abort) is
// a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/bpe_trainer.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/tiktoken.hpp"

namespace {

[[noreturn]] void finding(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_chat: %s: %s\n", what, detail.c_str());
  std::abort();
}

/// The 256 bytes as tokens, Llama 3's special tokens from 256 on.
const tessera::io::TiktokenTokenizer& bytes_tiktoken() {
  static const tessera::io::TiktokenTokenizer tok = [] {
    std::vector<std::string> tokens;
    for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(static_cast<unsigned char>(b)));
    return tessera::io::TiktokenTokenizer::parse(tessera::io::to_tiktoken_text(tokens), "bytes");
  }();
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tessera::io;
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  std::vector<ChatMessage> messages;
  try {
    messages = parse_chat_line(line, "fuzz.jsonl", 1);
  } catch (const tessera::Error&) {
    return 0;  // refused with a message: the contract
  }
  const TiktokenTokenizer& tok = bytes_tiktoken();
  bool has_reply = false;
  for (const ChatMessage& m : messages) has_reply = has_reply || m.role == "assistant";
  for (const ChatFormat format : {ChatFormat::llama3, ChatFormat::llama2})
    for (const bool prompt : {false, true}) {
      ChatTokens t;
      try {
        t = chat_tokens(format, tok, messages, "fuzz.jsonl:1", prompt);
      } catch (const tessera::Error&) {
        continue;
      }
      const std::string what(chat_template_of(format).substr(0, 40));
      if (t.ids.size() != t.loss_mask.size()) finding("a mask value is missing or extra", what);
      bool masked = false;
      for (std::size_t i = 0; i < t.ids.size(); ++i) {
        if (t.ids[i] >= static_cast<std::uint32_t>(tok.vocab_size())) finding("an id outside the vocabulary", what);
        masked = masked || t.loss_mask[i] != 0;
      }
      if (masked && !has_reply) finding("the mask is set without an assistant message", what);
      if (has_reply && !masked) finding("an assistant message without a masked token", what);
      const std::string text = tok.decode(t.ids);
      for (const ChatMessage& m : messages)
        if (text.find(python_strip(m.content)) == std::string::npos)
          finding("a message's text is not among the decoded ids", std::string(python_strip(m.content)));
    }
  return 0;
}
