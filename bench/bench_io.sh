#!/usr/bin/env bash
# bench_io.sh - strata save/load bandwidth against the disk's own, in one run.
# Each round runs `strata bench io` (which measures the disk the way strata uses it - O_DIRECT
# through strata's I/O buffers, as `strata bench disk` - then saves, empties the page cache
# and loads, on the same filesystem), then fio (O_DIRECT, sequential 8 MiB blocks, queue
# depth 4, fsync at the end, its own buffers of 4 KiB pages) for reference. Prints every
# round, then medians and the ratios of the medians against the disk as strata uses it.
# Env: BENCH_DIR (default build/bench), SIZE_MB (default 2048), ROUNDS (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-build/strata}
DIR=${BENCH_DIR:-build/bench}
SIZE_MB=${SIZE_MB:-2048}
ROUNDS=${ROUNDS:-5}
mkdir -p "$DIR"
trap 'rm -rf "$DIR/fio.bin" "$DIR"/bench-*' EXIT

drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }

fio_bw() { # rw -> GB/s
    fio --name=disk --filename="$DIR/fio.bin" --rw="$1" --bs=8M --size="${SIZE_MB}M" \
        --direct=1 --ioengine=libaio --iodepth=4 --end_fsync=1 --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k=sys.argv[1]; print("%.3f" % (j[k]["io_bytes"]/(j[k]["runtime"]/1000)/1e9))' "$2"
}

val() { sed -n "s/.*[ ^]$1=\\([0-9.]*\\).*/\\1/p" <<<"$2" | head -n 1; }

echo "strata bench io: ${SIZE_MB} MiB state, ${ROUNDS} rounds, on $(df -P "$DIR" | awk 'NR==2{print $1" ("$6")"}'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
results=()
for i in $(seq 1 "$ROUNDS"); do
    out=$("$STRATA" bench io --dir "$DIR" --size-mb "$SIZE_MB" --runs 1 2>/dev/null)
    disk=$(grep ' buffers=strata ' <<<"$out")
    run=$(grep ' save_s=' <<<"$out")
    dw=$(val write_gbps "$disk") dr=$(val read_gbps "$disk")
    sw=$(val save_gbps "$run") sl=$(val load_gbps "$run") req=$(val load_req_kib "$run")
    ok=$(val ok "$run")
    pages=$(sed -n 's/.*pages="\([^"]*\)".*/\1/p' <<<"$disk")
    rm -f "$DIR/fio.bin"
    fw=$(fio_bw write write)
    drop
    fr=$(fio_bw read read)
    rm -f "$DIR/fio.bin"
    printf 'round %d: disk (strata'"'"'s buffers: %s) write %s GB/s, read %s GB/s | strata save %s GB/s, load %s GB/s (%s KiB per device request), ok=%s | fio write %s, read %s GB/s | load average %s\n' \
        "$i" "$pages" "$dw" "$dr" "$sw" "$sl" "$req" "$ok" "$fw" "$fr" "$(cut -d' ' -f1 /proc/loadavg)"
    [ "$ok" = 1 ] || { echo "strata bench io failed: $out" >&2; exit 1; }
    results+=("$dw $dr $sw $sl $fw $fr")
done
printf '%s\n' "${results[@]}" | python3 -c '
import sys, statistics as st
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
dw, dr, sw, sl, fw, fr = (st.median(c) for c in zip(*rows))
print("median: disk (strata buffers) write %.3f GB/s, read %.3f GB/s; strata save %.3f GB/s, load %.3f GB/s; fio write %.3f, read %.3f GB/s" % (dw, dr, sw, sl, fw, fr))
print("save_ratio=%.2f load_ratio=%.2f (of the disk through strata'"'"'s buffers; goal >= 0.95)" % (sw / dw, sl / dr))
'
