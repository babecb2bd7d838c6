// Token ids tokenized elsewhere (io/token_arrays.hpp): NumPy .npy arrays and llm.c's token
// files, written here byte by byte as numpy.save and llm.c's write_datafile lay them out,
// read back id for id; each malformed file refused by a message naming it.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/io/token_arrays.hpp"

namespace test_token_arrays {  // unity build: this file's names stay in here

using namespace tessera;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tessera_token_arrays_" + name)).string();
}

void put_le(std::string& out, std::uint64_t v, unsigned bytes) {
  for (unsigned k = 0; k < bytes; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// numpy.save's layout: magic, version, header length, the dict padded with spaces to a
/// multiple of 64 bytes and ended by a newline, then the data.
std::string npy(const std::string& descr, const std::string& shape, const std::string& data, int major = 1,
                const std::string& fortran = "False") {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
  const std::size_t preamble = major == 1 ? 10 : 12;
  while ((preamble + dict.size() + 1) % 64 != 0) dict.push_back(' ');
  dict.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  put_le(out, dict.size(), major == 1 ? 2 : 4);
  return out + dict + data;
}

/// llm.c's write_datafile: 256 int32 (magic, version, count, zeros), then the ids.
std::string llmc(std::int32_t magic, std::int32_t version, std::int64_t count, const std::string& data) {
  std::string out;
  put_le(out, static_cast<std::uint32_t>(magic), 4);
  put_le(out, static_cast<std::uint32_t>(version), 4);
  put_le(out, static_cast<std::uint32_t>(count), 4);
  out.append(253 * 4, '\0');
  return out + data;
}

std::string ids_as(const std::vector<std::int64_t>& ids, unsigned bytes) {
  std::string out;
  for (std::int64_t id : ids) put_le(out, static_cast<std::uint64_t>(id), bytes);
  return out;
}

std::vector<std::uint32_t> read_all(io::TokenArrayReader& r, std::uint64_t vocab, std::size_t block) {
  std::vector<std::uint32_t> all, buf(block);
  while (const std::size_t n = r.read(buf, vocab)) all.insert(all.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(n));
  return all;
}

std::string error_of(const std::string& path, std::uint64_t vocab = 1000) {
  try {
    io::TokenArrayReader r(path);
    (void)read_all(r, vocab, 3);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("token arrays: NumPy .npy files and llm.c's token files read id for id, in blocks of any size") {
  const std::vector<std::int64_t> ids{0, 1, 7, 255, 256, 999, 42, 3, 500, 998, 12};
  const std::vector<std::uint32_t> want(ids.begin(), ids.end());
  struct Case {
    std::string name, bytes, description;
  };
  const std::vector<Case> cases{
      {"u2.npy", npy("<u2", "(11,)", ids_as(ids, 2)), "NumPy '<u2'"},
      {"u4.npy", npy("<u4", "(11,)", ids_as(ids, 4), 2), "NumPy '<u4'"},
      {"i4.npy", npy("<i4", "(11,)", ids_as(ids, 4), 3), "NumPy '<i4'"},
      {"i8.npy", npy("<i8", "(11,)", ids_as(ids, 8)), "NumPy '<i8'"},
      {"u8.npy", npy("<u8", "(11, )", ids_as(ids, 8)), "NumPy '<u8'"},
      {"gpt2.bin", llmc(20240520, 1, 11, ids_as(ids, 2)), "llm.c, uint16 ids"},
      {"llama3.bin", llmc(20240801, 7, 11, ids_as(ids, 4)), "llm.c, uint32 ids"},
  };
  for (const Case& c : cases)
    for (const std::size_t block : {1, 4, 11, 1000}) {
      CAPTURE(c.name);
      CAPTURE(block);
      const std::string path = temp_path(c.name);
      write_file(path, c.bytes);
      io::TokenArrayReader r(path);
      CHECK(r.count() == 11);
      CHECK(r.description() == c.description);
      CHECK(read_all(r, 1000, block) == want);
      std::filesystem::remove(path);
    }
  // An empty array reads as none.
  const std::string empty = temp_path("empty.npy");
  write_file(empty, npy("<u4", "(0,)", ""));
  io::TokenArrayReader r(empty);
  CHECK(r.count() == 0);
  CHECK(read_all(r, 10, 4).empty());
  std::filesystem::remove(empty);
}

TEST_CASE("token arrays: a malformed file or an id outside the vocabulary is refused by a message naming the file") {
  const std::vector<std::int64_t> ids{5, 6, 7, 8};
  struct Case {
    std::string name, bytes, expected;
    std::uint64_t vocab = 1000;
  };
  const std::vector<Case> cases{
      {"text.npy", "hello, world: not ids at all", "neither a NumPy .npy file nor an llm.c token file"},
      {"short.bin", "ab", "neither a NumPy .npy file nor an llm.c token file"},
      {"float.npy", npy("<f4", "(4,)", ids_as(ids, 4)), "NumPy dtype '<f4' is not an array of token ids"},
      {"bytes.npy", npy("|u1", "(4,)", "abcd"), "NumPy dtype '|u1' is not an array of token ids"},
      {"big.npy", npy(">u4", "(4,)", ids_as(ids, 4)), "NumPy dtype '>u4' is big-endian"},
      {"matrix.npy", npy("<u4", "(2, 2)", ids_as(ids, 4)), "NumPy array of shape (2, 2), not one dimension"},
      {"scalar.npy", npy("<u4", "()", ids_as({5}, 4)), "NumPy array of shape (), not one dimension"},
      {"fortran.npy", npy("<u4", "(4,)", ids_as(ids, 4), 1, "True"), "'fortran_order' is not False"},
      {"version.npy", npy("<u4", "(4,)", ids_as(ids, 4), 4), "NumPy format version 4"},
      {"truncated.npy", npy("<u2", "(5,)", ids_as(ids, 2)),
       "its NumPy shape says 5 ids of 2 bytes from byte 128, 138 bytes in all; the file holds 136 (truncated)"},
      {"long.npy", npy("<u2", "(3,)", ids_as(ids, 2)), "its NumPy shape says 3 ids of 2 bytes"},
      {"truncated.bin", llmc(20240520, 1, 9, ids_as(ids, 2)),
       "its llm.c header says 9 ids of 2 bytes from byte 1024, 1042 bytes in all; the file holds 1032 (truncated)"},
      {"version.bin", llmc(20240801, 1, 4, ids_as(ids, 4)), "an llm.c token file with magic 20240801 is version 7, not 1"},
      {"negative.bin", llmc(20240520, 1, -4, ids_as(ids, 2)), "llm.c header: a negative id count (-4)"},
      {"vocab.npy", npy("<u4", "(4,)", ids_as(ids, 4)), "id 3 is 8, not below the vocabulary size 8", 8},
      {"negative.npy", npy("<i8", "(4,)", ids_as({5, 6, -3, 8}, 8)), "id 2 is -3, a negative id"},
      {"negative32.npy", npy("<i4", "(4,)", ids_as({5, -70000, 6, 8}, 4)), "id 1 is -70000, a negative id"},
      {"vocab.bin", llmc(20240801, 7, 4, ids_as({5, 128256, 6, 8}, 4)),
       "id 1 is 128256, not below the vocabulary size 128256", 128256},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const std::string path = temp_path(c.name);
    write_file(path, c.bytes);
    const std::string e = error_of(path, c.vocab);
    CHECK(e.find(path + ": ") == 0);
    CHECK_MESSAGE(e.find(c.expected) != std::string::npos, e);
    std::filesystem::remove(path);
  }
  CHECK(error_of(temp_path("missing.npy")).find("cannot open it for reading") != std::string::npos);
}

}  // namespace test_token_arrays
