"""call_cycles.py - no two files of libstrata call each other in a cycle (docs/DESIGN.md,
Layers): from the objects' symbol tables (nm: symbols defined - functions, T, and data,
D/B/R: a table of sources names its readers through their data symbols; symbols used, U),
the graph of file -> file references, and its strongly connected components (Tarjan).
Prints each cycle with the references that make it and exits 1; 0 when there is none.
Usage: python3 tests/call_cycles.py OBJ..."""
import os
import subprocess
import sys
objs = sys.argv[1:]
defs, uses = {}, {}
for o in objs:
    out = subprocess.run(["nm", o], capture_output=True, text=True).stdout.split("\n")
    name = os.path.basename(o)[:-2]
    for l in out:
        p = l.split()
        if len(p) == 3 and p[1] in ("T", "D", "B", "R"):  # functions and data
            defs[p[2]] = name
        elif len(p) == 2 and p[0] == "U":
            uses.setdefault(name, set()).add(p[1])
edges = {}
for f, us in uses.items():
    for u in us:
        g = defs.get(u)
        if g and g != f:
            edges.setdefault(f, {}).setdefault(g, []).append(u)
# strongly connected components (Tarjan)
idx, low, st, on, out, n = {}, {}, [], set(), [], [0]
def sc(v):
    idx[v] = low[v] = n[0]; n[0] += 1; st.append(v); on.add(v)
    for w in edges.get(v, {}):
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(comp)
sys.setrecursionlimit(10000)
for v in list(edges):
    if v not in idx: sc(v)
for c in out:
    print("cycle:", " ".join(sorted(c)))
    for a in sorted(c):
        for b, syms in edges.get(a, {}).items():
            if b in c: print("  %s -> %s: %s" % (a, b, " ".join(sorted(syms)[:4])))
sys.exit(1 if out else 0)
