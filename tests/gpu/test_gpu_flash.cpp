// The CUDA flash attention kernels give the CPU backend's attention, causal, full (no
// mask), over packed documents and after a KV cache's keys (the forward): o, lse, dq,
// dk, dv, in float and bf16 storage, head dims 16 to 128, groups of 1, 2 and 4 q heads
// per kv head, rows padded so that tiles load with 16-byte vectors and without. Runs only
// where a device is present (the suite's main is in main.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../support/documents.hpp"
#include "../support/errors.hpp"
#include "../support/gradcheck.hpp"
#include "attention_reference.hpp"
#include "flash_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/dtype.hpp"

namespace test_gpu_flash {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

using testing::max_rel_diff;

namespace {

/// n normal(0, std) values from (seed, name), rounded to bf16 when `bf16`.
std::vector<float> random_values(std::int64_t n, const std::string& name, bool bf16, double std = 1.0) {
  Tensor<double> d(Shape{n});
  testing::fill_normal(d, 11, name, std);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto x = static_cast<float>(d[i]);
    out[static_cast<std::size_t>(i)] = bf16 ? round_to_bf16(x) : x;
  }
  return out;
}

std::vector<float> plus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

void check_flash_on_gpu(const AttentionShape& s, bool bf16, std::int64_t pad,
                        const std::vector<ops::DocumentSpan>& documents = {}) {
  CAPTURE(documents.size());
  CAPTURE(s.head_dim);
  CAPTURE(s.n_kv_heads);
  CAPTURE(s.causal);
  CAPTURE(bf16);
  CAPTURE(pad);
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  gpu_test::FlashRun run;
  run.shape = s;
  run.pad = pad;
  run.bf16 = bf16;
  run.documents = documents;
  run.q = random_values(rows * qc, "q", bf16);
  run.k = random_values(rows * kc, "k", bf16);
  run.v = random_values(rows * kc, "v", bf16);
  run.d_o = random_values(rows * qc, "dO", bf16);
  // The kernels (below Cuda::attention_backward, which zeroes dk and dv first) overwrite
  // dq and add into dk and dv.
  run.dq.assign(static_cast<std::size_t>(rows * qc), std::numeric_limits<float>::quiet_NaN());
  const auto dk0 = random_values(rows * kc, "dk0", bf16, 0.5), dv0 = random_values(rows * kc, "dv0", bf16, 0.5);
  run.dk = dk0;
  run.dv = dv0;
  gpu_test::flash_attention(run);

  // The CPU backend in float on the same (rounded) inputs.
  const gpu_test::AttentionResult ref = gpu_test::cpu_attention(run);
  const double tol = bf16 ? 5e-3 : 1e-5, grad_tol = bf16 ? 1e-2 : 1e-5;
  CHECK(max_rel_diff(run.o, ref.o) < tol);
  CHECK(max_rel_diff(run.lse, ref.lse) < 1e-5);
  CHECK(max_rel_diff(run.dq, ref.dq) < grad_tol);
  CHECK(max_rel_diff(run.dk, plus(dk0, ref.dk)) < grad_tol);
  CHECK(max_rel_diff(run.dv, plus(dv0, ref.dv)) < grad_tol);
}

}  // namespace

TEST_CASE("flash attention on the GPU matches the CPU backend: float and bf16, hd 16, 32, 64 and 128, GQA") {
  // 150 rows per sequence: three query blocks, the last one partial, and partial tiles.
  for (bool bf16 : {false, true})
    for (std::int64_t kv : {1, 2, 4}) {
      check_flash_on_gpu({2, 150, 4, kv, 64}, bf16, 0);
      check_flash_on_gpu({2, 150, 4, kv, 128}, bf16, 0);
    }
  // Rows of odd length: scalar tile loads.
  check_flash_on_gpu({2, 150, 4, 2, 64}, false, 1);
  check_flash_on_gpu({2, 150, 4, 2, 128}, true, 1);
  // A sequence shorter than one tile.
  check_flash_on_gpu({3, 5, 4, 2, 64}, false, 0);
  // The small head dims (torchtitan's debug model: dim 256 over 16 heads is 16).
  for (bool bf16 : {false, true}) {
    check_flash_on_gpu({2, 150, 4, 2, 16}, bf16, 0);
    check_flash_on_gpu({2, 70, 4, 1, 32}, bf16, 0);
  }
}

TEST_CASE("flash attention on the GPU without a mask (full) matches the CPU backend: float and bf16, hd 16 to 128, GQA") {
  // A context-parallel block whose keys all come before its queries: every key tile for
  // every query block, every query tile for every key block.
  auto full = [](std::int64_t batch, std::int64_t t, std::int64_t heads, std::int64_t kv, std::int64_t hd) {
    return AttentionShape{batch, t, heads, kv, hd, false};
  };
  for (bool bf16 : {false, true})
    for (std::int64_t kv : {1, 2, 4}) {
      check_flash_on_gpu(full(2, 150, 4, kv, 64), bf16, 0);
      check_flash_on_gpu(full(2, 150, 4, kv, 128), bf16, 0);
    }
  check_flash_on_gpu(full(2, 150, 4, 2, 64), false, 1);
  check_flash_on_gpu(full(2, 150, 4, 2, 128), true, 1);
  check_flash_on_gpu(full(3, 5, 4, 2, 64), false, 0);
  for (bool bf16 : {false, true}) {
    check_flash_on_gpu(full(2, 150, 4, 2, 16), bf16, 0);
    check_flash_on_gpu(full(2, 70, 4, 1, 32), bf16, 0);
  }
}

TEST_CASE("flash attention on the GPU over packed documents matches the CPU backend: float and bf16, hd 64 and 128") {
  // Documents that start mid-block, on a block's first row (64), one token long, and one
  // over two blocks; the second sequence one document: query blocks that skip key
  // tiles, key blocks that stop before the sequence's end.
  const std::int64_t t = 150;
  const std::vector<ops::DocumentSpan> documents = testing::spans_starting_at(2, t, {10, 64, 65, 66, 140});
  for (bool bf16 : {false, true})
    for (std::int64_t kv : {1, 4}) {
      check_flash_on_gpu({2, t, 4, kv, 64}, bf16, 0, documents);
      check_flash_on_gpu({2, t, 4, kv, 128}, bf16, 0, documents);
    }
  check_flash_on_gpu({2, t, 4, 2, 64}, false, 1, documents);
}

TEST_CASE("flash attention on the GPU over a context-parallel block of packed documents: rows that see no key") {
  // Queries at positions 450..599 and keys at 0..149 of sequences of 600 (CP 2's block
  // below the diagonal), bounds from ops::BlockDocuments: the document from 100 to 470
  // reaches the first 20 queries; every later query sees no key of the block (lse -inf,
  // o and dq zero) and keys 0..99 are seen by none.
  const std::int64_t S = 600, c = 150;
  const std::vector<ops::DocumentSpan> bounds =
      testing::ring_block_bounds(testing::spans_starting_at(2, S, {100, 470, 520}), 2, S, c, 3, 0);
  for (bool bf16 : {false, true}) {
    check_flash_on_gpu({2, c, 4, 2, 64, false}, bf16, 0, bounds);
    check_flash_on_gpu({2, c, 4, 2, 128, false}, bf16, 0, bounds);
  }
}

TEST_CASE("flash attention on the GPU after a KV cache's keys matches the CPU backend: runs merged, float and bf16") {
  // One new token and a few after caches shorter than a run of keys (128), a run's
  // length, and many runs with a partial last one (a token of a 4096-token window);
  // GQA groups of 1 and 4, head dims 64 and 128, rows padded (scalar tile loads), full
  // attention (every key) too.
  auto decode = [](std::int64_t batch, std::int64_t t, std::int64_t kv, std::int64_t hd, std::int64_t past,
                   bool bf16, std::int64_t pad, bool causal = true) {
    AttentionShape s{batch, t, 4, kv, hd, causal};
    s.past = past;
    CAPTURE(batch);
    CAPTURE(t);
    CAPTURE(kv);
    CAPTURE(hd);
    CAPTURE(past);
    CAPTURE(bf16);
    CAPTURE(pad);
    CAPTURE(causal);
    gpu_test::FlashRun run;
    run.shape = s;
    run.pad = pad;
    run.bf16 = bf16;
    run.q = random_values(s.rows() * 4 * hd, "q", bf16);
    run.k = random_values(batch * s.key_len() * kv * hd, "k", bf16);
    run.v = random_values(batch * s.key_len() * kv * hd, "v", bf16);
    gpu_test::flash_decode(run);
    const gpu_test::AttentionResult ref = gpu_test::cpu_attention_forward(run);
    CHECK(max_rel_diff(run.o, ref.o) < (bf16 ? 5e-3 : 1e-5));
    CHECK(max_rel_diff(run.lse, ref.lse) < 1e-5);
  };
  for (bool bf16 : {false, true})
    for (std::int64_t past : {1, 128, 300, 4095}) {
      decode(1, 1, 1, 64, past, bf16, 0);
      decode(2, 5, 4, 128, past, bf16, 0);
      decode(1, 70, 2, 64, past, bf16, 1);
    }
  decode(2, 5, 2, 64, 300, false, 0, false);
}

TEST_CASE("flash attention on the GPU refuses other head dims and float64 by name") {
  CHECK_ERROR_CONTAINS(gpu_test::flash_forward_without_data({1, 4, 2, 1, 96}, false),
                       "flash attention: head dim 96 is not supported (16, 32, 64 or 128)");
  CHECK_ERROR_CONTAINS(gpu_test::flash_forward_without_data({1, 4, 2, 1, 64}, true),
                       "flash attention (CUDA): float64 storage is not supported (float or bf16)");
}

}  // namespace test_gpu_flash
