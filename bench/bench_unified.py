"""make bench-unified (also run by make bench-torch): strata reading a checkpoint that
PyTorch DCP wrote, beside DCP reading its own (issue 19's figures).

    BENCH_UNIFIED_GB (default 2)   state in GiB, float32, saved by dcp.save on 4 gloo processes
    BENCH_UNIFIED_ROUNDS (5)       rounds; medians are reported
    BENCH_DIR (build/bench-unified) where the checkpoints go (the disk under test)
    BENCH_UNIFIED_OUT (bench/results) where unified.md goes

Each round: the disk is measured the way strata uses it (`strata bench disk`: O_DIRECT
through strata's I/O buffers, the reference of the "of disk" column; and through 4 KiB-page
buffers) and by fio (its own buffers), then every load below runs cold (page cache dropped)
into zeroed targets, the two systems in alternating order:
  - 4 -> 4, 4 -> 3 (FSDP-style Shard(0) DTensors on 4 or 3 gloo processes) and 4 -> 1 (plain
    tensors in one process): dcp.load and strata.torch.load of the same DCP directory, every
    rank's data checked bitwise against the values written;
  - export to safetensors: `strata export` against dcp_to_torch_save followed by
    safetensors' save_file (time and peak RSS of each, as a child process).
It also counts how often strata read and broadcast the checkpoint's index per load, and
read it per export (the goal: once each), the bytes each rank read from storage
(/proc/self/io) and the average device request during each load (/proc/diskstats: every
process's reads then). Writes BENCH_UNIFIED_OUT/unified.md; the last line holds the ratios
(strata / DCP, medians): load_4to4= load_4to3= load_4to1= read_rate_of_disk=
export_time= export_peak_rss_mib=.
"""

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402  (before any fork: torch_dist forks ranks from this process)
import torch_dist  # noqa: E402
import torch_systems as ts  # noqa: E402

PY = sys.executable
GIB = float(os.environ.get("BENCH_UNIFIED_GB", "2"))
ROUNDS = int(os.environ.get("BENCH_UNIFIED_ROUNDS", "5"))
OUT_DIR = os.environ.get("BENCH_UNIFIED_OUT", os.path.join(HERE, "results"))
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-unified"))
STRATA = os.environ.get("STRATA_CLI", os.path.join(os.path.dirname(HERE), "build", "strata"))
NT = 8      # tensors
COLS = 1000  # odd sizes: rows do not divide evenly by 3 or 4


def log(*a):
    print(*a, flush=True)


def shapes():
    rows = int(GIB * (1 << 30) / 4 / COLS / NT)
    return [(rows + 7 * i, COLS) for i in range(NT)]


def values(i, shape, r0, r1):
    """Rows [r0, r1) of tensor i: a fixed function of the element index."""
    idx = torch.arange(r0 * shape[1], r1 * shape[1], dtype=torch.int64)
    v = (idx * 2654435761 + i * 97) % 16777213
    return v.to(torch.float32).reshape(r1 - r0, shape[1])


def state(nprocs, fill):
    """{"model": {"w<i>": tensor}}: Shard(0) DTensors on nprocs ranks (plain tensors for 1),
    filled with the written values (fill) or zeros."""
    import torch.distributed as dist
    sd = {}
    mesh = None
    if nprocs > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (nprocs,))
    for i, shape in enumerate(shapes()):
        if mesh is None:
            t = values(i, shape, 0, shape[0]) if fill else torch.zeros(shape)
        else:
            from torch.distributed.tensor import DTensor, Shard
            r = dist.get_rank()
            per = -(-shape[0] // nprocs)
            r0, r1 = min(r * per, shape[0]), min((r + 1) * per, shape[0])
            local = values(i, shape, r0, r1) if fill else torch.zeros((r1 - r0, shape[1]))
            t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                   stride=(shape[1], 1))
        sd["w%d" % i] = t
    return {"model": sd}


def check(sd):
    """Every local value equals what was written (bitwise); raises otherwise."""
    import torch.distributed as dist
    for i, shape in enumerate(shapes()):
        t = sd["model"]["w%d" % i]
        local = ts.local_of(t)
        if local.shape[0] == 0:
            continue
        if local is t:
            r0 = 0
        else:
            per = -(-shape[0] // dist.get_world_size())
            r0 = dist.get_rank() * per
        want = values(i, shape, r0, r0 + local.shape[0])
        if not torch.equal(local.view(torch.int32), want.view(torch.int32)):
            raise AssertionError("w%d differs after the load" % i)


def job_save(path):
    import torch.distributed.checkpoint as dcp
    dcp.save(state(4, True), checkpoint_id=path)
    return 0


def job_load(system, path, nprocs):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import strata.torch as st
    sd = state(nprocs, False)
    ts.trim()

    def barrier():
        if dist.is_initialized():
            dist.barrier()
    barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        ts.drop_caches()
    barrier()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    rb0 = ts.read_bytes()
    c0 = ts.disk_counters(path) if rank0 else None
    stats = {}
    t0 = time.perf_counter()
    if system == "dcp":
        dcp.load(sd, checkpoint_id=path)
    else:
        stats = st.load(sd, path)
    barrier()
    t = time.perf_counter() - t0
    req = ts.request_kib(c0, ts.disk_counters(path)) if rank0 else None
    read = ts.read_bytes() - rb0
    check(sd)
    return {"s": t, "read": read, "meta_reads": stats.get("meta_reads"),
            "meta_bcasts": stats.get("meta_bcasts"), "req": req}


def timed_child(cmd):
    """Runs cmd under GNU time; (seconds, peak RSS in MiB of the command). Not the child's
    ru_maxrss: a child forked from this process (torch loaded) keeps its parent's peak
    across exec, so the command runs from /usr/bin/time, a small process."""
    out = os.path.join(BENCH_DIR, "time.out")
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", out] + cmd, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    t = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), p.stderr[-3000:]))
    with open(out) as f:
        kib = int(f.read().split()[-1])
    os.unlink(out)
    return t, kib / 1024.0


DCP_EXPORT = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, tmp, out = sys.argv[1:4]
dcp_to_torch_save(src, tmp)
sd = torch.load(tmp, weights_only=True)["model"]
save_file(sd, out)
"""


def fio_read_gbps(size_mb):
    path = os.path.join(BENCH_DIR, "fio.bin")
    base = ["fio", "--name=disk", "--filename=" + path, "--bs=8M", "--size=%dM" % size_mb,
            "--direct=1", "--ioengine=libaio", "--iodepth=4", "--output-format=json"]
    subprocess.run(base + ["--rw=write", "--end_fsync=1"], check=True, capture_output=True)
    ts.drop_caches()
    j = json.loads(subprocess.run(base + ["--rw=read"], check=True, capture_output=True,
                                  text=True).stdout)
    os.unlink(path)
    job = j["jobs"][0]["read"]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9


def main():
    os.makedirs(BENCH_DIR, exist_ok=True)
    ck = os.path.join(BENCH_DIR, "dcp")
    shutil.rmtree(ck, ignore_errors=True)
    nbytes = sum(r * c * 4 for r, c in shapes())
    log("bench-unified: a %.2f GiB DCP checkpoint (%d float32 tensors, Shard(0) on 4 gloo "
        "processes), %d rounds, in %s (page cache drop: %s)"
        % (nbytes / (1 << 30), NT, ROUNDS, BENCH_DIR, "permitted" if ts.drop_caches()
           else "NOT permitted"))
    t0 = time.perf_counter()
    torch_dist.run_job(job_save, 4, ck)
    log("dcp.save on 4 processes: %.1f s" % (time.perf_counter() - t0))
    res = {}
    pages = "?"
    for rnd in range(ROUNDS):
        d = ts.strata_disk(BENCH_DIR, int(nbytes / (1 << 20)))
        pages = d["strata"]["pages"]
        res.setdefault("disk", []).append(d["strata"]["read_gbps"])
        res.setdefault("disk_req", []).append(d["strata"]["read_req_kib"])
        res.setdefault("disk4k", []).append(d["4k"]["read_gbps"])
        fio = fio_read_gbps(int(nbytes / (1 << 20)))
        res.setdefault("fio", []).append(fio)
        log("[round %d] disk cold read through strata's buffers (%s) %.3f GB/s at %.0f KiB per "
            "request; through 4 KiB pages %.3f GB/s at %.0f KiB; fio %.3f GB/s"
            % (rnd + 1, pages, d["strata"]["read_gbps"], d["strata"]["read_req_kib"],
               d["4k"]["read_gbps"], d["4k"]["read_req_kib"], fio))
        systems = ["dcp", "strata"] if rnd % 2 == 0 else ["strata", "dcp"]
        for n in (4, 3, 1):
            for system in systems:
                got = torch_dist.run_job(job_load, n, system, ck, n)
                s = max(g["s"] for g in got)
                read = sum(g["read"] for g in got)
                res.setdefault((system, n), []).append(s)
                res.setdefault(("read", system, n), []).append([g["read"] for g in got])
                if got[0]["req"]:
                    res.setdefault(("req", system, n), []).append(got[0]["req"])
                if system == "strata":  # the index: read once (rank 0), broadcast once
                    res[("opens", n)] = (sum(g["meta_reads"] for g in got),
                                         max(g["meta_bcasts"] for g in got))
                log("[round %d] %-6s 4 -> %d: %.3f s, %.2f GB/s, %.2f GiB read from storage (per "
                    "rank %s MiB; device requests of %s KiB on average)"
                    % (rnd + 1, system, n, s, nbytes / s / 1e9, read / (1 << 30),
                       "/".join("%.0f" % (g["read"] / (1 << 20)) for g in got),
                       "%.0f" % got[0]["req"] if got[0]["req"] else "?"))
        res.setdefault("loadavg", []).append(os.getloadavg()[0])
        for system in systems:
            out = os.path.join(BENCH_DIR, "export-" + system)
            shutil.rmtree(out, ignore_errors=True)
            ts.drop_caches()
            if system == "strata":
                t, peak = timed_child([STRATA, "export", ck, out])
            else:
                os.makedirs(out)
                t, peak = timed_child([PY, "-c", DCP_EXPORT, ck, os.path.join(out, "all.pt"),
                                       os.path.join(out, "model.safetensors")])
            shutil.rmtree(out, ignore_errors=True)
            res.setdefault(("export", system), []).append((t, peak))
            log("[round %d] export %-6s %.2f s, peak RSS %.0f MiB" % (rnd + 1, system, t, peak))
    med = statistics.median

    def rng(xs, fmt="%.3f"):
        return (fmt + " (" + fmt + "-" + fmt + ")") % (med(xs), min(xs), max(xs))
    disk = med(res["disk"])
    md = []
    w = md.append
    w("# bench-unified: strata reading a checkpoint that PyTorch DCP wrote")
    w("")
    w("`make bench-unified`, %s UTC. A %.2f GiB DCP checkpoint (%d float32 tensors, `Shard(0)` "
      "DTensors saved by `dcp.save` on 4 gloo processes) loaded cold (page cache dropped) by "
      "`dcp.load` and `strata.torch.load` into 4 and 3 processes (`Shard(0)`) and 1 (plain "
      "tensors), alternating which goes first; medians of %d rounds (min-max)."
      % (time.strftime("%Y-%m-%d %H:%M", time.gmtime()), nbytes / (1 << 30), NT, ROUNDS))
    w("")
    w("- Load average (1 min) after each round's loads: %s." % rng(res["loadavg"], "%.1f"))
    w("- Disk, as strata uses it (the reference of \"of disk\"; `strata bench disk`: O_DIRECT, "
      "4 threads, cold reads of a load's size through strata's I/O buffers, %s): %s GB/s at %s "
      "KiB per device request; through 4 KiB-page buffers %s GB/s; fio (its own buffers, "
      "O_DIRECT, 8 MiB, libaio queue depth 4) %s GB/s."
      % (pages, rng(res["disk"]), rng(res["disk_req"], "%.0f"), rng(res["disk4k"]),
         rng(res["fio"])))
    w("")
    w("| case | DCP s | strata s | strata / DCP | strata GB/s | of disk | read from storage per "
      "rank, DCP / strata (MiB) | KiB per device request, DCP / strata |")
    w("|---|---|---|---|---|---|---|---|")
    ratios = {}
    for n in (4, 3, 1):
        d, s = med(res[("dcp", n)]), med(res[("strata", n)])
        ratios["load_4to%d" % n] = s / d
        per = {x: "/".join("%.0f" % (med(r[k] for r in res[("read", x, n)]) / (1 << 20))
                           for k in range(n)) for x in ("dcp", "strata")}
        rq = {x: "%.0f" % med(res[("req", x, n)]) if res.get(("req", x, n)) else "?"
              for x in ("dcp", "strata")}
        w("| load 4 -> %d | %s | %s | %.2f | %.2f | %.2f | %s / %s | %s / %s |"
          % (n, rng(res[("dcp", n)]), rng(res[("strata", n)]), s / d, nbytes / s / 1e9,
             nbytes / s / 1e9 / disk, per["dcp"], per["strata"], rq["dcp"], rq["strata"]))
    et = {k: med([x[0] for x in res[("export", k)]]) for k in ("dcp", "strata")}
    ep = {k: med([x[1] for x in res[("export", k)]]) for k in ("dcp", "strata")}
    w("| export to safetensors | %.2f (peak %.0f MiB) | %.2f (peak %.0f MiB) | %.2f | %.2f | "
      "%.2f | | |" % (et["dcp"], ep["dcp"], et["strata"], ep["strata"], et["strata"] / et["dcp"],
                      nbytes / et["strata"] / 1e9, nbytes / et["strata"] / 1e9 / disk))
    w("")
    w("Goals: a DCP checkpoint loaded by strata, 4 -> 4 and 4 -> 3, <= 0.4x `dcp.load`'s time: "
      "%s and %s." % tuple("%.2f (%s)" % (ratios["load_4to%d" % n], "met" if
                                          ratios["load_4to%d" % n] <= 0.4 else "MISSED")
                           for n in (4, 3)))
    for n in (4, 3, 1):
        w("")
        w("strata.torch.load 4 -> %d: the index read %d time(s) (all ranks), broadcast %d "
          "time(s)." % ((n,) + res[("opens", n)]))
    import strata.torch as st
    out = os.path.join(BENCH_DIR, "export-count")
    shutil.rmtree(out, ignore_errors=True)
    ex = st.export_safetensors(ck, out)
    shutil.rmtree(out, ignore_errors=True)
    w("")
    w("strata export: the index read %d time(s), %d data reads." % (ex["meta_reads"],
                                                                  ex["io_calls"]))
    line = ("bench-unified ratios (strata / DCP, medians of %d): load_4to4=%.2f load_4to3=%.2f "
            "load_4to1=%.2f read_rate_of_disk=%.2f export_time=%.2f export_peak_rss_mib=%.0f"
            % (ROUNDS, ratios["load_4to4"], ratios["load_4to3"], ratios["load_4to1"],
               nbytes / med(res[("strata", 4)]) / 1e9 / disk, et["strata"] / et["dcp"],
               ep["strata"]))
    w("")
    w("Last line:")
    w("")
    w("```")
    w(line)
    w("```")
    w("")
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "unified.md"), "w") as f:
        f.write("\n".join(md))
    log("\n".join(md))
    log(line)
    shutil.rmtree(ck, ignore_errors=True)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
