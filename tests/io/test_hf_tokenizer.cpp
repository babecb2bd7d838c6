// Hugging Face tokenizer.json (byte-level BPE): the ids `tokenizers` gave for the corpus
// (tests/fixtures/tokenizers/hf_ids.json, written by tools/make_fixtures.py --only
// tokenizer_json) for every vocabulary, decode round trips, loading by file and
// directory, and every kind of bad input with its message.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/checkpoint/hf.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/io/hf_tokenizer.hpp"
#include "tessera/io/load_tokenizer.hpp"
#include "tessera/io/sentencepiece.hpp"

#ifndef TESSERA_FIXTURES
#error "TESSERA_FIXTURES must name the tests/fixtures folder (tests/io/meson.build defines it)"
#endif

namespace test_hf_tokenizer {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
namespace io = tessera::io;
using Ids = std::vector<std::uint32_t>;
using nlohmann::json;
using tessera::test::TempDir;

fs::path fixture(const std::string& name) { return fs::path(TESSERA_FIXTURES) / "tokenizers" / name; }

json read_json(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.is_open(), "cannot open ", path.string());
  return json::parse(in);
}

std::vector<std::string> corpus() {
  std::vector<std::string> texts = read_json(fixture("corpus.json")).get<std::vector<std::string>>();
  for (const std::string& s : read_json(fixture("hf_corpus.json")).get<std::vector<std::string>>()) texts.push_back(s);
  return texts;
}

std::string write_file(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

/// A small valid byte-level tokenizer.json: the 256 bytes (ids 0..255, in byte order),
/// "ab" (256) from the merge "a b", and <|begin_of_text|> / <|end_of_text|> (257, 258).
json small_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[io::detail::to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  vocab["ab"] = 256;
  json added = json::array();
  for (auto [name, id] : {std::pair{"<|begin_of_text|>", 257}, std::pair{"<|end_of_text|>", 258}})
    added.push_back({{"id", id},
                     {"content", name},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  return {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"},
               {"pattern", {{"Regex", std::string(io::llama3_split_pattern)}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", true},
        {"vocab", vocab},
        {"merges", json::array({"a b"})}}}};
}

io::HfTokenizer parse(const json& j) { return io::HfTokenizer::parse(j.dump(), "test/tokenizer.json"); }

}  // namespace

TEST_CASE("tokenizer.json: the ids `tokenizers` gives, for every fixture vocabulary and corpus string") {
  const std::vector<std::string> texts = corpus();
  const json ref = read_json(fixture("hf_ids.json"));
  for (const std::string name : {"hf_llama3", "hf_trained", "hf_gpt2"}) {
    CAPTURE(name);
    const json& r = ref.at(name);
    const auto& encodings = r.at("encodings");
    REQUIRE(encodings.size() == texts.size());
    const auto tok = io::HfTokenizer::load(fixture(name + "/tokenizer.json").string());
    CHECK(tok.kind() == "tokenizer.json");
    CHECK(tok.vocab_size() == r.at("vocab_size").get<std::int64_t>());
    CHECK(tok.bos_id() == r.at("bos").get<std::uint32_t>());
    std::size_t merged = 0, specials = 0;
    for (std::size_t i = 0; i < texts.size(); ++i) {
      const std::string& s = texts[i];
      CAPTURE(i);
      CAPTURE(s);
      const Ids ordinary = encodings[i].at("ordinary").get<Ids>();
      const Ids allowed =
          encodings[i].contains("allow_special") ? encodings[i].at("allow_special").get<Ids>() : ordinary;
      const Ids got = tok.encode(s, io::EncodeOptions{.bos = false, .eos = false, .allow_special = false});
      CHECK(got == ordinary);
      CHECK(tok.encode(s, io::EncodeOptions{.bos = false, .eos = false, .allow_special = true}) == allowed);
      const std::string decoded = encodings[i].contains("decoded") ? encodings[i].at("decoded").get<std::string>() : s;
      CHECK(tok.decode(got) == decoded);
      merged += ordinary.size() < s.size();
      specials += allowed != ordinary;
    }
    CHECK(merged > texts.size() / 2);
    CHECK(specials >= 2);
    const Ids with = tok.encode("a", true, true);
    CHECK(with.front() == tok.bos_id());
    CHECK(with.back() == tok.eos_id());
  }
}

TEST_CASE("tokenizer.json: the Llama 3 conversion of a tiktoken file gives tiktoken's ids") {
  const auto hf = io::HfTokenizer::load(fixture("hf_llama3/tokenizer.json").string());
  const auto tt = io::TiktokenTokenizer::load(fixture("bpe.tiktoken").string());
  CHECK(hf.vocab_size() == tt.vocab_size());
  CHECK(hf.bos_id() == tt.bos_id());
  CHECK(hf.eos_id() == tt.eos_id());  // tokenizer_config.json: <|end_of_text|>
  CHECK(hf.special_id("<|eot_id|>") == tt.special_id("<|eot_id|>"));
  CHECK_FALSE(hf.special_id("a").has_value());
  for (const std::string& s : corpus()) {
    CAPTURE(s);
    for (bool allow : {false, true}) {
      const io::EncodeOptions o{.bos = true, .eos = true, .allow_special = allow};
      CHECK(hf.encode(s, o) == tt.encode(s, o));
    }
  }
  for (std::uint32_t id : {0u, 97u, 300u, tt.bos_id(), tt.eos_id() + 8}) CHECK(hf.token_text(id) == tt.token_text(id));
  // Bytes that are not UTF-8 (tokenizers never sees them: Python strings are Unicode)
  // take the tiktoken reader's path: pieces of their own, every byte a token.
  std::mt19937 rng(5);
  for (int k = 0; k < 300; ++k) {
    std::string s;
    for (std::size_t n = rng() % 40; n > 0; --n)
      s.push_back(static_cast<char>(rng() % 3 == 0 ? rng() % 256 : 'a' + rng() % 26));
    CHECK(hf.encode(s, false, false) == tt.encode(s, false, false));
    CHECK(hf.decode(hf.encode(s, true, true)) == s);
  }
}

TEST_CASE("tokenizer.json: a tiktoken file converted as transformers converts it") {
  const auto tt = io::TiktokenTokenizer::load(fixture("bpe.tiktoken").string());
  const std::string text = io::tiktoken_tokenizer_json(tt);
  // The fixture is transformers' conversion, saved by `tokenizers`: the same JSON.
  CHECK(json::parse(text) == read_json(fixture("hf_llama3/tokenizer.json")));
  const auto hf = io::HfTokenizer::parse(text, "converted");
  CHECK(hf.json() == text);
  CHECK(hf.eos_id() == tt.eos_id());  // <|end_of_text|>, with no tokenizer_config.json
  for (const std::string& s : corpus()) CHECK(hf.encode(s, true, true) == tt.encode(s, true, true));
}

TEST_CASE("tokenizer.json: byte-level alphabet, patterns, added tokens, decode") {
  for (int b = 0; b < 256; ++b) {
    const std::string byte(1, static_cast<char>(b));
    CHECK(io::detail::from_byte_level(io::detail::to_byte_level(byte)) == byte);
  }
  CHECK(io::detail::to_byte_level(" a\n") ==
        "\xC4\xA0"
        "a"
        "\xC4\x8A");  // Ġ a Ċ
  CHECK_FALSE(io::detail::from_byte_level(" ").has_value());
  // tiktoken's spelling of Llama 3's pattern becomes the PCRE2 one the tiktoken reader uses.
  CHECK(io::detail::pcre2_pattern_from_onig(io::llama3_split_pattern) == io::llama3_pcre2_pattern);
  CHECK(io::detail::pcre2_pattern_from_onig(R"([\s\]]\\s)") ==
        R"([\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\]]\\s)");

  const auto tok = io::HfTokenizer::load(fixture("hf_trained/tokenizer.json").string());
  const std::uint32_t tessera_id = 520;
  CHECK(tok.token_text(tessera_id) == "tessera");
  CHECK_FALSE(tok.is_special(tessera_id));
  CHECK(tok.is_special(0));
  CHECK(tok.token_text(0) == "<|begin_of_text|>");
  const Ids the = tok.encode(" the", false, false);
  REQUIRE(the.size() == 1);
  CHECK(tok.token_name(the[0]) == "\xC4\xA0the");  // the file's string keeps its Ġ
  CHECK(tok.token_text(the[0]) == " the");
  // Non-special added tokens are matched always, special ones only when allowed.
  const Ids ids = tok.encode("xtessera<|eot_id|>", false, false);
  CHECK(std::count(ids.begin(), ids.end(), tessera_id) == 1);
  CHECK(std::count(ids.begin(), ids.end(), 2u) == 0);
  CHECK(tok.encode("<|eot_id|>", io::EncodeOptions{.allow_special = true}) == Ids{2});
  // decode skips special tokens; ids outside the vocabulary name their position.
  CHECK(tok.decode(Ids{0, tessera_id, 1}) == "tessera");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{1, 523}), "token id 523 at position 1 is outside the vocabulary of 523");
  CHECK_ERROR_CONTAINS(tok.token_text(9999), "token id 9999 is outside the vocabulary of 523");
  // EOS without a tokenizer_config.json: <|end_of_text|> is in the vocabulary.
  CHECK(tok.eos_id() == 1);
  // hf_gpt2: EOS from tokenizer_config.json's {"content": ...} form.
  const auto gpt2 = io::HfTokenizer::load(fixture("hf_gpt2/tokenizer.json").string());
  CHECK(gpt2.token_text(gpt2.eos_id()) == "</s>");
  CHECK(gpt2.token_text(gpt2.bos_id()) == "<s>");

  // The small tokenizer: ignore_merges, merges, copies share the tables.
  const auto small = parse(small_tokenizer());
  CHECK(small.vocab_size() == 259);
  CHECK(small.encode("ab abab", false, false) == Ids{256, 32, 256, 256});  // pieces "ab", " abab"
  CHECK(small.encode("abab", false, false) == Ids{256, 256});
  const io::HfTokenizer copy = small;
  CHECK(copy.encode("ab", true, true) == Ids{257, 256, 258});
}

TEST_CASE("tokenizer.json: bad input, one line naming the file and the key") {
  const std::string file = "tokenizer.json 'test/tokenizer.json': ";
  CHECK_ERROR_CONTAINS(io::HfTokenizer::parse("{\"model\": ", "test/tokenizer.json"), file + "not JSON");
  CHECK_ERROR_CONTAINS(io::HfTokenizer::parse("[1, 2]", "test/tokenizer.json"), file + "not a JSON object");
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    json j = small_tokenizer();
    j["model"]["type"] = type;
    CHECK_ERROR_CONTAINS(parse(j), file + "model.type: \"" + type + "\" is not read; tessera reads byte-level BPE");
  }
  {  // Llama 2's tokenizer.json: Metaspace or Prepend + Replace, byte fallback.
    json j = small_tokenizer();
    j["model"]["byte_fallback"] = true;
    CHECK_ERROR_CONTAINS(
        parse(j), file + "model.byte_fallback: true: this is SentencePiece-style BPE (Llama 2): use tokenizer.model");
    j = small_tokenizer();
    j["normalizer"] = {
        {"type", "Sequence"},
        {"normalizers",
         json::array({{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
                      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}})}};
    CHECK_ERROR_CONTAINS(
        parse(j), file + "normalizer: \"Sequence\": this is SentencePiece-style BPE (Llama 2): use tokenizer.model");
    j = small_tokenizer();
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}};
    CHECK_ERROR_CONTAINS(parse(j), file + "pre_tokenizer: \"Metaspace\": this is SentencePiece-style BPE (Llama 2)");
    j = small_tokenizer();
    j["normalizer"] = {{"type", "NFC"}};
    CHECK_ERROR_CONTAINS(parse(j), file + "normalizer: \"NFC\" is not read");
    j = small_tokenizer();
    j["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Digits"}, {"individual_digits", true}};
    CHECK_ERROR_CONTAINS(parse(j), file + "pre_tokenizer.pretokenizers[0]: \"Digits\" is not read");
    j = small_tokenizer();
    j["decoder"] = {{"type", "WordPiece"}};
    CHECK_ERROR_CONTAINS(parse(j), file + "decoder: \"WordPiece\" is not read");
  }
  {  // A pattern PCRE2 cannot compile.
    json j = small_tokenizer();
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(ab";
    CHECK_ERROR_CONTAINS(parse(j),
                         file + "pre_tokenizer.pretokenizers[0].pattern.Regex: '(ab' is not a pattern PCRE2 reads");
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[^\\S]";
    CHECK_ERROR_CONTAINS(parse(j), "\\S inside a character class");
    j = small_tokenizer();
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
    CHECK_ERROR_CONTAINS(parse(j), file + "pre_tokenizer.pretokenizers[0].behavior: \"Removed\" is not read");
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 3;  // not a string: named, not nlohmann's type_error
    CHECK_ERROR_CONTAINS(parse(j), file + "pre_tokenizer.pretokenizers[0].behavior: \"3\" is not read");
    j = small_tokenizer();
    j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true;
    CHECK_ERROR_CONTAINS(parse(j), file + "pre_tokenizer.pretokenizers[1].add_prefix_space: true is not read");
  }
  {  // Merges and ids.
    json j = small_tokenizer();
    j["model"]["merges"].push_back("a zz");
    CHECK_ERROR_CONTAINS(parse(j), file + "model.merges[1]: 'a zz' names 'zz', which is not in model.vocab");
    j = small_tokenizer();
    j["model"]["merges"].push_back(json::array({"b", "a"}));
    CHECK_ERROR_CONTAINS(parse(j), file + "model.merges[1]: 'b a' names 'ba', which is not in model.vocab");
    j = small_tokenizer();
    j["model"]["merges"].push_back("a b c");
    CHECK_ERROR_CONTAINS(parse(j), file + "model.merges[1]: 'a b c' is not two tokens separated by one space");
    j = small_tokenizer();
    j["model"]["vocab"]["xy"] = 97;
    CHECK_ERROR_CONTAINS(parse(j), file + "model.vocab: id 97 is given twice");
    j = small_tokenizer();
    j["added_tokens"][0]["id"] = 256;
    CHECK_ERROR_CONTAINS(parse(j), file + "added_tokens: id 256 is given twice ('ab' and '<|begin_of_text|>')");
    j = small_tokenizer();
    j["added_tokens"][1]["id"] = 300;
    CHECK_ERROR_CONTAINS(
        parse(j), file + "ids must run 0..300 without gaps between model.vocab and added_tokens (id 258 is missing)");
    j = small_tokenizer();
    j["model"]["vocab"].erase("a");
    j["model"]["vocab"]["zz"] = 97;
    CHECK_ERROR_CONTAINS(parse(j), file + "model.vocab: the byte a (byte-level 'a') is not a token");
    j = small_tokenizer();
    j["added_tokens"][0]["lstrip"] = true;
    CHECK_ERROR_CONTAINS(parse(j), file + "added_tokens: '<|begin_of_text|>' has lstrip true, which is not read");
    j = small_tokenizer();
    j["added_tokens"][1]["content"] = "ab";
    CHECK_ERROR_CONTAINS(parse(j), file + "added_tokens: 'ab' has id 258 but is already token 256");
  }
  {  // BOS and EOS.
    json j = small_tokenizer();
    j["added_tokens"][1]["content"] = "<|eot_id|>";
    CHECK_ERROR_CONTAINS(parse(j), file + "no EOS token");
    CHECK(io::HfTokenizer::parse(j.dump(), "t", std::string_view(R"({"eos_token": "<|eot_id|>"})"), "c").eos_id() ==
          258);
    CHECK_ERROR_CONTAINS(
        io::HfTokenizer::parse(j.dump(), "t", std::string_view(R"({"eos_token": "</s>"})"), "c/tokenizer_config.json"),
        "tokenizer_config.json 'c/tokenizer_config.json': eos_token: '</s>' is not a token of 't'");
    CHECK_ERROR_CONTAINS(io::HfTokenizer::parse(j.dump(), "t", std::string_view("{"), "c/tokenizer_config.json"),
                         "tokenizer_config.json 'c/tokenizer_config.json': not JSON");
  }
  {  // The post-processor's BOS: its one id must be a token (fuzz_hf_tokenizer's finding: it was BOS unchecked).
    json j = small_tokenizer();
    const auto processor = [&j](json id) {
      j["post_processor"] = {
          {"type", "TemplateProcessing"},
          {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
          {"special_tokens", {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", json::array({id})}}}}}};
    };
    processor(257);
    CHECK(parse(j).bos_id() == 257);
    processor(259);
    CHECK_ERROR_CONTAINS(parse(j), file + "post_processor.special_tokens: the BOS token's id 259 is outside the "
                                          "vocabulary of 259");
    j["post_processor"]["type"] = 5;  // not a string: no template, so the BOS is found by name
    CHECK(parse(j).bos_id() == 257);
    processor(-1);
    CHECK_ERROR_CONTAINS(parse(j), file + "post_processor.special_tokens: '<|begin_of_text|>' has not exactly one id");
  }
}

TEST_CASE("load_tokenizer: tokenizer.json files and directories") {
  TempDir tmp("hf_tokenizer");
  const std::string json_text = [] {
    std::ifstream in(fixture("hf_trained/tokenizer.json"));
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }();
  // A file sniffed as JSON, whatever its name.
  const std::string file = write_file(tmp.path / "any.name", json_text);
  CHECK(io::load_tokenizer(file)->kind() == "tokenizer.json");
  // A directory with only tokenizer.json.
  write_file(tmp.path / "hf" / "tokenizer.json", json_text);
  CHECK(io::load_tokenizer((tmp.path / "hf").string())->kind() == "tokenizer.json");
  CHECK(io::tokenizer_file((tmp.path / "hf").string()) == (tmp.path / "hf" / "tokenizer.json").string());
  // tokenizer.model comes first, then tokenizer.json, then original/tokenizer.model.
  fs::create_directories(tmp.path / "hf" / "original");
  fs::copy_file(fixture("sp.model"), tmp.path / "hf" / "original" / "tokenizer.model");
  CHECK(io::load_tokenizer((tmp.path / "hf").string())->kind() == "tokenizer.json");
  fs::copy_file(fixture("bpe.tiktoken"), tmp.path / "hf" / "tokenizer.model");
  CHECK(io::load_tokenizer((tmp.path / "hf").string())->kind() == "tiktoken");
  // An empty directory: the message lists what was looked for.
  fs::create_directories(tmp.path / "empty");
  CHECK_ERROR_CONTAINS(io::load_tokenizer((tmp.path / "empty").string()),
                       "the directory has none of tokenizer.model, tokenizer.json, original/tokenizer.model");
  // A JSON file that is not a tokenizer.
  CHECK_ERROR_CONTAINS(io::load_tokenizer(write_file(tmp.path / "x.json", "{\"model\": {\"type\": \"Unigram\"}}")),
                       "model.type: \"Unigram\" is not read");
}

TEST_CASE("write_hf_tokenizer: the files transformers reads, for each kind of tokenizer") {
  // tests/io/check_hf_export.py loads them with transformers itself where it is installed;
  // here, what is written and that tessera reads it back the same.
  TempDir tmp("hf_tokenizer_export");
  const std::vector<std::string> texts = corpus();
  struct Case {
    std::string source;
    std::vector<std::string> files;
    std::string tokenizer_class;
    bool llama3_template;
  };
  const std::vector<Case> cases = {
      {"bpe.tiktoken", {"tokenizer.model", "tokenizer.json"}, "PreTrainedTokenizerFast", true},
      {"sp.model", {"tokenizer.model"}, "SentencePieceBackend", false},
      {"hf_llama3/tokenizer.json", {"tokenizer.json"}, "PreTrainedTokenizerFast", true},
      {"hf_gpt2/tokenizer.json", {"tokenizer.json"}, "PreTrainedTokenizerFast", false},
  };
  for (const Case& c : cases) {
    CAPTURE(c.source);
    const fs::path dir = tmp.path / fs::path(c.source).parent_path() / fs::path(c.source).filename().stem();
    fs::create_directories(dir);
    tessera::train::write_hf_tokenizer(fixture(c.source).string(), dir, 4096);
    for (const std::string& f : c.files) CHECK(fs::exists(dir / f));
    CHECK(fs::exists(dir / "tokenizer.json") == (c.files.back() == "tokenizer.json"));
    const json config = read_json(dir / "tokenizer_config.json");
    const auto original = io::load_tokenizer(fixture(c.source).string());
    CHECK(config.at("tokenizer_class") == c.tokenizer_class);
    CHECK(config.at("bos_token") == original->token_text(original->bos_id()));
    CHECK(config.at("eos_token") == original->token_text(original->eos_id()));
    CHECK(config.at("model_max_length") == 4096);
    CHECK(config.at("clean_up_tokenization_spaces") == false);
    CHECK(config.at("added_tokens_decoder").at(std::to_string(original->bos_id())).at("special") == true);
    CHECK(config.at("chat_template") == (c.llama3_template ? io::llama3_chat_template : io::llama2_chat_template));
    // The directory, read back by tessera, encodes as the original (tokenizer.model first).
    const auto back = io::load_tokenizer(dir.string());
    CHECK(back->vocab_size() == original->vocab_size());
    CHECK(back->eos_id() == original->eos_id());
    for (const std::string& s : texts) CHECK(back->encode(s, true, true) == original->encode(s, true, true));
    if (c.files.size() == 2) {  // tiktoken: its tokenizer.json reads back to the same ids too
      const auto converted = io::HfTokenizer::load((dir / "tokenizer.json").string());
      for (const std::string& s : texts) CHECK(converted.encode(s, true, true) == original->encode(s, true, true));
    }
  }
}

TEST_CASE("save_tokenizer_file: a tokenizer.json brings its tokenizer_config.json along") {
  TempDir tmp("hf_tokenizer_copy");
  const std::string dest = (tmp.path / "run" / "tokenizer.model").string();
  fs::create_directories(tmp.path / "run");
  CHECK(tessera::data::save_tokenizer_file(fixture("hf_gpt2").string(), dest));
  CHECK(fs::exists(tmp.path / "run" / "tokenizer_config.json"));
  const auto copy = io::load_tokenizer(dest);
  const auto original = io::load_tokenizer(fixture("hf_gpt2").string());
  CHECK(copy->kind() == "tokenizer.json");
  CHECK(copy->eos_id() == original->eos_id());  // </s>, from the config beside it
  // Other tokenizers bring nothing else.
  const std::string dest2 = (tmp.path / "run2" / "tokenizer.model").string();
  fs::create_directories(tmp.path / "run2");
  CHECK(tessera::data::save_tokenizer_file(fixture("bpe.tiktoken").string(), dest2));
  CHECK_FALSE(fs::exists(tmp.path / "run2" / "tokenizer_config.json"));
}

}  // namespace test_hf_tokenizer
