// Attention through cuDNN (backend/cuda/cudnn_attention.hpp) against tessera's own flash
// kernels, both through Cuda::attention_forward/backward<bf16>: o, the log-sum-exp (the
// two use the same convention, so it is compared too), dq, dk and dv, over grouped-query
// shapes, head dims 64 and 128, sequences that are not multiples of 64, batches above
// one, and padded rows (the model's own strided layouts), causal and full (no mask: a
// context-parallel block off the diagonal), and over packed documents (cuDNN's
// variable-length attention, ops/ragged_documents.hpp). Also: every output is
// overwritten, the graphs of one shape's causal and full calls are kept apart, the
// deterministic backward repeats bitwise, a head dim cuDNN refuses comes back with its
// reason. Where this binary or machine has no cuDNN, the cases say why and check nothing
// else.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../support/documents.hpp"
#include "../support/gradcheck.hpp"
#include "attention_reference.hpp"
#include "cudnn_launchers.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/ragged_documents.hpp"

namespace test_gpu_cudnn {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using gpu_test::GpuAttention;

using testing::max_rel_diff;

namespace {

/// n normal(0, std) values from (seed, name), rounded to bf16.
std::vector<float> bf16_values(std::int64_t n, const std::string& name, double std = 1.0) {
  Tensor<double> d(Shape{n});
  testing::fill_normal(d, 13, name, std);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = round_to_bf16(static_cast<float>(d[i]));
  return out;
}

/// A run of `s` with `pad` extra columns per device row (over packed `documents` when
/// given); every output starts as NaN, so an output left unwritten (or added into) shows.
gpu_test::FlashRun make_run(const AttentionShape& s, std::int64_t pad,
                            const std::vector<ops::DocumentSpan>& documents = {}) {
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  gpu_test::FlashRun run;
  run.shape = s;
  run.pad = pad;
  run.bf16 = true;
  run.q = bf16_values(rows * qc, "q");
  run.k = bf16_values(rows * kc, "k");
  run.v = bf16_values(rows * kc, "v");
  run.d_o = bf16_values(rows * qc, "dO");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  run.dq.assign(static_cast<std::size_t>(rows * qc), nan);
  run.dk.assign(static_cast<std::size_t>(rows * kc), nan);
  run.dv.assign(static_cast<std::size_t>(rows * kc), nan);
  run.documents = documents;
  return run;
}

gpu_test::FlashRun run_with(GpuAttention a, const AttentionShape& s, std::int64_t pad,
                            const std::vector<ops::DocumentSpan>& documents = {}) {
  gpu_test::AttentionScope scope(a);
  gpu_test::FlashRun run = make_run(s, pad, documents);
  gpu_test::cuda_attention(run);
  return run;
}

/// cuDNN against tessera's kernels on one shape (over packed `documents` when given:
/// cuDNN's variable-length attention). Each is within 5e-3 (o) and 1e-2 (gradients) of
/// the CPU backend in float (test_gpu_flash.cpp holds the kernels to that; both round P
/// and dS to bf16 as GEMM operands), so they are held to twice that of each other; the
/// log-sum-exp is fp32 from the same bf16 inputs in both. Over documents every row
/// belongs to one document, so every output is written, and the cuDNN run must differ
/// somewhere bitwise from tessera's: it ran cuDNN, not a fallback to the same kernels.
void check_against_tessera(const AttentionShape& s, std::int64_t pad,
                           const std::vector<ops::DocumentSpan>& documents = {}) {
  CAPTURE(s.causal);
  CAPTURE(s.batch);
  CAPTURE(s.seq_len);
  CAPTURE(s.n_heads);
  CAPTURE(s.n_kv_heads);
  CAPTURE(s.head_dim);
  CAPTURE(pad);
  AttentionShape probe = s;
  if (!documents.empty()) probe.document_slots = ops::document_table(documents, s.batch, s.seq_len).slots;
  CAPTURE(probe.document_slots);
  REQUIRE(gpu_test::cudnn_support(probe, false) == "");
  const gpu_test::FlashRun ref = run_with(GpuAttention::tessera, s, pad, documents);
  const gpu_test::FlashRun got = run_with(GpuAttention::cudnn, s, pad, documents);
  if (!documents.empty()) {
    CHECK(got.o != ref.o);
  }
  CHECK(max_rel_diff(got.o, ref.o) < 1e-2);
  CHECK(max_rel_diff(got.lse, ref.lse) < 1e-4);
  CHECK(max_rel_diff(got.dq, ref.dq) < 2e-2);
  CHECK(max_rel_diff(got.dk, ref.dk) < 2e-2);
  CHECK(max_rel_diff(got.dv, ref.dv) < 2e-2);
  // And both against the CPU backend in float: the own kernels are held to 5e-3 and
  // 1e-2 there (test_gpu_flash.cpp); cuDNN to twice that.
  const gpu_test::AttentionResult cpu = gpu_test::cpu_attention(got);
  CHECK(max_rel_diff(got.o, cpu.o) < 1e-2);
  CHECK(max_rel_diff(got.lse, cpu.lse) < 1e-4);
  CHECK(max_rel_diff(got.dq, cpu.dq) < 2e-2);
  CHECK(max_rel_diff(got.dk, cpu.dk) < 2e-2);
  CHECK(max_rel_diff(got.dv, cpu.dv) < 2e-2);
}

/// Whether cuDNN runs in this binary on this machine; says why not in the log.
bool cudnn_here() {
  const std::string why = gpu_test::cudnn_unavailable();
  if (!why.empty()) MESSAGE("cuDNN attention not checked: " << why);
  else MESSAGE("cuDNN attention: " << gpu_test::cudnn_description());
  return why.empty();
}

}  // namespace

TEST_CASE("cuDNN attention gives tessera's flash kernels and the CPU backend: GQA, hd 64 and 128, T up to 8192 and not a multiple of 64, batch > 1") {
  if (!cudnn_here()) return;
  for (std::int64_t kv : {1, 2, 4}) {
    check_against_tessera({2, 150, 4, kv, 64}, 0);
    check_against_tessera({2, 150, 4, kv, 128}, 0);
  }
  check_against_tessera({3, 64, 8, 8, 64}, 0);    // heads of their own, T a multiple of 64
  check_against_tessera({1, 333, 8, 2, 128}, 0);  // a long odd sequence, one sequence
  check_against_tessera({2, 5, 4, 2, 64}, 0);     // shorter than any tile
  // Llama 3's training length, at 8B's grouping (4 q heads per kv head) and head dim.
  check_against_tessera({1, 8192, 8, 2, 128}, 0);
  // Rows wider than the heads (ld = cols + 8): strides, no copies.
  check_against_tessera({2, 150, 4, 2, 64}, 8);
  check_against_tessera({2, 100, 4, 1, 128}, 8);
  // torchtitan's debug model (dim 256 over 16 heads) has head dim 16, where cuDNN may
  // decline: auto then keeps tessera's kernels (backend/cuda/attention_choice.hpp).
  const std::string hd16 = gpu_test::cudnn_support({2, 150, 4, 2, 16}, false);
  if (hd16.empty()) check_against_tessera({2, 150, 4, 2, 16}, 0);
  else MESSAGE("cuDNN declines head dim 16: " << hd16);
}

TEST_CASE("cuDNN attention without a mask (full) gives tessera's flash kernels and the CPU backend: GQA, hd 64 and 128, odd T, batch > 1") {
  if (!cudnn_here()) return;
  auto full = [](std::int64_t batch, std::int64_t t, std::int64_t heads, std::int64_t kv, std::int64_t hd) {
    return AttentionShape{batch, t, heads, kv, hd, false};
  };
  for (std::int64_t kv : {1, 2, 4}) {
    check_against_tessera(full(2, 150, 4, kv, 64), 0);
    check_against_tessera(full(2, 150, 4, kv, 128), 0);
  }
  check_against_tessera(full(3, 64, 8, 8, 64), 0);
  check_against_tessera(full(1, 333, 8, 2, 128), 0);
  check_against_tessera(full(2, 5, 4, 2, 64), 0);
  // A context-parallel block of 8B at Llama 3's length over cp 2: chunks of 2048 tokens.
  check_against_tessera(full(1, 2048, 8, 2, 128), 0);
  check_against_tessera(full(2, 150, 4, 2, 64), 8);
  check_against_tessera(full(2, 100, 4, 1, 128), 8);
}

TEST_CASE("cuDNN attention keeps one shape's causal and full graphs apart") {
  if (!cudnn_here()) return;
  // The same dims and lds both ways in turn, each against the CPU backend with its own
  // mask: a graph cached for one and reused for the other would fail the second.
  AttentionShape s{2, 150, 4, 2, 64};
  for (bool causal : {true, false, true}) {
    CAPTURE(causal);
    s.causal = causal;
    const gpu_test::FlashRun got = run_with(GpuAttention::cudnn, s, 0);
    const gpu_test::AttentionResult cpu = gpu_test::cpu_attention(got);
    CHECK(max_rel_diff(got.o, cpu.o) < 1e-2);
    CHECK(max_rel_diff(got.lse, cpu.lse) < 1e-4);
    CHECK(max_rel_diff(got.dq, cpu.dq) < 2e-2);
    CHECK(max_rel_diff(got.dk, cpu.dk) < 2e-2);
    CHECK(max_rel_diff(got.dv, cpu.dv) < 2e-2);
  }
}

TEST_CASE("cuDNN attention's deterministic backward repeats bitwise and agrees with the default one") {
  if (!cudnn_here()) return;
  for (bool causal : {true, false}) {
    CAPTURE(causal);
    const AttentionShape s{2, 150, 8, 2, 128, causal};
    const std::string why = gpu_test::cudnn_support(s, true);
    if (!why.empty()) {
      MESSAGE("cuDNN has no deterministic backward here: " << why);
      return;
    }
    const gpu_test::FlashRun a = run_with(GpuAttention::cudnn_deterministic, s, 0);
    const gpu_test::FlashRun b = run_with(GpuAttention::cudnn_deterministic, s, 0);
    CHECK(a.o == b.o);
    CHECK(a.dq == b.dq);
    CHECK(a.dk == b.dk);
    CHECK(a.dv == b.dv);
    const gpu_test::FlashRun fast = run_with(GpuAttention::cudnn, s, 0);
    CHECK(max_rel_diff(fast.dq, a.dq) < 1e-2);
    CHECK(max_rel_diff(fast.dk, a.dk) < 1e-2);
    CHECK(max_rel_diff(fast.dv, a.dv) < 1e-2);
  }
}

TEST_CASE("cuDNN variable-length attention over packed documents gives tessera's kernels and the CPU backend") {
  if (!cudnn_here()) return;
  AttentionShape ragged{2, 150, 4, 2, 64};
  ragged.document_slots = 8;
  const std::string why = gpu_test::cudnn_support(ragged, false);
  if (!why.empty()) {
    MESSAGE("cuDNN has no variable-length attention here: " << why);
    return;
  }
  // Documents that start mid-tile, on a tile's first row (64), one token long, and over
  // two tiles; the second sequence one document, so its slots past the first are empty.
  const std::int64_t t = 150;
  const std::vector<ops::DocumentSpan> documents = testing::spans_starting_at(2, t, {10, 64, 65, 66, 140});
  for (std::int64_t kv : {1, 2, 4})
    for (std::int64_t hd : {64, 128}) check_against_tessera({2, t, 4, kv, hd}, 0, documents);
  check_against_tessera({2, t, 4, 2, 64}, 8, documents);  // rows wider than the heads: strides
  // One document a sequence: the same as the causal call without documents.
  check_against_tessera({2, t, 4, 2, 128}, 0, testing::spans_starting_at(2, t, {}));
  // Llama 3's training length at 8B's grouping and head dim, 37 documents of uneven
  // lengths (64 slots).
  std::vector<std::int32_t> ids(8192, 3);
  for (std::int64_t i = 1; i <= 36; ++i) ids[static_cast<std::size_t>((i * i * 97) % 8192)] = 1;
  check_against_tessera({1, 8192, 8, 2, 128}, 0, ops::document_spans(ids, 1, 8192, 1));
}

TEST_CASE("cuDNN attention refuses a head dim it does not run, with cuDNN's reason") {
  if (!cudnn_here()) return;
  // 12 is no multiple of 8: the error names the shape and carries the frontend's reason.
  const std::string why = gpu_test::cudnn_support({1, 64, 2, 1, 12}, false);
  CAPTURE(why);
  CHECK(why.find("head dim 12") != std::string::npos);
  CHECK(why.find("): ") != std::string::npos);
}

}  // namespace test_gpu_cudnn
