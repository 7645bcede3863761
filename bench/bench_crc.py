"""make bench-crc: what checking a foreign format's zip CRC-32s costs a cold load (issue 28).

    BENCH_CRC_GB (default 1)      state in GiB, float32, 8 tensors of odd sizes
    BENCH_CRC_ROUNDS (default 5)  rounds; medians are reported
    BENCH_DIR (build/bench-crc)   where the checkpoints go (the disk under test)
    BENCH_CRC_WARM=1              the files in the page cache instead, read without O_DIRECT
                                  (what the check costs the CPU alone)

Writes a DCP checkpoint (dcp.save, one process) and a torch.save file of the same state, then
each round loads each of them with strata.torch.load cold (page cache dropped, a child
process per load) into zeroed tensors, checked (the default: each zip entry read whole and
its CRC-32 compared) and skip_crc=True, the two in alternating order; and a row block (the
first half of every tensor's rows, as one rank of a Shard(0) reshard needs), where the check
reads the other half too. Reported per case: the median load time, its stats (bytes,
crc_bytes, crc_checked) and the device's reads during the load (/proc/diskstats: sectors and
requests: bytes per request), the child's CPU time (its whole process: torch's import
included), and the load average. The last line holds the ratios
(checked / skipped, medians)."""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diskstats import counters, device  # noqa: E402

GIB = float(os.environ.get("BENCH_CRC_GB", "1"))
ROUNDS = int(os.environ.get("BENCH_CRC_ROUNDS", "5"))
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-crc"))
NT, COLS = 8, 1000


def shapes():
    rows = int(GIB * (1 << 30) / 4 / COLS / NT)
    return [(rows + 7 * i, COLS) for i in range(NT)]


def state():
    g = torch.Generator().manual_seed(28)
    return {"layer%d.weight" % i: torch.randn(s, generator=g) for i, s in enumerate(shapes())}


CHILD = r"""
import json, sys, time, torch, strata.torch as st
path, skip, half = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
direct = sys.argv[5] == "0"   # warm: buffered reads, from the page cache
shapes = json.loads(sys.argv[4])
if half:   # the first half of each tensor's rows: a DTensor rank's block, in plain tensors
    import strata
    s = strata.State()
    keep = []
    for i, (r, c) in enumerate(shapes):
        t = torch.zeros(r // 2, c)
        keep.append(t)
        s.add_shard("layer%d.weight" % i, "f32", [r, c], [0, 0], [r // 2, c],
                    data_ptr=t.data_ptr(), nbytes=t.numel() * 4, keep=t)
    t0 = time.perf_counter()
    stats = strata.load([path], [s], skip_crc=skip, direct=direct)
else:
    sd = {"layer%d.weight" % i: torch.zeros(r, c) for i, (r, c) in enumerate(shapes)}
    t0 = time.perf_counter()
    stats = st.load(sd, path, skip_crc=skip, direct=direct)
t = time.perf_counter() - t0
print(json.dumps({"seconds": t, "bytes": stats["bytes"], "crc_bytes": stats["crc_bytes"],
                  "crc_checked": stats["crc_checked"], "crc_skipped": stats["crc_skipped"]}))
"""


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def one(path, skip, half, dev, warm):
    if warm:   # the file in the page cache: what the check costs the CPU alone
        subprocess.run(["cat", path] if os.path.isfile(path) else
                       ["sh", "-c", "cat '%s'/* > /dev/null" % path], check=True,
                       stdout=subprocess.DEVNULL)
    else:
        drop_caches()
    r0 = counters(dev)[:2]
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", CHILD, path, "1" if skip else "0",
                          "1" if half else "0", json.dumps(shapes()), "1" if warm else "0"],
                         check=True,
                         capture_output=True, text=True).stdout
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r1 = counters(dev)[:2]
    res = json.loads(out.strip().splitlines()[-1])
    res["requests"] = r1[0] - r0[0]
    res["disk_bytes"] = (r1[1] - r0[1]) * 512
    res["cpu"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return res


def main():
    os.makedirs(BENCH_DIR, exist_ok=True)
    dcp_dir, pt = os.path.join(BENCH_DIR, "dcp"), os.path.join(BENCH_DIR, "model.pt")
    if not os.path.exists(pt):
        import torch.distributed.checkpoint as dcp
        sd = state()
        torch.save(sd, pt)
        dcp.save(sd, checkpoint_id=dcp_dir)
        del sd
    dev = device(BENCH_DIR)
    warm = os.environ.get("BENCH_CRC_WARM") == "1"
    cases = [("dcp", dcp_dir, False), ("torch.save", pt, False), ("torch.save half rows", pt, True)]
    res = {(c, skip): [] for c, _, _ in cases for skip in (False, True)}
    loads = []
    for rnd in range(ROUNDS):
        for name, path, half in cases:
            order = (False, True) if rnd % 2 == 0 else (True, False)
            for skip in order:
                r = one(path, skip, half, dev, warm)
                res[(name, skip)].append(r)
                print("round %d %-22s %-8s %.3f s  bytes %d crc_bytes %d checked %d  disk %d B "
                      "in %d requests" % (rnd, name, "skip" if skip else "checked", r["seconds"],
                                         r["bytes"], r["crc_bytes"], r["crc_checked"],
                                         r["disk_bytes"], r["requests"]), flush=True)
        loads.append(os.getloadavg()[0])
    print("\n%.2f GiB, %d rounds, %s, load average %.2f-%.2f (1 min, after each round)"
          % (GIB, ROUNDS, "warm (page cache)" if warm else "cold", min(loads), max(loads)))
    ratios = []
    for name, _, _ in cases:
        med = {}
        for skip in (False, True):
            rs = res[(name, skip)]
            med[skip] = statistics.median(r["seconds"] for r in rs)
            req = statistics.median(r["requests"] for r in rs)
            db = statistics.median(r["disk_bytes"] for r in rs)
            cpu = statistics.median(r["cpu"] for r in rs)
            print("%-22s %-8s median %.3f s (%s)  cpu %.2f s  disk %.0f MiB, %.0f KiB per "
                  "request, crc_bytes %d, crc_checked %d" % (
                      name, "skip" if skip else "checked", med[skip],
                      " ".join("%.3f" % r["seconds"] for r in rs), cpu, db / 2 ** 20,
                      db / max(req, 1) / 1024, rs[0]["crc_bytes"], rs[0]["crc_checked"]))
        ratios.append("%s=%.3f" % (name.replace(" ", "_").replace(".", ""),
                                   med[False] / med[True]))
    print("checked/skipped: " + " ".join(ratios))


if __name__ == "__main__":
    t0 = time.time()
    main()
    print("(%.0f s)" % (time.time() - t0))
