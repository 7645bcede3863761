#!/usr/bin/env bash
# kill_export_test.sh - an export is all or nothing under SIGKILL. Exports two different
# checkpoints (A and B, several files each) in turn into one OUT and SIGKILLs each export at
# a random instant (0 to 1.5 times an uninterrupted export). After every kill:
#   - OUT holds exactly the files of the set it held before (A or B) or of the new one, byte
#     for byte those of an uninterrupted export (so no file of one set beside the other's,
#     no .partial, nothing truncated);
#   - strata's reader of the index reads it (`strata verify OUT`), and, where the project
#     venv has the `safetensors` package, safetensors loads every file to the same tensors
#     (every 6th trial and at the end);
#   - nothing but OUT and staging directories (OUT.strata-export-*) is beside it.
# A staging directory left by a kill is removed by the next export to OUT: at the end a clean
# export leaves none. Prints "export kill trials: N, old set kept: O, new set in place: W,
# same set: S (A over A or B over B), staging left by kills: K, losses: L" and exits 1 on
# any loss.
#
# Environment: STRATA_KILL_EXPORT_TRIALS (default 24), STRATA_KILL_SEED (seeds $RANDOM),
# STRATA_KILL_VERBOSE=1 (a line per trial).
set -u
cd "$(dirname "$0")/.."
S=${STRATA:-${BUILD:-build}/strata}
TRIALS=${STRATA_KILL_EXPORT_TRIALS:-24}
SEED=${STRATA_KILL_SEED:-$$}
RANDOM=$SEED
PY=${VENV:-.venv}/bin/python
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-killx-XXXXXX")
trap 'rm -rf "$T"' EXIT
FILES="--max-file-gb 0.004" # several files per set
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }

"$S" demo --size-mb 24 --dir "$T/ckA" >/dev/null 2>&1 || { echo "demo A failed"; exit 1; }
"$S" demo --size-mb 16 --step 5 --dir "$T/ckB" >/dev/null 2>&1 || { echo "demo B failed"; exit 1; }
t0=$(now_ms)
"$S" export "$T/ckA" "$T/refA" $FILES --quiet || exit 1
t1=$(now_ms)
"$S" export "$T/ckB" "$T/refB" $FILES --quiet || exit 1
window=$(((t1 - t0) * 3 / 2))
[ "$window" -lt 40 ] && window=40
echo "kill_export_test: seed $SEED, kills within ${window} ms ($(ls "$T/refA" | wc -l) and $(ls "$T/refB" | wc -l) files per set)"

have_st=0
if [ -x "$PY" ] && "$PY" -c 'import safetensors.torch' 2>/dev/null; then have_st=1; fi
cat >"$T/st_load.py" <<'PY'
import os, sys
import torch
from safetensors.torch import load_file
def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith('.safetensors'):
            out.update(load_file(os.path.join(d, f)))
    return out
def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a and a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert raw(a[k]) == raw(b[k]), k
PY

mkdir "$T/run"
OUT=$T/run/out
"$S" export "$T/ckA" "$OUT" $FILES --quiet || exit 1
held=A
losses=0 old=0 new=0 same=0 left=0
loss() { losses=$((losses + 1)); echo "LOSS (trial $1): $2"; }
same_set() { # DIR REF: the same names, the same bytes
    [ "$(ls -A "$1")" = "$(ls -A "$2")" ] || return 1
    for f in "$2"/*; do cmp -s "$f" "$1/$(basename "$f")" || return 1; done
}
for i in $(seq "$TRIALS"); do
    if [ $((RANDOM % 2)) = 0 ]; then src=A; else src=B; fi
    delay=$((RANDOM % window))
    "$S" export "$T/ck$src" "$OUT" $FILES --quiet >"$T/x.out" 2>&1 &
    pid=$!
    sleep "$(printf '0.%03d' "$delay")"
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    st=$?
    if [ "$st" != 0 ] && [ "$st" != 137 ]; then
        loss "$i" "export exited $st: $(cat "$T/x.out")"
        continue
    fi
    if same_set "$OUT" "$T/ref$held"; then got=$held
    elif same_set "$OUT" "$T/ref$src"; then got=$src
    else
        loss "$i" "OUT is neither set $held nor set $src: $(ls -A "$OUT" | xargs)"
        break
    fi
    if [ "$held" = "$src" ]; then same=$((same + 1)) # the same set either way
    elif [ "$got" = "$held" ]; then old=$((old + 1))
    else new=$((new + 1)); fi
    other=$(ls -A "$T/run" | grep -v -x out | grep -v '^out\.strata-export-' | xargs)
    [ -z "$other" ] || loss "$i" "beside OUT: $other"
    k=$(ls -A "$T/run" | grep -c '^out\.strata-export-')
    [ "$k" -le 1 ] || loss "$i" "$k staging directories: the next export did not remove the old"
    left=$((left + k))
    "$S" verify "$OUT" >"$T/v.out" 2>&1 || loss "$i" "strata verify: $(cat "$T/v.out")"
    # (torch takes seconds to import: every 6th trial)
    if [ $have_st = 1 ] && [ $((i % 6)) = 1 ] &&
        ! "$PY" "$T/st_load.py" "$OUT" "$T/ref$got" >"$T/p.out" 2>&1; then
        loss "$i" "safetensors: $(tail -n 1 "$T/p.out")"
    fi
    [ "${STRATA_KILL_VERBOSE:-0}" = 1 ] &&
        echo "trial $i: export $src killed at ${delay} ms (status $st): OUT holds set $got, $k staging"
    held=$got
done
"$S" export "$T/ckB" "$OUT" $FILES --quiet || loss end "a clean export failed"
k=$(ls -A "$T/run" | grep -c '^out\.strata-export-')
[ "$k" = 0 ] || loss end "a clean export left $k staging directories"
same_set "$OUT" "$T/refB" || loss end "a clean export did not give set B"
if [ $have_st = 1 ] && ! "$PY" "$T/st_load.py" "$OUT" "$T/refB" >"$T/p.out" 2>&1; then
    loss end "safetensors: $(tail -n 1 "$T/p.out")"
fi
[ $have_st = 1 ] || echo "(the safetensors package is not in $PY: read by strata only)"
echo "export kill trials: $TRIALS, old set kept: $old, new set in place: $new, same set: $same, staging left by kills: $left, losses: $losses"
[ "$losses" = 0 ]
