// Packed documents masked apart (training.document_mask): a batch of packed rows trains
// exactly as its documents would one by one.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "../support/gradcheck.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/data/documents.hpp"
#include "tessera/nn/transformer.hpp"

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

}  // namespace test_documents
