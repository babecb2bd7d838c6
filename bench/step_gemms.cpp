#include "step_gemms.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "step_trace.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/train/config.hpp"

namespace tessera::bench {

std::vector<tessera::plan::StepGemm> step_gemms(const std::string& flavor, std::int64_t tokens,
                                                std::size_t device_bytes, bool float8) {
  const tessera::nn::ModelArgs args = tessera::nn::model_flavor(flavor);
  std::vector<std::string> keys = {"--model.flavor", flavor,
                                   "--model.max_seq_len", std::to_string(std::max<std::int64_t>(tokens, args.max_seq_len)),
                                   "--training.seq_len", std::to_string(tokens),
                                   "--training.local_batch_size", "1",
                                   "--training.global_batch_size", "1",
                                   "--training.mixed_precision_param", "bfloat16",
                                   "--activation_checkpoint.mode", "none"};
  if (float8)
    for (const char* k : {"--model.converters", "float8", "--float8.recipe_name", "tensorwise", "--float8.emulate", "false"})
      keys.emplace_back(k);
  const tessera::train::JobConfig c =
      llama_plan::on_one_device(tessera::train::parse_config("", "bench-kernels", keys));
  return tessera::plan::step_gemms(llama_plan::trace_step(c, true, device_bytes).trace);
}

}  // namespace tessera::bench
