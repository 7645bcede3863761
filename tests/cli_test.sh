#!/usr/bin/env bash
# cli_test.sh - the `strata` command end to end: demo across layouts, inspect, ls, verify
# (with a bit flip), gc, --help, exit statuses. Prints one line per check and a summary.
set -u
cd "$(dirname "$0")/.."
S=${STRATA:-${BUILD:-build}/strata}
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-cli-XXXXXX")
trap 'rm -rf "$T"' EXIT
pass=0 fail=0
check() { # name, then a command that must succeed
    local name=$1; shift
    if "$@" >"$T/out" 2>&1; then pass=$((pass + 1)); echo "ok   $name"
    else fail=$((fail + 1)); echo "FAIL $name"; sed 's/^/     /' "$T/out" | tail -n 15; fi
}
status_is() { # expected status, command...
    local want=$1; shift
    "$@"; local got=$?
    [ "$got" = "$want" ] || { echo "exit status $got, want $want"; return 1; }
}

# demo: several layout pairs, the last line must say ok=1
for pair in "tp=2,pp=2,dp=2,zero=1 tp=1,pp=3,dp=2" "tp=1,pp=1,dp=1 tp=3,pp=2,dp=1,zero=1" \
            "tp=4,pp=1,dp=3,zero=1 tp=2,pp=2,dp=1" "tp=3,pp=3,dp=1 tp=1,pp=1,dp=5,zero=1"; do
    set -- $pair
    check "demo $1 -> $2" bash -c "'$S' demo --size-mb 6 --from $1 --to $2 | tail -n 1 | grep -q 'ok=1$'"
done

check "demo --dir keeps the checkpoint" bash -c "'$S' demo --size-mb 4 --dir '$T/ck1' --step 77 | grep -q '^checkpoint: $T/ck1\$' && test -f '$T/ck1/COMMIT'"
check "inspect lists tensors" bash -c "'$S' inspect '$T/ck1' | grep -q 'model.layers.1.mlp.fc2.weight'"
check "inspect --json is valid JSON with shards" bash -c "'$S' inspect '$T/ck1' --json | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j[\"committed\"] and j[\"step\"]==77 and any(s.get(\"flat\") for t in j[\"tensors\"] for s in t[\"shards\"])'"
check "verify ok" status_is 0 "$S" verify "$T/ck1"

# a second checkpoint, made incomplete by removing its commit record
"$S" demo --size-mb 4 --dir "$T/ck2" >/dev/null 2>&1
rm -f "$T/ck2/COMMIT"
check "ls shows committed and incomplete" bash -c "out=\$('$S' ls '$T'); echo \"\$out\"; echo \"\$out\" | grep -q '^committed .* 77  $T/ck1\$' && echo \"\$out\" | grep -q '^incomplete .*$T/ck2\$'"
check "load of incomplete refused (exit 3)" status_is 3 "$S" verify "$T/ck2"
check "demo refuses to overwrite a committed checkpoint" bash -c "! '$S' demo --size-mb 4 --dir '$T/ck1' 2>&1 | grep -q ok=1; '$S' verify '$T/ck1'"

# bit flip in a data file: verify names tensor and file, exit 3
cp -r "$T/ck1" "$T/flip"
python3 - "$T/flip/data-000000.bin" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, 'rb').read()); b[12345] ^= 0x10; open(p, 'wb').write(bytes(b))
PY
check "verify reports a bit flip (exit 3, tensor and file named)" bash -c "'$S' verify '$T/flip' 2>&1 | tee /dev/stderr | grep -q \"CORRUPT: tensor '.*' in file 'data-000000.bin'\"; test \${PIPESTATUS[0]} = 3"
check "garbled metadata is STRATA_EFORMAT (exit 3)" bash -c "cp -r '$T/ck1' '$T/garb' && printf 'xx' | dd of='$T/garb/metadata.bin' bs=1 seek=40 conv=notrunc 2>/dev/null; '$S' inspect '$T/garb' 2>&1 | grep -q STRATA_EFORMAT; test \${PIPESTATUS[0]} = 3"

check "ls marks a commit record that does not match as CORRUPT" bash -c "'$S' ls '$T' | grep -q '^CORRUPT .*$T/garb\$'"
check "gc --dry-run removes nothing" bash -c "'$S' gc '$T' --dry-run | grep -q 'would remove $T/ck2' && test -d '$T/ck2'"
check "gc removes the incomplete one only" bash -c "'$S' gc '$T' && test ! -e '$T/ck2' && test -f '$T/garb/COMMIT' && '$S' verify '$T/ck1'"

# retention: gc --keep 2 keeps exactly the 2 newest committed checkpoints, and removes an
# incomplete one older than the newest committed
retain() {
    mkdir -p "$T/ret"
    for i in 1 2 3 4; do
        "$S" demo --size-mb 2 --dir "$T/ret/s$i" --step $i >/dev/null 2>&1 || return 1
        [ $i = 2 ] && { cp -r "$T/ret/s2" "$T/ret/inc"; rm "$T/ret/inc/COMMIT"; touch -d '1 hour ago' "$T/ret/inc"; }
    done
    sleep 0.01
    cp -r "$T/ret/s4" "$T/ret/fresh" && rm "$T/ret/fresh/COMMIT" # a save in progress
    "$S" gc "$T/ret" --keep 2 || return 1
    "$S" ls "$T/ret"
    [ "$(ls "$T/ret" | xargs)" = "fresh s3 s4" ] && "$S" verify "$T/ret/s4" >/dev/null
}
check "gc --keep 2 keeps the 2 newest committed and a save in progress, drops an old incomplete one" retain

check "README example (examples/reshard.c) runs" "${S%/strata}/examples/reshard" "$T/example"

for c in demo inspect ls verify gc bench; do
    check "$c --help" bash -c "'$S' $c --help | grep -q '^usage: strata $c'"
done
check "no command: usage, exit 2" status_is 2 "$S"
check "bad layout: exit 2" status_is 2 "$S" demo --from tp=x
for l in tp=+2 tp=2, tp=2,tp=3 "tp= 2" tp=2,zero=2 tp=99999999999; do
    check "layout '$l' refused: exit 2" status_is 2 "$S" demo --from "$l" --size-mb 1
done
check "unknown URI scheme: exit 2 with STRATA_ESCHEME" bash -c "'$S' verify s3://bucket/ck 2>&1 | grep -q STRATA_ESCHEME; test \${PIPESTATUS[0]} = 2"
check "missing checkpoint: exit 1" status_is 1 "$S" verify "$T/nope"

echo "cli: $pass passed, $fail failed"
[ "$fail" = 0 ]
