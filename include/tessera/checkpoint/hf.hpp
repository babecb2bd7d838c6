// Hugging Face Llama directories: config.json plus safetensors (one file or shards).
//
// Loading maps config.json onto nn::ModelArgs (hidden_size, intermediate_size,
// num_hidden_layers, num_attention_heads, num_key_value_heads, rms_norm_eps, rope_theta,
// rope_scaling with rope_type "llama3" -- or transformers 5's rope_parameters, which
// holds both -- vocab_size, max_position_embeddings, tie_word_embeddings) and reads
// every parameter under its Hugging Face name. Saving writes the same layout back.
//
// No weight is permuted on the way: tessera's rotary embedding rotates the two halves
// of each head (Hugging Face's rotate_half convention), which is the layout Hugging Face
// checkpoints are stored in. (Meta's original and torchtitan's checkpoints rotate
// interleaved pairs; their wq/wk rows are permuted relative to these.)
//
// Everything a model cannot be built from is refused with the file and key named: a
// model_type other than "llama", a hidden_act other than "silu", attention or MLP
// biases, a head_dim other than hidden_size / num_attention_heads, an unknown rope_type;
// and on the weights, a tensor missing, of another shape than config.json implies, or
// one the model has no place for.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/hf_tokenizer.hpp"
#include "tessera/io/load_tokenizer.hpp"
#include "tessera/io/sentencepiece.hpp"
#include "tessera/io/sharded_safetensors.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/lora.hpp"

namespace tessera::train {

/// A parameter's whole value must be here to save or load it: a sharded model (FSDP,
/// HSDP) saves inside model.with_whole_parameters(...) and loads before model.shard().
template <class T>
void check_whole(const nn::Parameter<T>& p, const char* what) {
  TESSERA_CHECK(p.value.data() != nullptr, p.name, " cannot be ", what,
                ": only this rank's shard is here (the model is sharded); save inside "
                "model.with_whole_parameters(...), load before model.shard()");
}

/// A loaded parameter's values must be finite: a NaN or an infinity in a saved model (a
/// corrupt file, or a run that diverged) would make every loss and sample NaN, far from
/// the file. Refused naming the file, the tensor and the first such element. One pass
/// of sums in double (no finite float or bf16 values overflow it) finds whether to look.
template <class T>
void check_finite(std::span<const T> values, const std::string& file, const std::string& tensor) {
  double sum = 0;
  for (const T& v : values) sum += static_cast<double>(static_cast<float>(v));
  if (std::isfinite(sum)) return;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = static_cast<double>(static_cast<float>(values[i]));
    if (!std::isfinite(v))
      fail(file, ": tensor '", tensor, "' holds ", std::isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf", " at element ", i,
           " (a model whose values are not all finite cannot be trained or run)");
  }
}

// ---------------------------------------------------------------------------------
// Names.

/// The Hugging Face name of a tessera parameter ("layers.0.attention.wq.weight" ->
/// "model.layers.0.self_attn.q_proj.weight"). Throws for a name outside the Llama model.
inline std::string hf_name(std::string_view name) {
  static const std::map<std::string, std::string, std::less<>> top = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"},
      {"norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string, std::less<>> in_layer = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
  };
  if (auto it = top.find(name); it != top.end()) return it->second;
  constexpr std::string_view prefix = "layers.";
  if (name.substr(0, prefix.size()) == prefix) {
    const std::size_t dot = name.find('.', prefix.size());
    const std::string_view index = name.substr(prefix.size(), dot - prefix.size());
    if (dot != std::string_view::npos && !index.empty() &&
        index.find_first_not_of("0123456789") == std::string_view::npos) {
      if (auto it = in_layer.find(name.substr(dot + 1)); it != in_layer.end()) {
        return "model.layers." + std::string(index) + "." + it->second;
      }
    }
  }
  fail("parameter '", name, "' has no Hugging Face Llama name");
}

// ---------------------------------------------------------------------------------
// config.json.

namespace detail {

/// Reads config.json fields with errors naming the file and the key.
class HfConfigReader {
 public:
  HfConfigReader(const nlohmann::json& j, std::string file) : j_(j), file_(std::move(file)) {}

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  std::int64_t positive_int(const char* key) const {
    if (!has(key)) fail(file_, ": key '", key, "' is missing");
    return positive_int_at(j_.at(key), key);
  }
  std::int64_t positive_int_or(const char* key, std::int64_t fallback) const {
    return has(key) ? positive_int_at(j_.at(key), key) : fallback;
  }
  double positive_number_or(const char* key, double fallback) const {
    return has(key) ? positive_number_at(j_.at(key), key) : fallback;
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_boolean()) fail(file_, ": key '", key, "': expected true or false, got ", j_.at(key).dump());
    return j_.at(key).get<bool>();
  }
  std::string string_or(const char* key, std::string fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_string()) fail(file_, ": key '", key, "': expected a string, got ", j_.at(key).dump());
    return j_.at(key).get<std::string>();
  }

  std::int64_t positive_int_at(const nlohmann::json& v, std::string_view key) const {
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0) {
      fail(file_, ": key '", key, "': expected a positive integer, got ", v.dump());
    }
    return v.get<std::int64_t>();
  }
  double positive_number_at(const nlohmann::json& v, std::string_view key) const {
    if (!v.is_number() || !(v.get<double>() > 0))
      fail(file_, ": key '", key, "': expected a positive number, got ", v.dump());
    return v.get<double>();
  }

  const nlohmann::json& json() const { return j_; }
  const std::string& file() const { return file_; }

 private:
  const nlohmann::json& j_;
  std::string file_;
};

/// rope_scaling (transformers 4) or rope_parameters (transformers 5) -> RopeScaling.
inline nn::RopeScaling read_rope_scaling(const HfConfigReader& r, const nlohmann::json& s, const char* key) {
  if (s.is_null()) return {};
  if (!s.is_object()) fail(r.file(), ": key '", key, "': expected an object or null, got ", s.dump());
  std::string type = "default";
  for (const char* k : {"rope_type", "type"}) {
    if (s.contains(k)) {
      if (!s.at(k).is_string()) fail(r.file(), ": key '", key, ".", k, "': expected a string, got ", s.at(k).dump());
      type = s.at(k).get<std::string>();
      break;
    }
  }
  if (type == "default") return {};
  if (type != "llama3") {
    fail(r.file(), ": key '", key, ".rope_type' = \"", type,
         "\" is not supported (tessera implements \"default\" and \"llama3\")");
  }
  auto field = [&](const char* k) -> const nlohmann::json& {
    if (!s.contains(k)) fail(r.file(), ": key '", key, ".", k, "' is missing (rope_type \"llama3\" needs it)");
    return s.at(k);
  };
  const std::string prefix = std::string(key) + ".";
  nn::RopeScaling out;
  out.enabled = true;
  out.factor = r.positive_number_at(field("factor"), prefix + "factor");
  out.low_freq_factor = r.positive_number_at(field("low_freq_factor"), prefix + "low_freq_factor");
  out.high_freq_factor = r.positive_number_at(field("high_freq_factor"), prefix + "high_freq_factor");
  out.original_max_position =
      r.positive_int_at(field("original_max_position_embeddings"), prefix + "original_max_position_embeddings");
  return out;
}

inline std::string config_path(const std::string& dir_or_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  return fs::is_directory(dir_or_file, ec) ? (fs::path(dir_or_file) / "config.json").string() : dir_or_file;
}

}  // namespace detail

/// The model arguments of a Hugging Face Llama config.json (given the directory or the
/// file itself).
inline nn::ModelArgs read_hf_config(const std::string& dir) {
  const std::string file = detail::config_path(dir);
  std::ifstream in(file, std::ios::binary);
  if (!in) fail(file, ": cannot open (a Hugging Face model directory needs a config.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(file, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(file, ": not a JSON object but ", j.type_name());
  const detail::HfConfigReader r(j, file);

  if (const std::string type = r.string_or("model_type", "llama"); type != "llama") {
    fail(file, ": model_type \"", type, "\" is not a Llama model (expected \"llama\")");
  }
  if (const std::string act = r.string_or("hidden_act", "silu"); act != "silu") {
    fail(file, ": hidden_act \"", act, "\" is not supported (Llama's feed-forward uses \"silu\")");
  }
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    if (r.boolean_or(bias, false)) fail(file, ": ", bias, " = true is not supported (Llama has no biases)");
  }

  nn::ModelArgs a;
  a.flavor = "hf:" + std::filesystem::path(file).parent_path().filename().string();
  a.dim = r.positive_int("hidden_size");
  a.ffn_hidden = r.positive_int("intermediate_size");
  a.n_layers = r.positive_int("num_hidden_layers");
  a.n_heads = r.positive_int("num_attention_heads");
  a.n_kv_heads = r.positive_int_or("num_key_value_heads", a.n_heads);
  a.vocab_size = r.positive_int("vocab_size");
  a.norm_eps = r.positive_number_or("rms_norm_eps", 1e-6);
  a.max_seq_len = r.positive_int_or("max_position_embeddings", 2048);
  a.tie_embeddings = r.boolean_or("tie_word_embeddings", false);
  a.rope_theta = r.positive_number_or("rope_theta", 10000.0);
  if (r.has("rope_parameters")) {
    const nlohmann::json& p = j.at("rope_parameters");
    if (p.is_object() && p.contains("rope_theta"))
      a.rope_theta = r.positive_number_at(p.at("rope_theta"), "rope_parameters.rope_theta");
    a.rope_scaling = detail::read_rope_scaling(r, p, "rope_parameters");
  } else if (r.has("rope_scaling")) {
    a.rope_scaling = detail::read_rope_scaling(r, j.at("rope_scaling"), "rope_scaling");
  }
  if (a.dim % a.n_heads == 0 && r.has("head_dim")) {
    const std::int64_t head_dim = r.positive_int("head_dim");
    if (head_dim != a.dim / a.n_heads) {
      fail(file, ": head_dim ", head_dim, " differs from hidden_size / num_attention_heads = ", a.dim / a.n_heads,
           " (tessera derives the head size from those two)");
    }
  }
  a.validate(file);
  return a;
}

/// config.json for `a`, in the form transformers 4 and 5 both read.
inline nlohmann::ordered_json hf_config_json(const nn::ModelArgs& a, DType dtype) {
  nlohmann::ordered_json rope = nullptr;
  if (a.rope_scaling.enabled) {
    rope = {{"rope_type", "llama3"},
            {"factor", a.rope_scaling.factor},
            {"low_freq_factor", a.rope_scaling.low_freq_factor},
            {"high_freq_factor", a.rope_scaling.high_freq_factor},
            {"original_max_position_embeddings", a.rope_scaling.original_max_position}};
  }
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", a.dim},
          {"intermediate_size", a.ffn_hidden_dim()},
          {"num_hidden_layers", a.n_layers},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.kv_heads()},
          {"head_dim", a.head_dim()},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling", rope},
          {"max_position_embeddings", a.max_seq_len},
          {"vocab_size", a.vocab_size},
          {"tie_word_embeddings", a.tie_embeddings},
          {"torch_dtype", dtype == DType::bf16 ? "bfloat16" : "float32"}};
}

// ---------------------------------------------------------------------------------
// Weights.

/// Reads every parameter of `model` from the Hugging Face directory `dir` (one
/// model.safetensors or shards with an index; F32, BF16, F16 or F64 converted to the
/// model's dtype). A tensor missing, shaped otherwise than the model (built from
/// config.json) expects, or with no place in the model is an error naming the file and
/// the tensor.
/// `adapter_seed`: LoRA adapters (which a Hugging Face model does not hold) are
/// initialised from this seed, as init_weights makes them.
template <class Model>
void load_hf_model(Model& model, const std::string& dir, std::optional<std::uint64_t> adapter_seed = std::nullopt) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  const io::ShardedSafetensors st = io::ShardedSafetensors::open(dir);
  std::set<std::string> used;
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    check_whole(p, "loaded");
    if (nn::is_lora_name(p.name)) {
      TESSERA_CHECK(adapter_seed.has_value(), dir, ": the model's LoRA adapter ", p.name, " has no Hugging Face tensor "
                    "(load the base model with the adapters' seed)");
      nn::init_parameter<B>(p, *adapter_seed, p.value.data(), p.numel());
      return;
    }
    const std::string name = hf_name(p.name);
    if (!st.contains(name)) {
      fail(dir, ": tensor '", name, "' (tessera parameter '", p.name, "') is missing from the safetensors files");
    }
    const std::vector<std::int64_t> shape(p.shape().dims.begin(), p.shape().dims.begin() + p.shape().rank);
    const io::TensorEntry& e = st.entry(name);
    if (e.shape != shape) {
      fail(st.file_of(name).path(), ": tensor '", name, "' has shape ", io::detail::shape_str(e.shape),
           ", but the model config.json describes needs ", io::detail::shape_str(shape));
    }
    Tensor<T> host(p.shape(), Uninitialized{});
    const std::span<T> values(host.data(), static_cast<std::size_t>(p.numel()));
    st.read(name, values, shape);
    check_finite(std::span<const T>(values), st.file_of(name).path(), name);
    B::copy_from_host(host.data(), p.value.data(), p.numel());
    used.insert(name);
  });
  // A pipelined model holds only its stages: the others' tensors have a place elsewhere.
  std::set<std::string> elsewhere;
  if constexpr (requires { model.parameter_names(); })
    for (const std::string& n : model.parameter_names())
      if (!nn::is_lora_name(n)) elsewhere.insert(hf_name(n));
  for (const std::string& name : st.names()) {
    if (used.count(name) || elsewhere.count(name)) continue;
    const bool rotary_buffer = name.size() > 21 && name.ends_with(".rotary_emb.inv_freq");
    const bool tied_copy = name == "lm_head.weight" && model.args().tie_embeddings;
    if (rotary_buffer || tied_copy) continue;  // derived values some exporters include
    fail(st.file_of(name).path(), ": tensor '", name, "' has no place in the model config.json describes (",
         model.args().n_layers, " layers", model.args().tie_embeddings ? ", tied embeddings" : "", ")");
  }
}

struct HfSaveOptions {
  DType dtype = DType::f32;                          // stored dtype: f32 or bf16
  std::uint64_t max_shard_bytes = 5'000'000'000ull;  // Hugging Face's default shard size
  std::string tokenizer_file;                        // its files written in when set (write_hf_tokenizer)
};

/// Writes the tokenizer files of a Hugging Face directory into `dir` for the tokenizer
/// file `tokenizer_spec` names (a file or directory io::load_tokenizer reads), so that
/// transformers' AutoTokenizer.from_pretrained(dir) (5.23) loads it directly and encodes
/// as tessera does:
///   tiktoken (Llama 3)      tokenizer.model (the file), tokenizer.json (its conversion,
///                           io::tiktoken_tokenizer_json), tokenizer_config.json with
///                           tokenizer_class PreTrainedTokenizerFast
///   tokenizer.json          tokenizer.json (the file as read), tokenizer_config.json
///                           with tokenizer_class PreTrainedTokenizerFast
///   SentencePiece (Llama 2) tokenizer.model (the file), tokenizer_config.json with
///                           tokenizer_class SentencePieceBackend and special_tokens_pattern
///                           "bos": transformers runs SentencePiece itself. (Its
///                           LlamaTokenizer converts the model to a tokenizer.json
///                           pipeline whose Metaspace adds no dummy prefix to text that
///                           starts with a space: " a" loses a token.)
/// tokenizer_config.json also names bos_token and eos_token, lists the special tokens
/// in added_tokens_decoder, sets model_max_length and clean_up_tokenization_spaces false
/// (decode gives the bytes back as they were), and holds the chat template
/// (io/chat.hpp): Llama 3's when the tokenizer has its header and end-of-turn tokens,
/// Llama 2's otherwise.
inline void write_hf_tokenizer(const std::string& tokenizer_spec, const std::filesystem::path& dir,
                               std::int64_t model_max_length) {
  namespace fs = std::filesystem;
  using ordered = nlohmann::ordered_json;
  const std::string tokenizer_file = io::tokenizer_file(tokenizer_spec);  // a directory's file, too
  TESSERA_CHECK(!tokenizer_file.empty(), "tokenizer '", tokenizer_spec, "' has no file to export");
  const std::unique_ptr<io::Tokenizer> tok = io::load_tokenizer(tokenizer_file);
  const auto write = [&](const char* name, const std::string& text) {
    const fs::path path = dir / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    TESSERA_CHECK(out.good(), path.string(), ": cannot write");
  };
  const auto copy_as = [&](const char* name) {
    std::error_code ec;
    fs::copy_file(tokenizer_file, dir / name, fs::copy_options::overwrite_existing, ec);
    if (ec) fail(tokenizer_file, ": cannot copy into ", dir.string(), ": ", ec.message());
  };
  ordered added = ordered::object();
  const auto add = [&](std::uint32_t id, const std::string& content, bool special, bool normalized) {
    added[std::to_string(id)] = {{"content", content}, {"lstrip", false},     {"normalized", normalized},
                                 {"rstrip", false},    {"single_word", false}, {"special", special}};
  };
  ordered config = ordered::object();
  if (const auto* sp = dynamic_cast<const io::SentencePieceTokenizer*>(tok.get())) {
    copy_as("tokenizer.model");
    for (std::uint32_t id : {sp->unk_id(), sp->bos_id(), sp->eos_id()}) add(id, sp->token_text(id), true, false);
  } else if (const auto* tt = dynamic_cast<const io::TiktokenTokenizer*>(tok.get())) {
    copy_as("tokenizer.model");
    write("tokenizer.json", io::tiktoken_tokenizer_json(*tt));
    for (std::size_t i = 0; i < io::llama3_num_special_tokens; ++i)
      add(tt->num_base_tokens() + static_cast<std::uint32_t>(i), io::llama3_special_token_name(i), true, false);
  } else if (const auto* hf = dynamic_cast<const io::HfTokenizer*>(tok.get())) {
    write("tokenizer.json", hf->json());
    for (const io::detail::HfAddedToken& t : hf->added_tokens()) add(t.id, t.content, t.special, t.normalized);
  } else {
    fail(tokenizer_file, ": a ", tok->kind(), " tokenizer has no Hugging Face form");
  }
  const bool sentencepiece = tok->kind() == "sentencepiece";
  config["added_tokens_decoder"] = std::move(added);
  config["bos_token"] = tok->token_text(tok->bos_id());
  config["chat_template"] = std::string(io::chat_template_of(io::chat_format_for(*tok)));
  config["clean_up_tokenization_spaces"] = false;
  config["eos_token"] = tok->token_text(tok->eos_id());
  config["model_input_names"] = ordered::array({"input_ids", "attention_mask"});
  config["model_max_length"] = model_max_length;
  if (sentencepiece) {
    config["special_tokens_pattern"] = "bos";
    config["unk_token"] = tok->token_text(dynamic_cast<const io::SentencePieceTokenizer&>(*tok).unk_id());
  }
  config["tokenizer_class"] = sentencepiece ? "SentencePieceBackend" : "PreTrainedTokenizerFast";
  write("tokenizer_config.json", config.dump(2) + "\n");
}

/// Calls f(p, values) for every parameter of `model` but LoRA's adapters, whole, with its
/// values on the host: an adapted weight's merged, W + (alpha / rank) B A (one GEMM on the
/// model's backend into a copy of W, rounded once), so that the file is a plain Llama
/// model. What the whole-model files hold (save_model, save_hf_model).
template <class Model, class F>
void for_each_merged_parameter(Model& model, F&& f) {
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;
  std::map<std::string, std::pair<nn::Parameter<T>*, nn::Parameter<T>*>, std::less<>> adapters;
  float scale = 1.0f;
  if constexpr (requires { model.plan().lora; }) scale = model.plan().lora.scaling();
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    if (!nn::is_lora_name(p.name)) return;
    const std::string weight = p.name.substr(0, p.name.size() - std::string_view(".lora_a.weight").size()) + ".weight";
    (p.name.ends_with(".lora_a.weight") ? adapters[weight].first : adapters[weight].second) = &p;
  });
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    check_whole(p, "saved");
    if (nn::is_lora_name(p.name)) return;
    const auto it = adapters.find(p.name);
    if (it == adapters.end()) {
      f(p, download<B>(p.value));
      return;
    }
    const auto [a, b] = it->second;
    TESSERA_CHECK(a != nullptr && b != nullptr, p.name, ": a LoRA adapter without its other half");
    const Tensor<T> merged = B::template empty<T>(p.shape());
    B::for_each(p.numel(), ops::Copy<T>{p.value.data(), merged.data()});
    B::gemm(Trans::no, Trans::no, scale, b->value.cview(), a->value.cview(), accum_t<T>(1), merged.view());
    f(p, download<B>(merged));
  });
}

/// Writes `model` as a Hugging Face Llama directory `dir` (config.json, safetensors
/// under Hugging Face names, and the tokenizer's files when given: write_hf_tokenizer).
/// A model with LoRA adapters is written with each adapter merged into its weight.
/// All or nothing: the
/// files are written into `dir.partial` and swapped in only when complete, so a failed
/// save leaves an earlier directory at `dir` intact. Refuses to replace a directory
/// that is not a model directory (has no config.json).
template <class Model>
void save_hf_model(Model& model, const std::string& dir, const HfSaveOptions& o = {}) {
  namespace fs = std::filesystem;
  using T = typename Model::scalar_type;
  TESSERA_CHECK(o.dtype == DType::f32 || o.dtype == DType::bf16, dir,
                ": Hugging Face export supports float32 and bfloat16");
  std::error_code ec;
  const fs::path target = fs::path(dir).lexically_normal();
  const fs::path staging = fs::path(target.string() + ".partial");
  const fs::path previous = fs::path(target.string() + ".previous");
  if (fs::exists(target, ec)) {
    TESSERA_CHECK(fs::is_directory(target, ec) && fs::exists(target / "config.json", ec), target.string(),
                  ": exists and is not a model directory (no config.json); not replacing it");
  }
  fs::remove_all(staging, ec);
  fs::create_directories(staging, ec);
  if (ec) fail(staging.string(), ": cannot create: ", ec.message());

  {
    const fs::path config = staging / "config.json";
    std::ofstream out(config, std::ios::binary | std::ios::trunc);
    out << hf_config_json(model.args(), o.dtype).dump(2) << "\n";
    out.close();
    TESSERA_CHECK(out.good(), config.string(), ": cannot write");
  }
  std::vector<io::TensorToWrite<T>> tensors;
  std::vector<Tensor<T>> host;  // the values on the host, alive until written
  for_each_merged_parameter(model, [&](nn::Parameter<T>& p, Tensor<T> values) {
    host.push_back(std::move(values));
    tensors.push_back({hf_name(p.name),
                       std::vector<std::int64_t>(p.shape().dims.begin(), p.shape().dims.begin() + p.shape().rank),
                       std::span<const T>(host.back().data(), static_cast<std::size_t>(p.numel()))});
  });
  io::write_sharded_safetensors(staging.string(), std::move(tensors),
                                o.dtype == DType::bf16 ? io::StDtype::bf16 : io::StDtype::f32, o.max_shard_bytes,
                                {{"format", "pt"}});
  if (!o.tokenizer_file.empty()) write_hf_tokenizer(o.tokenizer_file, staging, model.args().max_seq_len);

  // Swap: the old directory moves aside, the new one in, then the old one goes.
  fs::remove_all(previous, ec);
  const bool had_previous = fs::exists(target, ec);
  if (had_previous) {
    fs::rename(target, previous, ec);
    if (ec) fail(target.string(), ": cannot move the previous save aside: ", ec.message());
  }
  fs::rename(staging, target, ec);
  if (ec) {
    const std::string why = ec.message();
    if (had_previous) fs::rename(previous, target, ec);
    fail(target.string(), ": cannot move ", staging.string(), " into place: ", why);
  }
  if (had_previous) fs::remove_all(previous, ec);
}

/// True when `path` is a directory holding a config.json (a Hugging Face model).
inline bool is_hf_directory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) &&
         std::filesystem::exists(std::filesystem::path(path) / "config.json", ec);
}

}  // namespace tessera::train
