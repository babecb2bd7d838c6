// Tokenizers by the names a config uses: io::load_tokenizer's ("byte", a tokenizer file,
// a Hugging Face directory) plus "synthetic_bpe", the embedded corpus's own vocabulary,
// which lives in data/ because it is trained on that corpus. The binaries and the
// trainer resolve model.tokenizer here.
#pragma once

#include <cctype>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>

#include "tessera/core/error.hpp"
#include "tessera/data/synthetic_bpe.hpp"
#include "tessera/io/load_tokenizer.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::data {

/// The tokenizer model.tokenizer names: "synthetic_bpe" (the embedded corpus's own BPE
/// vocabulary, data/synthetic_bpe.hpp) or anything io::load_tokenizer takes.
inline std::unique_ptr<io::Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "synthetic_bpe") return std::make_unique<io::TiktokenTokenizer>(data::synthetic_bpe_tokenizer());
  return io::load_tokenizer(spec);
}

/// Writes the file of the tokenizer `spec` names to `dest`, so that a saved model
/// carries its tokenizer. Returns false, writing nothing, for "byte" (which has none).
/// A tokenizer.json brings the tokenizer_config.json beside it (its EOS) along, beside
/// `dest`; the copy is read back by content, whatever `dest` is called.
inline bool save_tokenizer_file(const std::string& spec, const std::string& dest) {
  namespace fs = std::filesystem;
  if (spec == "synthetic_bpe") {
    io::write_tiktoken(dest, data::synthetic_bpe_tokens());
    return true;
  }
  const std::string file = io::tokenizer_file(spec);
  if (file.empty()) return false;
  std::error_code ec;
  if (fs::exists(dest, ec) && fs::equivalent(file, dest, ec)) return true;
  const std::string tmp = dest + ".tmp";
  fs::copy_file(file, tmp, fs::copy_options::overwrite_existing, ec);
  if (!ec) fs::rename(tmp, dest, ec);
  if (ec) fail(dest, ": cannot copy the tokenizer ", file, " here: ", ec.message());
  const fs::path config = fs::path(file).parent_path() / "tokenizer_config.json";
  const fs::path config_dest = fs::path(dest).parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config, ec) && !fs::equivalent(config, config_dest, ec)) {
    std::ifstream in(file, std::ios::binary);
    char first = 0;
    while (in.get(first) && std::isspace(static_cast<unsigned char>(first))) {
    }
    if (first == '{') {
      fs::copy_file(config, config_dest, fs::copy_options::overwrite_existing, ec);
      if (ec) fail(config_dest.string(), ": cannot copy ", config.string(), " here: ", ec.message());
    }
  }
  return true;
}

}  // namespace tessera::data
