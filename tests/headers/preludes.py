#!/usr/bin/env python3
"""Which precompiled prelude each header's self-containment check may load.

    preludes.py INCLUDE_DIR HUB=COST... < HEADERS

For each header read from stdin (a path under INCLUDE_DIR, one per line), prints the
header, a tab, and the hub to preload for it, or "-" for none. A hub is another public
header whose parse is shared by many (check_headers.sh names them and precompiles each
once). A header may preload a hub only if the hub is in the header's own include
closure, unconditionally: the hub's includes and declarations are then ones the header
would have seen anyway, so the compile checks what it checked without the prelude (the
header still has to include what it uses; only the order in which the included files
are read changes). Of the hubs in its closure it gets the costliest (COST: any measure
of a hub's parse; check_headers.sh gives the size of its precompiled header).

Includes inside #if/#ifdef blocks are not followed: they may be off in this build, and a
hub reached only through one is never chosen.
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
IF = re.compile(r'^\s*#\s*if')
ENDIF = re.compile(r'^\s*#\s*endif')


def direct_includes(root, header, cache):
    if header not in cache:
        found = []
        depth = 0
        try:
            with open(os.path.join(root, header), encoding="utf-8") as f:
                for line in f:
                    if IF.match(line):
                        depth += 1
                    elif ENDIF.match(line):
                        depth -= 1
                    elif depth == 0:
                        m = INCLUDE.match(line)
                        if m and os.path.isfile(os.path.join(root, m.group(1))):
                            found.append(m.group(1))
        except OSError:
            pass
        cache[header] = found
    return cache[header]


def closure(root, header, cache, memo):
    if header not in memo:
        memo[header] = set()  # no cycles among the headers; this only stops a runaway
        seen = set()
        for i in direct_includes(root, header, cache):
            seen.add(i)
            seen |= closure(root, i, cache, memo)
        memo[header] = seen
    return memo[header]


def main():
    root = sys.argv[1]
    cost = {}
    for arg in sys.argv[2:]:
        hub, _, c = arg.rpartition("=")
        if os.path.isfile(os.path.join(root, hub)):
            cost[hub] = float(c)
    hubs = list(cost)
    cache, memo = {}, {}
    for line in sys.stdin:
        header = line.strip()
        if not header:
            continue
        mine = closure(root, header, cache, memo)
        usable = [h for h in hubs if h in mine]
        best = max(usable, key=lambda h: cost[h]) if usable else "-"
        print(f"{header}\t{best}")


if __name__ == "__main__":
    main()
