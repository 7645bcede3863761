#!/usr/bin/env bash
# kill_test.sh - crash safety under SIGKILL. Starts saving jobs and kills each at a random
# moment of its save (after it prints "saving to": 0-80 ms later, or up to 1.5 times the
# duration of an uninterrupted save where that is longer, as under the sanitizers), several
# checkpoints in one parent directory, some trials reusing the name of an earlier
# incomplete checkpoint. Then checks that
#   - `strata ls` shows every checkpoint as committed or incomplete, never CORRUPT;
#   - every committed one passes `strata verify`, `strata inspect --json` describes it, and
#     its data files and metadata are byte for byte those of an uninterrupted save of the
#     same state (the base below, which `strata demo` loaded and checked bitwise: the
#     demo's state and plan are deterministic, so equal files mean a bitwise equal load);
#   - a save under the name of an incomplete checkpoint replaces it;
#   - `strata gc` removes the incomplete ones and nothing else;
#   - the base, committed before all trials, still verifies and is unchanged.
# Prints "kill trials: N, committed: C, incomplete: I, losses: L" and exits 1 on any loss.
#
# Environment:
#   STRATA_KILL_TRIALS     trials (default 12)
#   STRATA_KILL_SIZE_MB    size of the saved state (default 48; 8 for a sanitizer build)
#   STRATA_KILL_WINDOW_MS  kill delays are drawn from [0, this) (default as above)
#   STRATA_KILL_ROUND      trials per round: the parent directory is checked and emptied
#                          after each, which bounds the disk used (default 25)
#   STRATA_KILL_SEED       seeds $RANDOM (printed, to repeat a run)
#   STRATA_KILL_VERBOSE=1  a line per trial
#   STRATA_KILL_MODE       single: `strata demo` saves the ranks of one process (default);
#                          async: single, through strata_save_start (a saver with a pool);
#                          mpi: 4 MPI processes save, SIGKILL hits one random rank or
#                          the whole job; mpiasync: mpi, through strata_save_start on a
#                          saver with a communicator.
#                          A mode is the mode_<name>_* functions and
#                          MODE_<name>_* patterns below.
set -u
cd "$(dirname "$0")/.."
S=${STRATA:-${BUILD:-build}/strata}
TRIALS=${STRATA_KILL_TRIALS:-12}
SIZE=${STRATA_KILL_SIZE_MB:-48}
# sanitizer builds run the demo about 10 times slower: a smaller state keeps make test-tsan
# and test-asan short (the kill window follows the measured save time either way)
if [ -z "${STRATA_KILL_SIZE_MB:-}" ] && ldd "$S" 2>/dev/null | grep -q 'lib[at]san'; then
    SIZE=8
fi
ROUND=${STRATA_KILL_ROUND:-25}
MODE=${STRATA_KILL_MODE:-single}
SEED=${STRATA_KILL_SEED:-$$}
RANDOM=$SEED
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-kill-XXXXXX")
trap 'rm -rf "$T"' EXIT

losses=0 committed=0 incomplete=0 empty=0 trials=0
loss() {
    losses=$((losses + 1))
    echo "LOSS: $*"
}
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }

# ---- modes: how a saving job is started and killed ------------------------------------
# mode_X_launch DIR OUT ERR: starts a job in the background that saves the test state to
#   DIR (the same state every time), then loads it back and checks it; stdout to OUT,
#   stderr to ERR. Sets JOB_PID.
# MODE_X_START, MODE_X_DONE: regexps of the ERR lines that say the save starts / is done.
# mode_X_ok OUT: the finished job loaded the checkpoint and found every byte right.
# mode_X_kill: SIGKILLs every process of the job and reaps it; sets JOB_STATUS (137 if
#   killed, else the job's own exit status: it finished or failed before the signal).

mode_single_launch() {
    "$S" demo --size-mb "$SIZE" --dir "$1" >"$2" 2>"$3" &
    JOB_PID=$!
}
MODE_single_START='^saving to'
MODE_single_DONE='^loading into'
mode_single_ok() { tail -n 1 "$1" | grep -q 'ok=1$'; }
mode_single_kill() {
    kill -9 "$JOB_PID" 2>/dev/null
    wait "$JOB_PID" 2>/dev/null
    JOB_STATUS=$?
}

# async: the single-process demo saving with strata_save_start (kills land in the
# snapshot or in the flush behind it)
mode_async_launch() {
    "$S" demo --async --size-mb "$SIZE" --dir "$1" >"$2" 2>"$3" &
    JOB_PID=$!
}
MODE_async_START='^saving to'
MODE_async_DONE='^loading into'
mode_async_ok() { mode_single_ok "$@"; }
mode_async_kill() { mode_single_kill; }

# mpi: `mpiexec -n 4 strata demo save` (tp=2,dp=2,zero=1), then a load on 3 processes
# that checks every byte. The kill hits either one random rank of the save (the others
# stop at the 3 s time limit, or MPICH ends them) or the whole job.
mode_mpi_launch() {
    setsid bash -c "mpiexec.mpich -disable-auto-cleanup -n 4 '$S' demo save ${MPI_ASYNC:-}--dir '$1' \
        --layout tp=2,pp=1,dp=2,zero=1 --size-mb $SIZE --timeout-ms 3000 &&
        mpiexec.mpich -n 3 '$S' demo load --dir '$1' --layout tp=1,pp=1,dp=3 --size-mb $SIZE" \
        >"$2" 2>"$3" &
    JOB_PID=$!
    JOB_DIR=$1
}
MODE_mpi_START='^saving to'
MODE_mpi_DONE='^saved'
mode_mpi_ok() { tail -n 1 "$1" | grep -q 'read_bytes=[1-9].* ok=1$'; }
mode_mpi_kill() {
    local pids
    if [ $((RANDOM % 2)) = 0 ]; then # the whole job
        kill -9 -- -"$JOB_PID" 2>/dev/null
    else # one random rank of the save
        pids=($(pgrep -f "demo save ${MPI_ASYNC:-}--dir $JOB_DIR " || true))
        [ ${#pids[@]} -gt 0 ] && kill -9 "${pids[$((RANDOM % ${#pids[@]}))]}" 2>/dev/null
    fi
    wait "$JOB_PID" 2>/dev/null
    JOB_STATUS=$?
    pkill -9 -f "demo (save|load) ${MPI_ASYNC:-}--dir $JOB_DIR " 2>/dev/null
    pkill -9 -f "demo (save|load) --dir $JOB_DIR " 2>/dev/null
    [ "$JOB_STATUS" = 0 ] || JOB_STATUS=137 # any end after a kill is the kill's doing
}
# mpiasync: mpi, saving with strata_save_start on a saver with a communicator (--async,
# a pool of 8 MiB per rank)
MPI_ASYNC=
if [ "$MODE" = mpiasync ]; then
    MPI_ASYNC="--async --pool-mb 8 "
    MODE=mpi
fi

if ! declare -F "mode_${MODE}_launch" >/dev/null; then
    echo "kill_test.sh: unknown STRATA_KILL_MODE '$MODE'" >&2
    exit 2
fi
start_re=MODE_${MODE}_START done_re=MODE_${MODE}_DONE
START_RE=${!start_re} DONE_RE=${!done_re}
launch() { "mode_${MODE}_launch" "$@"; }
job_ok() { "mode_${MODE}_ok" "$@"; }
kill_job() { "mode_${MODE}_kill"; }

# full_save DIR: an uninterrupted save (and bitwise check) to DIR; sets SAVE_MS to the
# time from the start marker to the done marker. Non-zero status on failure.
full_save() {
    local t0=0 t1=0
    launch "$1" "$T/full.out" "$T/full.err"
    while kill -0 "$JOB_PID" 2>/dev/null; do
        [ "$t0" = 0 ] && grep -q "$START_RE" "$T/full.err" 2>/dev/null && t0=$(now_ms)
        [ "$t1" = 0 ] && grep -q "$DONE_RE" "$T/full.err" 2>/dev/null && t1=$(now_ms)
        sleep 0.002
    done
    wait "$JOB_PID" || { sed 's/^/     /' "$T/full.err" | tail -n 5; return 1; }
    SAVE_MS=$((t1 > t0 ? t1 - t0 : 0))
    job_ok "$T/full.out"
}

# ---- checks ---------------------------------------------------------------------------

# state DIR: committed, incomplete (strata files, no commit record), CORRUPT, or none (no
# strata file: killed before the save created any, or no directory at all).
state() {
    [ -d "$1" ] || {
        echo none
        return
    }
    "$S" ls "$1" | awk -v d="$1" '$NF == d && $1 ~ /^(committed|incomplete|CORRUPT)$/ { print $1; found = 1 }
        END { if (!found) print "none" }'
}

# same_as_ref DIR: the checkpoint's files (all but the commit record, which holds a time,
# and a distributed save's plan.bin, which names the commit's save id) are the reference's,
# byte for byte, and there are no others.
same_as_ref() {
    local d=$1 f
    # (LOCK too: a save killed after its commit, before it removed its lock file, leaves it)
    if [ "$(cd "$d" && ls | grep -v '^\(COMMIT\|LOCK\)$')" != "$(cd "$T/ref" && ls | grep -v '^\(COMMIT\|LOCK\)$')" ]; then
        echo "$d: files differ from the reference: $(cd "$d" && ls | xargs)"
        return 1
    fi
    for f in "$T/ref"/*; do
        case ${f##*/} in COMMIT | plan.bin) continue ;; esac
        cmp -s "$f" "$d/${f##*/}" || {
            echo "$d/${f##*/} differs from the reference"
            return 1
        }
    done
}

# check_committed DIR: verify, inspect --json, bitwise equal to the reference.
check_committed() {
    local d=$1 out
    out=$("$S" verify "$d" 2>&1) || {
        echo "$out"
        return 1
    }
    "$S" inspect "$d" --json | python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["committed"] and j["tensors"] and j["files"], "inspect --json: not a committed checkpoint with tensors"
assert sum(f["bytes"] for f in j["files"]) >= j["data_bytes"] > 0, "inspect --json: sizes"
' || return 1
    same_as_ref "$d"
}

# ---- the base: committed before all trials, also the reference ------------------------

P="$T/ckpts"
mkdir -p "$P"
if ! full_save "$P/base"; then
    echo "kill_test.sh: the uninterrupted save of the base failed" >&2
    exit 1
fi
cp -a "$P/base" "$T/ref"
WINDOW=${STRATA_KILL_WINDOW_MS:-$((SAVE_MS * 3 / 2 > 80 ? SAVE_MS * 3 / 2 : 80))}
echo "kill test: mode $MODE${MPI_ASYNC:+ (async)}, $TRIALS trials, state $SIZE MiB, a save takes ~$SAVE_MS ms, kills 0-$WINDOW ms into it, seed $SEED"
check_committed "$P/base" || loss "base checkpoint does not check out before the trials"

# ---- trials, in rounds of $ROUND in one parent directory ------------------------------

check_round() { # after a round: ls, verify, replace one incomplete, gc, empty the directory
    local listing d st
    listing=$("$S" ls "$P") || {
        loss "strata ls $P failed"
        return
    }
    if echo "$listing" | grep -q '^CORRUPT'; then
        loss "ls shows corrupt checkpoints:"
        echo "$listing" | grep '^CORRUPT'
    fi
    for d in $(echo "$listing" | awk '$1 == "committed" { print $NF }'); do
        check_committed "$d" || loss "committed checkpoint $d does not check out"
    done
    # an uninterrupted save under the name of an incomplete checkpoint replaces it
    d=$(echo "$listing" | awk '$1 == "incomplete" { print $NF; exit }')
    if [ -n "$d" ]; then
        if full_save "$d" && [ "$(state "$d")" = committed ] && check_committed "$d"; then
            echo "  a save over incomplete ${d##*/} replaced it"
        else
            loss "a save over incomplete $d did not replace it"
        fi
    fi
    "$S" gc "$P" >/dev/null || loss "strata gc $P failed"
    listing=$("$S" ls "$P")
    if echo "$listing" | grep -qv '^committed\|^state'; then
        loss "after gc, not only committed checkpoints are left:"
        echo "$listing"
    fi
    [ "$(state "$P/base")" = committed ] || loss "gc or a trial touched the base checkpoint"
    for d in "$P"/k*; do # empty the directory for the next round; the base stays
        [ -e "$d" ] || continue
        st=$(state "$d")
        case $st in
        committed) rm -rf "$d" ;;
        none) rmdir "$d" 2>/dev/null || loss "$d: not a checkpoint but not empty: $(ls -A "$d" | xargs)" ;;
        *) loss "$d is still $st after gc" ;;
        esac
    done
}

declare -a pending=() # incomplete checkpoints of this round: names to reuse
start=$(date +%s)
for i in $(seq 1 "$TRIALS"); do
    name=k$i
    if [ ${#pending[@]} -gt 0 ] && [ $((RANDOM % 3)) = 0 ]; then
        j=$((RANDOM % ${#pending[@]}))
        name=${pending[$j]}
        pending=("${pending[@]:0:j}" "${pending[@]:j+1}")
    fi
    d="$P/$name"
    rm -f "$T/job.err"
    launch "$d" /dev/null "$T/job.err"
    until grep -q "$START_RE" "$T/job.err" 2>/dev/null || ! kill -0 "$JOB_PID" 2>/dev/null; do
        sleep 0.002
    done
    ms=$(((RANDOM * 32768 + RANDOM) % WINDOW))
    sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
    kill_job
    trials=$((trials + 1))
    if [ "$JOB_STATUS" != 137 ] && [ "$JOB_STATUS" != 0 ]; then
        loss "trial $i ($name): the job failed by itself (exit $JOB_STATUS):"
        sed 's/^/     /' "$T/job.err" | tail -n 5
    fi
    st=$(state "$d")
    case $st in
    committed) committed=$((committed + 1)) ;;
    incomplete | none)
        incomplete=$((incomplete + 1))
        [ "$st" = none ] && empty=$((empty + 1))
        pending+=("$name")
        ;;
    *) loss "trial $i ($name): the checkpoint is $st right after the kill" ;;
    esac
    [ -n "${STRATA_KILL_VERBOSE:-}" ] && echo "  trial $i: $name killed $ms ms into its save: $st"
    if [ $((i % ROUND)) = 0 ] || [ "$i" = "$TRIALS" ]; then
        check_round
        pending=()
    fi
done

check_committed "$P/base" || loss "the base checkpoint does not check out after the trials"
cmp -s "$P/base/COMMIT" "$T/ref/COMMIT" || loss "the base's commit record changed"

echo "trials took $(($(date +%s) - start)) s; incomplete ones killed before any file was written: $empty"
echo "kill trials: $trials, committed: $committed, incomplete: $incomplete, losses: $losses"
[ "$losses" = 0 ]
