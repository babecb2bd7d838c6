// Tests of the job configuration: defaults, TOML parsing, command-line overrides, every
// error message, the to_toml round trip, model overrides, and the shipped example configs.
#include "tessera/train/config.hpp"

#include "tessera/io/tokenizer.hpp"
#include "tessera/train/dataset.hpp"
#include "tessera/train/trainer.hpp"  // make_plan: the split points reach the parallel plan

#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace test_config {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using tessera::train::JobConfig;
using tessera::train::load_config;
using tessera::train::parse_config;
using tessera::train::to_toml;
using Args = std::vector<std::string>;

using tessera::testing::error_of;

/// The error thrown by `expr` is one line and contains every one of the given parts.
#define CHECK_ERROR(expr, ...)                                                   \
  do {                                                                           \
    std::string message_ = error_of([&] { (void)(expr); });                      \
    INFO("error: " << message_);                                                 \
    CHECK(message_.find('\n') == std::string::npos);                             \
    for (const std::string& part_ : std::initializer_list<std::string>{__VA_ARGS__}) \
      CHECK_MESSAGE(message_.find(part_) != std::string::npos, "missing: " << part_); \
  } while (0)

JobConfig parse(const std::string& text, const Args& args = {}) { return parse_config(text, "job.toml", args); }

using tessera::test::TempDir;

/// The source tree: TESSERA_SOURCE_DIR when the build defines it, else found from this
/// file's path (tests/train/test_config.cpp), which may be relative to the build folder.
fs::path source_dir() {
#ifdef TESSERA_SOURCE_DIR
  return fs::path(TESSERA_SOURCE_DIR);
#else
  const fs::path file(__FILE__);
  const fs::path marker = fs::path("tests") / "train" / "test_config.cpp";
  auto root_of = [](const fs::path& f) { return fs::weakly_canonical(f).parent_path().parent_path().parent_path(); };
  if (fs::exists(file)) return root_of(file);
  // A relative __FILE__ (relative to the build folder): try it from each folder above the
  // current one and above the test executable.
  std::error_code ec;
  std::vector<fs::path> starts = {fs::current_path()};
  if (fs::path exe = fs::read_symlink("/proc/self/exe", ec); !ec) starts.push_back(exe.parent_path());
  for (const auto& start : starts) {
    for (fs::path dir = start;; dir = dir.parent_path()) {
      if (fs::exists(dir / file)) return root_of(dir / file);
      if (fs::exists(dir / marker)) return dir;
      if (dir == dir.parent_path()) break;
    }
  }
  return {};
#endif
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("defaults follow torchtitan") {
  const JobConfig c;
  CHECK(c.job.dump_folder == "./outputs");
  CHECK(c.job.description.empty());
  CHECK_FALSE(c.job.print_config);
  CHECK(c.model.flavor == "debugmodel");
  CHECK_FALSE(c.model.dim.has_value());
  CHECK_FALSE(c.model.tie_embeddings.has_value());
  CHECK(c.model.tokenizer == "byte");
  CHECK(c.optimizer.name == "AdamW");
  CHECK(c.optimizer.lr == 8e-4);
  CHECK(c.optimizer.eps == 1e-8);
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK(c.optimizer.beta1 == 0.9);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.state_dtype == "float32");
  CHECK(c.lr_scheduler.warmup_steps == 200);
  CHECK_FALSE(c.lr_scheduler.decay_ratio.has_value());
  CHECK(c.lr_scheduler.decay_type == "linear");
  CHECK(c.lr_scheduler.min_lr_factor == 0.0);
  CHECK(c.training.local_batch_size == 8);
  CHECK(c.training.global_batch_size == -1);
  CHECK(c.training.seq_len == 2048);
  CHECK(c.training.steps == 10000);
  CHECK(c.training.max_norm == 1.0);
  CHECK(c.training.seed == 0);
  CHECK_FALSE(c.training.deterministic);
  CHECK(c.training.mixed_precision_param == "auto");  // the model's own type: nothing rounded unless asked
  CHECK(c.training.mixed_precision_reduce == "float32");
  CHECK(c.training.dataset == "synthetic");
  CHECK(c.training.dataset_path.empty());
  CHECK(c.training.synthetic_documents == 20000);
  CHECK(c.parallelism.data_parallel_replicate_degree == 1);
  CHECK(c.parallelism.data_parallel_shard_degree == -1);
  CHECK(c.parallelism.tensor_parallel_degree == 1);
  CHECK(c.parallelism.pipeline_parallel_degree == 1);
  CHECK(c.parallelism.context_parallel_degree == 1);
  CHECK_FALSE(c.parallelism.disable_loss_parallel);
  CHECK_FALSE(c.parallelism.disable_sequence_parallel);
  CHECK(c.parallelism.pipeline_parallel_schedule == "1F1B");
  CHECK(c.parallelism.pipeline_parallel_microbatch_size == 1);
  CHECK(c.parallelism.fsdp_reshard_after_forward == "default");
  CHECK(c.parallelism.pipeline_parallel_split_points.empty());
  CHECK(c.activation_checkpoint.mode == "none");
  CHECK(c.activation_checkpoint.selective_ac_option == "2");
  CHECK_FALSE(c.checkpoint.enable);
  CHECK(c.checkpoint.folder == "checkpoint");
  CHECK(c.checkpoint.interval == 500);
  CHECK(c.checkpoint.last_save_model_only);
  CHECK(c.checkpoint.export_dtype == "float32");
  CHECK(c.checkpoint.keep_latest_k == 10);
  CHECK(c.checkpoint.initial_load_path.empty());
  CHECK(c.metrics.log_freq == 10);
  CHECK_FALSE(c.metrics.enable_tensorboard);
  CHECK(c.metrics.save_tb_folder == "tb");
  CHECK(c.metrics.peak_tflops == 0.0);

  // An empty file, and no file at all, give the defaults with debugmodel resolved.
  for (const JobConfig& loaded : {parse(""), load_config("", {})}) {
    CHECK(loaded == c);
    CHECK(loaded.model.args.flavor == "debugmodel");
    CHECK(loaded.model.args.dim == 256);
    CHECK(loaded.model.args.n_layers == 6);
    CHECK(loaded.model.args.n_heads == 16);
    CHECK(loaded.model.args.vocab_size == 260);
  }
}

TEST_CASE("the key table is consistent") {
  const auto& keys = tessera::train::config_keys();
  CHECK(keys.size() == 127);
  std::set<std::string_view> names;
  for (const auto& k : keys) {
    INFO(k.name);
    CHECK(names.insert(k.name).second);
    CHECK(k.name.find('.') != std::string_view::npos);
    CHECK_FALSE(k.help.empty());
    CHECK(k.optional == !k.unset_means.empty());
    CHECK(tessera::train::find_config_key(k.name) == &k);
    // Every default is accepted by its own rules.
    CHECK_NOTHROW(tessera::train::detail::check_key(k, JobConfig{}, "defaults"));
  }
  CHECK(tessera::train::find_config_key("training.nope") == nullptr);
  CHECK(tessera::train::config_sections() ==
        std::vector<std::string_view>{"job", "model", "optimizer", "lr_scheduler", "training", "parallelism",
                                      "activation_checkpoint", "float8", "lora", "checkpoint", "metrics", "profiling", "validation", "comm",
                                      "compile", "debug"});
}

TEST_CASE("[comm]: the timeouts, positive seconds") {
  const JobConfig d;
  CHECK(d.comm.init_timeout_seconds == 300);
  CHECK(d.comm.train_timeout_seconds == 600);
  CHECK_FALSE(d.comm.check_nccl_semantics);
  CHECK(parse("[comm]\ncheck_nccl_semantics = true\n").comm.check_nccl_semantics);
  const JobConfig c = parse("[comm]\ninit_timeout_seconds = 60\n", {"--comm.train_timeout_seconds", "120"});
  CHECK(c.comm.init_timeout_seconds == 60);
  CHECK(c.comm.train_timeout_seconds == 120);
  CHECK_ERROR(parse("", {"--comm.train_timeout_seconds", "0"}), "command line", "comm.train_timeout_seconds");
  CHECK_ERROR(parse("[comm]\ninit_timeout_seconds = -1\n"), "comm.init_timeout_seconds");
}

TEST_CASE("each type parses from TOML") {
  auto c = parse(R"(
[job]
description = "a \"quoted\" job"
print_config = true
[optimizer]
lr = 3e-4
eps = 1          # an integer is fine for a float key
[lr_scheduler]
decay_ratio = 0.25
[training]
steps = 123
seed = 7
deterministic = true
global_batch_size = 64
[model]
n_layers = 2
rope_theta = 10000
tie_embeddings = true
)");
  CHECK(c.job.description == "a \"quoted\" job");
  CHECK(c.job.print_config);
  CHECK(c.optimizer.lr == 3e-4);
  CHECK(c.optimizer.eps == 1.0);
  REQUIRE(c.lr_scheduler.decay_ratio.has_value());
  CHECK(*c.lr_scheduler.decay_ratio == 0.25);
  CHECK(c.training.steps == 123);
  CHECK(c.training.seed == 7);
  CHECK(c.training.deterministic);
  CHECK(c.training.global_batch_size == 64);
  CHECK(c.model.n_layers == 2);
  CHECK(c.model.args.n_layers == 2);
  CHECK(c.model.args.rope_theta == 10000.0);
  CHECK(c.model.args.tie_embeddings);
  CHECK(c.model.args.dim == 256);  // untouched fields keep the flavor's value
}

TEST_CASE("command-line overrides") {
  const std::string file = "[training]\nsteps = 100\nseed = 3\n[checkpoint]\nenable = false\n";

  SUBCASE("both forms, and precedence over the file") {
    auto c = parse(file, {"--training.steps", "5", "--optimizer.lr=0.01", "--job.description=a b=c"});
    CHECK(c.training.steps == 5);
    CHECK(c.training.seed == 3);  // the file's value where no override
    CHECK(c.optimizer.lr == 0.01);
    CHECK(c.job.description == "a b=c");
  }
  SUBCASE("the last override wins") {
    CHECK(parse(file, {"--training.steps", "5", "--training.steps=6"}).training.steps == 6);
  }
  SUBCASE("negative numbers are values, not options") {
    auto c = parse("", {"--training.max_norm", "-1", "--parallelism.data_parallel_shard_degree", "-1"});
    CHECK(c.training.max_norm == -1.0);
    CHECK(c.parallelism.data_parallel_shard_degree == -1);
  }
  SUBCASE("booleans: bare flag, explicit value, = form") {
    CHECK(parse(file, {"--checkpoint.enable"}).checkpoint.enable);
    auto c = parse(file, {"--checkpoint.enable", "--training.deterministic"});
    CHECK(c.checkpoint.enable);
    CHECK(c.training.deterministic);
    CHECK_FALSE(parse("[checkpoint]\nenable = true\n", {"--checkpoint.enable", "false"}).checkpoint.enable);
    CHECK_FALSE(parse("[checkpoint]\nenable = true\n", {"--checkpoint.enable=false"}).checkpoint.enable);
    CHECK(parse(file, {"--checkpoint.enable", "true", "--training.steps", "9"}).checkpoint.enable);
  }
  SUBCASE("optional keys: set and unset") {
    auto c = parse("[lr_scheduler]\ndecay_ratio = 0.5\n", {"--model.n_layers", "3"});
    CHECK(c.model.args.n_layers == 3);
    CHECK(c.lr_scheduler.decay_ratio == 0.5);
    c = parse("[lr_scheduler]\ndecay_ratio = 0.5\n", {"--lr_scheduler.decay_ratio", "none"});
    CHECK_FALSE(c.lr_scheduler.decay_ratio.has_value());
    c = parse("", {"--model.tie_embeddings"});
    CHECK(c.model.tie_embeddings == true);
    CHECK(c.model.args.tie_embeddings);
  }
  SUBCASE("an empty string value") {
    CHECK(parse("[job]\ndescription = \"x\"\n", {"--job.description="}).job.description.empty());
  }
}

TEST_CASE("string-list keys: parallelism.pipeline_parallel_split_points") {
  using Names = std::vector<std::string>;
  auto points = [](const JobConfig& c) { return c.parallelism.pipeline_parallel_split_points; };

  SUBCASE("from TOML: an array of strings, on one line or several, or empty") {
    CHECK(points(parse("[parallelism]\npipeline_parallel_split_points = [\"layers.4\", \"layers.8\"]\n")) ==
          Names{"layers.4", "layers.8"});
    CHECK(points(parse("[parallelism]\npipeline_parallel_split_points = [\n  \"layers.1\",  # first cut\n"
                       "  'layers.3',\n]\n")) == Names{"layers.1", "layers.3"});
    CHECK(points(parse("[parallelism]\npipeline_parallel_split_points = []\n")).empty());
    CHECK(points(parse("parallelism.pipeline_parallel_split_points = [\"layers.0\"]\n")) == Names{"layers.0"});
  }
  SUBCASE("from the command line: comma-separated, over the file") {
    const std::string file = "[parallelism]\npipeline_parallel_split_points = [\"layers.1\"]\n";
    CHECK(points(parse(file)) == Names{"layers.1"});
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points", "layers.4,layers.8"})) ==
          Names{"layers.4", "layers.8"});
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points=layers.2"})) == Names{"layers.2"});
    // Spaces around an item are not part of it.
    CHECK(points(parse("", {"--parallelism.pipeline_parallel_split_points", " layers.2 ,\tlayers.5"})) ==
          Names{"layers.2", "layers.5"});
    // An empty value is the empty list, in either form; the last override wins.
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points="})).empty());
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points", ""})).empty());
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points", " "})).empty());
    CHECK(points(parse(file, {"--parallelism.pipeline_parallel_split_points", "layers.3",
                              "--parallelism.pipeline_parallel_split_points=layers.4,layers.5"})) ==
          Names{"layers.4", "layers.5"});
  }
  SUBCASE("not an array, or an item that is not a string, names the file, line and key") {
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = \"layers.4\"\n"), "job.toml:2:34: ",
                "parallelism.pipeline_parallel_split_points: expected an array of strings, got a string");
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = 4\n"), "job.toml:2:34: ",
                "expected an array of strings, got an integer");
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = { a = 1 }\n"), "job.toml:2:34: ",
                "expected an array of strings, got a table");
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = [\"layers.4\", 8]\n"), "job.toml:2:47: ",
                "parallelism.pipeline_parallel_split_points: expected an array of strings, got an integer at index 1");
    // In an array over several lines the error points at the item.
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = [\n  \"layers.1\",\n  true,\n]\n"),
                "job.toml:4:3: ", "got a boolean at index 1");
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = [[\"layers.1\"]]\n"), "job.toml:2:35: ",
                "got an array at index 0");
  }
  SUBCASE("bad command-line lists") {
    for (const char* text : {"layers.2,", ",layers.2", "layers.2,,layers.4", "layers.2, ,layers.4", ","}) {
      INFO(text);
      CHECK_ERROR(parse("", {"--parallelism.pipeline_parallel_split_points", text}), "command line: ",
                  "--parallelism.pipeline_parallel_split_points: expected comma-separated strings",
                  "got an empty item in '" + std::string(text) + "'");
    }
    CHECK_ERROR(parse("", {"--parallelism.pipeline_parallel_split_points"}), "command line: ",
                "--parallelism.pipeline_parallel_split_points needs a value");
  }
  SUBCASE("names that are not layers.<index> are refused at load, saying where they came from") {
    CHECK_ERROR(parse("[parallelism]\npipeline_parallel_split_points = [\"layers.2\", \"layer.3\"]\n"),
                "job.toml:2:34: ", "parallelism.pipeline_parallel_split_points: \"layer.3\" is not a block name");
    CHECK_ERROR(parse("", {"--parallelism.pipeline_parallel_split_points", "layers.x"}), "command line: ",
                "parallelism.pipeline_parallel_split_points: \"layers.x\" is not a block name");
    CHECK_ERROR(parse("", {"--parallelism.pipeline_parallel_split_points", "4"}), "\"4\" is not a block name");
  }
  SUBCASE("the items are written back as a TOML array, any characters quoted") {
    const tessera::train::detail::Value v = Names{"a \"b\"", "c,d", "", "e\\f"};
    const std::string text = tessera::train::detail::format_value(v);
    CHECK(text == R"(["a \"b\"", "c,d", "", "e\\f"])");
    toml::table t = toml::parse("x = " + text);
    const toml::array* a = t["x"].as_array();
    REQUIRE(a != nullptr);
    Names back;
    for (const auto& item : *a) back.push_back(item.value<std::string>().value_or("<not a string>"));
    CHECK(back == std::get<Names>(v));
    CHECK(tessera::train::detail::format_value(tessera::train::detail::Value{Names{}}) == "[]");
  }
  SUBCASE("make_plan gives the model the block indices") {
    JobConfig c = parse("[parallelism]\npipeline_parallel_degree = 2\n"
                        "pipeline_parallel_split_points = [\"layers.1\", \"layers.3\", \"layers.5\"]\n");
    CHECK(tessera::train::make_plan(c, nullptr).pipeline.split_points == std::vector<int>{1, 3, 5});
    CHECK(tessera::train::make_plan(parse(""), nullptr).pipeline.split_points.empty());
    // A config built in code is read by make_plan as it stands: a bad name is its error.
    JobConfig code;
    code.parallelism.pipeline_parallel_split_points = {"layers.2", "layers.x"};
    CHECK_ERROR(tessera::train::make_plan(code, nullptr),
                "parallelism.pipeline_parallel_split_points: \"layers.x\" is not a block name");
    code.parallelism.pipeline_parallel_split_points = {"layer.3"};
    CHECK_ERROR(tessera::train::make_plan(code, nullptr),
                "parallelism.pipeline_parallel_split_points: \"layer.3\" is not a block name");
  }
}

TEST_CASE("--config and --job.config_file select the file") {
  TempDir dir;
  std::string a = dir.write("a.toml", "[training]\nsteps = 11\n");
  std::string b = dir.write("b.toml", "[training]\nsteps = 22\nseed = 4\n");
  CHECK(load_config(a, {}).training.steps == 11);
  CHECK(load_config(a, {"--config", b}).training.steps == 22);
  CHECK(load_config("", {"--config=" + b}).training.steps == 22);
  CHECK(load_config(a, {"--job.config_file", b}).training.steps == 22);
  auto c = load_config("", {"--training.seed", "9", "--config", b});  // order does not matter
  CHECK(c.training.steps == 22);
  CHECK(c.training.seed == 9);
  CHECK_ERROR(load_config("", {"--config"}), "command line", "--config needs a value");
  CHECK_ERROR(load_config("", {"--config", "--training.steps", "3"}), "--config needs a value");
  CHECK_ERROR(parse("", {"--config", b}), "only read by load_config");
  // Errors in a loaded file name it.
  std::string bad = dir.write("bad.toml", "[training]\nsteps = 0\n");
  CHECK_ERROR(load_config(bad, {}), bad + ":2:9", "training.steps must be positive, got 0");
}

TEST_CASE("a missing config file") {
  TempDir dir;
  std::string missing = (dir.path / "nope.toml").string();
  CHECK_ERROR(load_config(missing, {}), missing, ": config file not found");
  CHECK_ERROR(load_config("", {"--config", missing}), missing, ": config file not found");
  CHECK_ERROR(load_config(dir.path.string(), {}), "is a folder, not a TOML config file");
}

TEST_CASE("TOML syntax errors give the line and column") {
  CHECK_ERROR(parse("[training]\nsteps = = 3\n"), "job.toml:2:", "TOML syntax error");
  CHECK_ERROR(parse("[training]\nsteps = 1\nsteps = 2\n"), "job.toml:3:", "TOML syntax error");
  CHECK_ERROR(parse("[training\n"), "job.toml:1:", "TOML syntax error");
}

TEST_CASE("unknown sections and keys") {
  CHECK_ERROR(parse("[trainig]\nsteps = 3\n"), "job.toml:1:", "unknown section [trainig]",
              "did you mean [training]?");
  CHECK_ERROR(parse("[compil]\nenable = true\n"), "unknown section [compil]", "did you mean [compile]?");
  CHECK_ERROR(parse("[float8]\nenable = true\n"), "unknown key 'float8.enable'");
  CHECK_ERROR(parse("[training]\nstepz = 3\n"), "job.toml:2:1", "unknown key 'training.stepz'",
              "did you mean 'training.steps'?");
  CHECK_ERROR(parse("[training]\nlr = 3.0\n"), "unknown key 'training.lr'", "did you mean 'optimizer.lr'?");
  CHECK_ERROR(parse("[training]\ncompile = true\n"), "unknown key 'training.compile'");
  CHECK(error_of([] { parse("[training]\ncompile = true\n"); }).find("did you mean") == std::string::npos);
  CHECK_ERROR(parse("steps = 3\n"), "job.toml:1:1", "'steps' is outside any section",
              "did you mean 'training.steps'?");
  CHECK_ERROR(parse("[training.extra]\nx = 1\n"), "unknown key 'training.extra'");
  CHECK_ERROR(parse("foo = 1\n"), "job.toml:1:1: key 'foo' is outside any section");
  CHECK_ERROR(parse("[[training]]\nsteps = 1\n"), "job.toml:1:", "[training] must be a table, got an array");
  CHECK_ERROR(parse("training = 3\n"), "[training] must be a table, got an integer");
  // Dotted keys are plain TOML and work anywhere.
  CHECK(parse("training.steps = 5\n").training.steps == 5);
  CHECK(parse("[training]\nsteps = 5\n[optimizer]\nlr = 0.5\n").optimizer.lr == 0.5);
}

TEST_CASE("wrong types name the key and both types") {
  CHECK_ERROR(parse("[training]\nsteps = \"ten\"\n"), "job.toml:2:9",
              "training.steps: expected an integer, got a string");
  CHECK_ERROR(parse("[training]\nsteps = 10.0\n"), "training.steps: expected an integer, got a float");
  CHECK_ERROR(parse("[optimizer]\nlr = true\n"), "optimizer.lr: expected a number, got a boolean");
  CHECK_ERROR(parse("[optimizer]\nlr = nan\n"), "optimizer.lr: expected a finite number");
  CHECK_ERROR(parse("[checkpoint]\nenable = \"yes\"\n"), "checkpoint.enable: expected a boolean");
  CHECK_ERROR(parse("[model]\nflavor = 7\n"), "model.flavor: expected a string, got an integer");
  CHECK_ERROR(parse("[model]\ndim = [1, 2]\n"), "model.dim: expected an integer, got an array");
  CHECK_ERROR(parse("[training.steps]\n"), "training.steps: expected an integer, got a table");
}

TEST_CASE("bad command-line overrides") {
  CHECK_ERROR(parse("", {"--training.steps"}), "command line", "--training.steps needs a value");
  CHECK_ERROR(parse("", {"--training.steps", "--training.seed", "1"}), "--training.steps needs a value");
  CHECK_ERROR(parse("", {"--training.stepz", "3"}), "command line", "unknown option --training.stepz",
              "did you mean --training.steps?");
  CHECK_ERROR(parse("", {"--bogus", "3"}), "unknown option --bogus");
  CHECK_ERROR(parse("", {"--training.steps", "ten"}), "command line",
              "--training.steps: expected an integer, got 'ten'");
  CHECK_ERROR(parse("", {"--training.steps", "10x"}), "expected an integer, got '10x'");
  CHECK_ERROR(parse("", {"--optimizer.lr", "fast"}), "--optimizer.lr: expected a number, got 'fast'");
  CHECK_ERROR(parse("", {"--optimizer.lr", "inf"}), "--optimizer.lr: expected a number, got 'inf'");
  CHECK_ERROR(parse("", {"--checkpoint.enable", "yes"}), "--checkpoint.enable: expected a boolean", "got 'yes'");
  CHECK_ERROR(parse("", {"--training.steps="}), "expected an integer, got ''");
  CHECK_ERROR(parse("", {"steps", "3"}), "command line: unexpected argument 'steps'");
  CHECK_ERROR(parse("", {"--training.steps", "3", "4"}), "unexpected argument '4'");
  CHECK_ERROR(parse("", {"--training.steps", "none"}), "expected an integer, got 'none'");
  // A range error on an overridden value names the command line, not the file.
  CHECK_ERROR(parse("[training]\nsteps = 5\n", {"--training.steps", "0"}),
              "command line: training.steps must be positive, got 0");
}

TEST_CASE("values out of range") {
  struct Case {
    const char* toml;
    const char* message;
  };
  const Case cases[] = {
      {"[training]\nsteps = 0", "training.steps must be positive, got 0"},
      {"[training]\nsteps = -5", "training.steps must be positive, got -5"},
      {"[training]\nlocal_batch_size = 0", "training.local_batch_size must be positive, got 0"},
      {"[training]\nseq_len = 0", "training.seq_len must be positive, got 0"},
      {"[training]\nseq_len = 4096", "training.seq_len (4096) exceeds the model's max_seq_len (2048)"},
      {"[training]\nglobal_batch_size = 0", "training.global_batch_size must be -1"},
      {"[training]\nglobal_batch_size = 12", "training.global_batch_size (12) must be a multiple of"},
      {"[training]\nsynthetic_documents = 0", "training.synthetic_documents must be positive"},
      {"[training]\nseed = -1", "training.seed must be >= 0, got -1"},
      {"[optimizer]\nlr = -0.1", "optimizer.lr must be >= 0, got -0.1"},
      {"[optimizer]\neps = 0", "optimizer.eps must be positive, got 0.0"},
      {"[optimizer]\nweight_decay = -1", "optimizer.weight_decay must be >= 0"},
      {"[optimizer]\nbeta1 = 1.0", "optimizer.beta1 must be in [0, 1), got 1.0"},
      {"[optimizer]\nbeta2 = -0.5", "optimizer.beta2 must be in [0, 1), got -0.5"},
      {"[lr_scheduler]\nwarmup_steps = -1", "lr_scheduler.warmup_steps must be >= 0, got -1"},
      {"[lr_scheduler]\ndecay_ratio = 1.5", "lr_scheduler.decay_ratio must be in [0, 1], got 1.5"},
      {"[lr_scheduler]\nmin_lr_factor = 2", "lr_scheduler.min_lr_factor must be in [0, 1], got 2.0"},
      {"[metrics]\nlog_freq = 0", "metrics.log_freq must be positive, got 0"},
      {"[metrics]\npeak_tflops = -1", "metrics.peak_tflops must be >= 0"},
      {"[profiling]\nprofile_freq = 0", "profiling.profile_freq must be positive, got 0"},
      {"[checkpoint]\ninterval = 0", "checkpoint.interval must be positive"},
      {"[comm]\ntrace_buf_size = -1", "comm.trace_buf_size must be >= 0, got -1"},
      {"[checkpoint]\nkeep_latest_k = -1", "checkpoint.keep_latest_k must be >= 0"},
      {"[checkpoint]\ncreate_seed_checkpoint = true",
       "job.toml:2:26: checkpoint.create_seed_checkpoint = true writes a checkpoint: it needs checkpoint.enable = true"},
      {"[parallelism]\ntensor_parallel_degree = 0", "parallelism.tensor_parallel_degree must be >= 1, got 0"},
      {"[parallelism]\ntensor_parallel_degree = -1", "parallelism.tensor_parallel_degree must be >= 1, got -1"},
      {"[parallelism]\npipeline_parallel_degree = 0", "parallelism.pipeline_parallel_degree must be >= 1"},
      {"[parallelism]\ncontext_parallel_degree = 0", "parallelism.context_parallel_degree must be >= 1"},
      {"[parallelism]\ndata_parallel_replicate_degree = 0", "parallelism.data_parallel_replicate_degree must be"},
      {"[parallelism]\ndata_parallel_shard_degree = 0", "parallelism.data_parallel_shard_degree must be -1"},
      {"[parallelism]\ndata_parallel_shard_degree = -2",
       "data_parallel_shard_degree must be -1 (the ranks the other degrees leave) or >= 1, got -2"},
      {"[parallelism]\npipeline_parallel_microbatch_size = 0", "pipeline_parallel_microbatch_size must be positive"},
      {"[model]\ndim = 0", "model.dim must be positive, got 0"},
      {"[model]\nn_kv_heads = -1", "model.n_kv_heads must be >= 0"},
      {"[model]\nnorm_eps = 0", "model.norm_eps must be positive"},
      {"[activation_checkpoint]\nselective_ac_option = \"0\"", "selective_ac_option must be \"op\" or a positive"},
      {"[activation_checkpoint]\nselective_ac_option = \"two\"", "selective_ac_option must be \"op\" or a positive"},
  };
  for (const auto& c : cases) {
    INFO(c.toml);
    CHECK_ERROR(parse(c.toml), "job.toml:2:", c.message);
  }
  // Edges that are accepted.
  CHECK(parse("[optimizer]\nbeta1 = 0.0\nlr = 0\n").optimizer.beta1 == 0.0);
  CHECK(parse("[lr_scheduler]\ndecay_ratio = 1.0\nmin_lr_factor = 1\n").lr_scheduler.decay_ratio == 1.0);
  CHECK(parse("[training]\nmax_norm = 0\nglobal_batch_size = 32\n").training.max_norm == 0.0);
  CHECK(parse("[activation_checkpoint]\nselective_ac_option = \"op\"\n").activation_checkpoint.selective_ac_option ==
        "op");
  CHECK(parse("[training]\nseq_len = 4096\n[model]\nmax_seq_len = 4096\n").training.seq_len == 4096);
}

TEST_CASE("unknown names in enumerated keys") {
  CHECK_ERROR(parse("[lr_scheduler]\ndecay_type = \"step\""), "job.toml:2:",
              "lr_scheduler.decay_type must be one of linear, sqrt, cosine; got \"step\"");
  CHECK_ERROR(parse("[training]\nmixed_precision_param = \"float16\""),
              "training.mixed_precision_param must be one of auto, float32, bfloat16; got \"float16\"");
  CHECK_ERROR(parse("[training]\nmixed_precision_reduce = \"bfloat16\""), "training.mixed_precision_reduce must be");
  CHECK_ERROR(parse("[activation_checkpoint]\nmode = \"partial\""),
              "activation_checkpoint.mode must be one of none, full, selective");
  CHECK_ERROR(parse("[checkpoint]\nexport_dtype = \"float16\""), "checkpoint.export_dtype must be one of");
  CHECK(parse("[checkpoint]\nasync_mode = \"async_with_pinned_mem\"").checkpoint.async_mode == "async_with_pinned_mem");
  CHECK_ERROR(parse("[checkpoint]\nasync_mode = \"sync\""),
              "checkpoint.async_mode must be one of disabled, async, async_with_pinned_mem; got \"sync\"");
  CHECK_ERROR(parse("[training]\ndataset = \"c5\""), "training.dataset must be one of synthetic, shard, chat, c4, c4_test; got \"c5\"");
  CHECK_ERROR(parse("[training]\nattention = \"flash\""),
              "training.attention must be one of auto, cudnn, tessera; got \"flash\"");
  CHECK_ERROR(parse("[optimizer]\nname = \"SGD\""), "optimizer.name must be one of AdamW");
  CHECK_ERROR(parse("[optimizer]\nstate_dtype = \"float16\""), "job.toml:2:",
              "optimizer.state_dtype must be one of float32, bfloat16; got \"float16\"");
  CHECK_ERROR(parse("", {"--optimizer.state_dtype", "fp8"}), "command line: optimizer.state_dtype must be one of");
  CHECK(parse("[optimizer]\nstate_dtype = \"bfloat16\"").optimizer.state_dtype == "bfloat16");
  CHECK_ERROR(parse("[parallelism]\npipeline_parallel_schedule = \"ZeroBubble\""),
              "parallelism.pipeline_parallel_schedule must be one of");
  CHECK_ERROR(parse("[parallelism]\nfsdp_reshard_after_forward = \"sometimes\""),
              "parallelism.fsdp_reshard_after_forward must be one of default, always, never");
  CHECK_ERROR(parse("[model]\nflavor = \"llama4\""), "job.toml:2:", "model.flavor: unknown flavor 'llama4'",
              "llama3_8b");
  CHECK_ERROR(parse("", {"--training.mixed_precision_param", "fp8"}),
              "command line: training.mixed_precision_param must be one of");
}

TEST_CASE("torchtitan's own TOML schema: [compile], [quantize.linear.float8], model.name with its flavors, "
          "hf_assets_path, its Hub datasets named") {
  // The keys torchtitan's Llama 3 files have that tessera's own do not.
  const JobConfig c = parse(R"(
[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
[training]
dataset = "c4"
seq_len = 8192
[compile]
enable = true
components = ["model", "loss"]
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
filter_fqns = ["output"]
[validation]
dataset = "c4_validation"
)");
  const tessera::nn::ModelArgs want = tessera::nn::model_flavor("llama3.1_8b");
  CHECK(c.model.args.dim == want.dim);
  CHECK(c.model.args.n_layers == want.n_layers);
  CHECK(c.model.args.max_seq_len == 131072);
  CHECK(c.model.args.rope_scaling.enabled);
  CHECK(c.model.tokenizer == "./assets/hf/Llama-3.1-8B");  // read from the assets folder
  CHECK(c.compile.enable);
  CHECK(c.float8.enable_fsdp_float8_all_gather);
  CHECK(c.float8.filter_fqns == std::vector<std::string>{"output"});
  // A run refuses the Hub's dataset by key, saying how to make a local one.
  CHECK_ERROR(tessera::train::load_training_tokens(c, tessera::io::ByteTokenizer{}), "training.dataset = \"c4\"",
              "Hugging Face Hub", "llama-tokenize");
  // model.tokenizer given wins over the assets folder; llama2's flavors; a wrong one is named.
  CHECK(parse("[model]\nname = \"llama3\"\nflavor = \"8B\"\nhf_assets_path = \"a\"\ntokenizer = \"byte\"\n"
              "[training]\nseq_len = 64\n").model.tokenizer == "byte");
  CHECK(parse("[model]\nname = \"llama2\"\nflavor = \"13B\"\n[training]\nseq_len = 64\n").model.args.dim == 5120);
  // With initial_load_in_hf, the assets folder is the weights' too, unless initial_load_path is given.
  CHECK(parse("[model]\nhf_assets_path = \"hf/8b\"\n[checkpoint]\ninitial_load_in_hf = true\n")
            .checkpoint.initial_load_path == "hf/8b");
  CHECK(parse("[model]\nhf_assets_path = \"hf/8b\"\n[checkpoint]\ninitial_load_in_hf = true\n"
              "initial_load_path = \"other\"\n").checkpoint.initial_load_path == "other");
  CHECK(parse("[model]\nhf_assets_path = \"hf/8b\"\n").checkpoint.initial_load_path.empty());
  CHECK_ERROR(parse("[model]\nname = \"llama3\"\nflavor = \"13B\"\n"), "'13B' is not a flavor of model.name",
              "8B");
  CHECK_ERROR(parse("[quantize.linear.mx]\nrecipe_name = \"mxfp8\"\n"), "unknown section [quantize.linear.mx]");
  // An empty [quantize] or [quantize.linear] sets nothing (the first was a null dereference).
  for (const char* empty : {"[quantize]\n", "[quantize.linear]\n", "[quantize]\n[quantize.linear]\n"})
    CHECK(parse(empty) == parse(""));
  CHECK_ERROR(parse("[quantize]\nlinear = 3\n"), "unknown section [quantize.linear]");
  CHECK_ERROR(parse("[quantize.linear.float8]\nemulate = true\n[float8]\nemulate = true\n"),
              "[quantize.linear.float8] and [float8] both set the float8 keys");
  // Its switches tessera reads but cannot turn on are refused by key, with the reason.
  CHECK_ERROR(parse("[metrics]\nenable_wandb = true\n"), "metrics.enable_wandb = true", "enable_tensorboard");
  CHECK(parse("[parallelism]\nenable_async_tensor_parallel = true\n").parallelism.enable_async_tensor_parallel);
  CHECK_ERROR(parse("[parallelism]\nenable_async_tensor_parallel = true\ndisable_sequence_parallel = true\n"),
              "parallelism.enable_async_tensor_parallel = true", "disable_sequence_parallel = true");
  CHECK(parse("[metrics]\nenable_wandb = false\ndisable_color_printing = true\n").metrics.disable_color_printing);
}

TEST_CASE("dataset shard needs a path") {
  CHECK_ERROR(parse("[training]\ndataset = \"shard\""), "job.toml:2:",
              "training.dataset_path is required when training.dataset = \"shard\"");
  auto c = parse("[training]\ndataset = \"shard\"\ndataset_path = \"data/x.tshard\"");
  CHECK(c.training.dataset_path == std::vector<std::string>{"data/x.tshard"});
}

TEST_CASE("dataset_path: one path or a list; dataset_weights: a number per entry") {
  using Names = std::vector<std::string>;
  using Weights = std::vector<double>;
  const std::string shard = "[training]\ndataset = \"shard\"\n";
  // One string is the list of it, in the file and on the command line; the dump writes a list.
  CHECK(parse(shard + "dataset_path = \"a.bin\"\n").training.dataset_path == Names{"a.bin"});
  CHECK(parse(shard, {"--training.dataset_path", "a.bin"}).training.dataset_path == Names{"a.bin"});
  const JobConfig two = parse(shard + "dataset_path = [\"a.bin\", \"c4/*.bin\"]\ndataset_weights = [3, 0.5]\n");
  CHECK(two.training.dataset_path == Names{"a.bin", "c4/*.bin"});
  CHECK(two.training.dataset_weights == Weights{3.0, 0.5});
  CHECK(parse_config(to_toml(two), "dump.toml", {}) == two);
  CHECK(to_toml(two).find("dataset_weights = [3.0, 0.5]\n") != std::string::npos);
  const JobConfig cli =
      parse(shard, {"--training.dataset_path", "a.bin,b.bin", "--training.dataset_weights", "0.7, 0.3"});
  CHECK(cli.training.dataset_path == Names{"a.bin", "b.bin"});
  CHECK(cli.training.dataset_weights == Weights{0.7, 0.3});
  CHECK(parse("[validation]\ndataset_path = \"v.bin\"\n").validation.dataset_path == Names{"v.bin"});
  // Bad weights, each named by key (and where the file has a line, by line).
  CHECK_ERROR(parse(shard + "dataset_path = [\"a.bin\", \"b.bin\"]\ndataset_weights = [1]\n"), "job.toml:",
              "training.dataset_weights has 1 weight and training.dataset_path 2 entries: one weight per entry");
  CHECK_ERROR(parse(shard + "dataset_path = [\"a.bin\"]\ndataset_weights = [0]\n"), "job.toml:4:",
              "training.dataset_weights: each item must be positive, got 0.0");
  CHECK_ERROR(parse(shard + "dataset_path = [\"a.bin\"]\ndataset_weights = [\"x\"]\n"), "job.toml:4:",
              "training.dataset_weights: expected an array of numbers, got a string at index 0");
  CHECK_ERROR(parse(shard + "dataset_path = [\"a.bin\"]\ndataset_weights = 1\n"), "job.toml:4:",
              "expected an array of numbers, got an integer");
  CHECK_ERROR(parse(shard, {"--training.dataset_path", "a.bin", "--training.dataset_weights", "1,x"}),
              "--training.dataset_weights: expected comma-separated numbers (0.7,0.3), got 'x' in '1,x'");
  CHECK_ERROR(parse("[training]\ndataset_weights = [1.0]\n"),
              "training.dataset_weights mixes the files of training.dataset_path, and training.dataset = "
              "\"synthetic\" reads none");
  // A list key that takes no plain string still refuses one.
  CHECK_ERROR(parse("[model]\nconverters = \"float8\"\n"), "model.converters: expected an array of strings");
}

TEST_CASE("model overrides apply on top of the flavor") {
  auto c = parse("[model]\nflavor = \"llama3_8b\"\nn_layers = 2\n[training]\nseq_len = 8192\n");
  const auto& a = c.model.args;
  CHECK(a.flavor == "llama3_8b");
  CHECK(a.n_layers == 2);
  CHECK(a.dim == 4096);
  CHECK(a.n_heads == 32);
  CHECK(a.n_kv_heads == 8);
  CHECK(a.vocab_size == 128256);
  CHECK(a.multiple_of == 1024);
  CHECK(a.ffn_dim_multiplier == 1.3);
  CHECK(a.max_seq_len == 8192);

  auto all = parse(R"([model]
flavor = "llama3.1_8b"
dim = 512
n_layers = 3
n_heads = 8
n_kv_heads = 2
vocab_size = 1000
multiple_of = 64
ffn_dim_multiplier = 1.5
rope_theta = 20000
norm_eps = 1e-6
max_seq_len = 1024
tie_embeddings = true
[training]
seq_len = 1024
)");
  const auto& b = all.model.args;
  CHECK(b.dim == 512);
  CHECK(b.n_layers == 3);
  CHECK(b.n_heads == 8);
  CHECK(b.n_kv_heads == 2);
  CHECK(b.vocab_size == 1000);
  CHECK(b.multiple_of == 64);
  CHECK(b.ffn_dim_multiplier == 1.5);
  CHECK(b.rope_theta == 20000.0);
  CHECK(b.norm_eps == 1e-6);
  CHECK(b.max_seq_len == 1024);
  CHECK(b.tie_embeddings);
  CHECK(b.rope_scaling.enabled);  // a field without a key keeps the flavor's value

  // The flavor's max_seq_len bounds training.seq_len.
  CHECK_ERROR(parse("[model]\nflavor = \"llama2_7b\"\n[training]\nseq_len = 8192\n"),
              "training.seq_len (8192) exceeds the model's max_seq_len (4096) of flavor llama2_7b");
}

TEST_CASE("model shapes that do not divide are rejected") {
  CHECK_ERROR(parse("[model]\nn_heads = 7\n"), "job.toml: [model]", "n_heads (7) does not divide dim (256)");
  CHECK_ERROR(parse("[model]\ndim = 200\n"), "n_heads (16) does not divide dim (200)");
  CHECK_ERROR(parse("[model]\nn_kv_heads = 3\n"), "job.toml: [model]",
              "n_kv_heads (3) does not divide n_heads (16)");
  CHECK_ERROR(parse("", {"--model.n_kv_heads", "5"}), "job.toml with --model.n_kv_heads from the command line: [model]",
              "n_kv_heads (5) does not divide n_heads (16)");
  CHECK_ERROR(load_config("", {"--model.n_heads", "3"}), "command line: [model]",
              "n_heads (3) does not divide dim (256)");
  // Past 2^48 parameters: refused before the parameter count overflows an int64.
  CHECK_ERROR(parse("[model]\ndim = 1099511627776\n"), "job.toml: [model]",
              "the parameter count is 8.70427e+25, past the 2.81475e+14 (2^48) parameters");
}

TEST_CASE("the folders a job writes to are named") {
  CHECK_ERROR(parse("", {"--job.dump_folder", ""}), "command line: job.dump_folder is empty");
  CHECK_ERROR(parse("[checkpoint]\nfolder = \"\"\n"), "job.toml:2:10: checkpoint.folder is empty");
}

TEST_CASE("to_toml round trip") {
  SUBCASE("defaults") {
    JobConfig c = parse("");
    std::string text = to_toml(c);
    CHECK(text.find("[training]\n") != std::string::npos);
    CHECK(text.find("steps = 10000\n") != std::string::npos);
    CHECK(text.find("# decay_ratio: unset") != std::string::npos);
    CHECK(text.find("# dim: unset, the flavor's value (256)") != std::string::npos);
    CHECK(text.find("[parallelism]\n") < text.find("pipeline_parallel_split_points = []\n"));
    CHECK(parse_config(text, "dump.toml", {}) == c);
  }
  SUBCASE("text from the command line: UTF-8 writes back, other bytes are refused by key") {
    // fuzz_config found the second: the config written back was no TOML.
    const JobConfig c = parse("", {"--job.description", "caf\xc3\xa9 \xe2\x9c\x93 \"q\" \\ \x01"});
    CHECK(c.job.description == "caf\xc3\xa9 \xe2\x9c\x93 \"q\" \\ \x01");
    CHECK(parse_config(to_toml(c), "dump.toml", {}) == c);
    CHECK_ERROR(parse("", {"--job.description", "ab\xff"}),
                "command line: --job.description: not UTF-8 text, got 'ab\xef\xbf\xbd'");
    CHECK_ERROR(parse("", {"--float8.filter_fqns", "output,w1\x8c"}), "--float8.filter_fqns: not UTF-8 text");
    CHECK_ERROR(parse("", {"--job.description=\xc3"}), "--job.description: not UTF-8 text");
  }
  SUBCASE("a string list: one item, several, and back to empty") {
    for (const Args& args : {Args{"--parallelism.pipeline_parallel_split_points", "layers.5"},
                             Args{"--parallelism.pipeline_parallel_split_points=layers.2,layers.4"}}) {
      JobConfig c = parse("", args);
      std::string text = to_toml(c);
      JobConfig back = parse_config(text, "dump.toml", {});
      CHECK(back == c);
      CHECK(back.parallelism.pipeline_parallel_split_points == c.parallelism.pipeline_parallel_split_points);
      CHECK_FALSE(back == parse(""));
    }
    JobConfig emptied = parse("[parallelism]\npipeline_parallel_split_points = [\"layers.1\"]\n",
                              {"--parallelism.pipeline_parallel_split_points="});
    CHECK(parse_config(to_toml(emptied), "dump.toml", {}) == parse(""));
  }
  SUBCASE("every key changed") {
    Args args = {"--job.dump_folder", "out dir/ü",
                 "--job.description", "quote \" backslash \\ tab \t newline \n bell \x07 done",
                 "--job.print_config",
                 "--model.flavor", "llama3.2_1b",
                 "--model.n_layers", "2",
                 "--model.dim", "512",
                 "--model.n_heads", "8",
                 "--model.n_kv_heads", "4",
                 "--model.vocab_size", "300",
                 "--model.multiple_of", "32",
                 "--model.ffn_dim_multiplier", "1.25",
                 "--model.rope_theta", "12345.678",
                 "--model.norm_eps", "1e-6",
                 "--model.max_seq_len", "512",
                 "--model.tie_embeddings", "false",
                 "--model.ffn_hidden", "96",
                 "--model.tokenizer", "tokenizers/llama3/tokenizer.model",
                 "--model.name", "llama2",
                 "--model.hf_assets_path", "assets/hf/Llama-2-7b",
                 "--model.converters", "float8",
                 "--model.fuse_projections", "false",
                 "--optimizer.lr", "0.000123456789",
                 "--optimizer.eps", "1e-12",
                 "--optimizer.weight_decay", "0",
                 "--optimizer.beta1", "0.8",
                 "--optimizer.beta2", "0.999",
                 "--optimizer.state_dtype", "bfloat16",
                 "--optimizer.early_step_in_backward", "true",
                 "--lr_scheduler.warmup_steps", "7",
                 "--lr_scheduler.decay_ratio", "0.3",
                 "--lr_scheduler.decay_type", "sqrt",
                 "--lr_scheduler.min_lr_factor", "0.05",
                 "--training.local_batch_size", "3",
                 "--training.global_batch_size", "12",
                 "--training.seq_len", "256",
                 "--training.steps", "17",
                 "--training.max_norm", "-1",
                 "--training.seed", "99",
                 "--training.deterministic",
                 "--training.device", "cpu", "--training.attention", "tessera",
                 "--training.expandable_segments", "false", "--training.cuda_graph", "true",
                 "--training.enable_cpu_offload", "true",
                 "--training.document_mask",
                 "--training.mixed_precision_param", "float32",
                 "--training.dataset", "shard",
                 "--training.dataset_path", "data/c4.tshard",
                 "--training.dataset_weights", "2",
                 "--training.packing", "first_fit",
                 "--training.shuffle", "true",
                 "--training.chat_format", "llama2",
                 "--training.synthetic_documents", "5",
                 "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "4",
                 "--parallelism.tensor_parallel_degree", "2",
                 "--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.context_parallel_degree", "2",
                 "--parallelism.context_parallel_rotate_method", "allgather",
                 "--parallelism.context_parallel_load_balancer", "none",
                 "--parallelism.disable_loss_parallel",
                 "--parallelism.disable_sequence_parallel",
                 "--parallelism.pipeline_parallel_schedule", "PipelineScheduleMulti",
                 "--parallelism.pipeline_parallel_schedule_csv", "runs/order.csv",
                 "--parallelism.pipeline_parallel_microbatch_size", "2",
                 "--parallelism.fsdp_reshard_after_forward", "never",
                 "--parallelism.pipeline_parallel_split_points", "layers.0,layers.1, layers.2",
                 "--parallelism.pipeline_parallel_layers_per_stage", "3",
                 "--parallelism.pipeline_parallel_first_stage_less_layers", "2",
                 "--parallelism.pipeline_parallel_last_stage_less_layers", "0",
                 "--activation_checkpoint.mode", "full",
                 "--activation_checkpoint.selective_ac_option", "op",
                 "--activation_checkpoint.recompute_swiglu", "true",
                 "--float8.recipe_name", "rowwise",
                 "--float8.enable_fsdp_float8_all_gather", "true",
                 "--float8.enable_tp_float8_all_gather", "false",
                 "--float8.precompute_float8_dynamic_scale_for_fsdp", "true",
                 "--float8.filter_fqns", "output,auto_filter_small_kn",
                 "--float8.emulate", "true",
                 "--lora.rank", "16",
                 "--lora.alpha", "32",
                 "--lora.target_modules", "wq,wv",
                 "--checkpoint.enable",
                 "--checkpoint.folder", "ckpt",
                 "--checkpoint.interval", "3",
                 "--checkpoint.load_step", "6",
                 "--checkpoint.enable_first_step_checkpoint",
                 "--checkpoint.create_seed_checkpoint",
                 "--checkpoint.exclude_from_loading", "dataloader,lr_scheduler",
                 "--checkpoint.async_mode", "async",
                 "--checkpoint.last_save_model_only", "false",
                 "--checkpoint.export_dtype", "bfloat16",
                 "--checkpoint.keep_latest_k", "0",
                 "--checkpoint.initial_load_path", "init/step-0",
                 "--checkpoint.initial_load_in_hf",
                 "--checkpoint.last_save_in_hf",
                 "--metrics.log_freq", "1",
                 "--metrics.enable_tensorboard",
                 "--metrics.save_tb_folder", "tensorboard",
                 "--metrics.peak_tflops", "989.5",
                 "--profiling.enable_profiling",
                 "--profiling.save_traces_folder", "traces",
                 "--profiling.profile_freq", "5",
                 "--profiling.enable_memory_snapshot",
                 "--profiling.save_memory_snapshot_folder", "snapshots",
                 "--validation.enable",
                 "--validation.dataset", "chat",
                 "--validation.dataset_path", "data/val.jsonl",
                 "--validation.freq", "3",
                 "--validation.steps", "4",
                 "--validation.local_batch_size", "2",
                 "--validation.seq_len", "128",
                 "--validation.synthetic_documents", "7",
                 "--comm.init_timeout_seconds", "30",
                 "--comm.train_timeout_seconds", "45",
                 "--comm.check_nccl_semantics",
                 "--comm.share_gpu",
                 "--comm.trace_buf_size", "64",
                 "--comm.save_traces_folder", "collectives",
                 "--compile.enable",
                 "--compile.components", "loss",
                 "--debug.enable_structured_logging",
                 "--metrics.disable_color_printing"};
    JobConfig c = load_config("", args);
    const JobConfig defaults;
    // torchtitan's switches tessera reads but refuses to turn on keep their one value;
    // asynchronous tensor parallelism needs the sequence parallelism this case turns off.
    const std::set<std::string_view> left = {"metrics.enable_wandb", "parallelism.enable_async_tensor_parallel"};
    for (const auto& k : tessera::train::config_keys()) {
      INFO(k.name);
      if (k.choices.size() != 1 && !left.contains(k.name))  // the case covers every key that has a choice
        CHECK_FALSE(tessera::train::detail::same_value(k, c, defaults));
    }
    std::string text = to_toml(c);
    JobConfig back = parse_config(text, "dump.toml", {});
    CHECK(back == c);
    CHECK(back.job.description == c.job.description);
    CHECK(back.model.args.n_kv_heads == 4);
    CHECK(back.model.args.rope_theta == 12345.678);
    CHECK(back.optimizer.lr == 0.000123456789);
    CHECK(back.parallelism.pipeline_parallel_split_points == std::vector<std::string>{"layers.0", "layers.1", "layers.2"});
    CHECK(text.find("pipeline_parallel_split_points = [\"layers.0\", \"layers.1\", \"layers.2\"]\n") !=
          std::string::npos);
    CHECK(to_toml(back) == text);

    TempDir dir;
    CHECK(load_config(dir.write("dump.toml", text), {}) == c);
  }
  SUBCASE("inequality is seen") {
    JobConfig a = parse(""), b = parse("", {"--lr_scheduler.decay_ratio", "0"});
    CHECK_FALSE(a == b);
  }
}

TEST_CASE("finalize_config checks a config built in code") {
  JobConfig c;
  c.model.flavor = "llama2_13b";
  c.model.n_layers = 1;
  c.training.seq_len = 4096;
  tessera::train::finalize_config(c, "my trainer");
  CHECK(c.model.args.dim == 5120);
  CHECK(c.model.args.n_layers == 1);
  c.optimizer.beta2 = 1.5;
  CHECK_ERROR(tessera::train::finalize_config(c, "my trainer"), "my trainer: optimizer.beta2 must be in [0, 1)");
}

TEST_CASE("config_help lists every key with type and default") {
  std::string help = tessera::train::config_help();
  for (const auto& k : tessera::train::config_keys()) {
    INFO(k.name);
    CHECK(help.find(tessera::detail::concat("--", k.name, " <")) != std::string::npos);
  }
  CHECK(help.find("--training.steps <int>  (default 10000)") != std::string::npos);
  CHECK(help.find("--optimizer.lr <float>  (default 0.0008)") != std::string::npos);
  CHECK(help.find("--checkpoint.enable <bool>  (default false)") != std::string::npos);
  CHECK(help.find("--job.dump_folder <string>  (default \"./outputs\")") != std::string::npos);
  CHECK(help.find("--lr_scheduler.decay_ratio <float, optional>  (default unset") != std::string::npos);
  CHECK(help.find("--parallelism.pipeline_parallel_split_points <string list>  (default [])") != std::string::npos);
  CHECK(help.find("A string list takes comma-separated items") != std::string::npos);
  CHECK(help.find("One of: linear, sqrt, cosine.") != std::string::npos);
}

TEST_CASE("docs/configuration.md describes every key") {
  fs::path src = source_dir();
  INFO("source dir: " << src);
  REQUIRE(fs::exists(src / "docs" / "configuration.md"));
  std::string doc = read_text(src / "docs" / "configuration.md");
  for (const auto& k : tessera::train::config_keys()) {
    INFO(k.name);
    CHECK(doc.find(tessera::detail::concat("`", k.key(), "`")) != std::string::npos);
  }
  for (auto s : tessera::train::config_sections()) CHECK(doc.find(tessera::detail::concat("[", s, "]")) != std::string::npos);
}

TEST_CASE("every example config loads") {
  fs::path dir = source_dir() / "examples" / "configs";
  INFO("configs: " << dir);
  REQUIRE(fs::is_directory(dir));
  std::set<std::string> flavors;
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".toml") continue;
    ++files;
    INFO(entry.path());
    JobConfig c;
    CHECK_NOTHROW(c = load_config(entry.path().string(), {}));
    flavors.insert(c.model.flavor);
    if (c.model.flavor != "debugmodel") {
      CHECK(entry.path().stem().string() == c.model.flavor);
      CHECK(c.training.mixed_precision_param == "bfloat16");
      CHECK(c.training.dataset == "shard");
      CHECK_FALSE(c.training.dataset_path.empty());
      CHECK(c.training.steps == 1000);
      CHECK(c.lr_scheduler.warmup_steps == 200);
      CHECK(c.training.seq_len == (c.model.flavor.rfind("llama2", 0) == 0 ? 4096 : 8192));
    }
    // Every shipped file survives the round trip too.
    CHECK(parse_config(to_toml(c), "dump.toml", {}) == c);
  }
  std::set<std::string> expected;
  for (const auto& a : tessera::nn::model_flavors()) expected.insert(a.flavor);
  CHECK(flavors == expected);
  // One file per flavor, and debug_chat.toml (the debug model fine-tuned on chat data).
  CHECK(files == static_cast<int>(expected.size()) + 1);

  auto lr_of = [&](const char* name) { return load_config((dir / name).string(), {}).optimizer.lr; };
  CHECK(lr_of("llama3_8b.toml") == 3e-4);
  CHECK(lr_of("llama3_70b.toml") == 1.5e-4);
  CHECK(lr_of("llama3.1_405b.toml") == 8e-5);
}

TEST_CASE("debug_model.toml is the default job: the debug shape on the embedded corpus, runnable here") {
  JobConfig c = load_config((source_dir() / "examples" / "configs" / "debug_model.toml").string(), {});
  CHECK(c.model.flavor == "debugmodel");
  CHECK(c.model.args.dim == 256);
  CHECK(c.model.args.n_layers == 6);
  CHECK(c.model.args.n_heads == 16);
  CHECK(c.training.mixed_precision_param == "float32");
  CHECK(c.training.dataset == "synthetic");
  CHECK(c.activation_checkpoint.mode == "none");
  CHECK(c.checkpoint.enable);
  // Overrides work on top of it as they would from llama-train.
  JobConfig o = load_config("", {"--config", (source_dir() / "examples" / "configs" / "debug_model.toml").string(),
                                 "--training.steps", "10"});
  CHECK(o.training.steps == 10);
  CHECK(o.training.seq_len == c.training.seq_len);
}

}  // namespace test_config
