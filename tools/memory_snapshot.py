#!/usr/bin/env python3
"""Reads the memory snapshots tessera writes (PyTorch's format: llama-train's
profiling.enable_memory_snapshot, llama-plan's --emit-memory-snapshot), without PyTorch.

    memory_snapshot.py summary FILE...   what each device holds, its peak over the
                                         recorded events, and the largest allocation
                                         sites live at that peak
    memory_snapshot.py check FILE...     the snapshot is whole: every segment covered by
                                         its blocks, and the events, replayed from the
                                         first, end at the segments and blocks held
                                         (exit 1 naming the file and what disagrees)

The same files open in pytorch.org/memory_viz (drag a file onto the page). A pickle can
run code as it loads: read only snapshots you trust.
"""
import collections
import pickle
import sys


class Bad(Exception):
    pass


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def where(frames):
    """An allocation site: what it holds, then the spans, innermost first."""
    return " < ".join(f["name"] for f in frames) if frames else "(before the history)"


def load(path):
    try:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise Bad(f"{path}: not a readable pickle: {e}")
    for key in ("segments", "device_traces"):
        if key not in snapshot:
            raise Bad(f"{path}: no '{key}': not a memory snapshot")
    return snapshot


def devices(snapshot):
    """The devices the snapshot has segments or events for."""
    found = {s["device"] for s in snapshot["segments"]}
    found |= {d for d, trace in enumerate(snapshot["device_traces"]) if trace}
    return sorted(found) or [0]


class Replay:
    """`trace` replayed from its first event: the blocks in use after it (address ->
    (size, frames)) and the bytes held; the peak of bytes in use, with the blocks live at
    it, and the peak of bytes held."""

    def __init__(self, trace):
        self.blocks, self.held, self.peak, self.at_peak, self.peak_held = replay(trace)


def replay(trace):
    blocks, held, in_use = {}, 0, 0
    peak, at_peak, peak_held = 0, {}, 0
    for e in trace:
        a = e["action"]
        if a == "alloc":
            if e["addr"] in blocks:
                raise Bad(f"alloc of {e['addr']:#x} twice")
            blocks[e["addr"]] = (e["size"], e["frames"])
            in_use += e["size"]
            if in_use > peak:
                peak, at_peak = in_use, dict(blocks)
        elif a == "free_completed":
            if e["addr"] not in blocks:
                raise Bad(f"free of {e['addr']:#x}, never allocated")
            in_use -= blocks.pop(e["addr"])[0]
        elif a in ("segment_alloc", "segment_map"):
            held += e["size"]
            peak_held = max(peak_held, held)
        elif a in ("segment_free", "segment_unmap"):
            held -= e["size"]
            if held < 0:
                raise Bad(f"{a} of {e['size']} bytes at {e['addr']:#x}: more than is held")
    return blocks, held, peak, at_peak, peak_held


def check(path):
    snapshot = load(path)
    overflowed = snapshot.get("allocator_settings", {}).get("trace_alloc_overflowed", False)
    lines = []
    for d in devices(snapshot):
        segments = [s for s in snapshot["segments"] if s["device"] == d]
        held, in_use = 0, {}
        for s in segments:
            if s["address"] + s["total_size"] > 2**53:
                raise Bad(f"{path}: device {d}: segment {s['address']:#x}: above 2**53, where memory_viz's "
                          f"numbers lose their precision")
            at = s["address"]
            for b in s["blocks"]:
                if b["address"] != at:
                    raise Bad(f"{path}: device {d}: segment {s['address']:#x}: a block at {b['address']:#x}, "
                              f"where {at:#x} was expected")
                at += b["size"]
                if b["state"] == "active_allocated":
                    in_use[b["address"]] = b["size"]
            if at != s["address"] + s["total_size"]:
                raise Bad(f"{path}: device {d}: segment {s['address']:#x}: its blocks cover {at - s['address']} "
                          f"of its {s['total_size']} bytes")
            if s["allocated_size"] != sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated"):
                raise Bad(f"{path}: device {d}: segment {s['address']:#x}: allocated_size is not its blocks'")
            held += s["total_size"]
        trace = snapshot["device_traces"][d] if d < len(snapshot["device_traces"]) else []
        if trace and not overflowed:
            try:
                r = Replay(trace)
            except Bad as e:
                raise Bad(f"{path}: device {d}: {e}")
            trace_held = r.held
            replayed = {a: size for a, (size, _) in r.blocks.items()}
            if replayed != in_use:
                raise Bad(f"{path}: device {d}: the events leave {len(replayed)} blocks in use "
                          f"({sum(replayed.values())} bytes), the segments hold {len(in_use)} "
                          f"({sum(in_use.values())} bytes)")
            if trace_held != held:
                raise Bad(f"{path}: device {d}: the events leave {trace_held} bytes held, the segments {held}")
        lines.append(f"{path}: device {d}: {len(segments)} segments, {gib(held)} held, "
                     f"{gib(sum(in_use.values()))} in use, {len(trace)} events")
    return lines


def summary(path, top=8):
    snapshot = load(path)
    out = []
    for d in devices(snapshot):
        segments = [s for s in snapshot["segments"] if s["device"] == d]
        held = sum(s["total_size"] for s in segments)
        used = sum(s["allocated_size"] for s in segments)
        trace = snapshot["device_traces"][d] if d < len(snapshot["device_traces"]) else []
        out.append(f"{path}: device {d}: {gib(held)} held in {len(segments)} segments, {gib(used)} in use")
        if not trace:
            continue
        r = Replay(trace)
        sites = collections.Counter()
        for size, frames in r.at_peak.values():
            sites[where(frames)] += size
        out.append(f"  over its {len(trace)} events: {gib(r.peak_held)} held at most, {gib(r.peak)} in use at "
                   f"most; the largest sites live then:")
        for site, size in sites.most_common(top):
            out.append(f"  {gib(size):>12}  {site}")
    return out


def main(argv):
    if len(argv) < 3 or argv[1] not in ("summary", "check"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        for path in argv[2:]:
            print("\n".join(check(path) if argv[1] == "check" else summary(path)))
    except Bad as e:
        print(f"memory_snapshot.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
