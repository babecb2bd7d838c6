// What every parallel test shares, compiled once: the debug job, its tokens, and the
// training loop the tests run (harness.hpp declares it extern; the model and trainer it
// trains are the build's shared instances, tessera/instances.hpp).
#include "harness.hpp"

#include "tessera/train/config.hpp"

namespace tessera::test {

train::JobConfig debug_job(std::int64_t local_batch, std::int64_t global_batch, int steps,
                           const std::vector<std::string>& overrides) {
  std::vector<std::string> o = {"--training.local_batch_size", std::to_string(local_batch),
                                "--training.global_batch_size", std::to_string(global_batch),
                                "--training.steps", std::to_string(steps),
                                "--validation.local_batch_size", std::to_string(local_batch)};
  o.insert(o.end(), overrides.begin(), overrides.end());
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    dim = 64
    tokenizer = "synthetic_bpe"
    vocab_size = 1024
    [optimizer]
    lr = 3e-3
    [lr_scheduler]
    warmup_steps = 3
    [training]
    seq_len = 32
    max_norm = 0.5
    seed = 0
    mixed_precision_param = "float32"
    synthetic_documents = 400
    [validation]
    seq_len = 32
    synthetic_documents = 60
  )",
                             "parity_job", o);
}

const std::vector<std::uint32_t>& debug_tokens() {
  static const std::vector<std::uint32_t> tokens = [] {
    const train::JobConfig c = debug_job(1, 1, 1);
    auto tok = data::make_tokenizer(c.model.tokenizer);
    return train::load_training_tokens(c, *tok).ids;
  }();
  return tokens;
}

io::TokenStream validation_tokens(const train::JobConfig& c) {
  auto tok = data::make_tokenizer(c.model.tokenizer);
  return train::load_token_stream(train::validation_dataset(c), *tok);
}

template RunResult train_layout<CpuDynamicModel>(comm::Communicator, comm::MeshShape, const train::JobConfig&,
                                                 const nn::NoBlockOptions&);

}  // namespace tessera::test
