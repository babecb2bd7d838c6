// Tokenizing a corpus: reading text and JSON lines sources with their line numbers,
// decoding JSON escapes, tokenizing in parallel in input order (the same ids for every
// thread count), errors that name the file and line, and the progress/summary text.
// The byte tokenizer makes every expected id known by construction.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tessera/data/tokenize.hpp"
#include "tessera/io/tokenizer.hpp"

namespace test_tokenize {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using namespace tessera::data;
using Ids = std::vector<std::uint32_t>;
using tessera::io::ByteTokenizer;

using tessera::test::TempDir;

/// BOS + bytes + EOS, as the byte tokenizer encodes a document.
Ids byte_ids(const std::string& text, bool bos = true, bool eos = true) {
  Ids ids;
  if (bos) ids.push_back(ByteTokenizer::kBos);
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  if (eos) ids.push_back(ByteTokenizer::kEos);
  return ids;
}

void append(Ids& to, const Ids& ids) { to.insert(to.end(), ids.begin(), ids.end()); }

/// A document of deterministic, varied length and content (some long, most short).
std::string doc_text(int i) {
  std::string s = "doc " + std::to_string(i) + ":";
  const int words = (i % 7 == 0) ? 300 + i % 50 : 1 + (i * 37) % 23;
  for (int w = 0; w < words; ++w) s += " w" + std::to_string((i * 131 + w * 17) % 1000);
  return s;
}

std::vector<RawDocument> read_records(std::vector<InputSource> sources, std::size_t chunk = std::size_t{1} << 20) {
  DocumentReader reader(std::move(sources), chunk);
  std::vector<RawDocument> out;
  RawDocument d;
  while (reader.next(d)) {
    out.push_back(d);
    d = RawDocument{};
  }
  return out;
}

Ids tokenize_files(const std::vector<InputSource>& sources, TokenizeOptions o, TokenizeStats* stats = nullptr) {
  DocumentReader reader(sources);
  ByteTokenizer tok;
  return tokenize_all(reader, tok, o, stats);
}

/// A tokenizer that refuses documents containing "BOOM", to test failures in encode.
class RefusingTokenizer final : public tessera::io::Tokenizer {
 public:
  using Tokenizer::encode;
  std::string_view kind() const override { return "refusing"; }
  std::int64_t vocab_size() const override { return 258; }
  std::uint32_t bos_id() const override { return 256; }
  std::uint32_t eos_id() const override { return 257; }
  std::vector<std::uint32_t> encode(std::string_view text, tessera::io::EncodeOptions o) const override {
    if (text.find("BOOM") != std::string_view::npos) throw std::runtime_error("refused a document");
    return ByteTokenizer().encode(text, o);
  }
  std::string decode(std::span<const std::uint32_t> ids) const override { return ByteTokenizer().decode(ids); }
  std::string token_text(std::uint32_t id) const override { return ByteTokenizer().token_text(id); }
  std::optional<std::uint32_t> special_id(std::string_view) const override { return std::nullopt; }
};

}  // namespace

TEST_CASE("input format follows the extension") {
  CHECK(input_format_of("c4-train.00000-of-01024.json") == InputFormat::jsonl);
  CHECK(input_format_of("data/part.jsonl") == InputFormat::jsonl);
  CHECK(input_format_of("book.txt") == InputFormat::text);
  CHECK(input_format_of("README") == InputFormat::text);
  CHECK(input_format_of("notes.json.txt") == InputFormat::text);
  CHECK(input_format_of("-") == InputFormat::text);
  CHECK(name_of(InputFormat::jsonl) == "jsonl");
}

TEST_CASE("a JSON line's text field is decoded, escapes included") {
  CHECK(json_document_text(R"({"text": "hello", "url": "x"})", "text", "f.jsonl", 1) == "hello");
  CHECK(json_document_text(R"({"content": "other field"})", "content", "f.jsonl", 1) == "other field");
  CHECK(json_document_text(R"({"text": "caf\u00e9"})", "text", "f.jsonl", 1) == "caf\xc3\xa9");
  // A surrogate pair is one code point, four UTF-8 bytes.
  CHECK(json_document_text(R"({"text": "\ud83d\ude00"})", "text", "f.jsonl", 1) == "\xf0\x9f\x98\x80");
  CHECK(json_document_text(R"({"text": "a\nb\t\"q\"\\ \/"})", "text", "f.jsonl", 1) == "a\nb\t\"q\"\\ /");
  CHECK(json_document_text("{\"text\": \"raw \xc3\xa9 bytes\"}\r", "text", "f.jsonl", 1) == "raw \xc3\xa9 bytes");
  CHECK(json_document_text(R"({"text": ""})", "text", "f.jsonl", 1).empty());
}

TEST_CASE("a bad JSON line names the file, the line and what is wrong") {
  CHECK_ERROR_CONTAINS(json_document_text("{\"text\": \"unterminated", "text", "c4.jsonl", 17),
                       "c4.jsonl:17: not valid JSON: column");
  CHECK_ERROR_CONTAINS(json_document_text("not json at all", "text", "c4.jsonl", 3), "c4.jsonl:3: not valid JSON");
  CHECK_ERROR_CONTAINS(json_document_text("[1, 2]", "text", "c4.jsonl", 4),
                       "c4.jsonl:4: expected a JSON object, found array");
  CHECK_ERROR_CONTAINS(json_document_text("\"just a string\"", "text", "c4.jsonl", 5),
                       "c4.jsonl:5: expected a JSON object, found string");
  CHECK_ERROR_CONTAINS(json_document_text(R"({"content": "x", "url": "u"})", "text", "c4.jsonl", 6),
                       "c4.jsonl:6: no \"text\" field (the object has \"content\", \"url\")");
  CHECK_ERROR_CONTAINS(json_document_text("{}", "text", "c4.jsonl", 7), "c4.jsonl:7: no \"text\" field (the object has no fields)");
  CHECK_ERROR_CONTAINS(json_document_text(R"({"text": 42})", "text", "c4.jsonl", 8),
                       "c4.jsonl:8: field \"text\" is number, not a string");
  CHECK_ERROR_CONTAINS(json_document_text(R"({"text": null})", "text", "c4.jsonl", 9),
                       "c4.jsonl:9: field \"text\" is null, not a string");
  CHECK_ERROR_CONTAINS(json_document_text("{\"text\": \"bad \xff byte\"}", "text", "c4.jsonl", 10),
                       "c4.jsonl:10: not valid JSON");
  CHECK_ERROR_CONTAINS(json_document_text(R"({"text": "\ud800 lone surrogate"})", "text", "c4.jsonl", 11),
                       "c4.jsonl:11: not valid JSON");
  CHECK_ERROR_CONTAINS(json_document_text(R"({"text": "a"} trailing)", "text", "c4.jsonl", 12),
                       "c4.jsonl:12: not valid JSON");
  // A long bad line does not make a long message.
  const std::string long_line = "{\"text\": \"" + std::string(100000, 'a');
  const std::string message = tessera::testing::error_of([&] { json_document_text(long_line, "text", "c4.jsonl", 2); });
  CHECK(message.find("c4.jsonl:2: not valid JSON") == 0);
  CHECK(message.size() < 400);
}

TEST_CASE("the reader hands out records in order with their line numbers") {
  TempDir dir;
  // Blank lines (also with spaces or CR), CRLF endings and a last line without a newline.
  const std::string jsonl = "{\"text\": \"one\"}\n\n  \r\n{\"text\": \"two\"}\r\n{\"text\": \"three\"}\n\n{\"text\": \"four\"}";
  const std::string a = dir.write("a.jsonl", jsonl);
  const std::string b = dir.write("b.txt", "a whole text file\nwith two lines\n");
  const std::string c = dir.write("c.txt", "");
  for (std::size_t chunk : {std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{1} << 20}) {
    CAPTURE(chunk);
    auto records = read_records({{a, InputFormat::jsonl}, {b, InputFormat::text}, {c, InputFormat::text}}, chunk);
    REQUIRE(records.size() == 6);
    CHECK(records[0].bytes == "{\"text\": \"one\"}");
    CHECK(records[0].line == 1);
    CHECK(records[1].bytes == "{\"text\": \"two\"}\r");
    CHECK(records[1].line == 4);
    CHECK(records[2].line == 5);
    CHECK(records[3].bytes == "{\"text\": \"four\"}");
    CHECK(records[3].line == 7);
    for (int i = 0; i < 4; ++i) CHECK(records[static_cast<std::size_t>(i)].source == 0);
    CHECK(records[4].bytes == "a whole text file\nwith two lines\n");
    CHECK(records[4].source == 1);
    CHECK(records[4].line == 0);
    CHECK(records[5].bytes.empty());  // an empty text file is an empty document
    CHECK(records[5].source == 2);
    // Every input byte is accounted for by some record.
    std::uint64_t bytes = 0;
    for (const auto& r : records) bytes += r.input_bytes;
    CHECK(bytes == jsonl.size() + 33);
  }
  DocumentReader reader({{a, InputFormat::jsonl}, {b, InputFormat::text}});
  CHECK(reader.total_bytes() == jsonl.size() + 33);
  CHECK(reader.bytes_read() == 0);
  DocumentBatch batch;
  REQUIRE(reader.read_batch(batch, 20));  // stops once 20 bytes of records are in
  CHECK(batch.docs.size() == 2);
  CHECK(batch.bytes == batch.docs[0].bytes.size() + batch.docs[1].bytes.size());
  REQUIRE(reader.read_batch(batch, 1000));
  CHECK(batch.docs.size() == 3);
  CHECK_FALSE(reader.read_batch(batch, 1000));
  CHECK(batch.docs.empty());
  CHECK(reader.bytes_read() == jsonl.size() + 33);
}

TEST_CASE("the reader refuses missing, unreadable and compressed sources by name") {
  TempDir dir;
  const std::string good = dir.write("good.jsonl", "{\"text\": \"x\"}\n");
  CHECK_ERROR_CONTAINS(DocumentReader({}), "no input files");
  CHECK_ERROR_CONTAINS(DocumentReader({{good, InputFormat::jsonl}, {(dir.path / "missing.jsonl").string(), InputFormat::jsonl}}),
                       "missing.jsonl: no such file");
  CHECK_ERROR_CONTAINS(DocumentReader({{dir.path.string(), InputFormat::text}}), ": is a directory");
  CHECK_ERROR_CONTAINS(DocumentReader({{"-", InputFormat::text}, {"-", InputFormat::jsonl}}),
                       "standard input ('-') is given more than once");
  if (::geteuid() != 0) {  // root reads any file
    const std::string locked = dir.write("locked.txt", "secret");
    fs::permissions(locked, fs::perms::none);
    CHECK_ERROR_CONTAINS(DocumentReader({{locked, InputFormat::text}}), "locked.txt: cannot open for reading");
  }
  const std::string gz = dir.write("c4.json.gz", std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00", 8) + "rest");
  const std::string zst = dir.write("c4.jsonl.zst", std::string("\x28\xb5\x2f\xfd\x00\x00", 6));
  CHECK_ERROR_CONTAINS(read_records({{gz, InputFormat::jsonl}}), "c4.json.gz: looks gzip-compressed");
  CHECK_ERROR_CONTAINS(read_records({{gz, InputFormat::text}}), "c4.json.gz: looks gzip-compressed");
  CHECK_ERROR_CONTAINS(read_records({{zst, InputFormat::jsonl}}, 2), "c4.jsonl.zst: looks zstd-compressed");
}

TEST_CASE("documents become BOS + ids + EOS, concatenated in input order") {
  TempDir dir;
  const std::string a = dir.write("a.txt", "first file");
  const std::string b = dir.write("b.jsonl", "{\"text\": \"x\\u00e9\"}\n{\"text\": \"\"}\n{\"text\": \"last\"}\n");
  const std::string c = dir.write("c.txt", "third");
  const std::vector<InputSource> sources{{a, InputFormat::text}, {b, InputFormat::jsonl}, {c, InputFormat::text}};

  Ids expected;
  for (const char* t : {"first file", "x\xc3\xa9", "", "last", "third"}) append(expected, byte_ids(t));
  TokenizeStats stats;
  CHECK(tokenize_files(sources, {}, &stats) == expected);
  CHECK(stats.documents == 5);
  CHECK(stats.tokens == expected.size());
  CHECK(stats.input_bytes == fs::file_size(a) + fs::file_size(b) + fs::file_size(c));

  TokenizeOptions no_bos;
  no_bos.encode.bos = false;
  Ids without_bos;
  for (const char* t : {"first file", "x\xc3\xa9", "", "last", "third"}) append(without_bos, byte_ids(t, false, true));
  CHECK(tokenize_files(sources, no_bos) == without_bos);

  TokenizeOptions neither = no_bos;
  neither.encode.eos = false;
  CHECK(tokenize_files(sources, neither) == byte_ids("first filex\xc3\xa9lastthird", false, false));

  // Another field.
  const std::string d = dir.write("d.jsonl", "{\"body\": \"B\", \"text\": \"T\"}\n");
  TokenizeOptions body;
  body.field = "body";
  CHECK(tokenize_files({{d, InputFormat::jsonl}}, body) == byte_ids("B"));
}

TEST_CASE("the ids do not depend on the thread count or the batch size") {
  TempDir dir;
  std::vector<InputSource> sources;
  Ids expected;
  int n = 0;
  for (int f = 0; f < 4; ++f) {
    std::string jsonl;
    for (int i = 0; i < 150; ++i, ++n) {
      const std::string text = doc_text(n);
      jsonl += nlohmann::json{{"id", n}, {"text", text}}.dump() + "\n";
      append(expected, byte_ids(text));
    }
    sources.push_back({dir.write("part" + std::to_string(f) + ".jsonl", jsonl), InputFormat::jsonl});
    const std::string text = "a text file between JSON files, number " + std::to_string(f);
    sources.push_back({dir.write("between" + std::to_string(f) + ".txt", text), InputFormat::text});
    append(expected, byte_ids(text));
    ++n;
  }
  // (threads, batch bytes): one document per batch, a few dozen, everything in one batch.
  const std::pair<unsigned, std::uint64_t> runs[] = {{1, 1}, {3, 1}, {1, 5000}, {2, 5000}, {8, 5000}, {17, 5000},
                                                     {1, 32u << 20}, {2, 32u << 20}, {3, 32u << 20}, {17, 32u << 20}};
  for (auto [threads, batch_bytes] : runs) {
    CAPTURE(threads);
    CAPTURE(batch_bytes);
    TokenizeOptions o;
    o.threads = threads;
    o.batch_bytes = batch_bytes;
    TokenizeProgress progress;
    DocumentReader reader(sources);
    ByteTokenizer tok;
    Ids ids;
    std::size_t calls = 0;
    TokenizeStats stats = tokenize_sources(
        reader, tok, o,
        [&](std::span<const std::uint32_t> part) {
          ++calls;
          ids.insert(ids.end(), part.begin(), part.end());
        },
        &progress);
    CHECK(ids == expected);
    CHECK(stats.documents == static_cast<std::uint64_t>(n));
    CHECK(stats.tokens == expected.size());
    CHECK(progress.documents.load() == stats.documents);
    CHECK(progress.tokens.load() == stats.tokens);
    CHECK(progress.input_bytes.load() == stats.input_bytes);
    CHECK(stats.input_bytes == *reader.total_bytes());
    if (batch_bytes == 1) CHECK(calls >= static_cast<std::size_t>(n));  // one document per batch
  }
}

TEST_CASE("tokenize_batch keeps the order of the batch it is given") {
  DocumentBatch batch;
  const std::vector<InputSource> sources{{"mem.jsonl", InputFormat::jsonl}, {"mem.txt", InputFormat::text}};
  Ids expected;
  for (int i = 0; i < 200; ++i) {
    RawDocument d;
    const std::string text = doc_text(i);
    d.source = static_cast<std::uint32_t>(i % 2);
    d.bytes = i % 2 == 0 ? nlohmann::json{{"text", text}}.dump() : text;
    d.line = i % 2 == 0 ? static_cast<std::uint64_t>(i + 1) : 0;
    batch.bytes += d.bytes.size();
    batch.docs.push_back(std::move(d));
    append(expected, byte_ids(text));
  }
  ByteTokenizer tok;
  for (unsigned threads : {1u, 4u, 64u}) {
    TokenizeOptions o;
    o.threads = threads;
    Ids ids;
    auto stats = tokenize_batch(batch, sources, tok, o,
                                [&](std::span<const std::uint32_t> p) { ids.insert(ids.end(), p.begin(), p.end()); });
    CHECK(ids == expected);
    CHECK(stats.documents == 200);
  }
  // An empty batch gives nothing and calls no sink.
  bool called = false;
  auto stats = tokenize_batch(DocumentBatch{}, sources, tok, {}, [&](std::span<const std::uint32_t>) { called = true; });
  CHECK(stats.documents == 0);
  CHECK_FALSE(called);
}

TEST_CASE("the first bad line in input order is reported, whatever the thread count") {
  TempDir dir;
  std::string jsonl;
  for (int line = 1; line <= 400; ++line) {
    if (line == 137) jsonl += "{\"url\": \"no text here\"}\n";
    else if (line == 300) jsonl += "{\"text\": 5}\n";  // a later error, never the one reported
    else jsonl += nlohmann::json{{"text", doc_text(line)}}.dump() + "\n";
  }
  const std::string bad = dir.write("bad.jsonl", jsonl);
  const std::string good = dir.write("good.txt", "fine");
  for (unsigned threads : {1u, 2u, 5u, 16u}) {
    for (std::uint64_t batch_bytes : {std::uint64_t{1}, std::uint64_t{3000}, std::uint64_t{32} << 20}) {
      CAPTURE(threads);
      CAPTURE(batch_bytes);
      TokenizeOptions o;
      o.threads = threads;
      o.batch_bytes = batch_bytes;
      CHECK_ERROR_CONTAINS(tokenize_files({{good, InputFormat::text}, {bad, InputFormat::jsonl}}, o),
                           "bad.jsonl:137: no \"text\" field (the object has \"url\")");
    }
  }
  // A bad line comes before a compressed file that follows it, even when the reader
  // meets the compressed file while the bad line's batch is still being tokenized.
  const std::string early = dir.write("early.jsonl", "{\"text\": \"ok\"}\n[\"array\"]\n");
  const std::string gz = dir.write("later.gz", std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00", 8));
  TokenizeOptions o;
  o.batch_bytes = 1u << 20;
  CHECK_ERROR_CONTAINS(tokenize_files({{early, InputFormat::jsonl}, {gz, InputFormat::text}}, o),
                       "early.jsonl:2: expected a JSON object, found array");
  CHECK_ERROR_CONTAINS(tokenize_files({{good, InputFormat::text}, {gz, InputFormat::text}}, o),
                       "later.gz: looks gzip-compressed");
}

TEST_CASE("a tokenizer failure names the document's file and line") {
  TempDir dir;
  const std::string j = dir.write("j.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"BOOM\"}\n");
  const std::string t = dir.write("t.txt", "text with BOOM inside");
  RefusingTokenizer tok;
  for (unsigned threads : {1u, 3u}) {
    TokenizeOptions o;
    o.threads = threads;
    DocumentReader r1({{j, InputFormat::jsonl}});
    CHECK_ERROR_CONTAINS(tokenize_all(r1, tok, o), "j.jsonl:2: cannot tokenize: refused a document");
    DocumentReader r2({{t, InputFormat::text}});
    CHECK_ERROR_CONTAINS(tokenize_all(r2, tok, o), "t.txt: cannot tokenize: refused a document");
  }
}

TEST_CASE("document_text decodes by the source's format") {
  RawDocument d;
  d.bytes = R"({"text": "caf\u00e9"})";
  d.line = 3;
  CHECK(document_text(d, {"x.jsonl", InputFormat::jsonl}, "text") == "caf\xc3\xa9");
  CHECK(document_text(d, {"x.txt", InputFormat::text}, "text") == d.bytes);
  CHECK_ERROR_CONTAINS(document_text(d, {"-", InputFormat::jsonl}, "body"), "<stdin>:3: no \"body\" field");
}

TEST_CASE("progress and summary lines") {
  const std::string half = progress_line(1'350'000'000, 2'700'000'000ull, 310'200'000, 10.0, 120);
  CHECK(half.find("[###############...............]  50%") == 0);
  CHECK(half.find("1.35 GB / 2.70 GB") != std::string::npos);
  CHECK(half.find("310.20M tokens") != std::string::npos);
  CHECK(half.find("135.0 MB/s") != std::string::npos);
  CHECK(half.find("31.02M tokens/s") != std::string::npos);
  CHECK(half.find("ETA 0:10") != std::string::npos);
  CHECK(half.size() <= 120);

  const std::string narrow = progress_line(500, 1000, 10, 1.0, 40);
  CHECK(narrow.find(" 50%  500 B / 1.0 kB") == 0);  // no room for a bar
  CHECK(narrow.size() == 40);

  const std::string done = progress_line(1000, 1000, 10, 1.0, 120);
  CHECK(done.find("100%") != std::string::npos);
  CHECK(done.find("ETA") == std::string::npos);

  const std::string streaming = progress_line(2'500'000, std::nullopt, 1234, 2.0, 120);
  CHECK(streaming == "2.5 MB read | 1234 tokens | 1.2 MB/s | 617 tokens/s");

  TokenizeStats stats;
  stats.documents = 1000;
  stats.tokens = 250000;
  stats.input_bytes = 1200000;
  CHECK(summary_line(stats, 0.5) == "1000 documents, 250000 tokens from 1200000 bytes in 0.50 s (500000 tokens/s, 2.4 MB/s)");
  stats.documents = 1;
  CHECK(summary_line(stats, 0.5).find("1 document, 250000 tokens") == 0);
}

}  // namespace test_tokenize

namespace test_tokenize {

TEST_CASE("chat data: conversations in order, each with its loss mask, whatever the thread count") {
  TempDir dir("tessera-tokenize-chat");
  const std::string path = (dir.path / "chat.jsonl").string();
  std::string text;
  std::vector<std::vector<tessera::io::ChatMessage>> conversations;
  for (int i = 0; i < 40; ++i) {
    conversations.push_back({{"user", "question " + std::to_string(i)}, {"assistant", "answer " + doc_text(i)}});
    text += R"({"messages": [{"role": "user", "content": ")" + conversations.back()[0].content +
            R"("}, {"role": "assistant", "content": ")" + conversations.back()[1].content + "\"}]}\n";
    if (i % 9 == 0) text += "\n";  // blank lines are skipped
  }
  {
    std::ofstream out(path, std::ios::binary);
    out << text;
  }
  tessera::io::TokenStream want;
  for (const auto& c : conversations) {
    auto t = tessera::io::chat_tokens(tessera::io::ChatFormat::llama2, ByteTokenizer{}, c, "x");
    want.ids.insert(want.ids.end(), t.ids.begin(), t.ids.end());
    want.loss_mask.insert(want.loss_mask.end(), t.loss_mask.begin(), t.loss_mask.end());
  }
  for (unsigned threads : {1u, 3u}) {
    TokenizeOptions o;
    o.threads = threads;
    o.batch_bytes = 700;  // many batches
    o.chat = tessera::io::ChatFormat::llama2;
    DocumentReader reader({InputSource{path, InputFormat::jsonl}});
    TokenizeStats stats;
    const tessera::io::TokenStream got = tokenize_stream(reader, ByteTokenizer{}, o, &stats);
    CHECK(got.ids == want.ids);
    CHECK(got.loss_mask == want.loss_mask);
    CHECK(stats.documents == 40);
  }
  // A bad conversation is named by file and line, the first in input order.
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out << R"({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]})" << "\n";
    out << "{not json\n";
  }
  TokenizeOptions o;
  o.threads = 2;
  o.chat = tessera::io::ChatFormat::llama2;
  DocumentReader reader({InputSource{path, InputFormat::jsonl}});
  CHECK_ERROR_CONTAINS(tokenize_stream(reader, ByteTokenizer{}, o), path + ":46: message 2 has role 'robot'");
  // Chat data needs a sink that takes the mask, and JSON lines.
  DocumentReader again({InputSource{path, InputFormat::jsonl}});
  CHECK_ERROR_CONTAINS(tokenize_all(again, ByteTokenizer{}, o), "chat data carries a loss mask");
  DocumentReader text_reader({InputSource{path, InputFormat::text}});
  CHECK_ERROR_CONTAINS(tokenize_stream(text_reader, ByteTokenizer{}, o), "chat data is JSON lines");
}

}  // namespace test_tokenize
