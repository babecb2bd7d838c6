// Picks a tokenizer from a config value: a built-in name, a file or a directory.
//
//   "byte"         the byte tokenizer (io/tokenizer.hpp)
//   a directory    the first of tokenizer.model, tokenizer.json, original/tokenizer.model
//                  (the layouts of Hugging Face's Llama repositories), read as a file below
//   a file         sniffed by content, since Llama 2 and Llama 3 both name theirs
//                  tokenizer.model: text whose first line is "<base64> <rank>" is a
//                  tiktoken rank file (Llama 3, io/tiktoken.hpp); bytes that start like
//                  a SentencePiece ModelProto (field 1, the pieces: 0x0A) are a
//                  SentencePiece model (Llama 2, io/sentencepiece.hpp); text that starts
//                  (after white space) with '{' is a Hugging Face tokenizer.json
//                  (byte-level BPE, io/hf_tokenizer.hpp; tokenizer_config.json beside
//                  it gives the EOS)
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include "tessera/core/error.hpp"
#include "tessera/io/hf_tokenizer.hpp"
#include "tessera/io/sentencepiece.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::io {

namespace detail {

/// Whether `bytes` begins with a tiktoken rank line: base64 characters (and '='), one
/// space, decimal digits, then a line end or the end of the text.
inline bool looks_like_tiktoken(std::string_view bytes) {
  std::size_t i = 0;
  while (i < bytes.size() && (base64_value(bytes[i]) >= 0 || bytes[i] == '=')) ++i;
  if (i == 0 || i >= bytes.size() || bytes[i] != ' ') return false;
  const std::size_t digits = ++i;
  while (i < bytes.size() && bytes[i] >= '0' && bytes[i] <= '9') ++i;
  if (i == digits) return false;
  return i == bytes.size() || bytes[i] == '\n' || bytes[i] == '\r';
}

/// Whether `bytes` begins like a serialized SentencePiece ModelProto: its first field
/// is `pieces` (field 1, length-delimited), tag byte 0x0A.
inline bool looks_like_sentencepiece(std::string_view bytes) {
  return !bytes.empty() && static_cast<unsigned char>(bytes[0]) == 0x0A;
}

/// Whether `bytes` begins like a JSON object: white space, then '{'.
inline bool looks_like_json_object(std::string_view bytes) {
  const std::size_t i = bytes.find_first_not_of(" \t\r\n");
  return i != std::string_view::npos && bytes[i] == '{';
}

/// The tokenizer in the file at `path`, by its content.
inline std::unique_ptr<Tokenizer> load_tokenizer_file(const std::string& path, std::string_view spec) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.is_open(), "tokenizer '", spec, "': cannot open '", path, "' for reading");
  std::ostringstream content;
  content << in.rdbuf();
  TESSERA_CHECK(!in.bad(), "tokenizer '", spec, "': read error on '", path, "'");
  const std::string bytes = content.str();
  if (looks_like_tiktoken(bytes)) return std::make_unique<TiktokenTokenizer>(TiktokenTokenizer::parse(bytes, path));
  if (looks_like_sentencepiece(bytes))
    return std::make_unique<SentencePieceTokenizer>(SentencePieceTokenizer::parse(bytes, path));
  if (looks_like_json_object(bytes)) return std::make_unique<HfTokenizer>(HfTokenizer::parse_beside_config(bytes, path));
  fail("tokenizer '", spec, "': '", path, "' is ", bytes.empty() ? "empty" : "not a tokenizer file",
       "; expected a tiktoken rank file (lines of '<base64> <rank>', Llama 3), a SentencePiece model (Llama 2) "
       "or a Hugging Face tokenizer.json (byte-level BPE)");
}

}  // namespace detail

/// The file a tokenizer spec reads: the file itself, or a directory's tokenizer.model
/// (else tokenizer.json, else original/tokenizer.model); "" for the built-in "byte".
/// Throws naming `spec` when there is no such file.
inline std::string tokenizer_file(std::string_view spec) {
  if (spec == "byte") return "";
  const std::filesystem::path path{std::string(spec)};
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  TESSERA_CHECK(!spec.empty() && std::filesystem::exists(status), "tokenizer '", spec,
                "': not a built-in tokenizer (\"byte\") and no such file or directory");
  if (std::filesystem::is_directory(status)) {
    for (const char* name : {"tokenizer.model", "tokenizer.json", "original/tokenizer.model"}) {
      const std::filesystem::path candidate = path / name;
      if (std::filesystem::is_regular_file(candidate, ec)) return candidate.string();
    }
    fail("tokenizer '", spec, "': the directory has none of tokenizer.model, tokenizer.json, original/tokenizer.model");
  }
  TESSERA_CHECK(std::filesystem::is_regular_file(status), "tokenizer '", spec, "': not a regular file or directory");
  return path.string();
}

/// The tokenizer `spec` names. Throws naming `spec` when it is neither a built-in name
/// nor a readable tokenizer file or directory.
inline std::unique_ptr<Tokenizer> load_tokenizer(std::string_view spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  return detail::load_tokenizer_file(tokenizer_file(spec), spec);
}

}  // namespace tessera::io
