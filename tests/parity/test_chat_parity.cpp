// Parity of the chat formats with transformers' apply_chat_template.
//
// tools/make_fixtures.py rendered conversations with Meta-Llama-3-8B-Instruct's and
// Llama-2-7b-chat-hf's chat templates (the Jinja text in io/chat.hpp) through
// transformers, with the fixture tokenizers: the Llama 3 tokenizer.json converted from
// bpe.tiktoken and the SentencePiece model sp.model (legacy: Meta's reference encoding).
// tessera's chat_tokens must give exactly the same ids, and its loss mask must cover
// exactly the assistants' replies.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/io/chat.hpp"
#include "tessera/io/sentencepiece.hpp"
#include "tessera/io/tiktoken.hpp"

namespace test_chat_parity {  // unity build: this file's names stay in here (tests/meson.build)

#ifndef TESSERA_FIXTURES
#error "TESSERA_FIXTURES must name the tests/fixtures folder (tests/parity/meson.build defines it)"
#endif

namespace fs = std::filesystem;
using namespace tessera;
using Ids = std::vector<std::uint32_t>;

TEST_CASE("chat formats: the ids of transformers' apply_chat_template, and a mask over the replies") {
  const fs::path fixtures(TESSERA_FIXTURES);
  std::ifstream in(fixtures / "chat" / "chat_ids.json", std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open ", (fixtures / "chat" / "chat_ids.json").string());
  const nlohmann::json cases = nlohmann::json::parse(in);
  REQUIRE(cases.size() >= 10);
  const io::TiktokenTokenizer llama3 = io::TiktokenTokenizer::load((fixtures / "tokenizers" / "bpe.tiktoken").string());
  const io::SentencePieceTokenizer llama2 = io::SentencePieceTokenizer::load((fixtures / "tokenizers" / "sp.model").string());
  CHECK(io::chat_format_for(llama3) == io::ChatFormat::llama3);
  CHECK(io::chat_format_for(llama2) == io::ChatFormat::llama2);
  int formats_seen[2] = {0, 0};
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const nlohmann::json& c = cases[k];
    const io::ChatFormat format = io::parse_chat_format(c.at("format").get<std::string>(), "format");
    const io::Tokenizer& tok = format == io::ChatFormat::llama3 ? static_cast<const io::Tokenizer&>(llama3) : llama2;
    std::vector<io::ChatMessage> messages;
    std::string replies, replies_spaced;  // the assistants' stripped replies, back to back
    for (const nlohmann::json& m : c.at("messages")) {
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      if (messages.back().role != "assistant") continue;
      replies += io::python_strip(messages.back().content);
      replies_spaced += " " + std::string(io::python_strip(messages.back().content)) + " ";
    }
    const bool generation = c.at("generation_prompt").get<bool>();
    CAPTURE(k);
    CAPTURE(c.at("format").get<std::string>());
    const io::ChatTokens t = io::chat_tokens(format, tok, messages, "case", generation);
    CHECK(t.ids == c.at("ids").get<Ids>());
    REQUIRE(t.loss_mask.size() == t.ids.size());
    // The masked tokens are the replies and what ends each (<|eot_id|>, or " " EOS).
    Ids learned;
    std::size_t ends = 0;
    for (std::size_t i = 0; i < t.ids.size(); ++i) {
      if (!t.loss_mask[i]) continue;
      learned.push_back(t.ids[i]);
      const std::uint32_t end = format == io::ChatFormat::llama3 ? *tok.special_id("<|eot_id|>") : tok.eos_id();
      ends += t.ids[i] == end ? 1 : 0;
    }
    const std::string decoded = tok.decode(learned);
    std::size_t assistants = 0;
    for (const io::ChatMessage& m : messages) assistants += m.role == "assistant" ? 1 : 0;
    CHECK(ends == assistants);
    // Llama 2's replies are " " + reply + " " each, which SentencePiece decodes with the
    // first leading space dropped.
    CHECK(decoded == (format == io::ChatFormat::llama3 || replies_spaced.empty() ? replies : replies_spaced.substr(1)));
    ++formats_seen[static_cast<int>(format)];
  }
  CHECK(formats_seen[0] >= 5);
  CHECK(formats_seen[1] >= 5);
}

}  // namespace test_chat_parity
