// llama-checkpoint: looks into, verifies and converts llama-train's sharded training
// checkpoints (checkpoint/sharded.hpp, docs/checkpoints.md).
//
//   llama-checkpoint list PATH [--step N] [--checksums]
//   llama-checkpoint verify PATH [--step N]
//   llama-checkpoint convert PATH --to hf OUTDIR | --to safetensors FILE
//                    [--dtype float32|bfloat16] [--tokenizer FILE] [--step N] [--force]
//
// PATH is a run's checkpoint folder (the `step-<N>` folders llama-train writes under
// <dump_folder>/checkpoint; the dump folder itself is taken for its checkpoint/), or one
// step folder. A command on a run folder works on its latest complete checkpoint, or
// step N's with --step. `convert` loads the checkpoint into one fp32 model on the CPU,
// whatever layout saved it, and writes it whole: a model.safetensors as llama-train's
// final save (train::save_model), or a Hugging Face Llama directory (train::save_hf_model).
// Both load in llama-generate and llama-eval.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/folder.hpp"
#include "tessera/checkpoint/hf.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/checkpoint/sharded.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"

using namespace tessera;
namespace fs = std::filesystem;

namespace {

void usage() {
  std::printf(
      "usage: llama-checkpoint list PATH [--step N] [--checksums]\n"
      "       llama-checkpoint verify PATH [--step N]\n"
      "       llama-checkpoint convert PATH --to hf OUTDIR | --to safetensors FILE\n"
      "                        [--dtype float32|bfloat16] [--tokenizer FILE] [--step N] [--force]\n\n"
      "Looks into, verifies and converts the sharded checkpoints llama-train writes.\n"
      "PATH is a run's checkpoint folder (holding step-N folders; a dump folder is taken for\n"
      "its checkpoint/ folder) or one step-N folder.\n\n"
      "  list      a run folder: each step folder, complete or not, the world size that saved\n"
      "            it and its size; then, as for a step folder, the latest complete checkpoint\n"
      "            (or step N's): the model, the training state and its settings, the state\n"
      "            families, the files and each parameter's shape, dtype and stretches\n"
      "  verify    reads every complete checkpoint (or the one PATH or --step names) and checks\n"
      "            the CRC-32C of every tensor; incomplete folders are reported, not failed\n"
      "  convert   loads the latest complete checkpoint (or step N's) into one fp32 model and\n"
      "            writes it whole: --to safetensors FILE (a model.safetensors as llama-train\n"
      "            writes) or --to hf OUTDIR (a Hugging Face Llama directory)\n\n"
      "  --step N          the checkpoint of step N in a run folder\n"
      "  --checksums       list: every tensor's CRC-32C too\n"
      "  --dtype D         convert: float32 (default) or bfloat16, as stored in the output\n"
      "  --tokenizer FILE  convert --to hf: its files for transformers written into OUTDIR\n"
      "                    (tokenizer.model and/or tokenizer.json, tokenizer_config.json)\n"
      "  --force           convert: replace OUT if it exists\n");
}

// ---------------------------------------------------------------------------------
// Text.

std::string size_text(std::uint64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes < 1000) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else if (b < 1e6) std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  else if (b < 1e9) std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  return buf;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// A JSON value as a cell: strings unquoted, the rest as JSON.
std::string json_text(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

/// Rows printed in aligned columns; `align` holds 'l' or 'r' per column.
class Table {
 public:
  Table(std::vector<std::string> header, std::string align) : align_(std::move(align)) {
    rows_.push_back(std::move(header));
  }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(const char* indent = "  ") const {
    std::vector<std::size_t> width;
    for (const auto& row : rows_)
      for (std::size_t c = 0; c < row.size(); ++c) {
        if (width.size() <= c) width.push_back(0);
        width[c] = std::max(width[c], row[c].size());
      }
    for (const auto& row : rows_) {
      std::string line = indent;
      for (std::size_t c = 0; c < row.size(); ++c) {
        const bool right = c < align_.size() && align_[c] == 'r';
        const std::string pad(width[c] - row[c].size(), ' ');
        const bool last = c + 1 == row.size();
        line += right ? pad + row[c] : (last ? row[c] : row[c] + pad);
        if (!last) line += "  ";
      }
      std::printf("%s\n", line.c_str());
    }
  }

 private:
  std::string align_;
  std::vector<std::vector<std::string>> rows_;
};

/// Parameters in the model's order: the embedding, the layers by number, the norm, the
/// output; within a layer by name.
bool model_order(const std::string& a, const std::string& b) {
  auto group = [](const std::string& n) {
    return n.rfind("tok_embeddings", 0) == 0 ? 0 : n.rfind("layers.", 0) == 0 ? 1 : n.rfind("norm", 0) == 0 ? 2 : 3;
  };
  if (group(a) != group(b)) return group(a) < group(b);
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) && std::isdigit(static_cast<unsigned char>(b[j]))) {
      std::size_t i2 = i, j2 = j;
      while (i2 < a.size() && std::isdigit(static_cast<unsigned char>(a[i2]))) ++i2;
      while (j2 < b.size() && std::isdigit(static_cast<unsigned char>(b[j2]))) ++j2;
      const std::string x = a.substr(i, i2 - i), y = b.substr(j, j2 - j);
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      i = i2;
      j = j2;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

std::string model_text(const nn::ModelArgs& a) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "%s: %lld layers, dim %lld, %lld heads (%lld kv), ffn %lld, vocab %lld%s, %.2fM parameters",
                a.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
                static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
                static_cast<long long>(a.ffn_hidden_dim()), static_cast<long long>(a.vocab_size),
                a.tie_embeddings ? ", tied embeddings" : "", static_cast<double>(a.num_params()) / 1e6);
  return buf;
}

// ---------------------------------------------------------------------------------
// Folders.

/// What PATH names: a run's checkpoint folder (run set) or one step folder (step set).
struct Target {
  fs::path run;
  fs::path step;
};

/// N of `model-rank<R>-of-<N>.safetensors`, or nothing.
std::optional<int> world_of_file(const std::string& name) {
  const std::string head = "model-rank", tail = ".safetensors";
  if (name.rfind(head, 0) != 0 || name.size() <= head.size() + tail.size() ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
    return std::nullopt;
  const std::size_t of = name.find("-of-");
  if (of == std::string::npos) return std::nullopt;
  const std::string n = name.substr(of + 4, name.size() - tail.size() - of - 4);
  if (n.empty() || n.size() > 9 || n.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(n);
}

/// A folder named like a step folder, or holding a marker or a rank's file.
bool is_step_folder(const fs::path& dir) {
  std::error_code ec;
  if (train::step_folder_number(dir.filename().string())) return true;
  if (fs::exists(dir / train::sharded::kCompleteMarker, ec)) return true;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (world_of_file(e.path().filename().string())) return true;
  return false;
}

Target resolve(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  while (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();  // "dir/"
  TESSERA_CHECK(fs::exists(p, ec), path, ": no such file or directory");
  TESSERA_CHECK(fs::is_directory(p, ec), path,
                ": not a directory (expected a run's checkpoint folder holding step-N folders, or one step-N folder)");
  if (is_step_folder(p)) return {{}, p};
  if (!train::list_saved_steps(p).empty()) return {p, {}};
  if (!train::list_saved_steps(p / "checkpoint").empty()) return {p / "checkpoint", {}};
  fail(path, ": neither a run's checkpoint folder (no step-N folders in it) nor a step folder (no ",
       train::sharded::kCompleteMarker, " marker, no model-rank<R>-of-<N>.safetensors files)");
}

/// The world size that saved a step folder: its marker's, else its files' names; 0 if unknown.
int saved_world(const fs::path& dir) {
  std::error_code ec;
  if (std::ifstream in(dir / train::sharded::kCompleteMarker); in) {
    try {
      nlohmann::json j;
      in >> j;
      return j.at("world_size").get<int>();
    } catch (const std::exception&) {
      return 0;
    }
  }
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (const auto n = world_of_file(e.path().filename().string())) return *n;
  return 0;
}

std::uint64_t folder_bytes(const fs::path& dir) {
  std::error_code ec;
  std::uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  return total;
}

std::string state_text(const train::SavedStep& s) {
  if (s.complete) return "complete";
  return s.partial ? "partial (a save that did not finish)" : "incomplete (no COMPLETE marker)";
}

std::string steps_text(const std::vector<train::SavedStep>& steps) {
  std::string out;
  for (const train::SavedStep& s : steps)
    if (s.complete) out += (out.empty() ? "" : ", ") + std::to_string(s.step);
  return out.empty() ? "none complete" : "complete: " + out;
}

/// The step folder a command works on: PATH's own, step N's of the run folder, or the
/// run folder's latest complete one (nothing if it has none).
std::optional<fs::path> chosen_step(const Target& t, std::optional<std::int64_t> step) {
  if (!t.step.empty()) {
    TESSERA_CHECK(!step, "--step: ", t.step.string(), " is one step folder already (give --step with a run folder)");
    return t.step;
  }
  const std::vector<train::SavedStep> steps = train::list_saved_steps(t.run);
  if (step) {
    for (const train::SavedStep& s : steps)
      if (s.step == *step && !s.partial) return s.path;
    for (const train::SavedStep& s : steps)
      if (s.step == *step) return s.path;
    fail(train::step_path(t.run, *step).string(), ": --step ", *step, " names no checkpoint here (",
         steps_text(steps), ")");
  }
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    if (it->complete) return it->path;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------
// list

void list_run(const fs::path& run) {
  const std::vector<train::SavedStep> steps = train::list_saved_steps(run);
  std::printf("%s: %zu step folder%s\n", run.string().c_str(), steps.size(), steps.size() == 1 ? "" : "s");
  Table t({"step", "state", "world", "size", "folder"}, "rlrrl");
  for (const train::SavedStep& s : steps) {
    const int world = saved_world(s.path);
    t.add({std::to_string(s.step), state_text(s), world > 0 ? std::to_string(world) : "?",
           size_text(folder_bytes(s.path)), s.path.filename().string()});
  }
  t.print();
}

void list_step(const fs::path& dir, bool checksums) {
  const std::string d = dir.string();
  const train::sharded::Index index = train::sharded::read_index(d);
  const nn::ModelArgs a = train::model_args_from_json(index.model_args, d);
  std::printf("%s\n\n", d.c_str());
  std::printf("model     %s\n", model_text(a).c_str());
  std::printf("saved by  %zu rank%s\n", index.files.size(), index.files.size() == 1 ? "" : "s");

  const nlohmann::json& state = index.state;
  if (!state.is_object()) {
    std::printf("\ntraining state: none (a model-only checkpoint)\n");
  } else {
    std::printf("\ntraining state\n");
    Table t({"key", "value"}, "lr");
    std::set<std::string> shown;
    for (const char* key : {"step", "lr_step", "data_position", "optimizer_steps"})
      if (state.contains(key)) {
        t.add({key, json_text(state.at(key))});
        shown.insert(key);
      }
    for (const auto& [key, value] : state.items())
      if (!shown.count(key) && key != "config") t.add({key, json_text(value)});
    t.print();
    if (state.contains("config") && state.at("config").is_object() && !state.at("config").empty()) {
      std::printf("\nsettings saved with it (a resume must keep them)\n");
      Table c({"setting", "value", "part"}, "lll");
      for (const auto& [key, value] : state.at("config").items()) {
        // Each is [value, the part of the state it belongs to].
        if (value.is_array() && value.size() == 2) c.add({key, value.at(0).dump(), json_text(value.at(1))});
        else c.add({key, value.dump(), ""});
      }
      c.print();
    }
  }

  // Per parameter, its stretches (file, key) in order; per family, its dtypes and bytes.
  std::map<std::string, std::vector<std::pair<std::size_t, std::string>>> stretches;
  for (const auto& [name, runs] : index.runs)
    for (const train::sharded::SavedRun& r : runs) {
      auto& v = stretches[name];
      if (std::find(v.begin(), v.end(), std::make_pair(r.file, r.key)) == v.end()) v.emplace_back(r.file, r.key);
    }
  auto stored = [](const std::string& family, const std::string& key) {
    return family.empty() ? key : family + "/" + key;
  };

  std::printf("\nfamilies (stored beside each stretch)\n");
  Table fam({"family", "dtype", "bytes", "size"}, "llrr");
  for (const std::string& family : index.families) {
    std::set<std::string> dtypes;
    std::uint64_t bytes = 0;
    for (const auto& [name, list] : stretches)
      for (const auto& [file, key] : list) {
        if (!family.empty() && index.values_only.count(name)) continue;  // frozen (LoRA): its values alone
        const io::TensorEntry& e = index.files[file].entry(stored(family, key));
        dtypes.insert(std::string(io::name_of(e.dtype)));
        bytes += e.byte_size();
      }
    std::string dtype;
    for (const std::string& x : dtypes) dtype += (dtype.empty() ? "" : "+") + x;
    fam.add({family.empty() ? "values" : family, dtype, std::to_string(bytes), size_text(bytes)});
  }
  fam.print();

  std::printf("\nfiles\n");
  Table files({"file", "tensors", "bytes", "size"}, "lrrr");
  std::uint64_t total = 0;
  std::size_t tensors = 0;
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    std::error_code ec;
    const std::uint64_t bytes = fs::file_size(index.files[i].path(), ec);
    total += bytes;
    tensors += index.files[i].tensors().size();
    files.add({fs::path(index.files[i].path()).filename().string(), std::to_string(index.files[i].tensors().size()),
               std::to_string(bytes), size_text(bytes)});
  }
  files.add({"total", std::to_string(tensors), std::to_string(total), size_text(total)});
  files.print();

  std::vector<std::string> names;
  for (const auto& [name, shape] : index.shapes) names.push_back(name);
  std::sort(names.begin(), names.end(), model_order);
  std::printf("\nparameters (%zu)\n", names.size());
  Table params({"parameter", "shape", "dtype", "stretches", "bytes"}, "llrrr");
  for (const std::string& name : names) {
    std::set<std::string> dtypes;
    std::uint64_t bytes = 0;
    const auto& list = stretches[name];
    for (const auto& [file, key] : list) {
      const io::TensorEntry& e = index.files[file].entry(key);
      dtypes.insert(std::string(io::name_of(e.dtype)));
      bytes += e.byte_size();
    }
    std::string dtype;
    for (const std::string& x : dtypes) dtype += (dtype.empty() ? "" : "+") + x;
    // A frozen parameter (LoRA) is saved without optimizer state.
    params.add({index.values_only.count(name) ? name + " (frozen)" : name, shape_text(index.shapes.at(name)), dtype,
                std::to_string(list.size()), std::to_string(bytes)});
  }
  params.print();

  if (checksums) {
    std::printf("\nchecksums (CRC-32C of each tensor's stored bytes, as the file's index records them)\n");
    Table c({"file", "tensor", "bytes", "crc32c"}, "llrl");
    for (std::size_t i = 0; i < index.files.size(); ++i) {
      const std::string file = fs::path(index.files[i].path()).filename().string();
      for (const auto& [key, crc] : index.crcs[i]) {
        char hex[16];
        std::snprintf(hex, sizeof hex, "%08x", static_cast<unsigned>(crc));
        const std::string bytes =
            index.files[i].contains(key) ? std::to_string(index.files[i].entry(key).byte_size()) : "missing";
        c.add({file, key, bytes, hex});
      }
    }
    c.print();
  }
}

int list(const Target& t, std::optional<std::int64_t> step, bool checksums) {
  if (!t.run.empty()) {
    list_run(t.run);
    const std::optional<fs::path> dir = chosen_step(t, step);
    if (!dir) {
      std::printf("\nno complete checkpoint to show\n");
      return 0;
    }
    std::printf("\n%s ", step ? "checkpoint" : "latest complete checkpoint:");
    list_step(*dir, checksums);
    return 0;
  }
  list_step(*chosen_step(t, step), checksums);
  return 0;
}

// ---------------------------------------------------------------------------------
// verify

/// Reads and checks one step folder; prints its "ok" line or throws.
void verify_step(const fs::path& dir) {
  const std::string d = dir.string();
  const train::sharded::Index index = train::sharded::read_index(d);
  train::model_args_from_json(index.model_args, d);
  const std::uint64_t bytes = index.check_all();
  std::size_t tensors = 0;
  for (const auto& crcs : index.crcs) tensors += crcs.size();
  std::printf("ok %s: %zu file%s, %zu tensors, %s checked\n", dir.filename().string().c_str(), index.files.size(),
              index.files.size() == 1 ? "" : "s", tensors, size_text(bytes).c_str());
}

int verify(const Target& t, std::optional<std::int64_t> step) {
  if (!t.step.empty() || step) {
    verify_step(*chosen_step(t, step));  // named directly: an incomplete folder is an error
    return 0;
  }
  int failed = 0, verified = 0;
  for (const train::SavedStep& s : train::list_saved_steps(t.run)) {
    if (!s.complete) {
      std::fflush(stdout);
      std::fprintf(stderr, "llama-checkpoint: warning: %s: %s, not verified\n", s.path.string().c_str(),
                   s.partial ? "a save that did not finish (or is being written)"
                             : "no COMPLETE marker (an interrupted save)");
      continue;
    }
    try {
      verify_step(s.path);
      ++verified;
    } catch (const std::exception& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "llama-checkpoint: error: %s\n", e.what());
      ++failed;
    }
  }
  TESSERA_CHECK(verified + failed > 0, t.run.string(), ": no complete checkpoint to verify");
  return failed > 0 ? 1 : 0;
}

// ---------------------------------------------------------------------------------
// convert

struct ConvertOptions {
  std::string to, out, tokenizer;
  DType dtype = DType::f32;
  bool force = false;
};

/// The LoRA settings a checkpoint holding adapters was trained with (its training state's
/// "lora", Trainer::reported_settings); none where it holds no adapters.
nn::LoraPolicy lora_of(const train::sharded::Index& index, const std::string& dir) {
  const bool adapters = std::any_of(index.shapes.begin(), index.shapes.end(),
                                    [](const auto& s) { return nn::is_lora_name(s.first); });
  if (!adapters) return {};
  const nlohmann::json* saved = nullptr;
  if (index.state.is_object() && index.state.contains("config") && index.state.at("config").contains("lora"))
    saved = &index.state.at("config").at("lora").at(0);
  TESSERA_CHECK(saved != nullptr, dir, ": holds LoRA adapters but not their settings (lora.alpha shows in no tensor): "
                "convert a training checkpoint of the run, or its final model.safetensors (merged already)");
  try {
    return nn::LoraPolicy{true, saved->at("rank").get<std::int64_t>(), saved->at("alpha").get<double>(),
                          saved->at("target_modules").get<std::vector<std::string>>()};
  } catch (const nlohmann::json::exception& e) {
    fail(dir, ": the training state's lora settings are malformed: ", e.what());
  }
}

int convert(const Target& t, std::optional<std::int64_t> step, const ConvertOptions& o) {
  std::error_code ec;
  TESSERA_CHECK(!o.to.empty(), "convert: --to hf OUTDIR or --to safetensors FILE is required");
  TESSERA_CHECK(o.tokenizer.empty() || o.to == "hf",
                "--tokenizer: only with --to hf (a safetensors file holds no tokenizer)");
  TESSERA_CHECK(o.tokenizer.empty() || fs::is_regular_file(o.tokenizer, ec), "--tokenizer ", o.tokenizer,
                ": no such file");
  if (fs::exists(o.out, ec) || fs::is_symlink(o.out, ec)) {
    TESSERA_CHECK(o.force, o.out, ": exists (give --force to replace it)");
    TESSERA_CHECK(o.to == "hf" || !fs::is_directory(o.out, ec), o.out, ": is a directory, not a safetensors file");
  }
  const std::optional<fs::path> dir = chosen_step(t, step);
  TESSERA_CHECK(dir, t.run.string(), ": no complete checkpoint to convert (",
                steps_text(train::list_saved_steps(t.run)), ")");
  if (!t.run.empty() && !step)
    for (const train::SavedStep& s : train::list_saved_steps(t.run))
      if (s.step > train::step_folder_number(dir->filename().string()).value_or(0) && !s.complete)
        std::fprintf(stderr, "llama-checkpoint: warning: %s: %s; converting the latest complete one\n",
                     s.path.string().c_str(), state_text(s).c_str());
  const std::string d = dir->string();
  const train::sharded::Index index = train::sharded::read_index(d);
  const nn::ModelArgs a = train::model_args_from_json(index.model_args, d);
  // A LoRA run's checkpoint: its adapters, merged into the weights on the way out.
  parallel::Plan plan;
  plan.lora = lora_of(index, d);
  nn::Transformer<float, Cpu> model(a, plan);
  // A bf16 run's checkpoint holds the optimizer's fp32 masters: the weights themselves,
  // of which its bf16 values are the rounding.
  const bool masters = train::load_sharded_model(model, d, true);
  if (o.to == "hf") {
    train::HfSaveOptions hf;
    hf.dtype = o.dtype;
    hf.tokenizer_file = o.tokenizer;
    train::save_hf_model(model, o.out, hf);
  } else {
    train::save_model(model, o.out, o.dtype);
  }
  std::printf("wrote %s: %s, %s, from %s%s (%s)\n", o.out.c_str(),
              o.to == "hf" ? "Hugging Face Llama directory" : "safetensors",
              o.dtype == DType::bf16 ? "bfloat16" : "float32", d.c_str(),
              masters ? " (its fp32 masters)" : "", model_text(a).c_str());
  return 0;
}

// ---------------------------------------------------------------------------------

std::int64_t parse_step(const std::string& text) {
  std::size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(used == text.size() && used > 0 && text[0] != '-' && text[0] != '+',
                "--step: expected a step number, got '", text, "'");
  return v;
}

int run(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
  TESSERA_CHECK(!args.empty(), "a command is required: list, verify or convert (see --help)");
  const std::string command = args[0];
  TESSERA_CHECK(command == "list" || command == "verify" || command == "convert", "unknown command '", command,
                "' (expected list, verify or convert; see --help)");
  std::string path;
  std::optional<std::int64_t> step;
  bool checksums = false;
  ConvertOptions o;
  std::string dtype = "float32";
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const char* what) -> const std::string& {
      TESSERA_CHECK(i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0, a, ": missing ", what,
                    i + 1 < args.size() ? " (got the option '" + args[i + 1] + "')" : std::string());
      return args[++i];
    };
    auto only = [&](bool ok, const char* commands) {
      TESSERA_CHECK(ok, a, ": only for ", commands, ", not ", command, " (see --help)");
    };
    if (a == "--step") {
      step = parse_step(value("step number"));
    } else if (a == "--checksums") {
      only(command == "list", "list");
      checksums = true;
    } else if (a == "--to") {
      only(command == "convert", "convert");
      o.to = value("output kind (hf or safetensors)");
      TESSERA_CHECK(o.to == "hf" || o.to == "safetensors", "--to: expected hf or safetensors, got '", o.to, "'");
      o.out = value(o.to == "hf" ? "output directory" : "output file");
      TESSERA_CHECK(!o.out.empty(), "--to ", o.to, ": the output path is empty");
    } else if (a == "--dtype") {
      only(command == "convert", "convert");
      dtype = value("dtype");
      TESSERA_CHECK(dtype == "float32" || dtype == "bfloat16", "--dtype: expected float32 or bfloat16, got '", dtype,
                    "'");
      o.dtype = dtype == "bfloat16" ? DType::bf16 : DType::f32;
    } else if (a == "--tokenizer") {
      only(command == "convert", "convert");
      o.tokenizer = value("tokenizer file");
    } else if (a == "--force") {
      only(command == "convert", "convert");
      o.force = true;
    } else if (a.size() > 1 && a[0] == '-') {
      fail("unknown option '", a, "' (see --help)");
    } else {
      TESSERA_CHECK(path.empty(), "unexpected argument '", a, "' (", command, " takes one PATH; see --help)");
      path = a;
    }
  }
  TESSERA_CHECK(!path.empty(), command, ": PATH is required (a run's checkpoint folder or a step-N folder)");
  const Target t = resolve(path);
  if (command == "list") return list(t, step, checksums);
  if (command == "verify") return verify(t, step);
  return convert(t, step, o);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "llama-checkpoint: error: %s\n", e.what());
    return 1;
  }
}
