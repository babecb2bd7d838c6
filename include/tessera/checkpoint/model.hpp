// Model checkpoints as safetensors: every parameter under its torchtitan name, and the
// model arguments in the metadata (key "tessera.model_args", JSON), so a checkpoint
// alone is enough to rebuild and run the model.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <system_error>
#include <string>
#include <vector>

#include "tessera/checkpoint/hf.hpp"  // the Hugging Face directory layout
#include "tessera/core/dtype.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/lora.hpp"

namespace tessera::train {

inline nlohmann::json model_args_to_json(const nn::ModelArgs& a) {
  return {{"flavor", a.flavor},
          {"dim", a.dim},
          {"n_layers", a.n_layers},
          {"n_heads", a.n_heads},
          {"n_kv_heads", a.kv_heads()},
          {"vocab_size", a.vocab_size},
          {"multiple_of", a.multiple_of},
          {"ffn_dim_multiplier", a.ffn_dim_multiplier},
          {"ffn_hidden", a.ffn_hidden},
          {"norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling",
           {{"enabled", a.rope_scaling.enabled},
            {"factor", a.rope_scaling.factor},
            {"low_freq_factor", a.rope_scaling.low_freq_factor},
            {"high_freq_factor", a.rope_scaling.high_freq_factor},
            {"original_max_position", a.rope_scaling.original_max_position}}},
          {"max_seq_len", a.max_seq_len},
          {"tie_embeddings", a.tie_embeddings},
          {"depth_init", a.depth_init}};
}

inline nn::ModelArgs model_args_from_json(const nlohmann::json& j, const std::string& where) {
  nn::ModelArgs a;
  // A whole number, not a float JSON would convert (1e30 does not fit an int64).
  auto integer = [&](const nlohmann::json& o, const char* key) {
    const nlohmann::json& v = o.at(key);
    TESSERA_CHECK(v.is_number_integer(), where, ": model arguments: ", key, " is ", v.dump(), ", not a whole number");
    return v.get<std::int64_t>();
  };
  try {
    a.flavor = j.at("flavor").get<std::string>();
    a.dim = integer(j, "dim");
    a.n_layers = integer(j, "n_layers");
    a.n_heads = integer(j, "n_heads");
    a.n_kv_heads = integer(j, "n_kv_heads");
    a.vocab_size = integer(j, "vocab_size");
    a.multiple_of = integer(j, "multiple_of");
    a.ffn_dim_multiplier = j.at("ffn_dim_multiplier").get<double>();
    a.ffn_hidden = j.contains("ffn_hidden") ? integer(j, "ffn_hidden") : 0;  // absent in older checkpoints
    a.norm_eps = j.at("norm_eps").get<double>();
    a.rope_theta = j.at("rope_theta").get<double>();
    const auto& r = j.at("rope_scaling");
    a.rope_scaling = {r.at("enabled").get<bool>(), r.at("factor").get<double>(), r.at("low_freq_factor").get<double>(),
                      r.at("high_freq_factor").get<double>(), integer(r, "original_max_position")};
    a.max_seq_len = integer(j, "max_seq_len");
    a.tie_embeddings = j.at("tie_embeddings").get<bool>();
    a.depth_init = j.at("depth_init").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": model arguments: ", e.what());
  }
  a.validate(where);
  return a;
}

/// Writes every parameter of `model` to `path` (atomically: a crash leaves any
/// previous file intact), stored as `dtype` (float32 or bfloat16). A LoRA model's
/// adapted weights are written merged with their adapters (for_each_merged_parameter).
template <class Model>
void save_model(Model& model, const std::string& path, DType dtype) {
  using T = typename Model::scalar_type;
  io::SafetensorsWriter w;
  const io::StDtype stored = dtype == DType::bf16 ? io::StDtype::bf16 : io::StDtype::f32;
  // A LoRA model's weights merged with their adapters: a plain Llama model's file.
  for_each_merged_parameter(model, [&](nn::Parameter<T>& p, const Tensor<T>& host) {
    std::vector<std::int64_t> shape(p.shape().dims.begin(), p.shape().dims.begin() + p.shape().rank);
    w.add(p.name, stored, shape, std::span<const T>(host.data(), static_cast<std::size_t>(p.numel())));
  });
  w.set_metadata("format", "pt");
  w.set_metadata("tessera.model_args", model_args_to_json(model.args()).dump());
  w.write(path);
}

/// The model arguments stored in a checkpoint's metadata.
inline nn::ModelArgs read_model_args(const std::string& path) {
  auto file = io::SafetensorsFile::open(path);
  auto it = file.metadata().find("tessera.model_args");
  TESSERA_CHECK(it != file.metadata().end(), path,
                ": no tessera.model_args in the metadata (not a tessera checkpoint)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": tessera.model_args is not valid JSON: ", e.what());
  }
  return model_args_from_json(j, path);
}

/// Loads every parameter of `model` from `path`; a missing tensor, another shape, a value
/// that is not finite, or a tensor with no place in the model (a file whose
/// tessera.model_args do not describe it) is an error naming the file and the tensor.
/// `adapter_seed`: a LoRA adapter the file does not hold (a base model's file) is
/// initialised from this seed, as init_weights makes it (nn::is_lora_name).
template <class Model>
void load_model(Model& model, const std::string& path, std::optional<std::uint64_t> adapter_seed = std::nullopt) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  auto file = io::SafetensorsFile::open(path);
  std::set<std::string> used;
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    check_whole(p, "loaded");
    if (adapter_seed && nn::is_lora_name(p.name) && !file.contains(p.name)) {
      nn::init_parameter<B>(p, *adapter_seed, p.value.data(), p.numel());
      return;
    }
    std::vector<std::int64_t> shape(p.shape().dims.begin(), p.shape().dims.begin() + p.shape().rank);
    Tensor<T> host(p.shape(), Uninitialized{});
    const std::span<T> values(host.data(), static_cast<std::size_t>(p.numel()));
    file.read(p.name, values, shape);
    check_finite(std::span<const T>(values), path, p.name);
    B::copy_from_host(host.data(), p.value.data(), p.numel());
    used.insert(p.name);
  });
  // A pipelined model holds only its stages: the others' tensors have a place elsewhere.
  if constexpr (requires { model.parameter_names(); })
    for (const std::string& n : model.parameter_names()) used.insert(n);
  for (const io::TensorEntry& e : file.tensors())
    TESSERA_CHECK(used.count(e.name), path, ": tensor '", e.name, "' has no place in the model (", model.args().n_layers,
                  " layers", model.args().tie_embeddings ? ", tied embeddings" : "",
                  "): the file's tessera.model_args do not describe what it holds");
}

/// The model arguments of either kind of saved model: a Hugging Face directory (its
/// config.json) or a tessera model.safetensors (its metadata).
inline nn::ModelArgs read_saved_model_args(const std::string& path) {
  std::error_code ec;
  TESSERA_CHECK(!std::filesystem::is_directory(path, ec) || is_hf_directory(path), path,
                ": a directory without config.json (expected a Hugging Face model directory or a model.safetensors)");
  return is_hf_directory(path) ? read_hf_config(path) : read_model_args(path);
}

/// Loads `model` from either kind of saved model (see read_saved_model_args); LoRA
/// adapters the files do not hold are initialised from `adapter_seed` where given.
template <class Model>
void load_saved_model(Model& model, const std::string& path, std::optional<std::uint64_t> adapter_seed = std::nullopt) {
  if (is_hf_directory(path)) load_hf_model(model, path, adapter_seed);
  else load_model(model, path, adapter_seed);
}

}  // namespace tessera::train
