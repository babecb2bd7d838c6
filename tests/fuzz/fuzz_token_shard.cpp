// libFuzzer target: the token shard readers (io/token_shard.hpp, io/mapped_token_shard.hpp),
// the files llama-tokenize writes and the data loader reads.
//
// Input layout: one byte of switches, then the shard's bytes, written to a scratch file.
//   bit 0  the CRCs are made right before writing (version 3: each chunk's entry and the
//          table's CRC in the header; versions 1 and 2: the payload's), so mutations
//          reach the id, mask and largest-id checks instead of stopping at a CRC;
//   bit 1  the file is cut to the size the header's version and flags give the largest
//          count it can hold, and that count written into the header, so mutations reach
//          past the size check;
//   bit 2  the mapped reader checks a version 1 or 2 shard in pieces of one id on three
//          threads (crc32_combine joins their CRCs), else in one piece.
// The readers must agree: read_token_stream (the whole file, checked), and
// MappedTokenShard (open, every chunk checked, every token read), either both accept the
// file or both refuse it with tessera::Error naming it. When they accept: the same ids
// and mask; max_id() the largest id and every id below vocab_size; any_target and read
// over windows the same as the stream; a window past the end refused; the header
// read_token_shard_header gives the same; read_token_file gives the same ids.
//
// Any other exception, a crash, a leak, undefined behaviour, a timeout, or a broken
// invariant above (reported on stderr, then abort) is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/crc32.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"
#include "scratch_file.hpp"

namespace {

namespace io = tessera::io;

[[noreturn]] void finding(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz_token_shard: %s %.*s\n", what, static_cast<int>(std::min<std::size_t>(detail.size(), 300)),
               detail.data());
  std::abort();
}

/// The file each input is written to; named *.u32, so read_token_file reads a file
/// without the magic as a headerless array.
const fuzz::ScratchFile& scratch() {
  static const fuzz::ScratchFile file("token-shard", ".u32");
  return file;
}
const std::string& scratch_path() { return scratch().path(); }

io::TokenShardHeader layout_of(const std::vector<unsigned char>& f, std::uint64_t count) {
  io::TokenShardHeader h;
  h.version = io::detail::load_u32_le(f.data() + 8);
  h.loss_mask = (io::detail::load_u32_le(f.data() + 28) & io::token_shard_flag_loss_mask) != 0;
  h.count = count;
  return h;
}

/// Bit 1: the largest count the file can hold under its header's version and flags.
void fit_count(std::vector<unsigned char>& f) {
  if (f.size() < io::token_shard_header_bytes) return;
  std::uint64_t count = (f.size() - io::token_shard_header_bytes) / 4;
  while (count > 0 && layout_of(f, count).file_bytes() > f.size()) --count;
  io::detail::store_u64_le(f.data() + 16, count);
  f.resize(static_cast<std::size_t>(layout_of(f, count).file_bytes()));
}

/// Bit 0: the CRCs the header's layout asks for, computed over the file as it is.
void fix_crcs(std::vector<unsigned char>& f) {
  if (f.size() < io::token_shard_header_bytes) return;
  const io::TokenShardHeader h = layout_of(f, io::detail::load_u64_le(f.data() + 16));
  if (h.count > (f.size() - io::token_shard_header_bytes) / 4 || h.file_bytes() > f.size()) return;
  const unsigned char* ids = f.data() + io::token_shard_header_bytes;
  const unsigned char* mask = f.data() + h.mask_offset();
  if (h.chunked()) {
    unsigned char* table = f.data() + h.table_offset();
    for (std::uint64_t k = 0; k < h.chunks(); ++k) {
      const auto [first, n] = io::detail::chunk_tokens(h, k);
      std::uint32_t crc = io::crc32(ids + 4 * first, 4 * n);
      if (h.loss_mask) crc = io::crc32_update(crc, mask + first / 8, (n + 7) / 8);
      io::detail::store_u32_le(table + 8 * k, crc);
    }
    io::detail::store_u32_le(f.data() + 24, io::crc32(table, h.table_bytes()));
  } else {
    const std::uint32_t crc = io::crc32_update(io::crc32(ids, 4 * h.count), mask, h.mask_bytes());
    io::detail::store_u32_le(f.data() + 24, crc);
  }
}

bool names_file(const tessera::Error& e) { return std::string_view(e.what()).find(scratch_path()) != std::string_view::npos; }

/// The mapped reader's view: every chunk checked, every token read in windows of `window`.
std::optional<io::TokenStream> mapped(bool pieces, std::size_t window, std::uint32_t& max_id) {
  try {
    const io::MappedTokenShard shard = io::MappedTokenShard::open(scratch_path(), pieces ? 3 : 1, pieces ? 4 : 1 << 26);
    io::TokenStream s;
    s.ids.resize(static_cast<std::size_t>(shard.size()));
    std::vector<std::uint8_t> keep(s.ids.size());
    for (std::size_t first = 0; first < s.ids.size(); first += window) {
      const std::size_t n = std::min(window, s.ids.size() - first);
      shard.read(first, n, s.ids.data() + first, keep.data() + first);
    }
    shard.check_all(pieces ? 3 : 1);
    if (shard.chunks_checked() != (shard.checked_as_read() ? shard.header().chunks() : 0))
      finding("a chunk was left unchecked");
    if (shard.masked()) {
      s.loss_mask = keep;
      for (std::size_t first = 0; first < keep.size(); first += window) {
        const std::size_t n = std::min(window, keep.size() - first);
        const bool any = std::any_of(keep.begin() + first, keep.begin() + first + n, [](auto b) { return b != 0; });
        if (shard.any_target(first, n) != any) finding("any_target disagrees with the mask");
      }
    } else if (std::any_of(keep.begin(), keep.end(), [](auto b) { return b != 1; })) {
      finding("a shard without a mask read a token as not a target");
    }
    bool refused = false;
    try {
      std::uint32_t id = 0;
      shard.read(shard.size(), 1, &id, nullptr);
    } catch (const tessera::Error&) {
      refused = true;
    }
    if (!refused) finding("a read past the end was not refused");
    max_id = shard.max_id();
    return s;
  } catch (const tessera::Error& e) {
    if (!names_file(e)) finding("the mapped reader's error names no file:", e.what());
    return std::nullopt;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t switches = data[0];
  std::vector<unsigned char> file(data + 1, data + size);
  if (switches & 2) fit_count(file);
  if (switches & 1) fix_crcs(file);
  scratch().write(file.data(), file.size());

  std::optional<io::TokenStream> whole;
  try {
    whole = io::read_token_stream(scratch_path());
  } catch (const tessera::Error& e) {
    if (!names_file(e)) finding("read_token_stream's error names no file:", e.what());
  }
  std::uint32_t max_id = 0;
  const std::size_t window = 1 + static_cast<std::size_t>(switches >> 3) * 7;
  const std::optional<io::TokenStream> mapped_view = mapped((switches & 4) != 0, window, max_id);
  if (whole.has_value() != mapped_view.has_value())
    finding(whole ? "the mapped reader refused a shard read_token_stream took"
                  : "the mapped reader took a shard read_token_stream refused");

  // read_token_file: the shard's ids when it has the magic; a .u32 array of the bytes otherwise.
  std::optional<std::vector<std::uint32_t>> any;
  try {
    any = io::read_token_file(scratch_path());
  } catch (const tessera::Error& e) {
    if (!names_file(e)) finding("read_token_file's error names no file:", e.what());
  }
  const bool magic = file.size() >= 8 && std::string_view(reinterpret_cast<const char*>(file.data()), 8) == "TSRATOKS";
  if (magic && any.has_value() != whole.has_value()) finding("read_token_file and read_token_stream disagree");
  if (!magic && any.has_value() != (file.size() % 4 == 0)) finding("a .u32 array read wrongly");
  if (!whole) return 0;

  if (whole->ids != mapped_view->ids) finding("the two readers read different ids");
  if (whole->loss_mask != mapped_view->loss_mask) finding("the two readers read different masks");
  if (*any != whole->ids) finding("read_token_file read other ids");
  const io::TokenShardHeader h = io::read_token_shard_header(scratch_path());
  // (An empty shard's mask is empty, so its stream reads as unmasked either way.)
  if (h.count != whole->ids.size() || (h.count > 0 && h.loss_mask != whole->masked()))
    finding("the header disagrees with the stream");
  std::uint32_t top = 0;
  for (std::uint32_t id : whole->ids) {
    if (id >= h.vocab_size) finding("an id at or above vocab_size was accepted");
    top = std::max(top, id);
  }
  if (top != max_id) finding("max_id() is not the largest id");
  for (std::size_t i = 0; i < whole->loss_mask.size(); ++i)
    if (whole->loss_mask[i] > 1) finding("a mask value other than 0 or 1");
  return 0;
}
