// Parity with Hugging Face transformers.
//
// tools/make_fixtures.py saved tiny random-weight Llama models with LlamaForCausalLM
// (tests/fixtures/hf/<variant>/: config.json and safetensors) and, in
// reference.safetensors, one batch (input_ids, targets already shifted) with the logits,
// the mean loss and the gradient of that loss for every parameter, as PyTorch computed
// them. Here the same directories go through the Hugging Face loader into
// nn::Transformer<float, Cpu>, which must reproduce every tensor:
//
//   max_i |tessera_i - reference_i| <= 1e-5 * max_i |reference_i|     (per tensor)
//
// A failure names the variant, the tensor and its worst element. docs/parity.md lists the
// variants and what each one exercises.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/instances.hpp"
#include "tessera/io/safetensors.hpp"
#include "tessera/io/sharded_safetensors.hpp"
#include "tessera/nn/transformer.hpp"

namespace test_hf_parity {  // unity build: this file's names stay in here (tests/meson.build)

#ifndef TESSERA_FIXTURES
#error "TESSERA_FIXTURES must name the tests/fixtures folder (tests/parity/meson.build defines it)"
#endif

namespace fs = std::filesystem;
using namespace tessera;
using Model = nn::Transformer<float, Cpu>;

namespace {

constexpr double kRelTolerance = 1e-5;
constexpr std::int32_t kIgnore = -100;

std::string hf_dir(const std::string& variant) { return (fs::path(TESSERA_FIXTURES) / "hf" / variant).string(); }

std::vector<std::int64_t> dims_of(const Shape& s) { return {s.dims.begin(), s.dims.begin() + s.rank}; }

/// "[b, t, v]" for flat index i of a row-major tensor of `shape`.
std::string index_str(std::size_t i, const std::vector<std::int64_t>& shape) {
  if (shape.empty()) return "[]";
  std::vector<std::int64_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    idx[d] = static_cast<std::int64_t>(i % static_cast<std::size_t>(shape[d]));
    i /= static_cast<std::size_t>(shape[d]);
  }
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

struct Comparison {
  std::string tensor;
  bool ok = true;
  double ratio = 0;  // max |a - b| / max |b|
  std::string message;
};

/// Compares `got` (tessera) with `want` (the reference) under the per-tensor rule above.
Comparison compare(const std::string& variant, const std::string& tensor, std::span<const float> got,
                   std::span<const float> want, const std::vector<std::int64_t>& shape) {
  Comparison c;
  c.tensor = tensor;
  if (got.size() != want.size()) {
    c.ok = false;
    c.message = variant + ": " + tensor + ": tessera has " + std::to_string(got.size()) +
                " elements, the reference " + std::to_string(want.size());
    return c;
  }
  double scale = 0;
  for (float w : want) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  double worst = -1;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double d = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (std::isnan(d)) d = std::numeric_limits<double>::infinity();
    if (d > worst) worst = d, at = i;
  }
  if (got.empty()) return c;
  const double allowed = kRelTolerance * scale;
  c.ok = worst <= allowed;
  c.ratio = scale > 0 ? worst / scale : (worst > 0 ? std::numeric_limits<double>::infinity() : 0.0);
  std::ostringstream m;
  m << std::setprecision(9) << variant << ": " << tensor << ": max |tessera - hf| = " << worst << " at "
    << index_str(at, shape) << " (tessera " << got[at] << ", hf " << want[at] << "), allowed " << kRelTolerance
    << " * max|hf| = " << allowed << " (ratio " << std::setprecision(3) << c.ratio << ")";
  c.message = m.str();
  return c;
}

/// reference.safetensors of one variant.
struct Reference {
  io::SafetensorsFile file;
  nn::Geometry g;
  std::vector<std::int32_t> inputs, targets;

  explicit Reference(const std::string& dir) : file(io::SafetensorsFile::open(dir + "/reference.safetensors")) {
    const auto& shape = file.entry("input_ids").shape;
    REQUIRE(shape.size() == 2);
    REQUIRE(file.entry("targets").shape == shape);
    g = nn::Geometry{shape[0], shape[1]};
    inputs = ints("input_ids");
    targets = ints("targets");
  }

  std::vector<std::int32_t> ints(const std::string& name) const {
    const auto& e = file.entry(name);
    std::vector<std::int32_t> v(static_cast<std::size_t>(e.numel()));
    file.read(name, std::span<std::int32_t>(v), e.shape);
    return v;
  }
  std::vector<float> floats(const std::string& name) const {
    const auto& e = file.entry(name);
    std::vector<float> v(static_cast<std::size_t>(e.numel()));
    file.read(name, std::span<float>(v), e.shape);
    return v;
  }
  const std::vector<std::int64_t>& shape(const std::string& name) const { return file.entry(name).shape; }

  std::int64_t target_count() const {
    return std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t != kIgnore; });
  }
};

/// Logits, loss (with and without gradients) and every gradient of the model loaded
/// from `dir`, compared with `dir`'s reference.
std::vector<Comparison> compare_with_reference(const std::string& variant, const std::string& dir, Model& model) {
  const Reference ref(dir);
  std::vector<Comparison> out;

  Tensor<float> logits = model.logits(ref.inputs, ref.g);
  out.push_back(compare(variant, "logits", {logits.data(), static_cast<std::size_t>(logits.numel())},
                        ref.floats("logits"), ref.shape("logits")));

  const std::int64_t count = ref.target_count();
  REQUIRE(count > 0);
  REQUIRE(count < ref.g.rows());  // the batch has ignored targets, so -100 handling is exercised
  const std::vector<float> want_loss = ref.floats("loss");
  const float no_grad_loss = static_cast<float>(model.loss(ref.inputs, ref.targets, ref.g) / static_cast<double>(count));
  out.push_back(compare(variant, "loss (no gradients)", {&no_grad_loss, 1}, want_loss, {}));

  model.zero_grad();
  const double sum = model.forward_backward(ref.inputs, ref.targets, ref.g, 1.0 / static_cast<double>(count));
  const float loss = static_cast<float>(sum / static_cast<double>(count));
  out.push_back(compare(variant, "loss", {&loss, 1}, want_loss, {}));

  std::set<std::string> unmatched;
  for (const auto& e : ref.file.tensors())
    if (e.name.starts_with("grad.")) unmatched.insert(e.name);
  model.for_each_parameter([&](nn::Parameter<float>& p) {
    const std::string name = "grad." + train::hf_name(p.name);
    if (!ref.file.contains(name)) {
      out.push_back({name, false, 0, variant + ": the reference has no " + name + " for tessera's " + p.name});
      return;
    }
    unmatched.erase(name);
    out.push_back(compare(variant, name + " (" + p.name + ")", {p.grad.data(), static_cast<std::size_t>(p.numel())},
                          ref.floats(name), ref.shape(name)));
  });
  for (const std::string& name : unmatched)
    out.push_back({name, false, 0, variant + ": reference gradient " + name + " matches no tessera parameter"});
  return out;
}

void check_parity(const std::string& variant) {
  const std::string dir = hf_dir(variant);
  Model model(train::read_hf_config(dir));
  train::load_hf_model(model, dir);
  const std::vector<Comparison> results = compare_with_reference(variant, dir, model);
  CHECK(results.size() > 3);
  const Comparison* worst = &results.front();
  for (const Comparison& c : results) {
    CHECK_MESSAGE(c.ok, c.message);
    if (c.ratio > worst->ratio) worst = &c;
  }
  MESSAGE(variant, ": ", results.size(), " tensors within ", kRelTolerance, " * max|hf|; closest to the limit: ",
          worst->tensor, " at ", worst->ratio, " * max|hf|");
}

using tessera::test::TempDir;

/// A copy of a fixture directory (model files only) to modify.
std::string copy_fixture(const std::string& variant, const TempDir& tmp) {
  const fs::path to = tmp.path / variant;
  fs::copy(hf_dir(variant), to, fs::copy_options::recursive);
  fs::remove(to / "reference.safetensors");
  return to.string();
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open ", path);
  return nlohmann::json::parse(in);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(2) << "\n";
  REQUIRE(out.good());
}

/// Rewrites `path` (float32 tensors) without the tensor `drop`.
void rewrite_without(const std::string& path, const std::string& drop) {
  io::SafetensorsWriter w;
  {
    const auto file = io::SafetensorsFile::open(path);
    REQUIRE(file.contains(drop));
    for (const auto& e : file.tensors()) {
      if (e.name == drop) continue;
      std::vector<float> v(static_cast<std::size_t>(e.numel()));
      file.read(e.name, std::span<float>(v), e.shape);
      w.add(e.name, io::StDtype::f32, e.shape, std::span<const float>(v));
    }
  }
  w.set_metadata("format", "pt");
  w.write(path);
}

/// Loads `dir` into a model built from its config.json.
void load(const std::string& dir) {
  Model model(train::read_hf_config(dir));
  train::load_hf_model(model, dir);
}

}  // namespace

TEST_CASE("config.json of each fixture maps onto the model arguments") {
  // llama2 and llama3_1 spell RoPE the way published checkpoints do (rope_theta and
  // rope_scaling at the top level); llama3 and llama3_2_tied the way transformers 5 does
  // (rope_parameters).
  const nn::ModelArgs l2 = train::read_hf_config(hf_dir("llama2"));
  CHECK(l2.dim == 48);
  CHECK(l2.n_layers == 2);
  CHECK(l2.n_heads == 4);
  CHECK(l2.kv_heads() == 4);
  CHECK(l2.ffn_hidden_dim() == 88);  // not Meta's rounding rule's 256: read from config.json
  CHECK(l2.vocab_size == 160);
  CHECK(l2.norm_eps == 1e-6);
  CHECK(l2.rope_theta == 10000.0);
  CHECK_FALSE(l2.rope_scaling.enabled);
  CHECK_FALSE(l2.tie_embeddings);

  const nn::ModelArgs l3 = train::read_hf_config(hf_dir("llama3"));
  CHECK(l3.kv_heads() == 2);
  CHECK(l3.ffn_hidden_dim() == 100);
  CHECK(l3.vocab_size == 200);
  CHECK(l3.norm_eps == 1e-5);
  CHECK(l3.rope_theta == 500000.0);
  CHECK_FALSE(l3.rope_scaling.enabled);

  const nn::ModelArgs l31 = train::read_hf_config(hf_dir("llama3_1"));
  CHECK(l31.kv_heads() == 1);
  CHECK(l31.rope_theta == 500000.0);
  CHECK(l31.rope_scaling.enabled);
  CHECK(l31.rope_scaling.factor == 8.0);
  CHECK(l31.rope_scaling.low_freq_factor == 1.0);
  CHECK(l31.rope_scaling.high_freq_factor == 4.0);
  CHECK(l31.rope_scaling.original_max_position == 64);

  const nn::ModelArgs l32 = train::read_hf_config(hf_dir("llama3_2_tied"));
  CHECK(l32.dim == 32);
  CHECK(l32.tie_embeddings);
  CHECK(l32.rope_theta == 500000.0);
  CHECK(l32.rope_scaling.enabled);
  CHECK(l32.rope_scaling.factor == 32.0);
  CHECK(l32.rope_scaling.original_max_position == 256);

  const nn::ModelArgs bf = train::read_hf_config(hf_dir("llama3_bf16"));
  CHECK(bf.num_params() == l3.num_params());
  CHECK(bf.rope_theta == l3.rope_theta);
}

TEST_CASE("Llama 2 (multi-head attention, sharded safetensors) matches Hugging Face") { check_parity("llama2"); }

TEST_CASE("Llama 3 (grouped-query attention) matches Hugging Face") { check_parity("llama3"); }

TEST_CASE("Llama 3.1 (rope_scaling llama3, one kv head) matches Hugging Face") { check_parity("llama3_1"); }

TEST_CASE("Llama 3.2 (tied embeddings) matches Hugging Face") { check_parity("llama3_2_tied"); }

TEST_CASE("Llama 3 stored in bfloat16 matches Hugging Face run on the same weights") {
  check_parity("llama3_bf16");
}

TEST_CASE("The sharded fixture is read through its index") {
  const std::string dir = hf_dir("llama2");
  CHECK(fs::exists(fs::path(dir) / io::kSafetensorsIndex));
  CHECK_FALSE(fs::exists(fs::path(dir) / io::kSafetensorsSingle));
  const auto st = io::ShardedSafetensors::open(dir);
  CHECK(st.shard_count() == 3);
  // The loaded model holds each tensor exactly as its shard stores it.
  Model model(train::read_hf_config(dir));
  train::load_hf_model(model, dir);
  std::set<std::string> shards;
  model.for_each_parameter([&](nn::Parameter<float>& p) {
    const std::string name = train::hf_name(p.name);
    const io::SafetensorsFile& file = st.file_of(name);
    shards.insert(file.path());
    std::vector<float> stored(static_cast<std::size_t>(p.numel()));
    file.read(name, std::span<float>(stored), dims_of(p.shape()));
    CHECK_MESSAGE(std::equal(stored.begin(), stored.end(), p.value.data()), name, " differs from ", file.path());
  });
  CHECK(shards.size() == 3);
}

TEST_CASE("BF16 weights load as the float32 weights rounded to bfloat16") {
  const std::string dir16 = hf_dir("llama3_bf16"), dir32 = hf_dir("llama3");
  const auto st = io::ShardedSafetensors::open(dir16);
  for (const std::string& name : st.names()) CHECK_MESSAGE(st.entry(name).dtype == io::StDtype::bf16, name);

  Model m16(train::read_hf_config(dir16)), m32(train::read_hf_config(dir32));
  train::load_hf_model(m16, dir16);
  train::load_hf_model(m32, dir32);
  std::vector<std::vector<float>> rounded;
  m32.for_each_parameter([&](nn::Parameter<float>& p) {
    std::vector<float> r(static_cast<std::size_t>(p.numel()));
    for (std::size_t i = 0; i < r.size(); ++i) r[i] = static_cast<float>(bf16(p.value.data()[i]));
    rounded.push_back(std::move(r));
  });
  std::size_t k = 0, changed = 0;
  m16.for_each_parameter([&](nn::Parameter<float>& p) {
    REQUIRE(k < rounded.size());
    const std::vector<float>& want = rounded[k++];
    REQUIRE(want.size() == static_cast<std::size_t>(p.numel()));
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (std::bit_cast<std::uint32_t>(p.value.data()[i]) != std::bit_cast<std::uint32_t>(want[i]) && bad++ == 0) first = i;
    }
    CHECK_MESSAGE(bad == 0, "llama3_bf16: ", p.name, ": ", bad, " elements differ from bf16(float32 weight), first at ",
                  first, ": loaded ", p.value.data()[first], ", expected ", want[first]);
  });
  CHECK(k == rounded.size());
  // The rounding is real: the fp32 weights are not already bf16 values.
  k = 0;
  m32.for_each_parameter([&](nn::Parameter<float>& p) {
    const std::vector<float>& r = rounded[k++];
    for (std::size_t i = 0; i < r.size(); ++i) changed += r[i] != p.value.data()[i];
  });
  CHECK(changed > 1000);
}

TEST_CASE("The comparison fails for a model that is not the reference's") {
  // Without Llama 3.1's frequency scaling the logits move far beyond the tolerance: the
  // fixture exercises the scaling, and the comparison can fail.
  {
    const std::string dir = hf_dir("llama3_1");
    nn::ModelArgs a = train::read_hf_config(dir);
    a.rope_scaling.enabled = false;
    Model model(a);
    train::load_hf_model(model, dir);
    const auto results = compare_with_reference("llama3_1 without rope scaling", dir, model);
    CHECK_FALSE(results.front().ok);  // logits
    CHECK(results.front().ratio > 1e-3);
    CHECK(results.front().message.find("llama3_1 without rope scaling: logits: max |tessera - hf|") == 0);
  }
  // Llama 2's norm epsilon (1e-6) matters too.
  {
    const std::string dir = hf_dir("llama2");
    nn::ModelArgs a = train::read_hf_config(dir);
    a.norm_eps = 1e-5;
    Model model(a);
    train::load_hf_model(model, dir);
    const auto results = compare_with_reference("llama2 with eps 1e-5", dir, model);
    CHECK_FALSE(results.front().ok);
  }
}

TEST_CASE("Loader errors name the file and the tensor") {
  TempDir tmp;

  SUBCASE("a tensor missing from model.safetensors") {
    const std::string dir = copy_fixture("llama3", tmp);
    rewrite_without(dir + "/model.safetensors", "model.layers.1.mlp.up_proj.weight");
    CHECK_ERROR_CONTAINS(load(dir), dir);
    CHECK_ERROR_CONTAINS(load(dir), "'model.layers.1.mlp.up_proj.weight'");
    CHECK_ERROR_CONTAINS(load(dir), "missing");
  }
  SUBCASE("a tensor shaped otherwise than config.json says") {
    const std::string dir = copy_fixture("llama3", tmp);
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["num_key_value_heads"] = 4;  // k_proj and v_proj would be (48, 48); the file has (24, 48)
    write_json(dir + "/config.json", cfg);
    CHECK_ERROR_CONTAINS(load(dir), dir + "/model.safetensors");
    CHECK_ERROR_CONTAINS(load(dir), "'model.layers.0.self_attn.k_proj.weight' has shape [24, 48]");
    CHECK_ERROR_CONTAINS(load(dir), "[48, 48]");
  }
  SUBCASE("a tensor config.json has no place for") {
    const std::string dir = copy_fixture("llama3", tmp);
    nlohmann::json cfg = read_json(dir + "/config.json");
    cfg["num_hidden_layers"] = 1;
    write_json(dir + "/config.json", cfg);
    CHECK_ERROR_CONTAINS(load(dir), dir + "/model.safetensors");
    CHECK_ERROR_CONTAINS(load(dir), "'model.layers.1.");
    CHECK_ERROR_CONTAINS(load(dir), "has no place");
  }
  SUBCASE("a shard the index names is missing") {
    const std::string dir = copy_fixture("llama2", tmp);
    fs::remove(fs::path(dir) / "model-00002-of-00003.safetensors");
    CHECK_ERROR_CONTAINS(load(dir), dir + "/model.safetensors.index.json");
    CHECK_ERROR_CONTAINS(load(dir), "'model-00002-of-00003.safetensors'");
    CHECK_ERROR_CONTAINS(load(dir), "missing");
  }
  SUBCASE("a tensor missing from the index") {
    const std::string dir = copy_fixture("llama2", tmp);
    nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
    REQUIRE(index["weight_map"].erase("model.norm.weight") == 1);
    write_json(dir + "/model.safetensors.index.json", index);
    CHECK_ERROR_CONTAINS(load(dir), dir);
    CHECK_ERROR_CONTAINS(load(dir), "'model.norm.weight'");
    CHECK_ERROR_CONTAINS(load(dir), "missing");
  }
  SUBCASE("the index puts a tensor in the wrong shard") {
    const std::string dir = copy_fixture("llama2", tmp);
    nlohmann::json index = read_json(dir + "/model.safetensors.index.json");
    const std::string right = index["weight_map"]["lm_head.weight"];
    const std::string wrong = right == "model-00001-of-00003.safetensors" ? "model-00002-of-00003.safetensors"
                                                                          : "model-00001-of-00003.safetensors";
    index["weight_map"]["lm_head.weight"] = wrong;
    write_json(dir + "/model.safetensors.index.json", index);
    CHECK_ERROR_CONTAINS(load(dir), "model.safetensors.index.json");
    CHECK_ERROR_CONTAINS(load(dir), "'lm_head.weight' in " + wrong);
  }
}

}  // namespace test_hf_parity
