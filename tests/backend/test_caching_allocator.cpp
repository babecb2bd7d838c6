// The caching device allocator over an upstream of host memory with a budget: rounding
// and alignment, reuse, splitting and merging, the two pools, statistics, running out of
// memory, bad releases, threads, and random sequences checked against its invariants.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/core/buffer.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/memory_history.hpp"
#include "tessera/core/profile.hpp"
#include "../support/errors.hpp"

namespace test_caching_allocator {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

/// Host memory standing in for a device: 256-byte aligned segments, at most `budget`
/// bytes out at once (nullptr beyond it, as the CUDA upstream returns when the device is
/// full), every call counted.
struct FakeDevice {
  explicit FakeDevice(std::size_t budget_bytes = std::numeric_limits<std::size_t>::max() / 4)
      : budget(budget_bytes) {}

  std::size_t budget;
  std::size_t outstanding = 0;  // bytes handed out and not given back
  int allocate_calls = 0;
  int failed_calls = 0;
  int release_calls = 0;
  std::map<void*, std::size_t> segments;
  std::mutex mutex;

  // The expandable segment's ranges and the pages mapped in them.
  std::map<void*, std::size_t> ranges;
  std::set<char*> mapped_pages;
  int reserve_calls = 0;
  int map_calls = 0;
  int unmap_calls = 0;

  ~FakeDevice() {
    for (auto& [p, size] : segments) std::free(p);
    for (auto& [p, size] : ranges) munmap(p, size);
  }

  CachingAllocator::Upstream upstream(bool tells_free = true) {
    CachingAllocator::Upstream u;
    u.allocate = [this](std::size_t bytes) -> void* {
      std::lock_guard lock(mutex);
      ++allocate_calls;
      if (bytes > budget - outstanding) {
        ++failed_calls;
        return nullptr;
      }
      void* p = std::aligned_alloc(CachingAllocator::kSegmentAlign, bytes);
      REQUIRE(p != nullptr);
      segments.emplace(p, bytes);
      outstanding += bytes;
      return p;
    };
    u.release = [this](void* p, std::size_t bytes) {
      std::lock_guard lock(mutex);
      ++release_calls;
      auto it = segments.find(p);
      REQUIRE(it != segments.end());
      REQUIRE(it->second == bytes);
      segments.erase(it);
      outstanding -= bytes;
      std::free(p);
    };
    if (tells_free)
      u.device_free_bytes = [this] {
        std::lock_guard lock(mutex);
        return budget - outstanding;
      };
    return u;
  }
};

/// The same device with an expandable segment: its range reserved with no access
/// (PROT_NONE), pages made readable and writable as they are mapped and unreachable again
/// when unmapped, so that a block used beyond the pages behind it faults; mapped pages
/// count against the same budget as segments.
CachingAllocator::Upstream expandable_upstream(FakeDevice& d, std::size_t range = 256 * MiB,
                                               std::size_t page = 2 * MiB) {
  CachingAllocator::Upstream u = d.upstream();
  CachingAllocator::Upstream::Expandable x;
  x.range_bytes = range;
  x.page_bytes = page;
  x.reserve = [&d](std::size_t bytes) -> void* {
    std::lock_guard lock(d.mutex);
    ++d.reserve_calls;
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(p != MAP_FAILED);
    d.ranges.emplace(p, bytes);
    return p;
  };
  x.map = [&d, page](void* at, std::size_t bytes) {
    std::lock_guard lock(d.mutex);
    ++d.map_calls;
    REQUIRE(bytes % page == 0);
    if (bytes > d.budget - d.outstanding) {
      ++d.failed_calls;
      return false;
    }
    for (std::size_t o = 0; o < bytes; o += page) REQUIRE(d.mapped_pages.insert(static_cast<char*>(at) + o).second);
    REQUIRE(mprotect(at, bytes, PROT_READ | PROT_WRITE) == 0);
    d.outstanding += bytes;
    return true;
  };
  x.unmap = [&d, page](void* at, std::size_t bytes) {
    std::lock_guard lock(d.mutex);
    ++d.unmap_calls;
    for (std::size_t o = 0; o < bytes; o += page) REQUIRE(d.mapped_pages.erase(static_cast<char*>(at) + o) == 1);
    REQUIRE(madvise(at, bytes, MADV_DONTNEED) == 0);
    REQUIRE(mprotect(at, bytes, PROT_NONE) == 0);
    d.outstanding -= bytes;
  };
  x.free_range = [&d](void* base, std::size_t bytes) {
    std::lock_guard lock(d.mutex);
    REQUIRE(d.ranges.at(base) == bytes);
    REQUIRE(munmap(base, bytes) == 0);
    d.ranges.erase(base);
  };
  u.expandable = std::move(x);
  return u;
}

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// What a history's events say the allocator holds: the blocks in use (address -> size)
/// and the bytes of segments and pages held, replayed from the first event.
struct Replayed {
  std::map<std::uintptr_t, std::size_t> blocks;
  std::size_t held = 0;
};
Replayed replay(const MemoryHistory& h) {
  Replayed r;
  for (const AllocatorEvent& e : h.events()) switch (e.action) {
      case AllocatorAction::alloc: REQUIRE(r.blocks.emplace(e.address, e.bytes).second); break;
      case AllocatorAction::free_completed: REQUIRE(r.blocks.erase(e.address) == 1); break;
      case AllocatorAction::segment_alloc:
      case AllocatorAction::segment_map: r.held += e.bytes; break;
      case AllocatorAction::segment_free:
      case AllocatorAction::segment_unmap: REQUIRE(r.held >= e.bytes); r.held -= e.bytes; break;
      case AllocatorAction::oom: break;
    }
  return r;
}

/// Checks that `state` covers each segment exactly with its blocks, in address order,
/// and agrees with the replay of `h` and with `stats`.
void check_state(const AllocatorState& state, const MemoryHistory& h, const CachingAllocator::Stats& stats) {
  std::size_t held = 0, allocated = 0, requested = 0;
  std::map<std::uintptr_t, std::size_t> in_use;
  std::uintptr_t last_end = 0;
  for (const SegmentState& seg : state) {
    REQUIRE(seg.address >= last_end);
    last_end = seg.address + seg.bytes;
    std::uintptr_t at = seg.address;
    for (const BlockState& b : seg.blocks) {
      REQUIRE(b.address == at);
      at += b.bytes;
      if (b.in_use) {
        in_use.emplace(b.address, b.bytes);
        allocated += b.bytes;
        requested += b.requested;
        REQUIRE(b.requested <= b.bytes);
      }
    }
    REQUIRE(at == seg.address + seg.bytes);
    held += seg.bytes;
  }
  CHECK(held == stats.reserved_bytes);
  CHECK(allocated == stats.allocated_bytes);
  CHECK(requested == stats.requested_bytes);
  const Replayed r = replay(h);
  CHECK(r.held == stats.reserved_bytes);
  CHECK(r.blocks == in_use);
}

}  // namespace

TEST_CASE("history: every block and segment, with where it was asked for; state: the segments and their blocks") {
  FakeDevice device(8 * MiB);
  CachingAllocator alloc(device.upstream());
  CHECK(alloc.history() == nullptr);
  void* before = alloc.allocate(4 * KiB, "before");  // not recorded: no history yet
  alloc.record_history(100);
  const MemoryHistory* h = alloc.history();
  REQUIRE(h != nullptr);
  alloc.record_history(5);  // one already recording stays
  CHECK(alloc.history() == h);
  CHECK(h->max_entries() == 100);

  profile::Recorder recorder;
  void* w = nullptr;
  void* g = nullptr;
  {
    profile::Recording on(recorder);
    const profile::Span step("step", "step 3");
    const profile::Span layer("layer", [] { return std::string("layers.1 backward"); });
    w = [&] {
      const MemoryUseScope use(MemoryUse::parameters);
      return alloc.allocate(3 * MiB, "layers.1.attention.wq");
    }();
    const MemoryUseScope use(MemoryUse::gradients);
    g = alloc.allocate(1 * MiB + 1);
    CHECK_ERROR_CONTAINS(alloc.allocate(5 * MiB, "too big"), "out of device memory");
  }
  alloc.release(g);
  alloc.empty_cache();

  const std::vector<AllocatorEvent> events = h->events();
  std::vector<AllocatorAction> actions;
  for (const AllocatorEvent& e : events) actions.push_back(e.action);
  using A = AllocatorAction;
  // w: a segment of 4 MiB, whole (1 MiB left is not split off); g: a 2 MiB segment,
  // whole too; the device is full, so the 5 MiB request empties the cache (nothing free to
  // give back) and fails; g goes, then its segment with empty_cache.
  CHECK(actions == std::vector{A::segment_alloc, A::alloc, A::segment_alloc, A::alloc, A::oom, A::free_completed,
                               A::segment_free});
  CHECK(events[0].bytes == 4 * MiB);
  CHECK(events[1].address == address(w));
  CHECK(events[1].bytes == 4 * MiB);
  CHECK(events[3].bytes == 2 * MiB);
  CHECK(events[4].bytes == 5 * MiB);
  CHECK(events[4].device_free == 0);
  CHECK(events[6].address == events[2].address);
  for (std::size_t i = 1; i < events.size(); ++i) CHECK(events[i].time_us >= events[i - 1].time_us);
  const AllocationContext cw = h->context(events[1].context);
  CHECK(cw.use == MemoryUse::parameters);
  CHECK(cw.what == "layers.1.attention.wq");
  REQUIRE(cw.spans.size() == 2);
  CHECK(cw.spans[0] == AllocationContext::Span{"step", "step 3"});
  CHECK(cw.spans[1] == AllocationContext::Span{"layer", "layers.1 backward"});
  const AllocationContext cg = h->context(events[3].context);
  CHECK(cg.use == MemoryUse::gradients);
  CHECK(cg.what.empty());
  CHECK(h->context(events[4].context).what == "too big");
  CHECK(events[0].context == 0);
  CHECK(h->live_context(address(w)) == events[1].context);
  CHECK(h->live_context(address(g)) == 0);  // released
  CHECK(h->live_context(address(before)) == 0);

  // The state: the small segment of `before` (2 MiB: its block and the free rest) and w's.
  const AllocatorState state = alloc.state();
  REQUIRE(state.size() == 2);
  const SegmentState& small = state[address(before) < address(w) ? 0 : 1];
  const SegmentState& large = state[address(before) < address(w) ? 1 : 0];
  CHECK(small.small);
  CHECK(small.bytes == 2 * MiB);
  CHECK(small.blocks == std::vector<BlockState>{{address(before), 4 * KiB, 4 * KiB, true},
                                                {address(before) + 4 * KiB, 2 * MiB - 4 * KiB, 0, false}});
  CHECK(!large.small);
  CHECK(large.blocks == std::vector<BlockState>{{address(w), 4 * MiB, 3 * MiB, true}});
  alloc.release(w);
  alloc.release(before);

  // A ring of 3 keeps the last 3 events.
  FakeDevice other;
  CachingAllocator small_ring(other.upstream());
  small_ring.record_history(3);
  void* x = small_ring.allocate(4 * KiB);
  small_ring.release(x);
  x = small_ring.allocate(8 * KiB);
  const std::vector<AllocatorEvent> kept = small_ring.history()->events();
  CHECK(small_ring.history()->overflowed());
  REQUIRE(kept.size() == 3);
  CHECK(kept[0].action == A::alloc);
  CHECK(kept[1].action == A::free_completed);
  CHECK(kept[2].action == A::alloc);
  CHECK(kept[2].bytes == 8 * KiB);
  small_ring.release(x);
}

TEST_CASE("history: each step's contexts are its own, and the table keeps only what the ring and live blocks name") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  alloc.record_history(64);
  const MemoryHistory& h = *alloc.history();
  void* kept = nullptr;
  {
    profile::Recorder where;
    const profile::Recording on(where);
    const profile::Span step("step", "step 0");
    kept = alloc.allocate(4 * KiB, "kept from the first step");
  }
  for (int s = 1; s <= 5000; ++s) {  // 5,000 steps, each its own context
    profile::Recorder where;
    const profile::Recording on(where);
    const profile::Span step("step", [&] { return "step " + std::to_string(s); });
    alloc.release(alloc.allocate(8 * KiB));
  }
  const MemoryHistory::View v = h.view();
  CHECK(v.contexts.size() < 2 * 1024 + 64);  // not 5,001
  REQUIRE(v.events.size() == 64);
  // The kept events still name their own step; the live block its first one.
  const AllocatorEvent& last_alloc = v.events[v.events.size() - 2];
  REQUIRE(last_alloc.action == AllocatorAction::alloc);
  REQUIRE(last_alloc.context < v.contexts.size());
  CHECK(v.contexts[last_alloc.context].spans.at(0).name == "step 5000");
  const std::uint32_t live = v.live.at(address(kept));
  CHECK(v.contexts.at(live).what == "kept from the first step");
  CHECK(v.contexts.at(live).spans.at(0).name == "step 0");
  alloc.release(kept);
}

TEST_CASE("state: the expandable segment is its runs of mapped pages; its history maps and unmaps them") {
  FakeDevice device;
  CachingAllocator alloc(expandable_upstream(device));
  alloc.record_history();
  auto* a = static_cast<char*>(alloc.allocate(4 * MiB, "a"));
  void* b = alloc.allocate(6 * MiB, "b");
  void* c = alloc.allocate(2 * MiB, "c");
  alloc.release(b);
  alloc.empty_cache();  // b's three pages go: two runs of mapped pages are left
  const AllocatorState state = alloc.state();
  REQUIRE(state.size() == 2);
  CHECK(state[0].expandable);
  CHECK(state[0].address == address(a));
  CHECK(state[0].blocks == std::vector<BlockState>{{address(a), 4 * MiB, 4 * MiB, true}});
  CHECK(state[1].address == address(a) + 10 * MiB);
  CHECK(state[1].blocks == std::vector<BlockState>{{address(c), 2 * MiB, 2 * MiB, true}});
  check_state(state, *alloc.history(), alloc.stats());
  // A block over the holes maps them again: one run.
  void* d = alloc.allocate(5 * MiB, "d");
  const AllocatorState again = alloc.state();
  REQUIRE(again.size() == 1);
  CHECK(again[0].bytes == 12 * MiB);
  check_state(again, *alloc.history(), alloc.stats());
  const std::vector<AllocatorEvent> events = alloc.history()->events();
  CHECK(events.back().action == AllocatorAction::alloc);
  CHECK(events[events.size() - 2].action == AllocatorAction::segment_map);
  CHECK(events[events.size() - 2].bytes == 6 * MiB);
  for (void* p : {static_cast<void*>(a), c, d}) alloc.release(p);
}

TEST_CASE("requests are rounded up to 512 bytes and blocks are 256-byte aligned") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  void* a = alloc.allocate(1);
  void* b = alloc.allocate(513);
  void* c = alloc.allocate(1024);
  auto s = alloc.stats();
  CHECK(s.allocated_bytes == 512 + 1024 + 1024);
  CHECK(s.requested_bytes == 1 + 513 + 1024);
  CHECK(s.reserved_bytes == CachingAllocator::kSmallSegment);
  CHECK(s.upstream_allocations == 1);
  CHECK(s.allocations == 3);
  // Carved one after the other from one segment, each at its base plus a multiple of 512.
  CHECK(address(b) == address(a) + 512);
  CHECK(address(c) == address(b) + 1024);
  for (void* p : {a, b, c}) CHECK(address(p) % 256 == 0);
  CHECK(alloc.allocate(0) == nullptr);
  alloc.release(nullptr);
  for (void* p : {a, b, c}) alloc.release(p);
  s = alloc.stats();
  CHECK(s.allocated_bytes == 0);
  CHECK(s.requested_bytes == 0);
  CHECK(s.reserved_bytes == CachingAllocator::kSmallSegment);  // kept for the next request
}

TEST_CASE("a released block is reused without a new segment") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  void* a = alloc.allocate(4000, "x");
  alloc.release(a);
  void* b = alloc.allocate(4000, "y");
  CHECK(b == a);
  auto s = alloc.stats();
  CHECK(s.cache_hits == 1);
  CHECK(s.upstream_allocations == 1);
  CHECK(device.allocate_calls == 1);
  alloc.release(b);
}

TEST_CASE("blocks split from a segment merge again when released") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  const std::size_t n = 256 * KiB;
  auto* a = static_cast<char*>(alloc.allocate(n));
  auto* b = static_cast<char*>(alloc.allocate(n));
  auto* c = static_cast<char*>(alloc.allocate(n));
  CHECK(b == a + n);
  CHECK(c == b + n);
  alloc.release(b);
  alloc.release(a);
  const auto hits = alloc.stats().cache_hits;  // b and c came from the segment's free rest
  // The free tail after c (1.25 MiB) also fits 512 KiB; best fit takes the merged a+b.
  void* ab = alloc.allocate(2 * n);
  CHECK(ab == a);
  auto s = alloc.stats();
  CHECK(s.upstream_allocations == 1);
  CHECK(s.cache_hits == hits + 1);
  CHECK(s.allocated_bytes == 3 * n);

  // Releasing the middle block last merges it with both neighbours: one whole free
  // segment, which empty_cache gives back.
  void* d = alloc.allocate(512);  // from the tail, after c
  CHECK(d == c + n);
  alloc.release(ab);
  alloc.release(d);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes == CachingAllocator::kSmallSegment);  // c still in use
  CHECK(device.release_calls == 0);
  alloc.release(c);
  alloc.empty_cache();
  s = alloc.stats();
  CHECK(s.reserved_bytes == 0);
  CHECK(s.upstream_releases == 1);
  CHECK(device.release_calls == 1);
  CHECK(device.outstanding == 0);
}

TEST_CASE("small and large requests come from separate pools") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  // A large request gets a segment of its size rounded up to 2 MiB.
  auto* big = static_cast<char*>(alloc.allocate(3 * MiB + 1, "big"));
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  alloc.release(big);
  // A small request never takes the free 4 MiB: it gets a 2 MiB segment of its own.
  auto* small = static_cast<char*>(alloc.allocate(4 * KiB, "small"));
  CHECK((small < big || small >= big + 4 * MiB));
  auto s = alloc.stats();
  CHECK(s.upstream_allocations == 2);
  CHECK(s.cache_hits == 0);
  CHECK(s.reserved_bytes == 6 * MiB);
  // 1 MiB is still small; the small segment has room for it, but not for 1 MiB + 512.
  void* one = alloc.allocate(CachingAllocator::kSmallLimit);
  CHECK(alloc.stats().upstream_allocations == 2);
  void* over = alloc.allocate(CachingAllocator::kSmallLimit + 1);
  CHECK(over == big);  // the large pool's free block, not the small segment's rest
  CHECK(alloc.stats().cache_hits == 2);
  for (void* p : {static_cast<void*>(small), one, over}) alloc.release(p);
}

TEST_CASE("the large pool splits only when more than 1 MiB is left") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  // 5 MiB in a 6 MiB segment: the 1 MiB left stays with the block.
  void* a = alloc.allocate(5 * MiB);
  auto s = alloc.stats();
  CHECK(s.reserved_bytes == 6 * MiB);
  CHECK(s.allocated_bytes == 6 * MiB);
  CHECK(s.requested_bytes == 5 * MiB);
  // 4.5 MiB in a 6 MiB segment: the 1.5 MiB left is split off and serves the next request.
  auto* b = static_cast<char*>(alloc.allocate(4 * MiB + 512 * KiB));
  CHECK(alloc.stats().allocated_bytes == 6 * MiB + 4 * MiB + 512 * KiB);
  void* c = alloc.allocate(1 * MiB + 512 * KiB);
  CHECK(c == b + 4 * MiB + 512 * KiB);
  s = alloc.stats();
  CHECK(s.upstream_allocations == 2);
  CHECK(s.cache_hits == 1);
  for (void* p : {a, static_cast<void*>(b), c}) alloc.release(p);
  alloc.empty_cache();
  CHECK(device.outstanding == 0);
}

TEST_CASE("peaks follow allocations until reset_peak") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  void* a = alloc.allocate(3 * MiB);  // 4 MiB segment, whole
  void* b = alloc.allocate(512 * KiB);
  auto s = alloc.stats();
  CHECK(s.peak_allocated == 4 * MiB + 512 * KiB);
  CHECK(s.peak_reserved == 6 * MiB);
  alloc.release(a);
  alloc.empty_cache();
  s = alloc.stats();
  CHECK(s.allocated_bytes == 512 * KiB);
  CHECK(s.reserved_bytes == 2 * MiB);
  CHECK(s.peak_allocated == 4 * MiB + 512 * KiB);
  CHECK(s.peak_reserved == 6 * MiB);
  alloc.reset_peak();
  s = alloc.stats();
  CHECK(s.peak_allocated == 512 * KiB);
  CHECK(s.peak_reserved == 2 * MiB);
  void* c = alloc.allocate(1 * MiB);
  CHECK(alloc.stats().peak_allocated == 1 * MiB + 512 * KiB);
  CHECK(alloc.stats().peak_reserved == 2 * MiB);
  alloc.release(b);
  alloc.release(c);
  CHECK(alloc.stats().peak_allocated == 1 * MiB + 512 * KiB);
}

TEST_CASE("out of memory: cached segments go back upstream and the request is retried") {
  FakeDevice device(6 * MiB);
  CachingAllocator alloc(device.upstream());
  // Two small segments, then all their blocks released: 4 MiB cached, nothing in use.
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(alloc.allocate(1 * MiB));
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  for (void* p : blocks) alloc.release(p);
  // 5 MiB needs a 6 MiB segment: the device has 2 MiB left until the cache goes back.
  void* big = alloc.allocate(5 * MiB, "layers.3.attention scores");
  REQUIRE(big != nullptr);
  auto s = alloc.stats();
  CHECK(device.failed_calls == 1);
  CHECK(s.upstream_releases == 2);
  CHECK(s.reserved_bytes == 6 * MiB);
  CHECK(s.allocated_bytes == 6 * MiB);

  // Nothing left to give back: the error names the tensor and the figures.
  CHECK_ERROR_CONTAINS(alloc.allocate(1536 * MiB, "layers.3.attention scores"),
                       "out of device memory allocating 1610612736 bytes (1.50 GiB) for layers.3.attention "
                       "scores: 6.00 MiB allocated by tessera, 6.00 MiB reserved, 0 B free on the device");
  CHECK_ERROR_CONTAINS(alloc.allocate(100, "wq.grad"), "allocating 100 bytes (100 B) for wq.grad");
  // A failed request leaves the allocator as it was.
  s = alloc.stats();
  CHECK(s.allocated_bytes == 6 * MiB);
  CHECK(s.requested_bytes == 5 * MiB);
  CHECK(s.reserved_bytes == 6 * MiB);
  CHECK(s.allocations == 5);
  alloc.release(big);
  void* again = alloc.allocate(100, "wq.grad");  // the 6 MiB segment goes back, a 2 MiB one comes
  CHECK(again != nullptr);
  CHECK(alloc.stats().reserved_bytes == 2 * MiB);
  alloc.release(again);
}

TEST_CASE("out of memory without the device's free bytes, and on a named device") {
  FakeDevice device(2 * MiB);
  auto upstream = device.upstream(false);
  upstream.device = "cuda:1";
  CachingAllocator alloc(std::move(upstream));
  void* a = alloc.allocate(2 * MiB, "tok_embeddings.weight");
  std::string message = testing::error_of([&] { alloc.allocate(3 * MiB, "output.weight"); });
  CHECK(message ==
        "out of device memory on cuda:1 allocating 3145728 bytes (3.00 MiB) for output.weight: "
        "2.00 MiB allocated by tessera, 2.00 MiB reserved");
  // Unnamed requests say so by saying nothing.
  CHECK_ERROR_CONTAINS(alloc.allocate(3 * MiB), "allocating 3145728 bytes (3.00 MiB): 2.00 MiB allocated");
  alloc.release(a);
}

TEST_CASE("a request larger than any device is refused before rounding overflows") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  CHECK_ERROR_CONTAINS(alloc.allocate(std::numeric_limits<std::size_t>::max(), "huge"),
                       "cannot allocate 18446744073709551615 bytes for huge: larger than any device memory");
  CHECK(device.allocate_calls == 0);
}

TEST_CASE("bad releases are errors naming the pointer") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  auto* a = static_cast<char*>(alloc.allocate(4 * KiB));
  auto* b = static_cast<char*>(alloc.allocate(4 * KiB));
  int local = 0;
  CHECK_ERROR_CONTAINS(alloc.release(&local), "not allocated by this caching allocator");
  CHECK_ERROR_CONTAINS(alloc.release(a + 1024),
                       "not the start of a block (it lies 1024 bytes into a block of 4096 bytes");
  alloc.release(a);
  CHECK_ERROR_CONTAINS(alloc.release(a), "already released");
  // b's block merges with the free rest of the segment: still recognised as released.
  alloc.release(b);
  std::string message = testing::error_of([&] { alloc.release(b); });
  CHECK(message.find("already released") != std::string::npos);
  std::ostringstream named;
  named << static_cast<const void*>(b);
  CHECK(message.find(named.str()) != std::string::npos);
  CHECK(alloc.stats().allocated_bytes == 0);

  // A block of another allocator is not this one's.
  FakeDevice other_device;
  CachingAllocator other(other_device.upstream());
  void* c = other.allocate(4 * KiB);
  CHECK_ERROR_CONTAINS(alloc.release(c), "not allocated by this caching allocator");
  CHECK(other.owns(c));
  CHECK(!alloc.owns(c));
  other.release(c);
  CHECK(!other.owns(c));

  // try_release: false for a pointer outside this allocator's segments, the release
  // for its own block, and the same errors as release() inside its segments.
  void* d = other.allocate(4 * KiB);
  CHECK(!alloc.try_release(d));
  CHECK(!alloc.try_release(&local));
  CHECK(!alloc.try_release(nullptr));
  CHECK(other.try_release(d));
  CHECK(other.stats().allocated_bytes == 0);
  CHECK_ERROR_CONTAINS(other.try_release(d), "already released");
}

TEST_CASE("release_to_owner finds the allocator from the pointer alone, as a Buffer deleter") {
  FakeDevice device0, device1;
  CachingAllocator alloc0(device0.upstream());
  CachingAllocator alloc1(device1.upstream());
  void* a = alloc0.allocate(4 * KiB);
  void* b = alloc1.allocate(8 * KiB);
  CachingAllocator::release_to_owner(b);
  CHECK(alloc1.stats().allocated_bytes == 0);
  CHECK(alloc0.stats().allocated_bytes == 4 * KiB);
  CachingAllocator::release_to_owner(a);
  CHECK(alloc0.stats().allocated_bytes == 0);
  CachingAllocator::release_to_owner(nullptr);
  int local = 0;
  CHECK_ERROR_CONTAINS(CachingAllocator::release_to_owner(&local), "not allocated by any caching allocator");
  CHECK_ERROR_CONTAINS(CachingAllocator::release_to_owner(a), "already released");

  // The Buffer counts the bytes in the device's MemoryStats; the allocator does not.
  MemoryStats counted[kDeviceKinds];
  ScopedMemoryStats scope(counted);
  {
    Buffer<float> buffer(static_cast<float*>(alloc1.allocate(1000 * sizeof(float), "h")), 1000, Device::cuda,
                         &CachingAllocator::release_to_owner);
    CHECK(counted[1].current() == 4000);
    CHECK(alloc1.stats().requested_bytes == 4000);
    CHECK(alloc1.stats().allocated_bytes == 4096);
  }
  CHECK(counted[1].current() == 0);
  CHECK(counted[1].peak() == 4000);
  CHECK(alloc1.stats().allocated_bytes == 0);
}

TEST_CASE("the upstream must give both calls and aligned segments") {
  FakeDevice device;
  auto upstream = device.upstream();
  upstream.release = nullptr;
  upstream.device = "cuda:0";
  CHECK_ERROR_CONTAINS(CachingAllocator{upstream},
                       "CachingAllocator on cuda:0: the upstream needs both allocate and release");

  // An upstream handing out segments 16 bytes past an aligned address.
  std::map<void*, void*> bases;
  int released = 0;
  CachingAllocator::Upstream skewed;
  skewed.allocate = [&](std::size_t bytes) -> void* {
    auto* base = static_cast<char*>(std::aligned_alloc(256, bytes + 256));
    bases[base + 16] = base;
    return base + 16;
  };
  skewed.release = [&](void* p, std::size_t) {
    std::free(bases.at(p));
    bases.erase(p);
    ++released;
  };
  CachingAllocator alloc(skewed);
  CHECK_ERROR_CONTAINS(alloc.allocate(100, "x"), "returned a segment at ");
  CHECK_ERROR_CONTAINS(alloc.allocate(100, "x"), "that is not 256-byte aligned");
  CHECK(released == 2);  // each segment given back at once
  CHECK(alloc.stats().reserved_bytes == 0);
}

TEST_CASE("destruction gives every segment back, blocks in use included, and never throws") {
  FakeDevice device;
  {
    CachingAllocator alloc(device.upstream());
    alloc.allocate(4 * KiB);
    alloc.allocate(3 * MiB);
    void* p = alloc.allocate(8 * MiB);
    alloc.release(p);
    CHECK(device.outstanding == 14 * MiB);
  }
  CHECK(device.outstanding == 0);
  CHECK(device.release_calls == 3);

  FakeDevice failing;
  int attempts = 0;
  {
    auto upstream = failing.upstream();
    auto release = upstream.release;
    upstream.release = [&, release](void* p, std::size_t bytes) {
      ++attempts;
      release(p, bytes);
      throw std::runtime_error("cudaFree failed");
    };
    CachingAllocator alloc(std::move(upstream));
    alloc.allocate(4 * KiB);
    alloc.allocate(3 * MiB);
  }
  CHECK(attempts == 2);  // the first failure did not stop the second release
}

TEST_CASE("threads sharing one allocator") {
  FakeDevice device;
  CachingAllocator alloc(device.upstream());
  constexpr int threads = 4;
  constexpr int steps = 3000;
  std::vector<std::thread> workers;
  std::vector<int> served(threads, 0);
  std::vector<std::string> failures(threads);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::vector<std::pair<std::uint64_t*, std::uint64_t>> live;  // block, the tag written in it
      for (int i = 0; i < steps; ++i) {
        if (live.empty() || rng() % 2 == 0) {
          std::size_t bytes = rng() % 4 == 0 ? 1 * MiB + rng() % (3 * MiB) : 8 + rng() % (64 * KiB);
          auto* p = static_cast<std::uint64_t*>(alloc.allocate(bytes));
          std::uint64_t tag = (static_cast<std::uint64_t>(t) << 32) | static_cast<std::uint64_t>(i);
          *p = tag;
          live.emplace_back(p, tag);
          ++served[t];
        } else {
          std::size_t k = rng() % live.size();
          if (*live[k].first != live[k].second && failures[t].empty())
            failures[t] = "a block was overwritten by another allocation";
          alloc.release(live[k].first);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (auto& [p, tag] : live) {
        if (*p != tag && failures[t].empty()) failures[t] = "a block was overwritten by another allocation";
        alloc.release(p);
      }
    });
  }
  for (auto& w : workers) w.join();
  for (auto& f : failures) CHECK(f.empty());
  auto s = alloc.stats();
  CHECK(s.allocated_bytes == 0);
  CHECK(s.requested_bytes == 0);
  std::size_t total = 0;
  for (int n : served) total += static_cast<std::size_t>(n);
  CHECK(s.allocations == total);
  CHECK(s.reserved_bytes == device.outstanding);
  CHECK(s.upstream_allocations + s.cache_hits == s.allocations);
  alloc.empty_cache();
  CHECK(device.outstanding == 0);
}

TEST_CASE("expandable: the large pool is one segment that grows at its end by the pages a request lacks") {
  FakeDevice device;
  CachingAllocator alloc(expandable_upstream(device));
  auto* x = static_cast<char*>(alloc.allocate(4 * MiB, "x"));
  auto* y = static_cast<char*>(alloc.allocate(6 * MiB, "y"));
  CHECK(y == x + 4 * MiB);
  CHECK(alloc.stats().reserved_bytes == 10 * MiB);
  CHECK(device.reserve_calls == 1);
  CHECK(device.map_calls == 2);
  alloc.release(y);
  // 12 MiB: no free block fits, so the free 6 MiB at the end takes 6 MiB more after it.
  auto* z = static_cast<char*>(alloc.allocate(12 * MiB, "z"));
  CHECK(z == y);
  auto s = alloc.stats();
  CHECK(s.reserved_bytes == 16 * MiB);
  CHECK(s.allocated_bytes == 16 * MiB);
  CHECK(s.upstream_allocations == 3);
  CHECK(device.outstanding == 16 * MiB);
  std::memset(z, 0x5a, 12 * MiB);  // every byte of it is mapped
  // With a segment per block, the same requests hold 22 MiB.
  {
    FakeDevice plain_device;
    CachingAllocator plain(plain_device.upstream());
    void* px = plain.allocate(4 * MiB);
    plain.release(plain.allocate(6 * MiB));
    void* pz = plain.allocate(12 * MiB);
    CHECK(plain.stats().reserved_bytes == 22 * MiB);
    plain.release(px);
    plain.release(pz);
  }
  // Small requests still take 2 MiB segments of their own.
  auto* small = static_cast<char*>(alloc.allocate(4 * KiB, "small"));
  CHECK((small < x || small >= x + 16 * MiB));
  CHECK(alloc.stats().reserved_bytes == 18 * MiB);
  // A free block inside the segment is reused by best fit before the segment grows.
  alloc.release(x);
  void* w = alloc.allocate(3 * MiB, "w");
  CHECK(w == x);
  CHECK(alloc.stats().reserved_bytes == 18 * MiB);
  CHECK(alloc.owns(w));
  CHECK(alloc.owns(z));
  for (void* p : {w, static_cast<void*>(z), static_cast<void*>(small)}) alloc.release(p);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes == 0);
  CHECK(device.outstanding == 0);
  CHECK(device.mapped_pages.empty());
}

TEST_CASE("expandable: empty_cache unmaps the whole free pages at the end; releases are checked as anywhere") {
  FakeDevice device;
  CachingAllocator alloc(expandable_upstream(device));
  // 2.5 MiB of a 4 MiB page pair: the 1.5 MiB after it is split off, free.
  auto* x = static_cast<char*>(alloc.allocate(2 * MiB + 512 * KiB, "x"));
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  alloc.empty_cache();  // the free 1.5 MiB shares x's second page: nothing to unmap
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  CHECK(device.unmap_calls == 0);
  // 3 MiB: the free 1.5 MiB at the end and one more page.
  auto* y = static_cast<char*>(alloc.allocate(3 * MiB, "y"));
  CHECK(y == x + 2 * MiB + 512 * KiB);
  CHECK(alloc.stats().reserved_bytes == 6 * MiB);
  alloc.release(y);
  alloc.empty_cache();  // the third page goes; the half page after x stays, free
  auto s = alloc.stats();
  CHECK(s.reserved_bytes == 4 * MiB);
  CHECK(s.upstream_releases == 1);
  CHECK(device.outstanding == 4 * MiB);
  std::memset(x, 1, 2 * MiB + 512 * KiB);
  void* again = alloc.allocate(1 * MiB + 512 * KiB, "again");  // the half page, no growth
  CHECK(again == y);
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  alloc.release(again);

  CHECK_ERROR_CONTAINS(alloc.release(x + 512), "not the start of a block (it lies 512 bytes into a block of");
  alloc.release(x);
  CHECK_ERROR_CONTAINS(alloc.release(x), "already released");
  alloc.empty_cache();
  s = alloc.stats();
  CHECK(s.reserved_bytes == 0);
  CHECK(device.outstanding == 0);
  // Growing again starts at the range's base; the range is reserved once.
  void* z = alloc.allocate(8 * MiB, "z");
  CHECK(z == x);
  CHECK(device.reserve_calls == 1);
  alloc.release(z);
}

TEST_CASE("expandable: empty_cache unmaps the free pages inside the segment too; a block over them maps them again") {
  FakeDevice device;
  CachingAllocator alloc(expandable_upstream(device));
  auto* a = static_cast<char*>(alloc.allocate(4 * MiB, "a"));
  void* b = alloc.allocate(6 * MiB, "b");
  void* c = alloc.allocate(2 * MiB, "c");
  alloc.release(b);
  alloc.empty_cache();  // c holds the end: b's three pages go, the segment's span stays
  auto s = alloc.stats();
  CHECK(s.reserved_bytes == 6 * MiB);
  CHECK(s.upstream_releases == 1);
  CHECK(device.outstanding == 6 * MiB);
  CHECK(device.mapped_pages.size() == 3);
  // 5 MiB takes b's free 6 MiB (1 MiB left is not split off): its pages come back.
  auto* d = static_cast<char*>(alloc.allocate(5 * MiB, "d"));
  CHECK(d == a + 4 * MiB);
  CHECK(alloc.stats().reserved_bytes == 12 * MiB);
  std::memset(d, 1, 5 * MiB);
  // A page shared with a block in use stays mapped: release a and d, keep 1.5 MiB of the
  // first page in use.
  alloc.release(d);
  alloc.release(a);
  void* e = alloc.allocate(1 * MiB + 512 * KiB, "e");  // the start of the free 10 MiB
  CHECK(e == a);
  alloc.empty_cache();  // pages 1 to 4 go; page 0 (e's) and c's stay
  CHECK(alloc.stats().reserved_bytes == 4 * MiB);
  CHECK(device.outstanding == 4 * MiB);
  std::memset(e, 2, 1 * MiB + 512 * KiB);
  for (void* p : {e, c}) alloc.release(p);
  alloc.empty_cache();
  CHECK(alloc.stats().reserved_bytes == 0);
  CHECK(device.mapped_pages.empty());
}

TEST_CASE("expandable: out of memory gives back the free pages inside the segment for the request") {
  FakeDevice device(14 * MiB);
  CachingAllocator alloc(expandable_upstream(device));
  auto* a = static_cast<char*>(alloc.allocate(4 * MiB, "a"));
  void* b = alloc.allocate(6 * MiB, "b");
  void* c = alloc.allocate(2 * MiB, "c");
  alloc.release(b);
  // 7 MiB: no free block fits and the device has 2 MiB left; b's 6 MiB of free pages go
  // back, and the segment grows by 8 MiB at its end.
  auto* e = static_cast<char*>(alloc.allocate(7 * MiB, "e"));
  CHECK(e == a + 12 * MiB);
  CHECK(device.failed_calls == 1);
  CHECK(alloc.stats().reserved_bytes == 14 * MiB);
  std::memset(e, 3, 7 * MiB);
  // The device is full; a (4 MiB, mapped) and b's unmapped pages are one free block now.
  // 4 MiB at its start needs no page mapped...
  alloc.release(a);
  void* f = alloc.allocate(4 * MiB, "f");
  CHECK(f == a);
  CHECK(device.failed_calls == 1);
  // ...6.5 MiB there needs pages the device no longer has, even after the cache goes.
  alloc.release(f);
  CHECK_ERROR_CONTAINS(alloc.allocate(6 * MiB + 512 * KiB, "layers.1.attention.wo"),
                       "out of device memory allocating 6815744 bytes (6.50 MiB) for layers.1.attention.wo");
  auto s = alloc.stats();
  CHECK(s.reserved_bytes == device.outstanding);
  CHECK(s.allocated_bytes == 2 * MiB + 8 * MiB);
  for (void* p : {c, static_cast<void*>(e)}) alloc.release(p);
  alloc.empty_cache();
  CHECK(device.outstanding == 0);
  CHECK(device.mapped_pages.empty());
}

TEST_CASE("expandable: out of memory empties the cache and retries once, then names the tensor") {
  FakeDevice device(8 * MiB);
  CachingAllocator alloc(expandable_upstream(device));
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(alloc.allocate(1 * MiB));  // two small segments
  for (void* p : blocks) alloc.release(p);
  // 5 MiB: 6 MiB of pages, 4 MiB left on the device until the small segments go back.
  void* big = alloc.allocate(5 * MiB, "big");
  CHECK(device.failed_calls == 1);
  CHECK(alloc.stats().reserved_bytes == 6 * MiB);
  CHECK_ERROR_CONTAINS(alloc.allocate(4 * MiB, "layers.0.feed_forward.w1"),
                       "out of device memory allocating 4194304 bytes (4.00 MiB) for layers.0.feed_forward.w1: "
                       "6.00 MiB allocated by tessera, 6.00 MiB reserved, 2.00 MiB free on the device");
  CHECK(alloc.stats().reserved_bytes == 6 * MiB);
  // Released, the 6 MiB at the end takes one more page for 7 MiB.
  alloc.release(big);
  void* bigger = alloc.allocate(7 * MiB, "bigger");
  CHECK(bigger == big);
  CHECK(alloc.stats().reserved_bytes == 8 * MiB);
  alloc.release(bigger);
}

TEST_CASE("expandable: destruction unmaps the pages and frees the range; a bad upstream is refused") {
  FakeDevice device;
  {
    CachingAllocator alloc(expandable_upstream(device));
    alloc.allocate(3 * MiB);
    alloc.allocate(4 * KiB);
    alloc.release(alloc.allocate(5 * MiB));
    CHECK(device.outstanding == 2 * MiB + 4 * MiB + 6 * MiB);
  }
  CHECK(device.outstanding == 0);
  CHECK(device.mapped_pages.empty());
  CHECK(device.ranges.empty());

  auto missing = expandable_upstream(device);
  missing.expandable->map = nullptr;
  CHECK_ERROR_CONTAINS(CachingAllocator{missing}, "an expandable upstream needs reserve, map, unmap and free_range");
  auto odd = expandable_upstream(device, 256 * MiB, 1000);
  CHECK_ERROR_CONTAINS(CachingAllocator{odd}, "expandable pages of 1000 bytes (a multiple of 512 is needed)");
  auto none = expandable_upstream(device);
  none.expandable->reserve = [](std::size_t) -> void* { return nullptr; };
  CachingAllocator alloc(none);
  CHECK_ERROR_CONTAINS(alloc.allocate(4 * MiB), "could not reserve an address range of 268435456 bytes (256.00 MiB)");
  CHECK(alloc.allocate(4 * KiB) != nullptr);  // the small pool does not need it
}

TEST_CASE("random allocations and releases keep every invariant") {
  for (const bool expandable : {false, true}) {
    CAPTURE(expandable);
    FakeDevice device(96 * MiB);
    CachingAllocator alloc(expandable ? expandable_upstream(device) : device.upstream());
    std::mt19937_64 rng(20240611);
    struct Live {
      std::size_t bytes;
      unsigned char tag;
    };
    std::map<std::uintptr_t, Live> live;  // by address
    std::size_t requested = 0;
    std::size_t allocations = 0;
    int out_of_memory = 0;
    alloc.record_history(std::size_t{1} << 20);  // every event: the replay below starts from the first
    for (int step = 0; step < 6000; ++step) {
      if (live.empty() || rng() % 5 < 3) {
        std::size_t bytes;
        switch (rng() % 4) {
          case 0: bytes = 1 + rng() % 2048; break;
          case 1: bytes = 1 + rng() % (1 * MiB); break;
          case 2: bytes = 1 * MiB + rng() % (4 * MiB); break;
          default: bytes = 512 * (1 + rng() % 64); break;
        }
        void* p = nullptr;
        try {
          p = alloc.allocate(bytes, "random");
        } catch (const Error& e) {
          CHECK(std::string(e.what()).find("out of device memory allocating") != std::string::npos);
          ++out_of_memory;
          // Free some to make room.
          for (int k = 0; k < 8 && !live.empty(); ++k) {
            auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
            alloc.release(reinterpret_cast<void*>(it->first));
            requested -= it->second.bytes;
            live.erase(it);
          }
          continue;
        }
        auto a = address(p);
        REQUIRE(a % 256 == 0);
        // No overlap with the live blocks on either side.
        auto next = live.lower_bound(a);
        if (next != live.end()) REQUIRE(a + bytes <= next->first);
        if (next != live.begin()) {
          auto prev = std::prev(next);
          REQUIRE(prev->first + prev->second.bytes <= a);
        }
        auto tag = static_cast<unsigned char>(rng());
        auto* c = static_cast<unsigned char*>(p);
        c[0] = tag;
        c[bytes - 1] = tag;
        for (std::size_t o = 1 * MiB; o < bytes; o += 1 * MiB) c[o] = tag;  // every page is mapped
        live.emplace(a, Live{bytes, tag});
        requested += bytes;
        ++allocations;
      } else {
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        auto* c = reinterpret_cast<unsigned char*>(it->first);
        REQUIRE(c[0] == it->second.tag);
        REQUIRE(c[it->second.bytes - 1] == it->second.tag);
        alloc.release(c);
        requested -= it->second.bytes;
        live.erase(it);
      }
      if (step % 500 == 0) alloc.empty_cache();
      auto s = alloc.stats();
      REQUIRE(s.requested_bytes == requested);
      REQUIRE(s.allocations == allocations);
      REQUIRE(s.allocated_bytes >= s.requested_bytes);
      REQUIRE(s.allocated_bytes <= s.reserved_bytes);
      REQUIRE(s.reserved_bytes == device.outstanding);
      REQUIRE(s.allocated_bytes % CachingAllocator::kBlockRound == 0);
      REQUIRE(s.peak_allocated >= s.allocated_bytes);
      REQUIRE(s.peak_reserved >= s.reserved_bytes);
      if (!expandable) REQUIRE(s.upstream_allocations - s.upstream_releases == device.segments.size());
      if (step % 250 == 0) check_state(alloc.state(), *alloc.history(), s);
    }
    CHECK(!alloc.history()->overflowed());
    CHECK(out_of_memory > 0);  // the budget was reached and the allocator recovered
    for (auto& [a, l] : live) alloc.release(reinterpret_cast<void*>(a));
    auto s = alloc.stats();
    CHECK(s.allocated_bytes == 0);
    CHECK(s.requested_bytes == 0);
    alloc.empty_cache();
    CHECK(alloc.stats().reserved_bytes == 0);
    CHECK(device.outstanding == 0);
  }
}

}  // namespace test_caching_allocator
