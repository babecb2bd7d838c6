#!/usr/bin/env python3
"""Sets the ranks' flight records side by side (llama-train's comm.trace_buf_size: the
files <dump_folder>/comm_traces/rank<r>_trace.json a failed run leaves) and says where
the run went wrong.

    comm_trace.py FOLDER|FILE...    the report
    comm_trace.py --self-test       the report on made-up traces, checked

On each group (a mesh dimension's communicator: its name and its members' world ranks)
the collectives are numbered in the order every member must issue them. The report
names, per group:
  - the first number at which members issued different operations or sizes (the ranks
    called different collectives: the run would hang or garble data);
  - members behind the others: a rank whose last collective on the group is older than
    another member's, with the collective it did issue last and where (the layer, the
    pipeline action), and the ones the others wait for;
  - members that left no trace (a rank that failed before its first collective, or was
    killed before it could write).
Then each rank's first collective it issued and never saw complete, and each rank's
reason for failing.
"""
import collections
import glob
import json
import os
import sys


class Bad(Exception):
    pass


def load(paths):
    """{rank: trace} from files or folders of rank<r>_trace.json."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "rank*_trace.json")))
            if not found:
                raise Bad(f"{p}: no rank<r>_trace.json in this folder")
            files += found
        else:
            files.append(p)
    traces = {}
    for f in files:
        try:
            with open(f) as h:
                t = json.load(h)
        except (OSError, ValueError) as e:
            raise Bad(f"{f}: not a readable trace: {e}")
        for key in ("rank", "world_size", "collectives"):
            if key not in t:
                raise Bad(f"{f}: no '{key}': not a flight record of llama-train")
        if t["rank"] in traces:
            raise Bad(f"{f}: a second trace of rank {t['rank']}")
        traces[t["rank"]] = t
    return traces


def describe(c):
    where = " < ".join(reversed(c["where"])) if c["where"] else "outside any recorded span"
    return f"{c['op']} of {c['bytes']} bytes ({where})"


def report(traces):
    out = []
    world = max(t["world_size"] for t in traces.values())
    missing = [r for r in range(world) if r not in traces]
    out.append(f"{len(traces)} of {world} ranks left a trace" + (f"; none from rank {', '.join(map(str, missing))}"
                                                                  if missing else ""))
    # group key -> rank -> {seq: record}
    groups = collections.defaultdict(dict)
    for r, t in sorted(traces.items()):
        for c in t["collectives"]:
            key = (c["group"], tuple(c["ranks"]))
            groups[key].setdefault(r, {})[c["seq"]] = c
    findings = 0
    for (name, members), by_rank in sorted(groups.items()):
        label = f"{name} {list(members)}" if members else name
        # Disagreement: the first number two members issued differently.
        common = sorted(set.intersection(*(set(s) for s in by_rank.values()))) if len(by_rank) > 1 else []
        for seq in common:
            ops = {r: (by_rank[r][seq]["op"], by_rank[r][seq]["bytes"]) for r in by_rank}
            if len(set(ops.values())) > 1:
                findings += 1
                parts = "; ".join(f"rank {r}: {describe(by_rank[r][seq])}" for r in sorted(by_rank))
                out.append(f"{label}: collective #{seq} differs between ranks: {parts}")
                break
        # Members behind: their last number below the group's latest.
        last = {r: max(s) for r, s in by_rank.items()}
        latest = max(last.values())
        for r in sorted(last):
            if last[r] < latest:
                findings += 1
                ahead = [q for q in sorted(last) if last[q] > last[r]]
                c = by_rank[r][last[r]]
                nxt = by_rank[ahead[0]].get(last[r] + 1)
                out.append(f"{label}: rank {r} is behind: its last collective there is #{last[r]}, {describe(c)}; "
                           f"rank {', '.join(map(str, ahead))} went on to #{latest}"
                           + (f" (#{last[r] + 1}: {describe(nxt)})" if nxt else ""))
        for r in members:
            if r not in traces:
                findings += 1
                seqs = [(q, min(s)) for q, s in by_rank.items() if min(s) == 1]
                first = by_rank[seqs[0][0]][1] if seqs else None
                out.append(f"{label}: rank {r} left no trace" +
                           (f"; the others issued #1 there, {describe(first)}" if first else ""))
    for r, t in sorted(traces.items()):
        pending = [c for c in t["collectives"] if c["waited_us"] is None]
        if pending:
            c = pending[0]
            out.append(f"rank {r} waits for {c['group']} #{c['seq']}, {describe(c)}"
                       + (f" (and {len(pending) - 1} later)" if len(pending) > 1 else ""))
        if t.get("reason"):
            out.append(f"rank {r} failed: {t['reason']}")
    if not findings:
        out.append("every group's members issued the same collectives")
    return out


def self_test():
    def rec(group, ranks, seq, op, size, waited=True, where=()):
        return {"group": group, "ranks": ranks, "seq": seq, "op": op, "bytes": size,
                "waited_us": 1 if waited else None, "where": list(where)}

    def trace(rank, world, cs, reason=""):
        return {"rank": rank, "world_size": world, "reason": reason, "collectives": cs}

    ok = True

    def expect(name, traces, wanted):
        nonlocal ok
        text = "\n".join(report(traces))
        for w in wanted:
            if w not in text:
                print(f"FAIL: {name}: no '{w}' in:\n{text}")
                ok = False

    # Rank 0 failed before its first collective; rank 1 waits in it.
    expect("no trace", {1: trace(1, 2, [rec("dp", [0, 1], 1, "all_reduce", 8, False)], "abandoned")},
           ["1 of 2 ranks left a trace; none from rank 0", "dp [0, 1]: rank 0 left no trace",
            "rank 1 waits for dp #1, all_reduce of 8 bytes", "rank 1 failed: abandoned"])
    # The ranks called different collectives at #2.
    a = [rec("tp", [0, 1], 1, "all_gather", 64), rec("tp", [0, 1], 2, "all_reduce", 32, False, ["step 1", "layers.0 forward"])]
    b = [rec("tp", [0, 1], 1, "all_gather", 64), rec("tp", [0, 1], 2, "reduce_scatter", 32, False)]
    expect("mismatch", {0: trace(0, 2, a), 1: trace(1, 2, b)},
           ["tp [0, 1]: collective #2 differs between ranks: rank 0: all_reduce of 32 bytes (layers.0 forward < step 1); "
            "rank 1: reduce_scatter"])
    # Rank 2 stopped after #3 on dp_shard; the others issued #4 and wait.
    g = [0, 2]
    ahead = [rec("dp_shard", g, s, "all_gather", 128, s < 4, ["step 2", "layers.1 forward"]) for s in (1, 2, 3, 4)]
    behind = [rec("dp_shard", g, s, "all_gather", 128, True, ["step 2", "layers.0 forward"]) for s in (1, 2, 3)]
    behind.append(rec("pp", [2, 3], 7, "send_recv", 4096, False, ["step 2", "1F0"]))
    expect("behind", {0: trace(0, 4, ahead), 2: trace(2, 4, behind)},
           ["dp_shard [0, 2]: rank 2 is behind: its last collective there is #3", "rank 0 went on to #4",
            "rank 2 waits for pp #7, send_recv of 4096 bytes (1F0 < step 2)", "pp [2, 3]: rank 3 left no trace"])
    # All agree.
    same = [rec("world", [0, 1], 1, "all_reduce", 4)]
    expect("agree", {0: trace(0, 2, same), 1: trace(1, 2, same)}, ["every group's members issued the same"])
    print("comm_trace.py self-test: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) < 2 or argv[1].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        print("\n".join(report(load(argv[1:]))))
    except Bad as e:
        print(f"comm_trace.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
