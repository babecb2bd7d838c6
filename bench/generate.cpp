// bench-generate: what sampling costs on the CPU (nn::generate, as llama-generate and
// llama-train's closing sample run it), through the KV cache and without it.
//
// A Llama model of --flavor's shape (--layers overrides its depth) with random weights
// continues a prompt of --prompt random ids by --tokens greedy tokens, the window its
// max_seq_len (as llama-generate's): once through the KV cache (each new token's forward
// over its own row) and once running the whole window for each token. Both must give the
// same tokens (exit status 1 otherwise: the smoke test's check). One row a mode:
// seconds, tokens/s and the milliseconds a token, against the model's bytes read a token
// (fp32 weights: what a decoded token's GEMMs cannot read less than).
//
//   bench-generate [--flavor NAME] [--layers N] [--prompt N] [--tokens N] [--commit HASH]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "machine.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"

namespace {

using namespace tessera;
using clock_type = std::chrono::steady_clock;

struct Options {
  std::string flavor = "debugmodel";
  std::int64_t layers = 0;  // 0: the flavor's
  std::int64_t prompt = 16, tokens = 256;
  std::string commit = "-";
};

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  for (bench::Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--flavor") o.flavor = f.value();
    else if (flag == "--layers") o.layers = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--prompt") o.prompt = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--tokens") o.tokens = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--commit") o.commit = f.value();
    else if (flag == "--help") {
      std::printf("bench-generate [--flavor NAME] [--layers N] [--prompt N] [--tokens N] [--commit HASH]\n");
      return 0;
    } else f.unknown();
  }
  nn::ModelArgs a = nn::model_flavor(o.flavor);
  if (o.layers > 0) a.n_layers = o.layers;
  a.validate();
  TESSERA_CHECK(o.prompt + o.tokens <= a.max_seq_len, "--prompt ", o.prompt, " + --tokens ", o.tokens,
                " exceed the flavor's max_seq_len ", a.max_seq_len);
  nn::Transformer<float, Cpu> model(a);
  model.init_weights(1);
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(o.prompt));
  std::uint32_t x = 12345;
  for (auto& id : prompt) {
    x = x * 1664525u + 1013904223u;
    id = static_cast<std::int32_t>((x >> 8) % static_cast<std::uint32_t>(a.vocab_size));
  }
  double weight_bytes = 0;
  model.for_each_parameter([&](nn::Parameter<float>& p) { weight_bytes += 4.0 * static_cast<double>(p.numel()); });

  std::printf("bench-generate: %s, %lld layers, %.1f M parameters (%.1f MB of fp32 weights); a prompt of %lld "
              "random ids, %lld greedy tokens; %s, %s, commit %s\n\n",
              o.flavor.c_str(), static_cast<long long>(a.n_layers), weight_bytes / 4e6, weight_bytes / 1e6,
              static_cast<long long>(o.prompt), static_cast<long long>(o.tokens), bench::utc_date().c_str(),
              bench::cpuinfo_field("model name").c_str(), o.commit.c_str());
  std::printf("| mode | seconds | tokens/s | ms a token | weights read a token at |\n|---|---:|---:|---:|---:|\n");
  std::vector<std::vector<std::int32_t>> texts;
  for (const bool cached : {true, false}) {
    nn::SampleOptions s;
    s.max_new_tokens = o.tokens;
    s.temperature = 0;
    s.context = a.max_seq_len;
    s.kv_cache = cached;
    const auto t0 = clock_type::now();
    texts.push_back(nn::generate(model, prompt, s));
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    const double n = static_cast<double>(texts.back().size());
    std::printf("| %s | %.2f | %.1f | %.2f | %.2f GB/s |\n", cached ? "KV cache" : "whole window", seconds,
                n / seconds, 1e3 * seconds / n, weight_bytes * n / seconds / 1e9);
  }
  if (texts[0] != texts[1]) {
    std::fprintf(stderr, "bench-generate: the KV cache's tokens differ from the whole window's\n");
    return 1;
  }
  std::printf("\nthe same %zu tokens both ways\n", texts[0].size());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench-generate: error: %s\n", e.what());
  return 1;
}
