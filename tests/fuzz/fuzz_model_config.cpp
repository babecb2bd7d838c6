// libFuzzer target: the two readers of a saved model's shape: Hugging Face's config.json
// (train::read_hf_config, from a scratch directory) and the tessera.model_args JSON a
// tessera model.safetensors carries in its metadata (train::model_args_from_json). The
// same input goes to both.
//
// When a reader accepts the input, the model arguments are used as a run uses them: the
// parameter count, the FLOPs per token at the model's longest sequence, the SwiGLU
// hidden size (UBSan stops any signed overflow in them), and they must write back and
// read back equal (hf_config_json and read_hf_config; model_args_to_json and
// model_args_from_json).
//
// Contract: reading either succeeds or throws tessera::Error naming the file. Any other
// exception, a crash, a leak, undefined behaviour, a timeout, or a broken invariant
// above (reported on stderr, then abort) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tessera/checkpoint/hf.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/core/error.hpp"
#include "scratch_file.hpp"

namespace {

using tessera::nn::ModelArgs;

[[noreturn]] void finding(const char* what, std::string_view detail = {}) {
  std::fprintf(stderr, "fuzz_model_config: %s %.*s\n", what, static_cast<int>(detail.size() < 300 ? detail.size() : 300),
               detail.data());
  std::abort();
}

/// The folder each input is written to, as its config.json.
const fuzz::ScratchFile& scratch() {
  static const fuzz::ScratchFile file("model-config", "", "config.json");
  return file;
}

void write_config(std::string_view text) { scratch().write(text.data(), text.size()); }

/// What a run computes from the arguments: UBSan reports an overflow here.
volatile double sink;
void use(const ModelArgs& a) {
  sink = static_cast<double>(a.num_params()) + static_cast<double>(a.num_embedding_params()) +
         static_cast<double>(a.ffn_hidden_dim()) + a.flops_per_token(a.max_seq_len, true);
  if (a.num_params() <= 0) finding("a model of no parameters was accepted");
}

bool same(const ModelArgs& a, const ModelArgs& b) {
  return a.dim == b.dim && a.n_layers == b.n_layers && a.n_heads == b.n_heads && a.kv_heads() == b.kv_heads() &&
         a.vocab_size == b.vocab_size && a.ffn_hidden_dim() == b.ffn_hidden_dim() && a.norm_eps == b.norm_eps &&
         a.rope_theta == b.rope_theta && a.rope_scaling.enabled == b.rope_scaling.enabled &&
         (!a.rope_scaling.enabled ||
          (a.rope_scaling.factor == b.rope_scaling.factor && a.rope_scaling.low_freq_factor == b.rope_scaling.low_freq_factor &&
           a.rope_scaling.high_freq_factor == b.rope_scaling.high_freq_factor &&
           a.rope_scaling.original_max_position == b.rope_scaling.original_max_position)) &&
         a.max_seq_len == b.max_seq_len && a.tie_embeddings == b.tie_embeddings;
}

bool names(const tessera::Error& e, std::string_view what) { return std::string_view(e.what()).find(what) != std::string_view::npos; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string& file = scratch().path();

  // config.json
  write_config(text);
  try {
    const ModelArgs a = tessera::train::read_hf_config(scratch().folder());
    use(a);
    const std::string back = tessera::train::hf_config_json(a, tessera::DType::bf16).dump();
    write_config(back);
    ModelArgs b;
    try {
      b = tessera::train::read_hf_config(scratch().folder());
    } catch (const tessera::Error& e) {
      finding("the config.json written back is refused:", e.what());
    }
    if (!same(a, b)) finding("the config.json written back reads back otherwise:", back);
  } catch (const tessera::Error& e) {
    if (!names(e, file)) finding("read_hf_config's error names no file:", e.what());
  }

  // tessera.model_args
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return 0;  // read_model_args refuses it before model_args_from_json, naming the file
  }
  try {
    const ModelArgs a = tessera::train::model_args_from_json(j, "fuzz.safetensors");
    use(a);
    const ModelArgs b = tessera::train::model_args_from_json(tessera::train::model_args_to_json(a), "back");
    if (!same(a, b) || a.flavor != b.flavor || a.depth_init != b.depth_init)
      finding("tessera.model_args written back reads back otherwise");
  } catch (const tessera::Error& e) {
    if (!names(e, "fuzz.safetensors")) finding("model_args_from_json's error names no file:", e.what());
  }
  return 0;
}
