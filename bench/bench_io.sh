#!/usr/bin/env bash
# bench_io.sh - strata save/load bandwidth against the disk's own, in one run.
# Each round measures the disk with fio (O_DIRECT, sequential 8 MiB blocks, queue depth 4,
# fsync at the end), then runs `strata bench io` (save, empty the page cache, load) on the
# same filesystem. Prints every round, then medians and the ratios of the medians.
# Env: BENCH_DIR (default build/bench), SIZE_MB (default 2048), ROUNDS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
STRATA=${STRATA:-build/strata}
DIR=${BENCH_DIR:-build/bench}
SIZE_MB=${SIZE_MB:-2048}
ROUNDS=${ROUNDS:-3}
mkdir -p "$DIR"
trap 'rm -rf "$DIR/fio.bin" "$DIR"/bench-*' EXIT

drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }

fio_bw() { # rw -> GB/s
    fio --name=disk --filename="$DIR/fio.bin" --rw="$1" --bs=8M --size="${SIZE_MB}M" \
        --direct=1 --ioengine=libaio --iodepth=4 --end_fsync=1 --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k=sys.argv[1]; print("%.3f" % (j[k]["io_bytes"]/(j[k]["runtime"]/1000)/1e9))' "$2"
}

echo "strata bench io: ${SIZE_MB} MiB state, ${ROUNDS} rounds, on $(df -P "$DIR" | awk 'NR==2{print $1" ("$6")"}')"
results=()
for i in $(seq 1 "$ROUNDS"); do
    rm -f "$DIR/fio.bin"
    dw=$(fio_bw write write)
    drop
    dr=$(fio_bw read read)
    rm -f "$DIR/fio.bin"
    line=$("$STRATA" bench io --dir "$DIR" --size-mb "$SIZE_MB" --runs 1 2>/dev/null | tail -n 1)
    sw=$(sed -n 's/.*save_gbps=\([0-9.]*\).*/\1/p' <<<"$line")
    sl=$(sed -n 's/.*load_gbps=\([0-9.]*\).*/\1/p' <<<"$line")
    ok=$(sed -n 's/.*ok=\([01]\).*/\1/p' <<<"$line")
    cache=$(sed -n 's/.*cache=\([a-z_]*\).*/\1/p' <<<"$line")
    printf 'round %d: disk write %s GB/s, disk read %s GB/s | strata save %s GB/s, load %s GB/s (cache: %s, ok=%s)\n' \
        "$i" "$dw" "$dr" "$sw" "$sl" "$cache" "$ok"
    [ "$ok" = 1 ] || { echo "strata bench io failed: $line" >&2; exit 1; }
    results+=("$dw $dr $sw $sl")
done
printf '%s\n' "${results[@]}" | python3 -c '
import sys, statistics as st
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
dw, dr, sw, sl = (st.median(c) for c in zip(*rows))
print("median: disk write %.3f GB/s, disk read %.3f GB/s, strata save %.3f GB/s, strata load %.3f GB/s" % (dw, dr, sw, sl))
print("save_ratio=%.2f load_ratio=%.2f (goal >= 0.80, long-term 0.95)" % (sw / dw, sl / dr))
'
