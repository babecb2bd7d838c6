// Chat formats: Python's strip, the JSON lines of a chat set, the loss mask, and every
// kind of bad conversation (tests/parity/test_chat_parity.cpp holds the ids to
// transformers' apply_chat_template).
#include <doctest/doctest.h>

#include "../support/errors.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/io/bpe_trainer.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/io/tokenizer.hpp"

namespace test_chat {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using Messages = std::vector<io::ChatMessage>;

namespace {

/// A tiktoken vocabulary of the 256 bytes alone: Llama 3's special tokens at 256...
io::TiktokenTokenizer bytes_tiktoken() {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(static_cast<unsigned char>(b)));
  return io::TiktokenTokenizer::parse(io::to_tiktoken_text(tokens), "bytes");
}

}  // namespace

TEST_CASE("python_strip: Python's str.strip on UTF-8, Unicode white space included") {
  CHECK(io::python_strip("  a b \n") == "a b");
  CHECK(io::python_strip("\t\v\f\r\x1c\x1f x") == "x");
  CHECK(io::python_strip("\xC2\xA0x\xC2\x85") == "x");                       // U+00A0, U+0085
  CHECK(io::python_strip("\xE3\x80\x80x\xE2\x80\x8A\xE2\x80\xAF") == "x");     // U+3000; U+200A, U+202F
  CHECK(io::python_strip("\xE2\x80\x8Bx") == "\xE2\x80\x8Bx");                 // U+200B is not white space
  CHECK(io::python_strip("\xE1\xA0\x8Ex") == "\xE1\xA0\x8Ex");                 // nor U+180E
  CHECK(io::python_strip(" \n ").empty());
  CHECK(io::python_strip("").empty());
}

TEST_CASE("chat_tokens: Llama 3's pieces, and a mask over the reply and its <|eot_id|>") {
  const io::TiktokenTokenizer tok = bytes_tiktoken();
  const std::uint32_t start = *tok.special_id("<|start_header_id|>"), end = *tok.special_id("<|end_header_id|>"),
                      eot = *tok.special_id("<|eot_id|>");
  const Messages m{{"user", " hi "}, {"assistant", "ok\n"}};
  const io::ChatTokens t = io::chat_tokens(io::ChatFormat::llama3, tok, m, "x");
  const std::vector<std::uint32_t> want{tok.bos_id(), start, 'u', 's', 'e', 'r', end, '\n', '\n', 'h', 'i', eot,
                                        start, 'a', 's', 's', 'i', 's', 't', 'a', 'n', 't', end, '\n', '\n', 'o', 'k', eot};
  CHECK(t.ids == want);
  std::vector<std::uint8_t> mask(want.size(), 0);
  mask[25] = mask[26] = mask[27] = 1;  // "o" "k" <|eot_id|>
  CHECK(t.loss_mask == mask);
  // The generation prompt opens the assistant's turn; nothing of it is learned.
  const io::ChatTokens g = io::chat_tokens(io::ChatFormat::llama3, tok, Messages{{"user", "hi"}}, "x", true);
  CHECK(g.ids.size() == 1 + 8 + 2 + 1 + 1 + 9 + 1 + 2);
  CHECK(g.ids[g.ids.size() - 3] == end);
  for (std::uint8_t b : g.loss_mask) CHECK(b == 0);
}

TEST_CASE("chat_tokens: Llama 2's [INST] turns with the byte tokenizer") {
  const io::ByteTokenizer tok;
  const Messages m{{"system", "S"}, {"user", "u "}, {"assistant", " a"}, {"user", "v"}};
  const io::ChatTokens t = io::chat_tokens(io::ChatFormat::llama2, tok, m, "x");
  const std::string first = "[INST] <<SYS>>\nS\n<</SYS>>\n\nu [/INST] a ";
  std::vector<std::uint32_t> want{io::ByteTokenizer::kBos};
  for (char c : first) want.push_back(static_cast<unsigned char>(c));
  want.push_back(io::ByteTokenizer::kEos);
  want.push_back(io::ByteTokenizer::kBos);
  for (char c : std::string("[INST] v [/INST]")) want.push_back(static_cast<unsigned char>(c));
  CHECK(t.ids == want);
  // " a " and EOS are learned, nothing else.
  const std::size_t reply = 1 + first.size() - 3;
  for (std::size_t i = 0; i < t.ids.size(); ++i) CHECK(t.loss_mask[i] == (i >= reply && i < reply + 4 ? 1 : 0));
  CHECK(io::chat_tokens(io::ChatFormat::llama2, tok, m, "x", true).ids == want);
}

TEST_CASE("chat formats: names, the default for a tokenizer, and the templates") {
  CHECK(io::parse_chat_format("llama2", "k") == io::ChatFormat::llama2);
  CHECK_ERROR_CONTAINS(io::parse_chat_format("chatml", "training.chat_format"),
                       "training.chat_format: unknown chat format 'chatml' (expected llama3 or llama2)");
  CHECK(io::resolve_chat_format("auto", io::ByteTokenizer{}, "k") == io::ChatFormat::llama2);
  CHECK(io::resolve_chat_format("auto", bytes_tiktoken(), "k") == io::ChatFormat::llama3);
  CHECK(io::chat_template_of(io::ChatFormat::llama3).find("<|start_header_id|>") != std::string_view::npos);
  CHECK(io::chat_template_of(io::ChatFormat::llama2).find("[INST]") != std::string_view::npos);
}

TEST_CASE("chat data: every bad line or conversation is one message naming its place") {
  const io::ByteTokenizer bytes;
  CHECK(io::parse_chat_line(R"({"messages": [{"role": "user", "content": "é"}]})", "c.jsonl", 3).at(0).content == "é");
  CHECK_ERROR_CONTAINS(io::parse_chat_line("{\"messages\": [", "c.jsonl", 7), "c.jsonl:7: not a JSON object");
  CHECK_ERROR_CONTAINS(io::parse_chat_line("[1]", "c.jsonl", 2), "c.jsonl:2: not a JSON object");
  // A number past a double is nlohmann's out_of_range, not a parse error (fuzz_chat found it
  // escaping without the file's name).
  CHECK_ERROR_CONTAINS(io::parse_chat_line("{\"messages\": [], \"n\": 1e400}", "c.jsonl", 3),
                       "c.jsonl:3: not a JSON object");
  CHECK_ERROR_CONTAINS(io::parse_chat_line(R"({"text": "x"})", "c.jsonl", 2), "c.jsonl:2: no \"messages\" field");
  CHECK_ERROR_CONTAINS(io::parse_chat_line(R"({"messages": {}})", "c.jsonl", 2), "\"messages\" is not an array");
  CHECK_ERROR_CONTAINS(io::parse_chat_line(R"({"messages": [{"role": "user"}]})", "c.jsonl", 4),
                       "c.jsonl:4: message 1 has no string \"content\"");
  CHECK_ERROR_CONTAINS(io::parse_chat_line(R"({"messages": [{"content": "x"}]})", "c.jsonl", 4),
                       "message 1 has no string \"role\"");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"user", "a"}, {"bot", "b"}}, "c.jsonl:5"),
                       "c.jsonl:5: message 2 has role 'bot' (a chat's roles are system, user and assistant)");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama3, bytes_tiktoken(), Messages{{"user", "a"}, {"assistant", " \n"}}, "c.jsonl:6"),
                       "c.jsonl:6: message 2 is an empty assistant turn");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama3, bytes, Messages{{"user", "a"}}, "c.jsonl:8"),
                       "c.jsonl:8: chat format llama3 needs the special token <|start_header_id|>, which the byte tokenizer lacks");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"user", "a"}, {"user", "b"}}, "c.jsonl:9"),
                       "c.jsonl:9: message 2 has role 'user': chat format llama2 takes a system message only first");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"assistant", "a"}}, "c.jsonl:9"),
                       "message 1 has role 'assistant'");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"user", "a"}, {"system", "s"}}, "x"),
                       "message 2 has role 'system'");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"user", "a"}, {"assistant", "b"}}, "x", true),
                       "x: chat format llama2 answers a conversation that ends with a user message");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{}, "x"), "x: the conversation has no messages");
  CHECK_ERROR_CONTAINS(io::chat_tokens(io::ChatFormat::llama2, bytes, Messages{{"system", "s"}}, "x"),
                       "x: the conversation has no user or assistant message");
}

}  // namespace test_chat
