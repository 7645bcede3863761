#!/usr/bin/env bash
# s3_test.sh - the s3:// backend against moto's S3 server on 127.0.0.1 (moto_server from the
# project venv, $VENV; started here and stopped on exit): build/tests/test_s3 (round trips,
# two savers, gc beside saves, killed saves, the fault wrapper, refused credentials), then
# the command on s3:// URIs (demo, inspect, ls, verify, gc, export, copy; virtual-host addressing
# through strata-test.localhost too), an MPI save and resharded
# load, and saves through tests/s3_fault_proxy.py (503s, dropped connections). A second moto runs with
# authentication on (INITIAL_NO_AUTH_ACTION_COUNT=0), so that it refuses every key.
# Skipped (77) without the venv's moto or a build with libcurl.
set -u
cd "$(dirname "$0")/.."
B=${BUILD:-build}
S=${STRATA:-$B/strata}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
if [ ! -x "$VENV/bin/moto_server" ]; then
    echo "s3_test: skipped (no moto_server in $VENV: make venv)"
    exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-s3-XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]+"${pids[@]}"}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
start_moto() { # port [env...]: starts moto_server, waits until it answers
    local port=$1
    shift
    env "$@" "$VENV/bin/moto_server" -H 127.0.0.1 -p "$port" >"$T/moto-$port.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        curl -s -o /dev/null "http://127.0.0.1:$port/moto-api/" && return 0
        sleep 0.1
    done
    echo "moto_server on port $port did not start:"
    cat "$T/moto-$port.log"
    return 1
}

port=$(free_port)
start_moto "$port" || exit 1
denied_port=$(free_port)
start_moto "$denied_port" INITIAL_NO_AUTH_ACTION_COUNT=0 || exit 1
export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_REGION=us-east-1 \
    AWS_ACCESS_KEY_ID=strata-test AWS_SECRET_ACCESS_KEY=strata-test-secret
unset AWS_SESSION_TOKEN AWS_ENDPOINT_URL_S3 AWS_DEFAULT_REGION
curl -s -f -X PUT "$AWS_ENDPOINT_URL/strata-test" >/dev/null || { echo "cannot create the bucket"; exit 1; }

if "$S" inspect s3://strata-test/none 2>&1 | grep -q 'built without libcurl'; then
    echo "s3_test: skipped (this build has no libcurl)"
    exit 77
fi

pass=0 fail=0
check() { # name, then a command that must succeed
    local name=$1
    shift
    if "$@" >"$T/out" 2>&1; then pass=$((pass + 1)); echo "ok   $name"
    else fail=$((fail + 1)); echo "FAIL $name"; sed 's/^/     /' "$T/out" | tail -n 30; fi
}

check "test_s3" env STRATA_TEST_S3=s3://strata-test/c \
    STRATA_TEST_S3_DENIED="http://127.0.0.1:$denied_port" "$B/tests/test_s3"

U=s3://strata-test/cli
check "demo saves to and loads from s3://" bash -c "'$S' demo --size-mb 24 --dir $U/ck1 --step 7 | tail -n 1 | grep -q 'ok=1$'"
check "inspect on s3://" bash -c "'$S' inspect $U/ck1 | grep -q 'committed, step 7'"
check "ls on s3://" bash -c "'$S' ls $U | grep -q 'ck1'"
check "verify on s3://" bash -c "'$S' verify $U/ck1 | grep -q '^ok: '"
check "export from s3://" bash -c "'$S' export $U/ck1 '$T/exp' --quiet && ls '$T/exp' | grep -q safetensors"
# strata copy (issue 30): from s3:// to a path and back to s3://, each copy verifying, the
# progress line on a terminal; onto a committed prefix refused
check "copy from s3:// to a path and back to s3://: both verify, progress shown" bash -c "'$S' copy $U/ck1 '$T/froms3' --quiet && '$S' verify '$T/froms3' && script -qec \"'$S' copy '$T/froms3' $U/ck1back\" /dev/null >'$T/cp.out' && grep -q 'copy: .* / .*/s' '$T/cp.out' && grep -q '^copied .* committed' '$T/cp.out' && '$S' verify $U/ck1back | grep -q '^ok: ' && '$S' inspect $U/ck1back | grep -q 'committed, step 7'"
check "copy onto a committed s3:// prefix: exit 1, STRATA_EEXIST" bash -c "'$S' copy '$T/froms3' $U/ck1back >'$T/o' 2>&1; test \$? = 1 && grep -q '(STRATA_EEXIST)' '$T/o'"
# an incomplete checkpoint (a data object without COMMIT) is listed and collected
curl -s -f -X PUT --data-binary 'x' "$AWS_ENDPOINT_URL/strata-test/cli/half/data-000000.bin" >/dev/null
check "ls shows an incomplete one" bash -c "'$S' ls $U | grep 'half' | grep -qi 'incomplete'"
check "gc on s3:// removes it, keeps ck1" bash -c "'$S' gc $U && ! '$S' ls $U | grep -q half && '$S' verify $U/ck1"
# virtual-host addressing: the bucket in the host name (curl resolves *.localhost to the
# loopback itself; moto takes the bucket from the Host header): every request goes to
# strata-test.localhost, none names the bucket in its path, and the objects land in it
V="env AWS_ENDPOINT_URL=http://localhost:$port STRATA_S3_ADDRESSING=virtual STRATA_S3_DEBUG=1"
check "virtual-host: demo, inspect, verify, gc" bash -c "$V '$S' demo --size-mb 12 --dir $U/vh --step 4 2>'$T/vh.log' | tail -n 1 | grep -q 'ok=1$' && $V '$S' inspect $U/vh 2>>'$T/vh.log' | grep -q 'committed, step 4' && $V '$S' verify $U/vh 2>>'$T/vh.log' | grep -q '^ok: ' && $V '$S' gc $U 2>>'$T/vh.log'"
check "virtual-host: every request to the bucket's host name" bash -c "grep -q '^strata s3: PUT http://strata-test.localhost:$port/cli/vh/COMMIT' '$T/vh.log' && ! grep '^strata s3: ' '$T/vh.log' | grep -v 'http://strata-test.localhost:$port/' | grep -q . && curl -s '$AWS_ENDPOINT_URL/strata-test?list-type=2&prefix=cli/vh/' | grep -q '<Key>cli/vh/COMMIT</Key>'"
if [ -z "${SANITIZED:-}" ] && command -v mpiexec.mpich >/dev/null; then # MPICH is not sanitized
    M="mpiexec.mpich -n 4"
    check "MPI: 4 ranks save to s3://, 3 load resharded" bash -c "$M '$S' demo save --dir $U/mpi --layout tp=2,pp=1,dp=2,zero=1 --size-mb 24 | grep -q '^saved_bytes=.* ok=1' && mpiexec.mpich -n 3 '$S' demo load --dir $U/mpi --layout tp=1,pp=3,dp=1 --size-mb 24 | grep -q '^saved_bytes=.* ok=1'"
fi
# through a proxy that answers 503, drops connections before passing requests on, and
# drops them after (the request took effect, its answer is lost): every save commits and
# loads bitwise, and each kind of fault happened
pport=$(free_port)
"$PY" tests/s3_fault_proxy.py "$pport" "$port" >"$T/proxy.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$pport/strata-test" && break; sleep 0.1; done
for i in 1 2 3; do
    check "demo through injected 503s and dropped connections ($i)" env \
        AWS_ENDPOINT_URL="http://127.0.0.1:$pport" STRATA_S3_PART_MB=5 bash -c \
        "'$S' demo --size-mb 32 --dir $U/faults-$i | tail -n 1 | grep -q 'ok=1$' && '$S' verify $U/faults-$i"
done
check "the proxy injected every kind of fault" bash -c "grep -q '^503 ' '$T/proxy.log' && grep -q '^drop-before ' '$T/proxy.log' && grep -q '^drop-after ' '$T/proxy.log'"
echo "faults injected: $(cut -d' ' -f1 "$T/proxy.log" | sort | uniq -c | tr -s ' \n' ' ')"
check "a missing bucket names it" bash -c "'$S' inspect s3://strata-missing/x 2>&1 | grep -q \"s3://strata-missing: no such bucket\""

echo "s3_test: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
