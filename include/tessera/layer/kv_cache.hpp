// A KV cache: the rotated keys and the values each attention layer of a model computed for
// the tokens of one sequence so far, so that decoding runs each new token's forward over
// its own row, not over the whole window again (nn::generate, Transformer::cached_last_logits).
//
// A forward that decodes carries the cache in its Context (Context::kv_cache) and its
// Geometry says where the new rows go (Geometry::past, the tokens already cached). Each
// attention layer keeps a slot, found by the layer's address: `capacity` rows of keys and
// of values in the backend's memory, of which the first `length` are written. It appends
// the new rows' keys and values, then attends to every key the slot holds. After the
// forward, advance() checks that every slot took the new rows (an attention that does not
// read the cache would have seen them alone) and moves the cache's length on.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::nn {

template <class T>
class KvCache {
 public:
  /// One attention layer's keys and values: (capacity, kv heads x head_dim) each.
  struct Slot {
    Tensor<T> keys, values;
    std::int64_t length = 0;  // rows written
  };

  /// A cache for up to `capacity` tokens of one sequence.
  explicit KvCache(std::int64_t capacity) : capacity_(capacity) {
    TESSERA_CHECK(capacity > 0, "KvCache: a capacity of ", capacity, " tokens");
  }

  std::int64_t capacity() const { return capacity_; }
  /// The tokens cached: the position the next forward's first row takes.
  std::int64_t length() const { return length_; }
  /// The attention layers that hold a slot.
  std::size_t slots() const { return slots_.size(); }
  /// The bytes the slots hold (their whole capacity).
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& s : slots_) n += s.second.keys.bytes() + s.second.values.bytes();
    return n;
  }

  /// Forgets every token (a new sequence, or a window that moved on); keeps the memory.
  void clear() {
    length_ = 0;
    for (auto& s : slots_) s.second.length = 0;
  }

  /// The slot of the attention layer at `owner`, made by make() (which returns a Slot of
  /// `capacity()` rows) on the layer's first call. A layer that joins after the first
  /// forward finds its slot empty where the others hold length() tokens: the layer's own
  /// check on Slot::length names it.
  template <class Make>
  Slot& slot(const void* owner, Make&& make) {
    for (auto& s : slots_)
      if (s.first == owner) return s.second;
    slots_.emplace_back(owner, std::forward<Make>(make)());
    return slots_.back().second;
  }

  /// After a forward of `n` new tokens through `model` (named in errors): every slot must
  /// have taken them; the cache then holds length() + n.
  void advance(std::int64_t n, const std::string& model) {
    TESSERA_CHECK(!slots_.empty(), model, ": decoding with a KV cache, no attention layer used it");
    for (std::size_t i = 0; i < slots_.size(); ++i)
      TESSERA_CHECK(slots_[i].second.length == length_ + n, model, ": attention layer ", i, " of ", slots_.size(),
                    " holds ", slots_[i].second.length, " tokens in its KV cache after a forward from position ",
                    length_, " of ", n, " tokens: it did not attend through the cache");
    length_ += n;
  }

 private:
  std::int64_t capacity_;
  std::int64_t length_ = 0;
  std::vector<std::pair<const void*, Slot>> slots_;  // in the order the layers first ran
};

}  // namespace tessera::nn
