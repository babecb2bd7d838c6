// A token shard read where it lies: the file mapped into memory, its windows copied out
// as a loader asks for them, so a corpus far larger than a host's memory trains, and the
// ranks of a node share one copy of it in the page cache.
//
// Everything read_token_stream checks is checked before a token is handed out, with the
// same messages naming the path. A version 3 shard (what llama-tokenize writes) is
// checked as it is read: open() checks the header, the exact size, the chunk table's
// CRC-32, every chunk's largest id against vocab_size and the mask's tail, which costs
// the same for a shard of any size; each chunk of 65536 tokens is checked (its CRC-32 and
// ids) the first time a read touches it, once. A shard of version 1 or 2 has one CRC for
// the whole payload, so open() checks it whole: one pass over the file, in pieces spread
// over a few threads (the pieces' CRCs joined by crc32_combine). Either way the pages a
// check reads are dropped from the process's resident set behind it (the page cache
// keeps them), and nothing but the largest id is kept.
// The file must not be changed while it is mapped: a later write would change the
// tokens under the run (a chunk not yet checked is then refused), and a truncation ends
// the process at the first read past the new end, naming the file (io/mapped_file.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"
#include "tessera/io/mapped_file.hpp"
#include "tessera/io/token_shard.hpp"

namespace tessera::io {

class MappedTokenShard {
 public:
  /// Maps the shard at `path` and checks it (version 3: its header and chunk table; the
  /// chunks as they are read); throws tessera::Error naming the path. For a shard of
  /// version 1 or 2, checked whole, `threads` bounds the threads the check runs on (0: up
  /// to 8, no more than the cores), each taking at least `min_piece_bytes` of ids.
  static MappedTokenShard open(const std::string& path, unsigned threads = 0,
                               std::uint64_t min_piece_bytes = std::uint64_t{64} << 20) {
    {
      std::ifstream probe;
      detail::open_token_shard(path, probe);  // "no such file", "not a regular file"
    }
    MappedTokenShard shard;
    shard.file_ = MappedFile::open(path);
    const auto* raw = reinterpret_cast<const unsigned char*>(shard.file_.data());
    const std::uint64_t size = shard.file_.size();
    TESSERA_CHECK(size >= token_shard_header_bytes, "token shard '", path, "': file is ", size,
                  " bytes, shorter than the ", token_shard_header_bytes, "-byte header");
    shard.header_ = detail::check_header(path, raw, size);
    if (shard.header_.chunked())
      shard.open_chunks();
    else
      shard.check(threads, std::max<std::uint64_t>(min_piece_bytes, 4));
    return shard;
  }

  const std::string& path() const { return file_.path(); }
  const TokenShardHeader& header() const { return header_; }
  /// Tokens in the shard.
  std::uint64_t size() const { return header_.count; }
  bool masked() const { return header_.loss_mask; }
  /// The largest id in the shard (0 for an empty one).
  std::uint32_t max_id() const { return max_id_; }

  /// Whether the shard's chunks are checked as they are read (version 3), rather than the
  /// whole file when it was opened (versions 1 and 2).
  bool checked_as_read() const { return header_.chunked(); }
  /// Chunks checked so far, of header().chunks() (0 for a shard checked whole at open).
  std::uint64_t chunks_checked() const {
    std::uint64_t n = 0;
    for (std::uint64_t w = 0; w < words(); ++w) n += static_cast<std::uint64_t>(std::popcount(checked_[w].load()));
    return n;
  }
  /// Checks every chunk not checked yet, on up to `threads` threads (0: up to 8, no more
  /// than the cores); throws at the first bad chunk, in the file's order. Nothing to do
  /// for a shard checked whole when it was opened.
  void check_all(unsigned threads = 0) const {
    const std::uint64_t chunks = header_.chunks();
    if (chunks == 0) return;
    if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
    const std::uint64_t pieces = std::min<std::uint64_t>(threads, chunks);
    run_pieces(pieces, [&](std::uint64_t p) {
      for (std::uint64_t k = chunks * p / pieces; k < chunks * (p + 1) / pieces; ++k) check_chunk(k);
    });
  }

  /// Copies tokens [first, first + n) into `ids` and, where `keep` is given, whether each
  /// counts as a target (1 everywhere for a shard without a loss mask).
  void read(std::uint64_t first, std::size_t n, std::uint32_t* ids, std::uint8_t* keep) const {
    TESSERA_CHECK(first <= header_.count && n <= header_.count - first, "token shard '", path(), "': tokens [",
                  first, ", ", first + n, ") are past its ", header_.count, " tokens");
    if (n == 0) return;
    check_chunks(first, n);
    const unsigned char* src = payload() + 4 * first;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(ids, src, 4 * n);
    } else {
      for (std::size_t i = 0; i < n; ++i) ids[i] = detail::load_u32_le(src + 4 * i);
    }
    if (!keep) return;
    if (!header_.loss_mask) {
      std::fill(keep, keep + n, std::uint8_t{1});
      return;
    }
    const unsigned char* bits = mask();
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint64_t k = first + i;
      keep[i] = (bits[k / 8] >> (k % 8)) & 1u;
    }
  }

  /// Whether any token of [first, first + n) counts as a target.
  bool any_target(std::uint64_t first, std::uint64_t n) const {
    if (n == 0) return false;
    if (!header_.loss_mask) return true;
    check_chunks(first, n);
    const unsigned char* bits = mask();
    std::uint64_t k = first;
    const std::uint64_t end = first + n;
    for (; k < end && k % 8 != 0; ++k)
      if ((bits[k / 8] >> (k % 8)) & 1u) return true;
    for (; k + 8 <= end; k += 8)
      if (bits[k / 8] != 0) return true;
    for (; k < end; ++k)
      if ((bits[k / 8] >> (k % 8)) & 1u) return true;
    return false;
  }

 private:
  const unsigned char* payload() const {
    return reinterpret_cast<const unsigned char*>(file_.data()) + token_shard_header_bytes;
  }
  const unsigned char* mask() const { return payload() + 4 * header_.count; }
  std::uint64_t words() const { return (header_.chunks() + 63) / 64; }

  // Version 3: the chunk table, checked against the header's CRC; the largest id from it;
  // a chunk whose largest id is not below vocab_size checked at once (its id and index
  // named); the mask's last byte. One bit per chunk says whether it has been checked.
  void open_chunks() {
    const auto* raw = reinterpret_cast<const unsigned char*>(file_.data());
    std::uint64_t first_wide = 0;
    table_ = detail::read_chunk_table(path(), header_, raw + header_.table_offset(), first_wide);
    checked_ = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(words()));
    for (const TokenShardChunk& c : table_) max_id_ = std::max(max_id_, c.max_id);
    if (first_wide < header_.chunks()) check_chunk(first_wide);  // throws: an id at or above vocab_size
    if (header_.mask_bytes() > 0) detail::check_mask_tail(path(), header_, mask()[header_.mask_bytes() - 1]);
  }

  // Checks the chunks that tokens [first, first + n) touch and have not been checked.
  void check_chunks(std::uint64_t first, std::uint64_t n) const {
    if (!header_.chunked()) return;
    for (std::uint64_t k = first / token_shard_chunk_tokens; k <= (first + n - 1) / token_shard_chunk_tokens; ++k)
      if (((checked_[k / 64].load(std::memory_order_acquire) >> (k % 64)) & 1u) == 0) check_chunk(k);
  }

  // Checks chunk k against its table entry, marks it checked, and drops the pages the
  // check read from the resident set (a window's read maps back the few it copies).
  // Two threads may check one chunk at once: both read the same bytes.
  void check_chunk(std::uint64_t k) const {
    const auto [first, n] = detail::chunk_tokens(header_, k);
    detail::check_chunk(path(), header_, k, payload() + 4 * first, header_.loss_mask ? mask() + first / 8 : nullptr,
                        table_[static_cast<std::size_t>(k)]);
    checked_[k / 64].fetch_or(std::uint64_t{1} << (k % 64), std::memory_order_release);
    file_.drop(static_cast<std::size_t>(token_shard_header_bytes + 4 * first), static_cast<std::size_t>(4 * n));
    if (header_.loss_mask)
      file_.drop(static_cast<std::size_t>(header_.mask_offset() + first / 8), static_cast<std::size_t>((n + 7) / 8));
  }

  // Runs piece(p) for p in [0, pieces), each on its own thread when there are several;
  // rethrows the first piece's error (in piece order) once all have finished.
  template <class Piece>
  static void run_pieces(std::uint64_t pieces, Piece&& piece) {
    if (pieces <= 1) {
      if (pieces == 1) piece(0);
      return;
    }
    std::vector<std::thread> workers;
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(pieces));
    workers.reserve(errors.size());
    for (std::uint64_t p = 0; p < pieces; ++p)
      workers.emplace_back([&, p] {
        try {
          piece(p);
        } catch (...) {
          errors[static_cast<std::size_t>(p)] = std::current_exception();
        }
      });
    for (auto& w : workers) w.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  // Versions 1 and 2: one pass over the payload: CRC-32, every id below vocab_size, the
  // largest id. The ids are split into pieces of whole ids, one thread each; the mask's
  // CRC follows theirs.
  void check(unsigned threads, std::uint64_t min_piece_bytes) {
    const std::uint64_t count = header_.count;
    const std::uint64_t id_bytes = 4 * count;
    if (threads == 0) threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
    const std::uint64_t pieces =
        std::max<std::uint64_t>(1, std::min<std::uint64_t>(threads, id_bytes / min_piece_bytes));
    struct Piece {
      std::uint64_t first = 0, count = 0;  // ids
      std::uint32_t crc = 0, max_id = 0;
      std::uint64_t bad_index = ~std::uint64_t{0};  // the first id not below vocab_size
      std::uint32_t bad_id = 0;
    };
    std::vector<Piece> part(static_cast<std::size_t>(pieces));
    for (std::uint64_t p = 0; p < pieces; ++p) {
      part[p].first = count * p / pieces;
      part[p].count = count * (p + 1) / pieces - part[p].first;
    }
    const std::uint32_t vocab = header_.vocab_size;
    auto scan = [&](Piece& piece) {
      const unsigned char* src = payload() + 4 * piece.first;
      constexpr std::uint64_t chunk = 1 << 14;  // ids: the CRC and the id check share a cache-resident chunk
      std::uint32_t buf[chunk];
      for (std::uint64_t done = 0; done < piece.count; done += chunk) {
        const auto n = static_cast<std::size_t>(std::min(chunk, piece.count - done));
        piece.crc = crc32_update(piece.crc, src + 4 * done, 4 * n);
        if constexpr (std::endian::native == std::endian::little) {
          std::memcpy(buf, src + 4 * done, 4 * n);
        } else {
          for (std::size_t i = 0; i < n; ++i) buf[i] = detail::load_u32_le(src + 4 * (done + i));
        }
        std::uint32_t top = piece.max_id;
        for (std::size_t i = 0; i < n; ++i) top = std::max(top, buf[i]);
        piece.max_id = top;
        // Every 16 MiB read, the pages behind are dropped from the resident set (the page
        // cache keeps them): opening a shard leaves the process no larger.
        constexpr std::uint64_t drop_every = 256;
        const std::uint64_t index = done / chunk;
        if (index % drop_every == drop_every - 1 || done + n == piece.count) {
          const std::uint64_t from = token_shard_header_bytes + 4 * (piece.first + (index / drop_every) * drop_every * chunk);
          file_.drop(static_cast<std::size_t>(from),
                     static_cast<std::size_t>(token_shard_header_bytes + 4 * (piece.first + done + n) - from));
        }
        if (top >= vocab && piece.bad_index == ~std::uint64_t{0}) {
          for (std::size_t i = 0; i < n; ++i)
            if (buf[i] >= vocab) {
              piece.bad_index = piece.first + done + i, piece.bad_id = buf[i];
              break;
            }
        }
      }
    };
    run_pieces(pieces, [&](std::uint64_t p) { scan(part[static_cast<std::size_t>(p)]); });
    std::uint32_t crc = 0;
    for (const Piece& piece : part) crc = crc32_combine(crc, piece.crc, 4 * piece.count);
    const std::uint64_t mask_bytes = header_.mask_bytes();
    if (mask_bytes > 0) crc = crc32_update(crc, mask(), static_cast<std::size_t>(mask_bytes));
    TESSERA_CHECK(crc == header_.crc32, "token shard '", path(), "': corrupt: payload CRC-32 is 0x", detail::hex(crc),
                  ", header says 0x", detail::hex(header_.crc32));
    for (const Piece& piece : part) {
      TESSERA_CHECK(piece.bad_index == ~std::uint64_t{0}, "token shard '", path(), "': token id ", piece.bad_id,
                    " at index ", piece.bad_index, " is not below vocab_size ", vocab);
      max_id_ = std::max(max_id_, piece.max_id);
    }
    if (mask_bytes > 0) detail::check_mask_tail(path(), header_, mask()[mask_bytes - 1]);
  }

  MappedFile file_;
  TokenShardHeader header_;
  std::uint32_t max_id_ = 0;
  std::vector<TokenShardChunk> table_;                    // version 3: the chunk table
  std::unique_ptr<std::atomic<std::uint64_t>[]> checked_;  // version 3: a bit per chunk, set once checked
};

}  // namespace tessera::io
