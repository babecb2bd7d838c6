// bench-generate: what sampling costs on the CPU (nn::generate, as llama-generate and
// llama-train's closing sample run it), through the KV cache and without it.
//
// A Llama model of --flavor's shape (--layers overrides its depth) with random weights
// continues a prompt of --prompt random ids by --tokens greedy tokens, the window its
// max_seq_len (as llama-generate's): once through the KV cache (each new token's forward
// over its own row) and once running the whole window for each token (generate.hpp). In
// float32 both must give the same tokens (exit status 1 otherwise: the smoke test's
// check). bench-generate-gpu runs the same on one GPU.
//
//   bench-generate [--flavor NAME] [--layers N] [--prompt N] [--tokens N] [--commit HASH]
#include <cstdio>
#include <exception>
#include <string>

#include "generate.hpp"
#include "machine.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"

int main(int argc, char** argv) try {
  using namespace tessera;
  bench::GenerateOptions o;
  for (bench::Flags f(argc, argv); f.next();) {
    if (bench::take_generate_flag(f, o)) continue;
    if (f.flag() == "--help") {
      std::printf("bench-generate %s\n", bench::kGenerateFlags);
      return 0;
    }
    f.unknown();
  }
  const nn::ModelArgs a = bench::generate_args(o);
  return bench::generate_rows<nn::Transformer<float, Cpu>>(o, a, bench::cpuinfo_field("model name"), true);
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench-generate: error: %s\n", e.what());
  return 1;
}
