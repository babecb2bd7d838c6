// llama-tokenize: text and JSON lines files -> one token shard, on every core.
//
//   llama-tokenize --tokenizer SPEC --output FILE.bin [--threads N] [--no-bos] [--no-eos]
//                  [--field text] [--format auto|text|jsonl] [--chat auto|llama3|llama2]
//                  INPUT...
//
// A text file is one document; a .jsonl/.json file holds one document per line in the
// field "text". Each document becomes BOS + ids + EOS; documents are concatenated in
// input order (the same shard for any --threads) and written atomically. With --chat,
// each JSON line is a conversation ({"messages": [...]}) in that chat format
// (io/chat.hpp), and the shard carries a loss mask over the assistants' replies.
//
//   llama-tokenize --write-synthetic-chat FILE.jsonl [--conversations N] [--first K]
//
// writes the embedded chat set (data/synthetic_chat.hpp), conversations K .. K + N - 1,
// as such JSON lines: a chat set to fine-tune on with nothing downloaded.
//
//   llama-tokenize --import FILE... (--vocab-size N | --tokenizer SPEC) --output FILE.bin
//
// makes a token shard of ids tokenized elsewhere: NumPy .npy arrays and llm.c's token
// files (io/token_arrays.hpp), in the order given, the ids as they are (each checked
// below the vocabulary).
//
//   llama-tokenize --check SHARD... [--threads N]
//   llama-tokenize --upgrade SHARD... [--threads N]
//
// --check checks token shards whole (every chunk's CRC-32 and ids, or a version 1 or 2
// shard's single CRC), as a training run checks them chunk by chunk as it reads: a corpus
// copied to a cluster checked before the run that needs it. --upgrade rewrites version 1
// and 2 shards as version 3 (the same tokens and mask, with a chunk table), each checked
// first and replaced whole, so that a run opens them without reading them. While it runs,
// a progress bar goes to stderr when stderr is a terminal; a summary line always
// follows. docs/tokenize.md has the details.
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tessera/data/synthetic_chat.hpp"
#include "tessera/data/tokenize.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_arrays.hpp"
#include "tessera/io/token_shard.hpp"
#include "flags.hpp"

using namespace tessera;

namespace {

void usage() {
  std::printf(
      "usage: llama-tokenize --tokenizer SPEC --output FILE.bin [options] INPUT...\n\n"
      "Tokenizes text and JSON lines files into one token shard, documents in input order.\n\n"
      "  --tokenizer SPEC   'byte', 'synthetic_bpe', or a tokenizer file or directory (tiktoken,\n"
      "                     SentencePiece or tokenizer.json)\n"
      "  --output FILE      the token shard to write (replaced whole, only on success)\n"
      "  --threads N        worker threads (default: every core, %u here)\n"
      "  --no-bos           do not put BOS before each document\n"
      "  --no-eos           do not put EOS after each document\n"
      "  --field NAME       the JSON field holding a document's text (default: text)\n"
      "  --format F         auto (default: .jsonl/.json are JSON lines, anything else text),\n"
      "                     text or jsonl for every input\n"
      "  --chat FORMAT      chat data: each JSON line is {\"messages\": [{\"role\": ..., \"content\":\n"
      "                     ...}, ...]}, tokenized in FORMAT (llama3, llama2, or auto: llama3\n"
      "                     when the tokenizer has its header tokens); the shard gets a loss\n"
      "                     mask so that training learns the assistants' replies only\n"
      "  INPUT              a text file (one document), a .jsonl/.json file (one document per\n"
      "                     line), or - for standard input\n\n"
      "       llama-tokenize --write-synthetic-chat FILE.jsonl [--conversations N] [--first K]\n\n"
      "Writes the embedded chat set, conversations K .. K + N - 1 (default 0 .. 1999), as JSON\n"
      "lines of {\"messages\": [...]}: arithmetic questions and repetitions in the embedded\n"
      "corpus's words.\n\n"
      "       llama-tokenize --import FILE... (--vocab-size N | --tokenizer SPEC) --output FILE.bin\n\n"
      "Makes a token shard of ids tokenized elsewhere, in the order given, as they are (no BOS or\n"
      "EOS added): NumPy .npy files (one dimension of 2, 4 or 8-byte integers, numpy.save of a\n"
      "token array) and llm.c's token files (GPT-2's uint16, Llama 3's uint32). Every id must be\n"
      "below the vocabulary size, given or the tokenizer's.\n\n"
      "       llama-tokenize --check SHARD... [--threads N]\n\n"
      "Checks token shards whole, on N threads (default: every core, up to 8): every chunk's\n"
      "CRC-32 and ids (a version 1 or 2 shard: its one CRC), which a training run checks as it\n"
      "reads them. A line per shard; the first bad one is named, with exit status 1.\n\n"
      "       llama-tokenize --upgrade SHARD... [--threads N]\n\n"
      "Rewrites version 1 and 2 shards as version 3 (the same tokens and mask, with a CRC per\n"
      "chunk, which a run checks as it reads instead of reading the whole file at its start),\n"
      "each checked first and replaced whole; a version 3 shard is left as it is.\n",
      std::max(1u, std::thread::hardware_concurrency()));
}


std::size_t terminal_columns() {
  struct winsize w {};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &w) == 0 && w.ws_col > 0) return w.ws_col;
  return 100;
}

/// Redraws the progress line on stderr at most ten times a second until stopped.
class ProgressBar {
 public:
  ProgressBar(const data::TokenizeProgress& progress, std::optional<std::uint64_t> total)
      : progress_(progress), total_(total), start_(clock::now()), thread_([this] { loop(); }) {}

  ~ProgressBar() { stop(); }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      stopped_ = true;
    }
    wake_.notify_all();
    thread_.join();
    std::fprintf(stderr, "\r\033[2K");
    std::fflush(stderr);
  }

 private:
  using clock = std::chrono::steady_clock;

  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stopped_; })) {
      const double seconds = std::chrono::duration<double>(clock::now() - start_).count();
      const std::string line = data::progress_line(progress_.input_bytes.load(), total_, progress_.tokens.load(),
                                                   seconds, terminal_columns() - 1);
      std::fprintf(stderr, "\r\033[2K%s", line.c_str());
      std::fflush(stderr);
    }
  }

  const data::TokenizeProgress& progress_;
  std::optional<std::uint64_t> total_;
  clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopped_ = false;
  std::thread thread_;  // last: starts once the rest is ready
};


/// --write-synthetic-chat: the embedded chat set as JSON lines, written whole or not at all.
int write_synthetic_chat(const std::vector<std::string>& args) {
  std::string path;
  std::int64_t count = 2000, first = 0;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    TESSERA_CHECK(a == "--write-synthetic-chat" || a == "--conversations" || a == "--first", "unknown option '", a,
                  "' with --write-synthetic-chat (it takes --conversations and --first)");
    TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
    const std::string& v = args[++i];
    if (a == "--write-synthetic-chat") path = v;
    else if (a == "--conversations") count = cli::parse_number<std::int64_t>(a, v, "a whole number >= 0", 0);
    else first = cli::parse_number<std::int64_t>(a, v, "a whole number >= 0", 0);
  }
  TESSERA_CHECK(count > 0, "--conversations: at least one conversation");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TESSERA_CHECK(out.is_open(), path, ": cannot open '", tmp, "' for writing");
    for (std::int64_t i = first; i < first + count; ++i) out << data::chat_json_line(data::synthetic_conversation(0, i)) << '\n';
    out.close();
    TESSERA_CHECK(out.good(), path, ": writing '", tmp, "' failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  TESSERA_CHECK(!ec, path, ": cannot rename '", tmp, "' to it: ", ec.message());
  std::fprintf(stderr, "llama-tokenize: wrote conversations %lld .. %lld of the embedded chat set to %s\n",
               static_cast<long long>(first), static_cast<long long>(first + count - 1), path.c_str());
  return 0;
}

/// --check and --upgrade (`option`): each shard checked whole, and with --upgrade one of
/// version 1 or 2 rewritten as version 3; a line for each.
int shard_tool(const std::vector<std::string>& args, const std::string& option) {
  unsigned threads = 0;
  std::vector<std::string> shards;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == option) continue;
    if (a == "--threads") {
      TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
      threads = cli::parse_number<unsigned>(a, args[++i], "a whole number from 1 to 4096", 1, 4096);
      continue;
    }
    TESSERA_CHECK(a.empty() || a[0] != '-', "unknown option '", a, "' with ", option, " (it takes --threads)");
    shards.push_back(a);
  }
  TESSERA_CHECK(!shards.empty(), option, ": no token shards named");
  for (const std::string& path : shards) {
    const auto start = std::chrono::steady_clock::now();
    const io::MappedTokenShard shard = io::MappedTokenShard::open(path, threads);
    shard.check_all(threads);
    const io::TokenShardHeader& h = shard.header();
    auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    if (option == "--check") {
      std::fprintf(stderr, "llama-tokenize: %s: good: %llu tokens, ids up to %u (vocab_size %u)%s, version %u%s, %.2f s\n",
                   path.c_str(), static_cast<unsigned long long>(h.count), shard.max_id(), h.vocab_size,
                   h.loss_mask ? ", a loss mask" : "", h.version,
                   h.chunked() ? (", " + std::to_string(h.chunks()) + (h.chunks() == 1 ? " chunk" : " chunks")).c_str() : "",
                   seconds());
      continue;
    }
    if (h.chunked()) {
      std::fprintf(stderr, "llama-tokenize: %s: already version 3, left as it is\n", path.c_str());
      continue;
    }
    // The new file is written beside the old one and renamed over it: the old inode stays
    // mapped (and whole) until this shard is let go, and a failure leaves it in place.
    io::TokenShardWriter out(path, h.vocab_size, h.loss_mask);
    constexpr std::size_t block = std::size_t{1} << 20;
    std::vector<std::uint32_t> ids(block);
    std::vector<std::uint8_t> keep(block);
    for (std::uint64_t first = 0; first < h.count; first += block) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(block, h.count - first));
      shard.read(first, n, ids.data(), h.loss_mask ? keep.data() : nullptr);
      if (h.loss_mask)
        out.append(std::span<const std::uint32_t>(ids.data(), n), std::span<const std::uint8_t>(keep.data(), n));
      else
        out.append(std::span<const std::uint32_t>(ids.data(), n));
    }
    out.commit();
    const io::TokenShardHeader now = io::read_token_shard_header(path);
    std::fprintf(stderr, "llama-tokenize: %s: version %u -> %u (%llu tokens, %llu chunks), %.2f s\n", path.c_str(),
                 h.version, now.version, static_cast<unsigned long long>(now.count),
                 static_cast<unsigned long long>(now.chunks()), seconds());
  }
  return 0;
}

/// --import: token id files (io::TokenArrayReader) into one shard, in order, as they are.
int import_tokens(const std::vector<std::string>& args) {
  std::string output, tokenizer_spec;
  std::uint64_t vocab_size = 0;
  std::vector<std::string> files;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--import") continue;
    if (a == "--output" || a == "--vocab-size" || a == "--tokenizer") {
      TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
      const std::string& v = args[++i];
      if (a == "--output") output = v;
      else if (a == "--tokenizer") tokenizer_spec = v;
      else vocab_size = cli::parse_number<std::uint64_t>(a, v, "a whole number from 1 to 4294967295", 1, 4294967295ull);
      continue;
    }
    TESSERA_CHECK(a.empty() || a[0] != '-', "unknown option '", a,
                  "' with --import (it takes --output, --vocab-size and --tokenizer)");
    files.push_back(a);
  }
  TESSERA_CHECK(!output.empty(), "--output: required (the token shard to write)");
  TESSERA_CHECK(!files.empty(), "--import: no files of token ids named");
  TESSERA_CHECK((vocab_size > 0) != !tokenizer_spec.empty(),
                "--import: give the vocabulary size, --vocab-size N or --tokenizer SPEC (one of them)");
  if (!tokenizer_spec.empty()) {
    const std::unique_ptr<io::Tokenizer> tok = data::make_tokenizer(tokenizer_spec);
    TESSERA_CHECK(tok->vocab_size() > 0 && tok->vocab_size() <= std::numeric_limits<std::uint32_t>::max(),
                  "tokenizer '", tokenizer_spec, "': vocabulary size ", tok->vocab_size(),
                  " does not fit a token shard's u32 field");
    vocab_size = static_cast<std::uint64_t>(tok->vocab_size());
  }
  // Every file's header is read before the shard is begun: a bad one fails at once.
  std::vector<io::TokenArrayReader> readers;
  readers.reserve(files.size());
  for (const std::string& f : files) readers.emplace_back(f);
  const auto start = std::chrono::steady_clock::now();
  io::TokenShardWriter shard(output, static_cast<std::uint32_t>(vocab_size));
  std::vector<std::uint32_t> ids(std::size_t{1} << 20);
  std::uint64_t total = 0;
  for (io::TokenArrayReader& r : readers) {
    while (const std::size_t n = r.read(ids, vocab_size)) shard.append(std::span<const std::uint32_t>(ids.data(), n));
    std::fprintf(stderr, "llama-tokenize: %s: %llu ids (%s)\n", r.path().c_str(),
                 static_cast<unsigned long long>(r.count()), r.description().c_str());
    total += r.count();
  }
  TESSERA_CHECK(total > 0, files.size() == 1 ? files.front() : "the files", ": no ids, so no token shard is written");
  shard.commit();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "llama-tokenize: %llu ids from %zu file%s, vocab_size %llu, %.2f s -> %s\n",
               static_cast<unsigned long long>(total), files.size(), files.size() == 1 ? "" : "s",
               static_cast<unsigned long long>(vocab_size), seconds, output.c_str());
  return 0;
}

int run(const std::vector<std::string>& args) {
  if (std::find(args.begin(), args.end(), "--write-synthetic-chat") != args.end()) return write_synthetic_chat(args);
  if (std::find(args.begin(), args.end(), "--import") != args.end()) return import_tokens(args);
  for (const char* option : {"--check", "--upgrade"})
    if (std::find(args.begin(), args.end(), option) != args.end()) return shard_tool(args, option);
  std::string tokenizer_spec, output, format = "auto", chat;
  data::TokenizeOptions options;
  std::vector<std::string> inputs;
  bool options_done = false, field_given = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (options_done || a == "-" || a.empty() || a[0] != '-') {
      inputs.push_back(a);
      continue;
    }
    if (a == "--") {
      options_done = true;
    } else if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (a == "--no-bos") {
      options.encode.bos = false;
    } else if (a == "--no-eos") {
      options.encode.eos = false;
    } else if (a == "--tokenizer" || a == "--output" || a == "--threads" || a == "--field" || a == "--format" ||
               a == "--chat") {
      TESSERA_CHECK(i + 1 < args.size(), a, ": missing value");
      const std::string& v = args[++i];
      if (a == "--tokenizer") {
        tokenizer_spec = v;
      } else if (a == "--output") {
        output = v;
      } else if (a == "--threads") {
        options.threads = cli::parse_number<unsigned>(a, v, "a whole number from 1 to 4096", 1, 4096);
      } else if (a == "--field") {
        options.field = v;
        field_given = true;
      } else if (a == "--chat") {
        chat = v;
      } else {
        format = v;
      }
    } else {
      fail("unknown option '", a, "' (see --help)");
    }
  }
  TESSERA_CHECK(!tokenizer_spec.empty(), "--tokenizer: required ('byte' or a tokenizer file)");
  TESSERA_CHECK(!output.empty(), "--output: required (the token shard to write)");
  TESSERA_CHECK(format == "auto" || format == "text" || format == "jsonl", "--format: expected auto, text or jsonl, got '",
                format, "'");
  TESSERA_CHECK(!options.field.empty(), "--field: the field name is empty");
  TESSERA_CHECK(!inputs.empty(), "no input files (give text or .jsonl files, or - for standard input)");

  // Everything that can be checked before the work starts is checked now.
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(!fs::is_directory(output, ec), output, ": is a directory; --output names the shard file to write");
  const fs::path parent = fs::path(output).parent_path();
  TESSERA_CHECK(parent.empty() || fs::is_directory(parent, ec), output, ": its directory ", parent.string(),
                " does not exist");
  std::vector<data::InputSource> sources;
  for (const std::string& path : inputs) {
    data::InputFormat f = format == "auto" ? data::input_format_of(path)
                          : format == "jsonl" ? data::InputFormat::jsonl
                                              : data::InputFormat::text;
    sources.push_back({path, f});
  }
  data::DocumentReader reader(std::move(sources));
  const std::unique_ptr<io::Tokenizer> tok = data::make_tokenizer(tokenizer_spec);
  TESSERA_CHECK(tok->vocab_size() > 0 && tok->vocab_size() <= std::numeric_limits<std::uint32_t>::max(),
                "tokenizer '", tokenizer_spec, "': vocabulary size ", tok->vocab_size(),
                " does not fit a token shard's u32 field");
  options.threads = data::resolved_threads(options);
  if (!chat.empty()) {
    options.chat = io::resolve_chat_format(chat, *tok, "--chat");
    TESSERA_CHECK(format != "text", "--chat: chat data is JSON lines, not --format text");
    TESSERA_CHECK(!field_given, "--field: chat data is read from each line's \"messages\"; --field names the text "
                  "field of JSON lines of documents");
    for (const data::InputSource& s : reader.sources())
      TESSERA_CHECK(s.format == data::InputFormat::jsonl, s.name(),
                    ": chat data is JSON lines of {\"messages\": [...]} (name the file .jsonl or give --format jsonl)");
  }

  // Ids stream into OUTPUT.tmp as they come (memory stays at two batches of text); the
  // shard replaces OUTPUT only once every document has succeeded, and a failed run
  // removes the temporary file.
  const auto start = std::chrono::steady_clock::now();
  data::TokenizeProgress progress;
  io::TokenShardWriter shard(output, static_cast<std::uint32_t>(tok->vocab_size()), options.chat.has_value());
  data::TokenizeStats stats;
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  {
    std::optional<ProgressBar> bar;
    if (tty) bar.emplace(progress, reader.total_bytes());
    stats = data::tokenize_sources(
        reader, *tok, options,
        [&](std::span<const std::uint32_t> ids, std::span<const std::uint8_t> mask) {
          if (options.chat)
            shard.append(ids, mask);
          else
            shard.append(ids);
        },
        &progress);
  }
  // An empty shard would only fail later, in the DataLoader of the run that reads it.
  TESSERA_CHECK(stats.tokens > 0, inputs.size() == 1 ? inputs.front() : "the inputs", ": no documents",
                options.chat ? " (no conversations)" : "", ", so no token shard is written");
  shard.commit();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::fprintf(stderr, "llama-tokenize: %s, %u thread%s -> %s%s\n", data::summary_line(stats, seconds).c_str(),
               options.threads, options.threads == 1 ? "" : "s", output.c_str(),
               options.chat ? (" (chat format " + std::string(io::name_of(*options.chat)) + ", with a loss mask)").c_str()
                            : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-tokenize: error: %s\n", e.what());
    return 1;
  }
}
