// The synthetic corpus: determinism, the shape of its text, its grammar, and how
// learnable it is.
#include <doctest/doctest.h>

#include "../support/errors.hpp"

#include <cstdint>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/data/synthetic.hpp"

namespace test_synthetic {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

using tessera::data::synthetic_corpus;
using tessera::data::synthetic_document;
namespace syn = tessera::data::detail;


std::vector<std::string> split(const std::string& text, const std::string& separator) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  while (true) {
    std::size_t end = text.find(separator, begin);
    if (end == std::string::npos) {
      parts.push_back(text.substr(begin));
      return parts;
    }
    parts.push_back(text.substr(begin, end - begin));
    begin = end + separator.size();
  }
}

/// The sentences of a document, without their final periods.
std::vector<std::string> sentences_of(const std::string& doc) {
  REQUIRE(!doc.empty());
  REQUIRE(doc.back() == '.');
  return split(doc.substr(0, doc.size() - 1), ". ");
}

/// The words of a sentence, lower-cased, without commas.
std::vector<std::string> words_of(const std::string& sentence) {
  std::vector<std::string> words;
  std::istringstream in(sentence);
  std::string w;
  while (in >> w) {
    if (!w.empty() && w.back() == ',') w.pop_back();
    for (char& c : w) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    words.push_back(w);
  }
  return words;
}

int number_value(const std::string& word) {
  for (std::size_t i = 0; i < syn::synthetic_numbers.size(); ++i) {
    if (syn::synthetic_numbers[i] == word) return static_cast<int>(i);
  }
  return -1;
}

std::uint64_t fnv1a(const std::vector<std::string>& docs) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto& d : docs) {
    for (unsigned char c : d) h = (h ^ c) * 0x100000001b3ull;
    h = (h ^ 0xFFu) * 0x100000001b3ull;
  }
  return h;
}

template <class Nouns>
void add_nouns(const Nouns& nouns, std::set<std::string>& singular, std::set<std::string>& plural) {
  for (const auto& n : nouns) {
    singular.insert(std::string(n.singular));
    plural.insert(std::string(n.plural));
  }
}

}  // namespace

TEST_CASE("synthetic corpus: a document depends only on (seed, index)") {
  CHECK(synthetic_document(0, 0) == synthetic_document(0, 0));
  CHECK(synthetic_document(7, 123) == synthetic_document(7, 123));
  auto corpus = synthetic_corpus(3, 50);
  REQUIRE(corpus.size() == 50);
  for (std::int64_t i = 0; i < 50; ++i) CHECK(corpus[static_cast<std::size_t>(i)] == synthetic_document(3, i));
  // Generating in another order or again gives the same text.
  CHECK(synthetic_document(3, 49) == corpus[49]);
  CHECK(synthetic_corpus(3, 50) == corpus);
  CHECK(synthetic_corpus(3, 0).empty());
}

TEST_CASE("synthetic corpus: different seeds and indices give different text") {
  auto a = synthetic_corpus(0, 100);
  auto b = synthetic_corpus(1, 100);
  int same = 0;
  for (std::size_t i = 0; i < a.size(); ++i) same += a[i] == b[i] ? 1 : 0;
  CHECK(same <= 2);
  std::set<std::string> distinct(a.begin(), a.end());
  CHECK(distinct.size() >= 98);
  // The key is not symmetric in (seed, index).
  CHECK(synthetic_document(1, 2) != synthetic_document(2, 1));
}

TEST_CASE("synthetic corpus: the text is pinned, so it is the same on every platform") {
  CHECK(synthetic_document(0, 1) ==
        "Nora asks David where the flower is. David says that the flower is behind the lake. "
        "The shiny box is red. A farmer hides the little map.");
  CHECK(fnv1a(synthetic_corpus(0, 200)) == 0x1cabf5da047941c3ull);
}

TEST_CASE("synthetic corpus: printable one-line documents of 2 to 8 capitalised sentences") {
  auto corpus = synthetic_corpus(11, 400);
  std::set<std::size_t> sentence_counts;
  for (const auto& doc : corpus) {
    INFO(doc);
    bool printable = true;
    for (char c : doc) printable = printable && c >= 32 && c <= 126;
    CHECK(printable);
    CHECK(doc.find('\n') == std::string::npos);
    CHECK(doc.find("  ") == std::string::npos);
    CHECK(doc.front() != ' ');
    CHECK(doc.back() == '.');
    auto sentences = sentences_of(doc);
    sentence_counts.insert(sentences.size());
    CHECK(sentences.size() >= 2);
    CHECK(sentences.size() <= 8);
    for (const auto& s : sentences) {
      REQUIRE(!s.empty());
      CHECK((s[0] >= 'A' && s[0] <= 'Z'));
      CHECK(s.find('.') == std::string::npos);
      CHECK(words_of(s).size() >= 2);
    }
  }
  CHECK(sentence_counts.count(2) == 1);
  CHECK(sentence_counts.count(8) == 1);
}

TEST_CASE("synthetic corpus: a closed lexicon of a few hundred words") {
  std::set<std::string> lexicon;
  for (const auto& doc : synthetic_corpus(5, 3000)) {
    for (const auto& s : sentences_of(doc)) {
      for (const auto& w : words_of(s)) lexicon.insert(w);
    }
  }
  INFO("distinct words: ", lexicon.size());
  CHECK(lexicon.size() >= 150);
  CHECK(lexicon.size() <= 400);
  for (const auto& w : lexicon) {
    bool letters = true;
    for (char c : w) letters = letters && c >= 'a' && c <= 'z';
    CHECK_MESSAGE(letters, w);
  }
}

TEST_CASE("synthetic corpus: grammar — agreement, a/an, arithmetic, episodes, tense") {
  std::set<std::string> singular, plural;
  add_nouns(syn::synthetic_animals, singular, plural);
  add_nouns(syn::synthetic_people, singular, plural);
  add_nouns(syn::synthetic_things, singular, plural);
  add_nouns(syn::synthetic_foods, singular, plural);
  std::set<std::string> both;  // "sheep" is both
  for (const auto& s : singular) {
    if (plural.count(s)) both.insert(s);
  }
  int arithmetic = 0, episodes = 0, dialogues = 0;
  for (const auto& doc : synthetic_corpus(2, 1500)) {
    INFO(doc);
    auto sentences = sentences_of(doc);
    bool has_past = false, has_present_plural = false;
    for (std::size_t si = 0; si < sentences.size(); ++si) {
      auto w = words_of(sentences[si]);
      for (std::size_t i = 0; i + 1 < w.size(); ++i) {
        const std::string& a = w[i];
        const std::string& b = w[i + 1];
        if (a == "a") CHECK(std::string("aeiou").find(b[0]) == std::string::npos);
        if (a == "an") CHECK(std::string("aeiou").find(b[0]) != std::string::npos);
        if (!both.count(a)) {
          if (b == "is" || b == "was") CHECK_FALSE(plural.count(a));
          if (b == "are" || b == "were") CHECK_FALSE(singular.count(a));
        }
        if (b == "was" || b == "were") has_past = true;
        if (b == "are") has_present_plural = true;
      }
      // "A plus B is C."
      if (w.size() == 5 && w[3] == "is" && (w[1] == "plus" || w[1] == "minus" || w[1] == "times")) {
        int x = number_value(w[0]), y = number_value(w[2]), z = number_value(w[4]);
        REQUIRE(x >= 0);
        REQUIRE(y >= 0);
        REQUIRE(z >= 0);
        CHECK(z == (w[1] == "plus" ? x + y : w[1] == "minus" ? x - y : x * y));
        ++arithmetic;
      }
      // "X has N nouns. She gives K nouns to Y. Now X has M nouns." and "... finds K more ..."
      if (si + 2 < sentences.size() && w.size() == 4 && (w[1] == "has" || w[1] == "had")) {
        auto give = words_of(sentences[si + 1]);
        auto now = words_of(sentences[si + 2]);
        if (now.size() == 5 && (now[0] == "now" || now[0] == "then") && now[1] == w[0]) {
          int have = number_value(w[2]);
          int k = number_value(give[2]);
          int left = now[3] == "no" ? 0 : number_value(now[3]);
          REQUIRE(have >= 1);
          REQUIRE(k >= 1);
          if (give[1] == "gives" || give[1] == "gave") {
            CHECK(left == have - k);
          } else {
            CHECK(give[3] == "more");
            CHECK(left == have + k);
          }
          // "one apple", "two apples", "no apples"
          CHECK(singular.count(w[3]) == (have == 1 ? 1u : 0u));
          CHECK(plural.count(now[4]) == (left == 1 ? 0u : 1u));
          ++episodes;
        }
      }
      // "X asks Y where the N is. Y says that the N is P the Q."
      if (si + 1 < sentences.size() && w.size() >= 6 && (w[1] == "asks" || w[1] == "asked") && w[3] == "where") {
        auto answer = words_of(sentences[si + 1]);
        REQUIRE(answer.size() == 9);
        CHECK(answer[0] == w[2]);
        CHECK(answer[4] == w[5]);  // the same noun
        CHECK(answer[5] == w[6]);  // the same tense and number
        ++dialogues;
      }
    }
    // One tense per story: a document with a past copula has no present plural copula.
    CHECK_FALSE((has_past && has_present_plural));
  }
  CHECK(arithmetic > 100);
  CHECK(episodes > 20);
  CHECK(dialogues > 20);
}

TEST_CASE("synthetic corpus: the source entropy leaves a byte-level model far below 1.5 nats/byte") {
  // -log p summed over the generator's choices bounds -log P(text) from above, so this is
  // an upper bound on the loss of an ideal model.
  double nats = 0.0, bytes = 0.0;
  for (std::int64_t i = 0; i < 3000; ++i) {
    syn::SyntheticWriter writer(0, i);
    std::string doc = writer.document();
    CHECK(doc == synthetic_document(0, i));
    nats += writer.nats();
    bytes += static_cast<double>(doc.size());
  }
  double per_byte = nats / bytes;
  INFO("derivation entropy: ", per_byte, " nats/byte");
  CHECK(per_byte < 0.6);
  CHECK(per_byte > 0.2);  // and the language is not trivial
}

TEST_CASE("synthetic corpus: bad arguments") {
  CHECK_ERROR_CONTAINS(synthetic_document(0, -1), "index -1 is negative");
  CHECK_ERROR_CONTAINS(synthetic_corpus(0, -5), "n_documents -5 is negative");
}

}  // namespace test_synthetic
