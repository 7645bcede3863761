"""include_floors.py - no file of libstrata includes a floor above its own (docs/DESIGN.md,
Layers). The floors, from the ground up:

    0 core                      (and strata_types.h)
    1 io, meta, plan, comm      (and strata_comm.h)
    2 source
    3 engine                    (and strata.h)
    4 tools                     (export, copy, the disk measure: they use the engine, it
                                 never uses them)
    5 cli, mpi                  (and strata_mpi.h)

A file under src/X/ may include (#include "...") only headers of its own floor and those
below; the Python extension (python/strata/*.c) only the public headers and its own. Prints
each upward include and exits 1; 0 when there is none.
Usage: python3 tests/include_floors.py [ROOT]"""
import glob
import os
import re
import sys

FLOOR = {"core": 0, "io": 1, "meta": 1, "plan": 1, "comm": 1, "source": 2, "engine": 3,
         "tools": 4, "cli": 5, "mpi": 5}
PUBLIC = {"strata_types.h": 0, "strata_comm.h": 1, "strata.h": 3, "strata_mpi.h": 5}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), ".."))
src = os.path.join(root, "src")


def floor_of(header, here):
    """The floor of the header a file in directory `here` includes, or None (not ours)."""
    if header in PUBLIC:
        return PUBLIC[header]
    path = os.path.normpath(os.path.join(here, header))
    rel = os.path.relpath(path, src)
    part = rel.split(os.sep)[0]
    return FLOOR.get(part) if not rel.startswith("..") else None


bad = []
for f in sorted(glob.glob(os.path.join(src, "*", "*.[ch]"))):
    mine = FLOOR.get(os.path.basename(os.path.dirname(f)))
    if mine is None:
        continue
    for h in INCLUDE.findall(open(f, encoding="utf-8").read()):
        fl = floor_of(h, os.path.dirname(f))
        if fl is not None and fl > mine:
            bad.append("%s includes \"%s\" (floor %d above its own, %d)"
                       % (os.path.relpath(f, root), h, fl, mine))
for f in sorted(glob.glob(os.path.join(root, "python", "strata", "*.c"))):
    for h in INCLUDE.findall(open(f, encoding="utf-8").read()):
        if h not in PUBLIC and not os.path.exists(os.path.join(os.path.dirname(f), h)):
            bad.append("%s includes \"%s\": the extension uses the public headers only"
                       % (os.path.relpath(f, root), h))
for b in bad:
    print("upward include:", b)
sys.exit(1 if bad else 0)
