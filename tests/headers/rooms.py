#!/usr/bin/env python3
"""The library's rooms: the folder graph of include/tessera, and no loop in it.

Each folder under include/tessera/ is a room (a sub-folder belongs to its room:
backend/cuda/ is backend; a header directly in include/tessera/ is the room "tessera").
A header's `#include "tessera/..."` lines make an edge from its room to each room it
includes. A room may include only rooms below it, so the graph has no loop; when it has
one, this script names the loop and, for each of its edges, the include lines that make
it, and exits 1. Otherwise it prints the rooms from the bottom up, each with the rooms it
includes, and exits 0.

    rooms.py INCLUDE_DIR     check include/tessera (INCLUDE_DIR/tessera)
    rooms.py --self-test     show the check failing on a loop, and passing without one
"""
import os
import re
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]tessera/([^">]+)[">]', re.M)
TOP = "tessera"


def room_of(path):
    """The room of a path under include/tessera/ ('nn/layer.hpp' -> 'nn')."""
    return path.split("/", 1)[0] if "/" in path else TOP


def read_graph(root):
    """{room: {included room: [(header, line, included header), ...]}} and the rooms."""
    edges, rooms = {}, set()
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith((".hpp", ".cuh", ".h")):
                continue
            path = os.path.join(folder, name)
            header = os.path.relpath(path, root).replace(os.sep, "/")
            src = room_of(header)
            rooms.add(src)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for m in INCLUDE.finditer(text):
                dst = room_of(m.group(1))
                if dst == src:
                    continue
                line = text.count("\n", 0, m.start()) + 1
                edges.setdefault(src, {}).setdefault(dst, []).append((header, line, m.group(1)))
                rooms.add(dst)
    return edges, rooms


def shortest_loop(edges, start):
    """The shortest path from `start` back to itself, as a list of rooms, or None."""
    frontier, parent = [start], {}
    while frontier:
        nxt = []
        for a in frontier:
            for b in sorted(edges.get(a, {})):
                if b == start:
                    path = [start]
                    while a != start:
                        path.insert(1, a)
                        a = parent[a]
                    return path + [start]
                if b not in parent and b != start:
                    parent[b] = a
                    nxt.append(b)
        frontier = nxt
    return None


def order(edges, rooms):
    """The rooms bottom-up (each after every room it includes), or None with a loop."""
    placed, out = set(), []
    while len(out) < len(rooms):
        ready = sorted(r for r in rooms if r not in placed and all(d in placed for d in edges.get(r, {})))
        if not ready:
            return None
        out += ready
        placed.update(ready)
    return out


def check(root, out=sys.stdout):
    edges, rooms = read_graph(root)
    loops, seen = [], set()
    for r in sorted(rooms):
        loop = shortest_loop(edges, r)
        if loop and frozenset(loop) not in seen:
            seen.add(frozenset(loop))
            loops.append(loop)
    if loops:
        for loop in loops:
            print("rooms: folders include each other round a loop: " + " -> ".join(loop), file=out)
            for a, b in zip(loop, loop[1:]):
                lines = edges[a][b]
                for header, line, included in lines[:3]:
                    print(f"  {a} -> {b}: include/tessera/{header}:{line} includes tessera/{included}", file=out)
                if len(lines) > 3:
                    print(f"  {a} -> {b}: and {len(lines) - 3} more include lines", file=out)
        print(f"rooms: {len(loops)} loop(s); a room may include only rooms below it (docs/architecture.md)", file=out)
        return 1
    for r in order(edges, rooms):
        below = ", ".join(sorted(edges.get(r, {}))) or "-"
        print(f"{r:10s} includes {below}", file=out)
    print(f"rooms: {len(rooms)} rooms, no loop", file=out)
    return 0


def self_test():
    """A tree with a loop fails naming it and its include line; without it, passes."""
    import io

    with tempfile.TemporaryDirectory() as tmp:
        def write(path, text):
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w", encoding="utf-8") as f:
                f.write(text)

        write("core/a.hpp", "#pragma once\n")
        write("ops/b.hpp", '#pragma once\n#include "tessera/core/a.hpp"\n')
        write("nn/c.hpp", '#pragma once\n#include "tessera/ops/b.hpp"\n')
        write("ops/d.hpp", '#pragma once\n\n#include <vector>\n#include "tessera/nn/c.hpp"\n')
        got = io.StringIO()
        status = check(tmp, got)
        text = got.getvalue()
        if status != 1 or "nn -> ops -> nn" not in text or "include/tessera/ops/d.hpp:4 includes tessera/nn/c.hpp" not in text:
            print("rooms --self-test: a loop nn -> ops -> nn was not reported as expected:\n" + text, file=sys.stderr)
            return 1
        os.remove(os.path.join(tmp, "ops/d.hpp"))
        got = io.StringIO()
        if check(tmp, got) != 0 or "rooms: 3 rooms, no loop" not in got.getvalue():
            print("rooms --self-test: a tree without a loop did not pass:\n" + got.getvalue(), file=sys.stderr)
            return 1
    print("rooms --self-test: a loop is named with its include line; a tree without one passes")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.join(argv[0], "tessera")
    if not os.path.isdir(root):
        print(f"rooms: {root}: no such folder", file=sys.stderr)
        return 2
    return check(root)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
