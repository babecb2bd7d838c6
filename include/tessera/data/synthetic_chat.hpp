// An embedded chat set: conversations about the synthetic corpus, for fine-tuning.
//
// Conversation `index` under `seed` is a pure function of (seed, index), like the corpus's
// documents (data/synthetic.hpp): an optional system message, then one to three turns,
// each a user question and the assistant's answer, of two kinds a small model learns:
//   arithmetic  "What is seven plus two?"            -> "Seven plus two is nine."
//   repetition  "Repeat after me: The cat sleeps."   -> "The cat sleeps."
// (a sentence of the corpus, documents the corpus's own seed never writes). The answers
// use the corpus's words, so a model pretrained on the corpus starts out knowing them,
// and fine-tuning on this set teaches the turn-taking of a chat format. llama-tokenize
// --write-synthetic-chat writes it as JSON lines (io/chat.hpp's format).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/io/chat.hpp"

namespace tessera::data {

/// The system message some conversations start with.
inline constexpr std::string_view synthetic_chat_system = "You are a helpful assistant. Answer in one sentence.";

namespace detail {

/// The first sentence of `document` (up to and including its first period).
inline std::string first_sentence(const std::string& document) {
  const std::size_t end = document.find('.');
  return end == std::string::npos ? document : document.substr(0, end + 1);
}

inline std::string capitalized(std::string_view word) {
  std::string s(word);
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

}  // namespace detail

/// Conversation `index` (>= 0) of the chat set under `seed`.
inline std::vector<io::ChatMessage> synthetic_conversation(std::uint64_t seed, std::int64_t index) {
  TESSERA_CHECK(index >= 0, "synthetic_conversation: index ", index, " is negative");
  std::uint64_t state = mix64(seed * 0x9E3779B97F4A7C15ull ^ mix64(static_cast<std::uint64_t>(index) + 0x63686174ull));
  auto uniform = [&](std::uint64_t n) {
    state = mix64(state + 0x9E3779B97F4A7C15ull);
    return state % n;
  };
  std::vector<io::ChatMessage> messages;
  if (uniform(4) == 0) messages.push_back({"system", std::string(synthetic_chat_system)});
  const std::uint64_t turns = 1 + uniform(3);
  for (std::uint64_t t = 0; t < turns; ++t) {
    if (uniform(3) != 0) {
      std::size_t a = 0, b = 0, result = 0;
      std::string_view op;
      switch (uniform(3)) {
        case 0: a = uniform(11); b = uniform(11); result = a + b; op = "plus"; break;
        case 1: a = uniform(21); b = uniform(a + 1); result = a - b; op = "minus"; break;
        default: a = 1 + uniform(10); b = uniform(20 / a + 1); result = a * b; op = "times"; break;
      }
      const std::string question = std::string(detail::synthetic_numbers[a]) + " " + std::string(op) + " " +
                                   std::string(detail::synthetic_numbers[b]);
      messages.push_back({"user", "What is " + question + "?"});
      messages.push_back({"assistant", detail::capitalized(question) + " is " + std::string(detail::synthetic_numbers[result]) + "."});
    } else {
      // Sentences of documents the corpus's seed-`seed` stream never writes: another seed.
      const std::string sentence =
          detail::first_sentence(synthetic_document(mix64(seed ^ 0x7265706561747321ull), index * 3 + static_cast<std::int64_t>(t)));
      messages.push_back({"user", "Repeat after me: " + sentence});
      messages.push_back({"assistant", sentence});
    }
  }
  return messages;
}

/// One JSON line {"messages": [...]} (no newline).
inline std::string chat_json_line(const std::vector<io::ChatMessage>& messages) {
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const io::ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  return nlohmann::ordered_json{{"messages", list}}.dump();
}

}  // namespace tessera::data
