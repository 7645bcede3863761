# runner.sh - sourced by run.sh and gpu_test.sh: run_one runs a test command under a timeout
# and counts it (exit 0 passed, 77 skipped, anything else failed; with RUNNER_SKIP_FAILS=1 a
# skip counts as a failure too); runner_summary prints the failures and "N passed, N failed"
# (", N skipped" when any) and returns non-zero if anything failed.
# The limit (TEST_TIMEOUT, seconds) guards against a hang; the Python suite alone takes several
# minutes on 2 loaded cores, so it is 20 minutes per suite, well inside CI's 90.
TEST_TIMEOUT=${TEST_TIMEOUT:-1200}
passed=0 failed=0 skipped=0
failures=()

run_one() { # name, command...
    local name=$1 rc start end
    shift
    echo "=== $name"
    start=$(date +%s%N)
    timeout "$TEST_TIMEOUT" "$@"
    rc=$?
    end=$(date +%s%N)
    echo "=== $name: exit $rc ($(awk -v ns=$((end - start)) 'BEGIN { printf "%.1f", ns / 1e9 }') s)"
    [ "$rc" = 77 ] && [ -n "${RUNNER_SKIP_FAILS:-}" ] && rc=1
    case $rc in
    0) passed=$((passed + 1)) ;;
    77) skipped=$((skipped + 1)) ;;
    *)
        failed=$((failed + 1))
        [ "$rc" = 124 ] && failures+=("$name (timed out after ${TEST_TIMEOUT}s)") ||
            failures+=("$name (exit $rc)")
        ;;
    esac
}

runner_summary() {
    local f summary
    for f in "${failures[@]+"${failures[@]}"}"; do
        echo "FAILED: $f"
    done
    summary="$passed passed, $failed failed"
    [ "$skipped" -gt 0 ] && summary="$summary, $skipped skipped"
    echo "$summary"
    [ "$failed" -eq 0 ]
}
