// The CUDA kernels' thread layouts (backend/cuda/kernel_layouts.hpp), checked on the CPU
// for every shape their launchers accept: each element held by exactly one thread, and
// no thread holding more than its registers do.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "tessera/backend/cuda/kernel_layouts.hpp"
#include "tessera/ops/cross_entropy.hpp"

namespace {

using tessera::cuda::detail::FusedNormLayout;
using tessera::cuda::detail::OneReadLayout;

constexpr int kBlocks = 8, kThreads = 512;  // cross_entropy_kernels.cuh's kOneReadBlocks, kOneReadThreads

/// How many times the one-read kernel's threads hold each logit of a row of `vocab`,
/// each thread `e` logits at most (e / width vectors); -1 where a held column is outside
/// [0, vocab) or a vector called whole is not.
std::vector<int> one_read_cover(int vocab, int width, int e) {
  const OneReadLayout l{vocab, width, kBlocks, kThreads};
  std::vector<int> held(static_cast<std::size_t>(vocab), 0);
  for (int rank = 0; rank < kBlocks; ++rank)
    for (int tid = 0; tid < kThreads; ++tid)
      for (int k = 0; k < e / width; ++k) {
        if (l.column(rank, tid, k) != l.column(rank, tid, 0) + k * l.stride()) return {-1};
        if (l.whole(rank, tid, k) && !l.present(rank, tid, k, width - 1)) return {-1};
        for (int w = 0; w < width; ++w) {
          if (!l.present(rank, tid, k, w)) continue;
          const int c = l.column(rank, tid, k) + w;
          if (c < 0 || c >= vocab) return {-1};
          ++held[static_cast<std::size_t>(c)];
        }
      }
  return held;
}

}  // namespace

TEST_CASE("kernel layouts: the one-read cross-entropy holds every logit of a row once") {
  std::vector<int> vocabs = {tessera::ops::kOneReadMinVocab, 8194, 20000, 32000, 32768, 32769, 50001, 65536, 65537,
                             100000, 128256, 131071, tessera::ops::kOneReadMaxVocab};
  for (int v = static_cast<int>(tessera::ops::kOneReadMinVocab); v <= tessera::ops::kOneReadMaxVocab; v += 4093)
    vocabs.push_back(v);
  for (const int width : {4, 8}) {  // float and bf16 logits
    for (const std::int64_t vocab : vocabs) {
      CAPTURE(vocab);
      CAPTURE(width);
      const std::optional<int> e = tessera::cuda::detail::one_read_logits_per_thread(vocab, kBlocks, kThreads);
      REQUIRE(e.has_value());
      CHECK((*e == 8 || *e == 16 || *e == 32));
      const std::vector<int> held = one_read_cover(static_cast<int>(vocab), width, *e);
      REQUIRE(held.size() == static_cast<std::size_t>(vocab));
      std::int64_t once = 0;
      for (const int h : held) once += h == 1;
      CHECK(once == vocab);
      // The fewest logits a thread that cover the row: half as many would not.
      if (*e > 8) CHECK(vocab > std::int64_t{kBlocks} * kThreads * (*e / 2));
    }
  }
  CHECK_FALSE(tessera::cuda::detail::one_read_logits_per_thread(tessera::ops::kOneReadMaxVocab + 1, kBlocks, kThreads));
}

TEST_CASE("kernel layouts: RMSNorm's fused backward holds every vector of a row once") {
  constexpr int kMax = 1024;  // row_launch.cuh's kMaxRowThreads
  for (std::int64_t vectors = 1; vectors <= 2 * kMax; vectors += (vectors < 80 ? 1 : 37)) {
    CAPTURE(vectors);
    const std::optional<FusedNormLayout> l = tessera::cuda::detail::fused_norm_layout(vectors, kMax);
    REQUIRE(l.has_value());
    CHECK(l->threads % 32 == 0);
    CHECK(l->threads <= kMax);
    CHECK((l->per_thread == 1 || l->per_thread == 2));
    std::vector<int> held(static_cast<std::size_t>(vectors), 0);
    bool inside = true;
    for (int tid = 0; tid < l->threads; ++tid)
      for (int k = 0; k < l->per_thread; ++k)
        if (l->mine(tid, k)) {
          const std::int64_t v = l->vector(tid, k);
          inside = inside && v >= 0 && v < vectors;
          if (v >= 0 && v < vectors) ++held[static_cast<std::size_t>(v)];
        }
    CHECK(inside);
    std::int64_t once = 0;
    for (const int h : held) once += h == 1;
    CHECK(once == vectors);
  }
  // Llama widths: 1B 2048 bf16 (256 vectors), 8B 4096 (512), float 4096 (1024): a vector a thread.
  for (const std::int64_t v : {256, 384, 512, 1024}) CHECK(tessera::cuda::detail::fused_norm_layout(v, kMax)->per_thread == 1);
  CHECK(tessera::cuda::detail::fused_norm_layout(2048, kMax)->per_thread == 2);
  CHECK_FALSE(tessera::cuda::detail::fused_norm_layout(2049, kMax));
  CHECK_FALSE(tessera::cuda::detail::fused_norm_layout(0, kMax));
}

TEST_CASE("kernel layouts: the transposing float8 cast reads and writes every element of its tile once") {
  using tessera::cuda::detail::TransposeTileLayout;
  // float8_kernels.cuh's tile (64, 256 threads, runs of 8), and others the rule allows.
  for (const TransposeTileLayout l : {TransposeTileLayout{64, 256, 8}, TransposeTileLayout{32, 128, 8},
                                      TransposeTileLayout{64, 128, 4}, TransposeTileLayout{128, 512, 8}}) {
    CAPTURE(l.tile);
    CAPTURE(l.threads);
    CAPTURE(l.run);
    REQUIRE(l.reads() * l.run * l.threads == l.tile * l.tile);
    REQUIRE(l.writes() * TransposeTileLayout::kWord * l.threads == l.tile * l.tile);
    std::vector<int> read(static_cast<std::size_t>(l.tile * l.tile), 0), written(read.size(), 0);
    bool inside = true, warps_along_rows = true;
    for (int t = 0; t < l.threads; ++t) {
      for (int k = 0; k < l.reads(); ++k) {
        const int rr = l.read_row(t, k), cc = l.read_column(t, k);
        inside = inside && rr >= 0 && rr < l.tile && cc >= 0 && cc % l.run == 0 && cc + l.run <= l.tile;
        if (inside)
          for (int w = 0; w < l.run; ++w) ++read[static_cast<std::size_t>(rr * l.tile + cc + w)];
        // A lane's run follows its left neighbour's along the row, unless the row ended.
        if (t % 32 != 0 && cc != 0) warps_along_rows = warps_along_rows && l.read_column(t - 1, k) + l.run == cc;
      }
      for (int k = 0; k < l.writes(); ++k) {
        const int cc = l.write_column(t, k), rr = l.write_row(t, k);
        inside = inside && cc >= 0 && cc < l.tile && rr >= 0 && rr % 4 == 0 && rr + 4 <= l.tile;
        if (inside)
          for (int i = 0; i < 4; ++i) ++written[static_cast<std::size_t>((rr + i) * l.tile + cc)];
        if (t % 32 != 0 && rr != 0) warps_along_rows = warps_along_rows && l.write_row(t - 1, k) + 4 == rr;
      }
    }
    CHECK(inside);
    CHECK(warps_along_rows);
    std::int64_t read_once = 0, written_once = 0;
    for (std::size_t i = 0; i < read.size(); ++i) {
      read_once += read[i] == 1;
      written_once += written[i] == 1;
    }
    CHECK(read_once == l.tile * l.tile);
    CHECK(written_once == l.tile * l.tile);
  }
}
