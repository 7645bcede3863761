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
says() { # expected status (or "nonzero"), a grep pattern its output must match, command...
    local want=$1 pat=$2 out got; shift 2
    out=$("$@" 2>&1); got=$?
    printf '%s\n' "$out"
    if [ "$want" = nonzero ]; then [ "$got" != 0 ]; else [ "$got" = "$want" ]; fi ||
        { echo "exit status $got, want $want"; return 1; }
    grep -q -- "$pat" <<<"$out" || { echo "the output lacks: $pat"; return 1; }
}
export -f says
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
check "verify reports a bit flip (exit 3, tensor and file named)" bash -c "says 3 \"CORRUPT: tensor '.*' in file 'data-000000.bin'\" '$S' verify '$T/flip'"
check "garbled metadata is STRATA_EFORMAT (exit 3)" bash -c "cp -r '$T/ck1' '$T/garb' && printf 'xx' | dd of='$T/garb/metadata.bin' bs=1 seek=40 conv=notrunc 2>/dev/null; says 3 STRATA_EFORMAT '$S' inspect '$T/garb'"

check "ls marks a commit record that does not match as CORRUPT" bash -c "'$S' ls '$T' | grep -q '^CORRUPT .*$T/garb\$'"
check "gc --dry-run removes nothing" bash -c "'$S' gc '$T' --dry-run | grep -q 'would remove $T/ck2' && test -d '$T/ck2'"
check "gc removes the incomplete one only" bash -c "'$S' gc '$T' && test ! -e '$T/ck2' && test -f '$T/garb/COMMIT' && '$S' verify '$T/ck1'"

# segments of distributed loads killed on this node (/dev/shm/strata-load-<uid>-<boot>-<pidns>-
# <pid>-<random>): gc removes one whose creator is dead, keeps a live process's and one
# named by another user
shm_gc() {
    local pre dead tag=$$ f
    pre="strata-load-$(id -u)-$(cut -c1-8 /proc/sys/kernel/random/boot_id)-$(readlink /proc/self/ns/pid | tr -dc 0-9)-"
    dead=$(sh -c 'echo $$') # a process that has ended
    kill -0 "$dead" 2>/dev/null && return 1
    local gone="/dev/shm/$pre$dead-cli$tag" live="/dev/shm/$pre$$-cli$tag"
    local other="/dev/shm/strata-load-$(($(id -u) + 1))-${pre#strata-load-*-}$dead-cli$tag"
    for f in "$gone" "$live" "$other"; do head -c 4096 /dev/zero >"$f"; chmod 600 "$f"; done
    "$S" gc "$T/ret" --dry-run >/dev/null && [ -e "$gone" ] || { rm -f "$gone" "$live" "$other"; return 1; }
    "$S" gc "$T/ret"; local e=$?
    local ok=0
    [ $e = 0 ] && [ ! -e "$gone" ] && [ -e "$live" ] && [ -e "$other" ] && ok=1
    rm -f "$gone" "$live" "$other"
    [ $ok = 1 ]
}

# retention: gc --keep 2 keeps exactly the 2 newest committed checkpoints, removes an
# abandoned incomplete one, and keeps one a live save owns (its LOCK held, here by a python
# process: POSIX record locks and strata's OFD locks exclude each other), however old
retain() {
    mkdir -p "$T/ret"
    for i in 1 2 3 4; do
        "$S" demo --size-mb 2 --dir "$T/ret/s$i" --step $i >/dev/null 2>&1 || return 1
        [ $i = 2 ] && { cp -r "$T/ret/s2" "$T/ret/inc"; rm "$T/ret/inc/COMMIT"; }
    done
    cp -r "$T/ret/s1" "$T/ret/live" && rm "$T/ret/live/COMMIT" && touch -d '1 hour ago' "$T/ret/live"
    python3 -c "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)" "$T/ret/live/LOCK" >"$T/held" &
    local holder=$!
    for k in $(seq 100); do grep -q held "$T/held" && break; sleep 0.1; done
    "$S" gc "$T/ret" --keep 2; local e=$?
    kill $holder; wait $holder 2>/dev/null
    [ $e = 0 ] || return 1
    "$S" ls "$T/ret"
    [ "$(ls "$T/ret" | xargs)" = "live s3 s4" ] && "$S" verify "$T/ret/s4" >/dev/null &&
        "$S" gc "$T/ret" --keep 2 && [ "$(ls "$T/ret" | xargs)" = "s3 s4" ] # let go: removed
}
check "gc --keep 2 keeps the 2 newest committed and a save in progress, drops abandoned ones" retain
check "gc removes a killed load's /dev/shm segment, keeps a live one's and another user's" shm_gc

check "README example (examples/reshard.c) runs" "${S%/strata}/examples/reshard" "$T/example"

# export (issue 12): safetensors files whose headers follow the format (8-byte little-endian
# length, JSON padded with spaces to a multiple of 8, offsets tiling the data, known dtype
# names), one file model.safetensors alone (issue 30: no index, as Hugging Face writes it);
# a small --max-file-gb splits it over several files and an index whose total_size is the
# sum and whose weight_map names every tensor of the checkpoint once; a corrupt checkpoint
# exits 3 and leaves no output file
cat >"$T/st_check.py" <<'PY'
import json, os, struct, sys
out, names_json, want_files = sys.argv[1], sys.argv[2], sys.argv[3]
names = [t['name'] for t in json.load(open(names_json))['tensors']]
if want_files == '1':     # one file: model.safetensors alone, as Hugging Face writes it
    assert os.listdir(out) == ['model.safetensors'], os.listdir(out)
    files, idx = ['model.safetensors'], None
else:
    idx = json.load(open(os.path.join(out, 'model.safetensors.index.json')))
    files = sorted(set(idx['weight_map'].values()))
    assert files == ['model-%05d-of-%05d.safetensors' % (i + 1, len(files))
                     for i in range(len(files))], files
    assert sorted(os.listdir(out)) == sorted(files + ['model.safetensors.index.json']), \
        os.listdir(out)
n = len(files)
assert (n == 1) if want_files == '1' else (n > 1), n
sizes = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'F8_E4M3': 1, 'F8_E5M2': 1, 'I64': 8,
         'I32': 4, 'I16': 2, 'I8': 1, 'U8': 1, 'BOOL': 1}
seen, total = {}, 0
for f in files:
    raw = open(os.path.join(out, f), 'rb').read()
    hlen = struct.unpack('<Q', raw[:8])[0]
    assert hlen % 8 == 0 and 8 + hlen <= len(raw), (f, hlen)
    text = raw[8:8 + hlen].decode('utf-8')
    assert text == text.rstrip(' ') + ' ' * (len(text) - len(text.rstrip(' ')))
    hdr = json.loads(text)
    assert hdr.pop('__metadata__', {'format': 'pt'}) == {'format': 'pt'}
    spans = []
    for name, t in hdr.items():
        assert name not in seen, name
        seen[name] = f
        assert set(t) == {'dtype', 'shape', 'data_offsets'} and t['dtype'] in sizes, t
        b, e = t['data_offsets']
        numel = 1
        for d in t['shape']:
            numel *= d
        assert e - b == numel * sizes[t['dtype']], (name, t)
        spans.append((b, e))
    spans.sort()
    pos = 0
    for b, e in spans:
        assert b == pos, (f, b, pos)
        pos = e
    assert pos == len(raw) - 8 - hlen, (f, pos, len(raw))
    total += pos
assert idx is None or idx['metadata']['total_size'] == total, (idx['metadata'], total)
assert idx is None or seen == idx['weight_map']
assert sorted(seen) == sorted(names), 'tensors differ from the checkpoint'
print(n, 'files,', len(seen), 'tensors,', total, 'bytes')
PY
"$S" inspect "$T/ck1" --json >"$T/ck1.json"
check "export: headers, offsets, dtypes and index follow the format" bash -c "'$S' export '$T/ck1' '$T/st1' && python3 '$T/st_check.py' '$T/st1' '$T/ck1.json' 1"
check "export --max-file-gb 0.001: several files, every tensor once" bash -c "'$S' export '$T/ck1' '$T/st2' --max-file-gb 0.001 --quiet && python3 '$T/st_check.py' '$T/st2' '$T/ck1.json' many"
check "export --prefix strips it; --dtype bf16 writes BF16" bash -c "'$S' export '$T/ck1' '$T/st3' --prefix model. --dtype bf16 --quiet && python3 '$T/st_check.py' '$T/st3' <(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); [t.update(name=t[\"name\"][6:]) for t in j[\"tensors\"] if t[\"name\"].startswith(\"model.\")]; print(json.dumps(j))' '$T/ck1.json') 1"
# copy (issue 30): strata_copy as a command, to a file path here (s3:// in s3_test.sh): the
# progress line on a terminal (script gives it one), the summary, a copy that verifies and
# has the source's step; a committed destination refused, untouched; a missing source
check "copy --help says what it does" bash -c "'$S' copy --help | grep -q '^usage: strata copy SRC DST' && '$S' --help | grep -q '^  copy '"
check "copy: progress line on a terminal, summary, the copy verifies (same step)" bash -c "script -qec \"'$S' copy '$T/ck1' '$T/ck1copy'\" /dev/null >'$T/cp.out' && grep -q 'copy: [0-9.]* [KMG]*i*B / [0-9.]* [KMG]*i*B  ' '$T/cp.out' && grep -q \"^copied $T/ck1 to $T/ck1copy: [0-9]* bytes of data files, every chunk verified, in .* s; committed\" '$T/cp.out' && '$S' verify '$T/ck1copy' && test \"\$('$S' inspect --json '$T/ck1copy' | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"step\"])')\" = \"\$('$S' inspect --json '$T/ck1' | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"step\"])')\""
check "copy --quiet prints nothing; onto a committed checkpoint: exit 1, STRATA_EEXIST, untouched" bash -c "'$S' copy --quiet '$T/ck1' '$T/ck1q' >'$T/cpq' && test ! -s '$T/cpq' && before=\$(cat '$T/ck1q/COMMIT' | od -An -tx1) && '$S' copy '$T/ck1' '$T/ck1q' >'$T/o' 2>&1; test \$? = 1 && grep -q '(STRATA_EEXIST)' '$T/o' && test \"\$(cat '$T/ck1q/COMMIT' | od -An -tx1)\" = \"\$before\""
check "copy of a missing checkpoint: exit 1; usage error: exit 2" bash -c "'$S' copy '$T/nothing-here' '$T/cpx' >'$T/o' 2>&1; test \$? = 1 && grep -q '(STRATA_ENOENT)' '$T/o' && ! test -e '$T/cpx/COMMIT' && { '$S' copy '$T/ck1' >/dev/null 2>&1; test \$? = 2; }"
check "export of a corrupt checkpoint: exit 3, no output left" bash -c "'$S' export '$T/flip' '$T/st4' --quiet; test \$? = 3 && test ! -e '$T/st4'"
check "export over an earlier export, corrupt: exit 3, the earlier files kept byte for byte" bash -c "cp -r '$T/st2' '$T/st5' && { '$S' export '$T/flip' '$T/st5' --quiet; test \$? = 3; } && diff -r '$T/st2' '$T/st5' && test -z \"\$(ls -d '$T'/st5.strata-export-* 2>/dev/null)\""
check "export into a directory holding other files: exit 1, the file named, nothing touched" bash -c "mkdir '$T/st5b' && touch '$T/st5b/config.json' && '$S' export '$T/ck1' '$T/st5b' --quiet 2>&1 | grep -q \"holds 'config.json', which is not a file an export writes.*STRATA_EEXIST\" && test \${PIPESTATUS[0]} = 1 && test \"\$(ls -A '$T/st5b')\" = config.json"
check "export to a dangling symlink: exit 1, named a symbolic link (not 'File exists')" bash -c "ln -s '$T/nowhere' '$T/st5c' && '$S' export '$T/ck1' '$T/st5c' --quiet 2>&1 | grep -q 'st5c. is a symbolic link (dangling or not)' && test \${PIPESTATUS[0]} = 1 && test ! -e '$T/nowhere'"
# Ctrl-C: the export stops at its next window and leaves OUT as it was (an earlier export
# of another checkpoint, byte for byte) and no staging directory; SIGINT is sent once the
# staging directory exists, so it lands inside the export
sigint() {
    "$S" demo --size-mb 160 --dir "$T/big" >/dev/null 2>&1 || return 1
    cp -r "$T/st2" "$T/st_int"
    "$S" export "$T/big" "$T/st_int" --quiet 2>"$T/int.err" &
    local pid=$! k
    for k in $(seq 2000); do compgen -G "$T/st_int.strata-export-*" >/dev/null && break; sleep 0.005; done
    kill -INT $pid
    wait $pid; local st=$?
    cat "$T/int.err"
    rm -rf "$T/big"
    [ $st = 1 ] && grep -q 'interrupted by Interrupt: the export stopped.*STRATA_EABORTED' "$T/int.err" &&
        diff -r "$T/st2" "$T/st_int" && ! compgen -G "$T/st_int.strata-export-*" >/dev/null
}
check "export stopped by SIGINT: exit 1, OUT as it was, no staging directory left" sigint
X=${BUILD:-build}/tests/test_export
check "export of a tensor named __metadata__: exit 1 (STRATA_EMISMATCH), not a usage error" bash -c "'$X' --make-names '$T/meta' __metadata__ w && '$S' export '$T/meta' '$T/stmeta' --quiet 2>&1 | grep -q \"tensor '__metadata__' cannot be exported.*STRATA_EMISMATCH\" && test \${PIPESTATUS[0]} = 1 && test ! -e '$T/stmeta'"
check "export: unknown --dtype or --format is a usage error (exit 2)" bash -c "'$S' export '$T/ck1' '$T/st6' --dtype f8 2>/dev/null; test \$? = 2 && { '$S' export '$T/ck1' '$T/st6' --format gguf 2>/dev/null; test \$? = 2; } && test ! -e '$T/st6'"
check "export of an incomplete checkpoint: exit 3" bash -c "cp -r '$T/ck1' '$T/inc1' && rm '$T/inc1/COMMIT' && { '$S' export '$T/inc1' '$T/st7' --quiet; test \$? = 3; } && test ! -e '$T/st7'"

for c in demo inspect ls verify gc export bench; do
    check "$c --help" bash -c "'$S' $c --help | grep -q '^usage: strata $c'"
done
check "bench disk --help" bash -c "'$S' bench disk --help | grep -q '^usage: strata bench disk'"
# bench disk: two passes, strata's I/O buffers then 4 KiB pages, each saying what backed
# them; its scratch file removed (where the filesystem refuses O_DIRECT: a clear failure)
bench_disk() {
    out=$("$S" bench disk --dir "$T" --size-mb 16 2>&1); rc=$?
    echo "$out"
    if [ $rc != 0 ]; then echo "$out" | grep -q "measuring the disk under '$T'.*STRATA_EINVAL"; return; fi
    echo "$out" | grep -q '^run=1 buffers=strata write_gbps=[0-9.]* read_gbps=[0-9.]* .* pages="[a-zA-Z0-9 ]*"$' &&
        echo "$out" | grep -q '^run=1 buffers=4k .* pages="4 KiB pages"$' &&
        ! ls -A "$T" | grep -q strata-disk
}
check "bench disk: the disk through strata's buffers and through 4 KiB pages" bench_disk
check "no command: usage, exit 2" status_is 2 "$S"
check "bad layout: exit 2" status_is 2 "$S" demo --from tp=x
for l in tp=+2 tp=2, tp=2,tp=3 "tp= 2" tp=2,zero=2 tp=99999999999; do
    check "layout '$l' refused: exit 2" status_is 2 "$S" demo --from "$l" --size-mb 1
done
check "unknown URI scheme: exit 2 with STRATA_ESCHEME" bash -c "says 2 STRATA_ESCHEME '$S' verify gs://bucket/ck"
check "missing checkpoint: exit 1" status_is 1 "$S" verify "$T/nope"

# hostile files (issue 10): a FIFO in place of COMMIT, metadata.bin or a data file blocks
# no command (each runs under a timeout: exit 124 would be a hang) and gets its exact
# status: COMMIT -> incomplete (3), metadata.bin -> STRATA_EFORMAT (3), data file ->
# STRATA_EIO (1); ls marks the first two CORRUPT and gc keeps them
mkdir -p "$T/fifo"
for f in COMMIT metadata.bin data-000000.bin; do
    cp -r "$T/ck1" "$T/fifo/$f" && rm "$T/fifo/$f/$f" && mkfifo "$T/fifo/$f/$f"
done
check "FIFO as COMMIT: verify is STRATA_EINCOMPLETE, not a hang" bash -c "says 3 'COMMIT is not a regular file.*STRATA_EINCOMPLETE' timeout 20 '$S' verify '$T/fifo/COMMIT'"
check "FIFO as COMMIT: inspect shows it as incomplete" bash -c "timeout 20 '$S' inspect '$T/fifo/COMMIT' | grep -q INCOMPLETE"
check "FIFO as metadata.bin: verify and inspect are STRATA_EFORMAT" bash -c "for c in verify inspect; do says 3 'metadata.bin is not a regular file.*STRATA_EFORMAT' timeout 20 '$S' \$c '$T/fifo/metadata.bin' || exit 1; done"
check "FIFO as a data file: verify is STRATA_EIO naming the file" bash -c "says 1 \"data file 'data-000000.bin'.*STRATA_EIO\" timeout 20 '$S' verify '$T/fifo/data-000000.bin'"
check "FIFOs: ls of the parent does not block, marks CORRUPT" bash -c "out=\$(timeout 20 '$S' ls '$T/fifo') || exit 1; echo \"\$out\"; echo \"\$out\" | grep -q '^CORRUPT .*$T/fifo/COMMIT\$' && echo \"\$out\" | grep -q '^CORRUPT .*$T/fifo/metadata.bin\$' && echo \"\$out\" | grep -q '^committed .*$T/fifo/data-000000.bin\$'"
check "FIFOs: gc and gc --keep do not block and keep all three" bash -c "timeout 20 '$S' gc '$T/fifo' && timeout 20 '$S' gc '$T/fifo' --keep 1 && test -p '$T/fifo/COMMIT/COMMIT' && test -p '$T/fifo/metadata.bin/metadata.bin' && test -p '$T/fifo/data-000000.bin/data-000000.bin'"

# a LOCK that is a symlink, FIFO, directory or socket spares that checkpoint only: gc and
# gc --keep warn naming it, remove the others and exit 0 (they stopped with exit 1, "Wrong
# medium type" / "No such device or address", at the first)
badlock() {
    local d=$T/badlock k
    for mode in plain --keep; do
        rm -rf "$d" && mkdir -p "$d"
        for k in symlink fifo dir socket plain; do
            cp -r "$T/ck1" "$d/$k" && rm "$d/$k/COMMIT"
        done
        ln -s /dev/null "$d/symlink/LOCK" && mkfifo "$d/fifo/LOCK" && mkdir "$d/dir/LOCK" &&
            python3 -c "import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" "$d/socket/LOCK" || return 1
        if [ $mode = plain ]; then timeout 20 "$S" gc "$d" >"$T/gc.out" 2>"$T/gc.err" || return 1
        else timeout 20 "$S" gc "$d" --keep 0 >"$T/gc.out" 2>"$T/gc.err" || return 1; fi
        cat "$T/gc.out" "$T/gc.err"
        [ ! -e "$d/plain" ] || return 1
        for k in symlink fifo dir socket; do
            [ -d "$d/$k" ] && grep -q "warning: kept $d/$k: '$d/$k/LOCK' is not a lock file" "$T/gc.err" || return 1
        done
    done
}
check "a LOCK that is a symlink, FIFO, directory or socket: gc warns, keeps it, collects the rest" badlock

# what a replacing save (STRATA_SAVE_REPLACE) killed after its commit leaves beside its
# target, a committed checkpoint in a hidden directory, is removed by gc (and gc --keep
# never counts it as one kept)
leftover() {
    local d=$T/rep
    rm -rf "$d" && mkdir -p "$d"
    "$S" demo --size-mb 2 --dir "$d/latest" >/dev/null 2>&1 &&
        "$S" demo --size-mb 2 --dir "$d/.latest.strata-replace" >/dev/null 2>&1 || return 1
    "$S" gc "$d" || return 1
    [ ! -e "$d/.latest.strata-replace" ] && "$S" verify "$d/latest" || return 1
    "$S" demo --size-mb 2 --dir "$d/.latest.strata-replace" >/dev/null 2>&1 &&
        "$S" gc "$d" --keep 1 && [ ! -e "$d/.latest.strata-replace" ] && "$S" verify "$d/latest"
}
check "gc removes what a replacing save left beside its target, keeps the target" leftover

# a sparse 4 GiB metadata.bin (a few KiB on disk) is refused before it is read: inspect,
# verify, ls and gc of the parent each peak under 64 MiB of memory (they took 4.1 GB)
cp -r "$T/ck1" "$T/sparse" && truncate -s 4G "$T/sparse/metadata.bin"
small_peak() { # command...: runs it, fails if its peak RSS reaches 64 MiB; its status
    python3 - "$@" <<'PY'
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB
print(f'{sys.argv[1:]}: exit {rc}, peak RSS {peak} KiB', file=sys.stderr)
sys.exit(rc if peak < 64 << 10 else 99)
PY
}
sparse() {
    small_peak "$S" inspect "$T/sparse" >"$T/sparse.out" 2>&1; local rc=$?
    cat "$T/sparse.out"
    [ $rc = 3 ] && grep -q 'larger than the .* bytes its commit record states.*STRATA_EFORMAT' \
        "$T/sparse.out" || return 1
    small_peak "$S" verify "$T/sparse"; [ $? = 3 ] || return 1
    small_peak "$S" ls "$T" >"$T/sparse.out" && grep -q "^CORRUPT .*$T/sparse\$" "$T/sparse.out" ||
        return 1
    small_peak "$S" gc "$T" --dry-run >/dev/null
}
check "sparse 4 GiB metadata.bin: inspect, verify, ls, gc refuse it under 64 MiB of memory" sparse

# inspect --json stays valid JSON whatever bytes an (older) checkpoint's names hold:
# test_hostile --make-bad-name writes one whose tensor and blob names are not UTF-8 (and
# hold control characters, quotes and backslashes), and the raw names to DIR.names; the
# output must decode as strict UTF-8 JSON, invalid bytes as U+FFFD as Python replaces them
H=${BUILD:-build}/tests/test_hostile
bad_json() {
    "$H" --make-bad-name "$T/badname" >/dev/null || return 1
    "$S" inspect "$T/badname" --json >"$T/bad.json" || return 1
    PYTHONIOENCODING=utf-8:strict python3 -m json.tool <"$T/bad.json" >/dev/null || return 1
    python3 - "$T/bad.json" "$T/badname.names" <<'PY'
import json, sys
raw = open(sys.argv[1], 'rb').read()
j = json.loads(raw.decode('utf-8'))  # strict: any invalid byte fails here
tname, bname = open(sys.argv[2], 'rb').read().split(b'\0')
got_t, got_b = j['tensors'][0]['name'], j['blobs'][0]['name']
want_t, want_b = tname.decode('utf-8', 'replace'), bname.decode('utf-8', 'replace')
assert got_t == want_t, (got_t, want_t)
assert got_b == want_b, (got_b, want_b)
print('names:', ascii(got_t), ascii(got_b))
PY
}
check "inspect --json escapes names that are not UTF-8 (strict JSON, U+FFFD)" bad_json
# names that are not UTF-8 cannot be loaded (strata_load refuses them), so cannot be exported:
# a clear error naming the byte, and no output
check "export of names that are not UTF-8 fails clearly, leaves nothing" bash -c "says nonzero 'is not valid UTF-8' '$S' export '$T/badname' '$T/stbad' --quiet && test ! -e '$T/stbad'"

# names, paths and messages that hold terminal control sequences (a checkpoint can carry
# them: they are valid UTF-8) reach the terminal escaped in inspect, ls, verify, gc and error
# messages: no ESC, BEL, backspace, DEL or C1 control, no byte that is not UTF-8
ctl_clean() { # FILE: none of those bytes
    python3 - "$1" <<'PY'
import sys
b = open(sys.argv[1], 'rb').read()
bad = [c for c in b if (c < 0x20 and c not in (9, 10)) or c == 0x7f]
t = b.decode('utf-8')  # strict: a stray byte fails here
bad += [c for c in t if 0x80 <= ord(c) <= 0x9f]
assert not bad, bad[:5]
PY
}
ctl() {
    local D="$T/ctl"$'\e[2J'
    "$X" --make-names "$D" $'title\e]0;owned\a' $'clear\e[2J\e[31mred' $'c1\xc2\x9b31mcsi' $'del\x7fbs\b' || return 1
    "$S" inspect "$D" --shards >"$T/ctl.out" 2>&1 || return 1
    "$S" ls "$T" >>"$T/ctl.out" 2>&1 || return 1
    "$S" verify "$D" >>"$T/ctl.out" 2>&1 || return 1
    local f=$(ls "$D" | grep '^data-')
    printf 'x' | dd of="$D/$f" bs=1 seek=3 conv=notrunc 2>/dev/null
    "$S" verify "$D" >>"$T/ctl.out" 2>&1; [ $? = 3 ] || return 1
    rm "$D/COMMIT"
    "$S" gc "$T" --dry-run >>"$T/ctl.out" 2>&1 || return 1
    "$S" export "$D" "$T/stctl" >>"$T/ctl.out" 2>&1; [ $? = 3 ] || return 1
    cat -v "$T/ctl.out"
    ctl_clean "$T/ctl.out" &&
        grep -qF 'title\x1b]0;owned\x07' "$T/ctl.out" && grep -qF 'c1\u009b31mcsi' "$T/ctl.out" &&
        grep -qF 'del\x7fbs\x08' "$T/ctl.out" && grep -qE "^CORRUPT: tensor '[^']*\\\\(x1b|u009b|x7f)" "$T/ctl.out" &&
        grep -qF 'ctl\x1b[2J' "$T/ctl.out" && grep -qF 'would remove' "$T/ctl.out"
}
check "inspect, ls, verify, gc and errors escape terminal control sequences" ctl
rm -rf "$T/ctl"$'\e[2J'

# a safetensors directory (the export above, st1) as a source: inspect, ls, verify say it
# has no checksums; export reads it again; gc never touches it; a truncated file is refused
cat >"$T/st_same.py" <<'PY'
import json, os, struct, sys
def tensors(d):  # name -> (dtype, shape, data bytes) over a directory's files
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith('.safetensors'):
            b = open(os.path.join(d, f), 'rb').read()
            n = struct.unpack('<Q', b[:8])[0]
            for k, v in json.loads(b[8:8 + n]).items():
                if k != '__metadata__':
                    s, e = v['data_offsets']
                    out[k] = (v['dtype'], v['shape'], b[8 + n + s:8 + n + e])
    return out
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a and a == b, (len(a), len(b))
print(len(a), 'tensors equal')
PY
check "inspect of a safetensors directory says it has no checksums" bash -c "'$S' inspect '$T/st1' | grep -q '^safetensors .*NO CHECKSUMS' && '$S' inspect '$T/st1' --json | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j[\"format\"]==\"safetensors\" and j[\"checksums\"] is False and j[\"chunk_bytes\"]==0 and j[\"tensors\"]'"
check "ls lists a safetensors directory as such" bash -c "'$S' ls '$T' | grep -q '^safetensors .* $T/st1 (no checksums)\$'"
check "verify of a safetensors directory reads it and says nothing could be checked" bash -c "'$S' verify '$T/st1' | grep -q 'no checksums'"
check "export of a safetensors directory (re-split) keeps every tensor's bytes" bash -c "'$S' export '$T/st1' '$T/st8' --max-file-gb 0.002 --quiet && test \$(ls '$T/st8' | grep -c safetensors\$) -gt 1 && python3 '$T/st_same.py' '$T/st1' '$T/st8'"
check "gc leaves a safetensors directory alone" bash -c "before=\$(ls '$T/st1' | wc -l); '$S' gc '$T' >/dev/null && test \"\$(ls '$T/st1' | wc -l)\" = \"\$before\""
cp -r "$T/st1" "$T/st9"
last=$(ls "$T/st9"/*.safetensors | tail -n 1)
truncate -s -1 "$last"
check "a truncated safetensors file: exit 3, the file named" bash -c "says 3 \"$(basename "$last")\" '$S' inspect '$T/st9'"

# mem:// and file:// URIs (issue 18): ls printed the listing, then "No such file or
# directory", and exited 1; ls, inspect, verify and gc take any URI like a path
mem_uris() {
    local M=(env STRATA_MEM_ROOT="$T/mem" "$S") out
    mkdir -m 700 -p "$T/mem"
    "${M[@]}" demo --size-mb 2 --dir mem://ck/a >/dev/null 2>&1 || return 1
    "${M[@]}" demo --size-mb 2 --dir mem://ck/b >/dev/null 2>&1 || return 1
    rm "$T/mem/ck/b/COMMIT"
    out=$("${M[@]}" ls mem://ck 2>&1) || { echo "ls exit $?: $out"; return 1; }
    echo "$out"
    echo "$out" | grep -q '^committed .* mem://ck/a$' && echo "$out" | grep -q '^incomplete .* mem://ck/b$' &&
        ! echo "$out" | grep -q 'No such file' || return 1
    "${M[@]}" ls mem://ck/a | grep -q '^committed .* mem://ck/a$' || return 1
    "${M[@]}" ls "file://$T/mem/ck" | grep -q "^committed .* file://$T/mem/ck/a\$" || return 1
    "${M[@]}" inspect mem://ck/a | grep -q '^checkpoint mem://ck/a: committed' || return 1
    "${M[@]}" verify mem://ck/a | grep -q '^ok: mem://ck/a:' || return 1
    "${M[@]}" gc mem://ck | grep -q '^removed mem://ck/b ' && test ! -e "$T/mem/ck/b" &&
        "${M[@]}" verify mem://ck/a >/dev/null
}
check "mem:// and file:// URIs: ls lists and exits 0; inspect, verify, gc work" mem_uris

check "gc removes a killed export's staging directory beside its OUT, OUT kept" bash -c "mkdir -p '$T/st1.strata-export-99-0000dead/set' && : >'$T/st1.strata-export-99-0000dead/EXPORT.LOCK' && '$S' gc '$T' | grep -q '^removed 1 staging directory left by killed exports' && test ! -e '$T/st1.strata-export-99-0000dead' && test -f '$T/st1/model.safetensors'"

# what a path that is no strata checkpoint is (issue 18), not "incomplete": a directory of
# checkpoints names one, an empty directory says so (STRATA_ENOENT, exit 1); a real PyTorch
# DCP checkpoint and a torch.save file (written by the venv's torch) are read (torch.save's
# legacy format is STRATA_ENOTSUP)
check "verify of a directory of checkpoints: names one under it, exit 1" bash -c "says 1 \"is a directory of checkpoints, not one (.* committed under it); did you mean $T/.*? (strata ls $T lists them) (STRATA_ENOENT)\" '$S' verify '$T'"
check "inspect of an empty directory: says so, exit 1" bash -c "mkdir '$T/void' && says 1 \"'$T/void' is an empty directory, not a checkpoint (STRATA_ENOENT)\" '$S' inspect '$T/void'"
PY=${VENV:-.venv}/bin/python
if [ -x "$PY" ] && "$PY" -c 'import torch.distributed.checkpoint' 2>/dev/null; then
    "$PY" -W ignore -c "import sys, torch, torch.distributed.checkpoint as d; d.save({'w': torch.arange(6.)}, checkpoint_id=sys.argv[1]); torch.save({'w': torch.ones(2)}, sys.argv[2])" "$T/dcp" "$T/model.pt"
    # a DCP checkpoint is a source (issue 19): inspect, verify, export, ls read it
    check "inspect of a DCP checkpoint: format named, no strata checksums" bash -c "'$S' inspect '$T/dcp' | grep -q \"^PyTorch DCP $T/dcp: 1 tensors, 0 blobs, 24 data bytes in 1 files; NO strata CHECKSUMS\""
    check "verify of a DCP checkpoint: zip CRC-32s checked, exit 0" bash -c "'$S' verify '$T/dcp' | grep -q \"^ok: $T/dcp: 1 tensors, 0 blobs, 24 data bytes read; every zip CRC-32 matches\""
    check "export of a DCP checkpoint: safetensors written" bash -c "'$S' export '$T/dcp' '$T/dcp.out' --quiet && test -f '$T/dcp.out/model.safetensors'"
    check "ls of a DCP checkpoint: listed as dcp" bash -c "'$S' ls '$T/dcp' | grep -q \"^dcp .* $T/dcp (no checksums)\""
    # issue 30: a directory of DCP checkpoints gets the hint a directory of strata's does; a
    # DCP directory whose save did not finish (.distcp files, no .metadata) is an incomplete
    # DCP checkpoint, listed as one
    "$PY" -W ignore -c "import sys, torch, torch.distributed.checkpoint as d; [d.save({'w': torch.arange(6.) * s}, checkpoint_id=sys.argv[1] + '/step-%d' % s) for s in (100, 200, 300)]" "$T/dcps"
    rm "$T/dcps/step-300/.metadata"      # what a dcp.save killed before its last write leaves
    check "inspect of a directory of DCP checkpoints: did you mean DIR/step-N, exit 1" bash -c "'$S' inspect '$T/dcps' >'$T/o' 2>&1; test \$? = 1 && grep -qF \"'$T/dcps' is a directory of checkpoints, not one (2 committed under it); did you mean $T/dcps/step-200? (strata ls $T/dcps lists them)\" '$T/o'"
    check "inspect of a DCP directory without .metadata: an incomplete DCP checkpoint, exit 3" bash -c "'$S' inspect '$T/dcps/step-300' >'$T/o' 2>&1; test \$? = 3 && grep -qF \"'$T/dcps/step-300' is an incomplete PyTorch DCP checkpoint: 1 .distcp file, no .metadata (dcp.save writes it last\" '$T/o'"
    check "ls of DCP checkpoints: the one without .metadata listed as incomplete" bash -c "'$S' ls '$T/dcps' >'$T/dcps.ls' && grep -q \"^dcp .* $T/dcps/step-200 (no checksums)\" '$T/dcps.ls' && grep -qF \"incomplete               -              -              -          -  $T/dcps/step-300 (an incomplete PyTorch DCP checkpoint\" '$T/dcps.ls'"
    check "verify of a torch.save file: its zip CRC-32s checked, no strata checksums said, exit 0" bash -c "'$S' verify '$T/model.pt' | grep -q \"^ok: $T/model.pt: 1 tensors in 1 files; every zip entry's CRC-32 matched (torch.save has no strata checksums\""
    check "inspect of a torch.save file: its tensor, no strata checksums" bash -c "'$S' inspect '$T/model.pt' | grep -q \"^torch.save $T/model.pt: 1 tensors, 1 pickle of values, .*NO STRATA CHECKSUMS\" && '$S' inspect --json '$T/model.pt' | grep -q '\"format\":\"torch.save\",\"checksums\":false'"
    "$PY" -W ignore -c "import sys, torch; torch.save({'w': torch.ones(2)}, sys.argv[1], _use_new_zipfile_serialization=False)" "$T/legacy.pt"
    check "inspect of a legacy torch.save file: refused as unsupported, exit 1" bash -c "says 1 \"is in torch.save's legacy format .*(STRATA_ENOTSUP)\" '$S' inspect '$T/legacy.pt'"
else
    echo "skip DCP and torch.save checks: no torch at $PY (make venv)"
fi

echo "cli: $pass passed, $fail failed"
[ "$fail" = 0 ]
