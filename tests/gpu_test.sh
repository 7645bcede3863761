#!/usr/bin/env bash
# gpu_test.sh - the device tests on a machine with a GPU (make test-gpu): each C test binary
# given as an argument against the real CUDA runtime, then the package built for $PYTHON
# (its torch with CUDA) into $BUILD/site and tests/python/test_torch_cuda.py (marker gpu).
# STRATA_TEST_GPU=1 is set for all of them: a test that finds no usable device fails
# instead of skipping. Prints "N passed, N failed" like run.sh; exits non-zero if anything
# failed.
# Usage: BUILD=build/gpu PYTHON=python3 bash tests/gpu_test.sh build/gpu/tests/test_cuda ...
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
BUILD=${BUILD:-build/gpu}
PYTHON=${PYTHON:-python3}
export STRATA_TEST_GPU=1
RUNNER_SKIP_FAILS=1 # a skipped test is a device not found: a failure here
. "$here/runner.sh"

# The CUDA runtime for the C tests: $STRATA_CUDART, else the first found of the loader's
# cache, the CUDA toolkit's, and the one torch's wheels carry (nvidia/*/lib).
find_cudart() {
    ldconfig -p 2>/dev/null | awk '/libcudart\.so/ { print $NF }'
    ls /usr/local/cuda/lib64/libcudart.so* /usr/local/cuda/targets/*/lib/libcudart.so* \
        2>/dev/null
    "$PYTHON" -c 'import glob, os, nvidia
for p in nvidia.__path__:
    print("\n".join(sorted(glob.glob(os.path.join(p, "*", "lib", "libcudart.so*")))))' \
        2>/dev/null
}
if [ -z "${STRATA_CUDART:-}" ]; then
    STRATA_CUDART=$(find_cudart | grep -v '^$' | head -n 1)
fi
if [ -z "$STRATA_CUDART" ]; then
    echo "gpu_test.sh: no CUDA runtime (libcudart) found; set STRATA_CUDART" >&2
    exit 1
fi
echo "gpu_test.sh: CUDA runtime $STRATA_CUDART"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader

for t in "$@"; do
    run_one "$t" env STRATA_CUDART="$STRATA_CUDART" "$t"
done

# The package for $PYTHON (no build isolation: setuptools and wheel of that python), then
# the torch tests with CUDA tensors. strata finds the runtime torch loaded by itself there.
mkdir -p "$BUILD/site"
site=$(cd "$BUILD/site" && pwd)
echo "=== pip install --target $site ($("$PYTHON" -c 'import sys, torch
print("python %d.%d, torch %s, CUDA %s" % (sys.version_info[0], sys.version_info[1],
      torch.__version__, torch.version.cuda))'))"
(cd "$root" && "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-compile \
    --upgrade --target "$site" .)
rc=$?
if [ "$rc" = 0 ]; then
    run_one "tests/python/test_torch_cuda.py (pytest -m gpu)" env \
        PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
        "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu -rs "$here/python/test_torch_cuda.py"
else
    failed=$((failed + 1))
    failures+=("pip install --target $site (exit $rc)")
fi

runner_summary
