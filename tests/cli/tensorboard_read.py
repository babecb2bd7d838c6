#!/usr/bin/env python3
"""Prints the scalars of a TensorBoard events directory as TensorBoard itself reads them.

Usage: tensorboard_read.py EVENTS_DIR

EVENTS_DIR is the directory holding one run's events.out.tfevents.* files (the files
of subdirectories are not read). One line per scalar, "step tag value", sorted by step
and then tag; the value is printed with nine significant digits, enough to tell any two
float32 values apart. This is TensorBoard's own reader (EventAccumulator) over every
events file in the directory, so what it prints is what TensorBoard shows: files merged
in name order, and the events that a resumed run's SessionLog START makes orphans
(steps from its START step on, in files before its own) already dropped. It checks
tessera's hand-written events files against the reader they are for.

Exits 77 (meson's code for a skipped test) when the tensorboard package is missing.
"""
import os
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: tensorboard_read.py EVENTS_DIR", file=sys.stderr)
        return 2
    directory = sys.argv[1]
    try:
        import tensorboard  # noqa: F401
        from tensorboard.backend.event_processing.event_accumulator import (
            SCALARS,
            EventAccumulator,
        )
    except ImportError as e:
        print(f"skipped: the tensorboard Python package is not installed ({e})", file=sys.stderr)
        return 77
    if not os.path.isdir(directory):
        print(f"{directory}: not a directory", file=sys.stderr)
        return 2

    # Size guidance 0 keeps every scalar; the default samples down to 10,000 per tag.
    acc = EventAccumulator(directory, size_guidance={SCALARS: 0})
    acc.Reload()
    rows = []
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            rows.append((event.step, tag, event.value))
    rows.sort(key=lambda r: (r[0], r[1]))
    for step, tag, value in rows:
        print(f"{step} {tag} {value:.9g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
