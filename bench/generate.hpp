// bench-generate's measurement, over any backend (generate.cpp: the CPU; generate_gpu.cpp:
// one GPU): a Llama model of a flavor's shape with random weights continues a prompt of
// random ids by greedy tokens (nn::generate, as llama-generate and llama-train's closing
// sample run it), once through the KV cache (each new token's forward over its own row)
// and once running the whole window for each token, the window the flavor's max_seq_len.
// One row a mode: seconds, tokens/s, milliseconds a token and the rate the weights are read
// at (what a decoded token's GEMMs cannot read less than).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "machine.hpp"
#include "tessera/core/error.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"

namespace tessera::bench {

struct GenerateOptions {
  std::string flavor = "debugmodel";
  std::int64_t layers = 0;  // 0: the flavor's
  std::int64_t prompt = 16, tokens = 256;
  std::string commit = "-";
};

inline constexpr const char* kGenerateFlags = "[--flavor NAME] [--layers N] [--prompt N] [--tokens N] [--commit HASH]";

/// Takes f's flag if it is one of GenerateOptions'; false for any other.
inline bool take_generate_flag(Flags& f, GenerateOptions& o) {
  const std::string_view flag = f.flag();
  if (flag == "--flavor") o.flavor = f.value();
  else if (flag == "--layers") o.layers = parse_count(flag, f.value(), 1);
  else if (flag == "--prompt") o.prompt = parse_count(flag, f.value(), 1);
  else if (flag == "--tokens") o.tokens = parse_count(flag, f.value(), 1);
  else if (flag == "--commit") o.commit = f.value();
  else return false;
  return true;
}

/// The flavor's arguments with --layers applied, checked against the prompt and tokens.
inline nn::ModelArgs generate_args(const GenerateOptions& o) {
  nn::ModelArgs a = nn::model_flavor(o.flavor);
  if (o.layers > 0) a.n_layers = o.layers;
  a.validate();
  TESSERA_CHECK(o.prompt + o.tokens <= a.max_seq_len, "--prompt ", o.prompt, " + --tokens ", o.tokens,
                " exceed the flavor's max_seq_len ", a.max_seq_len);
  return a;
}

/// Both modes' rows for Model (a fresh one, seed 1) on `machine`. `exact`: the two modes
/// compute the same logits to float32's rounding, so their greedy tokens must agree (exit
/// status 1 otherwise); in bf16 the modes' GEMMs see different row counts and round
/// differently, so the tokens that agree before the first difference are reported.
template <class Model>
int generate_rows(const GenerateOptions& o, const nn::ModelArgs& a, const std::string& machine, bool exact) {
  using T = typename Model::scalar_type;
  using clock_type = std::chrono::steady_clock;
  Model model(a);
  model.init_weights(1);
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(o.prompt));
  std::uint32_t x = 12345;
  for (auto& id : prompt) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<std::int32_t>((x >> 8) % static_cast<std::uint32_t>(a.vocab_size));
  }
  double weight_bytes = 0;
  model.for_each_parameter(
      [&](nn::Parameter<T>& p) { weight_bytes += static_cast<double>(sizeof(T)) * static_cast<double>(p.numel()); });

  std::printf("bench-generate: %s, %lld layers, %.1f M parameters (%.1f MB of %s weights); a prompt of %lld "
              "random ids, %lld greedy tokens; %s, %s, commit %s\n\n",
              o.flavor.c_str(), static_cast<long long>(a.n_layers), weight_bytes / sizeof(T) / 1e6, weight_bytes / 1e6,
              std::string(name_of(dtype_of<T>())).c_str(), static_cast<long long>(o.prompt),
              static_cast<long long>(o.tokens), utc_date().c_str(), machine.c_str(), o.commit.c_str());
  nn::SampleOptions s;
  s.temperature = 0;
  s.context = a.max_seq_len;
  s.max_new_tokens = 2;
  (void)nn::generate(model, prompt, s);  // warm-up: the backend's first calls (handles, allocator)
  std::printf("| mode | seconds | tokens/s | ms a token | weights read a token at |\n|---|---:|---:|---:|---:|\n");
  std::vector<std::vector<std::int32_t>> texts;
  for (const bool cached : {true, false}) {
    s.max_new_tokens = o.tokens;
    s.kv_cache = cached;
    const auto t0 = clock_type::now();
    texts.push_back(nn::generate(model, prompt, s));
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    const double n = static_cast<double>(texts.back().size());
    std::printf("| %s | %.2f | %.1f | %.2f | %.2f GB/s |\n", cached ? "KV cache" : "whole window", seconds,
                n / seconds, 1e3 * seconds / n, weight_bytes * n / seconds / 1e9);
  }
  std::size_t same = 0;
  while (same < texts[0].size() && same < texts[1].size() && texts[0][same] == texts[1][same]) ++same;
  if (same == texts[0].size() && texts[0].size() == texts[1].size()) {
    std::printf("\nthe same %zu tokens both ways\n", same);
    return 0;
  }
  std::printf("\nthe first %zu of %zu tokens the same both ways\n", same, texts[0].size());
  if (!exact) return 0;
  std::fprintf(stderr, "bench-generate: the KV cache's tokens differ from the whole window's\n");
  return 1;
}

}  // namespace tessera::bench
