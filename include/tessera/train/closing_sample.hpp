// The text a training run samples from its model at the end (llama-train's closing
// sample): how many tokens, and where none are drawn by default, why.
//
// One rank samples with the model it trained. Where it cannot, rank 0 gathers the whole
// parameters into a float32 model on its CPU and samples alone: with several ranks (a
// sharded or pipelined model's every forward would be a collective), and where float8
// GEMMs are emulated on the CPU (each token's forward would cast every weight to float8
// again in software). That copy costs 4 bytes a parameter of host memory, and every token
// a forward on the CPU that reads all of them: Llama 3.2 1B's shape samples 3.9 tokens/s
// on two cores (bench/RESULTS.md), an 8B model would hold 32 GB and take seconds a token.
// So the default (kClosingSampleTokens) is drawn from a copy of at most
// kClosingSampleCopyBytes, 8 GiB: Llama 3.2 1B's 4.9 GB copy samples, 3B's 12.9 GB does
// not, and the run says so and how to sample the saved model instead. A length the user
// gives is drawn whatever the size.
//
// The answer depends on the config alone (the model's size, the ranks, float8), so every
// rank reaches the same one: the gather is a collective every rank joins or none does.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/core/units.hpp"

namespace tessera::train {

/// The closing sample's length when the user gives none.
inline constexpr std::int64_t kClosingSampleTokens = 300;
/// The largest float32 copy of a model the default sample gathers on rank 0's CPU.
inline constexpr std::int64_t kClosingSampleCopyBytes = std::int64_t{8} << 30;

struct ClosingSample {
  std::int64_t tokens = 0;  // 0: no sample
  bool cpu_copy = false;    // drawn from rank 0's float32 copy rather than the trained model
  std::string declined;     // where the default was declined: why, as a sentence's end
};

/// `requested`: the length the user gave (0: none), or -1 where none was given.
/// `cpu_copy`: whether the sample must come from a float32 copy on rank 0's CPU
/// (several ranks, or float8 emulated); `parameters`: the model's count.
inline ClosingSample closing_sample(std::int64_t requested, bool cpu_copy, std::int64_t parameters) {
  TESSERA_CHECK(requested >= -1, "closing_sample: requested ", requested, " tokens (-1: the default)");
  TESSERA_CHECK(parameters >= 0, "closing_sample: ", parameters, " parameters");
  ClosingSample s;
  s.cpu_copy = cpu_copy;
  if (requested >= 0) {
    s.tokens = requested;
    return s;
  }
  const double copy_bytes = 4.0 * static_cast<double>(parameters);
  if (cpu_copy && copy_bytes > static_cast<double>(kClosingSampleCopyBytes)) {
    s.declined = tessera::detail::concat("it would gather the model's ", count_text(static_cast<double>(parameters)),
                                        " parameters into a float32 copy on rank 0's CPU (", decimal_bytes(copy_bytes),
                                        ", over the ", binary_bytes(static_cast<double>(kClosingSampleCopyBytes)),
                                        " a default sample copies) and run each token's forward there");
    return s;
  }
  s.tokens = kClosingSampleTokens;
  return s;
}

}  // namespace tessera::train
