// A step's timeline (core/profile.hpp): spans recorded only while a Recorder is installed
// on the thread, their names built only then; nesting, the memory samples, Regions as
// spans; and the Chrome trace file Perfetto opens, parsed back.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <thread>

#include "tessera/core/memory.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/core/region.hpp"

using namespace tessera;

TEST_CASE("profile: nothing is recorded, and no name built, without a Recorder on the thread") {
  CHECK_FALSE(profile::recording());
  int built = 0;
  {
    const profile::Span span("layer", [&] {
      ++built;
      return std::string("layers.0 forward");
    });
  }
  CHECK(built == 0);
  profile::Recorder r;
  {
    const profile::Recording off(nullptr);  // installs nothing
    CHECK_FALSE(profile::recording());
  }
  {
    const profile::Recording on(r);
    CHECK(profile::recording());
    CHECK(profile::recorder() == &r);
    const profile::Span span("layer", [&] {
      ++built;
      return std::string("layers.0 forward");
    });
  }
  CHECK_FALSE(profile::recording());
  CHECK(built == 1);
  REQUIRE(r.events().size() == 1);
  CHECK(r.events()[0].name == "layers.0 forward");
  CHECK(std::string(r.events()[0].category) == "layer");
  CHECK(r.events()[0].end_ns >= r.events()[0].begin_ns);
}

TEST_CASE("profile: spans nest on their thread; another thread's are its own Recorder's") {
  profile::Recorder outer, inner, other;
  {
    const profile::Recording on(outer);
    const profile::Span step("step", "step 1");
    {
      const profile::Span comm("comm", "all_gather", 4096, 2);
      const Region optimizer(region::kOptimizer);  // a Region is a span too
    }
    {
      const profile::Recording nested(inner);  // a Recorder installed over another
      const profile::Span span("layer", "layers.1 backward");
    }
    std::thread([&] {
      const profile::Span unseen("layer", "not recorded: no Recorder on this thread");
      const profile::Recording mine(other);
      const profile::Span seen("layer", "recorded by the thread's own");
    }).join();
    const profile::Span after("step", "after the nested Recorder");
  }
  REQUIRE(outer.events().size() == 4);
  const auto& e = outer.events();
  CHECK(e[0].name == "step 1");
  CHECK(e[0].depth == 0);
  CHECK(e[1].name == "all_gather");
  CHECK(e[1].bytes == 4096);
  CHECK(e[1].ranks == 2);
  CHECK(e[1].depth == 1);
  CHECK(e[2].name == "optimizer");
  CHECK(std::string(e[2].category) == "region");
  CHECK(e[2].depth == 2);
  CHECK(e[3].name == "after the nested Recorder");
  CHECK(e[3].depth == 1);
  // Each span lies within the one it is nested in.
  CHECK(e[0].begin_ns <= e[1].begin_ns);
  CHECK(e[2].end_ns <= e[1].end_ns);
  CHECK(e[3].end_ns <= e[0].end_ns);
  REQUIRE(inner.events().size() == 1);
  CHECK(inner.events()[0].name == "layers.1 backward");
  REQUIRE(other.events().size() == 1);
  CHECK(other.events()[0].name == "recorded by the thread's own");
}

TEST_CASE("profile: the memory in use is sampled as spans open and close, a sample a change") {
  MemoryStats stats;
  stats.on_alloc(100, MemoryUse::parameters);
  profile::Recorder r([&] { return stats.now(); });
  {
    const profile::Recording on(r);
    const profile::Span a("step", "a");
    stats.on_alloc(200);  // a temporary
    stats.on_saved(150);  // of which a layer saved 150 for its backward
    { const profile::Span b("layer", "b"); }  // opens and closes at the same: one sample
    stats.on_free(200);
    stats.on_saved(-150);
  }
  REQUIRE(r.memory().size() == 3);
  CHECK(r.memory()[0].held.total() == 100);
  CHECK(r.memory()[1].held[MemoryUse::temporary] == 200);
  CHECK(r.memory()[1].held.saved_activations == 150);
  CHECK(r.memory()[2].held.total() == 100);
  r.clear();
  CHECK(r.events().empty());
  CHECK(r.memory().empty());
}

TEST_CASE("profile: the spans open now, outermost first; clear() keeps them open") {
  profile::Recorder r;
  const profile::Recording on(r);
  CHECK(r.open_spans().empty());
  const profile::Span step("step", "step 1");
  {
    const profile::Span layer("layer", [] { return std::string("layers.0 forward"); });
    const auto open = r.open_spans();
    REQUIRE(open.size() == 2);
    CHECK(open[0]->name == "step 1");
    CHECK(open[1]->name == "layers.0 forward");
    CHECK(std::string(open[1]->category) == "layer");
    CHECK(open[1]->depth == 1);
  }
  { const profile::Span done("comm", "all_gather"); }
  REQUIRE(r.open_spans().size() == 1);
  r.clear();  // the closed spans go; "step 1" is still open and closes into the next recording
  REQUIRE(r.events().size() == 1);
  CHECK(r.events()[0].name == "step 1");
  CHECK(r.events()[0].end_ns == -1);
  const profile::Span next("layer", "layers.1 forward");
  REQUIRE(r.open_spans().size() == 2);
  CHECK(r.open_spans()[1]->depth == 1);
}

TEST_CASE("profile: the Chrome trace file holds every span, its payload and the memory track") {
  MemoryStats stats;
  stats.on_alloc(1 << 20, MemoryUse::parameters);
  profile::Recorder r([&] { return stats.now(); });
  {
    const profile::Recording on(r);
    const profile::Span step("step", "step \"2\"\\\n");  // a name that needs escaping
    const profile::Span comm("comm", "reduce_scatter", 123456, 4);
    stats.on_alloc(3000, MemoryUse::gradients);
    stats.on_alloc(500);
    stats.on_saved(200);
  }
  const std::string text = profile::chrome_trace(r, 3, "rank 3");
  const nlohmann::json j = nlohmann::json::parse(text);
  CHECK(j["displayTimeUnit"] == "ms");
  const auto& ev = j["traceEvents"];
  REQUIRE(ev.size() == 1 + 2 + 2);  // the process name, two spans, two memory samples
  CHECK(ev[0]["ph"] == "M");
  CHECK(ev[0]["args"]["name"] == "rank 3");
  CHECK(ev[1]["name"] == "step \"2\"\\\n");
  CHECK(ev[1]["ph"] == "X");
  CHECK(ev[1]["pid"] == 3);
  CHECK(ev[1]["cat"] == "step");
  CHECK(ev[2]["name"] == "reduce_scatter");
  CHECK(ev[2]["args"]["bytes"] == 123456);
  CHECK(ev[2]["args"]["ranks"] == 4);
  // Microseconds, the inner span within the outer.
  const double ts1 = ev[1]["ts"], dur1 = ev[1]["dur"], ts2 = ev[2]["ts"], dur2 = ev[2]["dur"];
  CHECK(dur1 >= 0);
  CHECK(ts2 >= ts1);
  CHECK(ts2 + dur2 <= ts1 + dur1 + 0.001);
  CHECK(ev[3]["ph"] == "C");
  CHECK(ev[3]["name"] == "memory in use");
  CHECK(ev[3]["args"]["parameters"] == 1 << 20);
  CHECK(ev[3]["args"]["gradients"] == 0);
  const auto& last = ev[4]["args"];  // a series per use, the temporaries split
  CHECK(last["parameters"] == 1 << 20);
  CHECK(last["gradients"] == 3000);
  CHECK(last["optimizer"] == 0);
  CHECK(last["saved activations"] == 200);
  CHECK(last["other temporaries"] == 300);
  CHECK(last["workspace"] == 0);
}

namespace {
std::string annotated;  // what the annotation hooks below were told, in order
void push_annotation(const char* name) { annotated += std::string("+") + name; }
void pop_annotation() { annotated += "-"; }
}  // namespace

TEST_CASE("profile: a Recorder's annotations (NVTX ranges on a GPU) open and close with its spans") {
  profile::Recorder r;
  r.annotate({push_annotation, pop_annotation});
  annotated.clear();
  {
    const profile::Span outside("step", "not recorded, not annotated");
  }
  {
    const profile::Recording on(r);
    const profile::Span step("step", "step 1");
    const profile::Span layer("layer", "layers.0 forward");
  }
  CHECK(annotated == "+step 1+layers.0 forward--");
}
