// Tokenizing a corpus: text and JSON lines files -> one ordered stream of token ids.
//
// Sources. A plain text file is one document: the whole file, its bytes as they are. A
// JSON lines file (".jsonl", or ".json" holding one object per line, as C4 ships them)
// holds one document per line: the string field `field` ("text") of a JSON object. Blank
// lines are skipped. "-" names standard input. Compressed files are refused by their
// magic bytes, so gzip data is never tokenized as text by mistake.
//
// Streaming. DocumentReader reads the sources in order and hands out batches of raw
// records (a whole text file, or one undecoded JSON line, with its 1-based line number)
// up to a byte budget, so a corpus larger than memory is never held whole; only a single
// text document must fit. JSON is decoded in the worker threads, next to the tokenizer:
// on many cores one decoding thread would be the bottleneck.
//
// Order. tokenize_batch cuts a batch into parts of consecutive records and lets the
// workers take the parts in order from a shared counter; each part's ids are kept apart
// and handed on in part order. The stream therefore does not depend on the number of
// threads. Workers stop taking parts after a failure, and every part before the failed
// one has been taken already, so the error reported is the first bad record in input
// order, whatever the thread count. tokenize_sources reads batch k + 1 while batch k is
// tokenized and passes each batch's ids to a sink, in order.
//
// Tokenizer::encode is called concurrently from several threads on one const tokenizer.
//
// Chat data. With TokenizeOptions::chat set, each JSON line is a conversation
// ({"messages": [...]}, io/chat.hpp) and becomes its ids in that chat format with a loss
// mask over the assistants' replies; the mask travels beside the ids to a MaskedTokenSink.
//
// Errors name the file and, for JSON lines, the line: "c4.jsonl:17: no \"text\" field".
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"
#include "tessera/core/units.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/token_shard.hpp"  // TokenStream
#include "tessera/io/tokenizer.hpp"

namespace tessera::data {

// ---------------------------------------------------------------------------------
// Sources and records.

enum class InputFormat : std::uint8_t { text, jsonl };

/// "text" or "jsonl".
constexpr std::string_view name_of(InputFormat f) { return f == InputFormat::text ? "text" : "jsonl"; }

/// The format a path's extension implies: ".jsonl" and ".json" are JSON lines, anything
/// else (".txt", none, "-") is text.
inline InputFormat input_format_of(std::string_view path) {
  auto ends_with = [&](std::string_view suffix) {
    return path.size() >= suffix.size() && path.substr(path.size() - suffix.size()) == suffix;
  };
  return ends_with(".jsonl") || ends_with(".json") ? InputFormat::jsonl : InputFormat::text;
}

struct InputSource {
  std::string path;  // "-" is standard input
  InputFormat format = InputFormat::text;

  bool is_stdin() const { return path == "-"; }
  /// The name errors use: the path, or "<stdin>".
  std::string name() const { return is_stdin() ? std::string("<stdin>") : path; }
};

/// One document as read, before decoding: a whole text file or one JSON line.
struct RawDocument {
  std::string bytes;
  std::uint32_t source = 0;      // index into the reader's sources
  std::uint64_t line = 0;        // 1-based line of a JSON line; 0 for a whole text file
  std::uint64_t input_bytes = 0; // input bytes it accounts for (its line, the newline, blank lines before it)
};

struct DocumentBatch {
  std::vector<RawDocument> docs;
  std::uint64_t bytes = 0;  // sum of docs[i].bytes.size()

  void clear() {
    docs.clear();
    bytes = 0;
  }
};

namespace detail {

/// The compression format whose magic bytes start `head`, or nullptr.
inline const char* compression_of(std::string_view head) {
  if (head.size() >= 2 && head[0] == '\x1f' && head[1] == '\x8b') return "gzip";
  if (head.size() >= 4 && head.substr(0, 4) == std::string_view("\x28\xb5\x2f\xfd", 4)) return "zstd";
  if (head.size() >= 6 && head.substr(0, 6) == std::string_view("\xfd" "7zXZ\0", 6)) return "xz";
  return nullptr;
}

inline bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

/// The part of a nlohmann parse error worth showing: without its "[json.exception...]"
/// prefix and the "line 1" a single-line parse always reports, and at most ~200 bytes.
inline std::string json_error_detail(const std::string& what) {
  std::string_view s = what;
  if (s.rfind("[json.exception.", 0) == 0) {
    const std::size_t close = s.find("] ");
    if (close != std::string_view::npos) s.remove_prefix(close + 2);
  }
  constexpr std::string_view prefix = "parse error at line 1, ";
  if (s.rfind(prefix, 0) == 0) s.remove_prefix(prefix.size());
  constexpr std::size_t max_chars = 200;
  std::string out(s.substr(0, max_chars));
  if (s.size() > max_chars) out += "...";
  return out;
}

}  // namespace detail

/// The document of one JSON line: the string field `field` of the object on it, its
/// escapes decoded ("\u00e9" becomes the UTF-8 bytes C3 A9). Throws naming
/// `name`:`line` when the line is not JSON, not an object, lacks the field, or the field
/// is not a string.
inline std::string json_document_text(std::string_view json_line, std::string_view field, const std::string& name,
                                      std::uint64_t line) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_line.begin(), json_line.end());
  } catch (const nlohmann::json::exception& e) {
    fail(name, ":", line, ": not valid JSON: ", detail::json_error_detail(e.what()));
  }
  if (!j.is_object()) {
    fail(name, ":", line, ": expected a JSON object, found ", j.type_name(),
         " (a JSON lines file holds one object per line)");
  }
  auto it = j.find(field);
  if (it == j.end()) {
    std::string keys;
    std::size_t shown = 0;
    for (auto k = j.begin(); k != j.end() && shown < 8; ++k, ++shown) {
      keys += (shown ? ", \"" : "\"") + k.key() + "\"";
    }
    if (j.size() > shown) keys += ", ...";
    fail(name, ":", line, ": no \"", field, "\" field (the object has ", keys.empty() ? "no fields" : keys, ")");
  }
  if (!it->is_string()) {
    fail(name, ":", line, ": field \"", field, "\" is ", it->type_name(), ", not a string");
  }
  return std::move(it->get_ref<std::string&>());
}

/// The text of a record read from `source`: a text document as it is, a JSON line decoded.
inline std::string document_text(const RawDocument& doc, const InputSource& source, std::string_view field) {
  if (source.format == InputFormat::text) return doc.bytes;
  return json_document_text(doc.bytes, field, source.name(), doc.line);
}

// ---------------------------------------------------------------------------------
// Reading.

/// Reads the records of its sources in order, in batches.
class DocumentReader {
 public:
  /// Checks every source up front (it exists, is not a directory, can be opened), so a
  /// mistyped name fails before any work. Throws naming the source.
  explicit DocumentReader(std::vector<InputSource> sources, std::size_t read_chunk_bytes = std::size_t{1} << 20)
      : sources_(std::move(sources)), chunk_(std::max<std::size_t>(read_chunk_bytes, 1)) {
    TESSERA_CHECK(!sources_.empty(), "no input files");
    TESSERA_CHECK(sources_.size() <= std::numeric_limits<std::uint32_t>::max(), "too many input files");
    std::uint64_t total = 0;
    bool known = true;
    bool seen_stdin = false;
    for (const InputSource& s : sources_) {
      if (s.is_stdin()) {
        TESSERA_CHECK(!seen_stdin, "standard input ('-') is given more than once");
        seen_stdin = true;
        known = false;
        continue;
      }
      std::error_code ec;
      const auto status = std::filesystem::status(s.path, ec);
      TESSERA_CHECK(std::filesystem::exists(status), s.path, ": no such file");
      TESSERA_CHECK(!std::filesystem::is_directory(status), s.path, ": is a directory, not a file");
      std::FILE* f = std::fopen(s.path.c_str(), "rb");
      if (f == nullptr) {
        const int err = errno;
        fail(s.path, ": cannot open for reading: ", std::strerror(err));
      }
      std::fclose(f);
      if (std::filesystem::is_regular_file(status)) {
        const std::uint64_t size = std::filesystem::file_size(s.path, ec);
        TESSERA_CHECK(!ec, s.path, ": cannot read its size: ", ec.message());
        total += size;
      } else {
        known = false;  // a pipe or a device: its size is not known in advance
      }
    }
    if (known) total_bytes_ = total;
  }

  ~DocumentReader() { close(); }
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  const std::vector<InputSource>& sources() const { return sources_; }

  /// The sum of the sources' sizes, when every source is a regular file.
  std::optional<std::uint64_t> total_bytes() const { return total_bytes_; }

  /// Input bytes read so far.
  std::uint64_t bytes_read() const { return bytes_read_; }

  /// Replaces `batch` with the next records, in order, until their bytes reach
  /// `max_bytes` (at least one record, however large). False when none is left.
  /// A source that fails after some records were read fails at the next call, so the
  /// records before it are tokenized (and their own errors reported) first.
  bool read_batch(DocumentBatch& batch, std::uint64_t max_bytes) {
    batch.clear();
    if (pending_error_) std::rethrow_exception(std::exchange(pending_error_, nullptr));
    RawDocument doc;
    while (batch.docs.empty() || batch.bytes < max_bytes) {
      try {
        if (!next(doc)) break;
      } catch (...) {
        if (batch.docs.empty()) throw;
        pending_error_ = std::current_exception();
        break;
      }
      batch.bytes += doc.bytes.size();
      batch.docs.push_back(std::move(doc));
      doc = RawDocument{};
    }
    return !batch.docs.empty();
  }

  /// The next record, or false when every source has been read.
  bool next(RawDocument& doc) {
    while (current_ < sources_.size()) {
      if (file_ == nullptr) open(current_);
      const InputSource& s = sources_[current_];
      if (s.format == InputFormat::text) {
        if (!text_done_) {
          doc.bytes.clear();
          while (fill()) {
          }
          doc.bytes = std::move(buffer_);
          buffer_.clear();
          doc.source = static_cast<std::uint32_t>(current_);
          doc.line = 0;
          doc.input_bytes = doc.bytes.size();
          text_done_ = true;
          return true;
        }
      } else if (next_line(doc)) {
        return true;
      }
      close();
      ++current_;
    }
    return false;
  }

 private:
  void open(std::size_t index) {
    const InputSource& s = sources_[index];
    if (s.is_stdin()) {
      file_ = stdin;
    } else {
      file_ = std::fopen(s.path.c_str(), "rb");
      if (file_ == nullptr) {
        const int err = errno;
        fail(s.path, ": cannot open for reading: ", std::strerror(err));
      }
    }
    buffer_.clear();
    pos_ = 0;
    line_ = 0;
    eof_ = false;
    text_done_ = false;
    checked_magic_ = false;
  }

  void close() {
    if (file_ != nullptr && file_ != stdin) std::fclose(file_);
    file_ = nullptr;
  }

  /// Appends up to one chunk of the current source to buffer_; false at its end.
  bool fill() {
    if (eof_) return false;
    const std::size_t old = buffer_.size();
    buffer_.resize(old + chunk_);
    const std::size_t n = std::fread(buffer_.data() + old, 1, chunk_, file_);
    buffer_.resize(old + n);
    bytes_read_ += n;
    if (n < chunk_) {
      if (std::ferror(file_)) {
        const int err = errno;
        fail(sources_[current_].name(), ": read error: ", std::strerror(err));
      }
      eof_ = true;
    }
    if (!checked_magic_ && (buffer_.size() >= 8 || eof_)) {
      checked_magic_ = true;
      if (const char* kind = detail::compression_of(buffer_)) {
        fail(sources_[current_].name(), ": looks ", kind, "-compressed (its first bytes are ", kind,
             "'s magic number); decompress it first");
      }
    }
    return n > 0;
  }

  /// The next non-blank line of the current JSON lines source, or false at its end.
  bool next_line(RawDocument& doc) {
    std::uint64_t skipped = 0;
    for (;;) {
      const std::size_t nl = buffer_.find('\n', pos_);
      const bool whole = nl != std::string::npos;
      if (!whole && !eof_) {
        // Keep the unfinished line, drop what was handed out, read on.
        buffer_.erase(0, pos_);
        pos_ = 0;
        fill();
        continue;
      }
      if (!whole && pos_ >= buffer_.size()) return false;  // end of the source
      const std::size_t end = whole ? nl : buffer_.size();
      const std::string_view line(buffer_.data() + pos_, end - pos_);
      const std::uint64_t span = line.size() + (whole ? 1 : 0);
      pos_ = whole ? nl + 1 : buffer_.size();
      ++line_;
      if (detail::is_blank(line)) {
        skipped += span;
        continue;
      }
      doc.bytes.assign(line);
      doc.source = static_cast<std::uint32_t>(current_);
      doc.line = line_;
      doc.input_bytes = skipped + span;
      return true;
    }
  }

  std::vector<InputSource> sources_;
  std::size_t chunk_;
  std::optional<std::uint64_t> total_bytes_;
  std::uint64_t bytes_read_ = 0;
  std::exception_ptr pending_error_;  // met by read_batch after it had records to return

  // The source being read.
  std::size_t current_ = 0;
  std::FILE* file_ = nullptr;
  std::string buffer_;
  std::size_t pos_ = 0;      // first byte of buffer_ not handed out yet
  std::uint64_t line_ = 0;   // lines handed out or skipped so far
  bool eof_ = false;
  bool text_done_ = false;
  bool checked_magic_ = false;
};

// ---------------------------------------------------------------------------------
// Tokenizing.

struct TokenizeOptions {
  io::EncodeOptions encode{true, true, false};  // BOS and EOS around every document
  std::string field = "text";                   // the JSON lines field holding the text
  unsigned threads = 0;                         // 0: std::thread::hardware_concurrency()
  std::uint64_t batch_bytes = std::uint64_t{32} << 20;  // text read ahead per batch
  // Chat data: JSON lines of conversations in this format, with a loss mask (BOS and
  // EOS are the format's, `encode` and `field` are not used).
  std::optional<io::ChatFormat> chat;
};

/// Counters the workers advance as they go, for a progress display on another thread.
struct TokenizeProgress {
  std::atomic<std::uint64_t> documents{0};
  std::atomic<std::uint64_t> tokens{0};
  std::atomic<std::uint64_t> input_bytes{0};
};

struct TokenizeStats {
  std::uint64_t documents = 0;
  std::uint64_t tokens = 0;
  std::uint64_t input_bytes = 0;  // bytes of the records tokenized, newlines and blank lines included
};

/// Receives the ids of consecutive documents, in input order.
using TokenSink = std::function<void(std::span<const std::uint32_t>)>;
/// The same with each id's loss mask value (empty for documents that have none: every
/// target counts; one per id for chat data).
using MaskedTokenSink = std::function<void(std::span<const std::uint32_t>, std::span<const std::uint8_t>)>;

/// The thread count `options` asks for: its own, or every core.
inline unsigned resolved_threads(const TokenizeOptions& options) {
  if (options.threads > 0) return options.threads;
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace detail {

/// One batch being tokenized: the workers start at construction; finish() waits for
/// them, rethrows the first failure in input order, and hands the ids to a sink.
class BatchRun {
 public:
  BatchRun(const DocumentBatch& batch, const std::vector<InputSource>& sources, const io::Tokenizer& tok,
           const TokenizeOptions& options, TokenizeProgress* progress)
      : batch_(batch), sources_(sources), tok_(tok), options_(options), progress_(progress) {
    split(resolved_threads(options));
    const std::size_t workers = std::min<std::size_t>(resolved_threads(options), parts_.size());
    try {
      for (std::size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
    } catch (...) {
      stop_.store(true);
      join();
      throw;
    }
  }

  ~BatchRun() {
    stop_.store(true);
    join();
  }
  BatchRun(const BatchRun&) = delete;
  BatchRun& operator=(const BatchRun&) = delete;

  TokenizeStats finish(const MaskedTokenSink& sink) {
    join();
    for (const Part& p : parts_) {
      if (p.error) std::rethrow_exception(p.error);
    }
    TokenizeStats stats;
    for (const Part& p : parts_) {
      stats.documents += p.end - p.begin;
      stats.tokens += p.ids.size();
      for (std::size_t d = p.begin; d < p.end; ++d) stats.input_bytes += batch_.docs[d].input_bytes;
      if (!p.ids.empty()) sink(std::span<const std::uint32_t>(p.ids), std::span<const std::uint8_t>(p.mask));
    }
    return stats;
  }

 private:
  struct Part {
    std::size_t begin = 0, end = 0;  // documents [begin, end) of the batch
    std::vector<std::uint32_t> ids;
    std::vector<std::uint8_t> mask;  // chat data only
    std::exception_ptr error;
  };

  /// Consecutive parts of about equal bytes, four per thread so that uneven documents
  /// still keep every thread busy.
  void split(unsigned threads) {
    const std::size_t n = batch_.docs.size();
    const std::size_t want = std::min<std::size_t>(n, std::size_t{4} * threads);
    if (want == 0) return;
    const std::uint64_t per_part = std::max<std::uint64_t>(1, batch_.bytes / want);
    Part part;
    std::uint64_t bytes = 0;
    for (std::size_t d = 0; d < n; ++d) {
      bytes += batch_.docs[d].bytes.size() + 1;
      if (bytes >= per_part || d + 1 == n) {
        part.end = d + 1;
        parts_.push_back(std::move(part));
        part = Part{};
        part.begin = d + 1;
        bytes = 0;
      }
    }
  }

  void work() {
    for (;;) {
      if (stop_.load(std::memory_order_relaxed)) return;
      const std::size_t i = next_.fetch_add(1);
      if (i >= parts_.size()) return;
      Part& p = parts_[i];
      try {
        for (std::size_t d = p.begin; d < p.end; ++d) {
          encode_into(batch_.docs[d], p);
          if (progress_ != nullptr) {
            progress_->documents.fetch_add(1, std::memory_order_relaxed);
            progress_->input_bytes.fetch_add(batch_.docs[d].input_bytes, std::memory_order_relaxed);
          }
        }
      } catch (...) {
        p.error = std::current_exception();
        stop_.store(true);
        return;
      }
    }
  }

  void encode_into(const RawDocument& doc, Part& part) const {
    const InputSource& source = sources_[doc.source];
    std::vector<std::uint32_t>& out = part.ids;
    std::vector<std::uint32_t> ids;
    if (options_.chat) {
      TESSERA_CHECK(source.format == InputFormat::jsonl, source.name(),
                    ": chat data is JSON lines of {\"messages\": [...]}, not a text file");
      const std::string where = tessera::detail::concat(source.name(), ":", doc.line);
      io::ChatTokens t =
          io::chat_tokens(*options_.chat, tok_, io::parse_chat_line(doc.bytes, source.name(), doc.line), where);
      ids = std::move(t.ids);
      part.mask.insert(part.mask.end(), t.loss_mask.begin(), t.loss_mask.end());
    } else if (source.format == InputFormat::text) {
      ids = encode(doc.bytes, source, doc);
    } else {
      ids = encode(json_document_text(doc.bytes, options_.field, source.name(), doc.line), source, doc);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    if (progress_ != nullptr) progress_->tokens.fetch_add(ids.size(), std::memory_order_relaxed);
  }

  std::vector<std::uint32_t> encode(std::string_view text, const InputSource& source, const RawDocument& doc) const {
    try {
      return tok_.encode(text, options_.encode);
    } catch (const std::exception& e) {
      if (doc.line > 0) fail(source.name(), ":", doc.line, ": cannot tokenize: ", e.what());
      fail(source.name(), ": cannot tokenize: ", e.what());
    }
  }

  void join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  const DocumentBatch& batch_;
  const std::vector<InputSource>& sources_;
  const io::Tokenizer& tok_;
  const TokenizeOptions& options_;
  TokenizeProgress* progress_;
  std::vector<Part> parts_;
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace detail

/// Tokenizes the documents of `batch` (read from `sources`) on options.threads threads
/// and passes their ids to `sink` in document order. Throws the first bad record's error.
inline TokenizeStats tokenize_batch(const DocumentBatch& batch, const std::vector<InputSource>& sources,
                                    const io::Tokenizer& tok, const TokenizeOptions& options,
                                    const MaskedTokenSink& sink, TokenizeProgress* progress = nullptr) {
  detail::BatchRun run(batch, sources, tok, options, progress);
  return run.finish(sink);
}

namespace detail {
/// A sink of ids alone, for documents without a loss mask.
inline MaskedTokenSink ids_only(const TokenSink& sink, const TokenizeOptions& options) {
  TESSERA_CHECK(!options.chat, "chat data carries a loss mask: tokenize it into a MaskedTokenSink");
  return [&sink](std::span<const std::uint32_t> ids, std::span<const std::uint8_t>) { sink(ids); };
}
}  // namespace detail

inline TokenizeStats tokenize_batch(const DocumentBatch& batch, const std::vector<InputSource>& sources,
                                    const io::Tokenizer& tok, const TokenizeOptions& options, const TokenSink& sink,
                                    TokenizeProgress* progress = nullptr) {
  return tokenize_batch(batch, sources, tok, options, detail::ids_only(sink, options), progress);
}

/// Every document of `reader`, tokenized in batches of options.batch_bytes of text; the
/// next batch is read while the current one is tokenized. The ids reach `sink` in input
/// order. Throws at the first bad record (in input order), naming its file and line.
inline TokenizeStats tokenize_sources(DocumentReader& reader, const io::Tokenizer& tok,
                                      const TokenizeOptions& options, const MaskedTokenSink& sink,
                                      TokenizeProgress* progress = nullptr) {
  TokenizeStats total;
  DocumentBatch current, next;
  bool more = reader.read_batch(current, options.batch_bytes);
  while (more) {
    std::exception_ptr read_error;
    TokenizeStats stats;
    {
      detail::BatchRun run(current, reader.sources(), tok, options, progress);
      try {
        more = reader.read_batch(next, options.batch_bytes);
      } catch (...) {
        read_error = std::current_exception();  // after this batch's own errors, which come first
      }
      stats = run.finish(sink);
    }
    if (read_error) std::rethrow_exception(read_error);
    total.documents += stats.documents;
    total.tokens += stats.tokens;
    total.input_bytes += stats.input_bytes;
    std::swap(current, next);
  }
  return total;
}

inline TokenizeStats tokenize_sources(DocumentReader& reader, const io::Tokenizer& tok,
                                      const TokenizeOptions& options, const TokenSink& sink,
                                      TokenizeProgress* progress = nullptr) {
  return tokenize_sources(reader, tok, options, detail::ids_only(sink, options), progress);
}

/// Every id of `reader`'s documents and, for chat data, its loss mask.
inline io::TokenStream tokenize_stream(DocumentReader& reader, const io::Tokenizer& tok,
                                       const TokenizeOptions& options, TokenizeStats* stats = nullptr) {
  io::TokenStream out;
  const TokenizeStats s = tokenize_sources(
      reader, tok, options, [&](std::span<const std::uint32_t> ids, std::span<const std::uint8_t> mask) {
        out.ids.insert(out.ids.end(), ids.begin(), ids.end());
        out.loss_mask.insert(out.loss_mask.end(), mask.begin(), mask.end());
      });
  if (stats != nullptr) *stats = s;
  return out;
}

/// All the ids of `reader`'s documents, in order (a convenience over tokenize_sources).
inline std::vector<std::uint32_t> tokenize_all(DocumentReader& reader, const io::Tokenizer& tok,
                                               const TokenizeOptions& options, TokenizeStats* stats = nullptr) {
  std::vector<std::uint32_t> ids;
  TokenizeStats s = tokenize_sources(reader, tok, options,
                                     [&](std::span<const std::uint32_t> part) { ids.insert(ids.end(), part.begin(), part.end()); });
  if (stats != nullptr) *stats = s;
  return ids;
}

// ---------------------------------------------------------------------------------
// Progress display.

/// One progress line: a bar and percentage when the total is known, bytes done, tokens,
/// and the rates, cut to `width` columns (a line that wraps cannot be redrawn in place);
/// the bar is dropped first.
///   "[#########...........]  45%  1.21 GB / 2.70 GB | 310.20M tokens | 85.1 MB/s | 21.33M tokens/s | ETA 0:17"
inline std::string progress_line(std::uint64_t bytes, std::optional<std::uint64_t> total, std::uint64_t tokens,
                                 double seconds, std::size_t width = 100) {
  const double secs = std::max(seconds, 1e-9);
  const double rate_bytes = static_cast<double>(bytes) / secs;
  std::string numbers;
  if (total) {
    numbers = decimal_bytes(static_cast<double>(bytes)) + " / " + decimal_bytes(static_cast<double>(*total));
  } else {
    numbers = decimal_bytes(static_cast<double>(bytes)) + " read";
  }
  numbers += " | " + count_text(static_cast<double>(tokens)) + " tokens | " + decimal_bytes(rate_bytes) +
             "/s | " + count_text(static_cast<double>(tokens) / secs) + " tokens/s";
  if (total && bytes > 0 && bytes < *total) {
    numbers += " | ETA " + clock_text(static_cast<double>(*total - bytes) / rate_bytes);
  }
  if (!total) return numbers.substr(0, width);
  const double fraction = *total == 0 ? 1.0 : std::min(1.0, static_cast<double>(bytes) / static_cast<double>(*total));
  char pct[8];
  std::snprintf(pct, sizeof pct, "%3d%%", static_cast<int>(fraction * 100.0));
  const std::size_t fixed = numbers.size() + 2 /* brackets */ + 1 + 4 /* " 100%" */ + 2;
  if (width < fixed + 10) return (std::string(pct) + "  " + numbers).substr(0, width);  // no room for a bar
  const std::size_t cells = std::min<std::size_t>(30, width - fixed);
  const auto filled = static_cast<std::size_t>(fraction * static_cast<double>(cells));
  return "[" + std::string(filled, '#') + std::string(cells - filled, '.') + "] " + pct + "  " + numbers;
}

/// The figures of a finished run:
///   "1000 documents, 250000 tokens from 1200000 bytes in 0.50 s (500000 tokens/s, 2.4 MB/s)"
inline std::string summary_line(const TokenizeStats& stats, double seconds) {
  const double secs = std::max(seconds, 1e-9);
  char s[256];
  std::snprintf(s, sizeof s, "%llu document%s, %llu tokens from %llu bytes in %.2f s (%.0f tokens/s, %s/s)",
                static_cast<unsigned long long>(stats.documents), stats.documents == 1 ? "" : "s",
                static_cast<unsigned long long>(stats.tokens),
                static_cast<unsigned long long>(stats.input_bytes), seconds,
                static_cast<double>(stats.tokens) / secs,
                decimal_bytes(static_cast<double>(stats.input_bytes) / secs).c_str());
  return s;
}

}  // namespace tessera::data
