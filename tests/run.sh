#!/usr/bin/env bash
# run.sh - runs each test binary given as an argument as its own process (under a
# timeout), then tests/cli_test.sh, install_test.sh, kill_test.sh, kill_export_test.sh,
# s3_test.sh (moto from $VENV; skipped without it), nocurl_test.sh (the CURL=0 build) (and, outside the sanitizers, mpi_test.sh, readme_test.sh and the Python tests in $VENV when it exists), and prints
# "N passed, N failed" (plus ", N skipped" when a test exits with 77). Exits non-zero if
# anything failed.
# Usage: bash tests/run.sh build/tests/test_a build/tests/test_b ...
set -u
# MPICH is linked into the `strata` command (its MPI demo) and the install test's MPI
# program; its UCX layer (libucm) interposes madvise, which glibc calls when a thread exits,
# and under ThreadSanitizer that hook crashes the process (SIGSEGV in
# __tsan::MutexPreReadLock from ucm_event_enter). Single-process runs need no UCX memory
# events.
export UCX_MEM_EVENTS=${UCX_MEM_EVENTS:-no}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/runner.sh"

for t in "$@"; do
    run_one "$t" "$t"
done
# the device paths once more against the fake CUDA runtime: with one device, and none
fake=${BUILD:-build}/tests/libfakecudart.so
if [ -f "$fake" ] && [ -f "${BUILD:-build}/tests/test_cuda" ]; then
    run_one "test_cuda (fake runtime)" env STRATA_CUDART="$fake" "${BUILD:-build}/tests/test_cuda"
    run_one "test_cuda (fake runtime, no device)" env STRATA_CUDART="$fake" FAKE_CUDA_DEVICES=0 \
        "${BUILD:-build}/tests/test_cuda"
fi
# the distributed loads once more through each way ranks get their bytes: each rank reading
# what it needs on its node (the default above: the threads of one process share a node),
# every byte another rank reads sent through the communicator (a pretend node per rank), and
# both (two pretend nodes)
for t in "$@"; do
    case "$t" in
    */test_dist | */test_stload | */test_loader | */test_incr)
        run_one "$(basename "$t") (a node per rank)" env STRATA_LOAD_NODES=64 "$t"
        run_one "$(basename "$t") (two nodes)" env STRATA_LOAD_NODES=2 "$t"
        ;;
    esac
done
# the MPI tests run in the plain build only: MPICH itself is not built with the sanitizers
mpi=mpi_test.sh
[ -n "${SANITIZED:-}" ] && mpi=
for script in cycles_test.sh cli_test.sh install_test.sh kill_test.sh kill_export_test.sh $mpi \
    s3_test.sh nocurl_test.sh; do
    if [ -f "$here/$script" ]; then
        run_one "tests/$script" bash "$here/$script"
    fi
done
run_one "tests/kill_test.sh (async)" env STRATA_KILL_MODE=async \
    STRATA_KILL_TRIALS="${STRATA_KILL_ASYNC_TRIALS:-6}" bash "$here/kill_test.sh"
if [ -n "$mpi" ]; then # the kill test on multi-process saves, a few trials
    run_one "tests/kill_test.sh (mpi)" env STRATA_KILL_MODE=mpi \
        STRATA_KILL_TRIALS="${STRATA_KILL_MPI_TRIALS:-6}" bash "$here/kill_test.sh"
    run_one "tests/kill_test.sh (mpi, async)" env STRATA_KILL_MODE=mpiasync STRATA_KILL_SIZE_MB=24 \
        STRATA_KILL_TRIALS="${STRATA_KILL_MPI_TRIALS:-6}" bash "$here/kill_test.sh"
fi

# DeepSpeed JIT-builds an op into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions):
# one per venv, so that the venvs of two clones (other include paths, so another build) do not
# rebuild each other's op, or wait forever on a lock a killed build left there
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ] && [ -d "${VENV:-.venv}" ]; then
    TORCH_EXTENSIONS_DIR="$(cd "${VENV:-.venv}" && pwd)/torch_extensions"
    export TORCH_EXTENSIONS_DIR
fi

# the README's examples, in order, twice: plain build only (MPICH, and the venv's pip-built
# extension, are not built with the sanitizers); `make test` makes the venv, so the Python
# examples must run
if [ -z "${SANITIZED:-}" ]; then
    run_one "tests/readme_test.sh" env STRATA_README_NEED_VENV=1 VENV="${VENV:-.venv}" \
        bash "$here/readme_test.sh"
fi

# the Python package (strata, strata.torch) in the project venv: plain build only (the
# extension is built by pip, not with the sanitizers)
venv=${VENV:-.venv}
if [ -z "${SANITIZED:-}" ] && [ -x "$venv/bin/python" ]; then
    run_one "tests/python (pytest)" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
        "$here/python"
fi

runner_summary
