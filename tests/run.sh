#!/usr/bin/env bash
# run.sh - runs each test binary given as an argument as its own process (under a
# timeout), then tests/cli_test.sh if present, and prints "N passed, N failed" (plus
# ", N skipped" when a test exits with 77). Exits non-zero if anything failed.
# Usage: bash tests/run.sh build/tests/test_a build/tests/test_b ...
set -u
here=$(cd "$(dirname "$0")" && pwd)
TEST_TIMEOUT=${TEST_TIMEOUT:-600}
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

for t in "$@"; do
    run_one "$t" "$t"
done
if [ -f "$here/cli_test.sh" ]; then
    run_one tests/cli_test.sh bash "$here/cli_test.sh"
fi

for f in "${failures[@]+"${failures[@]}"}"; do
    echo "FAILED: $f"
done
summary="$passed passed, $failed failed"
[ "$skipped" -gt 0 ] && summary="$summary, $skipped skipped"
echo "$summary"
[ "$failed" -eq 0 ]
