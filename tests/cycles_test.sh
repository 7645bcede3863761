#!/bin/bash
# cycles_test.sh - libstrata's files reference one another (calls and data) without a cycle
# (tests/call_cycles.py over the library's objects in $BUILD/obj; the command's files in
# src/cli are not the library and are left out), and no file includes a floor above its
# own (tests/include_floors.py over the sources), and no function is over 120 lines
# (tests/long_functions.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
obj=${BUILD:-build}/obj/src
shopt -s nullglob
objs=()
for o in "$obj"/{core,io,meta,plan,comm,source,engine,tools}/*.o; do
    # only the objects of sources there now (a file moved or removed leaves its old object)
    src=${o#"$obj"/}
    [ -f "$here/../src/${src%.o}.c" ] && objs+=("$o")
done
if [ ${#objs[@]} -eq 0 ]; then
    echo "cycles_test: no objects under $obj (run make first)" >&2
    exit 1
fi
python3 "$here/call_cycles.py" "${objs[@]}"
python3 "$here/include_floors.py" "$here/.."
python3 "$here/long_functions.py" 120 "$here/.."
echo "cycles_test: ${#objs[@]} objects, no call cycle (functions and data); no upward include;" \
    "no function over 120 lines"
