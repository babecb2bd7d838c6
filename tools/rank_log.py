#!/usr/bin/env python3
"""Sets the ranks' structured logs side by side (llama-train's
debug.enable_structured_logging: <dump_folder>/structured_logs/rank_<r>.jsonl) and says
which rank is slow at what, and where a rank stopped.

    rank_log.py FOLDER|FILE...    the report
    rank_log.py --self-test       the report on made-up logs, checked

The report:
  - the ranks that logged, and any missing below the highest;
  - per phase (step, fetching_batch, fwd_bwd, optim, eval, checkpoint_save,
    checkpoint_load): how many times it ran, the median of the ranks' median durations,
    their range, and the slowest rank with its median over the ranks' median;
  - each phase a rank left open (a _start with no _end: the rank was killed there, or
    hangs there), and each phase an error ended (the rank failed, or was aborted, in it).
A log a resumed run appended to is read per process (its pid): a phase an earlier process
left open is reported with that process.
"""
import collections
import glob
import json
import os
import statistics
import sys

PHASES = ("step", "fetching_batch", "fwd_bwd", "optim", "eval", "checkpoint_save", "checkpoint_load")
INSTANTS = ("structured_logger_started", "training_start", "training_end")


class Bad(Exception):
    pass


def read_logs(paths):
    """Every record of the files (or the rank_*.jsonl in folders), by rank."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "rank_*.jsonl")))
            if not found:
                raise Bad(f"{p}: no rank_*.jsonl files (llama-train writes them with "
                          "debug.enable_structured_logging = true)")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise Bad(f"{p}: no such file or folder")
    by_rank = collections.defaultdict(list)
    for f in files:
        with open(f) as fh:
            lines = fh.readlines()
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rank, name = int(r["rank"]), str(r["log_type_name"])
            except (ValueError, KeyError, TypeError) as e:
                # The last line of a killed rank may be cut short; any other is damage.
                if n == len(lines):
                    continue
                raise Bad(f"{f}:{n}: not a structured log line ({e})")
            r["rank"], r["log_type_name"] = rank, name
            by_rank[rank].append(r)
    return by_rank


def analyse(by_rank):
    """(durations[phase][rank] -> [ms], open spans, failed spans)."""
    durations = collections.defaultdict(lambda: collections.defaultdict(list))
    left_open, failed = [], []
    for rank, records in sorted(by_rank.items()):
        stacks = collections.defaultdict(list)  # pid -> open phases, innermost last
        for r in records:
            name, pid = r["log_type_name"], r.get("pid")
            if name in INSTANTS:
                continue
            for suffix in ("_start", "_end", "_error"):
                if name.endswith(suffix):
                    phase = name[: -len(suffix)]
                    break
            else:
                continue  # an instant
            stack = stacks[pid]
            if suffix == "_start":
                stack.append(r)
                continue
            # Close the innermost open span of this phase (and anything opened inside it).
            for i in range(len(stack) - 1, -1, -1):
                if stack[i]["log_type_name"] == phase + "_start":
                    del stack[i:]
                    break
            if suffix == "_end":
                durations[phase][rank].append(float(r.get("value", 0.0)))
            else:
                failed.append((rank, r.get("step"), phase, float(r.get("value", 0.0))))
        for pid, stack in stacks.items():
            for r in stack:
                left_open.append((rank, pid, r.get("step"), r["log_type_name"][: -len("_start")], r.get("time_us")))
    return durations, left_open, failed


def report(by_rank):
    lines = []
    ranks = sorted(by_rank)
    missing = [r for r in range(ranks[-1] + 1) if r not in by_rank] if ranks else []
    lines.append(f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''} logged"
                 + (f"; none from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing else ""))
    durations, left_open, failed = analyse(by_rank)
    for phase in PHASES + tuple(sorted(set(durations) - set(PHASES))):
        per_rank = {r: statistics.median(v) for r, v in durations.get(phase, {}).items() if v}
        if not per_rank:
            continue
        runs = sum(len(v) for v in durations[phase].values())
        middle = statistics.median(per_rank.values())
        slow = max(per_rank, key=lambda r: (per_rank[r], -r))
        line = (f"{phase}: {runs} ended, median {middle:.2f} ms over {len(per_rank)} rank"
                f"{'s' if len(per_rank) != 1 else ''} ({min(per_rank.values()):.2f} to {max(per_rank.values()):.2f})")
        if len(per_rank) > 1:
            ratio = per_rank[slow] / middle if middle > 0 else float("inf")
            line += f"; slowest rank {slow}, {per_rank[slow]:.2f} ms, {ratio:.2f}x the median"
        lines.append(line)
    for rank, step, phase, ms in failed:
        lines.append(f"rank {rank} failed in {phase} at step {step}, after {ms:.2f} ms")
    for rank, pid, step, phase, _ in left_open:
        lines.append(f"rank {rank} (pid {pid}) left {phase} open at step {step}: killed or hung there")
    if not failed and not left_open:
        lines.append("every phase that started ended")
    return "\n".join(lines)


def self_test():
    def rec(rank, step, name, value=None, pid=100):
        r = {"rank": rank, "pid": pid, "step": step, "log_type_name": name, "time_us": 0}
        if value is not None:
            r["value"] = value
        return r
    logs = collections.defaultdict(list)
    for rank in (0, 1, 3):
        logs[rank].append(rec(rank, 0, "training_start"))
        for step in (1, 2, 3):
            slow = 3.0 if rank == 3 else 1.0
            logs[rank] += [rec(rank, step, "step_start"), rec(rank, step, "fetching_batch_start"),
                           rec(rank, step, "fetching_batch_end", 0.5 * slow), rec(rank, step, "fwd_bwd_start")]
            if rank == 1 and step == 3:
                logs[rank].append(rec(rank, step, "fwd_bwd_error", 7.0))
                logs[rank].append(rec(rank, step, "step_error", 8.0))
                break
            if rank == 3 and step == 3:
                break  # killed inside fwd_bwd
            logs[rank] += [rec(rank, step, "fwd_bwd_end", 10.0), rec(rank, step, "step_end", 12.0)]
    out = report(logs)
    expected = [
        "3 ranks logged; none from rank 2",
        "step: 7 ended, median 12.00 ms over 3 ranks (12.00 to 12.00); slowest rank 0, 12.00 ms, 1.00x the median",
        "fetching_batch: 9 ended, median 0.50 ms over 3 ranks (0.50 to 1.50); slowest rank 3, 1.50 ms, 3.00x the median",
        "rank 1 failed in fwd_bwd at step 3, after 7.00 ms",
        "rank 1 failed in step at step 3, after 8.00 ms",
        "rank 3 (pid 100) left step open at step 3: killed or hung there",
        "rank 3 (pid 100) left fwd_bwd open at step 3: killed or hung there",
    ]
    for e in expected:
        if e not in out.splitlines():
            print(f"self-test FAILED: missing line: {e}\n--- report ---\n{out}")
            return 1
    if "every phase that started ended" in out:
        print("self-test FAILED: says every phase ended")
        return 1
    print("rank_log.py self-test: ok")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    try:
        by_rank = read_logs(argv[1:])
        if not by_rank:
            raise Bad("no records in " + ", ".join(argv[1:]))
        print(report(by_rank))
    except Bad as e:
        print(f"rank_log.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
