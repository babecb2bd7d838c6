// Named regions of a step: the loss head, the optimizer update, a recomputation.
//
// A Region is a scope object that names the work done on its thread while it lives. The
// dry run's trace (backend/meta/trace.hpp) files every recorded operation under the
// innermost open region, so a step's predicted time can be told by part (llama-plan
// prints the loss head and the optimizer apart from the GEMMs and kernels elsewhere).
// Other backends ignore regions; opening one costs a thread-local pointer swap. While a
// profile records on the thread (core/profile.hpp), a region is also one of its spans.
#pragma once

#include "tessera/core/profile.hpp"

namespace tessera {

/// The region names the library opens (a user's code may open its own).
namespace region {
inline constexpr const char* kLossHead = "loss head";       // output projection + cross-entropy, forward and backward
inline constexpr const char* kOptimizer = "optimizer";      // gradient norm, clipping and the AdamW update
inline constexpr const char* kRecompute = "recompute";      // a checkpoint policy's forward recomputation
}  // namespace region

class Region {
 public:
  explicit Region(const char* name) : name_(name), outer_(innermost()), span_("region", name) { innermost() = this; }
  ~Region() { innermost() = outer_; }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const char* name() const { return name_; }
  const Region* outer() const { return outer_; }

  /// The innermost region open on this thread, or nullptr.
  static const Region* current() { return innermost(); }
  /// The name of the innermost region open on this thread, or "" outside any.
  static const char* current_name() { return innermost() ? innermost()->name_ : ""; }
  /// Whether a region called `name` (the same pointer, as region::kLossHead) is open here.
  static bool inside(const char* name) {
    for (const Region* r = innermost(); r; r = r->outer_)
      if (r->name_ == name) return true;
    return false;
  }

 private:
  static const Region*& innermost() {
    static thread_local const Region* r = nullptr;
    return r;
  }

  const char* name_;
  const Region* outer_;
  profile::Span span_;
};

}  // namespace tessera
