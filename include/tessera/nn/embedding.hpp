// Token embedding: ids (rows) -> (rows, dim). Token ids are checked against the
// vocabulary before any gather, so a bad id is an error naming it, not a wild read.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/embedding.hpp"

namespace tessera::nn {

template <class T, Backend B>
class Embedding {
 public:
  using scalar_type = T;
  using backend_type = B;

  Embedding(std::string name, std::int64_t vocab, std::int64_t dim, Init init)
      : weight_(std::move(name) + ".weight", Shape{vocab, dim}, init) {}

  Tensor<T> forward(std::span<const std::int32_t> ids) {
    const std::int64_t vocab = weight_.value.size(0), dim = weight_.value.size(1);
    for (std::size_t i = 0; i < ids.size(); ++i)
      TESSERA_CHECK(ids[i] >= 0 && ids[i] < vocab, weight_.name, ": token id ", ids[i], " at position ", i,
                    " is outside the vocabulary of ", vocab);
    const auto rows = static_cast<std::int64_t>(ids.size());
    Tensor<T> y = B::template empty<T>(Shape{rows, dim});
    B::for_each(rows, ops::EmbeddingForward<T>{ids.data(), weight_.value.data(), y.data(), dim});
    return y;
  }

  void backward(std::span<const std::int32_t> ids, const Tensor<T>& dy) {
    const std::int64_t dim = weight_.value.size(1);
    B::for_each(dim, ops::EmbeddingBackwardColumn<T>{ids.data(), dy.data(), weight_.grad.data(),
                                                     static_cast<std::int64_t>(ids.size()), dim});
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
  }

  Parameter<T>& weight() { return weight_; }

 private:
  Parameter<T> weight_;
};

}  // namespace tessera::nn
