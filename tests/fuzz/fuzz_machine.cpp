// libFuzzer target: llama-plan's machine profiles (plan::parse_machine), the TOML files a
// user writes for the GPUs of a cluster they mean to rent.
//
// Input: a profile's TOML. A [machine] base resolves to the input itself (a chain of
// bases up to the reader's limit, and each section merged over its own), except a base
// starting with "missing", which names no profile.
//
// When the profile is accepted, what the planner derives from it must be a number it can
// use: usable bytes and the streaming bandwidth positive and finite, the capacity inside
// a size_t, every efficiency in (0, 1] at any GEMM size, every attention rate and held-SM
// slowdown positive and finite, the counts the planner takes as ints inside an int, and
// the reserved memory below the capacity.
//
// Contract: parsing either succeeds or throws tessera::Error naming the profile. Any
// other exception, a crash, a leak, undefined behaviour, a timeout, or a broken invariant
// above (reported on stderr, then abort) is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"
#include "tessera/plan/machine.hpp"

namespace {

namespace plan = tessera::plan;

[[noreturn]] void finding(const char* what, double value) {
  std::fprintf(stderr, "fuzz_machine: %s (%g)\n", what, value);
  std::abort();
}

void positive_finite(double v, const char* what) {
  if (!(std::isfinite(v) && v > 0)) finding(what, v);
}

void check(const plan::Machine& m) {
  positive_finite(m.usable_bytes(), "usable bytes");
  positive_finite(m.stream_bandwidth(), "the streaming bandwidth");
  if (m.capacity_bytes.value >= static_cast<double>(std::numeric_limits<std::size_t>::max()))
    finding("a capacity past a size_t", m.capacity_bytes.value);
  for (double v : {m.sm_count.value, m.network ? m.network->gpus_per_node.value : 1.0,
                   m.network && m.network->nics_per_node ? m.network->nics_per_node->value : 1.0})
    if (!(v >= 1 && v <= std::numeric_limits<int>::max() && v == std::floor(v))) finding("a count past an int", v);
  for (double gflop : {1e-9, 1e-3, 1.0, 51.5, 1e3, 1e9, 1e300}) {
    for (const plan::EfficiencyCurve* c : {&m.gemm_bf16, &m.gemm_fp32, m.gemm_fp8 ? &*m.gemm_fp8 : nullptr}) {
      if (!c) continue;
      const double e = c->at(gflop);
      if (!(e > 0 && e <= 1)) finding("an efficiency outside (0, 1]", e);
    }
    if (m.gemm_beside_held_sms) {
      const double held = std::min(gflop, m.sm_count.value - 1);
      positive_finite(m.gemm_beside_held_sms->at(held, m.sm_count.value / (m.sm_count.value - held)),
                      "a held-SM slowdown");
    }
  }
  for (const auto& [hd, rates] : m.cudnn_attention_bf16)
    for (double seq : {1.0, 128.0, 8192.0, 131072.0, 1e12}) {
      positive_finite(rates.forward.at(seq), "an attention rate (forward)");
      positive_finite(rates.backward.at(seq), "an attention rate (backward)");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const plan::MachineResolver resolve = [&text](std::string_view base,
                                                std::string_view) -> std::optional<plan::MachineText> {
    if (base.starts_with("missing")) return std::nullopt;
    return plan::MachineText{text, std::string(base) + ".toml"};
  };
  try {
    check(plan::parse_machine(text, "fuzz.toml", resolve));
  } catch (const tessera::Error& e) {
    if (std::string_view(e.what()).find(".toml") == std::string_view::npos) {
      std::fprintf(stderr, "fuzz_machine: an error that names no profile: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
