// Packed documents masked apart (training.document_mask): a batch of packed rows trains
// exactly as its documents would one by one.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "../support/gradcheck.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/data/corpus.hpp"
#include "tessera/data/documents.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/ops/ragged_documents.hpp"

namespace test_documents {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;

namespace {

constexpr std::int32_t kBos = 1, kEos = 2;

/// Every parameter's gradient, in order.
std::vector<float> gradients(Transformer<float, Cpu>& model) {
  std::vector<float> g;
  model.for_each_parameter([&](Parameter<float>& p) { g.insert(g.end(), p.grad.data(), p.grad.data() + p.numel()); });
  return g;
}

}  // namespace

TEST_CASE("a packed batch with document_mask trains as its documents one by one: losses and gradients") {
  ModelArgs a = testing::tiny_args();
  a.dim = 32;
  a.vocab_size = 40;
  a.max_seq_len = 64;
  Transformer<float, Cpu> model(a);
  model.init_weights(5);

  // Documents BOS + words + EOS packed into one stream, cut into 2 windows of 41 tokens:
  // documents straddle the rows, one row starts mid-document, one document is 3 tokens.
  const std::int64_t batch = 2, t = 40;
  std::vector<std::int32_t> stream;
  std::uint64_t draw = 7;
  for (int len : {5, 12, 1, 20, 9, 3, 17, 30}) {
    stream.push_back(kBos);
    for (int i = 0; i < len; ++i) stream.push_back(3 + static_cast<std::int32_t>(mix64(++draw) % 37));
    stream.push_back(kEos);
  }
  REQUIRE(stream.size() >= static_cast<std::size_t>(batch * (t + 1)));
  data::Batch b;
  b.batch = batch;
  b.seq_len = t;
  for (std::int64_t r = 0; r < batch; ++r) {
    const auto* w = stream.data() + r * (t + 1);
    b.inputs.insert(b.inputs.end(), w, w + t);
    b.targets.insert(b.targets.end(), w + 1, w + t + 1);
  }
  data::mask_document_boundaries(b, kBos);
  std::int64_t boundaries = 0;
  for (std::int64_t i = 0; i < batch * t; ++i)
    boundaries += stream[static_cast<std::size_t>((i / t) * (t + 1) + i % t + 1)] == kBos ? 1 : 0;
  CHECK(b.n_targets == batch * t - boundaries);
  CHECK(boundaries >= 3);

  Geometry packed{batch, t};
  packed.document_start_id = kBos;
  model.zero_grad();
  const double packed_loss = model.forward_backward(b.inputs, b.targets, packed, 1.0);
  const std::vector<float> packed_grads = gradients(model);
  CHECK(model.loss(b.inputs, b.targets, packed) == doctest::Approx(packed_loss).epsilon(1e-6));

  // Each document of each row alone: a sequence of its own, positions from 0.
  model.zero_grad();
  double alone_loss = 0;
  int documents = 0;
  const std::vector<ops::DocumentSpan> spans = ops::document_spans(b.inputs, batch, t, kBos);
  for (std::int64_t r = 0; r < batch; ++r)
    for (std::int64_t i = 0; i < t;) {
      const ops::DocumentSpan d = spans[static_cast<std::size_t>(r * t + i)];
      const auto first = b.inputs.begin() + r * t + d.begin, last = b.inputs.begin() + r * t + d.end;
      const std::vector<std::int32_t> in(first, last);
      const std::vector<std::int32_t> tg(b.targets.begin() + r * t + d.begin, b.targets.begin() + r * t + d.end);
      alone_loss += model.forward_backward(in, tg, Geometry{1, d.end - d.begin}, 1.0);
      ++documents;
      i = d.end;
    }
  CHECK(documents >= 6);
  CHECK(packed_loss == doctest::Approx(alone_loss).epsilon(1e-6));

  const std::vector<float> alone_grads = gradients(model);
  CHECK(testing::max_rel_diff(packed_grads, alone_grads) < 1e-6);

  // The masks matter: the same rows unmasked are another computation.
  model.zero_grad();
  const double unmasked = model.forward_backward(b.inputs, b.targets, Geometry{batch, t}, 1.0);
  CHECK(unmasked != doctest::Approx(alone_loss).epsilon(1e-6));
  CHECK(testing::max_rel_diff(gradients(model), alone_grads) > 1e-2);
}

TEST_CASE("a staged batch carries its document table; a fixed one keeps its slots, growing them for more documents") {
  ModelArgs a = testing::tiny_args();
  a.vocab_size = 40;
  a.max_seq_len = 16;
  Transformer<float, Cpu> model(a);
  model.init_weights(5);
  auto batch_with = [](std::initializer_list<std::int64_t> starts) {
    std::vector<std::int32_t> ids(2 * 8, 5);
    for (std::int64_t r : starts) ids[static_cast<std::size_t>(r)] = kBos;
    return ids;
  };
  Geometry g{2, 8};
  g.document_start_id = kBos;
  const std::vector<std::int32_t> targets(16, 6);
  using Staged = Transformer<float, Cpu>::staged_batch_type;
  auto table_of = [](const Staged& s) {
    return std::vector<ops::DocumentSpan>(s.g.document_table, s.g.document_table + s.g.batch * s.g.document_slots);
  };

  // Three documents in the first sequence, one in the second: 4 slots each.
  Staged eager;
  model.stage(batch_with({3, 5}), targets, g, 1.0, eager);
  REQUIRE(eager.g.document_slots == 4);
  const std::vector<ops::DocumentSpan> want = {{0, 3}, {3, 5}, {5, 8}, {8, 8}, {0, 8}, {8, 8}, {8, 8}, {8, 8}};
  CHECK(table_of(eager) == want);
  // A micro-batch of the second sequence reads its own part of the table.
  const Geometry second = eager.g.sequences(1, 1);
  CHECK(second.document_table == eager.g.document_table + 4);
  CHECK(second.documents == eager.g.documents + 8);
  // An eager batch takes as few slots as its documents need.
  model.stage(batch_with({}), targets, g, 1.0, eager);
  CHECK(eager.g.document_slots == 1);

  // A fixed batch (a captured step's) keeps its slots when fewer documents come, and
  // grows them when more do.
  Staged fixed = Staged::fixed_layout();
  model.stage(batch_with({3, 5}), targets, g, 1.0, fixed);
  CHECK(fixed.g.document_slots == 4);
  const ops::DocumentSpan* before = fixed.g.document_table;
  model.stage(batch_with({}), targets, g, 1.0, fixed);
  CHECK(fixed.g.document_slots == 4);
  CHECK(fixed.g.document_table == before);  // staged again in place
  CHECK(table_of(fixed)[0] == ops::DocumentSpan{0, 8});
  model.stage(batch_with({1, 2, 3, 4, 9}), targets, g, 1.0, fixed);
  CHECK(fixed.g.document_slots == 8);

  // Without document_mask nothing is staged.
  Staged plain;
  model.stage(batch_with({3}), targets, Geometry{2, 8}, 1.0, plain);
  CHECK(plain.g.documents == nullptr);
  CHECK(plain.g.document_table == nullptr);
  CHECK(plain.g.document_slots == 0);
}


TEST_CASE("first-fit rows with document_mask train each whole document as it would alone") {
  ModelArgs a = testing::tiny_args();
  a.dim = 32;
  a.vocab_size = 40;
  a.max_seq_len = 64;
  Transformer<float, Cpu> model(a);
  model.init_weights(9);

  // Documents BOS + words + EOS; one (52 tokens) longer than a row of 41, left out.
  std::vector<std::vector<std::uint32_t>> docs;
  std::vector<std::uint32_t> stream;
  std::uint64_t draw = 11;
  for (int len : {5, 12, 1, 20, 9, 50, 3, 17, 30, 7}) {
    std::vector<std::uint32_t> d = {kBos};
    for (int i = 0; i < len; ++i) d.push_back(3 + static_cast<std::uint32_t>(mix64(++draw) % 37));
    d.push_back(kEos);
    stream.insert(stream.end(), d.begin(), d.end());
    docs.push_back(std::move(d));
  }
  const std::int64_t t = 40;
  data::Packing packing;
  packing.kind = data::Packing::Kind::first_fit;
  packing.document_start_id = kBos;
  const data::TokenCorpus corpus(io::TokenStream{stream, {}});
  const data::PackedRows plan = data::PackedRows::plan(corpus, t, packing);
  CHECK(plan.too_long == 1);
  data::DataLoader loader(std::vector<data::TokenCorpus>{corpus}, std::vector<double>{1}, t, plan.rows(), 0, 1, packing);
  data::Batch b = loader.next();
  data::mask_document_boundaries(b, kBos);  // as the trainer does: nothing to drop in whole documents
  CHECK(b.n_targets == [&] {
    std::int64_t n = 0;
    for (const auto& d : docs) n += d.size() <= static_cast<std::size_t>(t + 1) ? static_cast<std::int64_t>(d.size()) - 1 : 0;
    return n;
  }());

  Geometry packed{b.batch, t};
  packed.document_start_id = kBos;
  model.zero_grad();
  const double packed_loss = model.forward_backward(b.inputs, b.targets, packed, 1.0);
  const std::vector<float> packed_grads = gradients(model);

  // Each document that fits, whole and alone: inputs its tokens but the last, targets but the first.
  model.zero_grad();
  double alone_loss = 0;
  for (const auto& d : docs) {
    if (d.size() > static_cast<std::size_t>(t + 1)) continue;
    const std::vector<std::int32_t> in(d.begin(), d.end() - 1), tg(d.begin() + 1, d.end());
    alone_loss += model.forward_backward(in, tg, Geometry{1, static_cast<std::int64_t>(in.size())}, 1.0);
  }
  CHECK(packed_loss == doctest::Approx(alone_loss).epsilon(1e-6));
  CHECK(testing::max_rel_diff(packed_grads, gradients(model)) < 1e-6);
}

}  // namespace test_documents
