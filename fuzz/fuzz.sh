#!/usr/bin/env bash
# fuzz.sh - builds the libFuzzer targets of fuzz/ into build/fuzz/ and runs each for
# ${FUZZ_SECONDS:-60} seconds. `make fuzz` calls it. The targets: fuzz_meta (metadata
# decoder), fuzz_commit (commit record), fuzz_uri (URI resolution), fuzz_layout (the CLI's
# layout parser), fuzz_safetensors (the safetensors header parser, src/source/safetensors.c),
# fuzz_pickle, fuzz_zip, fuzz_dcp (the DCP .metadata interpreter, src/source/dcp.c),
# fuzz_megatron (metadata.json and mcore_data, src/source/megatron.c), fuzz_peer (the peer
# replica record, src/meta/peer_rec.c), fuzz_planfile (the stored save plan, plan.bin,
# src/meta/planfile.c).
#
# Build: the library sources (src/core, io, meta, plan, comm without its MPI backend, source,
# engine) are compiled with clang, coverage instrumentation and ASan + UBSan into
# build/fuzz/libstrata_fuzz.a (objects are rebuilt when their source or any header is
# newer); each target fuzz/fuzz_<name>.c links against it (fuzz_layout also compiles
# src/cli/synth.c).
#
# Run: each target fuzzes a scratch copy of fuzz/corpus/<target>/ (seeds, the reproducers of
# fixed crashes, and coverage found by earlier runs); at the end the scratch corpus is merged
# back with -merge=1, so only inputs that add coverage are kept. Crash, leak, timeout and
# OOM inputs land in build/fuzz/artifacts/<target>/. Per target it prints the executions
# (libFuzzer's stat::number_of_executed_units), the time, and whether it crashed.
#
# Environment:
#   FUZZ_SECONDS=60     seconds per target (-max_total_time)
#   FUZZ_TARGETS="..."  targets to run (default: every fuzz/fuzz_*.c)
#   FUZZ_JOBS=1         targets run at once (2 on a two-core machine at most)
#   FUZZ_TIMEOUT=10     seconds one input may take before it counts as a hang
#   FUZZ_MAX_LEN=8192   largest input tried (longer corpus files are cut for fuzzing; the
#                       replay test still runs them whole)
#   FUZZ_NO_MERGE=1     do not merge new coverage back into fuzz/corpus
#   FUZZ_MINIMIZE=1     only minimize fuzz/corpus/* (seed-* and repro-* files are kept, the
#                       others only if they add coverage to those: -merge=1), then exit
#   FUZZ_BUILD_ONLY=1   build the targets and exit
#   CC_FUZZ=clang       compiler
#   FUZZ_OUT=build/fuzz where the objects, targets, logs and artifacts go
# Exits non-zero if a build failed or any target crashed, leaked or hung.
set -u
cd "$(dirname "$0")/.." || exit 2

SECONDS_PER=${FUZZ_SECONDS:-60}
JOBS=${FUZZ_JOBS:-1}
CC_FUZZ=${CC_FUZZ:-clang}
OUT=${FUZZ_OUT:-build/fuzz}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
CFLAGS="-O1 -g -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -Iinclude -Isrc $SAN"
LIBS="-lxxhash -lz -lpthread -lm"

if [ -n "${FUZZ_TARGETS:-}" ]; then
    read -r -a targets <<<"$FUZZ_TARGETS"
else
    targets=()
    for f in fuzz/fuzz_*.c; do
        t=${f#fuzz/}
        targets+=("${t%.c}")
    done
fi

# ---- build ----

build() {
    mkdir -p "$OUT/obj"
    # the newest header: objects older than it are rebuilt
    local newest_h
    newest_h=$(ls -t include/*.h src/*/*.h 2>/dev/null | head -1)
    local stale=() objs=()
    for s in src/core/*.c src/io/*.c src/meta/*.c src/plan/*.c src/comm/*.c src/source/*.c src/engine/*.c; do
        case $s in *_mpi.c) continue ;; esac # no MPI in the fuzzers (nothing they link uses it)
        local o="$OUT/obj/${s%.c}.o"
        objs+=("$o")
        if [ ! -f "$o" ] || [ "$s" -nt "$o" ] || { [ -n "$newest_h" ] && [ "$newest_h" -nt "$o" ]; }; then
            mkdir -p "$(dirname "$o")"
            stale+=("$s")
        fi
    done
    if [ ${#stale[@]} -gt 0 ]; then
        echo "fuzz: compiling ${#stale[@]} library sources with $CC_FUZZ (ASan, UBSan, coverage)"
        printf '%s\n' "${stale[@]}" |
            xargs -P 2 -I{} sh -c '$0 $1 -fsanitize=fuzzer-no-link -c "$2" -o "$3/obj/${2%.c}.o"' \
                "$CC_FUZZ" "$CFLAGS" {} "$OUT" || return 1
        rm -f "$OUT/libstrata_fuzz.a"
    fi
    if [ ! -f "$OUT/libstrata_fuzz.a" ]; then
        ar rcs "$OUT/libstrata_fuzz.a" "${objs[@]}" || return 1
    fi
    for t in "${targets[@]}"; do
        local extra=""
        [ "$t" = fuzz_layout ] && extra=src/cli/synth.c
        echo "fuzz: building $OUT/$t"
        # shellcheck disable=SC2086
        $CC_FUZZ $CFLAGS -fsanitize=fuzzer -o "$OUT/$t" "fuzz/$t.c" $extra \
            "$OUT/libstrata_fuzz.a" $LIBS || return 1
    done
}

if ! build; then
    echo "fuzz: BUILD FAILED"
    exit 2
fi
[ -n "${FUZZ_BUILD_ONLY:-}" ] && exit 0

# ---- minimize ----

if [ -n "${FUZZ_MINIMIZE:-}" ]; then
    for t in "${targets[@]}"; do
        c=fuzz/corpus/$t
        tmp=$(mktemp -d "${TMPDIR:-/tmp}/strata-fuzzmin-XXXXXX")
        before=$(ls "$c" | wc -l)
        # seeds and reproducers stay (under their names); the rest is merged over them
        for f in "$c"/seed-* "$c"/repro-*; do [ -f "$f" ] && cp "$f" "$tmp/"; done
        "$OUT/$t" -merge=1 "$tmp" "$c" >"$OUT/minimize-$t.log" 2>&1 ||
            { cat "$OUT/minimize-$t.log"; rm -rf "$tmp"; exit 1; }
        rm -f "$c"/*
        cp "$tmp"/* "$c"/
        rm -rf "$tmp"
        echo "fuzz: $t: $before files -> $(ls "$c" | wc -l) (seed-* and repro-* kept), $(du -sb "$c" | cut -f1) bytes"
    done
    exit 0
fi

# ---- run ----

run_target() { # target: writes $OUT/work/<t>/{log,result}
    local t=$1 w=$OUT/work/$1 c=fuzz/corpus/$1
    rm -rf "$w" "$OUT/artifacts/$t"
    mkdir -p "$w/corpus" "$OUT/artifacts/$t" "$c"
    cp "$c"/. "$w/corpus/" -r 2>/dev/null
    local dict=()
    [ -f "fuzz/$t.dict" ] && dict=("-dict=fuzz/$t.dict")
    local start end rc
    start=$(date +%s)
    "$OUT/$t" -max_total_time="$SECONDS_PER" -print_final_stats=1 \
        -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=2048 -max_len="${FUZZ_MAX_LEN:-8192}" \
        -artifact_prefix="$OUT/artifacts/$t/" "${dict[@]}" "$w/corpus" >"$w/log" 2>&1
    rc=$?
    end=$(date +%s)
    local execs
    execs=$(awk '/stat::number_of_executed_units/ { n = $NF } END { print n + 0 }' "$w/log")
    local found
    found=$(ls "$OUT/artifacts/$t" 2>/dev/null | tr '\n' ' ')
    local merged=0
    if [ -z "${FUZZ_NO_MERGE:-}" ]; then
        local n0
        n0=$(ls "$c" | wc -l)
        "$OUT/$t" -merge=1 "$c" "$w/corpus" >"$w/merge.log" 2>&1 ||
            echo "fuzz: $t: merge failed (see $w/merge.log)" >>"$w/log"
        merged=$(($(ls "$c" | wc -l) - n0))
    fi
    local verdict=ok
    if [ $rc -ne 0 ] || [ -n "$found" ]; then
        verdict="CRASHED (exit $rc): $found"
    fi
    printf '%s: %s execs in %ss (%s exec/s), %s new corpus files, %s\n' "$t" "$execs" \
        $((end - start)) $((execs / (end - start > 0 ? end - start : 1))) "$merged" "$verdict" \
        >"$w/result"
    [ "$verdict" = ok ]
}

rm -rf "$OUT/work"
mkdir -p "$OUT/work"
echo "fuzz: ${#targets[@]} targets x ${SECONDS_PER}s, $JOBS at a time"
pids=()
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
        wait -n
    done
    echo "fuzz: running $t (log: $OUT/work/$t/log)"
    run_target "$t" &
    pids+=($!)
done
for p in "${pids[@]}"; do
    wait "$p"
done

failed=0
echo "==== fuzz summary (${SECONDS_PER}s per target)"
for t in "${targets[@]}"; do
    if [ -f "$OUT/work/$t/result" ]; then
        cat "$OUT/work/$t/result"
        grep -q CRASHED "$OUT/work/$t/result" && {
            failed=$((failed + 1))
            grep -m 5 -E 'ERROR|SUMMARY|fuzz_[a-z]+:' "$OUT/work/$t/log" | sed 's/^/    /'
        }
    else
        echo "$t: no result"
        failed=$((failed + 1))
    fi
done
echo "corpus: $(du -sb fuzz/corpus | cut -f1) bytes in $(find fuzz/corpus -type f | wc -l) files"
[ $failed -eq 0 ] || { echo "fuzz: $failed target(s) crashed"; exit 1; }
