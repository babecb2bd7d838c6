// Token shards: CRC-32, the file layout, round trips, and every kind of bad file.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/io/crc32.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"

namespace test_token_shard {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using Ids = std::vector<std::uint32_t>;
using Bytes = std::vector<unsigned char>;
using Mask = std::vector<std::uint8_t>;


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
  using tessera::io::TokenShardLayout;
  TempDir dir("tessera-mapped-shard");
  // Both layouts; the chunked one also over three chunks of its table (pieces across them).
  for (const auto& [layout, count] : {std::pair{TokenShardLayout::whole, std::size_t{1001}},
                                      std::pair{TokenShardLayout::chunked, std::size_t{1001}},
                                      std::pair{TokenShardLayout::chunked, std::size_t{140001}}}) {
    CAPTURE(count);
    const bool chunked = layout == TokenShardLayout::chunked;
    CAPTURE(chunked);
    const std::string plain = dir.file("plain.bin"), masked = dir.file("masked.bin");
    const Ids ids = sample_tokens(count, 5000);
    tessera::io::write_token_shard(plain, ids, 5000, layout);
    tessera::io::TokenStream chat{ids, {}};
    for (std::size_t i = 0; i < ids.size(); ++i) chat.loss_mask.push_back(i % 5 == 2 || i % 7 == 0 ? 1 : 0);
    tessera::io::write_token_shard(masked, chat, 5000, layout);
    const tessera::io::TokenStream loaded = tessera::io::read_token_stream(masked);
    CHECK(loaded.ids == ids);
    CHECK(loaded.loss_mask == chat.loss_mask);
    const std::uint64_t n_all = count, tail = count - 4, mid = count / 3;
    for (unsigned threads : {1u, 3u, 8u}) {
      CAPTURE(threads);
      const MappedTokenShard a = MappedTokenShard::open(plain, threads, 100), b = MappedTokenShard::open(masked, threads, 100);
      CHECK(a.size() == ids.size());
      CHECK_FALSE(a.masked());
      CHECK(b.masked());
      CHECK(a.checked_as_read() == chunked);
      CHECK(a.max_id() == *std::max_element(ids.begin(), ids.end()));
      CHECK(a.header().vocab_size == 5000);
      CHECK(a.chunks_checked() == 0);  // nothing read yet (and nothing to check as read before version 3)
      for (const auto& [first, n] : {std::pair<std::uint64_t, std::size_t>{0, n_all}, {0, 1}, {tail, 4}, {mid, 100},
                                     {count > 65600 ? 65530 : 0, count > 65600 ? 70 : 0}, {n_all, 0}}) {
        CAPTURE(first);
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
      CHECK(a.chunks_checked() == a.header().chunks());  // the first read took them all
      CHECK_ERROR_CONTAINS(a.read(n_all - 1, 2, nullptr, nullptr),
                           tessera::detail::concat("tokens [", n_all - 1, ", ", n_all + 1, ") are past its ", n_all, " tokens"));
      // any_target: over a byte's bits, whole bytes, and the tail.
      for (std::uint64_t first = 0; first < 40; ++first)
        for (std::uint64_t n = 0; n < 30; ++n) {
          bool any = false;
          for (std::uint64_t k = first; k < first + n; ++k) any = any || chat.loss_mask[k];
          CHECK(b.any_target(first, n) == any);
          CHECK(a.any_target(first, n) == (n > 0));
        }
    }
  }
  // An empty shard maps too.
  const std::string empty = dir.file("empty.bin");
  tessera::io::write_token_shard(empty, Ids{}, 10);
  CHECK(MappedTokenShard::open(empty).size() == 0);
  MappedTokenShard::open(empty).check_all();
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

TEST_CASE("token shard: layout of a written file (version 1, whole)") {
  TempDir dir;
  const std::string path = dir.file("small.bin");
  Ids ids{1, 0x01020304u, 257, 0};
  tessera::io::write_token_shard(path, ids, 0x01020305u, tessera::io::TokenShardLayout::whole);
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
    CHECK(h.version == 3);
    CHECK(h.chunks() == 1);
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
    CHECK(fs::file_size(path) == 32 + 12 + 8);
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
  const Ids ids = sample_tokens(150000, 1000);  // three chunks of the table, pieces across their ends
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
  {
    // The same in the whole layout (version 1).
    tessera::io::write_token_shard(dir.file("whole1.bin"), ids, 1000, tessera::io::TokenShardLayout::whole);
    tessera::io::TokenShardWriter w(dir.file("parts1.bin"), 1000, false, tessera::io::TokenShardLayout::whole);
    for (std::size_t begin = 0; begin < ids.size(); begin += 7777)
      w.append(std::span<const std::uint32_t>(ids).subspan(begin, std::min<std::size_t>(7777, ids.size() - begin)));
    w.commit();
    CHECK(read_bytes(dir.file("parts1.bin")) == read_bytes(dir.file("whole1.bin")));
    CHECK(tessera::io::read_token_shard(dir.file("parts1.bin")) == ids);
  }

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

TEST_CASE("token shard: the reader rejects every kind of bad file, naming the path (version 1)") {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  const Ids ids = sample_tokens(100, 258);
  tessera::io::write_token_shard(good, ids, 258, tessera::io::TokenShardLayout::whole);
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
    put_u32(b, 8, 4);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "unsupported version 4");
    CHECK_READERS_REFUSE(bad, "knows versions 1, 2 and 3");
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
    tessera::io::write_token_shard(bad, wide, 1000, tessera::io::TokenShardLayout::whole);
    Bytes b = read_bytes(bad);
    put_u32(b, 12, 258);  // the header's vocab_size is outside the CRC
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "token id 300 at index 63 is not below vocab_size 258");
    CHECK_READERS_REFUSE(bad, bad);
  }
}

TEST_CASE("a chunked shard (version 3): its table, its chunks checked as read, and every kind of bad chunk") {
  using tessera::io::MappedTokenShard;
  using tessera::io::TokenStream;
  TempDir dir("tessera-shard-chunked");
  constexpr std::size_t count = 150000;  // chunks [0, 65536), [65536, 131072), [131072, 150000)
  TokenStream chat{sample_tokens(count, 1000), {}};
  for (std::size_t i = 0; i < count; ++i) chat.loss_mask.push_back(i % 3 == 1 ? 1 : 0);
  const std::string plain = dir.file("plain.bin"), masked = dir.file("masked.bin");
  tessera::io::write_token_shard(plain, chat.ids, 1000);
  tessera::io::write_token_shard(masked, chat, 1000);
  const Bytes p = read_bytes(plain), m = read_bytes(masked);
  constexpr std::size_t mask_bytes = (count + 7) / 8, table = 32 + 4 * count;

  // The layout: the table after the ids (and the mask), the header's CRC over it.
  REQUIRE(p.size() == table + 3 * 8);
  REQUIRE(m.size() == table + mask_bytes + 3 * 8);
  CHECK(u32_at(p, 8) == 3);
  CHECK(u32_at(p, 28) == 0);
  CHECK(u32_at(m, 8) == 3);
  CHECK(u32_at(m, 28) == 1);
  CHECK(u32_at(p, 24) == tessera::io::crc32(p.data() + table, 24));
  CHECK(u32_at(m, 24) == tessera::io::crc32(m.data() + table + mask_bytes, 24));
  for (std::size_t k = 0; k < 3; ++k) {
    CAPTURE(k);
    const std::size_t first = 65536 * k, n = std::min<std::size_t>(65536, count - first);
    CHECK(u32_at(p, table + 8 * k) == tessera::io::crc32(p.data() + 32 + 4 * first, 4 * n));
    CHECK(u32_at(p, table + 8 * k + 4) ==
          *std::max_element(chat.ids.begin() + static_cast<std::ptrdiff_t>(first),
                            chat.ids.begin() + static_cast<std::ptrdiff_t>(first + n)));
    const std::uint32_t ids_crc = tessera::io::crc32(m.data() + 32 + 4 * first, 4 * n);
    CHECK(u32_at(m, table + mask_bytes + 8 * k) ==
          tessera::io::crc32_update(ids_crc, m.data() + table + first / 8, (n + 7) / 8));
  }
  CHECK(tessera::io::read_token_shard_header(masked).chunks() == 3);

  // Opening reads the header and the table; each chunk is checked once, when first read.
  {
    const MappedTokenShard shard = MappedTokenShard::open(masked);
    CHECK(shard.chunks_checked() == 0);
    Ids got(10);
    shard.read(65530, 10, got.data(), nullptr);  // chunks 0 and 1
    CHECK(shard.chunks_checked() == 2);
    shard.read(0, 10, got.data(), nullptr);
    CHECK(shard.chunks_checked() == 2);
    shard.check_all(2);
    CHECK(shard.chunks_checked() == 3);
  }
  // Several threads reading one shard at once see its tokens.
  {
    const MappedTokenShard shard = MappedTokenShard::open(plain);
    std::vector<std::thread> readers;
    std::vector<int> mismatches(4, 0);
    for (int t = 0; t < 4; ++t)
      readers.emplace_back([&, t] {
        Ids got(1000);
        for (std::uint64_t first = static_cast<std::uint64_t>(t) * 7919; first + 1000 <= count; first += 37013) {
          shard.read(first, 1000, got.data(), nullptr);
          mismatches[static_cast<std::size_t>(t)] +=
              got != Ids(chat.ids.begin() + static_cast<std::ptrdiff_t>(first), chat.ids.begin() + static_cast<std::ptrdiff_t>(first + 1000));
        }
      });
    for (auto& r : readers) r.join();
    CHECK(mismatches == std::vector<int>(4, 0));
    CHECK(shard.chunks_checked() == 3);
  }

  const std::string bad = dir.file("bad.bin");
  // A bad chunk: read_token_stream refuses the file; the mapped shard opens, reads the
  // good chunks, and refuses any read (or check_all) that touches the bad one.
  auto refuse_chunk = [&](const Bytes& b, const std::string& text, std::uint64_t bad_token) {
    write_bytes(bad, b);
    CHECK_ERROR_CONTAINS(tessera::io::read_token_stream(bad), text);
    CHECK_ERROR_CONTAINS(tessera::io::read_token_stream(bad), bad);
    const MappedTokenShard shard = MappedTokenShard::open(bad);
    Ids got(4);
    std::vector<std::uint8_t> keep(4);
    const std::uint64_t good = bad_token < 65536 ? 140000 : 0;
    shard.read(good, 4, got.data(), keep.data());
    CHECK_ERROR_CONTAINS(shard.read(bad_token, 4, got.data(), keep.data()), text);
    CHECK_ERROR_CONTAINS(shard.read(bad_token, 4, got.data(), nullptr), bad);  // refused again: never marked checked
    CHECK_ERROR_CONTAINS(shard.check_all(3), text);
  };
  SUBCASE("a flipped id byte") {
    Bytes b = p;
    b[32 + 4 * 70000 + 1] ^= 0x10;
    refuse_chunk(b, "corrupt: chunk 1 (tokens [65536, 131072)) has CRC-32 0x", 70000);
    refuse_chunk(b, ", the chunk table says 0x", 70000);
  }
  SUBCASE("a flipped mask bit") {
    Bytes b = m;
    b[table + 140000 / 8] ^= 0x04;
    refuse_chunk(b, "corrupt: chunk 2 (tokens [131072, 150000))", 140000);
  }
  SUBCASE("an id not below vocab_size in a chunk whose CRC and table entry agree with it") {
    // The table's entries are the writer's (vocab 2000); the header then claims 1000.
    Ids wide = chat.ids;
    wide[100000] = 1500;
    tessera::io::write_token_shard(bad, wide, 2000);
    Bytes b = read_bytes(bad);
    put_u32(b, 12, 1000);
    write_bytes(bad, b);
    // Found when the shard opens: the table says chunk 1 holds an id of 1500.
    CHECK_READERS_REFUSE(bad, "token id 1500 at index 100000 is not below vocab_size 1000");
  }
  SUBCASE("a table entry whose largest id is not the chunk's") {
    Bytes b = p;
    put_u32(b, table + 8 * 2 + 4, u32_at(b, table + 8 * 2 + 4) - 1);
    put_u32(b, 24, tessera::io::crc32(b.data() + table, 24));
    refuse_chunk(b, "corrupt: chunk 2 (tokens [131072, 150000)) has largest id", 131072);
    refuse_chunk(b, "the chunk table says", 131072);
  }
  SUBCASE("a flipped table byte, or the header's CRC") {
    Bytes b = p;
    b[table + 9] ^= 0x01;
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "corrupt: the chunk table's CRC-32 is 0x");
    b = p;
    b[25] ^= 0x01;
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "corrupt: the chunk table's CRC-32");
    CHECK_READERS_REFUSE(bad, bad);
  }
  SUBCASE("the table cut short, or one byte after it") {
    write_bytes(bad, Bytes(p.begin(), p.end() - 1));
    CHECK_READERS_REFUSE(bad, tessera::detail::concat("truncated: expected ", p.size(), " bytes"));
    CHECK_READERS_REFUSE(bad, "3 chunk table entries of 8 bytes");
    Bytes b = p;
    b.push_back(0);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "1 trailing bytes");
  }
  SUBCASE("flags other than the mask's") {
    Bytes b = p;
    put_u32(b, 28, 2);
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "version 3 flags are 2, expected 0 or 1");
  }
  SUBCASE("a mask bit past the last token, under correct CRCs") {
    TokenStream odd{Ids(chat.ids.begin(), chat.ids.begin() + 13), Mask(13, 1)};
    tessera::io::write_token_shard(bad, odd, 1000);
    Bytes b = read_bytes(bad);
    const std::size_t mask_at = 32 + 4 * 13, table_at = mask_at + 2;
    b[mask_at + 1] |= 0x80;
    put_u32(b, table_at, tessera::io::crc32_update(tessera::io::crc32(b.data() + 32, 4 * 13), b.data() + mask_at, 2));
    put_u32(b, 24, tessera::io::crc32(b.data() + table_at, 8));
    write_bytes(bad, b);
    CHECK_READERS_REFUSE(bad, "bits set past the last token");
  }
}

TEST_CASE("a mapped file shortened under the process: one line naming it, exit status 1") {
  // In a child process: the SIGBUS handler ends it. Returns its exit status (or 128 + the
  // signal that ended it) and what it wrote to stderr.
  auto in_child = [](auto f) {
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::dup2(pipe_fds[1], STDERR_FILENO);
      ::close(pipe_fds[0]);
      const rlimit no_core{0, 0};
      ::setrlimit(RLIMIT_CORE, &no_core);
      f();
      ::_exit(3);
    }
    ::close(pipe_fds[1]);
    std::string out;
    char buf[512];
    for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
    ::close(pipe_fds[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    return std::pair{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
  };
  TempDir dir("tessera-shard-sigbus");
  const std::string path = dir.file("shortened.bin");
  const Ids ids = sample_tokens(150000, 1000);
  tessera::io::write_token_shard(path, ids, 1000);

  const auto [status, err] = in_child([&] {
    const tessera::io::MappedTokenShard shard = tessera::io::MappedTokenShard::open(path);
    fs::resize_file(path, 8192);  // the pages past it are gone from under the mapping
    Ids got(4);
    shard.read(100000, 4, got.data(), nullptr);
  });
  CHECK(status == 1);
  CHECK(err.find(tessera::detail::concat(": error: '", path, "': reading byte ")) != std::string::npos);
  CHECK(err.find("of the mapped file failed (SIGBUS): it was shortened or rewritten in place") != std::string::npos);
  CHECK(std::count(err.begin(), err.end(), '\n') == 1);

  // A SIGBUS outside every mapping is left to the action before: the default (the process
  // ends by the signal, silently), or a sanitizer's handler (which reports it its way).
  tessera::io::write_token_shard(path, ids, 1000);
  const auto [raised, other] = in_child([&] {
    const tessera::io::MappedTokenShard shard = tessera::io::MappedTokenShard::open(path);
    ::raise(SIGBUS);
  });
  const struct sigaction& before = tessera::io::detail::sigbus_before;
  if ((before.sa_flags & SA_SIGINFO) == 0 && before.sa_handler == SIG_DFL) {
    CHECK(raised == 128 + SIGBUS);
    CHECK(other.empty());
  } else {
    CHECK(raised != 0);
    CHECK(raised != 3);
    CHECK(other.find("of the mapped file failed") == std::string::npos);
  }
}

TEST_CASE("a shard with a loss mask (version 2): layout, round trip, streaming, and bad masks") {
  using tessera::io::TokenStream;
  using tessera::io::TokenShardLayout;
  TempDir dir("tessera-shard-mask");
  const std::string path = (dir.path / "chat.bin").string();
  TokenStream stream;
  stream.ids = sample_tokens(13, 300);  // 13 tokens: the mask's last byte is partly used
  for (std::size_t i = 0; i < stream.ids.size(); ++i) stream.loss_mask.push_back(i % 3 == 1 || i == 12 ? 1 : 0);
  tessera::io::write_token_shard(path, stream, 300, TokenShardLayout::whole);

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
    tessera::io::TokenShardWriter w(streamed, 300, true, TokenShardLayout::whole);
    const std::span<const std::uint32_t> ids(stream.ids);
    const std::span<const std::uint8_t> mask(stream.loss_mask);
    w.append(ids.first(5), mask.first(5));
    w.append(ids.subspan(5), mask.subspan(5));
    CHECK_ERROR_CONTAINS(w.append(ids), "has a loss mask");
    w.commit();
  }
  CHECK(read_bytes(streamed) == b);

  // A shard without a mask is version 1, and reads with an empty mask.
  const std::string plain = (dir.path / "plain.bin").string();
  tessera::io::write_token_shard(plain, TokenStream{stream.ids, {}}, 300, TokenShardLayout::whole);
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
