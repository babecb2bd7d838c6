// A device's memory snapshot in PyTorch's format: the dict torch.cuda.memory._snapshot()
// returns, pickled, which pytorch.org/memory_viz draws (its Active Memory Timeline, its
// segment and allocator-state views) and torch.cuda._memory_viz reads (segsum, trace).
// llama-train writes one per rank (profiling.enable_memory_snapshot), llama-plan one of
// the step it predicts (--emit-memory-snapshot).
//
// What goes in, from an allocator's AllocatorState and MemoryHistory
// (core/memory_history.hpp):
//
//   {"segments": [{"device", "address", "total_size", "allocated_size", "active_size",
//                  "requested_size", "stream": 0, "segment_type": "small" | "large",
//                  "segment_pool_id": (0, 0), "is_expandable", "frames": [],
//                  "blocks": [{"address", "size", "requested_size",
//                              "state": "active_allocated" | "inactive", "frames"}]}],
//    "device_traces": [[], ..., [{"action", "addr", "size", "stream": 0, "time_us",
//                                 "frames"[, "device_free"]}]],   // at index `device`
//    "allocator_settings": {"expandable_segments", "trace_alloc_max_entries",
//                           "trace_alloc_overflowed"}}
//
// A block's "frames" are where it was asked for, the innermost first: a frame for what the
// memory holds ({"filename": "memory use", "line": 0, "name": "parameters"}, or
// "workspace: the cuDNN attention workspace" where the request was named), then one per
// span open on the asking thread ({"filename": "layer", "line": its depth, "name":
// "layers.3 backward"}), the step's outermost. Every stream is 0: tessera allocates on
// one compute stream. An oom event's "addr" is the device's free bytes, as PyTorch's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <unordered_map>

#include "tessera/core/error.hpp"
#include "tessera/core/memory_history.hpp"
#include "tessera/io/pickle.hpp"

namespace tessera::io {

/// The snapshot of device `device` (its index in "device_traces"), pickled. `history`
/// may be nullptr: the segments alone, no events, no frames.
inline std::string torch_memory_snapshot(const AllocatorState& state, const MemoryHistory* history, int device = 0,
                                         bool expandable_segments = false) {
  TESSERA_CHECK(device >= 0, "memory snapshot: device ", device, " (a device index is 0 or more)");
  // One moment's events and contexts: the allocator may go on meanwhile (thread ranks).
  const MemoryHistory::View h = history != nullptr ? history->view() : MemoryHistory::View{};
  PickleWriter w;
  std::unordered_map<std::uint32_t, std::uint32_t> memo;  // context -> its frames' memo id
  auto frames = [&](std::uint32_t context) {
    if (context == 0 || context >= h.contexts.size()) {  // no history: no contexts
      w.begin_list();
      w.end_list();
      return;
    }
    if (const auto it = memo.find(context); it != memo.end()) return w.get(it->second);
    const AllocationContext& c = h.contexts[context];
    auto frame = [&](std::string_view filename, int line, const std::string& name) {
      w.begin_dict();
      w.string("filename");
      w.string(filename);
      w.string("line");
      w.integer(line);
      w.string("name");
      w.string(name);
      w.end_dict();
    };
    w.begin_list();
    frame("memory use", 0, c.what.empty() ? std::string(name_of(c.use)) : std::string(name_of(c.use)) + ": " + c.what);
    for (std::size_t i = c.spans.size(); i-- > 0;) frame(c.spans[i].category, static_cast<int>(i), c.spans[i].name);
    w.end_list();
    memo.emplace(context, w.memoize());
  };

  w.begin_dict();
  w.string("segments");
  w.begin_list();
  for (const SegmentState& s : state) {
    std::size_t allocated = 0, requested = 0;
    for (const BlockState& b : s.blocks)
      if (b.in_use) {
        allocated += b.bytes;
        requested += b.requested;
      }
    w.begin_dict();
    w.string("device");
    w.integer(device);
    w.string("address");
    w.integer(std::uint64_t{s.address});
    w.string("total_size");
    w.integer(std::uint64_t{s.bytes});
    w.string("allocated_size");
    w.integer(std::uint64_t{allocated});
    w.string("active_size");
    w.integer(std::uint64_t{allocated});
    w.string("requested_size");
    w.integer(std::uint64_t{requested});
    w.string("stream");
    w.integer(0);
    w.string("segment_type");
    w.string(s.small ? "small" : "large");
    w.string("segment_pool_id");
    w.integer(0);
    w.integer(0);
    w.pair();
    w.string("is_expandable");
    w.boolean(s.expandable);
    w.string("frames");
    frames(0);
    w.string("blocks");
    w.begin_list();
    for (const BlockState& b : s.blocks) {
      w.begin_dict();
      w.string("address");
      w.integer(std::uint64_t{b.address});
      w.string("size");
      w.integer(std::uint64_t{b.bytes});
      w.string("requested_size");
      w.integer(std::uint64_t{b.in_use ? b.requested : 0});
      w.string("state");
      w.string(b.in_use ? "active_allocated" : "inactive");
      w.string("frames");
      const auto live = b.in_use ? h.live.find(b.address) : h.live.end();
      frames(live != h.live.end() ? live->second : 0);
      w.end_dict();
    }
    w.end_list();
    w.end_dict();
  }
  w.end_list();

  w.string("device_traces");
  w.begin_list();
  for (int d = 0; d < device; ++d) {
    w.begin_list();
    w.end_list();
  }
  w.begin_list();
  if (history != nullptr)
    for (const AllocatorEvent& e : h.events) {
      const bool oom = e.action == AllocatorAction::oom;
      w.begin_dict();
      w.string("action");
      w.string(name_of(e.action));
      w.string("addr");
      w.integer(std::uint64_t{oom ? e.device_free : e.address});
      w.string("size");
      w.integer(std::uint64_t{e.bytes});
      w.string("stream");
      w.integer(0);
      w.string("time_us");
      w.integer(e.time_us);
      w.string("frames");
      frames(e.context);
      if (oom) {
        w.string("device_free");
        w.integer(std::uint64_t{e.device_free});
      }
      w.end_dict();
    }
  w.end_list();
  w.end_list();

  w.string("allocator_settings");
  w.begin_dict();
  w.string("expandable_segments");
  w.boolean(expandable_segments);
  w.string("trace_alloc_max_entries");
  w.integer(std::uint64_t{h.max_entries});
  w.string("trace_alloc_overflowed");
  w.boolean(h.overflowed);
  w.end_dict();
  w.end_dict();
  return w.finish();
}

/// Writes `pickle` to `path`; `key` names the setting the path came from in the error.
inline void write_memory_snapshot(const std::string& path, std::string_view pickle, std::string_view key) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(pickle.data(), static_cast<std::streamsize>(pickle.size()));
  out.close();
  TESSERA_CHECK(out.good(), key, ": cannot write the memory snapshot ", path);
}

}  // namespace tessera::io
