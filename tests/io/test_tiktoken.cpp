// Llama 3's pre-tokenizer and the tiktoken-format BPE tokenizer: pieces, merges by
// rank, special tokens, round trips, long inputs, threads, and every rank-file error.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tessera/io/pretokenize.hpp"
#include "tessera/io/tiktoken.hpp"

namespace test_tiktoken {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using tessera::io::TiktokenTokenizer;
using Ids = std::vector<std::uint32_t>;
using Pieces = std::vector<std::string_view>;

/// A rank file: the 256 single bytes (rank = byte), then `extra` from rank 256 on.
std::string rank_text(const std::vector<std::string>& extra) {
  std::string text;
  for (int b = 0; b < 256; ++b)
    text += tessera::io::detail::base64_encode(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  for (std::size_t i = 0; i < extra.size(); ++i)
    text += tessera::io::detail::base64_encode(extra[i]) + " " + std::to_string(256 + i) + "\n";
  return text;
}

TiktokenTokenizer tokenizer_with(const std::vector<std::string>& extra) {
  return TiktokenTokenizer::parse(rank_text(extra), "test.tiktoken");
}

Ids bytes_of(std::string_view s) {
  Ids ids;
  for (char c : s) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string random_bytes(std::mt19937& rng, std::size_t max_length) {
  static const std::vector<std::string> fragments = {
      "a", "Z", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "7", "123", "!", ".", "<|", "|>", "<|eot_id|>",
      "\xC3\xA9", "\xE4\xB8\xAD", "\xF0\x9F\x98\x80", "\xC2\x85", "\xE1\xA0\x8E", "\x80", "\xFF", "\xC3",
      "\xF0\x9F", "\xED\xA0\x80", "\xC0\xAF", "\xF4\x90\x80\x80", "the", " of"};
  std::string s;
  const std::size_t n = rng() % (max_length + 1);
  for (std::size_t k = 0; k < n; ++k) {
    if (rng() % 4 == 0) {
      s.push_back(static_cast<char>(rng() % 256));
    } else {
      s += fragments[rng() % fragments.size()];
    }
  }
  return s;
}

using tessera::test::TempDir;

}  // namespace

// ---------------------------------------------------------------- pre-tokenizer

TEST_CASE("pretokenize: Llama 3's pieces") {
  using tessera::io::pretokenize;
  // The pieces tiktoken gives with Llama 3's pattern.
  CHECK(pretokenize("Hello, world!") == Pieces{"Hello", ",", " world", "!"});
  CHECK(pretokenize("I'LL see you're here, he'S") ==
        Pieces{"I", "'LL", " see", " you", "'re", " here", ",", " he", "'S"});
  CHECK(pretokenize("1234567 89") == Pieces{"123", "456", "7", " ", "89"});
  CHECK(pretokenize("a   b") == Pieces{"a", "  ", " b"});
  CHECK(pretokenize("a\n\n  b") == Pieces{"a", "\n\n", " ", " b"});
  CHECK(pretokenize("x \t\ny") == Pieces{"x", " \t\n", "y"});
  CHECK(pretokenize("  leading") == Pieces{" ", " leading"});
  CHECK(pretokenize("trailing  ") == Pieces{"trailing", "  "});
  CHECK(pretokenize("\xE4\xB8\xAD\xE6\x96\x87 text") == Pieces{"\xE4\xB8\xAD\xE6\x96\x87", " text"});
  CHECK(pretokenize("$100.00!!") == Pieces{"$", "100", ".", "00", "!!"});
  // U+0085 is white space to tiktoken; U+180E is not (PCRE2's own \s would say it is).
  CHECK(pretokenize("a\xC2\x85\xC2\x85"
                    "b") == Pieces{"a", "\xC2\x85", "\xC2\x85"
                                                    "b"});
  CHECK(pretokenize("a\xE1\xA0\x8E\xE1\xA0\x8E"
                    "b") == Pieces{"a", "\xE1\xA0\x8E\xE1\xA0\x8E", "b"});
  CHECK(pretokenize("").empty());
}

TEST_CASE("pretokenize: invalid UTF-8 becomes pieces of its own, and the pieces always rebuild the text") {
  using tessera::io::pretokenize;
  CHECK(pretokenize("ab\xFF\xFE"
                    "cd") == Pieces{"ab", "\xFF\xFE", "cd"});
  CHECK(pretokenize("\x80") == Pieces{"\x80"});
  // A truncated character at the end and a surrogate encoding are invalid too.
  CHECK(pretokenize("hi \xE4\xB8") == Pieces{"hi", " ", "\xE4\xB8"});
  CHECK(pretokenize("x\xED\xA0\x80y") == Pieces{"x", "\xED\xA0\x80", "y"});

  const tessera::io::Pretokenizer interpreter(tessera::io::llama3_pcre2_pattern, /*use_jit=*/false);
  CHECK_FALSE(interpreter.jit());
  std::mt19937 rng(11);
  for (int i = 0; i < 20000; ++i) {
    const std::string text = random_bytes(rng, 24);
    const auto pieces = pretokenize(text);
    std::string joined;
    for (std::string_view p : pieces) {
      CHECK_FALSE(p.empty());
      joined += p;
    }
    REQUIRE(joined == text);
    // The JIT (when there is one) and the interpreter cut every text the same way.
    REQUIRE(interpreter.split(text) == pieces);
  }
}

TEST_CASE("pretokenize: long runs are single pieces and take linear time") {
  const tessera::io::Pretokenizer interpreter(tessera::io::llama3_pcre2_pattern, /*use_jit=*/false);
  const std::size_t n = 1 << 20;
  for (const tessera::io::Pretokenizer* p : {&tessera::io::llama3_pretokenizer(), &interpreter}) {
    CHECK(p->split(std::string(n, ' ')).size() == 1);
    CHECK(p->split(std::string(n, 'x')).size() == 1);
    CHECK(p->split(std::string(n, '\xFF')).size() == 1);
    CHECK(p->split(std::string(n - 1, ' ') + "a") == Pieces{std::string_view(std::string(n - 2, ' ')), " a"});
    // Many short pieces: each match must not rescan the rest of the text.
    std::string digits(300000, '7');
    CHECK(p->split(digits).size() == 100000);
    // More spaces before a letter than PCRE2's default limit of backtracking steps.
    const std::string spaces = std::string(11000000, ' ') + "x";
    const auto pieces = p->split(spaces);
    REQUIRE(pieces.size() == 2);
    CHECK(pieces[1] == " x");
  }
}

TEST_CASE("pretokenize: a pattern that does not compile names PCRE2's reason") {
  CHECK_ERROR_CONTAINS(tessera::io::Pretokenizer("(ab"), "pre-tokenizer pattern does not compile at offset 3");
  CHECK_ERROR_CONTAINS(tessera::io::Pretokenizer("(ab"), "missing closing parenthesis");
  // Characters a pattern does not match become pieces too.
  const tessera::io::Pretokenizer digits("[0-9]+");
  CHECK(digits.split("ab12c3") == Pieces{"ab", "12", "c", "3"});
}

TEST_CASE("pretokenize: threads share one compiled pattern") {
  std::mt19937 rng(3);
  std::vector<std::string> texts;
  for (int i = 0; i < 400; ++i) texts.push_back(random_bytes(rng, 60));
  std::vector<std::vector<Pieces>> results(4);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round)
        for (const std::string& text : texts) results[t].push_back(tessera::io::pretokenize(text));
    });
  for (auto& th : threads) th.join();
  for (std::size_t t = 0; t < results.size(); ++t) {
    REQUIRE(results[t].size() == 5 * texts.size());
    for (std::size_t i = 0; i < results[t].size(); ++i)
      REQUIRE(results[t][i] == tessera::io::pretokenize(texts[i % texts.size()]));
  }
}

// ---------------------------------------------------------------- base64 and merging

TEST_CASE("tiktoken: base64 as the rank file spells it") {
  using tessera::io::detail::base64_decode;
  using tessera::io::detail::base64_encode;
  CHECK(base64_encode("Man") == "TWFu");
  CHECK(base64_encode("Ma") == "TWE=");
  CHECK(base64_encode("M") == "TQ==");
  CHECK(base64_encode(std::string("\x00\xFF\xFE", 3)) == "AP/+");
  std::string out;
  CHECK(base64_decode("TWFu", out));
  CHECK(out == "Man");
  CHECK(base64_decode("TQ==", out));
  CHECK(out == "M");
  CHECK(base64_decode("AP/+", out));
  CHECK(out == std::string("\x00\xFF\xFE", 3));
  CHECK_FALSE(base64_decode("TQ=", out));    // length
  CHECK_FALSE(base64_decode("T=Q=", out));   // '=' inside
  CHECK_FALSE(base64_decode("TQ==TQ==", out));  // '=' before the end
  CHECK_FALSE(base64_decode("T-Q_", out));   // url-safe alphabet
  CHECK_FALSE(base64_decode("===A", out));
}

TEST_CASE("tiktoken: merges take the lowest rank first and the leftmost pair on ties") {
  SUBCASE("lower rank wins") {
    auto tok = tokenizer_with({"ab", "bc"});  // ab = 256, bc = 257
    CHECK(tok.encode("abc", false, false) == Ids{256, 'c'});
    auto tok2 = tokenizer_with({"bc", "ab"});  // bc = 256, ab = 257
    CHECK(tok2.encode("abc", false, false) == Ids{'a', 256});
  }
  SUBCASE("leftmost on ties") {
    auto tok = tokenizer_with({"aa"});
    CHECK(tok.encode("aaa", false, false) == Ids{256, 'a'});
    CHECK(tok.encode("aaaa", false, false) == Ids{256, 256});
  }
  SUBCASE("a pair merges when its concatenation has a rank, however it was built") {
    // "abc" is listed after "ab" and "bc"; the pieces meet as (a, bc) here.
    auto tok = tokenizer_with({"bc", "ab", "abc"});
    CHECK(tok.encode("abcd", false, false) == Ids{258, 'd'});
    CHECK(tok.encode("abc", false, false) == Ids{258});  // a whole piece that is a token
  }
  SUBCASE("no merge across pieces") {
    auto tok = tokenizer_with({"a ", " b", "ab"});
    // Pieces "a" and " b": "a " never forms.
    CHECK(tok.encode("a b", false, false) == Ids{'a', 257});
  }
  SUBCASE("unmergeable bytes stay single bytes") {
    auto tok = tokenizer_with({});
    CHECK(tok.encode("hi \xFF", false, false) == bytes_of("hi \xFF"));
  }
}

TEST_CASE("tiktoken: the heap merge gives the scan's result on random rank tables") {
  using tessera::io::detail::byte_pair_merge_heap;
  using tessera::io::detail::byte_pair_merge_scan;
  using tessera::io::detail::no_rank;
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    // Tokens over a 3-letter alphabet with random ranks: many ties and rivalries.
    std::unordered_map<std::string, std::uint32_t> ranks;
    for (int b = 0; b < 256; ++b) ranks[std::string(1, static_cast<char>(b))] = static_cast<std::uint32_t>(b);
    const int extra = 5 + static_cast<int>(rng() % 40);
    for (int i = 0; i < extra; ++i) {
      std::string t;
      const int len = 2 + static_cast<int>(rng() % 5);
      for (int k = 0; k < len; ++k) t.push_back("abc"[rng() % 3]);
      ranks.emplace(t, static_cast<std::uint32_t>(256 + rng() % 100));
    }
    const auto rank_of = [&](std::string_view s) {
      auto it = ranks.find(std::string(s));
      return it == ranks.end() ? no_rank : it->second;
    };
    std::string piece;
    const int n = 1 + static_cast<int>(rng() % 200);
    for (int k = 0; k < n; ++k) piece.push_back("abc"[rng() % 3]);
    std::vector<std::uint32_t> a(piece.size() + 1), b;
    for (std::uint32_t i = 0; i <= piece.size(); ++i) a[i] = i;
    b = a;
    byte_pair_merge_scan(piece, a, rank_of);
    byte_pair_merge_heap(piece, b, rank_of);
    REQUIRE(a == b);
  }
}

TEST_CASE("tiktoken: a piece of 100k spaces merges quickly") {
  auto tok = tokenizer_with({"  ", "    ", "        "});  // 2, 4 and 8 spaces
  const std::string spaces(100000, ' ');
  const Ids ids = tok.encode(spaces, false, false);
  REQUIRE(ids.size() == 100000 / 8);
  CHECK(std::all_of(ids.begin(), ids.end(), [](std::uint32_t id) { return id == 258; }));
  CHECK(tok.decode(ids) == spaces);
  // With one more space, one single space is left over.
  CHECK(tok.encode(spaces + " ", false, false).size() == 100000 / 8 + 1);
}

// ---------------------------------------------------------------- special tokens

TEST_CASE("tiktoken: Llama 3.1's special tokens follow the base tokens") {
  auto tok = tokenizer_with({"ab"});
  const std::uint32_t n = 257;
  CHECK(tok.kind() == "tiktoken");
  CHECK(tok.num_base_tokens() == n);
  CHECK(tok.vocab_size() == n + 256);
  CHECK(tok.bos_id() == n);
  CHECK(tok.eos_id() == n + 1);
  CHECK(tok.special_id("<|begin_of_text|>") == n);
  CHECK(tok.special_id("<|end_of_text|>") == n + 1);
  CHECK(tok.special_id("<|reserved_special_token_0|>") == n + 2);
  CHECK(tok.special_id("<|reserved_special_token_1|>") == n + 3);
  CHECK(tok.special_id("<|finetune_right_pad_id|>") == n + 4);
  CHECK(tok.special_id("<|reserved_special_token_2|>") == n + 5);
  CHECK(tok.special_id("<|start_header_id|>") == n + 6);
  CHECK(tok.special_id("<|end_header_id|>") == n + 7);
  CHECK(tok.special_id("<|eom_id|>") == n + 8);
  CHECK(tok.special_id("<|eot_id|>") == n + 9);
  CHECK(tok.special_id("<|python_tag|>") == n + 10);
  CHECK(tok.special_id("<|reserved_special_token_3|>") == n + 11);
  CHECK(tok.special_id("<|reserved_special_token_247|>") == n + 255);
  CHECK_FALSE(tok.special_id("<|reserved_special_token_248|>").has_value());
  CHECK_FALSE(tok.special_id("<|step_id|>").has_value());
  CHECK_FALSE(tok.special_id("ab").has_value());
  CHECK(tok.token_text(n + 9) == "<|eot_id|>");
  CHECK(tok.token_text(n + 255) == "<|reserved_special_token_247|>");
  CHECK(tok.token_text(256) == "ab");
  CHECK(tok.token_text('x') == "x");
  CHECK_ERROR_CONTAINS(tok.token_text(n + 256), "token id 513 is outside the vocabulary of 513");
  CHECK_ERROR_CONTAINS(tessera::io::llama3_special_token_name(256), "special token index 256");
}

TEST_CASE("tiktoken: special-token text is a token only with allow_special") {
  auto tok = tokenizer_with({});
  const std::uint32_t eot = *tok.special_id("<|eot_id|>");
  const std::uint32_t header = *tok.special_id("<|start_header_id|>");
  const std::string text = "hi<|eot_id|>";
  CHECK(tok.encode(text, tessera::io::EncodeOptions{false, false, false}) == bytes_of(text));
  CHECK(tok.encode(text, tessera::io::EncodeOptions{false, false, true}) == Ids{'h', 'i', eot});
  CHECK(tok.encode("<|start_header_id|>a<|eot_id|><|eot_id|>", tessera::io::EncodeOptions{true, true, true}) ==
        Ids{tok.bos_id(), header, 'a', eot, eot, tok.eos_id()});
  // A "<|" that does not start a special token is text; the next one may.
  CHECK(tok.encode("<|<|eot_id|>|>", tessera::io::EncodeOptions{false, false, true}) ==
        Ids{'<', '|', eot, '|', '>'});
  CHECK(tok.encode("<|reserved_special_token_248|>", tessera::io::EncodeOptions{false, false, true}) ==
        bytes_of("<|reserved_special_token_248|>"));
  CHECK(tok.encode("<|eot_id", tessera::io::EncodeOptions{false, false, true}) == bytes_of("<|eot_id"));
  // Text on either side of a special token is pre-tokenized on its own.
  auto merging = tokenizer_with({"ab"});
  CHECK(merging.encode("a<|eot_id|>b", tessera::io::EncodeOptions{false, false, true}) ==
        Ids{'a', *merging.special_id("<|eot_id|>"), 'b'});
  // Many "<|" without a closing "|>" stay linear.
  std::string opens;
  for (int i = 0; i < 50000; ++i) opens += "<|";
  CHECK(tok.encode(opens, tessera::io::EncodeOptions{false, false, true}).size() == opens.size());
}

TEST_CASE("tiktoken: decode gives raw bytes, skips specials and names a bad id's position") {
  auto tok = tokenizer_with({"ab", "\xE4\xB8"});
  CHECK(tok.decode(Ids{tok.bos_id(), 256, 'c', tok.eos_id(), *tok.special_id("<|eot_id|>")}) == "abc");
  // A token may hold part of a UTF-8 character; decode returns the bytes as they are.
  CHECK(tok.decode(Ids{257}) == "\xE4\xB8");
  CHECK(tok.decode(Ids{}).empty());
  CHECK_ERROR_CONTAINS(tok.decode(Ids{'a', 514}), "token id 514 at position 1 is outside the vocabulary of 514");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{4000000000u}), "token id 4000000000 at position 0");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{4000000000u}), "test.tiktoken");
}

TEST_CASE("tiktoken: any byte string round-trips, in one thread or many") {
  auto tok = tokenizer_with({"th", "the", " the", "in", "ing", "  ", "\xC3\xA9", "<|", "12", "123", "'s", "\n\n"});
  std::mt19937 rng(5);
  std::vector<std::string> texts;
  for (int i = 0; i < 3000; ++i) texts.push_back(random_bytes(rng, 40));
  std::vector<Ids> expected;
  for (const std::string& text : texts) {
    expected.push_back(tok.encode(text, false, false));
    REQUIRE(tok.decode(expected.back()) == text);
    for (std::uint32_t id : expected.back()) REQUIRE(id < tok.num_base_tokens());
    // With allow_special, special-token text becomes special ids, which decode skips;
    // their token_text is that text again.
    const Ids special = tok.encode(text, tessera::io::EncodeOptions{false, false, true});
    std::string rebuilt;
    for (std::uint32_t id : special) rebuilt += tok.token_text(id);
    REQUIRE(rebuilt == text);
  }
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (std::size_t t = 0; t < mismatches.size(); ++t)
    threads.emplace_back([&, t] {
      for (std::size_t i = t; i < texts.size(); i += 2)
        if (tok.encode(texts[i], false, false) != expected[i]) ++mismatches[t];
    });
  for (auto& th : threads) th.join();
  for (int m : mismatches) CHECK(m == 0);
}

// ---------------------------------------------------------------- the rank file

TEST_CASE("tiktoken file: order, line endings and a missing final newline do not matter") {
  std::string text = rank_text({"ab", "abc"});
  auto reference = TiktokenTokenizer::parse(text, "a");
  // Lines in reverse order, CRLF endings, no newline at the end.
  std::vector<std::string> lines;
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t eol = text.find('\n', pos);
    lines.push_back(text.substr(pos, eol - pos));
    pos = eol + 1;
  }
  std::reverse(lines.begin(), lines.end());
  std::string shuffled;
  for (std::size_t i = 0; i < lines.size(); ++i) shuffled += lines[i] + (i + 1 < lines.size() ? "\r\n" : "");
  auto tok = TiktokenTokenizer::parse(shuffled, "b");
  CHECK(tok.num_base_tokens() == 258);
  for (const char* s : {"abc", "abcab", "xabcx", "ab ab"}) CHECK(tok.encode(s, false, false) == reference.encode(s, false, false));
  CHECK(tok.rank_of("abc") == 257u);
  CHECK_FALSE(tok.rank_of("abcd").has_value());
}

TEST_CASE("tiktoken file: each malformed line is named by file and line") {
  const std::string good = rank_text({"ab"});  // 257 lines
  const auto error_of = [](const std::string& text) {
    return tessera::testing::error_of([&] { (void)TiktokenTokenizer::parse(text, "bad.tiktoken"); });
  };
  const auto contains = [](const std::string& message, const std::string& part) {
    INFO("message: ", message);
    CHECK(message.find(part) != std::string::npos);
  };
  contains(error_of(good + "YWJj\n"), "tiktoken file 'bad.tiktoken' line 258: expected '<base64 of the token> <rank>', found no space");
  contains(error_of(good + "YW!j 257\n"), "line 258: 'YW!j' is not valid base64");
  contains(error_of(good + "YWJ 257\n"), "line 258: 'YWJ' is not valid base64");
  contains(error_of(good + " 257\n"), "line 258: empty token");
  contains(error_of(good + "YWJj 25x\n"), "line 258: rank '25x' is not a decimal number");
  contains(error_of(good + "YWJj -1\n"), "line 258: rank '-1' is not a decimal number");
  contains(error_of(good + "YWJj \n"), "line 258: rank '' is not a decimal number");
  contains(error_of(good + "YWJj 257 \n"), "line 258: rank '257 ' is not a decimal number");
  contains(error_of(good + "YWJj 4294967296\n"), "line 258: rank '4294967296' is not a decimal number below 2^32");
  contains(error_of(good + "YWJj 256\n"), "line 258: rank 256 is given twice (also on line 257)");
  contains(error_of(good + "YWI= 257\n"), "line 258: token 'ab' is given twice (also on line 257)");
  contains(error_of(good + "YWJj 300\n"), "line 258: rank 300 is out of range: the file has 258 tokens, so ranks must run 0..257 without gaps (rank 257 is missing)");
  contains(error_of(good + "\nYWJj 257\n"), "line 258: empty line");
  contains(error_of(""), "tiktoken file 'bad.tiktoken': no tokens");
  contains(error_of("\n"), "line 1: empty line");
  // Every single byte must be a token: drop the line of byte 0x41 ('A', rank 65).
  std::string without_a;
  for (int b = 0; b < 256; ++b) {
    if (b == 'A') continue;
    without_a += tessera::io::detail::base64_encode(std::string(1, static_cast<char>(b))) + " " +
                 std::to_string(b < 'A' ? b : b - 1) + "\n";
  }
  contains(error_of(without_a), "tiktoken file 'bad.tiktoken': the single byte A has no rank; every byte must be a token");
  // A non-printable byte is shown escaped: drop byte 0 and renumber the rest.
  std::string without_nul;
  for (int b = 1; b < 256; ++b)
    without_nul += tessera::io::detail::base64_encode(std::string(1, static_cast<char>(b))) + " " +
                   std::to_string(b - 1) + "\n";
  contains(error_of(without_nul), "the single byte \\x00 has no rank");
}

TEST_CASE("tiktoken file: random damage never does worse than a clear error") {
  const std::string good = rank_text({"ab", "abc", " the", "\n\n"});
  std::mt19937 rng(13);
  int parsed = 0;
  int rejected = 0;
  for (int trial = 0; trial < 1500; ++trial) {
    std::string text = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % (text.size() + 1);
      switch (rng() % 4) {
        case 0: if (at < text.size()) text[at] = static_cast<char>(rng() % 256); break;
        case 1: text.insert(at, 1, " =\n0A9+/-"[rng() % 9]); break;
        case 2: if (at < text.size()) text.erase(at, 1 + rng() % 8); break;
        default: text = text.substr(0, at); break;
      }
    }
    try {
      auto tok = TiktokenTokenizer::parse(text, "fuzz");
      ++parsed;
      const Ids ids = tok.encode("the abc\n\nxyz", false, false);
      CHECK(tok.decode(ids) == "the abc\n\nxyz");
    } catch (const tessera::Error& e) {
      ++rejected;
      REQUIRE(std::string(e.what()).find("tiktoken file 'fuzz'") != std::string::npos);
    }
  }
  CHECK(parsed + rejected == 1500);
  CHECK(rejected > 0);
}

TEST_CASE("tiktoken file: load reads a file and names a missing one") {
  TempDir tmp;
  const std::string path = (tmp.path / "tokenizer.model").string();
  {
    std::ofstream out(path, std::ios::binary);
    out << rank_text({"ab"});
  }
  auto tok = TiktokenTokenizer::load(path);
  CHECK(tok.num_base_tokens() == 257);
  CHECK(tok.source() == path);
  CHECK(tok.encode("abab", false, false) == Ids{256, 256});
  CHECK_ERROR_CONTAINS(TiktokenTokenizer::load((tmp.path / "missing.model").string()), "missing.model': no such file");
  CHECK_ERROR_CONTAINS(TiktokenTokenizer::load(tmp.path.string()), "not a regular file");
  {
    std::ofstream out(path, std::ios::binary);
    out << rank_text({"ab"}) << "junk\n";
  }
  CHECK_ERROR_CONTAINS(TiktokenTokenizer::load(path), "tiktoken file '" + path + "' line 258");
}

}  // namespace test_tiktoken
