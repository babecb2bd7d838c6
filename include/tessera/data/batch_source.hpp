// Where a trainer's batches come from: this data-parallel rank's slice of each global
// batch, in order, at a position a checkpoint saves and a resume seeks to.
//
// Three sources, one type (train::Trainer takes a BatchSource):
//   - a DataLoader, the library's: windows of a token stream, sliced per rank;
//   - a token stream of the user's (BatchSource::tokens): cut into windows as a
//     DataLoader cuts it, each rank taking its slice once the trainer binds the source
//     to the model's data-parallel rank;
//   - a callback of the user's (BatchSource::callback): asked for global batch `index`'s
//     slice of this rank, so a source that can produce any batch by its index resumes
//     exactly. Its batches are checked for shape and for token ids the model cannot
//     read, naming the batch.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/data/loader.hpp"

namespace tessera::data {

/// What a callback source is asked for: the `index`-th global batch's slice of data-parallel
/// rank `dp_rank` (of `dp_degree`): `batch` sequences of `seq_len` inputs and as many
/// targets (Batch::ignore_index where a target does not count).
struct BatchRequest {
  std::int64_t index = 0;
  std::int64_t batch = 0, seq_len = 0;
  std::int64_t dp_rank = 0, dp_degree = 1;
};

class BatchSource {
 public:
  using Callback = std::function<Batch(const BatchRequest&)>;

  /// The library's loader, reading one data-parallel slice already: the trainer checks
  /// that slice is its model's.
  BatchSource(DataLoader loader) : loader_(std::move(loader)), bound_(true) {}  // NOLINT: a loader is a source

  /// A token stream, cut into consecutive windows of seq_len + 1 tokens (DataLoader's
  /// rules); a global batch is local_batch_size x the data-parallel degree windows.
  static BatchSource tokens(std::span<const std::uint32_t> tokens, std::int64_t seq_len,
                            std::int64_t local_batch_size) {
    BatchSource s(Kind::tokens, seq_len, local_batch_size);
    s.tokens_.assign(tokens.begin(), tokens.end());
    return s;
  }

  /// The user's own batches: `next` is called with the request for this rank's slice of
  /// each global batch in turn (index 0, 1, ...; after a resume, from the saved index).
  static BatchSource callback(Callback next, std::int64_t seq_len, std::int64_t local_batch_size) {
    TESSERA_CHECK(static_cast<bool>(next), "BatchSource::callback: the callback is empty");
    BatchSource s(Kind::callback, seq_len, local_batch_size);
    s.callback_ = std::move(next);
    return s;
  }

  /// Binds the source to the model's data-parallel rank (the trainer does, once). A
  /// DataLoader must already read that slice.
  void bind(std::int64_t dp_rank, std::int64_t dp_degree) {
    if (loader_) {
      TESSERA_CHECK(loader_->dp_degree() == dp_degree && loader_->dp_rank() == dp_rank, "the DataLoader reads slice ",
                    loader_->dp_rank(), " of ", loader_->dp_degree(), ", the model is data-parallel rank ", dp_rank,
                    " of ", dp_degree);
      return;
    }
    TESSERA_CHECK(!bound_, "BatchSource: bound twice");
    if (kind_ == Kind::tokens) {
      loader_.emplace(std::move(tokens_), seq_len_, local_batch_, dp_rank, dp_degree);
      tokens_ = {};
    } else {
      TESSERA_CHECK(dp_rank >= 0 && dp_rank < dp_degree, "BatchSource: data-parallel rank ", dp_rank,
                    " is out of range for degree ", dp_degree);
      dp_rank_ = dp_rank, dp_degree_ = dp_degree;
    }
    bound_ = true;
  }

  /// This rank's slice of the next global batch.
  Batch next() {
    TESSERA_CHECK(bound_, "BatchSource: next() before bind()");
    if (loader_) return loader_->next();
    const BatchRequest r{index_, local_batch_, seq_len_, dp_rank_, dp_degree_};
    Batch b = callback_(r);
    TESSERA_CHECK(b.batch == r.batch && b.seq_len == r.seq_len, "the batch callback's batch ", index_, " (data-parallel rank ", dp_rank_, ") is ", b.batch, " x ",
                  b.seq_len, ", not the ", r.batch, " x ", r.seq_len, " asked for");
    const auto n = static_cast<std::size_t>(r.batch * r.seq_len);
    TESSERA_CHECK(b.inputs.size() == n && b.targets.size() == n, "the batch callback's batch ", index_, " (data-parallel rank ", dp_rank_, ") has ",
                  b.inputs.size(), " inputs and ", b.targets.size(), " targets, not ", r.batch, " x ", r.seq_len,
                  " = ", n, " of each");
    for (std::size_t i = 0; i < n; ++i)
      TESSERA_CHECK(b.inputs[i] >= 0 && (b.targets[i] >= 0 || b.targets[i] == Batch::ignore_index),
                    "the batch callback's batch ", index_, " (data-parallel rank ", dp_rank_, "): token ", i, " has input ", b.inputs[i], " and target ",
                    b.targets[i], " (ids are >= 0; a target that does not count is ", Batch::ignore_index, ")");
    b.n_targets = count_targets(b);
    ++index_;
    return b;
  }

  /// The position a resume seeks to: a DataLoader's windows, a callback's batch index.
  std::int64_t position() const { return loader_ ? loader_->position() : index_; }
  void seek(std::int64_t position) {
    TESSERA_CHECK(position >= 0, "BatchSource::seek: position ", position, " is negative");
    if (loader_)
      loader_->seek(position);
    else
      index_ = position;
  }

  std::int64_t seq_len() const { return loader_ ? loader_->seq_len() : seq_len_; }
  std::int64_t local_batch_size() const { return loader_ ? loader_->local_batch_size() : local_batch_; }
  /// The loader the batches come from, once bound (none for a callback).
  const DataLoader* loader() const { return loader_ ? &*loader_ : nullptr; }

 private:
  enum class Kind { loader, tokens, callback };
  BatchSource(Kind kind, std::int64_t seq_len, std::int64_t local_batch_size)
      : kind_(kind), seq_len_(seq_len), local_batch_(local_batch_size) {
    TESSERA_CHECK(seq_len > 0, "BatchSource: seq_len must be positive, got ", seq_len);
    TESSERA_CHECK(local_batch_size > 0, "BatchSource: local_batch_size must be positive, got ", local_batch_size);
  }

  Kind kind_ = Kind::loader;
  std::optional<DataLoader> loader_;
  std::vector<std::uint32_t> tokens_;  // until bound
  Callback callback_;
  std::int64_t seq_len_ = 0, local_batch_ = 0;
  std::int64_t dp_rank_ = 0, dp_degree_ = 1;
  std::int64_t index_ = 0;
  bool bound_ = false;
};

}  // namespace tessera::data
