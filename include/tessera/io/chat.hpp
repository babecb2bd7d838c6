// Chat formats: a conversation as the ids an instruct model reads, with a loss mask.
//
// Two formats, each the ids transformers' `apply_chat_template` gives with that model's
// own template (the Jinja text below, which the Hugging Face export writes into
// tokenizer_config.json):
//   llama3  <|begin_of_text|> then, per message,
//           <|start_header_id|>ROLE<|end_header_id|> "\n\n" + strip(content) <|eot_id|>
//   llama2  per user turn BOS "[INST] " + strip(content) + " [/INST]", per assistant
//           turn " " + strip(content) + " " EOS; a leading system message goes inside
//           the first user turn as "<<SYS>>\n" + system + "\n<</SYS>>\n\n"
// strip is Python's str.strip (Jinja's trim): Unicode white space at both ends. The
// templates render text and the tokenizer cuts it at the special tokens and encodes
// each piece between them; chat_tokens builds the same pieces directly and encodes
// each with Tokenizer::encode, so the ids agree token for token. One difference is
// deliberate: message text that spells a special token ("<|eot_id|>") stays text here,
// where a rendered template would turn it into the control token.
// Llama 2's pieces start with SentencePiece's dummy space, as Meta's reference
// chat_completion encodes them (transformers does the same with "legacy": true).
//
// The loss mask marks what a fine-tuned model learns to produce: an assistant message's
// content and the token that ends it (<|eot_id|>, or Llama 2's " " + EOS); headers,
// system and user text are context only. Where the reply begins inside an encoded piece
// (after "\n\n", after " [/INST]"), the reply's tokens are those past the ids the
// piece's prompt part encodes to alone; a token that straddles the boundary counts as
// reply (it holds the reply's first bytes).
//
// Chat data comes as JSON lines, one conversation per line:
//   {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, ...]}
// Roles are system, user and assistant; Llama 2 allows a system message only first and
// then user and assistant in turn, starting with user (its template raises otherwise).
// An assistant message with no content (after strip) is refused: there is nothing to learn.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::io {

/// Meta-Llama-3-8B-Instruct's chat template (tokenizer_config.json's "chat_template"),
/// the Jinja text transformers renders. chat_tokens(ChatFormat::llama3, ...) gives the
/// ids of its rendering.
inline constexpr std::string_view llama3_chat_template =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Llama-2-7b-chat-hf's chat template: [INST] ... [/INST] turns, the system prompt in
/// <<SYS>> inside the first user turn.
inline constexpr std::string_view llama2_chat_template =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif "
    "%}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
    "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";


enum class ChatFormat : std::uint8_t { llama3, llama2 };

/// "llama3" or "llama2".
constexpr std::string_view name_of(ChatFormat f) { return f == ChatFormat::llama3 ? "llama3" : "llama2"; }

/// The format `name` names; `what` (a key, an option) names the value in errors.
inline ChatFormat parse_chat_format(std::string_view name, std::string_view what) {
  if (name == "llama3") return ChatFormat::llama3;
  if (name == "llama2") return ChatFormat::llama2;
  fail(what, ": unknown chat format '", name, "' (expected llama3 or llama2)");
}

/// The Jinja template of `format` (what tokenizer_config.json's chat_template holds).
constexpr std::string_view chat_template_of(ChatFormat format) {
  return format == ChatFormat::llama3 ? llama3_chat_template : llama2_chat_template;
}

/// The special tokens Llama 3's format needs.
inline constexpr std::string_view llama3_chat_specials[] = {"<|start_header_id|>", "<|end_header_id|>",
                                                            "<|eot_id|>"};

/// The format a tokenizer's model was made for: llama3 when it has Llama 3's header and
/// end-of-turn tokens, llama2 otherwise (that format needs only BOS and EOS).
inline ChatFormat chat_format_for(const Tokenizer& tok) {
  for (std::string_view name : llama3_chat_specials)
    if (!tok.special_id(name)) return ChatFormat::llama2;
  return ChatFormat::llama3;
}

/// "auto" (chat_format_for) or a format's name.
inline ChatFormat resolve_chat_format(std::string_view name, const Tokenizer& tok, std::string_view what) {
  return name == "auto" ? chat_format_for(tok) : parse_chat_format(name, what);
}

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;
};

/// A conversation's ids and which of them a fine-tuned model learns to produce.
struct ChatTokens {
  std::vector<std::uint32_t> ids;
  std::vector<std::uint8_t> loss_mask;  // 1: an assistant reply's token
};

namespace detail {

/// The length of the UTF-8 white space character (Python's str.isspace) at the start
/// of `s`, or 0: \t \n \v \f \r, U+001C-U+001F, space, U+0085, U+00A0, U+1680,
/// U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000.
inline std::size_t space_at(std::string_view s) {
  if (s.empty()) return 0;
  const auto b = [&](std::size_t i) { return i < s.size() ? static_cast<unsigned char>(s[i]) : 0u; };
  const unsigned c0 = b(0);
  if ((c0 >= 0x09 && c0 <= 0x0D) || (c0 >= 0x1C && c0 <= 0x20)) return 1;
  if (c0 == 0xC2 && (b(1) == 0x85 || b(1) == 0xA0)) return 2;
  if (c0 == 0xE1 && b(1) == 0x9A && b(2) == 0x80) return 3;  // U+1680
  if (c0 == 0xE2 && b(1) == 0x80 && ((b(2) >= 0x80 && b(2) <= 0x8A) || b(2) == 0xA8 || b(2) == 0xA9 || b(2) == 0xAF))
    return 3;                                                  // U+2000-U+200A, U+2028, U+2029, U+202F
  if (c0 == 0xE2 && b(1) == 0x81 && b(2) == 0x9F) return 3;  // U+205F
  if (c0 == 0xE3 && b(1) == 0x80 && b(2) == 0x80) return 3;  // U+3000
  return 0;
}

/// The length of the white space character that ends `s`, or 0.
inline std::size_t space_before(std::string_view s) {
  for (std::size_t n = 1; n <= 3 && n <= s.size(); ++n)
    if (space_at(s.substr(s.size() - n)) == n) return n;
  return 0;
}

}  // namespace detail

/// Python's str.strip() (Jinja's trim) on UTF-8 text: white space off both ends.
inline std::string_view python_strip(std::string_view s) {
  while (std::size_t n = detail::space_at(s)) s.remove_prefix(n);
  while (std::size_t n = detail::space_before(s)) s.remove_suffix(n);
  return s;
}

namespace detail {

class ChatBuilder {
 public:
  explicit ChatBuilder(const Tokenizer& tok) : tok_(tok) {}

  void special(std::uint32_t id, bool learn) { push(id, learn); }

  /// The ids of `prompt + reply` as one piece; the reply's (those past the ids of
  /// `prompt` alone, where they agree) count when `learn`.
  void piece(std::string_view prompt, std::string_view reply, bool learn) {
    const std::string whole = std::string(prompt) + std::string(reply);
    const std::vector<std::uint32_t> ids = tok_.encode(whole, EncodeOptions{});
    std::size_t shared = 0;
    if (learn) {
      const std::vector<std::uint32_t> alone = tok_.encode(prompt, EncodeOptions{});
      while (shared < alone.size() && shared < ids.size() && alone[shared] == ids[shared]) ++shared;
    }
    for (std::size_t i = 0; i < ids.size(); ++i) push(ids[i], learn && i >= shared);
  }

  ChatTokens take() { return std::move(out_); }

 private:
  void push(std::uint32_t id, bool learn) {
    out_.ids.push_back(id);
    out_.loss_mask.push_back(learn ? 1 : 0);
  }

  const Tokenizer& tok_;
  ChatTokens out_;
};

}  // namespace detail

/// The ids of `messages` in `format`, with the loss mask. With
/// `add_generation_prompt` (a prompt to answer), what opens the assistant's next turn
/// follows: Llama 3's assistant header; Llama 2's conversation must then end with a
/// user turn, whose " [/INST]" already asks for the answer. `where` ("chat.jsonl:7")
/// starts every error message.
inline ChatTokens chat_tokens(ChatFormat format, const Tokenizer& tok, std::span<const ChatMessage> messages,
                              std::string_view where, bool add_generation_prompt = false) {
  TESSERA_CHECK(!messages.empty(), where, ": the conversation has no messages");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    TESSERA_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", where, ": message ", i + 1,
                  " has role '", m.role, "' (a chat's roles are system, user and assistant)");
    TESSERA_CHECK(m.role != "assistant" || !python_strip(m.content).empty(), where, ": message ", i + 1,
                  " is an empty assistant turn (nothing to learn)");
  }
  detail::ChatBuilder out(tok);
  if (format == ChatFormat::llama3) {
    std::uint32_t special[3];
    for (int k = 0; k < 3; ++k) {
      const auto id = tok.special_id(llama3_chat_specials[k]);
      TESSERA_CHECK(id.has_value(), where, ": chat format llama3 needs the special token ", llama3_chat_specials[k],
                    ", which the ", tok.kind(), " tokenizer lacks (chat format llama2 needs only BOS and EOS)");
      special[k] = *id;
    }
    out.special(tok.bos_id(), false);
    for (const ChatMessage& m : messages) {
      const bool reply = m.role == "assistant";
      out.special(special[0], false);
      out.piece(m.role, "", false);
      out.special(special[1], false);
      out.piece("\n\n", python_strip(m.content), reply);
      out.special(special[2], reply);
    }
    if (add_generation_prompt) {
      out.special(special[0], false);
      out.piece("assistant", "", false);
      out.special(special[1], false);
      out.piece("\n\n", "", false);
    }
    return out.take();
  }
  // Llama 2.
  std::size_t first = 0;
  std::string system;
  if (messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  std::string user;  // the open [INST] piece, waiting for its reply
  bool open = false;
  for (std::size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool user_turn = (i - first) % 2 == 0;
    TESSERA_CHECK((m.role == "user") == user_turn && m.role != "system", where, ": message ", i + 1, " has role '",
                  m.role, "': chat format llama2 takes a system message only first, then user and assistant in turn",
                  " starting with user");
    if (user_turn) {
      std::string content = m.content;
      if (i == first && first == 1) content = tessera::detail::concat("<<SYS>>\n", system, "\n<</SYS>>\n\n", content);
      user = tessera::detail::concat("[INST] ", python_strip(content), " [/INST]");
      out.special(tok.bos_id(), false);
      open = true;
    } else {
      out.piece(user, tessera::detail::concat(" ", python_strip(m.content), " "), true);
      out.special(tok.eos_id(), true);
      open = false;
    }
  }
  if (open) out.piece(user, "", false);
  TESSERA_CHECK(!add_generation_prompt || open, where,
                ": chat format llama2 answers a conversation that ends with a user message");
  ChatTokens t = out.take();
  TESSERA_CHECK(!t.ids.empty(), where, ": the conversation has no user or assistant message");
  return t;
}

/// The messages of one JSON line {"messages": [{"role": ..., "content": ...}, ...]};
/// errors name `name`:`line`.
inline std::vector<ChatMessage> parse_chat_line(std::string_view json_line, std::string_view name, std::uint64_t line) {
  const std::string where = tessera::detail::concat(name, ":", line);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_line.begin(), json_line.end());
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range: a number past a double
    fail(where, ": not a JSON object (", e.what(), ")");
  }
  TESSERA_CHECK(j.is_object(), where, ": not a JSON object");
  const auto it = j.find("messages");
  TESSERA_CHECK(it != j.end(), where, ": no \"messages\" field (a chat line is {\"messages\": [{\"role\": ..., ",
                "\"content\": ...}, ...]})");
  TESSERA_CHECK(it->is_array(), where, ": \"messages\" is not an array");
  std::vector<ChatMessage> messages;
  for (std::size_t i = 0; i < it->size(); ++i) {
    const nlohmann::json& m = (*it)[i];
    TESSERA_CHECK(m.is_object(), where, ": message ", i + 1, " is not an object");
    const auto role = m.find("role");
    const auto content = m.find("content");
    TESSERA_CHECK(role != m.end() && role->is_string(), where, ": message ", i + 1, " has no string \"role\"");
    TESSERA_CHECK(content != m.end() && content->is_string(), where, ": message ", i + 1,
                  " has no string \"content\"");
    messages.push_back({role->get<std::string>(), content->get<std::string>()});
  }
  return messages;
}

}  // namespace tessera::io
