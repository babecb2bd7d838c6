// Validation: the loss of held-out data under the training's own layout, no gradients.
//
// [validation] as torchtitan's: every `freq` steps the model reads `steps` global batches
// of the validation stream (local_batch_size x seq_len windows on each data-parallel
// rank, DataLoader's slicing, from the stream's start every time, so every validation
// reads the same tokens) through Model::loss, which runs whatever layout the model has
// (sharded units gathered, tensor-parallel loss, the pipeline's forward-only pass, the
// context-parallel ring). Each data-parallel rank sums its slice's token losses and
// targets; the sums are added over the data-parallel ranks, and the loss is their
// quotient: the mean cross-entropy per counted target, the same figure on every rank.
// Targets follow the training's rules: a chat stream's loss mask, and with
// training.document_mask the boundaries between packed documents.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/error.hpp"
#include "tessera/data/documents.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/parallel/host_values.hpp"

namespace tessera::train {

struct ValidationResult {
  double loss = 0;          // mean cross-entropy per counted target, in nats
  std::int64_t tokens = 0;  // counted targets, every data-parallel rank's
  std::int64_t batches = 0; // global batches read
};

class Validator {
 public:
  /// `loader` reads this rank's slice of the validation stream; `steps` global batches
  /// per validation, or -1 for the whole stream once (its whole global batches, at least
  /// one). `document_start_id` >= 0 masks packed documents apart, as in training.
  /// `source` names the stream in errors.
  Validator(data::DataLoader loader, std::int64_t steps, std::int32_t document_start_id, std::string source)
      : loader_(std::move(loader)), document_start_id_(document_start_id), source_(std::move(source)) {
    TESSERA_CHECK(steps > 0 || steps == -1, "validation.steps: ", steps, " must be positive or -1");
    steps_ = steps > 0 ? steps : std::max<std::int64_t>(1, loader_.windows_per_epoch() / loader_.global_batch_size());
  }

  std::int64_t steps() const { return steps_; }
  /// The held-out batches' loader.
  const data::DataLoader& loader() const { return loader_; }

  /// The validation loss of `model` now (a collective over the model's mesh).
  template <class Model>
  ValidationResult run(Model& model) {
    using B = typename Model::backend_type;
    loader_.seek(0);
    double sums[2] = {0, 0};  // loss, targets
    for (std::int64_t s = 0; s < steps_; ++s) {
      data::Batch b = loader_.next();
      if (document_start_id_ >= 0) data::mask_document_boundaries(b, document_start_id_);
      nn::Geometry g{b.batch, b.seq_len};
      g.document_start_id = document_start_id_;
      sums[0] += model.loss(b.inputs, b.targets, g);
      sums[1] += static_cast<double>(b.n_targets);
    }
    if (comm::DeviceMesh* mesh = model.plan().mesh) {
      const auto total = parallel::all_reduce_host<B>(mesh->dp(), std::array<double, 2>{sums[0], sums[1]});
      sums[0] = total[0];
      sums[1] = total[1];
    }
    TESSERA_CHECK(sums[1] > 0, source_, ": the validation batches have no target tokens (validation.steps = ", steps_,
                  ")");
    return ValidationResult{sums[0] / sums[1], static_cast<std::int64_t>(sums[1]), steps_};
  }

 private:
  data::DataLoader loader_;
  std::int64_t steps_ = 1;
  std::int32_t document_start_id_ = -1;
  std::string source_;
};

}  // namespace tessera::train
