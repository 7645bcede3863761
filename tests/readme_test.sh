#!/usr/bin/env bash
# readme_test.sh - runs the README's examples as a user would: every fenced block marked
# with an HTML comment on the line before it, in order, twice, from a scratch directory
# that stands for the repository root (build/, include/, examples/ are links to this
# tree's), with $STRATA_MEM_ROOT (where mem:// lives) inside it.
#
#   <!-- run: sh -->          bash -e -o pipefail (MPI examples run mpiexec.mpich themselves)
#   <!-- run: sh torch -->    the same, with the project venv's bin/ first on PATH
#   <!-- run: python -->      the venv's python
#   <!-- run: c -->           the body of main(), built as the README says (build tree)
#   <!-- run: file NAME -->   written to NAME, for the blocks after it
#
# Blocks that need the venv (sh torch, python) print a SKIP line and are not run where
# $VENV/bin/python is missing, unless STRATA_README_NEED_VENV=1 (tests/run.sh, under
# `make test`, which makes the venv): then that is a failure.
# Usage: bash tests/readme_test.sh [README]
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
readme=${1:-$root/README.md}
venv=${VENV:-.venv}
case $venv in /*) ;; *) venv=$root/$venv ;; esac
build=${BUILD:-build}
case $build in /*) ;; *) build=$root/$build ;; esac
scratch=$(mktemp -d "${TMPDIR:-/tmp}/strata-readme-XXXXXX") || exit 1
trap 'rm -rf "$scratch"' EXIT
export STRATA_MEM_ROOT=$scratch/shm

# 1. the marked blocks, in order: $scratch/blocks/NNN (contents) and NNN.kind ("sh torch")
mkdir -p "$scratch/blocks"
awk -v out="$scratch/blocks" '
    /^<!-- run: .* -->$/ { kind = $0; sub(/^<!-- run: /, "", kind); sub(/ -->$/, "", kind); next }
    /^```/ {
        if (inside) { inside = 0; close(f); next }
        if (other) { other = 0; next }   # the end of an unmarked block
        if (kind == "") { other = 1; next }
        n++; f = sprintf("%s/%03d", out, n); inside = 1
        printf "" > f; print kind > (f ".kind"); close(f ".kind"); kind = ""; next
    }
    inside { print > f; next }
    other { next }
    { if ($0 != "") kind = "" }   # a marker belongs to the fence right after it
' "$readme"
blocks=$(cd "$scratch/blocks" && ls | grep -v '\.kind$')
[ -n "$blocks" ] || { echo "FAIL: no marked examples in $readme"; exit 1; }

fail=0
skip_venv() { # block, kind: 0 if it must be skipped (SKIP printed), 1 to run it
    [ -x "$venv/bin/python" ] && return 1
    if [ "${STRATA_README_NEED_VENV:-}" = 1 ]; then
        echo "FAIL: README block $1 ($2) needs the venv, and $venv/bin/python is missing"
        fail=1
    else
        echo "SKIP: README block $1 ($2): no venv at $venv (make venv)"
    fi
    return 0
}

run_block() { # pass, block number
    local pass=$1 b=$2 kind log rc=0
    kind=$(cat "$scratch/blocks/$b.kind")
    log=$scratch/log
    case $kind in
    "sh")
        (cd "$scratch/root" && bash -e -o pipefail "$scratch/blocks/$b") >"$log" 2>&1 || rc=$? ;;
    "sh torch")
        skip_venv "$b" "$kind" && return 0
        (cd "$scratch/root" && PATH="$venv/bin:$PATH" bash -e -o pipefail "$scratch/blocks/$b") \
            >"$log" 2>&1 || rc=$? ;;
    "python")
        skip_venv "$b" "$kind" && return 0
        (cd "$scratch/root" && "$venv/bin/python" "$scratch/blocks/$b") >"$log" 2>&1 || rc=$? ;;
    "c")
        { printf '#include <stdio.h>\n#include <stdlib.h>\n#include <sys/stat.h>\n#include "strata.h"\n\n'
          printf 'int main(void)\n{\n'; cat "$scratch/blocks/$b"; printf '}\n'; } >"$scratch/ex.c"
        (cd "$scratch/root" && cc -Wall -Wextra -Werror -Iinclude -o "$scratch/ex" \
            "$scratch/ex.c" build/libstrata.a -lxxhash -lz -lpthread -ldl -lm \
            $(nm build/libstrata.a 2>/dev/null | grep -q ' U curl_easy_init' && echo -lcurl) \
            $(nm build/libstrata.a 2>/dev/null | grep -q ' U crc32_gzip_refl' && echo -lisal) &&
            "$scratch/ex") >"$log" 2>&1 || rc=$? ;;
    file\ *)
        cp "$scratch/blocks/$b" "$scratch/root/${kind#file }"
        return 0 ;;
    *)
        echo "FAIL: README block $b: unknown marker 'run: $kind'"
        fail=1
        return 0 ;;
    esac
    if [ "$rc" = 0 ]; then
        echo "ok: pass $pass, README block $b ($kind)"
    else
        echo "FAIL: pass $pass, README block $b ($kind) exited $rc; the block:"
        sed 's/^/    | /' "$scratch/blocks/$b"
        echo "  its output (last 40 lines):"
        tail -n 40 "$log" | sed 's/^/    > /'
        fail=1
    fi
}

# 2. run them all, in order, twice: what one run leaves must not break the next
mkdir -p "$scratch/root"
ln -s "$build" "$scratch/root/build"
ln -s "$root/include" "$scratch/root/include"
ln -s "$root/examples" "$scratch/root/examples"
for pass in 1 2; do
    for b in $blocks; do
        run_block "$pass" "$b"
    done
done
[ "$fail" = 0 ] && echo "readme_test: $(echo $blocks | wc -w) marked examples ran twice"
exit "$fail"
