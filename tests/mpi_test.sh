#!/usr/bin/env bash
# mpi_test.sh - strata under MPI (MPICH, oversubscribed on this machine's cores): save on 4
# processes, load on 3, 2 and 1; a matrix of layout pairs; read-once byte counts; the plan
# cache; a rank killed during a save; incremental saves (tests/mpi_incr.c); the stored plan
# across restarts (tests/mpi_plan.c). Prints one line
# per check and a summary.
set -u
cd "$(dirname "$0")/.."
S=${STRATA:-${BUILD:-build}/strata}
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-mpi-XXXXXX")
trap 'rm -rf "$T"' EXIT
MPIEXEC="timeout 300 mpiexec.mpich"
pass=0 fail=0
check() {
    local name=$1; shift
    if "$@" >"$T/out" 2>&1; then pass=$((pass + 1)); echo "ok   $name"
    else fail=$((fail + 1)); echo "FAIL $name"; sed 's/^/     /' "$T/out" | tail -n 20; fi
}
last_ok() { grep -q '^saved_bytes=.* ok=1$' "$T/run"; }
save() { $MPIEXEC -n "$1" "$S" demo save --dir "$2" --layout "$3" --size-mb "${4:-12}" >"$T/run" 2>&1 && cat "$T/run" && last_ok; }
load() { $MPIEXEC -n "$1" "$S" demo load --dir "$2" --layout "$3" --size-mb "${4:-12}" >"$T/run" 2>&1 && cat "$T/run" && last_ok; }

check "save on 4 processes as tp=2,dp=2,zero=1" save 4 "$T/a" tp=2,pp=1,dp=2,zero=1
check "load on 3 processes as tp=1,dp=3" load 3 "$T/a" tp=1,pp=1,dp=3
saved=$(sed -n 's/^saved_bytes=\([0-9]*\).*/\1/p' "$T/run")
read=$(sed -n 's/.*read_bytes=\([0-9]*\).*/\1/p' "$T/run")
check "dp=3 load reads each saved byte once (read_bytes $read = data bytes $saved)" test "$read" = "$saved" -a -n "$saved"
check "load on 2 processes as pp=2" load 2 "$T/a" tp=1,pp=2,dp=1
check "load on 1 process" load 1 "$T/a" tp=1,pp=1,dp=1
check "verify the MPI-saved checkpoint" "$S" verify "$T/a"
# a layout for another number of processes: exit 2, the numbers said (issue 30)
check "demo load on 3 processes of a 4-rank layout: says 3 and 4, exit 2" bash -c "$MPIEXEC -n 3 '$S' demo load --dir '$T/a' --layout tp=2,pp=1,dp=2 >'$T/ws' 2>&1; test \$? = 2 && grep -qxF 'strata demo: 3 processes; the layout tp=2,pp=1,dp=2 needs 4 (tp*pp*dp: one rank each): run it with mpiexec -n 4' '$T/ws'"

# ranks of one load with settings of their own in the environment (MPMD: ranks 1 and 2 only):
# every rank takes rank 0's I/O threads and loads bitwise (each used its own: a kill at the
# time limit, or wrong bytes); ranks 1 and 2 pretending to be nodes of their own (then rank
# 0 on its real node and each of them on its own: bytes sent between them) load bitwise too
mixed() { # NAME VALUE: the variable ranks 1 and 2 have
    $MPIEXEC -n 1 "$S" demo load --dir "$T/a" --layout tp=1,pp=1,dp=3 --size-mb 12 : \
        -n 2 -env "$1" "$2" "$S" demo load --dir "$T/a" --layout tp=1,pp=1,dp=3 --size-mb 12 \
        >"$T/run" 2>&1 && cat "$T/run" && last_ok
}
for v in "STRATA_IO_THREADS 1" "STRATA_IO_THREADS 9" "STRATA_LOAD_NODES 3"; do
    check "load on 3 processes, $v on ranks 1 and 2 only" bash -c "$(declare -f mixed last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; mixed $v"
done

# a matrix of save/load layout pairs
i=0
for pair in "4 tp=4,pp=1,dp=1 2 tp=1,pp=1,dp=2,zero=1" "2 tp=1,pp=2,dp=1 4 tp=2,pp=2,dp=1" \
            "3 tp=3,pp=1,dp=1,zero=1 2 tp=2,pp=1,dp=1" "4 tp=1,pp=2,dp=2,zero=1 3 tp=3,pp=1,dp=1" \
            "1 tp=1,pp=1,dp=1 4 tp=2,pp=1,dp=2,zero=1" "4 tp=2,pp=2,dp=1 4 tp=1,pp=1,dp=4,zero=1"; do
    set -- $pair
    i=$((i + 1))
    check "matrix: $2 on $1 -> $4 on $3" bash -c "$(declare -f save load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; save $1 '$T/m$i' $2 && load $3 '$T/m$i' $4"
done

# the plan cache: the same layout twice is a hit; another layout is a miss
check "plan cache: built, then cached" bash -c "$MPIEXEC -n 4 '$S' demo save --dir '$T/c' --layout tp=2,pp=1,dp=2 --size-mb 6 --repeat 2 | tee /dev/stderr | grep -q 'save 1: .* plan built' && $MPIEXEC -n 4 '$S' demo save --dir '$T/c2' --layout tp=2,pp=1,dp=2 --size-mb 6 --repeat 2 | grep -q 'save 2: .* plan cached'"

# the asynchronous distributed save: three saves (plan built, then cached), each loaded
# on 3 processes and checked bitwise
async_saves() {
    $MPIEXEC -n 4 "$S" demo save --async --dir "$T/as" --layout tp=2,pp=1,dp=2,zero=1 --size-mb 12 \
        --repeat 3 --pool-mb 8 >"$T/run" 2>&1; cat "$T/run"; last_ok || return 1
    grep -q 'save 1: .* plan built' "$T/run" && grep -q 'save 3: .* plan cached' "$T/run" &&
        grep -q 'async: started in' "$T/run" || return 1
    for d in "$T/as" "$T/as.2" "$T/as.3"; do load 3 "$d" tp=1,pp=1,dp=3 || return 1; done
}
check "async save on 4 processes (pool of 8 MiB per rank: 2 chunks), plan cached, loads on 3" \
    bash -c "$(declare -f async_saves load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; async_saves"

# background commits (the saver's commit thread, on a duplicate communicator: MPICH gives
# MPI_THREAD_MULTIPLE): every rank SIGKILLed as soon as strata_handle_done says the save is
# over, with no strata_wait_durable anywhere: the checkpoint is committed and loads
# bitwise on 3 processes. Without MPI_THREAD_MULTIPLE the commit stays in
# strata_wait_durable, and the demo says why.
killed_when_done() { # (each rank leaves a file once done: a dying job's output may be cut)
    mkdir -p "$T/kdflags"
    STRATA_DEMO_DONE_DIR="$T/kdflags" $MPIEXEC -disable-auto-cleanup -n 4 "$S" demo save --async \
        --die-when-done --dir "$T/kd" --layout tp=2,pp=1,dp=2,zero=1 --size-mb 12 --pool-mb 8 \
        >"$T/kd.out" 2>&1
    grep -v '^\[\(proxy\|mpiexec\)' "$T/kd.out" | grep -v '^$'
    ls "$T/kdflags"
    [ "$(ls "$T/kdflags" | grep -c '^done-[0-3]$')" = 4 ] &&
        "$S" ls "$T" | grep -q "^committed .* $T/kd\$" && load 3 "$T/kd" tp=1,pp=1,dp=3
}
check "async save: all 4 ranks killed once done, no wait: committed, loads on 3" \
    bash -c "$(declare -f killed_when_done load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; killed_when_done"
funneled() {
    STRATA_DEMO_MPI_FUNNELED=1 $MPIEXEC -n 2 "$S" demo save --async --dir "$T/fu" --layout tp=2,pp=1,dp=1 \
        --size-mb 6 --pool-mb 8 >"$T/run" 2>&1; cat "$T/run"; last_ok &&
        grep -q 'in strata_wait_durable: .*MPI_THREAD_FUNNELED, not MPI_THREAD_MULTIPLE' "$T/run" &&
        load 2 "$T/fu" tp=1,pp=1,dp=2 6
}
check "async save under MPI_THREAD_FUNNELED: commits in strata_wait_durable, says why, loads" \
    bash -c "$(declare -f funneled load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; funneled"

# two tiers: shared memory (mem://, under $T/shm) and disk; both load on 3 processes
tiers() {
    export STRATA_MEM_ROOT="$T/shm"
    $MPIEXEC -n 4 "$S" demo save --async --dir mem://tc --also "$T/tc" --layout tp=2,pp=1,dp=2,zero=1 \
        --size-mb 12 --pool-mb 8 >"$T/run" 2>&1; cat "$T/run"; last_ok || return 1
    load 3 mem://tc tp=1,pp=1,dp=3 && load 3 "$T/tc" tp=1,pp=1,dp=3
}
check "async save to two tiers (mem:// and disk) on 4 processes, each loads on 3" \
    bash -c "$(declare -f tiers load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; tiers"

# a rank killed during a save: no hang (every process ends within the time limit and a
# bound), the new checkpoint is either committed and verifies (the kill came after the
# commit) or not committed, the old checkpoint is intact, gc cleans up
killed() { # rank, ms, dir[, --async: the commit runs on the savers' commit threads]
    local t0=$SECONDS
    STRATA_DEMO_DIE_RANK=$1 STRATA_DEMO_DIE_MS=$2 $MPIEXEC -disable-auto-cleanup -n 4 "$S" demo save \
        ${4:-} --dir "$3" --layout tp=2,pp=1,dp=2,zero=1 --size-mb 24 --timeout-ms 3000 >"$T/kill.out" 2>&1
    local st=$? took=$((SECONDS - t0))
    grep -v '^\[\(proxy\|mpiexec\)' "$T/kill.out"
    echo "exit $st after ${took}s"
    [ "$took" -lt 60 ] || return 1
    local state; state=$("$S" ls "$T" | awk -v d="$3" '$NF == d {print $1}')
    echo "state of the new checkpoint: ${state:-absent}"
    case "$state" in
    committed) "$S" verify "$3" || return 1 ;;
    CORRUPT) return 1 ;;
    *) [ "$st" != 0 ] || return 1 ;;
    esac
    "$S" verify "$T/a" && "$S" gc "$T" >/dev/null && ! "$S" ls "$T" | grep -q '^incomplete'
}
# a rank that stops answering (SIGSTOP as its save begins): the others give up with
# STRATA_EABORTED at the 3 s time limit instead of waiting forever
stopped() {
    local t0=$SECONDS
    : >"$T/stop.out" # there before the loop below reads it (the job opens it in the background)
    STRATA_DEMO_STOP=1 STRATA_DEMO_DIE_RANK=3 STRATA_DEMO_DIE_MS=-1 mpiexec.mpich -disable-auto-cleanup -n 4 \
        "$S" demo save --dir "$T/st" --layout tp=2,pp=1,dp=2,zero=1 --size-mb 6 --timeout-ms 3000 >"$T/stop.out" 2>&1 &
    local pid=$!
    while [ $((SECONDS - t0)) -lt 30 ] && [ "$(grep -c STRATA_EABORTED "$T/stop.out")" -lt 3 ]; do sleep 0.2; done
    local took=$((SECONDS - t0))
    pkill -9 -f "demo save --dir $T/st" 2>/dev/null; wait "$pid" 2>/dev/null
    grep -v '^\[\(proxy\|mpiexec\)' "$T/stop.out"
    echo "3 ranks reported STRATA_EABORTED after ${took}s"
    [ "$(grep -c STRATA_EABORTED "$T/stop.out")" -ge 3 ] && [ "$took" -lt 30 ] && "$S" verify "$T/a" >/dev/null
}
check "a rank that stops answering: the other 3 return STRATA_EABORTED within the time limit" \
    bash -c "$(declare -f stopped); S='$S' T='$T'; stopped"
for k in 1 2 3 4 5 6 7 8 9; do
    r=$((RANDOM % 4)) ms=$((RANDOM % 100)) mode=
    [ "$k" -gt 6 ] && mode=--async
    check "rank $r killed ${ms} ms into a ${mode:+background-committed }save: no hang, old checkpoint intact, nothing half-committed" \
        bash -c "$(declare -f killed); MPIEXEC='$MPIEXEC' S='$S' T='$T'; killed $r $ms '$T/k$k' $mode"
done

# one owner per directory: two MPI jobs (2 processes each, models of different sizes) save
# to one path at once, sync and async; exactly one commits and loads as its own model, the
# other fails with STRATA_EBUSY or STRATA_EEXIST. STRATA_MPI_OWN_TRIALS (make stress: 40).
two_jobs() {
    local i n=${STRATA_MPI_OWN_TRIALS:-4} refused=0
    for i in $(seq 1 "$n"); do
        local d="$T/race$i" mode="" e1 e2 win size
        [ $((i % 2)) = 0 ] && mode=--async
        $MPIEXEC -n 2 "$S" demo save $mode --dir "$d" --layout tp=2,pp=1,dp=1 --size-mb 6 >"$T/r1" 2>&1 &
        local p1=$!
        $MPIEXEC -n 2 "$S" demo save $mode --dir "$d" --layout tp=1,pp=1,dp=2 --size-mb 8 >"$T/r2" 2>&1 &
        local p2=$!
        wait $p1; e1=$?; wait $p2; e2=$?
        if [ $e1 = 0 ] && [ $e2 != 0 ]; then win=1 size=6
        elif [ $e2 = 0 ] && [ $e1 != 0 ]; then win=2 size=8
        else echo "trial $i: exits $e1 and $e2, want exactly one 0"; cat "$T/r1" "$T/r2"; return 1; fi
        grep -q 'STRATA_EBUSY\|STRATA_EEXIST' "$T/r$((3 - win))" ||
            { echo "trial $i: the loser's message:"; cat "$T/r$((3 - win))"; return 1; }
        refused=$((refused + 1))
        "$S" verify "$d" >/dev/null || { echo "trial $i: $d does not verify"; return 1; }
        load 2 "$d" tp=1,pp=1,dp=2 "$size" >/dev/null || { echo "trial $i: no load"; return 1; }
    done
    echo "two MPI jobs on one path: $n trials, $n committed, $refused refused, 0 losses"
}
check "two MPI jobs saving to one path: one commits and loads, the other is refused" \
    bash -c "$(declare -f two_jobs load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; two_jobs"

# a collector beside MPI saves: `strata gc` (incomplete checkpoints no live save owns) loops
# while 2 processes save 6 steps, sync then async; every save that returned loads
beside_gc() {
    local mode
    for mode in "" --async; do
        mkdir -p "$T/g$mode"
        ( while :; do "$S" gc "$T/g$mode" >/dev/null 2>&1; done ) &
        local gc=$!
        $MPIEXEC -n 2 "$S" demo save $mode --dir "$T/g$mode/s" --layout tp=2,pp=1,dp=1 --size-mb 6 \
            --repeat 6 >"$T/run" 2>&1
        local e=$?
        kill $gc; wait $gc 2>/dev/null
        cat "$T/run"; [ $e = 0 ] && last_ok || return 1
        for d in "$T/g$mode/s" "$T/g$mode"/s.*; do
            load 2 "$d" tp=1,pp=1,dp=2 6 >/dev/null || { echo "$d does not load"; return 1; }
        done
    done
}
check "strata gc looping beside MPI saves (sync, async): every save loads" \
    bash -c "$(declare -f beside_gc load last_ok); MPIEXEC='$MPIEXEC' S='$S' T='$T'; beside_gc"

# incremental saves on 2 and 3 processes (tests/mpi_incr.c: each rank links its own base
# file, writes only its adapters, every step loads bitwise on every rank and on one, bases
# removed by retention, a rank that cannot link writes in full)
MI=${BUILD:-build}/tests/mpi_incr
for n in 2 3; do
    if [ -x "$MI" ]; then
        mkdir -p "$T/incr$n"
        check "incremental saves on $n processes (tests/mpi_incr.c)" \
            bash -c "$MPIEXEC -n $n '$MI' '$T/incr$n'"
    else
        fail=$((fail + 1)); echo "FAIL $MI is not built (make $MI)"
    fi
done

# the save plan stored with a checkpoint, across restarts on 8 processes (tests/mpi_plan.c,
# three jobs: the collectives counted through the communicator by wrapping MPI's): a job
# restarted with the same layout reuses it and makes no planning collective; one whose
# rank 1 changed its layout plans afresh; each loads bitwise
MP=${BUILD:-build}/tests/mpi_plan
if [ -x "$MP" ]; then
    mkdir -p "$T/plan"
    for phase in first restart changed; do
        check "stored plan on 8 processes: $phase (tests/mpi_plan.c)" \
            bash -c "$MPIEXEC -n 8 '$MP' $phase '$T/plan'"
    done
else
    fail=$((fail + 1)); echo "FAIL $MP is not built (make $MP)"
fi

echo "mpi: $pass passed, $fail failed"
[ "$fail" = 0 ]
