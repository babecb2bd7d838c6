// A machine profile: the rates llama-plan prices a traced training step with.
//
// GPU profiles are TOML files (examples/machines/*.toml; built into llama-plan, and any
// FILE.toml of the same form). Every figure carries its source, and the loader refuses a
// profile whose figure is missing, not a positive number, or has no source, naming the
// file and the key:
//
//   [machine]                 name, description, device = "cuda"; optional
//                             compute_capability = "9.0" (the rules training.attention
//                             applies: backend/cuda/attention_choice.hpp; without it,
//                             sm_80's)
//   [memory.capacity_bytes]   device memory, and [memory.reserved_bytes] what the CUDA
//                             context, library workspaces and allocator slack take first
//   [compute.bf16_tflops]     dense tensor-core peak; [compute.fp32_tflops] CUDA cores;
//   [compute.sm_count], [compute.boost_clock_ghz],
//   [compute.shared_memory_bytes_per_clock_per_sm]
//   [gemm.bf16_efficiency]    points = [[gflop, fraction], ...]: the fraction of the peak
//   [gemm.fp32_efficiency]    cuBLAS reaches by GEMM size (2 m n k / 1e9)
//   [compute.fp8_tflops]      optional, with [gemm.fp8_efficiency] (each needs the other):
//   [gemm.fp8_efficiency]     the dense float8 tensor-core peak and the fraction of it
//                             cuBLASLt's float8 matmul reaches by size. A GPU without float8
//                             tensor cores (A100) gives neither, and a float8 GEMM priced on
//                             it is refused, naming the profile and compute.fp8_tflops
//   [gemm.slowdown_beside_held_sms]  optional: points = [[held, ratio], ...], how many
//                             times as long a bf16 GEMM takes while `held` SMs are taken
//                             by blocks that stay (an NCCL collective's channels),
//                             measured (bench-kernels --sections sm-hold); without it,
//                             sm / (sm - held) (plan/timeline.hpp)
//   [hbm.bandwidth_gbs], [hbm.achieved_fraction]
//   [host.launch_us]          back-to-back kernel launches on one stream, per launch
//   [host.sync_us]            a small device-to-host copy and the stream wait it implies
//   [host.link_gbs]           host <-> device copies
//   [host.memory_gbs]         optional: the host memory bandwidth one rank's loops reach
//                             while every GPU's rank of the node runs them (CPU offload's
//                             optimizer, backend/host.hpp); without it an offloaded step
//                             is refused, naming the key
//   [attention.cudnn_bf16_hd<D>_forward], [attention.cudnn_bf16_hd<D>_backward]
//                             optional: cuDNN's causal flash attention in bf16 at head
//                             dim D, points = [[seq_len, tflops], ...] (FLOPs counted as
//                             trace::Attention counts them: causal pairs only; a full call
//                             is priced at the same rate, plan/cost.hpp); each head
//                             dim given both ways. Without them a step that would run
//                             cuDNN's attention is priced on tessera's own kernel, and
//                             llama-plan says so
//   [network.gpus_per_node]   optional, each key required once the section is there:
//   [network.nvlink_gbs]      the bus bandwidth NCCL reaches among one node's GPUs, and
//   [network.nvlink_latency_us]   the latency of one ring step (Simple protocol) there;
//   [network.network_gbs]     the network's bandwidth per GPU between nodes, and
//   [network.network_latency_us]  one ring step's latency over it (plan/cluster.hpp)
//   [network.nics_per_node]   optional: the NICs a node's GPUs reach the network by; a
//                             collective between nodes then holds SMs while it runs
//                             (plan/cluster.hpp, collective_sms), and without it none
//
// A profile may start from another: `base = "NAME"` in [machine] (a built-in profile's
// name where llama-plan reads it, a NAME.toml beside the profile, or a path relative to
// it) takes every figure of that profile, and each figure this one gives replaces the
// base's whole. The same GPU on another cluster is then its [network] alone
// (examples/machines/a100-80gb-p4de.toml). The profile names itself; a chain of bases
// ends within eight.
//
// Each figure is a table: { value = <number>, source = "<where it comes from>" } (the
// curves have `points` for `value`). The CPU's profile is not a file: plan/cpu.hpp
// measures it on the machine at hand.
#pragma once

#include <toml++/toml.h>  // toml++ v3 (Debian ships this name, not toml.hpp)

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"

namespace tessera::plan {

/// A figure and where it comes from.
struct Sourced {
  double value = 0;
  std::string source;
};

/// y at x on a curve of (x, y) points with x increasing: linear in log(x) between the
/// points, flat beyond the first and the last (points not empty).
inline double log_interpolate(const std::vector<std::array<double, 2>>& points, double x) {
  if (x <= points.front()[0]) return points.front()[1];
  if (x >= points.back()[0]) return points.back()[1];
  for (std::size_t i = 1; i < points.size(); ++i) {
    if (x > points[i][0]) continue;
    const double x0 = std::log(points[i - 1][0]), x1 = std::log(points[i][0]);
    const double t = (std::log(x) - x0) / (x1 - x0);
    return points[i - 1][1] + t * (points[i][1] - points[i - 1][1]);
  }
  return points.back()[1];
}

/// The fraction of a peak reached, as a function of a GEMM's size in GFLOP: linear in
/// log(size) between the points, flat beyond the first and the last.
struct EfficiencyCurve {
  std::vector<std::array<double, 2>> points;  // (gflop, fraction), gflop increasing
  std::string source;

  double at(double gflop) const { return points.empty() ? 1.0 : log_interpolate(points, gflop); }
};

/// A rate in TFLOP/s as a function of the sequence length: linear in log(seq_len) between
/// the points, flat beyond the first and the last.
struct RateCurve {
  std::vector<std::array<double, 2>> points;  // (seq_len, tflops), seq_len increasing
  std::string source;

  double at(double seq_len) const { return points.empty() ? 0.0 : log_interpolate(points, seq_len); }
};

/// How many times as long a GEMM takes while `held` SMs are held, as measured: linear
/// in held between (0, 1) and the points, then flat, and never under `spread`, the
/// ratio of the GEMM's work spread over the SMs left (sm / (sm - held)).
struct HeldSmSlowdown {
  std::vector<std::array<double, 2>> points;  // (held SMs, ratio), held increasing, ratio >= 1
  std::string source;

  double at(double held, double spread) const {
    if (held <= 0 || points.empty()) return std::max(1.0, spread);
    double x0 = 0, y0 = 1;
    for (const auto& [x, y] : points) {
      if (held <= x) return std::max(spread, y0 + (held - x0) / (x - x0) * (y - y0));
      x0 = x, y0 = y;
    }
    return std::max(spread, y0);
  }
};

/// cuDNN's causal attention at one head dim, forward and backward.
struct AttentionRates {
  RateCurve forward, backward;
};

/// How a cluster of these GPUs is joined (the [network] section; plan/cluster.hpp).
struct Network {
  Sourced gpus_per_node;
  Sourced nvlink_gbs, nvlink_latency_us;
  Sourced network_gbs, network_latency_us;
  std::optional<Sourced> nics_per_node;  // absent: collectives hold no SMs (plan/cluster.hpp)
};

/// A GPU's rates (device = cuda), as a machine file gives them.
struct Machine {
  std::string name;
  std::string description;
  std::string origin;  // the file it was read from, or "built in"
  Device device = Device::cuda;
  int cc_major = 0, cc_minor = 0;  // [machine] compute_capability; 0: not given

  Sourced capacity_bytes, reserved_bytes;
  Sourced bf16_tflops, fp32_tflops, sm_count, boost_clock_ghz, shared_memory_bytes_per_clock_per_sm;
  EfficiencyCurve gemm_bf16, gemm_fp32;
  std::optional<Sourced> fp8_tflops;          // absent: no float8 tensor cores
  std::optional<EfficiencyCurve> gemm_fp8;    // given exactly when fp8_tflops is
  std::optional<HeldSmSlowdown> gemm_beside_held_sms;  // absent: sm / (sm - held)
  Sourced hbm_gbs, hbm_fraction;
  Sourced launch_us, sync_us, host_link_gbs;
  std::optional<Sourced> host_memory_gbs;  // absent: host loops (CPU offload) are not priced
  std::map<std::int64_t, AttentionRates> cudnn_attention_bf16;  // by head dim; may be empty
  std::optional<Network> network;  // absent: one GPU's profile, no cluster

  /// The cuDNN rates for head dim `hd`: the smallest head dim given that is at least
  /// `hd`, else the largest (nullptr when the profile gives none).
  const AttentionRates* cudnn_attention_rates(std::int64_t hd) const {
    if (cudnn_attention_bf16.empty()) return nullptr;
    auto it = cudnn_attention_bf16.lower_bound(hd);
    if (it == cudnn_attention_bf16.end()) --it;
    return &it->second;
  }

  /// Whether the profile prices float8 GEMMs (compute.fp8_tflops and gemm.fp8_efficiency).
  bool has_float8() const { return fp8_tflops.has_value() && gemm_fp8.has_value(); }

  /// Bytes tensors may take: capacity less what is reserved before the first one.
  double usable_bytes() const { return capacity_bytes.value - reserved_bytes.value; }
  /// Bytes per second a streaming kernel reaches.
  double stream_bandwidth() const { return hbm_gbs.value * 1e9 * hbm_fraction.value; }
};

namespace detail {

/// Where a node was read: its own file (a figure taken from a base says the base's), else
/// `origin`, and its line.
inline std::string where(std::string_view origin, const toml::node& n) {
  std::string s = n.source().path ? *n.source().path : std::string(origin);
  if (n.source().begin.line > 0) s += tessera::detail::concat(":", n.source().begin.line);
  return s;
}

inline const toml::table& table_at(const toml::table& root, std::string_view origin, std::string_view section,
                                   std::string_view key) {
  const toml::node* s = root.get(section);
  const std::string name = tessera::detail::concat(section, ".", key);
  TESSERA_CHECK(s && s->is_table(), origin, ": machine profile: [", section, "] is missing (it holds [", name, "])");
  const toml::node* k = s->as_table()->get(key);
  TESSERA_CHECK(k, origin, ": machine profile: ", name, " is missing");
  TESSERA_CHECK(k->is_table(), where(origin, *k), ": machine profile: ", name,
                " must be a table { value = <number>, source = \"...\" }");
  return *k->as_table();
}

inline std::string source_of(const toml::table& t, std::string_view origin, std::string_view name) {
  const toml::node* src = t.get("source");
  TESSERA_CHECK(src && src->is_string() && !src->as_string()->get().empty(), where(origin, t), ": machine profile: ",
                name, " has no source (every figure names where it comes from)");
  return src->as_string()->get();
}

inline Sourced read_rate(const toml::table& root, std::string_view origin, std::string_view section,
                         std::string_view key) {
  const toml::table& t = table_at(root, origin, section, key);
  const std::string name = tessera::detail::concat(section, ".", key);
  const toml::node* v = t.get("value");
  TESSERA_CHECK(v, where(origin, t), ": machine profile: ", name, " has no value");
  std::optional<double> x = v->value<double>();
  TESSERA_CHECK(x.has_value(), where(origin, *v), ": machine profile: ", name, ".value must be a number");
  TESSERA_CHECK(std::isfinite(*x) && *x > 0, where(origin, *v), ": machine profile: ", name,
                ".value must be a positive number, got ", *x);
  return {*x, source_of(t, origin, name)};
}

/// The `points` of table `t` (figure `name`): a non-empty list of [x, y] pairs of numbers,
/// x positive and increasing, y positive and at most `y_max`; `pair` names them in
/// errors ("gflop, fraction").
inline std::vector<std::array<double, 2>> read_points(const toml::table& t, std::string_view origin,
                                                     const std::string& name, std::string_view pair, double y_max) {
  const toml::array* pts = t.get_as<toml::array>("points");
  TESSERA_CHECK(pts && !pts->empty(), where(origin, t), ": machine profile: ", name,
                ".points must be a non-empty list of [", pair, "] pairs");
  std::vector<std::array<double, 2>> out;
  for (std::size_t i = 0; i < pts->size(); ++i) {
    const toml::array* p = (*pts)[i].as_array();
    std::optional<double> x = p && p->size() == 2 ? (*p)[0].value<double>() : std::nullopt;
    std::optional<double> y = p && p->size() == 2 ? (*p)[1].value<double>() : std::nullopt;
    TESSERA_CHECK(x && y, where(origin, (*pts)[i]), ": machine profile: ", name, ".points[", i, "] must be a pair [",
                  pair, "] of numbers");
    // Finite too: TOML spells inf and nan, and an infinite rate would price a kernel at no time.
    TESSERA_CHECK(std::isfinite(*x) && std::isfinite(*y) && *x > 0 && *y > 0 && *y <= y_max, where(origin, (*pts)[i]),
                  ": machine profile: ", name, ".points[", i, "]: ", pair, " must be positive and finite",
                  y_max < 1e300 ? tessera::detail::concat(", the second at most ", y_max) : "", ", got [", *x, ", ", *y,
                  "]");
    TESSERA_CHECK(out.empty() || *x > out.back()[0], where(origin, (*pts)[i]), ": machine profile: ", name,
                  ".points must have increasing ", pair.substr(0, pair.find(',')));
    out.push_back({*x, *y});
  }
  return out;
}

inline EfficiencyCurve read_curve(const toml::table& root, std::string_view origin, std::string_view section,
                                  std::string_view key) {
  const toml::table& t = table_at(root, origin, section, key);
  const std::string name = tessera::detail::concat(section, ".", key);
  EfficiencyCurve c;
  c.points = read_points(t, origin, name, "gflop, fraction", 1.0);
  c.source = source_of(t, origin, name);
  return c;
}

/// The optional [attention] section: cudnn_bf16_hd<D>_forward / _backward rate curves.
inline std::map<std::int64_t, AttentionRates> read_attention(const toml::table& root, std::string_view origin) {
  std::map<std::int64_t, AttentionRates> rates;
  const toml::node* section = root.get("attention");
  if (!section) return rates;
  TESSERA_CHECK(section->is_table(), where(origin, *section), ": machine profile: [attention] must be a table");
  std::map<std::int64_t, int> given;  // head dim -> 1 forward | 2 backward
  for (const auto& [k, node] : *section->as_table()) {
    const std::string key(k.str());
    const std::string name = "attention." + key;
    constexpr std::string_view prefix = "cudnn_bf16_hd";
    std::int64_t hd = 0;
    bool backward = false;
    bool ok = key.rfind(prefix, 0) == 0;
    if (ok) {
      const std::size_t us = key.find('_', prefix.size());
      const std::string digits = key.substr(prefix.size(), us == std::string::npos ? std::string::npos : us - prefix.size());
      const std::string dir = us == std::string::npos ? "" : key.substr(us + 1);
      ok = !digits.empty() && digits.size() <= 4 && digits.find_first_not_of("0123456789") == std::string::npos &&
           (dir == "forward" || dir == "backward");
      if (ok) {
        hd = std::stoll(digits);
        backward = dir == "backward";
        ok = hd > 0;
      }
    }
    TESSERA_CHECK(ok, where(origin, node), ": machine profile: unknown key ", name,
                  " (expected cudnn_bf16_hd<head dim>_forward or _backward)");
    TESSERA_CHECK(node.is_table(), where(origin, node), ": machine profile: ", name,
                  " must be a table { points = [[seq_len, tflops], ...], source = \"...\" }");
    const toml::table& t = *node.as_table();
    RateCurve c;
    c.points = read_points(t, origin, name, "seq_len, tflops", std::numeric_limits<double>::infinity());
    c.source = source_of(t, origin, name);
    (backward ? rates[hd].backward : rates[hd].forward) = std::move(c);
    given[hd] |= backward ? 2 : 1;
  }
  for (const auto& [hd, mask] : given)
    TESSERA_CHECK(mask == 3, origin, ": machine profile: attention.cudnn_bf16_hd", hd, "_",
                  mask == 1 ? "backward" : "forward", " is missing (each head dim needs both directions)");
  return rates;
}

}  // namespace detail

/// A profile's text and the name it goes by in errors.
struct MachineText {
  std::string text, origin;
};

/// Finds the profile a [machine] base names, from the profile read as `from`: nullopt when
/// there is none of that name.
using MachineResolver = std::function<std::optional<MachineText>(std::string_view base, std::string_view from)>;

namespace detail {

/// A file's whole text; nullopt when it cannot be opened.
inline std::optional<std::string> file_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in.good()) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace detail

/// The base as a file beside the profile: a path relative to the profile's folder, a bare
/// NAME as NAME.toml there.
inline std::optional<MachineText> machine_beside(std::string_view base, std::string_view from) {
  std::filesystem::path p(base);
  if (p.extension() != ".toml" && !p.has_parent_path()) p += ".toml";
  if (p.is_relative()) p = std::filesystem::path(from).parent_path() / p;
  std::optional<std::string> text = detail::file_text(p);
  if (!text) return std::nullopt;
  return MachineText{std::move(*text), p.string()};
}

namespace detail {

inline toml::table parse_profile(std::string_view text, std::string_view origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::string at(origin);
    if (e.source().begin.line > 0) at += tessera::detail::concat(":", e.source().begin.line);
    fail(at, ": TOML syntax error: ", e.description());
  }
}

/// `root` over the profile its [machine] base names (and that one's base, ...): each figure
/// root gives replaces the base's, [machine]'s keys one by one.
inline toml::table with_base(toml::table root, std::string_view origin, const MachineResolver& resolve, int depth = 0) {
  const toml::table* head = root.get_as<toml::table>("machine");
  const toml::node* b = head ? head->get("base") : nullptr;
  if (!b) return root;
  TESSERA_CHECK(b->is_string() && !b->as_string()->get().empty(), where(origin, *b),
                ": machine profile: machine.base must name a profile (a built-in name or a FILE.toml)");
  const std::string base = b->as_string()->get();
  TESSERA_CHECK(depth < 8, where(origin, *b), ": machine profile: machine.base = \"", base,
                "\": more than eight bases in a chain (does a profile name itself?)");
  const auto* name = head->get_as<std::string>("name");
  TESSERA_CHECK(name && !name->get().empty(), origin, ": machine profile: machine.name is missing (a profile with a "
                "base names itself)");
  const std::optional<MachineText> found = resolve(base, origin);
  TESSERA_CHECK(found.has_value(), where(origin, *b), ": machine profile: machine.base = \"", base,
                "\": no such profile (a built-in name, a NAME.toml beside this file, or a path)");
  toml::table merged = with_base(parse_profile(found->text, found->origin), found->origin, resolve, depth + 1);
  for (auto&& [section, node] : root) {
    toml::table* into = merged.get_as<toml::table>(section);
    if (!node.is_table() || !into) {  // a section the base lacks, or one the reader will refuse
      merged.insert_or_assign(section, node);
      continue;
    }
    for (auto&& [key, value] : *node.as_table())
      if (!(section == "machine" && key == "base")) into->insert_or_assign(key, value);
  }
  return merged;
}

}  // namespace detail

/// Reads a GPU profile from TOML text; `origin` names it in errors ("h100.toml"), and a
/// [machine] base is found by `resolve`.
inline Machine parse_machine(std::string_view text, std::string_view origin,
                             const MachineResolver& resolve = machine_beside) {
  const toml::table root = detail::with_base(detail::parse_profile(text, origin), origin, resolve);
  Machine m;
  m.origin = std::string(origin);
  const toml::table* head = root.get_as<toml::table>("machine");
  TESSERA_CHECK(head, origin, ": machine profile: [machine] is missing (name, description, device)");
  const auto* name = head->get_as<std::string>("name");
  TESSERA_CHECK(name && !name->get().empty(), origin, ": machine profile: machine.name is missing");
  m.name = name->get();
  if (const auto* d = head->get_as<std::string>("description")) m.description = d->get();
  const auto* device = head->get_as<std::string>("device");
  TESSERA_CHECK(device && device->get() == "cuda", origin, ": machine profile: machine.device must be \"cuda\" (the CPU's "
                "profile is measured: --machine cpu)");
  if (const toml::node* cc = head->get("compute_capability")) {
    // "<major>.<minor>": a major of one to three digits, a minor of one (from_chars, not
    // sscanf, whose %d is undefined past an int).
    const auto* text = cc->as_string();
    int major = 0, minor = 0;
    bool ok = false;
    if (text) {
      const std::string& t = text->get();
      const std::size_t dot = t.find('.');
      ok = dot != std::string::npos && dot >= 1 && dot <= 3 && t.size() == dot + 2 &&
           std::from_chars(t.data(), t.data() + dot, major).ptr == t.data() + dot &&
           std::from_chars(t.data() + dot + 1, t.data() + t.size(), minor).ptr == t.data() + t.size() && major >= 1 &&
           minor >= 0;
    }
    TESSERA_CHECK(ok, detail::where(origin, *cc),
                  ": machine profile: machine.compute_capability must be a string such as \"9.0\"");
    m.cc_major = major;
    m.cc_minor = minor;
  }
  using detail::read_curve;
  using detail::read_rate;
  m.capacity_bytes = read_rate(root, origin, "memory", "capacity_bytes");
  // The planner holds a device's bytes in a size_t: no GPU comes near an exbibyte.
  TESSERA_CHECK(m.capacity_bytes.value <= 0x1p60, origin, ": machine profile: memory.capacity_bytes must be at most ",
                "2^60 (1 EiB), got ", m.capacity_bytes.value);
  m.reserved_bytes = read_rate(root, origin, "memory", "reserved_bytes");
  TESSERA_CHECK(m.reserved_bytes.value < m.capacity_bytes.value, origin,
                ": machine profile: memory.reserved_bytes must be less than memory.capacity_bytes");
  m.bf16_tflops = read_rate(root, origin, "compute", "bf16_tflops");
  m.fp32_tflops = read_rate(root, origin, "compute", "fp32_tflops");
  // Counts the planner takes as ints: whole numbers, and no more than any machine has.
  const auto count = [&](const Sourced& v, const char* key, double most) {
    TESSERA_CHECK(v.value == std::floor(v.value) && v.value <= most, origin, ": machine profile: ", key,
                  " must be a whole number up to ", most, ", got ", v.value);
  };
  m.sm_count = read_rate(root, origin, "compute", "sm_count");
  count(m.sm_count, "compute.sm_count", 65536);
  m.boost_clock_ghz = read_rate(root, origin, "compute", "boost_clock_ghz");
  m.shared_memory_bytes_per_clock_per_sm = read_rate(root, origin, "compute", "shared_memory_bytes_per_clock_per_sm");
  m.gemm_bf16 = read_curve(root, origin, "gemm", "bf16_efficiency");
  m.gemm_fp32 = read_curve(root, origin, "gemm", "fp32_efficiency");
  // Float8: optional (an A100 has no float8 tensor cores), the peak and its curve together.
  const auto* compute = root.get_as<toml::table>("compute");
  const auto* gemm_section = root.get_as<toml::table>("gemm");
  const bool fp8_peak = compute && compute->get("fp8_tflops");
  const bool fp8_curve = gemm_section && gemm_section->get("fp8_efficiency");
  TESSERA_CHECK(fp8_peak == fp8_curve, origin, ": machine profile: ", fp8_peak ? "compute.fp8_tflops" : "gemm.fp8_efficiency",
                " is given without ", fp8_peak ? "gemm.fp8_efficiency" : "compute.fp8_tflops",
                " (a float8 GEMM is priced from both: give both, or neither on a GPU without float8 tensor cores)");
  if (fp8_peak) {
    m.fp8_tflops = read_rate(root, origin, "compute", "fp8_tflops");
    m.gemm_fp8 = read_curve(root, origin, "gemm", "fp8_efficiency");
  }
  if (const auto* gemm = root.get_as<toml::table>("gemm"); gemm && gemm->get("slowdown_beside_held_sms")) {
    const std::string name = "gemm.slowdown_beside_held_sms";
    const toml::table& t = detail::table_at(root, origin, "gemm", "slowdown_beside_held_sms");
    HeldSmSlowdown h;
    h.points = detail::read_points(t, origin, name, "held, ratio", std::numeric_limits<double>::infinity());
    for (const auto& [held, ratio] : h.points) {
      TESSERA_CHECK(ratio >= 1, detail::where(origin, t), ": machine profile: ", name, ": a GEMM beside ", held,
                    " SMs held cannot take less time than alone (ratio ", ratio, ")");
      TESSERA_CHECK(held < m.sm_count.value, detail::where(origin, t), ": machine profile: ", name, ": ", held,
                    " SMs held is not under compute.sm_count (", m.sm_count.value, ")");
    }
    h.source = detail::source_of(t, origin, name);
    m.gemm_beside_held_sms = std::move(h);
  }
  m.hbm_gbs = read_rate(root, origin, "hbm", "bandwidth_gbs");
  m.hbm_fraction = read_rate(root, origin, "hbm", "achieved_fraction");
  TESSERA_CHECK(m.hbm_fraction.value <= 1, origin, ": machine profile: hbm.achieved_fraction must be at most 1, got ",
                m.hbm_fraction.value);
  m.launch_us = read_rate(root, origin, "host", "launch_us");
  m.sync_us = read_rate(root, origin, "host", "sync_us");
  m.host_link_gbs = read_rate(root, origin, "host", "link_gbs");
  if (const toml::table* host = root["host"].as_table(); host && host->get("memory_gbs"))
    m.host_memory_gbs = read_rate(root, origin, "host", "memory_gbs");
  m.cudnn_attention_bf16 = detail::read_attention(root, origin);
  if (root.get("network")) {
    Network n;
    n.gpus_per_node = read_rate(root, origin, "network", "gpus_per_node");
    count(n.gpus_per_node, "network.gpus_per_node", 65536);
    n.nvlink_gbs = read_rate(root, origin, "network", "nvlink_gbs");
    n.nvlink_latency_us = read_rate(root, origin, "network", "nvlink_latency_us");
    n.network_gbs = read_rate(root, origin, "network", "network_gbs");
    n.network_latency_us = read_rate(root, origin, "network", "network_latency_us");
    if (root.get_as<toml::table>("network")->get("nics_per_node")) {
      n.nics_per_node = read_rate(root, origin, "network", "nics_per_node");
      count(*n.nics_per_node, "network.nics_per_node", 65536);
    }
    m.network = n;
  }
  return m;
}

/// Reads a GPU profile from a file.
inline Machine load_machine(const std::filesystem::path& path, const MachineResolver& resolve = machine_beside) {
  std::error_code ec;
  TESSERA_CHECK(!std::filesystem::is_directory(path, ec), path.string(),
                ": a directory, not a machine profile (a FILE.toml of the form of examples/machines)");
  const std::optional<std::string> text = detail::file_text(path);
  TESSERA_CHECK(text.has_value(), path.string(), ": cannot open the machine profile");
  return parse_machine(*text, path.string(), resolve);
}

}  // namespace tessera::plan
