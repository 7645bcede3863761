#!/usr/bin/env bash
# valgrind.sh - runs each test binary given as an argument under valgrind memcheck
# (make test-valgrind): any memory error, or a definite or indirect leak, fails the test.
# test_property runs fewer random cases (STRATA_PROP_CASES, default here 100) since
# valgrind is slow. Logs go to $BUILD/valgrind/<test>.log; the failing ones are shown.
# Prints "N passed, N failed" (plus ", N skipped" for exit 77) and exits non-zero if
# anything failed.
# Usage: BUILD=build bash tests/valgrind.sh build/tests/test_a build/tests/test_b ...
# Environment: VALGRIND_TIMEOUT (seconds per test, default 600), VALGRIND_OPTS (extra
# valgrind options), STRATA_PROP_CASES.
set -u
BUILD=${BUILD:-build}
VALGRIND_TIMEOUT=${VALGRIND_TIMEOUT:-600}
logdir=$BUILD/valgrind
mkdir -p "$logdir"

if ! command -v valgrind >/dev/null; then
    echo "valgrind.sh: valgrind is not installed"
    exit 2
fi

passed=0 failed=0 skipped=0
failures=()
total_start=$(date +%s%N)

for t in "$@"; do
    name=$(basename "$t")
    log=$logdir/$name.log
    echo "=== valgrind $t"
    start=$(date +%s%N)
    # shellcheck disable=SC2086
    STRATA_PROP_CASES=${STRATA_PROP_CASES:-100} timeout "$VALGRIND_TIMEOUT" \
        valgrind --tool=memcheck --leak-check=full --show-leak-kinds=definite,indirect \
        --errors-for-leak-kinds=definite,indirect --error-exitcode=99 \
        --child-silent-after-fork=yes --num-callers=30 --log-file="$log" \
        ${VALGRIND_OPTS:-} "$t" >"$log.out" 2>&1
    rc=$?
    end=$(date +%s%N)
    secs=$(awk -v ns=$((end - start)) 'BEGIN { printf "%.1f", ns / 1e9 }')
    summary=$(grep -m1 'ERROR SUMMARY' "$log" | sed 's/^==[0-9]*== //')
    echo "=== valgrind $t: exit $rc ($secs s) ${summary:-no valgrind summary}"
    case $rc in
    0) passed=$((passed + 1)) ;;
    77) skipped=$((skipped + 1)) ;;
    *)
        failed=$((failed + 1))
        case $rc in
        99) why="memory errors or leaks" ;;
        124) why="timed out after ${VALGRIND_TIMEOUT}s" ;;
        *) why="exit $rc" ;;
        esac
        failures+=("$t ($why; log: $log)")
        echo "--- test output (last 20 lines):"
        tail -20 "$log.out"
        echo "--- valgrind report (first 80 lines after the header):"
        grep -v -E '^==[0-9]+== (Memcheck|Copyright|Using Valgrind|Command|Parent PID)' "$log" |
            sed -n 1,80p
        ;;
    esac
done

for f in "${failures[@]+"${failures[@]}"}"; do
    echo "FAILED: $f"
done
total_end=$(date +%s%N)
summary="$passed passed, $failed failed"
[ "$skipped" -gt 0 ] && summary="$summary, $skipped skipped"
echo "$summary ($(awk -v ns=$((total_end - total_start)) 'BEGIN { printf "%.0f", ns / 1e9 }') s under valgrind)"
[ "$failed" -eq 0 ]
