// Data loading: packing, windows, data-parallel slicing of the global batch, wrap-around,
// resuming, and the path from the synthetic corpus through a token shard to a batch.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "tessera/data/corpus.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/io/tokenizer.hpp"

namespace test_loader {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

using tessera::data::Batch;
using tessera::data::DataLoader;
using Ids = std::vector<std::uint32_t>;
using Row = std::vector<std::int32_t>;


Ids iota_tokens(std::size_t n) {
  Ids ids(n);
  std::iota(ids.begin(), ids.end(), 0u);
  return ids;
}

/// Row `r` of a (batch, seq_len) array.
Row row_of(const std::vector<std::int32_t>& v, std::int64_t seq_len, std::int64_t r) {
  return Row(v.begin() + r * seq_len, v.begin() + (r + 1) * seq_len);
}

/// The inputs and targets of window `w` of an iota stream.
Row window_inputs(std::int64_t w, std::int64_t seq_len) {
  Row row(static_cast<std::size_t>(seq_len));
  std::iota(row.begin(), row.end(), static_cast<std::int32_t>(w * (seq_len + 1)));
  return row;
}
Row window_targets(std::int64_t w, std::int64_t seq_len) {
  Row row(static_cast<std::size_t>(seq_len));
  std::iota(row.begin(), row.end(), static_cast<std::int32_t>(w * (seq_len + 1) + 1));
  return row;
}

}  // namespace

TEST_CASE("pack_documents: <|bos|> bytes <|eos|> per document") {
  tessera::io::ByteTokenizer tok;
  CHECK(tessera::data::pack_documents({"ab", "c"}, tok) == Ids{256, 97, 98, 257, 256, 99, 257});
  CHECK(tessera::data::pack_documents({""}, tok) == Ids{256, 257});
  CHECK(tessera::data::pack_documents({}, tok).empty());
}

TEST_CASE("DataLoader: consecutive non-overlapping windows of seq_len + 1 tokens") {
  DataLoader loader(iota_tokens(30), 3, 2);  // 7 windows of 4 tokens; 2 tokens left over
  CHECK(loader.windows_per_epoch() == 7);
  Batch b = loader.next();
  CHECK(b.batch == 2);
  CHECK(b.seq_len == 3);
  REQUIRE(b.inputs.size() == 6);
  REQUIRE(b.targets.size() == 6);
  CHECK(b.inputs == Row{0, 1, 2, 4, 5, 6});
  CHECK(b.targets == Row{1, 2, 3, 5, 6, 7});
  CHECK(b.n_targets == 6);
  CHECK(tessera::data::count_targets(b) == 6);
  CHECK(loader.position() == 2);
  b = loader.next();
  CHECK(b.inputs == Row{8, 9, 10, 12, 13, 14});
  CHECK(b.targets == Row{9, 10, 11, 13, 14, 15});
  CHECK(loader.epoch() == 0);
}

TEST_CASE("DataLoader: wraps to the start and counts epochs") {
  const std::int64_t seq = 3;
  DataLoader loader(iota_tokens(22), seq, 2);  // 5 windows
  REQUIRE(loader.windows_per_epoch() == 5);
  const std::int64_t expected[][2] = {{0, 1}, {2, 3}, {4, 0}, {1, 2}, {3, 4}, {0, 1}};
  const std::int64_t epochs_after[] = {0, 0, 1, 1, 2, 2};
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    Batch b = loader.next();
    for (std::int64_t r = 0; r < 2; ++r) {
      CHECK(row_of(b.inputs, seq, r) == window_inputs(expected[step][r], seq));
      CHECK(row_of(b.targets, seq, r) == window_targets(expected[step][r], seq));
    }
    CHECK(loader.epoch() == epochs_after[step]);
  }
  CHECK(loader.position() == 12);
}

TEST_CASE("DataLoader: a global batch larger than the stream wraps more than once") {
  DataLoader loader(iota_tokens(9), 3, 5);  // 2 windows, 5 per batch
  Batch b = loader.next();
  for (std::int64_t r = 0; r < 5; ++r) CHECK(row_of(b.inputs, 3, r) == window_inputs(r % 2, 3));
  CHECK(loader.epoch() == 2);
}

TEST_CASE("DataLoader: every data-parallel layout sees the same global batch") {
  const std::int64_t seq = 4;
  const Ids tokens = iota_tokens(5 * 23 + 3);  // 23 windows: batches straddle the wrap
  for (std::int64_t degree : {1, 2, 3, 4}) {
    for (std::int64_t local : {1, 2, 3}) {
      CAPTURE(degree);
      CAPTURE(local);
      DataLoader single(tokens, seq, local * degree);
      std::vector<DataLoader> ranks;
      for (std::int64_t r = 0; r < degree; ++r) ranks.emplace_back(tokens, seq, local, r, degree);
      for (int step = 0; step < 12; ++step) {
        Batch whole = single.next();
        Row inputs, targets;
        std::int64_t n_targets = 0;
        for (auto& rank : ranks) {
          Batch part = rank.next();
          CHECK(part.batch == local);
          inputs.insert(inputs.end(), part.inputs.begin(), part.inputs.end());
          targets.insert(targets.end(), part.targets.begin(), part.targets.end());
          n_targets += part.n_targets;
        }
        CHECK(inputs == whole.inputs);
        CHECK(targets == whole.targets);
        CHECK(n_targets == whole.n_targets);
        for (auto& rank : ranks) {
          CHECK(rank.position() == single.position());
          CHECK(rank.epoch() == single.epoch());
        }
      }
    }
  }
}

TEST_CASE("DataLoader: seek to a saved position resumes the stream exactly") {
  const Ids tokens = iota_tokens(4 * 11);
  DataLoader a(tokens, 3, 2, 1, 2);
  for (int i = 0; i < 7; ++i) a.next();  // past one wrap
  const std::int64_t saved = a.position();
  CHECK(saved == 28);
  CHECK(a.epoch() == 2);
  DataLoader b(tokens, 3, 2, 1, 2);
  b.seek(saved);
  CHECK(b.epoch() == a.epoch());
  for (int i = 0; i < 5; ++i) {
    Batch x = a.next(), y = b.next();
    CHECK(x.inputs == y.inputs);
    CHECK(x.targets == y.targets);
  }
  b.seek(0);
  CHECK(b.next().inputs == DataLoader(tokens, 3, 2, 1, 2).next().inputs);
  CHECK_ERROR_CONTAINS(b.seek(-1), "window index -1 is negative");
}

TEST_CASE("DataLoader: bad arguments") {
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(4), 4, 1), "has 4 tokens, fewer than one window of seq_len + 1 = 5");
  CHECK_ERROR_CONTAINS(DataLoader(Ids{}, 1, 1), "has 0 tokens");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), 0, 1), "seq_len must be positive, got 0");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), -3, 1), "seq_len must be positive, got -3");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), 2, 0), "local_batch_size must be positive, got 0");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), 2, 1, 0, 0), "dp_degree must be positive, got 0");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), 2, 1, 2, 2), "dp_rank 2 is out of range for dp_degree 2");
  CHECK_ERROR_CONTAINS(DataLoader(iota_tokens(10), 2, 1, -1, 2), "dp_rank -1 is out of range");
  Ids big = iota_tokens(10);
  big[7] = 0x80000000u;
  CHECK_ERROR_CONTAINS(DataLoader(big, 2, 1), "token id 2147483648 at index 7 does not fit in int32");
  // Exactly one window is enough.
  DataLoader one(iota_tokens(5), 4, 1);
  CHECK(one.windows_per_epoch() == 1);
  CHECK(one.next().targets == Row{1, 2, 3, 4});
}

TEST_CASE("DataLoader: a loss mask turns the targets it leaves out into ignore_index, in every layout") {
  // 4 windows of 5 tokens (seq_len 4); token i counts when i % 3 == 0.
  tessera::io::TokenStream stream{iota_tokens(20), {}};
  for (std::size_t i = 0; i < 20; ++i) stream.loss_mask.push_back(i % 3 == 0 ? 1 : 0);
  DataLoader whole(stream, 4, 2);
  CHECK(whole.masked());
  const Batch b = whole.next();
  // Window 0 is tokens 0..4: inputs 0 1 2 3, targets 1 2 3 4, of which only 3 counts.
  CHECK(row_of(b.inputs, 4, 0) == Row{0, 1, 2, 3});
  CHECK(row_of(b.targets, 4, 0) == Row{-100, -100, 3, -100});
  // Window 1 is tokens 5..9: targets 6 7 8 9, of which 6 and 9 count.
  CHECK(row_of(b.targets, 4, 1) == Row{6, -100, -100, 9});
  CHECK(b.n_targets == 3);
  // Each data-parallel rank's slice carries the same mask as the whole batch's rows.
  for (std::int64_t r = 0; r < 2; ++r) {
    DataLoader part(stream, 4, 1, r, 2);
    const Batch p = part.next();
    CHECK(p.targets == row_of(b.targets, 4, r));
  }
  // Wrapped round and resumed, the mask stays with its tokens.
  DataLoader later(stream, 4, 2);
  later.seek(4);
  CHECK(later.next().targets == b.targets);
}

TEST_CASE("DataLoader: a loss mask of the wrong length, or one that keeps nothing, is refused") {
  CHECK_ERROR_CONTAINS(DataLoader(tessera::io::TokenStream{iota_tokens(10), {1, 0}}, 4, 1), "10 tokens but 2 loss mask values");
  tessera::io::TokenStream none{iota_tokens(12), std::vector<std::uint8_t>(12, 0)};
  none.loss_mask[11] = 1;  // past the last whole window of 5 tokens: never a target
  CHECK_ERROR_CONTAINS(DataLoader(none, 4, 1), "the loss mask leaves no target in the 2 windows");
}

TEST_CASE("count_targets skips ignore_index") {
  Batch b;
  b.batch = 1;
  b.seq_len = 4;
  b.targets = {5, Batch::ignore_index, 7, Batch::ignore_index};
  CHECK(tessera::data::count_targets(b) == 2);
  b.targets.clear();
  CHECK(tessera::data::count_targets(b) == 0);
}

TEST_CASE("TokenCorpus: shards and streams in memory read as one stream, windows straddling them") {
  using tessera::data::TokenCorpus;
  tessera::test::TempDir dir("tessera-corpus");
  // 0..99 split as memory [0, 17), shard [17, 40) with a mask, an empty shard, shard [40, 100).
  const Ids all = iota_tokens(100);
  std::vector<std::uint8_t> mask(100, 1);
  tessera::io::TokenStream masked{Ids(all.begin() + 17, all.begin() + 40), {}};
  for (std::size_t i = 0; i < masked.ids.size(); ++i) {
    masked.loss_mask.push_back(i % 4 == 0 ? 1 : 0);
    mask[17 + i] = masked.loss_mask.back();
  }
  tessera::io::write_token_shard(dir.file("b.bin"), masked, 1000);
  tessera::io::write_token_shard(dir.file("empty.bin"), Ids{}, 1000);
  tessera::io::write_token_shard(dir.file("c.bin"), Ids(all.begin() + 40, all.end()), 1000);
  TokenCorpus corpus(tessera::io::TokenStream{Ids(all.begin(), all.begin() + 17), {}}, "head");
  corpus.append(tessera::io::MappedTokenShard::open(dir.file("b.bin")));
  corpus.append(tessera::io::MappedTokenShard::open(dir.file("empty.bin")));
  corpus.append(tessera::io::MappedTokenShard::open(dir.file("c.bin")));
  CHECK(corpus.size() == 100);
  CHECK(corpus.masked());
  CHECK(corpus.max_id() == 99);
  CHECK(corpus.names() == std::vector<std::string>{"head", dir.file("b.bin"), dir.file("c.bin")});
  CHECK(corpus.resident_tokens() == 17);
  for (std::uint64_t first = 0; first < 100; first += 3)
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{9}, std::size_t{30}}) {
      if (first + n > 100) continue;
      Ids ids(n);
      std::vector<std::uint8_t> keep(n);
      corpus.read(first, n, ids.data(), keep.data());
      CHECK(ids == Ids(all.begin() + static_cast<std::ptrdiff_t>(first), all.begin() + static_cast<std::ptrdiff_t>(first + n)));
      CHECK(keep == std::vector<std::uint8_t>(mask.begin() + static_cast<std::ptrdiff_t>(first),
                                              mask.begin() + static_cast<std::ptrdiff_t>(first + n)));
      const bool any = std::any_of(keep.begin(), keep.end(), [](std::uint8_t k) { return k != 0; });
      CHECK(corpus.any_target(first, n) == any);
    }
  CHECK(corpus.first_above(98) == 99);
  CHECK(corpus.first_above(99) == 100);
  CHECK_ERROR_CONTAINS(corpus.read(95, 6, nullptr, nullptr), "tokens [95, 101) are past its 100 tokens");

  // A DataLoader over the corpus gives what one over the same tokens in memory gives,
  // on every data-parallel rank, across the wrap.
  const tessera::io::TokenStream flat{all, mask};
  for (std::int64_t degree : {1, 3}) {
    for (std::int64_t r = 0; r < degree; ++r) {
      DataLoader mapped(corpus, 6, 2, r, degree), memory(flat, 6, 2, r, degree);
      CHECK(mapped.windows_per_epoch() == 14);
      for (int step = 0; step < 9; ++step) {
        const Batch x = mapped.next(), y = memory.next();
        CHECK(x.inputs == y.inputs);
        CHECK(x.targets == y.targets);
        CHECK(x.n_targets == y.n_targets);
      }
    }
  }
}

TEST_CASE("DataLoader: a weighted mix deals each stream its share, the same order on every layout") {
  using tessera::data::TokenCorpus;
  // Three streams told apart by their ids: 1000 + k, 2000 + k, 3000 + k; windows of 4 tokens.
  auto stream = [](std::uint32_t base, std::size_t n) {
    Ids ids(n);
    for (std::size_t k = 0; k < n; ++k) ids[k] = base + static_cast<std::uint32_t>(k);
    return TokenCorpus(tessera::io::TokenStream{ids, {}}, "stream " + std::to_string(base));
  };
  const std::vector<TokenCorpus> corpora = {stream(1000, 4 * 50), stream(2000, 4 * 3 + 2), stream(3000, 4 * 20)};
  const std::vector<double> weights = {5, 3, 2};  // any units: 50%, 30%, 20%
  const std::int64_t seq = 3;
  DataLoader whole(corpora, weights, seq, 6);
  REQUIRE(whole.streams().size() == 3);
  CHECK(whole.streams()[0].weight == doctest::Approx(0.5));
  CHECK(whole.streams()[1].windows == 3);
  CHECK(whole.windows_per_epoch() == 73);
  // The order: after every window, each stream's count within one of its share, and each
  // stream's windows in its own order, wrapping by itself (stream 2 has only 3).
  std::vector<std::int64_t> taken(3, 0);
  std::vector<Row> order;
  for (int step = 0; step < 20; ++step) {
    const Batch b = whole.next();
    for (std::int64_t r = 0; r < b.batch; ++r) {
      const Row in = row_of(b.inputs, seq, r);
      const std::size_t d = static_cast<std::size_t>(in[0] / 1000 - 1);
      const std::int64_t w = taken[d] % whole.streams()[d].windows;
      CHECK(in[0] == static_cast<std::int32_t>(1000 * (d + 1) + 4 * w));
      CHECK(row_of(b.targets, seq, r)[2] == in[0] + 3);
      ++taken[d];
      const auto n = static_cast<double>(order.size() + 1);
      for (std::size_t e = 0; e < 3; ++e) CHECK(std::abs(static_cast<double>(taken[e]) - n * weights[e] / 10) <= 1.0);
      order.push_back(in);
    }
  }
  CHECK(whole.windows_taken(whole.position()) == taken);
  CHECK(whole.epoch() == std::min({taken[0] / 50, taken[1] / 3, taken[2] / 20}));
  // Sliced over data-parallel ranks, the same global order; resumed anywhere, the same.
  for (std::int64_t degree : {2, 3}) {
    std::vector<DataLoader> ranks;
    for (std::int64_t r = 0; r < degree; ++r) ranks.emplace_back(corpora, weights, seq, 6 / degree, r, degree);
    for (int step = 0; step < 20; ++step)
      for (std::int64_t r = 0; r < degree; ++r) {
        const Batch b = ranks[static_cast<std::size_t>(r)].next();
        for (std::int64_t row = 0; row < b.batch; ++row)
          CHECK(row_of(b.inputs, seq, row) == order[static_cast<std::size_t>(step * 6 + r * (6 / degree) + row)]);
      }
  }
  for (std::int64_t at : {0, 6, 42, 102}) {
    DataLoader resumed(corpora, weights, seq, 3, 1, 2);
    resumed.next();  // somewhere else first: seek goes back as well as forward
    resumed.next();
    resumed.seek(at);
    for (int step = 0; step < 3; ++step) {
      const Batch b = resumed.next();
      for (std::int64_t row = 0; row < 3; ++row)
        CHECK(row_of(b.inputs, seq, row) == order[static_cast<std::size_t>(at + step * 6 + 3 + row)]);
    }
  }
  // Equal weights alternate; one stream of weight 1 reads as DataLoader over it alone.
  DataLoader even(std::vector<TokenCorpus>{stream(1000, 40), stream(2000, 40)}, std::vector<double>{1, 1}, seq, 4);
  const Batch e = even.next();
  for (std::int64_t r = 0; r < 4; ++r) CHECK(row_of(e.inputs, seq, r)[0] / 1000 == 1 + r % 2);
  DataLoader alone(std::vector<TokenCorpus>{stream(1000, 40)}, std::vector<double>{7}, seq, 4);
  DataLoader plain(stream(1000, 40), seq, 4);
  CHECK(alone.next().inputs == plain.next().inputs);
}

TEST_CASE("DataLoader: a mix refuses bad weights and a stream too short for a window, naming it") {
  using tessera::data::TokenCorpus;
  auto stream = [](std::size_t n, const std::string& name) {
    return TokenCorpus(tessera::io::TokenStream{iota_tokens(n), {}}, name);
  };
  const std::vector<TokenCorpus> two = {stream(40, "a.bin"), stream(40, "b.bin")};
  CHECK_ERROR_CONTAINS(DataLoader(two, std::vector<double>{1}, 3, 1), "2 token streams but 1 weights");
  CHECK_ERROR_CONTAINS(DataLoader(two, std::vector<double>{1, 0}, 3, 1), "the weight of b.bin is 0; weights are positive numbers");
  CHECK_ERROR_CONTAINS(DataLoader(two, std::vector<double>{-1, 1}, 3, 1), "the weight of a.bin is -1");
  CHECK_ERROR_CONTAINS(DataLoader(std::vector<TokenCorpus>{stream(40, "a.bin"), stream(3, "short.bin")}, std::vector<double>{1, 1}, 3, 1),
                       "short.bin has 3 tokens, fewer than one window of seq_len + 1 = 4");
  CHECK_ERROR_CONTAINS(DataLoader(std::vector<TokenCorpus>{}, {}, 3, 1), "no token stream to read");
  tessera::io::TokenStream none{iota_tokens(8), std::vector<std::uint8_t>(8, 0)};
  CHECK_ERROR_CONTAINS(DataLoader(std::vector<TokenCorpus>{stream(40, "a.bin"), TokenCorpus(none, "prompts.bin")}, std::vector<double>{1, 1}, 3, 1),
                       "prompts.bin: the loss mask leaves no target in the 2 windows");
}

TEST_CASE("DataLoader: first-fit packing keeps documents whole, in the first open row with room") {
  using tessera::data::Packing;
  using tessera::data::TokenCorpus;
  // Documents start at BOS = 1. Row capacity: seq_len 8 slots; a document of L tokens fills L - 1.
  const std::vector<Ids> docs = {{1, 101, 102, 103, 104},                                   // A: 4 slots
                                 {1, 201, 202, 203, 204, 205, 206, 207, 208},               // B: 8
                                 {1, 301, 302},                                             // C: 2
                                 {1, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411},  // D: 11, too long
                                 {1, 501, 502, 503},                                        // E: 3
                                 {1, 601},                                                  // F: 1
                                 {1}};                                                      // G: nothing to predict
  tessera::io::TokenStream stream;
  for (const Ids& d : docs)
    for (std::uint32_t t : d) {
      stream.ids.push_back(t);
      stream.loss_mask.push_back(t % 2 == 0 ? 1 : 0);  // even ids count
    }
  Packing packing;
  packing.kind = Packing::Kind::first_fit;
  packing.document_start_id = 1;
  packing.open_rows = 2;
  // Two open rows: A opens row 0, B row 1, C joins row 0; E fits neither, so row 0
  // ([A, C]) closes and E opens a row that F joins; then row 1 ([B]) and [E, F] close.
  const auto plan = tessera::data::PackedRows::plan(TokenCorpus(tessera::io::TokenStream{stream.ids, {}}), 8, packing);
  CHECK(plan.rows() == 3);
  CHECK(plan.documents == 7);
  CHECK(plan.too_long == 1);
  CHECK(plan.padding == 2 + 0 + 4);
  const Row pad(1, 0);
  auto row = [](std::initializer_list<Ids> parts, bool targets, std::size_t n) {
    Row r;
    for (const Ids& d : parts) {
      if (targets)
        r.insert(r.end(), d.begin() + 1, d.end());
      else
        r.insert(r.end(), d.begin(), d.end() - 1);
    }
    r.resize(n, targets ? Batch::ignore_index : 0);
    return r;
  };
  DataLoader plain(std::vector<TokenCorpus>{TokenCorpus(tessera::io::TokenStream{stream.ids, {}})}, std::vector<double>{1},
                   8, 3, 0, 1, packing);
  CHECK(plain.windows_per_epoch() == 3);
  const Batch b = plain.next();
  CHECK(row_of(b.inputs, 8, 0) == row({docs[0], docs[2]}, false, 8));
  CHECK(row_of(b.targets, 8, 0) == row({docs[0], docs[2]}, true, 8));
  CHECK(row_of(b.inputs, 8, 1) == row({docs[1]}, false, 8));
  CHECK(row_of(b.targets, 8, 2) == row({docs[4], docs[5]}, true, 8));
  CHECK(b.n_targets == 6 + 8 + 4);
  // The loss mask stays with its tokens; rows wrap and slice over ranks like windows.
  DataLoader masked(std::vector<TokenCorpus>{TokenCorpus(stream)}, std::vector<double>{1}, 8, 1, 1, 3, packing);
  const Batch m = masked.next();
  // Rank 1 of 3 reads row 1, B: its targets 201..208, the odd ones left out.
  CHECK(row_of(m.targets, 8, 0) == Row{Batch::ignore_index, 202, Batch::ignore_index, 204, Batch::ignore_index, 206,
                                       Batch::ignore_index, 208});
  masked.seek(3);
  CHECK(masked.next().inputs == m.inputs);
  // Tokens before the first BOS are a document too; a stream whose documents are all too long is refused.
  Ids lead = {7, 8, 9, 1, 5, 6};
  const auto lead_plan = tessera::data::PackedRows::plan(TokenCorpus(tessera::io::TokenStream{lead, {}}), 4, packing);
  CHECK(lead_plan.documents == 2);
  CHECK(lead_plan.rows() == 1);
  CHECK_ERROR_CONTAINS(DataLoader(std::vector<TokenCorpus>{TokenCorpus(tessera::io::TokenStream{docs[3], {}}, "long.bin")},
                                  std::vector<double>{1}, 8, 1, 0, 1, packing),
                       "long.bin: every one of its 1 documents is longer than a row of seq_len + 1 = 9 tokens");
  Packing no_bos = packing;
  no_bos.document_start_id = -1;
  CHECK_ERROR_CONTAINS(tessera::data::PackedRows::plan(TokenCorpus(stream), 8, no_bos), "needs the id documents start with");
}

TEST_CASE("permute is a permutation of [0, n) for every n, another for another key") {
  for (std::int64_t n : {1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4099}) {
    CAPTURE(n);
    std::vector<std::int64_t> seen(static_cast<std::size_t>(n), 0);
    std::int64_t moved = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t p = tessera::data::permute(j, n, 42);
      REQUIRE(p >= 0);
      REQUIRE(p < n);
      ++seen[static_cast<std::size_t>(p)];
      moved += p != j ? 1 : 0;
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](std::int64_t c) { return c == 1; }));
    if (n >= 100) CHECK(moved > n * 9 / 10);  // a shuffle, not the identity
  }
  std::int64_t same = 0;
  for (std::int64_t j = 0; j < 1000; ++j) same += tessera::data::permute(j, 1000, 1) == tessera::data::permute(j, 1000, 2);
  CHECK(same < 20);
}

TEST_CASE("DataLoader: shuffled, each epoch reads every window once in an order of its own, on every layout") {
  using tessera::data::TokenCorpus;
  using tessera::data::WindowOrder;
  const std::int64_t seq = 3, windows = 20;
  const Ids tokens = iota_tokens(static_cast<std::size_t>(windows * (seq + 1)));
  const WindowOrder order{true, 7};
  auto loader = [&](std::int64_t local, std::int64_t rank, std::int64_t degree, WindowOrder o) {
    return DataLoader(std::vector<TokenCorpus>{TokenCorpus(tessera::io::TokenStream{tokens, {}})}, std::vector<double>{1},
                      seq, local, rank, degree, {}, o);
  };
  DataLoader whole = loader(4, 0, 1, order);
  std::vector<std::int64_t> read;  // the windows in the order read
  for (int step = 0; step < 10; ++step) {
    const Batch b = whole.next();
    for (std::int64_t r = 0; r < 4; ++r) read.push_back(row_of(b.inputs, seq, r)[0] / (seq + 1));
  }
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::int64_t> e(read.begin() + epoch * windows, read.begin() + (epoch + 1) * windows);
    std::vector<std::int64_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> all(static_cast<std::size_t>(windows));
    std::iota(all.begin(), all.end(), 0);
    CHECK(sorted == all);
  }
  CHECK_FALSE(std::is_sorted(read.begin(), read.begin() + windows));
  CHECK(std::vector<std::int64_t>(read.begin(), read.begin() + windows) !=
        std::vector<std::int64_t>(read.begin() + windows, read.end()));
  // Two ranks, and a resume at step 3: the same global order.
  for (std::int64_t r = 0; r < 2; ++r) {
    DataLoader part = loader(2, r, 2, order);
    part.seek(12);
    for (int step = 3; step < 10; ++step) {
      const Batch b = part.next();
      for (std::int64_t row = 0; row < 2; ++row)
        CHECK(row_of(b.inputs, seq, row)[0] / (seq + 1) == read[static_cast<std::size_t>(step * 4 + r * 2 + row)]);
    }
  }
  // Another seed, another order; unshuffled, the files' order.
  DataLoader other = loader(4, 0, 1, WindowOrder{true, 8});
  CHECK(other.next().inputs != loader(4, 0, 1, order).next().inputs);
  CHECK(loader(4, 0, 1, {}).next().inputs == DataLoader(tokens, seq, 4).next().inputs);
}

TEST_CASE("synthetic corpus -> token shard -> DataLoader -> text") {
  namespace fs = std::filesystem;
  auto base = fs::temp_directory_path();
  auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  fs::path dir;
  for (int i = 0;; ++i) {
    dir = base / ("tessera-test-loader-" + std::to_string(stamp) + "-" + std::to_string(i));
    if (fs::create_directory(dir)) break;
  }
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{dir};

  tessera::io::ByteTokenizer tok;
  auto docs = tessera::data::synthetic_corpus(0, 200);
  Ids packed = tessera::data::pack_documents(docs, tok);
  const std::string path = (dir / "corpus.bin").string();
  tessera::io::write_token_shard(path, packed, static_cast<std::uint32_t>(tok.vocab_size()));
  Ids tokens = tessera::io::read_token_shard(path);
  REQUIRE(tokens == packed);
  CHECK(tessera::io::read_token_shard_header(path).count == packed.size());

  std::string all;
  for (const auto& d : docs) all += d;
  DataLoader loader(tokens, 64, 4);
  for (int step = 0; step < 3; ++step) {
    Batch b = loader.next();
    for (std::int64_t r = 0; r < b.batch; ++r) {
      Row in = row_of(b.inputs, b.seq_len, r);
      Ids ids(in.begin(), in.end());
      std::string text = tok.decode(ids);
      CHECK(!text.empty());
      // With the special tokens removed, each window is text of the corpus; where a
      // window spans a document boundary the pieces are adjacent in `all`.
      CHECK(all.find(text) != std::string::npos);
    }
  }
}

}  // namespace test_loader
