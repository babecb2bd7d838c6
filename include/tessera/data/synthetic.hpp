// An embedded synthetic corpus: a small English-like language with learnable structure.
//
// Document `index` under `seed` is a pure function of (seed, index): a splitmix64 stream
// keyed by both drives a probabilistic grammar, and no std:: distribution is used, so
// the text is the same with every standard library and on every machine. Any document
// can be generated alone, in any order, on any rank.
//
// The grammar has a lexicon of about 350 word forms: names with a gender (for he/she),
// animals, people, things, food and places; nouns with singular and plural (regular and
// irregular); adjectives by kind of noun; transitive verbs whose object kind they select
// (one eats food, chases animals, carries things) and intransitive verbs, each with its
// third-person singular and past forms; determiners with a/an and number agreement; and
// numbers written as words. Sentences agree in number (is/are, sees/see), a document keeps
// one tense (and its time adverbials match it), a pronoun refers to the previous
// sentence's named subject, and a few multi-sentence episodes carry state:
//   "Anna has seven apples. She gives three apples to Ben. Now Anna has four apples."
//   "Ben asked Anna where the keys were. Anna said that the keys were under the bridge."
// About one document in five is arithmetic facts ("Two plus three is five.").
//
// A document is 2 to 8 sentences, each with a capital first letter and a final period,
// joined by single spaces: printable ASCII only, no newline (so a corpus can be stored one
// document per line). A megabyte of text takes about 10 ms with -O2.
//
// How learnable: the generator adds up -log p of every random choice it makes. That sum is
// at least -log P(text), so its average over documents, divided by their bytes, bounds
// from above the loss an ideal byte-level model reaches. It is about 0.42 nats/byte (the
// test pins it below 0.6), so a small transformer has room to get well below 1.5.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"

namespace tessera::data {

namespace detail {

using std::string_view;

struct Noun {
  string_view singular, plural;
};
struct Verb {
  string_view base, third, past;  // see, sees, saw
};
enum class ObjectKind { any, thing, food, animate };
struct TransitiveVerb {
  Verb forms;
  ObjectKind object;
};
struct Name {
  string_view name;
  bool female;
};

inline constexpr std::array<Name, 24> synthetic_names = {{
    {"Anna", true},   {"Clara", true}, {"Emma", true},  {"Grace", true},  {"Ivy", true},   {"Lucy", true},
    {"Maria", true},  {"Nora", true},  {"Rosa", true},  {"Sara", true},   {"Julia", true}, {"Mia", true},
    {"Ben", false},   {"David", false}, {"Felix", false}, {"Henry", false}, {"Jack", false}, {"Leo", false},
    {"Max", false},   {"Oscar", false}, {"Paul", false}, {"Sam", false},  {"Tom", false},  {"Hugo", false},
}};

inline constexpr std::array<Noun, 15> synthetic_animals = {{
    {"cat", "cats"},     {"dog", "dogs"},       {"bird", "birds"}, {"fox", "foxes"},   {"horse", "horses"},
    {"mouse", "mice"},   {"rabbit", "rabbits"}, {"duck", "ducks"}, {"wolf", "wolves"}, {"frog", "frogs"},
    {"bear", "bears"},   {"goat", "goats"},     {"cow", "cows"},   {"owl", "owls"},    {"sheep", "sheep"},
}};

// The first synthetic_occupations entries say nothing of gender (an introduction
// "Anna is a doctor." takes one of them); the rest do.
inline constexpr std::array<Noun, 12> synthetic_people = {{
    {"child", "children"}, {"teacher", "teachers"}, {"farmer", "farmers"}, {"baker", "bakers"},
    {"doctor", "doctors"}, {"painter", "painters"}, {"sailor", "sailors"}, {"singer", "singers"},
    {"girl", "girls"},     {"boy", "boys"},         {"man", "men"},        {"woman", "women"},
}};
inline constexpr std::size_t synthetic_occupations = 8;

inline constexpr std::array<Noun, 20> synthetic_things = {{
    {"ball", "balls"},     {"book", "books"},       {"box", "boxes"},       {"cup", "cups"},
    {"hat", "hats"},       {"key", "keys"},         {"letter", "letters"},  {"stone", "stones"},
    {"flower", "flowers"}, {"shoe", "shoes"},       {"coin", "coins"},      {"basket", "baskets"},
    {"candle", "candles"}, {"bottle", "bottles"},   {"leaf", "leaves"},     {"toy", "toys"},
    {"map", "maps"},       {"umbrella", "umbrellas"}, {"bell", "bells"},    {"kite", "kites"},
}};

inline constexpr std::array<Noun, 8> synthetic_foods = {{
    {"apple", "apples"}, {"cake", "cakes"},     {"egg", "eggs"},     {"pear", "pears"},
    {"carrot", "carrots"}, {"cookie", "cookies"}, {"plum", "plums"}, {"onion", "onions"},
}};

inline constexpr std::array<string_view, 15> synthetic_places = {
    "garden", "kitchen", "forest", "river", "park", "house", "school", "market",
    "barn",   "field",   "lake",   "village", "library", "hill", "bridge"};

inline constexpr std::array<string_view, 15> synthetic_animate_adjectives = {
    "happy", "sad", "hungry", "sleepy", "angry", "brave", "little", "big",
    "old",   "young", "clever", "quiet", "lazy", "friendly", "tired"};

inline constexpr std::array<string_view, 15> synthetic_thing_adjectives = {
    "red", "blue", "green", "yellow", "big", "small", "old", "new",
    "heavy", "empty", "round", "shiny", "wet", "broken", "little"};

inline constexpr std::array<string_view, 8> synthetic_food_adjectives = {
    "fresh", "sweet", "warm", "big", "small", "red", "green", "ripe"};

inline constexpr std::array<TransitiveVerb, 18> synthetic_transitive_verbs = {{
    {{"see", "sees", "saw"}, ObjectKind::any},           {{"like", "likes", "liked"}, ObjectKind::any},
    {{"find", "finds", "found"}, ObjectKind::thing},     {{"carry", "carries", "carried"}, ObjectKind::thing},
    {{"want", "wants", "wanted"}, ObjectKind::thing},    {{"hold", "holds", "held"}, ObjectKind::thing},
    {{"drop", "drops", "dropped"}, ObjectKind::thing},   {{"take", "takes", "took"}, ObjectKind::thing},
    {{"hide", "hides", "hid"}, ObjectKind::thing},       {{"bring", "brings", "brought"}, ObjectKind::thing},
    {{"paint", "paints", "painted"}, ObjectKind::thing}, {{"eat", "eats", "ate"}, ObjectKind::food},
    {{"cook", "cooks", "cooked"}, ObjectKind::food},     {{"watch", "watches", "watched"}, ObjectKind::animate},
    {{"follow", "follows", "followed"}, ObjectKind::animate}, {{"chase", "chases", "chased"}, ObjectKind::animate},
    {{"help", "helps", "helped"}, ObjectKind::animate},  {{"call", "calls", "called"}, ObjectKind::animate},
}};

inline constexpr std::array<Verb, 12> synthetic_intransitive_verbs = {{
    {"sleep", "sleeps", "slept"}, {"run", "runs", "ran"},         {"sing", "sings", "sang"},
    {"jump", "jumps", "jumped"},  {"walk", "walks", "walked"},    {"swim", "swims", "swam"},
    {"play", "plays", "played"},  {"sit", "sits", "sat"},         {"laugh", "laughs", "laughed"},
    {"wait", "waits", "waited"},  {"dance", "dances", "danced"},  {"rest", "rests", "rested"},
}};

inline constexpr std::array<string_view, 6> synthetic_manner_adverbs = {
    "quickly", "slowly", "quietly", "happily", "loudly", "carefully"};
inline constexpr std::array<string_view, 5> synthetic_present_times = {
    "every day", "every morning", "every evening", "at night", "sometimes"};
inline constexpr std::array<string_view, 5> synthetic_past_times = {
    "yesterday", "last night", "one morning", "long ago", "later"};
inline constexpr std::array<string_view, 5> synthetic_prepositions = {"in", "near", "behind", "under", "beside"};

inline constexpr std::array<string_view, 21> synthetic_numbers = {
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty"};

/// Writes one synthetic document. Every random choice goes through uniform/chance/weighted,
/// which add -log p of the outcome to nats() (an upper bound on -log P(text)).
class SyntheticWriter {
 public:
  SyntheticWriter(std::uint64_t seed, std::int64_t index)
      : state_(mix64(mix64(seed) ^ (static_cast<std::uint64_t>(index) * 0xD1B54A32D192ED03ull))) {}

  /// The document: 2 to 8 sentences.
  std::string document() {
    std::int64_t sentences = 2 + static_cast<std::int64_t>(uniform(7));
    if (chance(20)) {
      for (std::int64_t i = 0; i < sentences; ++i) arithmetic_fact();
      return std::move(text_);
    }
    past_ = chance(50);
    protagonist_ = uniform(synthetic_names.size());
    friend_ = (protagonist_ + 1 + uniform(synthetic_names.size() - 1)) % synthetic_names.size();
    std::int64_t written = 0;
    while (written < sentences) {
      std::int64_t left = sentences - written;
      // transitive, intransitive, copula, existential, introduction, arithmetic, counting (3), dialogue (2)
      std::size_t kind = weighted({28, 20, 14, 10, 6, 4, left >= 3 ? 10 : 0, left >= 2 ? 8 : 0});
      switch (kind) {
        case 0: transitive(); break;
        case 1: intransitive(); break;
        case 2: copula(); break;
        case 3: existential(); break;
        case 4: introduction(); break;
        case 5: arithmetic_fact(); break;
        case 6: counting_episode(); break;
        default: dialogue_episode(); break;
      }
      written += (kind == 6) ? 3 : (kind == 7 ? 2 : 1);
    }
    return std::move(text_);
  }

  double nats() const { return nats_; }

 private:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);

  // --- random choices -------------------------------------------------------------------

  std::uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix64(state_);
  }
  /// Uniform in [0, n), n >= 1.
  std::size_t uniform(std::size_t n) {
    if (n > 1) nats_ += std::log(static_cast<double>(n));
    return static_cast<std::size_t>(((next() >> 32) * static_cast<std::uint64_t>(n)) >> 32);
  }
  /// True with probability percent/100.
  bool chance(int percent) {
    bool yes = static_cast<int>(uniform_raw(100)) < percent;
    nats_ -= std::log((yes ? percent : 100 - percent) / 100.0);
    return yes;
  }
  /// Index i with probability weights[i] / sum.
  std::size_t weighted(std::initializer_list<int> weights) {
    int total = 0;
    for (int w : weights) total += w;
    int r = static_cast<int>(uniform_raw(static_cast<std::size_t>(total)));
    std::size_t i = 0;
    for (int w : weights) {
      if (r < w) {
        nats_ -= std::log(static_cast<double>(w) / total);
        return i;
      }
      r -= w;
      ++i;
    }
    return weights.size() - 1;  // not reached: r < total
  }
  std::size_t uniform_raw(std::size_t n) {
    return static_cast<std::size_t>(((next() >> 32) * static_cast<std::uint64_t>(n)) >> 32);
  }
  template <class Array>
  const auto& pick(const Array& items) {
    return items[uniform(items.size())];
  }

  // --- text -----------------------------------------------------------------------------

  void word(string_view w) {
    if (!sentence_.empty()) sentence_.push_back(' ');
    sentence_.append(w);
  }
  void comma() { sentence_.push_back(','); }
  void end_sentence() {
    if (sentence_[0] >= 'a' && sentence_[0] <= 'z') sentence_[0] = static_cast<char>(sentence_[0] - 'a' + 'A');
    sentence_.push_back('.');
    if (!text_.empty()) text_.push_back(' ');
    text_.append(sentence_);
    sentence_.clear();
  }
  static bool starts_with_vowel(string_view w) {
    return w[0] == 'a' || w[0] == 'e' || w[0] == 'i' || w[0] == 'o' || w[0] == 'u';
  }
  /// "a" or "an", by the word that follows.
  void indefinite(string_view next_word) { word(starts_with_vowel(next_word) ? "an" : "a"); }
  void verb(const Verb& v, bool third_singular) { word(past_ ? v.past : (third_singular ? v.third : v.base)); }
  void be(bool plural) { word(past_ ? (plural ? "were" : "was") : (plural ? "are" : "is")); }
  void count_noun(std::size_t n, const Noun& noun) {
    word(n == 0 ? "no" : synthetic_numbers[n]);
    word(n == 1 ? noun.singular : noun.plural);
  }
  void place_phrase() {
    word(pick(synthetic_prepositions));
    word("the");
    word(pick(synthetic_places));
  }
  void time_adverbial() {
    word(past_ ? pick(synthetic_past_times) : pick(synthetic_present_times));
    comma();
  }
  std::size_t other_name(std::size_t person) {
    if (person == none) return chance(70) ? friend_ : uniform(synthetic_names.size());
    if (chance(70)) return person == protagonist_ ? friend_ : protagonist_;
    return (person + 1 + uniform(synthetic_names.size() - 1)) % synthetic_names.size();
  }
  std::size_t cast_member() {
    std::size_t i = weighted({5, 3, 2});
    return i == 0 ? protagonist_ : (i == 1 ? friend_ : uniform(synthetic_names.size()));
  }

  // --- phrases --------------------------------------------------------------------------

  enum class NounKind { animal, person, thing, food };

  /// A determiner phrase: [det] [adjective] noun. Returns true when plural.
  bool noun_phrase(NounKind kind, bool definite_only = false) {
    const Noun& noun = kind == NounKind::animal   ? pick(synthetic_animals)
                       : kind == NounKind::person ? pick(synthetic_people)
                       : kind == NounKind::thing  ? pick(synthetic_things)
                                                  : pick(synthetic_foods);
    bool plural = chance(35);
    string_view adjective;
    if (chance(30)) {
      adjective = (kind == NounKind::animal || kind == NounKind::person) ? pick(synthetic_animate_adjectives)
                  : kind == NounKind::thing                                ? pick(synthetic_thing_adjectives)
                                                                           : pick(synthetic_food_adjectives);
    }
    string_view head = plural ? noun.plural : noun.singular;
    string_view first = adjective.empty() ? head : adjective;
    if (definite_only) {
      word("the");
    } else if (!plural) {
      switch (weighted({50, 30, 7, 7, 6})) {
        case 0: word("the"); break;
        case 1: indefinite(first); break;
        case 2: word("this"); break;
        case 3: word("that"); break;
        default: word("my"); break;
      }
    } else {
      switch (weighted({45, 15, 8, 8, 8, 16})) {
        case 0: word("the"); break;
        case 1: word("some"); break;
        case 2: word("many"); break;
        case 3: word("these"); break;
        case 4: word("those"); break;
        default: word(synthetic_numbers[2 + uniform(9)]); break;
      }
    }
    if (!adjective.empty()) word(adjective);
    word(head);
    return plural;
  }

  /// An animate subject: a name, a pronoun for the previous sentence's named subject, or a
  /// noun phrase. Sets subject_person_ and returns true when plural.
  bool animate_subject() {
    bool pronoun_ok = previous_person_ != none;
    switch (weighted({30, pronoun_ok ? 20 : 0, 50})) {
      case 0: subject_person_ = cast_member(); word(synthetic_names[subject_person_].name); return false;
      case 1:
        subject_person_ = previous_person_;
        word(synthetic_names[subject_person_].female ? "she" : "he");
        return false;
      default: subject_person_ = none; return noun_phrase(chance(60) ? NounKind::animal : NounKind::person);
    }
  }
  void object(ObjectKind kind) {
    switch (kind) {
      case ObjectKind::any:
        if (chance(50)) return object(ObjectKind::animate);
        return object(ObjectKind::thing);
      case ObjectKind::thing: noun_phrase(chance(75) ? NounKind::thing : NounKind::food); return;
      case ObjectKind::food: noun_phrase(NounKind::food); return;
      case ObjectKind::animate:
        if (chance(30)) {
          word(synthetic_names[other_name(subject_person_)].name);
        } else {
          noun_phrase(chance(60) ? NounKind::animal : NounKind::person);
        }
        return;
    }
  }
  void finish_clause() {
    previous_person_ = subject_person_;
    end_sentence();
  }

  // --- sentences ------------------------------------------------------------------------

  void transitive() {
    if (chance(15)) time_adverbial();
    bool plural = animate_subject();
    const TransitiveVerb& v = pick(synthetic_transitive_verbs);
    verb(v.forms, !plural);
    object(v.object);
    if (chance(25)) place_phrase();
    finish_clause();
  }
  void intransitive() {
    if (chance(15)) time_adverbial();
    bool plural = animate_subject();
    verb(pick(synthetic_intransitive_verbs), !plural);
    if (chance(30)) word(pick(synthetic_manner_adverbs));
    if (chance(40)) place_phrase();
    finish_clause();
  }
  void copula() {
    NounKind kind = NounKind::thing;
    bool plural = false;
    switch (weighted({40, 30, 30})) {
      case 0: plural = animate_subject(); kind = NounKind::animal; break;
      case 1: subject_person_ = none; plural = noun_phrase(NounKind::thing); break;
      default: subject_person_ = none; plural = noun_phrase(NounKind::food); kind = NounKind::food; break;
    }
    be(plural);
    if (chance(15)) word("very");
    word(kind == NounKind::animal ? pick(synthetic_animate_adjectives)
         : kind == NounKind::thing ? pick(synthetic_thing_adjectives)
                                   : pick(synthetic_food_adjectives));
    finish_clause();
  }
  void existential() {
    word("there");
    std::size_t kind = weighted({40, 40, 20});
    const Noun& noun = kind == 0 ? pick(synthetic_animals) : kind == 1 ? pick(synthetic_things) : pick(synthetic_foods);
    bool plural = chance(50);
    be(plural);
    if (plural) {
      switch (weighted({60, 20, 20})) {
        case 0: word(synthetic_numbers[2 + uniform(9)]); break;
        case 1: word("some"); break;
        default: word("many"); break;
      }
      word(noun.plural);
    } else {
      indefinite(noun.singular);
      word(noun.singular);
    }
    place_phrase();
    subject_person_ = none;
    finish_clause();
  }
  void introduction() {
    subject_person_ = cast_member();
    word(synthetic_names[subject_person_].name);
    be(false);
    string_view adjective = chance(50) ? pick(synthetic_animate_adjectives) : string_view{};
    const Noun& job = synthetic_people[uniform(synthetic_occupations)];
    indefinite(adjective.empty() ? job.singular : adjective);
    if (!adjective.empty()) word(adjective);
    word(job.singular);
    finish_clause();
  }
  void arithmetic_fact() {
    std::size_t a = 0, b = 0, result = 0;
    string_view op;
    switch (weighted({40, 35, 25})) {
      case 0: a = uniform(11); b = uniform(11); result = a + b; op = "plus"; break;
      case 1: a = uniform(21); b = uniform(a + 1); result = a - b; op = "minus"; break;
      default: a = 1 + uniform(10); b = uniform(20 / a + 1); result = a * b; op = "times"; break;
    }
    word(synthetic_numbers[a]);
    word(op);
    word(synthetic_numbers[b]);
    word("is");
    word(synthetic_numbers[result]);
    subject_person_ = none;
    finish_clause();
  }
  /// "Anna has seven apples. She gives three apples to Ben. Now Anna has four apples."
  void counting_episode() {
    std::size_t owner = chance(70) ? protagonist_ : friend_;
    std::size_t other = owner == protagonist_ ? friend_ : protagonist_;
    const Noun& noun = chance(50) ? pick(synthetic_foods) : pick(synthetic_things);
    std::size_t have = 1 + uniform(12);
    const Verb have_verb{"have", "has", "had"};
    word(synthetic_names[owner].name);
    verb(have_verb, true);
    count_noun(have, noun);
    end_sentence();

    word(synthetic_names[owner].female ? "she" : "he");
    std::size_t now = 0;
    if (chance(50)) {
      std::size_t give = 1 + uniform(have);
      verb({"give", "gives", "gave"}, true);
      count_noun(give, noun);
      word("to");
      word(synthetic_names[other].name);
      now = have - give;
    } else {
      std::size_t found = 1 + uniform(8);
      verb({"find", "finds", "found"}, true);
      word(synthetic_numbers[found]);
      word("more");
      word(found == 1 ? noun.singular : noun.plural);
      now = have + found;
    }
    end_sentence();

    word(past_ ? "then" : "now");
    word(synthetic_names[owner].name);
    verb(have_verb, true);
    count_noun(now, noun);
    subject_person_ = owner;
    finish_clause();
  }
  /// "Anna asks Ben where the ball is. Ben says that the ball is under the bridge."
  void dialogue_episode() {
    std::size_t asker = chance(60) ? protagonist_ : friend_;
    std::size_t answerer = asker == protagonist_ ? friend_ : protagonist_;
    std::size_t kind = weighted({50, 30, 20});
    const Noun& noun = kind == 0 ? pick(synthetic_things) : kind == 1 ? pick(synthetic_animals) : pick(synthetic_foods);
    bool plural = chance(35);
    string_view head = plural ? noun.plural : noun.singular;

    word(synthetic_names[asker].name);
    verb({"ask", "asks", "asked"}, true);
    word(synthetic_names[answerer].name);
    word("where the");
    word(head);
    be(plural);
    end_sentence();

    word(synthetic_names[answerer].name);
    verb({"say", "says", "said"}, true);
    word("that the");
    word(head);
    be(plural);
    place_phrase();
    subject_person_ = answerer;
    finish_clause();
  }

  std::uint64_t state_;
  double nats_ = 0.0;
  std::string text_, sentence_;
  bool past_ = false;
  std::size_t protagonist_ = 0, friend_ = 1;
  std::size_t subject_person_ = none, previous_person_ = none;
};

}  // namespace detail

/// Document `index` (>= 0) of the synthetic corpus under `seed`.
inline std::string synthetic_document(std::uint64_t seed, std::int64_t index) {
  TESSERA_CHECK(index >= 0, "synthetic_document: index ", index, " is negative");
  return detail::SyntheticWriter(seed, index).document();
}

/// Documents first .. first + n_documents - 1 of the synthetic corpus under `seed`.
inline std::vector<std::string> synthetic_corpus(std::uint64_t seed, std::int64_t first, std::int64_t n_documents) {
  TESSERA_CHECK(n_documents >= 0, "synthetic_corpus: n_documents ", n_documents, " is negative");
  TESSERA_CHECK(first >= 0, "synthetic_corpus: first document ", first, " is negative");
  std::vector<std::string> docs;
  docs.reserve(static_cast<std::size_t>(n_documents));
  for (std::int64_t i = 0; i < n_documents; ++i) docs.push_back(synthetic_document(seed, first + i));
  return docs;
}

/// Documents 0 .. n_documents-1 of the synthetic corpus under `seed`.
inline std::vector<std::string> synthetic_corpus(std::uint64_t seed, std::int64_t n_documents) {
  return synthetic_corpus(seed, 0, n_documents);
}

}  // namespace tessera::data
