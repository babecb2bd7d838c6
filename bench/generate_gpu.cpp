// bench-generate-gpu: what sampling costs on one GPU, through the KV cache (the decoding
// attention on tessera's flash kernels, each row's keys in runs merged at the end) and
// running the whole window for each token (generate.hpp). Both modes attend on tessera's
// flash kernels: cuDNN's graphs are built for one sequence length each, and the whole
// window's length changes every token.
//
//   bench-generate-gpu [--dtype bfloat16|float32] [--flavor NAME] [--layers N] [--prompt N] [--tokens N]
//                      [--commit HASH]
//
// In float32 the two modes must give the same tokens (exit status 1 otherwise); in bf16
// the tokens that agree before the first difference are reported.
#include <cstdio>
#include <exception>
#include <string>

#include "cuda_device.hpp"
#include "generate.hpp"
#include "machine.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/nn/transformer.hpp"

int main(int argc, char** argv) try {
  using namespace tessera;
  bench::GenerateOptions o;
  std::string dtype = "bfloat16";
  for (bench::Flags f(argc, argv); f.next();) {
    if (bench::take_generate_flag(f, o)) continue;
    if (f.flag() == "--dtype") {
      dtype = f.value();
      TESSERA_CHECK(dtype == "bfloat16" || dtype == "float32", "--dtype: '", dtype, "' is not bfloat16 or float32");
    } else if (f.flag() == "--help") {
      std::printf("bench-generate-gpu [--dtype bfloat16|float32] %s\n", bench::kGenerateFlags);
      return 0;
    } else {
      f.unknown();
    }
  }
  const nn::ModelArgs a = bench::generate_args(o);
  cuda::require_device();
  if (dtype == "float32") return bench::generate_rows<nn::Transformer<float, Cuda>>(o, a, bench::cuda_device_name(), true);
  return bench::generate_rows<nn::Transformer<bf16, Cuda>>(o, a, bench::cuda_device_name(), false);
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench-generate-gpu: error: %s\n", e.what());
  return 1;
}
