// Hugging Face directories written by tessera: names, config.json, sharding, the
// all-or-nothing save, and loading back what was saved; and evaluation windows.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/train/evaluate.hpp"

namespace test_hf_checkpoint {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
namespace fs = std::filesystem;
using Model = nn::Transformer<float, Cpu>;

namespace {

nn::ModelArgs tiny(bool tied) {
  nn::ModelArgs a;
  a.flavor = "tiny";
  a.dim = 16, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.vocab_size = 40, a.ffn_hidden = 24;
  a.max_seq_len = 32, a.tie_embeddings = tied;
  a.rope_scaling = {true, 8.0, 1.0, 4.0, 16};
  return a;
}

using tessera::test::TempDir;

std::vector<float> values_of(Model& m) {
  std::vector<float> v;
  m.for_each_parameter([&](nn::Parameter<float>& p) { v.insert(v.end(), p.value.data(), p.value.data() + p.numel()); });
  return v;
}

}  // namespace

TEST_CASE("hf_name maps every Llama parameter and refuses others") {
  CHECK(train::hf_name("tok_embeddings.weight") == "model.embed_tokens.weight");
  CHECK(train::hf_name("layers.12.attention.wk.weight") == "model.layers.12.self_attn.k_proj.weight");
  CHECK(train::hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight");
  CHECK(train::hf_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight");
  CHECK(train::hf_name("layers.0.feed_forward.w3.weight") == "model.layers.0.mlp.up_proj.weight");
  CHECK(train::hf_name("layers.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight");
  CHECK(train::hf_name("output.weight") == "lm_head.weight");
  CHECK_ERROR_CONTAINS(train::hf_name("layers.x.attention.wq.weight"), "parameter 'layers.x.attention.wq.weight'");
  CHECK_ERROR_CONTAINS(train::hf_name("layers.0.mixer.weight"), "no Hugging Face Llama name");
}

TEST_CASE("a saved Hugging Face directory loads back bit for bit, in one file or in shards") {
  for (bool tied : {false, true}) {
    for (std::uint64_t shard_bytes : {std::uint64_t{5'000'000'000}, std::uint64_t{4000}}) {
      CAPTURE(tied);
      CAPTURE(shard_bytes);
      TempDir tmp;
      const std::string dir = (tmp.path / "hf").string();
      Model m(tiny(tied));
      m.init_weights(7);
      train::save_hf_model(m, dir, {DType::f32, shard_bytes, ""});
      const bool sharded = shard_bytes < 5'000'000'000;
      CHECK(fs::exists(fs::path(dir) / "model.safetensors.index.json") == sharded);
      CHECK(fs::exists(fs::path(dir) / "model.safetensors") == !sharded);
      CHECK_FALSE(fs::exists(dir + ".partial"));
      if (sharded) CHECK(io::ShardedSafetensors::open(dir).shard_count() > 2);

      const nn::ModelArgs back = train::read_hf_config(dir);
      CHECK(back.dim == 16);
      CHECK(back.ffn_hidden_dim() == 24);
      CHECK(back.kv_heads() == 2);
      CHECK(back.tie_embeddings == tied);
      CHECK(back.rope_scaling.enabled);
      CHECK(back.rope_scaling.original_max_position == 16);
      Model loaded(back);
      train::load_hf_model(loaded, dir);
      CHECK(values_of(loaded) == values_of(m));
      CHECK(io::ShardedSafetensors::open(dir).contains("lm_head.weight") == !tied);
    }
  }
}

TEST_CASE("LoRA: a base model loads beside fresh adapters, and exports merged, the same model") {
  parallel::Plan plan;
  plan.lora = nn::LoraPolicy{true, 3, 6.0, {}};
  TempDir tmp;
  const std::string base_dir = (tmp.path / "base").string(), merged_dir = (tmp.path / "merged").string();
  Model base(tiny(false));
  base.init_weights(5);
  train::save_hf_model(base, base_dir);
  // The base model's weights, frozen, with the adapters the seed makes (B zero: the same model).
  Model lora(tiny(false), plan);
  CHECK_ERROR_CONTAINS(train::load_hf_model(lora, base_dir), "lora_a");
  train::load_hf_model(lora, base_dir, 11);
  const std::vector<std::int32_t> ids = {1, 5, 9, 2, 7, 3, 30, 4}, targets = {5, 9, 2, 7, 3, 30, 4, 8};
  const nn::Geometry g{1, 8};
  CHECK(lora.loss(ids, targets, g) == base.loss(ids, targets, g));
  Model fresh(tiny(false), plan);
  fresh.init_weights(11);
  std::size_t adapters = 0;
  std::map<std::string, std::vector<float>> made;
  fresh.for_each_parameter([&](nn::Parameter<float>& p) { made[p.name].assign(p.value.data(), p.value.data() + p.numel()); });
  lora.for_each_parameter([&](nn::Parameter<float>& p) {
    if (!nn::is_lora_name(p.name)) return;
    ++adapters;
    CHECK_MESSAGE(std::vector<float>(p.value.data(), p.value.data() + p.numel()) == made.at(p.name), p.name);
    // Trained adapters: B away from zero, so that the merge moves the weights.
    for (std::int64_t i = 0; i < p.numel(); ++i) p.value[i] += 0.05f * static_cast<float>((i * 7 + 3) % 11 - 5);
  });
  CHECK(adapters == 2 * (7 * 2 + 1));
  // Exported merged, W + (alpha / rank) B A: a plain model loads it and computes the same loss.
  train::save_hf_model(lora, merged_dir);
  CHECK_FALSE(io::ShardedSafetensors::open(merged_dir).contains("model.layers.0.self_attn.q_proj.lora_A.weight"));
  Model merged(train::read_hf_config(merged_dir));
  train::load_hf_model(merged, merged_dir);
  const double with_adapters = lora.loss(ids, targets, g), folded = merged.loss(ids, targets, g);
  CHECK(with_adapters != base.loss(ids, targets, g));
  CHECK(std::abs(folded - with_adapters) <= 1e-5 * std::abs(with_adapters));
  // So is model.safetensors, which a plain model (llama-generate's, llama-eval's) loads.
  const std::string file = (tmp.path / "model.safetensors").string();
  train::save_model(lora, file, DType::f32);
  Model plain(tiny(false));
  train::load_model(plain, file);
  CHECK(values_of(plain) == values_of(merged));
  // And a LoRA run may start from it: fresh adapters beside it, the merged model's loss.
  Model again(tiny(false), plan);
  train::load_model(again, file, 11);
  CHECK(again.loss(ids, targets, g) == plain.loss(ids, targets, g));
}

TEST_CASE("bfloat16 export rounds each weight once") {
  TempDir tmp;
  const std::string dir = (tmp.path / "hf").string();
  Model m(tiny(false));
  m.init_weights(3);
  train::save_hf_model(m, dir, {DType::bf16, 5'000'000'000ull, ""});
  Model loaded(train::read_hf_config(dir));
  train::load_hf_model(loaded, dir);
  const auto a = values_of(m), b = values_of(loaded);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(b[i] == static_cast<float>(bf16(a[i])));
  std::ifstream in(fs::path(dir) / "config.json");
  CHECK(nlohmann::json::parse(in).at("torch_dtype") == "bfloat16");
}

TEST_CASE("saving over a directory replaces it whole, and never over a folder that is not a model") {
  TempDir tmp;
  const std::string dir = (tmp.path / "hf").string();
  Model m(tiny(false));
  m.init_weights(1);
  train::save_hf_model(m, dir, {DType::f32, 4000, ""});  // sharded first
  REQUIRE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  m.init_weights(2);
  train::save_hf_model(m, dir, {});  // then one file: no stale shards or index remain
  CHECK_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().rfind("model-", 0) != 0);
  Model loaded(train::read_hf_config(dir));
  train::load_hf_model(loaded, dir);
  CHECK(values_of(loaded) == values_of(m));

  const fs::path precious = tmp.path / "notes";
  fs::create_directories(precious);
  std::ofstream(precious / "todo.txt") << "keep me";
  CHECK_ERROR_CONTAINS(train::save_hf_model(m, precious.string(), {}), "is not a model directory");
  CHECK(fs::exists(precious / "todo.txt"));
}

TEST_CASE("read_hf_config: unsupported settings are named") {
  TempDir tmp;
  auto write = [&](const std::string& text) {
    std::ofstream(tmp.path / "config.json") << text;
    return tmp.path.string();
  };
  const std::string base =
      R"("hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10)";
  CHECK(train::read_hf_config(write("{" + base + "}")).kv_heads() == 4);
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "model_type": "mistral"})")), "model_type \"mistral\"");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "hidden_act": "gelu"})")), "hidden_act \"gelu\"");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "attention_bias": true})")), "attention_bias = true");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "head_dim": 8})")), "head_dim 8 differs");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "rope_scaling": {"rope_type": "yarn"}})")),
                       "rope_scaling.rope_type' = \"yarn\" is not supported");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8}})")),
                       "rope_scaling.low_freq_factor' is missing");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write(R"({"hidden_size": 16})")), "key 'intermediate_size' is missing");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base + R"(, "num_key_value_heads": "2"})")),
                       "key 'num_key_value_heads': expected a positive integer");
  CHECK_ERROR_CONTAINS(train::read_hf_config(write("{" + base)), "config.json: not valid JSON");
  // transformers 5 keeps rope_theta and the scaling together in rope_parameters.
  const nn::ModelArgs v5 = train::read_hf_config(write("{" + base + R"(, "rope_parameters": {"rope_type": "llama3",
      "rope_theta": 250000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}})"));
  CHECK(v5.rope_theta == 250000.0);
  CHECK(v5.rope_scaling.enabled);
  CHECK(v5.rope_scaling.factor == 32.0);
}

TEST_CASE("evaluate: consecutive windows, each predicting its own next tokens") {
  Model m(tiny(false));
  m.init_weights(5);
  std::vector<std::uint32_t> tokens(23);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7 + 3) % 40);
  // Windows of 5: four full ones (4 predictions each) and a last one of 3 tokens (2).
  const train::EvalResult r = train::evaluate(m, tokens, 5, 3, "tokens");
  CHECK(r.tokens == 4 * 4 + 2);
  double expected = 0;
  for (std::size_t start = 0; start + 1 < tokens.size(); start += 5) {
    const std::size_t len = std::min<std::size_t>(5, tokens.size() - start);
    std::vector<std::int32_t> in(tokens.begin() + start, tokens.begin() + start + len - 1);
    std::vector<std::int32_t> tg(tokens.begin() + start + 1, tokens.begin() + start + len);
    expected += m.loss(in, tg, nn::Geometry{1, static_cast<std::int64_t>(len - 1)});
  }
  CHECK(r.loss_sum == doctest::Approx(expected).epsilon(1e-6));
  CHECK(r.perplexity() == doctest::Approx(std::exp(expected / 18)).epsilon(1e-6));
  // The batch size changes nothing but speed.
  CHECK(train::evaluate(m, tokens, 5, 1, "tokens").loss_sum == doctest::Approx(r.loss_sum).epsilon(1e-6));
  tokens[9] = 40;
  CHECK_ERROR_CONTAINS(train::evaluate(m, tokens, 5, 3, "tokens.u32"), "tokens.u32: token id 40 at index 9");
  CHECK_ERROR_CONTAINS(train::evaluate(m, tokens, 1, 3, "t"), "windows of 1 tokens make no prediction");
}

}  // namespace test_hf_checkpoint
