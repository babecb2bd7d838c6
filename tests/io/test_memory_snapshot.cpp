// PyTorch's memory snapshot as tessera writes it: the pickle opcodes byte for byte, and
// whole snapshots (of a caching allocator over host memory and of the CPU backend's
// memory) read back by a reader of those opcodes and checked field by field.
// tests/cli (plan.sh, distributed.sh) load llama-plan's and llama-train's with Python's
// own pickle and tools/memory_snapshot.py.
#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/memory_history.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/io/memory_snapshot.hpp"
#include "tessera/io/pickle.hpp"

namespace test_memory_snapshot {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

// A reader of the opcodes PickleWriter writes, and nothing else: a value is null, a bool,
// an integer (in 128 bits: LONG1 holds up to 9 bytes here), a double, a string, a list,
// a dict (string keys) or a pair.
struct Value;
using List = std::vector<Value>;
using Dict = std::map<std::string, Value>;
struct Value {
  std::variant<std::monostate, bool, __int128, double, std::string, std::shared_ptr<List>, std::shared_ptr<Dict>> v;
  const Dict& dict() const { return *std::get<std::shared_ptr<Dict>>(v); }
  const List& list() const { return *std::get<std::shared_ptr<List>>(v); }
  const Value& operator[](const std::string& k) const {
    const auto it = dict().find(k);
    REQUIRE_MESSAGE(it != dict().end(), "no key ", k);
    return it->second;
  }
  const Value& operator[](std::size_t i) const { return list().at(i); }
  std::int64_t integer() const { return static_cast<std::int64_t>(std::get<__int128>(v)); }
  const std::string& str() const { return std::get<std::string>(v); }
};

Value unpickle(const std::string& b) {
  std::size_t at = 0;
  auto byte = [&] { return static_cast<unsigned char>(b.at(at++)); };
  auto le = [&](int n) {
    std::uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= std::uint64_t{byte()} << (8 * i);
    return x;
  };
  REQUIRE(byte() == 0x80);
  REQUIRE(byte() == 4);
  std::vector<Value> stack, memo;
  std::vector<std::size_t> marks;
  auto since_mark = [&] {
    REQUIRE(!marks.empty());
    const std::size_t m = marks.back();
    marks.pop_back();
    std::vector<Value> items(stack.begin() + static_cast<std::ptrdiff_t>(m), stack.end());
    stack.resize(m);
    return items;
  };
  for (;;) {
    const unsigned char op = byte();
    switch (op) {
      case 'N': stack.push_back({}); break;
      case 0x88: stack.push_back({true}); break;
      case 0x89: stack.push_back({false}); break;
      case 'J': stack.push_back({__int128{static_cast<std::int32_t>(le(4))}}); break;
      case 0x8a: {
        const int n = byte();
        REQUIRE(n <= 9);
        unsigned __int128 x = 0;
        for (int i = 0; i < n; ++i) x |= static_cast<unsigned __int128>(byte()) << (8 * i);
        if (n < 16 && (x >> (8 * n - 1)) & 1) x |= ~static_cast<unsigned __int128>(0) << (8 * n);  // sign
        stack.push_back({static_cast<__int128>(x)});
        break;
      }
      case 'G': {
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = bits << 8 | byte();
        stack.push_back({std::bit_cast<double>(bits)});
        break;
      }
      case 'X': {
        const auto n = static_cast<std::size_t>(le(4));
        stack.push_back({b.substr(at, n)});
        at += n;
        break;
      }
      case '}': stack.push_back({std::make_shared<Dict>()}); break;
      case ']': stack.push_back({std::make_shared<List>()}); break;
      case '(': marks.push_back(stack.size()); break;
      case 'u': {
        const auto items = since_mark();
        REQUIRE(items.size() % 2 == 0);
        auto& d = *std::get<std::shared_ptr<Dict>>(stack.back().v);
        for (std::size_t i = 0; i < items.size(); i += 2) d[items[i].str()] = items[i + 1];
        break;
      }
      case 'e': {
        const auto items = since_mark();
        auto& l = *std::get<std::shared_ptr<List>>(stack.back().v);
        l.insert(l.end(), items.begin(), items.end());
        break;
      }
      case 0x86: {
        REQUIRE(stack.size() >= 2);
        auto pair = std::make_shared<List>(stack.end() - 2, stack.end());
        stack.resize(stack.size() - 2);
        stack.push_back({pair});
        break;
      }
      case 0x94: memo.push_back(stack.back()); break;
      case 'h': stack.push_back(memo.at(byte())); break;
      case 'j': stack.push_back(memo.at(le(4))); break;
      case '.':
        REQUIRE(stack.size() == 1);
        REQUIRE(marks.empty());
        REQUIRE(at == b.size());
        return stack.back();
      default: FAIL("an opcode the writer does not write: ", static_cast<int>(op)); return {};
    }
  }
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s += static_cast<char>(x);
  return s;
}

/// `f` written alone between PROTO 4 and STOP.
template <class F>
std::string pickled(F&& f) {
  io::PickleWriter w;
  f(w);
  const std::string all = w.finish();
  REQUIRE(all.substr(0, 2) == bytes({0x80, 4}));
  REQUIRE(all.back() == '.');
  return all.substr(2, all.size() - 3);
}

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

std::uintptr_t address_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

TEST_CASE("pickle: each value's opcodes, byte for byte") {
  using W = io::PickleWriter;
  CHECK(pickled([](W& w) { w.none(); }) == "N");
  CHECK(pickled([](W& w) { w.boolean(true); }) == bytes({0x88}));
  CHECK(pickled([](W& w) { w.boolean(false); }) == bytes({0x89}));
  // BININT: 4 bytes little-endian, signed.
  CHECK(pickled([](W& w) { w.integer(255); }) == bytes({'J', 0xff, 0, 0, 0}));
  CHECK(pickled([](W& w) { w.integer(std::int64_t{-1}); }) == bytes({'J', 0xff, 0xff, 0xff, 0xff}));
  // LONG1: the fewest two's complement bytes that keep the sign.
  CHECK(pickled([](W& w) { w.integer(std::int64_t{2147483648}); }) == bytes({0x8a, 5, 0, 0, 0, 0x80, 0}));
  CHECK(pickled([](W& w) { w.integer(std::int64_t{-2147483649}); }) == bytes({0x8a, 5, 0xff, 0xff, 0xff, 0x7f, 0xff}));
  CHECK(pickled([](W& w) { w.integer(std::uint64_t{1} << 48); }) == bytes({0x8a, 7, 0, 0, 0, 0, 0, 0, 1}));
  CHECK(pickled([](W& w) { w.integer(~std::uint64_t{0}); }) ==
        bytes({0x8a, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0}));
  // BINFLOAT: 8 bytes big-endian.
  CHECK(pickled([](W& w) { w.real(1.5); }) == bytes({'G', 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}));
  // BINUNICODE: a 4-byte length, then UTF-8; ill-formed bytes become U+FFFD.
  CHECK(pickled([](W& w) { w.string("h\xc3\xa9"); }) == bytes({'X', 3, 0, 0, 0, 'h', 0xc3, 0xa9}));
  CHECK(pickled([](W& w) { w.string(std::string(1, '\xff')); }) == bytes({'X', 3, 0, 0, 0, 0xef, 0xbf, 0xbd}));
  CHECK(pickled([](W& w) {
          w.begin_dict();
          w.string("a");
          w.integer(1);
          w.end_dict();
        }) == bytes({'}', '(', 'X', 1, 0, 0, 0, 'a', 'J', 1, 0, 0, 0, 'u'}));
  CHECK(pickled([](W& w) {
          w.begin_list();
          w.integer(3);
          w.integer(4);
          w.pair();
          w.end_list();
        }) == bytes({']', '(', 'J', 3, 0, 0, 0, 'J', 4, 0, 0, 0, 0x86, 'e'}));
  // MEMOIZE names the value just written; BINGET up to 255, then LONG_BINGET.
  io::PickleWriter w;
  w.begin_list();
  for (int i = 0; i < 257; ++i) {
    w.none();
    CHECK(w.memoize() == static_cast<std::uint32_t>(i));
  }
  w.get(7);
  w.get(256);
  w.end_list();
  const std::string all = w.finish();
  CHECK(all.substr(all.size() - 9) == bytes({'h', 7, 'j', 0, 1, 0, 0, 'e', '.'}));
  CHECK(unpickle(all).list().size() == 259);
  CHECK_THROWS_WITH_AS(w.get(0), doctest::Contains("no value is memoized as 0"), Error);
}

TEST_CASE("memory snapshot: a caching allocator's segments, blocks and events, with where each block was asked for") {
  // Host memory standing in for a device, with 12 MiB of room.
  struct Host {
    std::size_t left = 12 * MiB;
  } host;
  CachingAllocator::Upstream up;
  up.allocate = [&host](std::size_t n) -> void* {
    if (n > host.left) return nullptr;
    host.left -= n;
    return std::aligned_alloc(CachingAllocator::kSegmentAlign, n);
  };
  up.release = [&host](void* p, std::size_t n) {
    host.left += n;
    std::free(p);
  };
  up.device_free_bytes = [&host] { return host.left; };
  CachingAllocator alloc(up);
  alloc.record_history();
  profile::Recorder where;
  void* w = nullptr;
  void* a = nullptr;
  {
    const profile::Recording on(where);
    const profile::Span step("step", "step 2");
    {
      const MemoryUseScope use(MemoryUse::parameters);
      w = alloc.allocate(6 * MiB, "layers.0.attention.wq");
    }
    const profile::Span layer("layer", "layers.0 forward");
    a = alloc.allocate(100 * KiB);
    void* t = alloc.allocate(200 * KiB);
    alloc.release(t);
    CHECK_THROWS_AS(alloc.allocate(8 * MiB, "too big"), OutOfMemory);
  }
  const std::string pickle = io::torch_memory_snapshot(alloc.state(), alloc.history(), 1, true);
  const Value s = unpickle(pickle);

  // Segments: the small one (a, and the free rest), then w's of 6 MiB, in address order.
  const List& segments = s["segments"].list();
  REQUIRE(segments.size() == 2);
  const Value& small = segments[address_of(a) < address_of(w) ? 0 : 1];
  const Value& large = segments[address_of(a) < address_of(w) ? 1 : 0];
  CHECK(small["device"].integer() == 1);
  CHECK(small["segment_type"].str() == "small");
  CHECK(small["total_size"].integer() == static_cast<std::int64_t>(2 * MiB));
  CHECK(small["allocated_size"].integer() == static_cast<std::int64_t>(100 * KiB));
  CHECK(small["requested_size"].integer() == static_cast<std::int64_t>(100 * KiB));
  CHECK(small["stream"].integer() == 0);
  CHECK(small["segment_pool_id"].list().size() == 2);
  CHECK(std::get<bool>(small["is_expandable"].v) == false);
  REQUIRE(small["blocks"].list().size() == 2);
  const Value& ab = small["blocks"][0];
  CHECK(ab["address"].integer() == static_cast<std::int64_t>(address_of(a)));
  CHECK(ab["state"].str() == "active_allocated");
  // a's frames: what it holds, then the spans innermost first.
  REQUIRE(ab["frames"].list().size() == 3);
  CHECK(ab["frames"][0]["name"].str() == "temporary");
  CHECK(ab["frames"][0]["filename"].str() == "memory use");
  CHECK(ab["frames"][1]["name"].str() == "layers.0 forward");
  CHECK(ab["frames"][1]["filename"].str() == "layer");
  CHECK(ab["frames"][1]["line"].integer() == 1);
  CHECK(ab["frames"][2]["name"].str() == "step 2");
  CHECK(small["blocks"][1]["state"].str() == "inactive");
  CHECK(small["blocks"][1]["frames"].list().empty());
  CHECK(large["segment_type"].str() == "large");
  REQUIRE(large["blocks"].list().size() == 1);
  CHECK(large["blocks"][0]["frames"][0]["name"].str() == "parameters: layers.0.attention.wq");
  CHECK(large["blocks"][0]["frames"][1]["name"].str() == "step 2");

  // Events on device 1 (device 0's list is there, empty).
  const List& traces = s["device_traces"].list();
  REQUIRE(traces.size() == 2);
  CHECK(traces[0].list().empty());
  const List& events = traces[1].list();
  std::vector<std::string> actions;
  for (const Value& e : events) actions.push_back(e["action"].str());
  CHECK(actions == std::vector<std::string>{"segment_alloc", "alloc", "segment_alloc", "alloc", "alloc",
                                            "free_completed", "oom"});
  CHECK(events[4]["size"].integer() == static_cast<std::int64_t>(200 * KiB));
  CHECK(events[4]["frames"][1]["name"].str() == "layers.0 forward");  // the same frames as a's, by memo
  const Value& oom = events[6];
  CHECK(oom["size"].integer() == static_cast<std::int64_t>(8 * MiB));
  CHECK(oom["device_free"].integer() == static_cast<std::int64_t>(12 * MiB - 2 * MiB - 6 * MiB));
  CHECK(oom["addr"].integer() == oom["device_free"].integer());  // as PyTorch writes an oom
  CHECK(oom["frames"][0]["name"].str() == "temporary: too big");
  for (const Value& e : events) CHECK(e["stream"].integer() == 0);
  const Value& settings = s["allocator_settings"];
  CHECK(std::get<bool>(settings["expandable_segments"].v));
  CHECK(settings["trace_alloc_max_entries"].integer() == static_cast<std::int64_t>(MemoryHistory::kDefaultEntries));
  CHECK(!std::get<bool>(settings["trace_alloc_overflowed"].v));

  // No history: the segments alone, no events, no frames.
  const Value bare = unpickle(io::torch_memory_snapshot(alloc.state(), nullptr));
  CHECK(bare["segments"].list().size() == 2);
  CHECK(bare["device_traces"].list().size() == 1);
  CHECK(bare["device_traces"][0].list().empty());
  alloc.release(a);
  alloc.release(w);
}

TEST_CASE("memory snapshot: the CPU backend's memory, each tensor a segment of its own, per thread rank") {
  MemoryStats rank_stats[kDeviceKinds];  // this thread is a rank with a device of its own
  const ScopedMemoryStats rank(rank_stats);
  Cpu::record_memory_history(16);
  CHECK(Cpu::memory_history() != nullptr);
  CHECK(Cpu::memory_state().empty());
  Tensor<float> kept, gone;
  {
    const MemoryUseScope use(MemoryUse::optimizer);
    kept = Cpu::empty<float>({10});
  }
  gone = Cpu::empty<float>({1000});
  gone = Tensor<float>();
  const AllocatorState state = Cpu::memory_state();
  REQUIRE(state.size() == 1);
  CHECK(state[0].address == address_of(kept.data()));
  CHECK(state[0].bytes == 64);  // 40 bytes in 64-byte lines
  CHECK(state[0].blocks == std::vector<BlockState>{{address_of(kept.data()), 64, 40, true}});
  const Value s = unpickle(io::torch_memory_snapshot(state, Cpu::memory_history(), Cpu::memory_device()));
  std::vector<std::string> actions;
  for (const Value& e : s["device_traces"][0].list()) actions.push_back(e["action"].str());
  CHECK(actions == std::vector<std::string>{"segment_alloc", "alloc", "segment_alloc", "alloc", "free_completed",
                                            "segment_free"});
  CHECK(s["segments"][0]["blocks"][0]["frames"][0]["name"].str() == "optimizer");
  {
    // Another thread rank's device has a history of its own (none here).
    MemoryStats other[kDeviceKinds];
    const ScopedMemoryStats other_rank(other);
    CHECK(Cpu::memory_history() == nullptr);
    const Tensor<float> elsewhere = Cpu::empty<float>({4});
    CHECK(Cpu::memory_state().size() == 1);
  }
  CHECK(Cpu::memory_history()->events().size() == 6);  // the other rank's tensor is not in it
  kept = Tensor<float>();
  cpu::DeviceMemory::instance().forget_history();
  CHECK(Cpu::memory_history() == nullptr);
}

}  // namespace test_memory_snapshot
