// Sharded checkpoints (checkpoint/sharded.hpp): saved under one layout, each rank
// writing what it holds, and loaded under another, each rank reading what it holds;
// every parameter comes back bitwise. Interrupted and broken folders are refused by name.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "harness.hpp"
#include "tessera/checkpoint/sharded.hpp"
#include "tessera/comm/thread.hpp"

namespace test_sharded_checkpoint {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;
namespace fs = std::filesystem;

using Values = std::map<std::string, std::vector<float>>;
constexpr std::uint64_t kSeed = 5;

struct Layout {
  const char* name;
  comm::MeshShape shape;
};

/// Runs f(model, world) on every rank of `l`, the model made on its plan.
template <class F>
void on_layout(const Layout& l, const train::JobConfig& c, F&& f) {
  comm::run_thread_ranks(l.shape.world(), [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, l.shape);
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    f(model, world);
  }, nccl_rules());
}

/// Every parameter of `model`, whole, by name (a collective on a parallel plan).
Values whole_values(CpuDynamicModel& model) {
  Values v;
  model.with_whole_parameters([&] {
    model.for_each_parameter(
        [&](nn::Parameter<float>& p) { v[p.name] = std::vector<float>(p.value.data(), p.value.data() + p.numel()); });
  });
  return v;
}

bool same_bits(const Values& a, const Values& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, v] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != v.size() ||
        std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

TEST_CASE("sharded checkpoints: saved under each layout, loaded under others, every parameter bitwise") {
  const train::JobConfig c = debug_job(1, 1, 1);
  Values reference;
  {
    CpuDynamicModel one(c.model.args);
    one.init_weights(kSeed);
    reference = whole_values(one);
  }
  const Layout saves[] = {{"one rank", {}},
                          {"FSDP 4", {1, 1, 4, 1}},
                          {"HSDP 2x2", {1, 2, 2, 1}},
                          {"FSDP 2 x TP 2", {1, 1, 2, 2}},
                          {"PP 2 x TP 2", {2, 1, 1, 2}}};
  const Layout loads[] = {{"one rank", {}},
                          {"TP 2 x FSDP 2", {1, 1, 2, 2}},
                          {"PP 2 x FSDP 2", {2, 1, 2, 1}},
                          {"DDP 2", {1, 2, 1, 1}},
                          {"TP 4", {1, 1, 1, 4}}};
  for (const Layout& save : saves) {
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-1");
    on_layout(save, c, [&](CpuDynamicModel& model, comm::Communicator&) {
      model.init_weights(kSeed);
      train::save_sharded_model(model, folder);
    });
    // One file per rank, and the marker.
    CHECK(fs::exists(fs::path(folder) / "COMPLETE"));
    CHECK(fs::exists(fs::path(folder) / train::sharded::file_name(save.shape.world() - 1, save.shape.world())));
    for (const Layout& load : loads) {
      const std::string from = save.name, into = load.name;  // doctest prints a const char* as an address
      CAPTURE(from);
      CAPTURE(into);
      std::vector<Values> got(static_cast<std::size_t>(load.shape.world()));
      on_layout(load, c, [&](CpuDynamicModel& model, comm::Communicator& world) {
        train::load_sharded_model(model, folder);  // into a model without storage: its share only
        got[static_cast<std::size_t>(world.rank())] = whole_values(model);
      });
      for (const Values& v : got) CHECK(same_bits(v, reference));
    }
  }
}

TEST_CASE("sharded checkpoints: saved under ZBVZeroBubble's V placement, loaded under the looping one, bitwise") {
  // PP 2 x FSDP 2 by ZBV: pipeline rank 0 holds stages 0 and 3 (the embedding and the
  // output), rank 1 the middle two. Loaded by 1F1B on PP 2 (rank 0 the embedding, rank 1
  // the output) and on one rank.
  const train::JobConfig zbv =
      debug_job(1, 1, 1, {"--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"});
  const train::JobConfig c = debug_job(1, 1, 1);
  Values reference;
  {
    CpuDynamicModel one(c.model.args);
    one.init_weights(kSeed);
    reference = whole_values(one);
  }
  tessera::test::TempDir dir;
  const std::string folder = dir.file("step-1");
  on_layout({"PP 2 x FSDP 2, ZBVZeroBubble", {2, 1, 2, 1}}, zbv, [&](CpuDynamicModel& model, comm::Communicator&) {
    model.init_weights(kSeed);
    train::save_sharded_model(model, folder);
  });
  for (const Layout& load : {Layout{"one rank", {}}, Layout{"PP 2, 1F1B", {2, 1, 1, 1}}}) {
    const std::string into = load.name;
    CAPTURE(into);
    std::vector<Values> got(static_cast<std::size_t>(load.shape.world()));
    on_layout(load, c, [&](CpuDynamicModel& model, comm::Communicator& world) {
      train::load_sharded_model(model, folder);
      got[static_cast<std::size_t>(world.rank())] = whole_values(model);
    });
    for (const Values& v : got) CHECK(same_bits(v, reference));
  }
}

TEST_CASE("sharded checkpoints: an interrupted save, a missing or truncated file and another model are refused") {
  const train::JobConfig c = debug_job(1, 1, 1);
  tessera::test::TempDir dir;
  const fs::path folder = fs::path(dir.file("step-3"));
  const Layout fsdp2{"FSDP 2", {1, 1, 2, 1}};
  auto save = [&] {
    on_layout(fsdp2, c, [&](CpuDynamicModel& model, comm::Communicator&) {
      model.init_weights(kSeed);
      train::save_sharded_model(model, folder.string());
    });
  };
  auto load_error = [&](const std::string& expected, const train::JobConfig& job) {
    CpuDynamicModel model(job.model.args);
    CHECK_ERROR_CONTAINS(train::load_sharded_model(model, folder.string()), expected);
  };
  save();
  fs::remove(folder / "COMPLETE");
  load_error("no COMPLETE marker: the save that wrote this folder did not finish", c);

  save();
  fs::remove(folder / train::sharded::file_name(1, 2));
  load_error(train::sharded::file_name(1, 2) + ": missing (the checkpoint was saved by 2 ranks", c);

  save();
  fs::resize_file(folder / train::sharded::file_name(0, 2), 1000);
  load_error(train::sharded::file_name(0, 2), c);

  // A flipped byte in a tensor: its checksum names the file and the tensor.
  auto flip = [&](const fs::path& file, std::size_t at_from_end) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-static_cast<std::streamoff>(at_from_end), std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0x10);
    f.seekp(-static_cast<std::streamoff>(at_from_end), std::ios::end);
    f.put(c);
  };
  save();
  flip(folder / train::sharded::file_name(1, 2), 3);
  load_error(train::sharded::file_name(1, 2) + ": tensor '", c);
  load_error("is corrupt: its bytes have CRC-32C", c);

  // A changed digit in the index in the header (still valid JSON): refused before use.
  save();
  {
    const fs::path file = folder / train::sharded::file_name(0, 2);
    std::string bytes;
    {
      std::ifstream in(file, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    const std::size_t at = bytes.find("tessera.shapes");
    REQUIRE(at != std::string::npos);
    const std::size_t digit = bytes.find_first_of("123456789", bytes.find("[", at + 16));
    bytes[digit] = bytes[digit] == '9' ? '8' : static_cast<char>(bytes[digit] + 1);
    std::ofstream(file, std::ios::binary) << bytes;
  }
  load_error(train::sharded::file_name(0, 2) + ": the index in its header is corrupt", c);

  // A crash in the middle of a save of the same folder: the partial folder is not the
  // checkpoint, and the complete one before it still loads.
  save();
  fs::create_directories(folder.string() + ".partial");
  std::ofstream(fs::path(folder.string() + ".partial") / train::sharded::file_name(0, 2)) << "half a file";
  {
    CpuDynamicModel model(c.model.args);
    train::load_sharded_model(model, folder.string());
    CHECK_ERROR_CONTAINS(train::load_sharded_model(model, folder.string() + ".partial"), "no COMPLETE marker");
  }

  save();
  CHECK_FALSE(fs::exists(folder.string() + ".partial"));  // the next save of it cleared what the crash left
  const train::JobConfig wider = debug_job(1, 1, 1, {"--model.dim", "128"});
  load_error("is not this model", wider);

  // Saved again over the same folder: complete again, and it loads.
  save();
  CpuDynamicModel model(c.model.args);
  train::load_sharded_model(model, folder.string());
}

/// Rank 0's losses of `steps` steps on layout `shape`: resumed from `resume` first when
/// given, and saving the training state to `save` after `save_after` steps when given.
struct TrainOptions {
  train::ResumeParts parts;      // what the resume loads
  bool async = false;            // save with start_checkpoint / poll_checkpoint
  std::int64_t* steps_done = nullptr;       // rank 0's step count after the resume
  std::int64_t* data_position = nullptr;    // rank 0's data position after the resume
};

std::vector<double> train_steps(const comm::MeshShape& shape, const train::JobConfig& c, int steps,
                                const std::string& resume = "", const std::string& save = "", int save_after = 0,
                                TrainOptions o = {}) {
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
    if (world.size() > 1) omp_set_num_threads(1);  // ranks share the cores
    comm::DeviceMesh mesh(world, shape);
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    if (resume.empty() || !o.parts.model) model.init_weights(static_cast<std::uint64_t>(c.training.seed));
    data::DataLoader loader(debug_tokens(), c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                            mesh.dp_degree());
    train::Trainer<CpuDynamicModel> trainer(model, train::trainer_options(c), std::move(loader));
    if (!resume.empty()) trainer.load_checkpoint(resume, o.parts);
    if (world.rank() == 0 && o.steps_done) *o.steps_done = trainer.steps_done();
    if (world.rank() == 0 && o.data_position) *o.data_position = trainer.batches().position();
    for (int s = 0; s < steps; ++s) {
      per_rank[static_cast<std::size_t>(world.rank())].push_back(trainer.step().loss);
      if (!save.empty() && s + 1 == save_after) {
        if (o.async) trainer.start_checkpoint(save);
        else trainer.save_checkpoint(save);
      }
      if (trainer.checkpoint_pending()) trainer.poll_checkpoint(s + 1 == steps);
    }
  }, nccl_rules());
  return per_rank.front();
}

std::vector<double> tail(const std::vector<double>& v, std::size_t from) { return {v.begin() + static_cast<long>(from), v.end()}; }

TEST_CASE("training checkpoints: a run resumed on one rank is the uninterrupted run, bitwise (fp32, bf16 params, bf16 moments)") {
  const std::vector<std::vector<std::string>> variants = {
      {}, {"--training.mixed_precision_param", "bfloat16"}, {"--optimizer.state_dtype", "bfloat16"},
      {"--model.converters", "lora"}};
  for (const auto& keys : variants) {
    const std::string variant = keys.empty() ? "fp32" : keys[0] + " " + keys[1];
    CAPTURE(variant);
    const train::JobConfig c = debug_job(4, 4, 6, keys);
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-3");
    const std::vector<double> whole = train_steps({}, c, 6);
    const std::vector<double> first = train_steps({}, c, 3, "", folder, 3);
    CHECK(first == std::vector<double>(whole.begin(), whole.begin() + 3));
    CHECK(train_steps({}, c, 3, folder) == tail(whole, 3));
  }
}

/// On FSDP 2, a run saved after 2 of 4 steps under `other` and resumed under `plain`, and
/// one saved under `plain` and resumed under `other`: each the uninterrupted run under
/// `plain`, bitwise. Returns the folder the plain run saved (in `dir`).
std::string check_resumed_across(const train::JobConfig& plain, const train::JobConfig& other,
                                 const tessera::test::TempDir& dir) {
  const comm::MeshShape fsdp2{1, 1, 2, 1};
  const std::vector<double> whole = train_steps(fsdp2, plain, 4);
  const std::string saved_other = dir.file("other/step-2"), saved_plain = dir.file("plain/step-2");
  CHECK(train_steps(fsdp2, other, 2, "", saved_other, 2) == std::vector<double>(whole.begin(), whole.begin() + 2));
  CHECK(train_steps(fsdp2, plain, 2, saved_other) == tail(whole, 2));
  CHECK(train_steps(fsdp2, plain, 2, "", saved_plain, 2) == std::vector<double>(whole.begin(), whole.begin() + 2));
  CHECK(train_steps(fsdp2, other, 2, saved_plain) == tail(whole, 2));
  return saved_plain;
}

TEST_CASE("training checkpoints: saved with the shards offloaded to the host, resumed without, and back: the same run") {
  const train::JobConfig plain = debug_job(2, 4, 4, {"--training.mixed_precision_param", "bfloat16"});
  const train::JobConfig offloaded =
      debug_job(2, 4, 4, {"--training.mixed_precision_param", "bfloat16", "--training.enable_cpu_offload", "true"});
  tessera::test::TempDir dir;
  check_resumed_across(plain, offloaded, dir);
}

TEST_CASE("training checkpoints: saved under the early step, resumed without it, and back: the same run") {
  // Unit by unit in the backward (optimizer.early_step_in_backward), with no clipping:
  // the same moments and step count as the step without it.
  const std::vector<std::string> no_clip = {"--training.max_norm", "0"};
  const train::JobConfig plain = debug_job(2, 4, 4, no_clip);
  const train::JobConfig early = debug_job(2, 4, 4, with(no_clip, {"--optimizer.early_step_in_backward", "true"}));
  tessera::test::TempDir dir;
  const std::string saved_plain = check_resumed_across(plain, early, dir);
  // And on one rank, FSDP over itself, against one rank's step without it.
  CHECK(train_steps({}, early, 2, saved_plain) == train_steps({}, plain, 2, saved_plain));
}

TEST_CASE("training checkpoints: LoRA saved under TP 2, resumed under DDP 2 and on one rank: the same run") {
  // The frozen weights are saved with the model (their values), the adapters with their
  // moments; a frozen weight has no optimizer state to save or load.
  const std::vector<std::string> lora = {"--model.converters", "lora", "--lora.rank", "4", "--optimizer.lr", "1e-2"};
  const train::JobConfig whole_batch = debug_job(4, 4, 6, lora), half = debug_job(2, 4, 6, lora);
  const std::vector<double> whole = train_steps({}, whole_batch, 6);
  tessera::test::TempDir dir;
  const std::string folder = dir.file("step-3");
  const std::vector<double> first = train_steps({1, 1, 1, 2}, whole_batch, 3, "", folder, 3);
  CHECK(max_relative_difference(first, std::vector<double>(whole.begin(), whole.begin() + 3)) <= 1e-5);
  CHECK(max_relative_difference(train_steps({1, 2, 1, 1}, half, 3, folder), tail(whole, 3)) <= 1e-5);
  CHECK(max_relative_difference(train_steps({}, whole_batch, 3, folder), tail(whole, 3)) <= 1e-5);
  // A checkpoint without the adapters' state (a run without LoRA) cannot resume one with them.
  const std::string plain = dir.file("plain");
  train_steps({}, debug_job(4, 4, 6), 1, "", plain, 1);
  CHECK_ERROR_CONTAINS(train_steps({}, whole_batch, 1, plain), "lora_a");
}

TEST_CASE("training checkpoints: saved under each layout of the parity matrix, resumed under two others, the same run") {
  // Every layout the parity tests train (tests/parallel/test_parity.cpp and the tensor-,
  // pipeline- and context-parallel ones) and all of them at once, each saving after step 3 and
  // resumed under the layouts three and five places on: every kind of layout is saved
  // and resumed into others (one rank into PP x TP x FSDP and HSDP, PP 2 into one rank).
  // Under the sanitizers, three places on only: every layout still saves and loads.
  const Layout layouts[] = {{"one rank", {}},
                            {"FSDP 2", {1, 1, 2, 1}},
                            {"FSDP 4", {1, 1, 4, 1}},
                            {"PP 2 x TP 2 x FSDP 2", {2, 1, 2, 2}},
                            {"FSDP 8", {1, 1, 8, 1}},
                            {"HSDP 2x2", {1, 2, 2, 1}},
                            {"DDP 4", {1, 4, 1, 1}},
                            {"TP 2", {1, 1, 1, 2}},
                            {"FSDP 2 x TP 2", {1, 1, 2, 2}},
                            {"PP 2", {2, 1, 1, 1}},
                            {"PP 2 x TP 2", {2, 1, 1, 2}},
                            {"PP 2 x FSDP 2", {2, 1, 2, 1}},
                            {"CP 2", {1, 1, 1, 1, 2}},
                            {"CP 2 x TP 2 x FSDP 2", {1, 1, 2, 2, 2}}};
  constexpr std::int64_t kBatch = 8;  // the global batch: every data-parallel degree divides it
  auto job = [](const comm::MeshShape& s) { return debug_job(kBatch / s.dp(), kBatch, 6); };
  const std::vector<double> whole = train_steps({}, job({}), 6);
  const std::size_t n = std::size(layouts);
  for (std::size_t i = 0; i < n; ++i) {
    const Layout& save = layouts[i];
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-3");
    const std::vector<double> first = train_steps(save.shape, job(save.shape), 3, "", folder, 3);
#if TESSERA_SHORT_TESTS
    for (std::size_t offset : {3u}) {
#else
    for (std::size_t offset : {3u, 5u}) {
#endif
      const Layout& load = layouts[(i + offset) % n];
      const std::string from = save.name, into = load.name;
      CAPTURE(from);
      CAPTURE(into);
      CHECK(max_relative_difference(first, std::vector<double>(whole.begin(), whole.begin() + 3)) <= 1e-5);
      CHECK(max_relative_difference(train_steps(load.shape, job(load.shape), 3, folder), tail(whole, 3)) <= 1e-5);
    }
  }
}

TEST_CASE("training checkpoints: a model-only folder cannot resume training") {
  const train::JobConfig c = debug_job(4, 4, 1);
  tessera::test::TempDir dir;
  const std::string folder = dir.file("model");
  {
    CpuDynamicModel model(c.model.args);
    model.init_weights(1);
    train::save_sharded_model(model, folder);
  }
  CHECK_ERROR_CONTAINS(train_steps({}, c, 1, folder), "no training state in the metadata (a model-only checkpoint)");
}

TEST_CASE("sharded checkpoints: a file of another save, and a shape no tensor has, are refused by name") {
  const train::JobConfig c = debug_job(2, 4, 1);
  const comm::MeshShape fsdp2{1, 1, 2, 1};
  tessera::test::TempDir dir;
  const fs::path model = dir.file("model"), trained = dir.file("trained");
  auto save_model = [&] {
    on_layout({"FSDP 2", fsdp2}, c, [&](CpuDynamicModel& m, comm::Communicator&) {
      m.init_weights(kSeed);
      train::save_sharded_model(m, model.string());
    });
  };
  auto load_error = [&](const std::string& expected) {
    CpuDynamicModel m(c.model.args);
    CHECK_ERROR_CONTAINS(train::load_sharded_model(m, model.string()), expected);
  };
  // Rank 1's file of a training checkpoint among a model's files: a training state
  // against none (the message read a null state as an object, and nlohmann's
  // type_error escaped without a file's name).
  train_steps(fsdp2, c, 1, "", trained.string(), 1);
  save_model();
  const std::string rank1 = train::sharded::file_name(1, 2);
  fs::copy_file(trained / rank1, model / rank1, fs::copy_options::overwrite_existing);
  load_error(rank1 + ": saved at step 1 (data position ");
  load_error(train::sharded::file_name(0, 2) +
             " was saved with no training state (a model saved alone): the files come from different saves");

  // A shape whose element count overflows an int64, written into both files' indexes with
  // their CRC-32C made right: refused naming the parameter, before any count overflows.
  save_model();
  for (int r = 0; r < 2; ++r) {
    const fs::path file = model / train::sharded::file_name(r, 2);
    std::string bytes;
    {
      std::ifstream in(file, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    std::uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, bytes.data(), 8);  // little-endian, as the host
    nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_bytes));
    nlohmann::json& meta = header["__metadata__"];
    nlohmann::json shapes = nlohmann::json::parse(meta["tessera.shapes"].get<std::string>());
    shapes["norm.weight"] = {std::int64_t{1} << 40, std::int64_t{1} << 40};
    meta["tessera.shapes"] = shapes.dump();
    std::map<std::string, std::string> strings;
    for (const auto& [key, value] : meta.items()) strings[key] = value.get<std::string>();
    meta["tessera.index_crc32c"] = std::to_string(train::sharded::index_crc(strings));
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::uint64_t size = text.size();
    std::string out(8, '\0');
    std::memcpy(out.data(), &size, 8);
    out += text;
    out += bytes.substr(8 + header_bytes);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << out;
  }
  load_error("parameter 'norm.weight' has shape [1099511627776, 1099511627776], which no tensor has");
}

TEST_CASE("training checkpoints: an asynchronous save is the same checkpoint, committed once every rank wrote") {
  const train::JobConfig c = debug_job(2, 4, 6);
  const comm::MeshShape fsdp2{1, 1, 2, 1};
  const std::vector<double> whole = train_steps(fsdp2, c, 6);
  tessera::test::TempDir dir;
  const std::string folder = dir.file("step-3");
  TrainOptions async;
  async.async = true;
  // Saved after step 3 while steps 4 and 5 run; committed by a later poll.
  const std::vector<double> first = train_steps(fsdp2, c, 5, "", folder, 3, async);
  CHECK(first == std::vector<double>(whole.begin(), whole.begin() + 5));
  CHECK(fs::exists(fs::path(folder) / "COMPLETE"));
  CHECK_FALSE(fs::exists(folder + ".partial"));
  CHECK(train_steps(fsdp2, c, 3, folder) == tail(whole, 3));
}

TEST_CASE("training checkpoints: a changed setting is refused by name; excluded parts start afresh") {
  const train::JobConfig c = debug_job(4, 4, 6);
  tessera::test::TempDir dir;
  const std::string folder = dir.file("step-3");
  train_steps({}, c, 3, "", folder, 3);

  const train::JobConfig longer = debug_job(4, 4, 6, {"--training.seq_len", "16"});
  CHECK_ERROR_CONTAINS(train_steps({}, longer, 1, folder),
                       "training.seq_len was 32 when this checkpoint was saved and is 16 now");
  const train::JobConfig bf16 = debug_job(4, 4, 6, {"--training.mixed_precision_param", "bfloat16"});
  CHECK_ERROR_CONTAINS(train_steps({}, bf16, 1, folder), "training.mixed_precision_param was \"float32\"");
  const train::JobConfig wider_batch = debug_job(4, 8, 6);
  CHECK_ERROR_CONTAINS(train_steps({}, wider_batch, 1, folder), "training.global_batch_size was 4");

  // The data starts afresh: a new seq_len is allowed then, and the position is 0.
  TrainOptions fresh_data;
  fresh_data.parts = train::ResumeParts::excluding({"dataloader"});
  std::int64_t steps = -1, position = -1;
  fresh_data.steps_done = &steps;
  fresh_data.data_position = &position;
  train_steps({}, longer, 1, folder, "", 0, fresh_data);
  CHECK(steps == 3);
  CHECK(position == 0);

  // The step count starts afresh; the rest resumes.
  TrainOptions fresh_steps;
  fresh_steps.parts = train::ResumeParts::excluding({"train_state"});
  fresh_steps.steps_done = &steps;
  fresh_steps.data_position = &position;
  train_steps({}, c, 1, folder, "", 0, fresh_steps);
  CHECK(steps == 0);
  CHECK(position > 0);

  // The model and the data start afresh (from the seed, at the start), the optimizer's
  // moments resume: the first loss, before any update, is a fresh run's.
  TrainOptions fresh_model;
  fresh_model.parts = train::ResumeParts::excluding({"model", "dataloader"});
  CHECK(train_steps({}, c, 1, folder, "", 0, fresh_model).front() == train_steps({}, c, 1).front());
  CHECK_ERROR_CONTAINS(train::ResumeParts::excluding({"weights"}), "'weights' is not one of model, optimizer");
}

}  // namespace test_sharded_checkpoint
