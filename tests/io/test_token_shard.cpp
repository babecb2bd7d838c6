// Token shards: CRC-32, the file layout, round trips, and every kind of bad file.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tessera/io/crc32.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"

namespace test_token_shard {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using Ids = std::vector<std::uint32_t>;
using Bytes = std::vector<unsigned char>;


using tessera::test::TempDir;

Bytes read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.is_open());
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  REQUIRE(out.is_open());
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::uint32_t u32_at(const Bytes& b, std::size_t offset) {
  return static_cast<std::uint32_t>(b[offset]) | static_cast<std::uint32_t>(b[offset + 1]) << 8 |
         static_cast<std::uint32_t>(b[offset + 2]) << 16 | static_cast<std::uint32_t>(b[offset + 3]) << 24;
}

void put_u32(Bytes& b, std::size_t offset, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[offset + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
}

Ids sample_tokens(std::size_t n, std::uint32_t vocab) {
  Ids ids(n);
  std::uint32_t x = 12345;
  for (auto& id : ids) {
    x = x * 1664525u + 1013904223u;
    id = (x >> 8) % vocab;
  }
  return ids;
}

/// Both readers refuse the file at `path` with a message holding `text`: the one that
/// loads it and the one that maps it (one thread, and pieces of 64 bytes on four).
#define CHECK_READERS_REFUSE(path, text)                                                           \
  do {                                                                                             \
    CHECK_ERROR_CONTAINS(tessera::io::read_token_stream(path), text);                              \
    CHECK_ERROR_CONTAINS(tessera::io::MappedTokenShard::open(path, 1), text);                      \
    CHECK_ERROR_CONTAINS(tessera::io::MappedTokenShard::open(path, 4, 64), text);                  \
  } while (0)

}  // namespace

TEST_CASE("crc32_combine joins the CRCs of pieces checksummed apart") {
  const Ids ids = sample_tokens(1000, 1u << 20);
  const auto* bytes = reinterpret_cast<const unsigned char*>(ids.data());
  const std::size_t n = 4 * ids.size();
  const std::uint32_t whole = tessera::io::crc32(bytes, n);
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{1999}, n - 1, n}) {
    const std::uint32_t a = tessera::io::crc32(bytes, cut), b = tessera::io::crc32(bytes + cut, n - cut);
    CHECK(tessera::io::crc32_combine(a, b, n - cut) == whole);
  }
  // Three pieces, joined left to right.
  const std::uint32_t c1 = tessera::io::crc32(bytes, 100), c2 = tessera::io::crc32(bytes + 100, 1000),
                      c3 = tessera::io::crc32(bytes + 1100, n - 1100);
  CHECK(tessera::io::crc32_combine(tessera::io::crc32_combine(c1, c2, 1000), c3, n - 1100) == whole);
  // An empty second piece leaves the first's CRC.
  CHECK(tessera::io::crc32_combine(0x12345678u, 0, 0) == 0x12345678u);
}

TEST_CASE("a mapped shard reads what read_token_stream reads, in any piece, on any threads") {
  using tessera::io::MappedTokenShard;
  TempDir dir("tessera-mapped-shard");
  const std::string plain = dir.file("plain.bin"), masked = dir.file("masked.bin");
  const Ids ids = sample_tokens(1001, 5000);
  tessera::io::write_token_shard(plain, ids, 5000);
  tessera::io::TokenStream chat{ids, {}};
  for (std::size_t i = 0; i < ids.size(); ++i) chat.loss_mask.push_back(i % 5 == 2 || i % 7 == 0 ? 1 : 0);
  tessera::io::write_token_shard(masked, chat, 5000);
  for (unsigned threads : {1u, 3u, 8u}) {
    CAPTURE(threads);
    const MappedTokenShard a = MappedTokenShard::open(plain, threads, 100), b = MappedTokenShard::open(masked, threads, 100);
    CHECK(a.size() == ids.size());
    CHECK_FALSE(a.masked());
    CHECK(b.masked());
    CHECK(a.max_id() == *std::max_element(ids.begin(), ids.end()));
    CHECK(a.header().vocab_size == 5000);
    for (const auto& [first, n] : {std::pair<std::uint64_t, std::size_t>{0, 1001}, {0, 1}, {997, 4}, {333, 100}, {1001, 0}}) {
      Ids got(n);
      std::vector<std::uint8_t> keep(n, 7);
      a.read(first, n, got.data(), keep.data());
      CHECK(got == Ids(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.begin() + static_cast<std::ptrdiff_t>(first + n)));
      CHECK(std::all_of(keep.begin(), keep.end(), [](std::uint8_t k) { return k == 1; }));
      b.read(first, n, got.data(), keep.data());
      CHECK(got == Ids(ids.begin() + static_cast<std::ptrdiff_t>(first), ids.begin() + static_cast<std::ptrdiff_t>(first + n)));
      CHECK(keep == std::vector<std::uint8_t>(chat.loss_mask.begin() + static_cast<std::ptrdiff_t>(first),
                                              chat.loss_mask.begin() + static_cast<std::ptrdiff_t>(first + n)));
    }
    CHECK_ERROR_CONTAINS(a.read(1000, 2, nullptr, nullptr), "tokens [1000, 1002) are past its 1001 tokens");
    // any_target: over a byte's bits, whole bytes, and the tail.
    for (std::uint64_t first = 0; first < 40; ++first)
      for (std::uint64_t n = 0; n < 30; ++n) {
        bool any = false;
        for (std::uint64_t k = first; k < first + n; ++k) any = any || chat.loss_mask[k];
        CHECK(b.any_target(first, n) == any);
        CHECK(a.any_target(first, n) == (n > 0));
      }
  }
  // An empty shard maps too.
  const std::string empty = dir.file("empty.bin");
  tessera::io::write_token_shard(empty, Ids{}, 10);
  CHECK(MappedTokenShard::open(empty).size() == 0);
}

TEST_CASE("crc32: known check values and incremental updates") {
  using tessera::io::crc32;
  using tessera::io::crc32_update;
  CHECK(crc32("123456789", 9) == 0xCBF43926u);
  CHECK(crc32("", 0) == 0u);
  const char* fox = "The quick brown fox jumps over the lazy dog";
  CHECK(crc32(fox, std::strlen(fox)) == 0x414FA339u);
  CHECK(crc32_update(crc32("12345", 5), "6789", 4) == 0xCBF43926u);
  const unsigned char one_zero[1] = {0};
  CHECK(crc32(one_zero, 1) == 0xD202EF8Du);
  // Eight bytes at a time and byte by byte agree at every length and split.
  std::string text;
  for (int i = 0; i < 100; ++i) text += fox[i % 43];
  for (std::size_t n = 0; n <= text.size(); n += 7)
    CHECK(crc32_update(crc32(text.data(), n), text.data() + n, text.size() - n) == crc32(text.data(), text.size()));
}

TEST_CASE("crc32c: known check values (RFC 3720) and incremental updates") {
  using tessera::io::crc32c;
  using tessera::io::crc32c_update;
  CHECK(crc32c("123456789", 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  const unsigned char zeros[32] = {};
  CHECK(crc32c(zeros, 32) == 0x8A9136AAu);
  unsigned char ones[32];
  std::memset(ones, 0xFF, sizeof ones);
  CHECK(crc32c(ones, 32) == 0x62A8AB43u);
  unsigned char up[32];
  for (int i = 0; i < 32; ++i) up[i] = static_cast<unsigned char>(i);
  CHECK(crc32c(up, 32) == 0x46DD794Eu);
  for (std::size_t n = 0; n <= 32; ++n) CHECK(crc32c_update(crc32c(up, n), up + n, 32 - n) == 0x46DD794Eu);
}

TEST_CASE("token shard: layout of a written file") {
  TempDir dir;
  const std::string path = dir.file("small.bin");
  Ids ids{1, 0x01020304u, 257, 0};
  tessera::io::write_token_shard(path, ids, 0x01020305u);
  Bytes b = read_bytes(path);
  REQUIRE(b.size() == 32 + 4 * ids.size());
  CHECK(std::string(b.begin(), b.begin() + 8) == "TSRATOKS");
  CHECK(u32_at(b, 8) == 1);
  CHECK(u32_at(b, 12) == 0x01020305u);
  CHECK(u32_at(b, 16) == 4);  // count, low word
  CHECK(u32_at(b, 20) == 0);  // count, high word
  CHECK(u32_at(b, 24) == tessera::io::crc32(b.data() + 32, b.size() - 32));
  CHECK(u32_at(b, 28) == 0);
  // Little-endian payload.
  CHECK(b[36] == 0x04);
  CHECK(b[37] == 0x03);
  CHECK(b[38] == 0x02);
  CHECK(b[39] == 0x01);
  CHECK(u32_at(b, 40) == 257);
  CHECK_FALSE(fs::exists(path + ".tmp"));
}

TEST_CASE("token shard: round trips") {
  TempDir dir;
  SUBCASE("several chunks") {
    const std::string path = dir.file("big.bin");
    Ids ids = sample_tokens(40000, 258);  // more than one 16384-token write chunk
    tessera::io::write_token_shard(path, ids, 258);
    CHECK(tessera::io::read_token_shard(path) == ids);
    auto h = tessera::io::read_token_shard_header(path);
    CHECK(h.version == 1);
    CHECK(h.vocab_size == 258);
    CHECK(h.count == 40000);
    CHECK(h.crc32 == u32_at(read_bytes(path), 24));
  }
  SUBCASE("empty") {
    const std::string path = dir.file("empty.bin");
    tessera::io::write_token_shard(path, Ids{}, 258);
    CHECK(fs::file_size(path) == 32);
    CHECK(tessera::io::read_token_shard(path).empty());
    CHECK(tessera::io::read_token_shard_header(path).count == 0);
  }
  SUBCASE("largest ids of a large vocabulary") {
    const std::string path = dir.file("wide.bin");
    Ids ids{0xFFFFFFFEu, 0, 128255, 0x80000000u};
    tessera::io::write_token_shard(path, ids, 0xFFFFFFFFu);
    CHECK(tessera::io::read_token_shard(path) == ids);
  }
  SUBCASE("overwriting an existing shard replaces it whole") {
    const std::string path = dir.file("again.bin");
    tessera::io::write_token_shard(path, sample_tokens(1000, 50), 50);
    Ids second{7, 8, 9};
    tessera::io::write_token_shard(path, second, 10);
    CHECK(tessera::io::read_token_shard(path) == second);
    CHECK(fs::file_size(path) == 32 + 12);
    CHECK_FALSE(fs::exists(path + ".tmp"));
  }
}

TEST_CASE("token shard: the writer rejects bad input and leaves existing files alone") {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  SUBCASE("id not below vocab_size: nothing written") {
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(path, Ids{1, 2, 258, 3}, 258),
                         "token id 258 at index 2 is not below vocab_size 258");
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(path, Ids{1, 2, 258, 3}, 258), path);
    CHECK_FALSE(fs::exists(path));
    CHECK_FALSE(fs::exists(path + ".tmp"));
  }
  SUBCASE("id not below vocab_size: an existing shard is kept") {
    Ids good{1, 2, 3};
    tessera::io::write_token_shard(path, good, 10);
    CHECK_THROWS_AS(tessera::io::write_token_shard(path, Ids{1, 99}, 10), tessera::Error);
    CHECK(tessera::io::read_token_shard(path) == good);
  }
  SUBCASE("vocab_size 0") {
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(path, Ids{}, 0), "vocab_size must be positive");
  }
  SUBCASE("missing directory") {
    const std::string nowhere = dir.file("no/such/dir/shard.bin");
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(nowhere, Ids{1}, 10), "directory does not exist");
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(nowhere, Ids{1}, 10), nowhere);
  }
}

TEST_CASE("token shard: streaming writer gives the same bytes, and abandoning it keeps the old shard") {
  TempDir dir;
  const Ids ids = sample_tokens(50000, 1000);  // several internal chunks
  tessera::io::write_token_shard(dir.file("whole.bin"), ids, 1000);
  {
    tessera::io::TokenShardWriter w(dir.file("parts.bin"), 1000);
    for (std::size_t begin = 0; begin < ids.size(); begin += 7777) {
      const std::size_t n = std::min<std::size_t>(7777, ids.size() - begin);
      w.append(std::span<const std::uint32_t>(ids).subspan(begin, n));
    }
    w.append(Ids{});
    CHECK(w.count() == ids.size());
    CHECK_FALSE(fs::exists(dir.file("parts.bin")));  // nothing at the path before commit
    w.commit();
    CHECK_ERROR_CONTAINS(w.append(Ids{1}), "append after commit");
  }
  CHECK(read_bytes(dir.file("parts.bin")) == read_bytes(dir.file("whole.bin")));

  const Ids old{4, 5, 6};
  tessera::io::write_token_shard(dir.file("kept.bin"), old, 10);
  {
    tessera::io::TokenShardWriter w(dir.file("kept.bin"), 10);
    w.append(Ids{1, 2, 3});
    CHECK_ERROR_CONTAINS(w.append(Ids{7, 12}), "token id 12 at index 4 is not below vocab_size 10");
    CHECK(fs::exists(dir.file("kept.bin.tmp")));
  }  // destroyed without commit
  CHECK_FALSE(fs::exists(dir.file("kept.bin.tmp")));
  CHECK(tessera::io::read_token_shard(dir.file("kept.bin")) == old);
}

TEST_CASE("token shard: the reader rejects every kind of bad file, naming the path") {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  const Ids ids = sample_tokens(100, 258);
  tessera::io::write_token_shard(good, ids, 258);
  const Bytes original = read_bytes(good);
  const std::string bad = dir.file("bad.bin");
  using tessera::io::read_token_shard;
  using tessera::io::read_token_shard_header;

  SUBCASE("missing file") {
    const std::string missing = dir.file("missing.bin");
    CHECK_READERS_REFUSE(missing, "no such file");
    CHECK_READERS_REFUSE(missing, missing);
    CHECK_ERROR_CONTAINS(read_token_shard_header(missing), "no such file");
  }
  SUBCASE("a directory") {
    CHECK_READERS_REFUSE(dir.path.string(), "not a regular file");
  }
  SUBCASE("shorter than the header") {
    write_bytes(bad, Bytes(original.begin(), original.begin() + 10));
    CHECK_READERS_REFUSE(bad, "file is 10 bytes, shorter than the 32-byte header");
    CHECK_ERROR_CONTAINS(read_token_shard_header(bad), bad);
    write_bytes(bad, Bytes{});
    CHECK_READERS_REFUSE(bad, "file is 0 bytes");
  }
  SUBCASE("wrong magic") {
    Bytes b = original;
    b[0] = 'X';
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "not a tessera token shard");
    CHECK_ERROR_CONTAINS(read_token_shard_header(bad), "not a tessera token shard");
    CHECK_READERS_REFUSE(bad, bad);
  }
  SUBCASE("unsupported version") {
    Bytes b = original;
    put_u32(b, 8, 3);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "unsupported version 3");
    put_u32(b, 8, 2);  // a loss mask's version without the mask's flag
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "version 2 flags are 0");
    CHECK_ERROR_CONTAINS(read_token_shard_header(bad), bad);
  }
  SUBCASE("reserved field set") {
    Bytes b = original;
    put_u32(b, 28, 5);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "reserved header field is 5");
  }
  SUBCASE("vocab_size 0 in the header") {
    Bytes b = original;
    put_u32(b, 12, 0);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "vocab_size is 0");
  }
  SUBCASE("truncated by one byte") {
    write_bytes(bad, Bytes(original.begin(), original.end() - 1));
    CHECK_READERS_REFUSE(bad, "truncated: expected 432 bytes");
    CHECK_READERS_REFUSE(bad, "found 431");
    CHECK_ERROR_CONTAINS(read_token_shard_header(bad), "truncated");
    CHECK_READERS_REFUSE(bad, bad);
  }
  SUBCASE("header only, count says 100") {
    write_bytes(bad, Bytes(original.begin(), original.begin() + 32));
    CHECK_READERS_REFUSE(bad, "truncated: expected 432 bytes");
    CHECK_READERS_REFUSE(bad, "found 32");
  }
  SUBCASE("a count no file can hold") {
    Bytes b = original;
    put_u32(b, 16, 0xFFFFFFFFu);
    put_u32(b, 20, 0xFFFFFFFFu);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "truncated");
    CHECK_READERS_REFUSE(bad, "18446744073709551615 tokens");
  }
  SUBCASE("one trailing byte") {
    Bytes b = original;
    b.push_back(0);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "1 trailing bytes: expected 432 bytes");
    CHECK_READERS_REFUSE(bad, "found 433");
    CHECK_ERROR_CONTAINS(read_token_shard_header(bad), "trailing");
  }
  SUBCASE("a flipped payload byte") {
    Bytes b = original;
    b[32 + 4 * 37 + 1] ^= 0x10;
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "corrupt");
    CHECK_READERS_REFUSE(bad, bad);
    // The header alone is still consistent: read_token_shard_header does not read the payload.
    CHECK(read_token_shard_header(bad).count == 100);
  }
  SUBCASE("a flipped CRC byte") {
    Bytes b = original;
    b[25] ^= 0x01;
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "corrupt");
  }
  SUBCASE("an id not below vocab_size, with a correct CRC") {
    Ids wide = ids;
    wide[63] = 300;
    tessera::io::write_token_shard(bad, wide, 1000);
    Bytes b = read_bytes(bad);
    put_u32(b, 12, 258);  // the header's vocab_size is outside the CRC
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "token id 300 at index 63 is not below vocab_size 258");
    CHECK_READERS_REFUSE(bad, bad);
  }
}

TEST_CASE("a shard with a loss mask: layout, round trip, streaming, and bad masks") {
  using tessera::io::TokenStream;
  TempDir dir("tessera-shard-mask");
  const std::string path = (dir.path / "chat.bin").string();
  TokenStream stream;
  stream.ids = sample_tokens(13, 300);  // 13 tokens: the mask's last byte is partly used
  for (std::size_t i = 0; i < stream.ids.size(); ++i) stream.loss_mask.push_back(i % 3 == 1 || i == 12 ? 1 : 0);
  tessera::io::write_token_shard(path, stream, 300);

  const Bytes b = read_bytes(path);
  REQUIRE(b.size() == 32 + 4 * 13 + 2);
  CHECK(u32_at(b, 8) == 2);   // version 2
  CHECK(u32_at(b, 28) == 1);  // flags: a loss mask follows
  // Bits LSB first: tokens 1, 4, 7, 10 and 12.
  CHECK(b[32 + 52] == 0b10010010);
  CHECK(b[32 + 53] == 0b00010100);
  CHECK(u32_at(b, 24) == tessera::io::crc32(b.data() + 32, b.size() - 32));

  const TokenStream back = tessera::io::read_token_stream(path);
  CHECK(back.ids == stream.ids);
  CHECK(back.loss_mask == stream.loss_mask);
  CHECK(tessera::io::read_token_shard(path) == stream.ids);  // the ids alone
  CHECK(tessera::io::read_token_shard_header(path).loss_mask);

  // Streamed in pieces, the same bytes.
  const std::string streamed = (dir.path / "streamed.bin").string();
  {
    tessera::io::TokenShardWriter w(streamed, 300, true);
    const std::span<const std::uint32_t> ids(stream.ids);
    const std::span<const std::uint8_t> mask(stream.loss_mask);
    w.append(ids.first(5), mask.first(5));
    w.append(ids.subspan(5), mask.subspan(5));
    CHECK_ERROR_CONTAINS(w.append(ids), "has a loss mask");
    w.commit();
  }
  CHECK(read_bytes(streamed) == b);

  // A shard without a mask stays version 1, and reads with an empty mask.
  const std::string plain = (dir.path / "plain.bin").string();
  tessera::io::write_token_shard(plain, TokenStream{stream.ids, {}}, 300);
  CHECK(u32_at(read_bytes(plain), 8) == 1);
  CHECK(tessera::io::read_token_stream(plain).loss_mask.empty());
  {
    tessera::io::TokenShardWriter w((dir.path / "x.bin").string(), 300);
    CHECK_ERROR_CONTAINS(w.append(stream.ids, stream.loss_mask), "has no loss mask");
  }

  const std::string bad = (dir.path / "bad.bin").string();
  SUBCASE("the mask cut short") {
    write_bytes(bad, Bytes(b.begin(), b.end() - 1));
    CHECK_READERS_REFUSE(bad, "truncated: expected 86 bytes");
    CHECK_READERS_REFUSE(bad, "2 bytes of loss mask");
  }
  SUBCASE("a flipped mask bit") {
    Bytes c = b;
    c[32 + 52] ^= 0x01;
    write_bytes(bad, c);
    CHECK_READERS_REFUSE(bad, "corrupt");
  }
  SUBCASE("a bit past the last token") {
    Bytes c = b;
    c[32 + 53] |= 0x80;
    put_u32(c, 24, tessera::io::crc32(c.data() + 32, c.size() - 32));
    write_bytes(bad, c);
    CHECK_READERS_REFUSE(bad, "bits set past the last token");
  }
  SUBCASE("mask and ids of different lengths") {
    CHECK_ERROR_CONTAINS(tessera::io::write_token_shard(bad, TokenStream{stream.ids, {1, 0}}, 300),
                         "13 ids but 2 mask values");
    CHECK_FALSE(fs::exists(bad));
  }
}

}  // namespace test_token_shard
