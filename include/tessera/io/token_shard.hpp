// Token shards: a tokenized corpus as one flat file of uint32 token ids, with an
// optional loss mask.
//
// Layout (all little-endian; docs/formats.md is the reference):
//   offset  0  8 bytes  magic "TSRATOKS"
//   offset  8  u32      version: 3 (what the writers write), 1 or 2 (read, and written
//                       on request: TokenShardLayout::whole)
//   offset 12  u32      vocab_size: every id in the payload is below it
//   offset 16  u64      count: number of tokens
//   offset 24  u32      version 3: CRC-32 (IEEE) of the chunk table; versions 1 and 2:
//                       of the payload bytes (ids, then the mask's)
//   offset 28  u32      flags: bit 0 set when a loss mask follows (version 1: 0, version
//                       2: 1; version 3: either)
//   offset 32  count x u32 token ids
//   then, with a mask: ceil(count / 8) bytes of loss mask: bit i % 8 of byte i / 8 is
//              set when token i counts as a target (chat data: the assistant's
//              replies); the unused high bits of the last byte are 0
//   version 3, last: the chunk table, one 8-byte entry per chunk of 65536 tokens (the
//              last chunk may be shorter): u32 CRC-32 of the chunk's id bytes followed
//              by its mask bytes, u32 the chunk's largest id
//
// The chunk table lets a reader check a shard as it reads it: io::MappedTokenShard checks
// the table when it opens a shard (its CRC, every chunk's largest id against vocab_size)
// and each chunk the first time a window touches it, so opening a corpus of any size
// costs the same. read_token_stream checks every chunk. write_token_shard checks every id
// against vocab_size before it writes anything; TokenShardWriter streams ids in as they
// come. Both write to `path + ".tmp"` and rename, so a reader never sees a half-written
// shard at `path`. The readers check everything the header claims (magic, version,
// flags, exact file size, CRCs, ids below vocab_size) and throw tessera::Error with one
// line naming the path (and, for a chunk, its tokens).
#pragma once

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"

namespace tessera::io {

inline constexpr std::string_view token_shard_magic = "TSRATOKS";
inline constexpr std::uint32_t token_shard_version = 1;          // ids only, a CRC of the payload
inline constexpr std::uint32_t token_shard_masked_version = 2;   // ids and a loss mask, a CRC of the payload
inline constexpr std::uint32_t token_shard_chunked_version = 3;  // ids, a loss mask or not, a chunk table
inline constexpr std::uint32_t token_shard_flag_loss_mask = 1;
inline constexpr std::uint64_t token_shard_header_bytes = 32;
/// Tokens in each chunk of a version 3 shard (the last may hold fewer): 256 KiB of ids,
/// 8 KiB of mask, so a window's first read checks a few chunks, not the file.
inline constexpr std::uint64_t token_shard_chunk_tokens = 65536;
inline constexpr std::uint64_t token_shard_chunk_entry_bytes = 8;

/// How a writer lays a shard out: `chunked` (version 3, a CRC per chunk: what tessera
/// writes) or `whole` (versions 1 and 2, one CRC over the payload, for readers that
/// predate version 3).
enum class TokenShardLayout { chunked, whole };

struct TokenShardHeader {
  std::uint32_t version = 0;
  std::uint32_t vocab_size = 0;  // every id is below it
  std::uint64_t count = 0;       // number of tokens in the payload
  std::uint32_t crc32 = 0;       // version 3: CRC-32 of the chunk table; 1 and 2: of the payload
  bool loss_mask = false;        // a loss mask follows the ids

  bool chunked() const { return version == token_shard_chunked_version; }
  /// Bytes of the loss mask: ceil(count / 8), or 0 without one.
  std::uint64_t mask_bytes() const { return loss_mask ? (count + 7) / 8 : 0; }
  /// Chunks in the chunk table: ceil(count / token_shard_chunk_tokens), or 0 before version 3.
  std::uint64_t chunks() const {
    return chunked() ? (count + token_shard_chunk_tokens - 1) / token_shard_chunk_tokens : 0;
  }
  std::uint64_t table_bytes() const { return token_shard_chunk_entry_bytes * chunks(); }
  /// The file's size: the header, the ids, the mask and the chunk table.
  std::uint64_t file_bytes() const { return token_shard_header_bytes + 4 * count + mask_bytes() + table_bytes(); }
  /// Where the mask (if any) and the chunk table (version 3) start in the file.
  std::uint64_t mask_offset() const { return token_shard_header_bytes + 4 * count; }
  std::uint64_t table_offset() const { return mask_offset() + mask_bytes(); }
};

/// One entry of a version 3 shard's chunk table.
struct TokenShardChunk {
  std::uint32_t crc32 = 0;   // of the chunk's id bytes, then its mask bytes
  std::uint32_t max_id = 0;  // the chunk's largest id
};

/// A token stream and which of its tokens count as targets: loss_mask[i] is 1 when
/// token i may be predicted (a chat's assistant replies), 0 when it may not (the
/// prompt); an empty mask means every token counts.
struct TokenStream {
  std::vector<std::uint32_t> ids;
  std::vector<std::uint8_t> loss_mask;

  bool masked() const { return !loss_mask.empty(); }
};

namespace detail {
/// `value` in lowercase hexadecimal digits, without a prefix (a CRC in a message).
inline std::string hex(std::uint32_t value) {
  char digits[8];
  return std::string(digits, std::to_chars(digits, digits + sizeof digits, value, 16).ptr);
}

inline void store_u32_le(unsigned char* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline void store_u64_le(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
inline std::uint32_t load_u32_le(const unsigned char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
inline std::uint64_t load_u64_le(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

/// Opens `path` for reading and returns its size; throws when it is missing or not a file.
inline std::uint64_t open_token_shard(const std::string& path, std::ifstream& in) {
  std::error_code ec;
  auto status = std::filesystem::status(path, ec);
  TESSERA_CHECK(std::filesystem::exists(status), "token shard '", path, "': no such file");
  TESSERA_CHECK(std::filesystem::is_regular_file(status), "token shard '", path, "': not a regular file");
  std::uint64_t size = std::filesystem::file_size(path, ec);
  TESSERA_CHECK(!ec, "token shard '", path, "': cannot read its size: ", ec.message());
  in.open(path, std::ios::binary);
  TESSERA_CHECK(in.is_open(), "token shard '", path, "': cannot open for reading");
  return size;
}

/// Checks the 32-byte header `raw` of a shard of `size` bytes: magic, version, reserved
/// field, vocab_size, and that the file holds exactly `count` ids.
inline TokenShardHeader check_header(const std::string& path, const unsigned char* raw, std::uint64_t size) {
  TESSERA_CHECK(size >= token_shard_header_bytes, "token shard '", path, "': file is ", size,
                " bytes, shorter than the ", token_shard_header_bytes, "-byte header");
  TESSERA_CHECK(std::memcmp(raw, token_shard_magic.data(), token_shard_magic.size()) == 0, "token shard '",
                path, "': not a tessera token shard (bad magic)");
  TokenShardHeader header;
  header.version = load_u32_le(raw + 8);
  header.vocab_size = load_u32_le(raw + 12);
  header.count = load_u64_le(raw + 16);
  header.crc32 = load_u32_le(raw + 24);
  const std::uint32_t flags = load_u32_le(raw + 28);
  TESSERA_CHECK(header.version >= token_shard_version && header.version <= token_shard_chunked_version,
                "token shard '", path, "': unsupported version ", header.version, " (this reader knows versions ",
                token_shard_version, ", ", token_shard_masked_version, " and ", token_shard_chunked_version, ")");
  if (header.version == token_shard_version) {
    TESSERA_CHECK(flags == 0, "token shard '", path, "': reserved header field is ", flags, ", expected 0");
  } else if (header.version == token_shard_masked_version) {
    TESSERA_CHECK(flags == token_shard_flag_loss_mask, "token shard '", path, "': version 2 flags are ", flags,
                  ", expected ", token_shard_flag_loss_mask, " (a loss mask follows the ids)");
  } else {
    TESSERA_CHECK(flags <= token_shard_flag_loss_mask, "token shard '", path, "': version 3 flags are ", flags,
                  ", expected 0 or ", token_shard_flag_loss_mask, " (a loss mask follows the ids)");
  }
  header.loss_mask = (flags & token_shard_flag_loss_mask) != 0;
  TESSERA_CHECK(header.vocab_size > 0, "token shard '", path, "': vocab_size is 0");
  // Past this many tokens the ids, mask and table overflow a 64-bit size.
  constexpr std::uint64_t max_count = (std::numeric_limits<std::uint64_t>::max() - token_shard_header_bytes) / 8;
  TESSERA_CHECK(header.count <= max_count, "token shard '", path, "': truncated: header claims ",
                header.count, " tokens, more than any file can hold; file is ", size, " bytes");
  const std::uint64_t expected = header.file_bytes();
  const std::string layout = tessera::detail::concat(
      "32-byte header + 4 x ", header.count, " tokens",
      header.loss_mask ? tessera::detail::concat(" + ", header.mask_bytes(), " bytes of loss mask") : std::string(),
      header.chunked() ? tessera::detail::concat(" + ", header.chunks(), " chunk table entries of 8 bytes")
                       : std::string());
  TESSERA_CHECK(size >= expected, "token shard '", path, "': truncated: expected ", expected, " bytes (", layout,
                "), found ", size);
  TESSERA_CHECK(size == expected, "token shard '", path, "': ", size - expected, " trailing bytes: expected ",
                expected, " bytes (", layout, "), found ", size);
  return header;
}

/// The tokens [first, first + count) of chunk `k`.
inline std::pair<std::uint64_t, std::uint64_t> chunk_tokens(const TokenShardHeader& header, std::uint64_t k) {
  const std::uint64_t first = k * token_shard_chunk_tokens;
  return {first, std::min(token_shard_chunk_tokens, header.count - first)};
}

/// The chunk table at `raw` (header.table_bytes() bytes), checked against the header's
/// CRC, every chunk's largest id below vocab_size. Returns the entries; an entry whose
/// largest id is not below vocab_size is left for `check_chunk` to name the id (its
/// index: the first such chunk is returned in `first_wide`, or chunks() when none is).
inline std::vector<TokenShardChunk> read_chunk_table(const std::string& path, const TokenShardHeader& header,
                                                     const unsigned char* raw, std::uint64_t& first_wide) {
  const std::uint32_t crc = crc32(raw, static_cast<std::size_t>(header.table_bytes()));
  TESSERA_CHECK(crc == header.crc32, "token shard '", path, "': corrupt: the chunk table's CRC-32 is 0x", hex(crc),
                ", header says 0x", hex(header.crc32));
  std::vector<TokenShardChunk> table(static_cast<std::size_t>(header.chunks()));
  first_wide = header.chunks();
  for (std::size_t k = 0; k < table.size(); ++k) {
    table[k].crc32 = load_u32_le(raw + token_shard_chunk_entry_bytes * k);
    table[k].max_id = load_u32_le(raw + token_shard_chunk_entry_bytes * k + 4);
    if (table[k].max_id >= header.vocab_size && first_wide == header.chunks()) first_wide = k;
  }
  return table;
}

/// Checks chunk `k` of a version 3 shard: `ids` its id bytes as stored, `mask` its mask
/// bytes (null without a mask), against its entry in the chunk table. The failures, in
/// order: the CRC ("corrupt", naming the chunk and its tokens), an id not below
/// vocab_size (naming it and its index), a largest id other than the table's.
inline void check_chunk(const std::string& path, const TokenShardHeader& header, std::uint64_t k,
                        const unsigned char* ids, const unsigned char* mask, const TokenShardChunk& entry) {
  const auto [first, n] = chunk_tokens(header, k);
  std::uint32_t crc = crc32(ids, static_cast<std::size_t>(4 * n));
  if (mask) crc = crc32_update(crc, mask, static_cast<std::size_t>((n + 7) / 8));
  TESSERA_CHECK(crc == entry.crc32, "token shard '", path, "': corrupt: chunk ", k, " (tokens [", first, ", ",
                first + n, ")) has CRC-32 0x", hex(crc), ", the chunk table says 0x", hex(entry.crc32));
  // The largest id, through a cache-resident buffer in host order (a loop the compiler
  // vectorises, where loading each id byte by byte would not).
  std::uint32_t top = 0;
  std::uint32_t buf[4096];
  for (std::uint64_t done = 0; done < n; done += 4096) {
    const auto m = static_cast<std::size_t>(std::min<std::uint64_t>(4096, n - done));
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(buf, ids + 4 * done, 4 * m);
    } else {
      for (std::size_t i = 0; i < m; ++i) buf[i] = load_u32_le(ids + 4 * (done + i));
    }
    for (std::size_t i = 0; i < m; ++i) top = std::max(top, buf[i]);
  }
  if (top >= header.vocab_size) {
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint32_t id = load_u32_le(ids + 4 * i);
      TESSERA_CHECK(id < header.vocab_size, "token shard '", path, "': token id ", id, " at index ", first + i,
                    " is not below vocab_size ", header.vocab_size);
    }
  }
  TESSERA_CHECK(top == entry.max_id, "token shard '", path, "': corrupt: chunk ", k, " (tokens [", first, ", ",
                first + n, ")) has largest id ", top, ", the chunk table says ", entry.max_id);
}

/// Checks that no mask bit is set past the last token (`last` the mask's last byte).
inline void check_mask_tail(const std::string& path, const TokenShardHeader& header, unsigned char last) {
  const std::uint64_t used = header.count % 8;
  TESSERA_CHECK(used == 0 || (last >> used) == 0, "token shard '", path,
                "': the loss mask's last byte has bits set past the last token");
}

/// Reads and checks the header of an open shard of `size` bytes (check_header).
inline TokenShardHeader read_checked_header(const std::string& path, std::ifstream& in, std::uint64_t size) {
  TESSERA_CHECK(size >= token_shard_header_bytes, "token shard '", path, "': file is ", size,
                " bytes, shorter than the ", token_shard_header_bytes, "-byte header");
  unsigned char raw[token_shard_header_bytes];
  in.read(reinterpret_cast<char*>(raw), token_shard_header_bytes);
  TESSERA_CHECK(in.gcount() == static_cast<std::streamsize>(token_shard_header_bytes), "token shard '",
                path, "': cannot read the header");
  return check_header(path, raw, size);
}

}  // namespace detail

/// Writes a token shard in pieces, so a tokenizer's output never has to be held in
/// memory: ids are appended as they come and the header's count and CRC, and the chunk
/// table, are filled in by commit(). A shard with a loss mask (`with_loss_mask`) takes
/// each id's mask bit with it; the bits (an eighth of a byte per token) are held until
/// commit() writes them after the ids. Until then the shard lives at `path + ".tmp"`; a
/// writer destroyed without commit() (an error, an exception) removes it, so `path` is
/// either left as it was or replaced by a complete shard. `layout` chooses version 3
/// (chunked, the default) or versions 1 and 2 (whole: one CRC, for older readers).
class TokenShardWriter {
 public:
  TokenShardWriter(std::string path, std::uint32_t vocab_size, bool with_loss_mask = false,
                   TokenShardLayout layout = TokenShardLayout::chunked)
      : path_(std::move(path)), tmp_(path_ + ".tmp"), vocab_size_(vocab_size), masked_(with_loss_mask),
        chunked_(layout == TokenShardLayout::chunked) {
    TESSERA_CHECK(vocab_size > 0, "write_token_shard '", path_, "': vocab_size must be positive");
    out_.open(tmp_, std::ios::binary | std::ios::trunc);
    if (!out_.is_open()) {
      std::error_code ec;
      const auto parent = std::filesystem::path(tmp_).parent_path();
      const bool missing_dir = !parent.empty() && !std::filesystem::is_directory(parent, ec);
      fail("write_token_shard '", path_, "': cannot open '", tmp_, "' for writing",
           missing_dir ? " (its directory does not exist)" : "");
    }
    unsigned char header[token_shard_header_bytes] = {};  // count and CRC come at commit()
    std::memcpy(header, token_shard_magic.data(), token_shard_magic.size());
    const std::uint32_t version =
        chunked_ ? token_shard_chunked_version : masked_ ? token_shard_masked_version : token_shard_version;
    detail::store_u32_le(header + 8, version);
    detail::store_u32_le(header + 12, vocab_size_);
    detail::store_u32_le(header + 28, masked_ ? token_shard_flag_loss_mask : 0);
    out_.write(reinterpret_cast<const char*>(header), token_shard_header_bytes);
  }
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;
  ~TokenShardWriter() {
    if (committed_) return;
    out_.close();
    std::error_code ignored;
    std::filesystem::remove(tmp_, ignored);
  }

  /// Appends `ids` to a shard without a loss mask; each must be below vocab_size (the
  /// error gives its index in the shard).
  void append(std::span<const std::uint32_t> ids) {
    TESSERA_CHECK(!masked_, "write_token_shard '", path_, "': the shard has a loss mask: append ids with their mask");
    append_ids(ids);
  }

  /// Appends `ids` and their loss mask (`mask[i]` nonzero: token i counts as a target)
  /// to a shard with a loss mask.
  void append(std::span<const std::uint32_t> ids, std::span<const std::uint8_t> mask) {
    TESSERA_CHECK(masked_, "write_token_shard '", path_, "': the shard has no loss mask (open it with_loss_mask)");
    TESSERA_CHECK(mask.size() == ids.size(), "write_token_shard '", path_, "': ", ids.size(), " ids but ",
                  mask.size(), " mask values");
    const std::uint64_t first = count_;
    append_ids(ids);
    mask_bits_.resize(static_cast<std::size_t>((count_ + 7) / 8), 0);
    for (std::size_t i = 0; i < mask.size(); ++i) {
      const std::uint64_t k = first + i;
      if (mask[i]) mask_bits_[static_cast<std::size_t>(k / 8)] |= static_cast<std::uint8_t>(1u << (k % 8));
    }
  }

  std::uint64_t count() const { return count_; }

  /// Writes the loss mask (if any) and the chunk table (version 3), completes the header,
  /// closes the file and renames it to `path`.
  void commit() {
    TESSERA_CHECK(!committed_, "write_token_shard '", path_, "': committed twice");
    if (masked_) {
      out_.write(reinterpret_cast<const char*>(mask_bits_.data()), static_cast<std::streamsize>(mask_bits_.size()));
      crc_ = crc32_update(crc_, mask_bits_.data(), mask_bits_.size());
    }
    if (chunked_) {
      // Each chunk's CRC runs on from its ids over its mask bytes (a chunk is a whole
      // number of mask bytes: token_shard_chunk_tokens is a multiple of 8).
      if (count_ % token_shard_chunk_tokens != 0) table_.push_back(open_chunk_);
      std::vector<unsigned char> table(token_shard_chunk_entry_bytes * table_.size());
      for (std::size_t k = 0; k < table_.size(); ++k) {
        if (masked_) {
          const std::size_t from = k * (token_shard_chunk_tokens / 8);
          const std::size_t bytes = std::min<std::size_t>(token_shard_chunk_tokens / 8, mask_bits_.size() - from);
          table_[k].crc32 = crc32_update(table_[k].crc32, mask_bits_.data() + from, bytes);
        }
        detail::store_u32_le(table.data() + token_shard_chunk_entry_bytes * k, table_[k].crc32);
        detail::store_u32_le(table.data() + token_shard_chunk_entry_bytes * k + 4, table_[k].max_id);
      }
      out_.write(reinterpret_cast<const char*>(table.data()), static_cast<std::streamsize>(table.size()));
      crc_ = crc32(table.data(), table.size());
    }
    unsigned char fields[12];
    detail::store_u64_le(fields, count_);
    detail::store_u32_le(fields + 8, crc_);
    out_.seekp(16);
    out_.write(reinterpret_cast<const char*>(fields), sizeof fields);
    out_.close();
    std::error_code ec;
    if (!out_) fail("write_token_shard '", path_, "': writing '", tmp_, "' failed (disk full?)");
    std::filesystem::rename(tmp_, path_, ec);
    if (ec) fail("write_token_shard '", path_, "': cannot rename '", tmp_, "' to it: ", ec.message());
    committed_ = true;
  }

 private:
  void append_ids(std::span<const std::uint32_t> ids) {
    TESSERA_CHECK(!committed_, "write_token_shard '", path_, "': append after commit");
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TESSERA_CHECK(ids[i] < vocab_size_, "write_token_shard '", path_, "': token id ", ids[i], " at index ",
                    count_ + i, " is not below vocab_size ", vocab_size_);
    }
    // In pieces that fit the staging buffer and end at a chunk's end at the latest.
    for (std::size_t begin = 0; begin < ids.size();) {
      const std::uint64_t room = token_shard_chunk_tokens - count_ % token_shard_chunk_tokens;
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>({staging_tokens, ids.size() - begin, room}));
      for (std::size_t i = 0; i < n; ++i) detail::store_u32_le(staging_.data() + 4 * i, ids[begin + i]);
      out_.write(reinterpret_cast<const char*>(staging_.data()), static_cast<std::streamsize>(4 * n));
      if (chunked_) {
        open_chunk_.crc32 = crc32_update(open_chunk_.crc32, staging_.data(), 4 * n);
        for (std::size_t i = 0; i < n; ++i) open_chunk_.max_id = std::max(open_chunk_.max_id, ids[begin + i]);
      } else {
        crc_ = crc32_update(crc_, staging_.data(), 4 * n);
      }
      count_ += n, begin += n;
      if (chunked_ && count_ % token_shard_chunk_tokens == 0) {
        table_.push_back(open_chunk_);
        open_chunk_ = {};
      }
    }
  }

  static constexpr std::size_t staging_tokens = 16384;
  std::string path_, tmp_;
  std::uint32_t vocab_size_;
  bool masked_, chunked_;
  std::ofstream out_;
  std::uint64_t count_ = 0;
  std::uint32_t crc_ = 0;                 // whole: the payload's; chunked: the table's, at commit()
  std::vector<TokenShardChunk> table_;    // chunked: the full chunks' entries (CRCs of their ids so far)
  TokenShardChunk open_chunk_;            // chunked: the chunk being filled
  bool committed_ = false;
  std::vector<unsigned char> staging_ = std::vector<unsigned char>(4 * staging_tokens);  // little-endian
  std::vector<std::uint8_t> mask_bits_;  // the loss mask, packed, until commit()
};

/// Writes `tokens` as a token shard at `path`, by way of `path + ".tmp"` and a rename.
/// Every id must be below `vocab_size`; nothing is written otherwise.
inline void write_token_shard(const std::string& path, std::span<const std::uint32_t> tokens,
                              std::uint32_t vocab_size, TokenShardLayout layout = TokenShardLayout::chunked) {
  TESSERA_CHECK(vocab_size > 0, "write_token_shard '", path, "': vocab_size must be positive");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TESSERA_CHECK(tokens[i] < vocab_size, "write_token_shard '", path, "': token id ", tokens[i],
                  " at index ", i, " is not below vocab_size ", vocab_size);
  }
  TokenShardWriter w(path, vocab_size, false, layout);
  w.append(tokens);
  w.commit();
}

/// The header of the shard at `path`, checked against the file's size (the payload is
/// not read, so its CRCs and ids are not checked: read_token_shard does that).
inline TokenShardHeader read_token_shard_header(const std::string& path) {
  std::ifstream in;
  std::uint64_t size = detail::open_token_shard(path, in);
  return detail::read_checked_header(path, in, size);
}

/// Writes `stream` (ids and, when it has one, its loss mask) as a token shard at `path`.
inline void write_token_shard(const std::string& path, const TokenStream& stream, std::uint32_t vocab_size,
                              TokenShardLayout layout = TokenShardLayout::chunked) {
  if (!stream.masked()) return write_token_shard(path, stream.ids, vocab_size, layout);
  TESSERA_CHECK(stream.loss_mask.size() == stream.ids.size(), "write_token_shard '", path, "': ", stream.ids.size(),
                " ids but ", stream.loss_mask.size(), " mask values");
  TokenShardWriter w(path, vocab_size, true, layout);
  w.append(stream.ids, stream.loss_mask);
  w.commit();
}

/// Every token of the shard at `path` and its loss mask (empty for a shard without
/// one), after checking header, size, CRCs (version 3: the chunk table's and every
/// chunk's) and ids.
inline TokenStream read_token_stream(const std::string& path) {
  std::ifstream in;
  std::uint64_t size = detail::open_token_shard(path, in);
  TokenShardHeader header = detail::read_checked_header(path, in, size);
  TESSERA_CHECK(header.count <= std::numeric_limits<std::size_t>::max() / 4, "token shard '", path,
                "': ", header.count, " tokens do not fit in memory");
  TokenStream stream;
  std::vector<std::uint32_t>& tokens = stream.ids;
  tokens.resize(static_cast<std::size_t>(header.count));
  // Read the payload straight into the vector's memory, then put the bytes in host order.
  const auto payload_bytes = static_cast<std::streamsize>(4 * header.count);
  in.read(reinterpret_cast<char*>(tokens.data()), payload_bytes);
  TESSERA_CHECK(in.gcount() == payload_bytes, "token shard '", path, "': truncated while reading: got ",
                in.gcount(), " of ", payload_bytes, " payload bytes");
  std::vector<std::uint8_t> bits(static_cast<std::size_t>(header.mask_bytes()));
  if (header.loss_mask) {
    in.read(reinterpret_cast<char*>(bits.data()), static_cast<std::streamsize>(bits.size()));
    TESSERA_CHECK(in.gcount() == static_cast<std::streamsize>(bits.size()), "token shard '", path,
                  "': truncated while reading the loss mask");
  }
  const auto* raw = reinterpret_cast<const unsigned char*>(tokens.data());  // as stored: little-endian
  if (header.chunked()) {
    std::vector<unsigned char> table_bytes(static_cast<std::size_t>(header.table_bytes()));
    in.read(reinterpret_cast<char*>(table_bytes.data()), static_cast<std::streamsize>(table_bytes.size()));
    TESSERA_CHECK(in.gcount() == static_cast<std::streamsize>(table_bytes.size()), "token shard '", path,
                  "': truncated while reading the chunk table");
    std::uint64_t first_wide = 0;
    const std::vector<TokenShardChunk> table = detail::read_chunk_table(path, header, table_bytes.data(), first_wide);
    for (std::uint64_t k = 0; k < table.size(); ++k) {
      const std::uint64_t first = detail::chunk_tokens(header, k).first;
      detail::check_chunk(path, header, k, raw + 4 * first, header.loss_mask ? bits.data() + first / 8 : nullptr,
                          table[static_cast<std::size_t>(k)]);
    }
  } else {
    std::uint32_t crc = crc32(raw, tokens.size() * 4);
    crc = crc32_update(crc, bits.data(), bits.size());
    TESSERA_CHECK(crc == header.crc32, "token shard '", path, "': corrupt: payload CRC-32 is 0x", detail::hex(crc),
                  ", header says 0x", detail::hex(header.crc32));
  }
  if constexpr (std::endian::native != std::endian::little) {
    for (auto& t : tokens) t = detail::load_u32_le(reinterpret_cast<const unsigned char*>(&t));
  }
  if (!header.chunked()) {  // version 3: check_chunk has checked every id
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      TESSERA_CHECK(tokens[i] < header.vocab_size, "token shard '", path, "': token id ", tokens[i],
                    " at index ", i, " is not below vocab_size ", header.vocab_size);
    }
  }
  if (header.loss_mask) {
    if (!bits.empty()) detail::check_mask_tail(path, header, bits.back());
    stream.loss_mask.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) stream.loss_mask[i] = (bits[i / 8] >> (i % 8)) & 1u;
  }
  return stream;
}

/// Every token of the shard at `path`, after checking header, size, CRCs and ids; a
/// shard's loss mask, if it has one, is checked and dropped (read_token_stream keeps it).
inline std::vector<std::uint32_t> read_token_shard(const std::string& path) {
  return read_token_stream(path).ids;
}

/// The tokens of a file that is either a token shard (told by its magic, whatever its
/// name) or, when its name ends in ".u32", a headerless array of little-endian uint32
/// ids as numpy's `tofile` writes it. Anything else is an error naming the file.
inline std::vector<std::uint32_t> read_token_file(const std::string& path) {
  std::ifstream in;
  const std::uint64_t size = detail::open_token_shard(path, in);
  char magic[8] = {};
  in.read(magic, sizeof magic);
  if (in.gcount() == 8 && std::string_view(magic, 8) == token_shard_magic) {
    in.close();
    return read_token_shard(path);
  }
  TESSERA_CHECK(path.size() > 4 && path.ends_with(".u32"), "token file '", path,
                "': not a token shard (no TSRATOKS magic) and not named *.u32 (a headerless uint32 array)");
  TESSERA_CHECK(size % 4 == 0, "token file '", path, "': ", size,
                " bytes is not a whole number of uint32 ids (a .u32 file is a headerless little-endian uint32 array)");
  std::vector<std::uint32_t> tokens(static_cast<std::size_t>(size / 4));
  in.clear();
  in.seekg(0);
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(size));
  TESSERA_CHECK(static_cast<std::uint64_t>(in.gcount()) == size, "token file '", path, "': short read: got ",
                in.gcount(), " of ", size, " bytes");
  if constexpr (std::endian::native != std::endian::little) {
    for (auto& t : tokens) t = detail::load_u32_le(reinterpret_cast<const unsigned char*>(&t));
  }
  return tokens;
}

}  // namespace tessera::io
