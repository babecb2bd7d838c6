#!/usr/bin/env python3
"""gpu_clocks: the GPU's clocks and power through each step of a run, from nvidia-smi's log.

On an H100 (2026-11-27, bench/RESULTS.md) PyTorch's GEMMs ran at 800 to 830 TFLOP/s inside
torchtitan's eager step, where bench-kernels timed GEMMs of the same shapes back to back
at 660 to 745. One explanation the GEMM timings alone cannot rule out: GEMMs back to back
hold the GPU at its power limit, which lowers the SM clock, while GEMMs between
memory-bound kernels run at a higher one. `tools/gpu_bundle.sh`'s `run.sh all` logs
nvidia-smi through the whole run and marks where each step (and each part of the gemms
step) begins; this script gives each marked window its SM clock, memory clock, power and
temperature, so the rates measured in a window can be read beside the clock they ran at.

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \\
        --format=csv,noheader,nounits -lms 250 > clocks.csv &
    echo "$(date '+%Y/%m/%d %H:%M:%S.%N') gemms: tessera" >> marks.txt
    ...
    python3 bench/gpu_clocks.py --csv clocks.csv --marks marks.txt [--json out.json]
    python3 bench/gpu_clocks.py --self-test

A window runs from its mark to the next (the last to the log's end). Each line of the
log is one sample; a field nvidia-smi cannot read ("[N/A]", "[Not Supported]") is left
out of that field's figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

PROG = "gpu_clocks"
FIELDS = ("sm_mhz", "mem_mhz", "power_w", "temp_c", "util_pct")


class ClocksError(Exception):
    pass


def parse_time(text: str, where: str) -> datetime.datetime:
    """nvidia-smi's timestamp and `date '+%Y/%m/%d %H:%M:%S.%N'`: local time, to the
    microsecond (nanoseconds cut)."""
    t = text.strip()
    if "." in t:
        head, frac = t.split(".", 1)
        t = head + "." + frac[:6]
    for fmt in ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S"):
        try:
            return datetime.datetime.strptime(t, fmt)
        except ValueError:
            pass
    raise ClocksError(f"{where}: '{text.strip()}' is not a time of the form 2026/11/28 01:02:03.456")


def read_lines(path: str, flag: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError as e:
        raise ClocksError(f"{flag} {path}: {e.strerror}") from None


def read_samples(path: str) -> list[tuple[datetime.datetime, dict]]:
    lines = read_lines(path, "--csv")
    samples = []
    for i, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("timestamp"):
            continue
        cols = [c.strip() for c in line.split(",")]
        where = f"--csv {path}:{i}"
        if len(cols) != 1 + len(FIELDS):
            raise ClocksError(f"{where}: {len(cols)} fields, expected {1 + len(FIELDS)} (timestamp, "
                              f"{', '.join(FIELDS)}: the query in this script's help)")
        values = {}
        for name, text in zip(FIELDS, cols[1:]):
            try:
                values[name] = float(text)
            except ValueError:
                if not text.startswith("["):  # nvidia-smi's [N/A], [Not Supported]
                    raise ClocksError(f"{where}: {name} '{text}' is not a number") from None
        samples.append((parse_time(cols[0], where), values))
    if not samples:
        raise ClocksError(f"--csv {path}: no samples")
    return samples


def read_marks(path: str) -> list[tuple[datetime.datetime, str]]:
    lines = read_lines(path, "--marks")
    marks = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split(" ", 2)
        if len(parts) < 3:
            raise ClocksError(f"--marks {path}:{i}: expected 'YYYY/MM/DD HH:MM:SS.fff NAME', got '{line}'")
        marks.append((parse_time(parts[0] + " " + parts[1], f"--marks {path}:{i}"), parts[2].strip()))
    if not marks:
        raise ClocksError(f"--marks {path}: no marks")
    marks.sort(key=lambda m: m[0])
    return marks


def windows(samples, marks) -> list[dict]:
    """Each mark's window, from it to the next mark (the last to the last sample)."""
    out = []
    for j, (begin, name) in enumerate(marks):
        end = marks[j + 1][0] if j + 1 < len(marks) else samples[-1][0]
        inside = [v for t, v in samples if begin <= t < end or (j + 1 == len(marks) and t == end)]
        w = {"name": name, "seconds": (end - begin).total_seconds(), "samples": len(inside)}
        for field in FIELDS:
            xs = [v[field] for v in inside if field in v]
            if xs:
                w[field] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        out.append(w)
    return out


def table(ws: list[dict]) -> str:
    def fig(w, field, key="median", fmt="%.0f"):
        return fmt % w[field][key] if field in w else "-"
    lines = ["%-36s %8s %7s %16s %8s %16s %7s %6s" % ("window", "seconds", "samples", "SM MHz (min)", "mem MHz",
                                                     "power W (max)", "temp C", "util%")]
    for w in ws:
        sm = "%s (%s)" % (fig(w, "sm_mhz"), fig(w, "sm_mhz", "min"))
        power = "%s (%s)" % (fig(w, "power_w"), fig(w, "power_w", "max"))
        lines.append("%-36s %8.1f %7d %16s %8s %16s %7s %6s" % (w["name"][:36], w["seconds"], w["samples"], sm,
                                                               fig(w, "mem_mhz"), power, fig(w, "temp_c", "max"),
                                                               fig(w, "util_pct")))
    return "\n".join(lines)


def self_test() -> int:
    with tempfile.TemporaryDirectory() as d:
        csv, marks = os.path.join(d, "clocks.csv"), os.path.join(d, "marks.txt")
        with open(csv, "w") as f:
            # Ten samples a second for 4 s: 1980 MHz and 400 W, then 1755 MHz and 700 W from 2 s.
            for i in range(40):
                t = datetime.datetime(2026, 11, 28, 1, 2, 3) + datetime.timedelta(milliseconds=100 * i)
                sm, power = (1980, 400.5) if i < 20 else (1755, 699.0)
                util = "[N/A]" if i == 5 else "100"
                f.write("%s, %d, 2619, %.1f, 55, %s\n" % (t.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3], sm, power, util))
        with open(marks, "w") as f:
            f.write("2026/11/28 01:02:05.000000000 gemms: back to back\n")
            f.write("2026/11/28 01:02:03.000000000 eager\n")  # out of order: sorted
        ws = windows(read_samples(csv), read_marks(marks))
        if [w["name"] for w in ws] != ["eager", "gemms: back to back"] or [w["samples"] for w in ws] != [20, 20]:
            raise ClocksError(f"self-test failed: windows {[(w['name'], w['samples']) for w in ws]}")
        if ws[0]["sm_mhz"]["median"] != 1980 or ws[1]["sm_mhz"]["median"] != 1755 or ws[1]["power_w"]["max"] != 699.0:
            raise ClocksError(f"self-test failed: {ws}")
        if ws[0]["util_pct"]["median"] != 100 or abs(ws[1]["seconds"] - 1.9) > 1e-9:
            raise ClocksError(f"self-test failed: {ws}")
        with open(csv, "a") as f:
            f.write("2026/11/28 01:02:08.000, 1755, 2619, lots, 55, 100\n")
        try:
            read_samples(csv)
        except ClocksError as e:
            if "power_w 'lots' is not a number" not in str(e) or ":41:" not in str(e):
                raise ClocksError(f"self-test failed: the bad line's error was: {e}") from None
        else:
            raise ClocksError("self-test failed: a bad power reading was accepted")
    print(f"{PROG}: self-test passed")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", help="nvidia-smi's log (the query in this script's help)")
    p.add_argument("--marks", help="lines 'YYYY/MM/DD HH:MM:SS.fff NAME', each the start of a window")
    p.add_argument("--json", help="write the windows here too")
    p.add_argument("--self-test", action="store_true", help="check this script and exit")
    ns = p.parse_args(argv)
    try:
        if ns.self_test:
            return self_test()
        if not ns.csv or not ns.marks:
            raise ClocksError("give --csv and --marks (or --self-test)")
        ws = windows(read_samples(ns.csv), read_marks(ns.marks))
        print(table(ws))
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"windows": ws}, f, indent=1)
        return 0
    except ClocksError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
