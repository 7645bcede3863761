"""long_functions.py - no C function of src/ is over LIMIT lines (docs/DESIGN.md, Layers: a
longer one is a sign to cut it by step). A function is counted from the line holding only
its opening "{" (column 0, as the code's style writes every function) to its closing "}".
Prints each one over the limit (lines, file, name) and exits 1; 0 when there is none.
Usage: python3 tests/long_functions.py [LIMIT] [ROOT]"""
import glob
import os
import re
import sys

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 120
root = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else
                       os.path.join(os.path.dirname(__file__), ".."))
NAME = re.compile(r"(\w+)\s*\(")
over = []
for path in sorted(glob.glob(os.path.join(root, "src", "**", "*.c"), recursive=True)):
    lines = open(path, encoding="utf-8", errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("{") and i > 0:
            j = i - 1
            while j > 0 and "(" not in lines[j]:
                j -= 1
            m = NAME.search(lines[j])
            k = i + 1
            while k < len(lines) and not lines[k].startswith("}"):
                k += 1
            if k - i + 1 > limit:
                over.append((k - i + 1, os.path.relpath(path, root), m.group(1) if m else "?"))
            i = k
        i += 1
for n, path, name in sorted(over, reverse=True):
    print("long function: %s %s: %d lines (limit %d)" % (path, name, n, limit))
sys.exit(1 if over else 0)
