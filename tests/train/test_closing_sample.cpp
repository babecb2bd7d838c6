// llama-train's closing sample: the length the user gives is drawn whatever the model's
// size; by default 300 tokens, except from a float32 copy on rank 0's CPU over 8 GiB,
// where the run says why none was drawn.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "../support/errors.hpp"
#include "tessera/train/closing_sample.hpp"

namespace test_closing_sample {  // unity build: this file's names stay in here (tests/meson.build)

using tessera::train::closing_sample;
using tessera::train::ClosingSample;
using tessera::train::kClosingSampleCopyBytes;
using tessera::train::kClosingSampleTokens;

// Llama 3.2 1B and 3B, Llama 3 8B: their parameter counts (tied embeddings at 1B and 3B).
constexpr std::int64_t k1B = 1'235'814'400, k3B = 3'212'749'824, k8B = 8'030'261'248;
// The largest model whose float32 copy is the default's limit.
constexpr std::int64_t kLargestCopied = kClosingSampleCopyBytes / 4;

TEST_CASE("closing sample: the length given is drawn, from the trained model or a copy, whatever the size") {
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{300}, std::int64_t{9999}})
    for (const bool copy : {false, true})
      for (const std::int64_t params : {std::int64_t{94'304}, k1B, k8B}) {
        const ClosingSample s = closing_sample(n, copy, params);
        CHECK(s.tokens == n);
        CHECK(s.cpu_copy == copy);
        CHECK(s.declined.empty());
      }
}

TEST_CASE("closing sample: by default 300 tokens, none from a copy over 8 GiB, saying why") {
  CHECK(kClosingSampleTokens == 300);
  CHECK(kClosingSampleCopyBytes == std::int64_t{8} << 30);
  // One rank samples with the model it trained: the default whatever its size.
  for (const std::int64_t params : {std::int64_t{94'304}, k1B, k8B, std::int64_t{405'000'000'000}}) {
    const ClosingSample s = closing_sample(-1, false, params);
    CHECK(s.tokens == kClosingSampleTokens);
    CHECK_FALSE(s.cpu_copy);
    CHECK(s.declined.empty());
  }
  // From a copy: up to 8 GiB of float32 (Llama 3.2 1B's 4.9 GB, the limit itself).
  for (const std::int64_t params : {std::int64_t{94'304}, k1B, kLargestCopied}) {
    const ClosingSample s = closing_sample(-1, true, params);
    CHECK(s.tokens == kClosingSampleTokens);
    CHECK(s.cpu_copy);
    CHECK(s.declined.empty());
  }
  // Past it, none, and why: the model's size and the copy's.
  const ClosingSample past = closing_sample(-1, true, kLargestCopied + 1);
  CHECK(past.tokens == 0);
  CHECK_FALSE(past.declined.empty());
  const ClosingSample three = closing_sample(-1, true, k3B);
  CHECK(three.tokens == 0);
  CHECK(three.declined ==
        "it would gather the model's 3.21B parameters into a float32 copy on rank 0's CPU (12.85 GB, over the "
        "8.00 GiB a default sample copies) and run each token's forward there");
  CHECK(closing_sample(-1, true, k8B).declined.find("8.03B parameters") != std::string::npos);
}

TEST_CASE("closing sample: a length below -1 or a negative size is an error naming it") {
  CHECK_ERROR_CONTAINS(closing_sample(-2, false, k1B), "requested -2 tokens");
  CHECK_ERROR_CONTAINS(closing_sample(-1, true, -5), "-5 parameters");
}

}  // namespace test_closing_sample
