#!/usr/bin/env bash
# nocurl_test.sh - libstrata built without libcurl (make CURL=0: $BUILD/nocurl/strata, which
# `make test` builds) refuses an s3:// URI with STRATA_ENOTSUP and a message saying why and
# what to install; the command's other backends still work there.
set -u
cd "$(dirname "$0")/.."
S=${BUILD:-build}/nocurl/strata
if [ ! -x "$S" ]; then
    echo "nocurl_test: skipped (no $S: make test builds it)"
    exit 77
fi
T=$(mktemp -d "${TMPDIR:-/tmp}/strata-nocurl-XXXXXX")
trap 'rm -rf "$T"' EXIT
fail=0
check() { # name, then a command that must succeed
    if bash -c "$2" >"$T/out" 2>&1; then echo "ok   $1"
    else fail=1; echo "FAIL $1"; sed 's/^/     /' "$T/out"; fi
}
# the AWS variables are set, so that only the missing libcurl can be the reason
export AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=y AWS_ENDPOINT_URL=http://127.0.0.1:9
for cmd in "inspect s3://bucket/ck" "ls s3://bucket" "gc s3://bucket" "verify s3://bucket/ck"; do
    check "$cmd: STRATA_ENOTSUP, built without libcurl" \
        "! '$S' $cmd 2>'$T/err' && grep -q \"'s3://bucket[^']*': this libstrata was built without libcurl, which s3:// needs: install libcurl4-openssl-dev\" '$T/err' && grep -q '(STRATA_ENOTSUP)' '$T/err'"
done
check "the command has no libcurl" "! ldd '$S' | grep -q libcurl"
check "demo on disk still works" "'$S' demo --size-mb 4 --dir '$T/ck' | tail -n 1 | grep -q 'ok=1\$'"
exit $fail
