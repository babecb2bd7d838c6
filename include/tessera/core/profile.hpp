// A step's timeline as its thread lived it: named spans (the step, each layer's forward
// and backward, each collective and its wait, each pipeline action, the loss head, the
// optimizer) with their start and end, and the memory in use at each, for a person to
// read in Perfetto or chrome://tracing (profiling.enable_profiling; llama-train writes
// one file per rank: chrome_trace below).
//
// A Recorder collects what the threads it is installed on (Recording) open: the library
// opens Spans at the places above, and a Span on a thread with no Recorder costs one
// thread-local load. A Span's name may be built lazily (a callable), so that a layer's
// "layers.12 forward" is formatted only while something records. Spans on one thread
// nest (a Span ends before the one opened before it), which the file format relies on.
//
//   profile::Recorder recorder([] { return memory_stats(B::device).now(); });
//   {
//     profile::Recording on(recorder);  // this thread's spans go to `recorder`
//     trainer.step();
//   }
//   write(profile::chrome_trace(recorder, rank, "rank 0"));
//
// Times are the steady clock's (CLOCK_MONOTONIC), shared by every process on a host, so
// the files of several ranks open together line up. On the CPU a span is the work
// itself; on a GPU it is the host's side (launches, and waits that hold the host), the
// device's own timeline being a device profiler's (backend/cuda/kernel_profile.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/core/memory.hpp"

namespace tessera::profile {

/// One span: what ran, from when to when, on the recording thread.
struct Event {
  std::string name;
  const char* category = "";     // "step", "layer", "comm", "pipeline", "region", ...
  std::int64_t begin_ns = 0;     // steady clock
  std::int64_t end_ns = -1;      // -1 while open
  std::uint64_t bytes = 0;       // a collective's or a transfer's payload; 0 for the rest
  int ranks = 0;                 // a collective's group size; 0 for the rest
  int depth = 0;                 // spans open around it on its thread
};

/// The memory in use at a moment, by what it holds (a sample taken as a span opens or closes).
struct MemorySample {
  std::int64_t at_ns = 0;
  MemoryBreakdown held;
};

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// What a Recorder also tells a device profiler as its spans open and close: on a GPU,
/// NVTX ranges, so that an Nsight Systems timeline of a recorded step shows each span
/// over the kernels it launched (llama-train's CUDA build installs them; a range pushed
/// with no profiler attached costs next to nothing).
struct Annotations {
  void (*push)(const char* name) = nullptr;
  void (*pop)() = nullptr;
};

/// The spans opened on the threads it is installed on, in the order they opened.
class Recorder {
 public:
  /// `memory`, where given, is sampled as each span opens and closes (on the recording
  /// thread): the bytes in use on the device the spans run on, by use
  /// (MemoryStats::now(), core/memory.hpp).
  explicit Recorder(std::function<MemoryBreakdown()> memory = {}) : memory_(std::move(memory)) {}

  /// Also pushes and pops `a`'s ranges as spans open and close.
  void annotate(Annotations a) { annotations_ = a; }

  const std::vector<Event>& events() const { return events_; }
  const std::vector<MemorySample>& memory() const { return samples_; }
  /// The spans open now, the outermost first (where an allocation is asked for: the
  /// memory history's context, core/memory_history.hpp).
  std::vector<const Event*> open_spans() const {
    std::vector<const Event*> out;
    out.reserve(open_.size());
    for (std::size_t i : open_) out.push_back(&events_[i]);
    return out;
  }
  /// Forgets the spans and samples recorded; spans open now stay open.
  void clear() {
    std::vector<Event> still_open;
    for (std::size_t& i : open_) {
      still_open.push_back(std::move(events_[i]));
      i = still_open.size() - 1;
    }
    events_ = std::move(still_open);
    samples_.clear();
  }

  /// Opens a span; returns the handle close() takes (its depth).
  std::size_t open(std::string name, const char* category, std::uint64_t bytes, int ranks) {
    sample();
    events_.push_back(Event{std::move(name), category, now_ns(), -1, bytes, ranks, static_cast<int>(open_.size())});
    if (annotations_.push) annotations_.push(events_.back().name.c_str());
    open_.push_back(events_.size() - 1);
    return open_.size() - 1;
  }
  /// Closes the span open() returned `handle` for: the innermost one open.
  void close(std::size_t handle) {
    if (annotations_.pop) annotations_.pop();
    events_[open_[handle]].end_ns = now_ns();
    open_.resize(handle);
    sample();
  }

 private:
  void sample() {
    if (!memory_) return;
    const MemoryBreakdown b = memory_();
    if (samples_.empty() || samples_.back().held.by_use != b.by_use ||
        samples_.back().held.saved_activations != b.saved_activations)
      samples_.push_back({now_ns(), b});
  }

  std::function<MemoryBreakdown()> memory_;
  Annotations annotations_;
  std::vector<Event> events_;
  std::vector<MemorySample> samples_;
  std::vector<std::size_t> open_;  // the spans open now, outermost first: indices into events_
};

/// Where a thread's coarse spans also go, whether or not a Recorder records: a log of a
/// run's phases that is always on (train/rank_log.hpp: the step, its data and micro-
/// batches, the optimizer, validation, checkpoints). takes() filters by category before a
/// span's name is built; event() names the span's phase, or returns nullptr to leave it.
class PhaseSink {
 public:
  virtual ~PhaseSink() = default;
  virtual bool takes(const char* category) const = 0;
  virtual const char* event(std::string_view name) const = 0;
  virtual void begin(const char* event) = 0;
  /// The span closed after `duration_ns`; `failed`: by an exception unwinding through it.
  virtual void end(const char* event, std::int64_t duration_ns, bool failed) = 0;
};

namespace detail {
inline Recorder*& current() {
  static thread_local Recorder* r = nullptr;
  return r;
}
inline PhaseSink*& current_sink() {
  static thread_local PhaseSink* s = nullptr;
  return s;
}
}  // namespace detail

/// Installs `s` on this thread while it lives (the sink installed before comes back after).
class PhaseLogging {
 public:
  explicit PhaseLogging(PhaseSink* s) : outer_(detail::current_sink()) {
    if (s) detail::current_sink() = s;
  }
  ~PhaseLogging() { detail::current_sink() = outer_; }
  PhaseLogging(const PhaseLogging&) = delete;
  PhaseLogging& operator=(const PhaseLogging&) = delete;

 private:
  PhaseSink* outer_;
};

/// The Recorder installed on this thread, or nullptr.
inline Recorder* recorder() { return detail::current(); }
/// Whether this thread's spans are recorded.
inline bool recording() { return detail::current() != nullptr; }

/// Installs `r` on this thread while it lives (the Recorder installed before comes back
/// after); nullptr installs nothing, so that a caller records some steps and not others.
class Recording {
 public:
  explicit Recording(Recorder& r) : Recording(&r) {}
  explicit Recording(Recorder* r) : outer_(detail::current()) {
    if (r) detail::current() = r;
  }
  ~Recording() { detail::current() = outer_; }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

 private:
  Recorder* outer_;
};

/// A span of this thread's work, recorded while a Recorder is installed here, and logged
/// as a phase while a PhaseSink installed here takes it.
class Span {
 public:
  /// `name` is built only while recording (or logging a span of a category the sink
  /// takes) when it is a callable returning a string.
  template <class Name>
  Span(const char* category, Name&& name, std::uint64_t bytes = 0, int ranks = 0) : recorder_(detail::current()) {
    PhaseSink* sink = detail::current_sink();
    if (sink && !sink->takes(category)) sink = nullptr;
    if (!recorder_ && !sink) return;
    std::string built;
    if constexpr (std::is_invocable_v<Name&>)
      built = std::string(name());
    else
      built = std::string(std::string_view(name));
    if (sink) {
      if (const char* e = sink->event(built)) {
        sink_ = sink, event_ = e;
        sink_->begin(event_);
        begin_ns_ = now_ns();
        exceptions_ = std::uncaught_exceptions();
      }
    }
    if (recorder_) index_ = recorder_->open(std::move(built), category, bytes, ranks);
  }
  ~Span() {
    if (recorder_) recorder_->close(index_);
    if (sink_) sink_->end(event_, now_ns() - begin_ns_, std::uncaught_exceptions() > exceptions_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  Recorder* recorder_;
  std::size_t index_ = 0;
  PhaseSink* sink_ = nullptr;
  const char* event_ = nullptr;
  std::int64_t begin_ns_ = 0;
  int exceptions_ = 0;
};

namespace detail {
/// `s` as a JSON string's contents.
inline void append_escaped(std::string& out, std::string_view s) {
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", c);
      out += esc;
    } else {
      out += ch;
    }
  }
}
/// Nanoseconds as microseconds with three decimals (the format's unit).
inline void append_us(std::string& out, std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>((ns < 0 ? -ns : ns) % 1000));
  out += text;
}
}  // namespace detail

/// `r`'s spans (closed ones) and memory samples in the Chrome trace event format (one JSON
/// object: complete events "X" on process `pid` named `process`, thread 0; the memory as
/// a counter "memory in use" with a series per use: parameters, gradients, optimizer,
/// saved activations, other temporaries, workspace), which Perfetto and chrome://tracing
/// open. A span still open is written as ending at the last close.
inline std::string chrome_trace(const Recorder& r, int pid, std::string_view process) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  const std::string p = std::to_string(pid);
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + p + ",\"tid\":0,\"args\":{\"name\":\"";
  detail::append_escaped(out, process);
  out += "\"}}";
  std::int64_t last = 0;
  for (const Event& e : r.events()) last = std::max(last, std::max(e.begin_ns, e.end_ns));
  for (const Event& e : r.events()) {
    out += ",\n{\"name\":\"";
    detail::append_escaped(out, e.name);
    out += "\",\"cat\":\"";
    detail::append_escaped(out, e.category);
    out += "\",\"ph\":\"X\",\"pid\":" + p + ",\"tid\":0,\"ts\":";
    detail::append_us(out, e.begin_ns);
    out += ",\"dur\":";
    detail::append_us(out, (e.end_ns < 0 ? last : e.end_ns) - e.begin_ns);
    if (e.bytes > 0 || e.ranks > 0) {
      out += ",\"args\":{\"bytes\":" + std::to_string(e.bytes);
      if (e.ranks > 0) out += ",\"ranks\":" + std::to_string(e.ranks);
      out += "}";
    }
    out += "}";
  }
  for (const MemorySample& m : r.memory()) {
    out += ",\n{\"name\":\"memory in use\",\"ph\":\"C\",\"pid\":" + p + ",\"tid\":0,\"ts\":";
    detail::append_us(out, m.at_ns);
    const std::size_t temporaries = m.held[MemoryUse::temporary];
    const std::size_t saved = std::min(m.held.saved_activations, temporaries);
    out += ",\"args\":{\"parameters\":" + std::to_string(m.held[MemoryUse::parameters]) +
           ",\"gradients\":" + std::to_string(m.held[MemoryUse::gradients]) +
           ",\"optimizer\":" + std::to_string(m.held[MemoryUse::optimizer]) +
           ",\"saved activations\":" + std::to_string(saved) +
           ",\"other temporaries\":" + std::to_string(temporaries - saved) +
           ",\"workspace\":" + std::to_string(m.held[MemoryUse::workspace]) + "}}";
  }
  out += "\n]}\n";
  return out;
}

}  // namespace tessera::profile
