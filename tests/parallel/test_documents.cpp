// Packed documents masked apart (training.document_mask) train the same model on every
// layout of the parity matrices as on one rank: the parity model for 10 steps (3 in
// sanitizer builds), losses within 1e-5 relative at every step. Data-parallel (FSDP,
// HSDP), tensor-parallel (with FSDP), pipelines (each microbatch its own documents,
// zero-bubble's deferred weight gradients), context-parallel (the ring's blocks masked
// as the whole sequence is, alone and composed) and their composition; a graphed step
// on the CPU.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "harness.hpp"
#include "parity_checks.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer_options.hpp"

namespace test_documents {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const std::vector<std::string> kDocuments = {"--training.document_mask", "true"};

std::vector<std::string> pipeline(const char* schedule) {
  return {"--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.pipeline_parallel_microbatch_size", "1"};
}

}  // namespace

TEST_CASE("document mask: one rank trains another model than without it (the corpus's windows hold documents)") {
  CHECK(one_rank_run(kDocuments).losses != one_rank_run().losses);
  // A graphed step (recorded calls on the CPU) stages each batch's documents into the
  // same tensors: the same run.
  CHECK(one_rank_run(with(kDocuments, {"--training.cuda_graph", "true"})).losses == one_rank_run(kDocuments).losses);
}

TEST_CASE("document mask: data-parallel, tensor-parallel and pipeline layouts train one rank's model") {
  check_layout_parity("FSDP 2", {1, 1, 2, 1}, {}, kDocuments);
  check_layout_parity("HSDP 2x2, full", {1, 2, 2, 1}, kAcModes[1].keys, kDocuments);
  check_layout_parity("TP 2, selective op", {1, 1, 1, 2}, kAcModes[2].keys, kDocuments);
  check_layout_parity("FSDP 2 x TP 2, every 2nd layer", {1, 1, 2, 2}, kAcModes[3].keys, kDocuments);
  check_layout_parity("PP 2, 1F1B", {2, 1, 1, 1}, pipeline("1F1B"), kDocuments);
  check_layout_parity("PP 2, Interleaved1F1B, full", {2, 1, 1, 1}, with(pipeline("Interleaved1F1B"), kAcModes[1].keys),
                      kDocuments);
  check_layout_parity("FSDP 2 x TP 2 x PP 2, InterleavedZeroBubble", {2, 1, 2, 2}, pipeline("InterleavedZeroBubble"),
                      kDocuments);
}

TEST_CASE("document mask: context-parallel layouts train one rank's model") {
  // The ring's blocks: documents that cross chunks and ranks, queries of a chunk that see
  // none of an earlier chunk's keys.
  check_layout_parity("CP 2", {1, 1, 1, 1, 2}, {}, kDocuments);
  check_layout_parity("CP 4, full", {1, 1, 1, 1, 4}, kAcModes[1].keys, kDocuments);
  check_layout_parity("CP 2 x FSDP 2, selective op", {1, 1, 2, 1, 2}, kAcModes[2].keys, kDocuments);
  check_layout_parity("CP 2 x TP 2", {1, 1, 1, 2, 2}, {}, with(kDocuments, {"--model.n_kv_heads", "4"}));
  check_layout_parity("CP 2 x PP 2, 1F1B", {2, 1, 1, 1, 2}, pipeline("1F1B"), kDocuments);
}

TEST_CASE("document mask: a BOS outside the vocabulary is refused in one line") {
  const auto bos = data::make_tokenizer("synthetic_bpe")->bos_id();
  const train::JobConfig small = debug_job(8, 8, 1, with(kDocuments, {"--model.vocab_size", std::to_string(bos)}));
  const std::string refusal = "training.document_mask: the BOS id " + std::to_string(bos) +
                              " of model.tokenizer synthetic_bpe is outside the model's vocabulary";
  CHECK_THROWS_WITH_AS(train::trainer_options(small), doctest::Contains(refusal.c_str()), Error);
}

}  // namespace test_documents
