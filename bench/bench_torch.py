"""make bench-torch: strata beside torch.save and DCP, in a real training loop, on one state
and one disk. Writes bench/results/torch.md and torch.png; the last line printed is

    stall_ratio_vs_dcp_async=X durable_ratio_vs_dcp_async=X save_of_disk=X load_of_disk=X
    reshard_load_of_disk=X load_ratio_vs_torch_mmap=X peak_extra_ratio_vs_dcp=X

Each round: the disk where the checkpoints go is measured the way strata uses it (`strata
bench disk`: O_DIRECT through strata's I/O buffers, the reference of every "of disk" figure,
and through 4 KiB-page buffers), then by fio (its own buffers); then every configuration
runs in fresh processes (so memory figures start clean):

    1p-fp32, 1p-bf16  one process, plain model: for each system (the order rotates each
                      round) setup, one save outside the loop (call, snapshot, durable, peak
                      extra RSS), then a period of K real training steps with one checkpoint
                      at its start, against the same period without; then the cold loads
    4p-fp32           4 gloo processes, FSDP2 x TP (2 x 2): each system's save, then cold
                      loads in the same layout, on 3 processes (FSDP2) and on 1 (plain)

Environment: BENCH_TORCH_GB (state GiB, default 2), BENCH_TORCH_ROUNDS or ROUNDS (default
5), BENCH_TORCH_K (steps per checkpoint, default 10; BENCH_TORCH_K_BF16 for 1p-bf16,
default 0: no loop, saves outside it only), BENCH_TORCH_CONFIGS (default
"1p-fp32,1p-bf16,4p-fp32"), BENCH_DIR (where checkpoints and fio's file go, default
build/bench-torch), BENCH_TORCH_OUT (default bench/results).
"""

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PY = sys.executable


def env_int(name, default, alt=None):
    v = os.environ.get(name) or (os.environ.get(alt) if alt else None)
    return int(v) if v else default


GIB = float(os.environ.get("BENCH_TORCH_GB", "2"))
ROUNDS = env_int("BENCH_TORCH_ROUNDS", 5, "ROUNDS")
K = env_int("BENCH_TORCH_K", 10)
K_BF16 = env_int("BENCH_TORCH_K_BF16", 0)
K_BLOCK = 2
CONFIGS = [c for c in os.environ.get("BENCH_TORCH_CONFIGS", "1p-fp32,1p-bf16,4p-fp32").split(",")
           if c]
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-torch"))
OUT_DIR = os.environ.get("BENCH_TORCH_OUT", os.path.join(HERE, "results"))
MIB = 1 << 20


def now():
    return time.perf_counter()


def rotate(xs, r):
    r %= max(len(xs), 1)
    return xs[r:] + xs[:r]


def log(*a):
    print(*a, flush=True)


# =============================================================================================
# one process
# =============================================================================================

LOADS_1P = ["torch_load", "torch_load_mmap", "dcp_load", "strata_load", "strata_mgr_load"]
LOAD_LABELS = {
    "torch_load": "torch.load + copy_",
    "torch_load_mmap": "torch.load(mmap=True) + copy_",
    "dcp_load": "DCP load",
    "strata_load": "strata load",
    "strata_mgr_load": "strata manager load (/dev/shm tier)",
    "dcp_load_4": "DCP load 4 -> 4",
    "strata_load_4": "strata load 4 -> 4",
    "dcp_load_3": "DCP load 4 -> 3 (FSDP2)",
    "strata_load_3": "strata load 4 -> 3 (FSDP2)",
    "dcp_load_1": "DCP load 4 -> 1 (plain)",
    "strata_load_1": "strata load 4 -> 1 (plain)",
}
# which saved checkpoint each load format reads (the save outside the loop)
LOAD_SOURCE = {"torch": "torch_save", "dcp": "dcp_save_t4", "strata": "strata_save"}


def pool_for(nbytes):
    """A pool that holds the whole state (so a snapshot never waits for the disk): the
    state rounded up to 64 MiB buffers, plus one."""
    buf = 64 * MIB
    return (nbytes + buf - 1) // buf * buf + buf


class Rows:
    def __init__(self, config, rnd):
        self.config = config
        self.round = rnd
        self.rows = []

    def add(self, system, metric, value):
        self.rows.append({"config": self.config, "round": self.round, "system": system,
                          "metric": metric, "value": value})


def _watch(system, h, out, stop):
    import threading

    def run():
        while not stop.is_set():
            try:
                if system.done(h):
                    out.append(now())
                    return
            except Exception:
                return
            time.sleep(0.005)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def period(tr, k, system=None, sd_fn=None, path=None, step=0, mem=None):
    """K training steps with (system given) one checkpoint started at the beginning:
    wait_snapshot before the first optimizer step, durable waited for at the end (the next
    checkpoint would wait there). Returns (seconds, blocked seconds, seconds to durable).
    mem (a list): gets the peak RSS above the RSS before the call, over the call."""
    import threading
    import torch_systems as ts
    if mem is not None:
        rss0 = ts.rss()
        ts.hwm_reset()
    done_at, stop, watcher = [], threading.Event(), None
    t0 = now()
    blocked = 0.0
    h = None
    if system is not None:
        h = system.start(sd_fn(), path, step)
        blocked = now() - t0
        if mem is not None:
            mem.append(ts.hwm() - rss0)
        if system.is_async:
            watcher = _watch(system, h, done_at, stop)
    for i in range(k):
        tr.forward_backward()
        if system is not None and i == 0:
            tw = now()
            system.snapshot(h)
            blocked += now() - tw
        tr.optimizer_step()
    durable = None
    if system is not None:
        tw = now()
        if watcher is not None and not done_at:
            pass
        stop.set()
        if watcher is not None:
            watcher.join()
        system.durable(h)
        te = now()
        blocked += te - tw
        if system.is_async:
            durable = (done_at[0] if done_at else te) - t0
        else:
            durable = blocked
    return now() - t0, blocked, durable


def phase_single(dtype_name, rnd, out_path):
    import torch
    import torch_model as tm
    import torch_systems as ts
    import strata
    import strata.torch as st

    config = "1p-" + dtype_name
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    rows = Rows(config, rnd)
    k = K if dtype_name == "fp32" else K_BF16
    meta = {"config": config}
    layers = tm.layers_for(GIB, dtype)
    model, opt = tm.build("plain", layers, dtype)
    tr = tm.Trainer(model, opt)
    tr.step()
    tr.step()

    def sd_fn():
        return tm.state_dict(model, opt)

    sd = sd_fn()
    nbytes = tm.local_bytes(sd)
    meta.update(layers=layers, bytes=nbytes, params=sum(p.numel() for p in model.parameters()),
                tensors=len(tm.tensors(sd)), k=k, torch_threads=torch.get_num_threads())
    meta["drop_caches"] = ts.drop_caches()
    meta["hwm_reset"] = ts.hwm_reset()
    if dtype_name == "fp32":
        meta["staging_probe"] = ts.probe_staging_options()
    mc = ts.memcpy_gbps()
    cg, cs = ts.copy_state_gbps(sd, tm.tensors)
    rows.add("env", "memcpy_gbps", mc)
    rows.add("env", "copy_gbps", cg)
    rows.add("env", "copy_s", cs)
    log("[%s r%d] %d layers, %.2f GiB state in %d tensors; memcpy %.2f GB/s (1 thread), "
        "copy_ of the state %.3f s (%.2f GB/s, %d threads)" % (
            config, rnd, layers, nbytes / 2**30, meta["tensors"], mc, cs, cg,
            torch.get_num_threads()))

    root = os.path.join(BENCH_DIR, "%s-r%d" % (config, rnd))
    shm_root = "/dev/shm/strata-bench-torch-%d/%s" % (os.getpid(), config)
    ts.rmtree(root)
    os.makedirs(root)
    pool = pool_for(nbytes)
    meta["pool_bytes"] = pool
    systems = ts.make_systems(pool, shm_root, os.path.join(root, "mgr"), distributed=False)
    meta["options"] = {s.name: s.options() for s in systems}
    meta["labels"] = {s.name: s.label for s in systems}
    names = [s.name for s in systems]
    third = (len(names) + 2) // 3
    order = (["baseline_a"] + names[:third] + ["baseline_b"] + names[third:2 * third]
             + ["baseline_c"] + names[2 * third:])
    if not k:
        order = names
    order = rotate(order, rnd)
    by_name = {s.name: s for s in systems}
    digests = {}
    periods = []
    step = 0
    for name in order:
        if name.startswith("baseline"):
            tr.step()
            p, _, _ = period(tr, k)
            periods.append(p)
            log("[%s r%d] %s: %d steps in %.3f s" % (config, rnd, name, k, p))
            continue
        s = by_name[name]
        path = os.path.join(root, name)
        loop_path = os.path.join(root, name + "-loop")
        is_src = LOAD_SOURCE.get(s.fmt) == name
        if (is_src and (s.is_async or not k)) or (s.fmt == "strata_mgr" and not k):
            digests[s.fmt] = ts.digest(sd_fn(), tm.tensors)
        ts.trim()
        os.sync()
        shm0 = shutil.disk_usage("/dev/shm").used
        rss0 = ts.rss()
        ts.hwm_reset()
        s.setup(sd_fn())
        msg = ""
        if s.is_async or not k:
            # outside the loop: the first save after the setup
            step += 1
            t0 = now()
            h = s.start(sd_fn(), path, step)
            t_call = now() - t0
            s.snapshot(h)
            t_snap = now() - t0
            s.durable(h)
            t_dur = now() - t0
            peak = ts.hwm() - rss0
            shm = shutil.disk_usage("/dev/shm").used - shm0
            del h
            rows.add(name, "call_s", t_call)
            rows.add(name, "durable_s", t_dur)
            rows.add(name, "save_gbps", nbytes / t_dur / 1e9)
            rows.add(name, "peak_extra_save", peak)
            if shm > 0 and ("shm" in name or s.fmt == "strata_mgr"):
                rows.add(name, "shm_bytes", shm)
            if s.is_async:
                rows.add(name, "snapshot_s", t_snap)
                rows.add(name, "snapshot_gbps", nbytes / t_snap / 1e9)
            msg = "call %.3f s, snapshot %.3f s, durable %.3f s (%.2f GB/s), peak extra %.0f " \
                  "MiB%s" % (t_call, t_snap, t_dur, nbytes / t_dur / 1e9, peak / MIB,
                             ", /dev/shm +%.0f MiB" % (shm / MIB)
                             if shm > 0 and ("shm" in name or s.fmt == "strata_mgr") else "")
        if k:
            tr.step()
            step += 1
            if s.fmt == "strata_mgr":
                digests["strata_mgr"] = ts.digest(sd_fn(), tm.tensors)
            if is_src and not s.is_async:
                digests[s.fmt] = ts.digest(sd_fn(), tm.tensors)   # the loop's save is loaded
            if s.is_async:
                ks = k
                p, blocked, dur = period(tr, ks, s, sd_fn, loop_path, step)
            else:
                # a blocking save blocks for its whole call: the period needs only a step or
                # two after it; this save is also the one whose call and memory are reported
                ks = K_BLOCK
                mem = []
                p, blocked, dur = period(tr, ks, s, sd_fn, path, step, mem)
                rows.add(name, "call_s", blocked)
                rows.add(name, "durable_s", blocked)
                rows.add(name, "save_gbps", nbytes / blocked / 1e9)
                rows.add(name, "peak_extra_save", mem[0])
                msg = "call (durable) %.3f s (%.2f GB/s), peak extra %.0f MiB" % (
                    blocked, nbytes / blocked / 1e9, mem[0] / MIB)
            rows.add(name, "period_s", p)
            rows.add(name, "period_steps", ks)
            rows.add(name, "blocked_s", blocked)
            rows.add(name, "loop_durable_s", dur)
            msg += " | loop: checkpoint + %d steps in %.3f s, blocked %.3f s, durable after " \
                   "%.3f s" % (ks, p, blocked, dur)
        log("[%s r%d] %s: %s" % (config, rnd, name, msg))
        s.close()
        if s.fmt != "strata_mgr":
            ts.rmtree(loop_path)
        if not is_src:
            ts.rmtree(path)
        ts.trim()
    if k:
        base = statistics.median(periods) / k
        rows.add("baseline", "period_s", base * k)
        rows.add("baseline", "step_s", base)
        per = {}
        for r in rows.rows:
            if r["metric"] in ("period_s", "period_steps") and r["system"] != "baseline":
                per.setdefault(r["system"], {})[r["metric"]] = r["value"]
        for name, d in per.items():
            stall = d["period_s"] - d["period_steps"] * base
            rows.add(name, "stall_s", stall)
            rows.add(name, "overhead_pct", stall / (k * base) * 100)

    # the cold loads, into the training state (zeroed first), in place
    import torch.distributed.checkpoint as dcp
    srcs = {"torch_load": ("torch", os.path.join(root, "torch_save", "state.pt")),
            "torch_load_mmap": ("torch", os.path.join(root, "torch_save", "state.pt")),
            "dcp_load": ("dcp", os.path.join(root, LOAD_SOURCE["dcp"])),
            "strata_load": ("strata", os.path.join(root, LOAD_SOURCE["strata"])),
            "strata_mgr_load": ("strata_mgr", None)}
    for name in rotate(LOADS_1P, rnd):
        fmt, path = srcs[name]
        sd = sd_fn()
        ts.scribble(sd, tm.tensors)
        ts.trim()
        dropped = ts.drop_caches()
        rss0 = ts.rss()
        ts.hwm_reset()
        rb0 = ts.read_bytes()
        c0 = ts.disk_counters(BENCH_DIR)
        stats = None
        t0 = now()
        if name in ("torch_load", "torch_load_mmap"):
            obj = torch.load(path, weights_only=True, mmap=(name == "torch_load_mmap"))
            flat = dict(tm.tensors(obj))
            with torch.no_grad():
                for k, t in tm.tensors(sd):
                    t.copy_(flat[k])
            del obj, flat
        elif name == "dcp_load":
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        elif name == "strata_load":
            stats = st.load(sd, path)
        else:
            st.CheckpointManager(by_name["strata_mgr"].tiers).load(sd)
        t = now() - t0
        req = ts.request_kib(c0, ts.disk_counters(BENCH_DIR))
        peak = ts.hwm() - rss0
        rb = ts.read_bytes() - rb0
        ok = ts.digest(sd, tm.tensors) == digests[fmt]
        rows.add(name, "load_s", t)
        rows.add(name, "load_gbps", nbytes / t / 1e9)
        rows.add(name, "peak_extra_load", peak)
        rows.add(name, "storage_read", rb)
        rows.add(name, "req_kib", req)
        if stats and stats.get("io_calls"):  # strata's own reads: the requests it makes
            rows.add(name, "read_kib", stats["bytes"] / stats["io_calls"] / 1024)
        rows.add(name, "ok", int(ok))
        log("[%s r%d] %s: %.3f s (%.2f GB/s), peak extra %.0f MiB, read from storage %.0f MiB "
            "(device requests of %s KiB on average), %s%s%s" % (
                config, rnd, name, t, nbytes / t / 1e9, peak / MIB, rb / MIB,
                "%.0f" % req if req else "?",
                         "digest ok" if ok else "DIGEST MISMATCH",
                         "" if dropped else " (page cache NOT dropped)",
                         ", strata read %.0f MiB" % (stats["bytes"] / MIB) if stats else ""))
    ts.rmtree(root)
    ts.rmtree(os.path.dirname(shm_root))
    del strata
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "rows": rows.rows}, f)


# =============================================================================================
# several processes
# =============================================================================================

def _barrier():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def _load_cold(name, fmt, path, sd, nbytes):
    """One cold load on every rank: (seconds on this rank, peak extra, storage reads,
    strata stats or None)."""
    import torch.distributed.checkpoint as dcp
    import torch_model as tm
    import torch_systems as ts
    import strata.torch as st
    ts.scribble(sd, tm.tensors)
    ts.trim()
    _barrier()
    dropped = ts.drop_caches() if _rank() == 0 else True
    _barrier()
    rss0 = ts.rss()
    ts.hwm_reset()
    rb0 = ts.read_bytes()
    _barrier()
    c0 = ts.disk_counters(path) if _rank() == 0 else None
    stats = None
    t0 = now()
    if fmt == "dcp":
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
    else:
        stats = st.load(sd, path)
    t = now() - t0
    _barrier()
    req = ts.request_kib(c0, ts.disk_counters(path)) if _rank() == 0 else None
    return {"name": name, "s": t, "peak": ts.hwm() - rss0, "read": ts.read_bytes() - rb0,
            "stats": stats, "dropped": dropped, "req": req}


def job_dist_save(dtype_name, rnd, root, shm_root):
    import torch
    import torch.distributed as dist
    import torch_model as tm
    import torch_systems as ts
    world = dist.get_world_size()
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    layers = tm.layers_for(GIB, dtype)
    t0 = now()
    model, opt = tm.build("fsdp_tp", layers, dtype, world=world)
    tr = tm.Trainer(model, opt)
    tr.step()
    t_build = now() - t0

    def sd_fn():
        return tm.state_dict(model, opt)

    sd = sd_fn()
    local = tm.local_bytes(sd)
    nbytes = tm.state_bytes(layers, dtype)
    dg = ts.digest(sd, tm.tensors)
    pool = pool_for(local)
    systems = ts.make_systems(pool, shm_root, os.path.join(root, "mgr"), distributed=True)
    out = {"rank": rank, "local": local, "bytes": nbytes, "layers": layers, "digest": dg,
           "build_s": t_build, "saves": {}, "loads": {}, "pool": pool,
           "labels": {s.name: s.label for s in systems},
           "options": {s.name: s.options() for s in systems},
           "placements": sorted(set(str(tuple(getattr(t, "placements", ())))
                                    for _, t in tm.tensors(sd)))}
    step = 0
    for s in rotate(systems, rnd):
        path = os.path.join(root, s.name)
        ts.trim()
        _barrier()
        if rank == 0:
            os.sync()
        _barrier()
        rss0 = ts.rss()
        ts.hwm_reset()
        s.setup(sd_fn())
        step += 1
        _barrier()
        t0 = now()
        h = s.start(sd_fn(), path, step)
        t_call = now() - t0
        s.snapshot(h)
        t_snap = now() - t0
        s.durable(h)
        t_dur = now() - t0
        peak = ts.hwm() - rss0
        del h
        s.close()
        _barrier()
        out["saves"][s.name] = {"call": t_call, "snap": t_snap, "durable": t_dur, "peak": peak,
                                "async": s.is_async}
        if rank == 0 and s.name not in LOAD_SOURCE.values():
            ts.rmtree(path)
        ts.trim()
    for fmt in rotate(["dcp", "strata"], rnd):
        name = fmt + "_load_4"
        r = _load_cold(name, fmt, os.path.join(root, LOAD_SOURCE[fmt]), sd_fn(), nbytes)
        r["ok"] = ts.digest(sd_fn(), tm.tensors) == dg
        out["loads"][name] = r
    return out


def job_dist_load(dtype_name, rnd, root, digest):
    import torch
    import torch.distributed as dist
    import torch_model as tm
    import torch_systems as ts
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    layers = tm.layers_for(GIB, dtype)
    model, opt = tm.build("fsdp" if world > 1 else "plain", layers, dtype, world=world)
    tr = tm.Trainer(model, opt)
    tr.step()
    sd = tm.state_dict(model, opt)
    nbytes = tm.state_bytes(layers, dtype)
    out = {"rank": _rank(), "loads": {}}
    for fmt in rotate(["dcp", "strata"], rnd):
        name = "%s_load_%d" % (fmt, world)
        r = _load_cold(name, fmt, os.path.join(root, LOAD_SOURCE[fmt]), sd, nbytes)
        r["ok"] = ts.digest(sd, tm.tensors) == digest
        out["loads"][name] = r
    return out


def phase_dist(dtype_name, rnd, out_path):
    # this process forks the ranks: it imports torch's packages but runs no torch op
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch_dist
    import torch_systems as ts

    config = "4p-" + dtype_name
    rows = Rows(config, rnd)
    root = os.path.join(BENCH_DIR, "%s-r%d" % (config, rnd))
    shm_root = "/dev/shm/strata-bench-torch-%d/%s" % (os.getpid(), config)
    ts.rmtree(root)
    os.makedirs(root)
    t0 = now()
    r4 = torch_dist.run_job(job_dist_save, 4, dtype_name, rnd, root, shm_root)
    nbytes = r4[0]["bytes"]
    meta = {"config": config, "bytes": nbytes, "layers": r4[0]["layers"],
            "local": [r["local"] for r in r4], "pool_bytes": r4[0]["pool"],
            "labels": r4[0]["labels"], "options": r4[0]["options"],
            "placements": r4[0]["placements"], "build_s": max(r["build_s"] for r in r4)}
    log("[%s r%d] 4 ranks, FSDP2 x TP: %.2f GiB state (%s MiB per rank), built in %.1f s" % (
        config, rnd, nbytes / 2**30, "/".join("%.0f" % (r["local"] / MIB) for r in r4),
        meta["build_s"]))
    for name in r4[0]["saves"]:
        per = [r["saves"][name] for r in r4]
        t_call = max(p["call"] for p in per)
        t_snap = max(p["snap"] for p in per)
        t_dur = max(p["durable"] for p in per)
        peak = sum(p["peak"] for p in per)
        rows.add(name, "call_s", t_call)
        rows.add(name, "durable_s", t_dur)
        rows.add(name, "save_gbps", nbytes / t_dur / 1e9)
        rows.add(name, "peak_extra_save", peak)
        rows.add(name, "peak_extra_save_rank_max", max(p["peak"] for p in per))
        if per[0]["async"]:
            rows.add(name, "snapshot_s", t_snap)
            rows.add(name, "snapshot_gbps", nbytes / t_snap / 1e9)
        log("[%s r%d] %s: call %.3f s, snapshot %.3f s, durable %.3f s (%.2f GB/s), peak "
            "extra %.0f MiB (sum of ranks)" % (config, rnd, name, t_call, t_snap, t_dur,
                                               nbytes / t_dur / 1e9, peak / MIB))
    jobs = [("4", r4)]
    r3 = torch_dist.run_job(job_dist_load, 3, dtype_name, rnd, root, r4[0]["digest"])
    jobs.append(("3", r3))
    r1 = torch_dist.run_job(job_dist_load, 1, dtype_name, rnd, root, r4[0]["digest"])
    jobs.append(("1", r1))
    for _, rr in jobs:
        for name in rr[0]["loads"]:
            per = [r["loads"][name] for r in rr]
            t = max(p["s"] for p in per)
            peak = sum(p["peak"] for p in per)
            read = sum(p["read"] for p in per)
            ok = all(p["ok"] for p in per)
            rows.add(name, "load_s", t)
            rows.add(name, "load_gbps", nbytes / t / 1e9)
            rows.add(name, "peak_extra_load", peak)
            rows.add(name, "storage_read", read)
            rows.add(name, "storage_read_rank_max", max(p["read"] for p in per))
            rows.add(name, "req_kib", per[0]["req"])
            rows.add(name, "ok", int(ok))
            st = per[0]["stats"]
            if st:
                rows.add(name, "strata_all_bytes", st.get("all_bytes") or st.get("bytes"))
            log("[%s r%d] %s on %d: %.3f s (%.2f GB/s), peak extra %.0f MiB (sum of ranks), "
                "read from storage on the node %.0f MiB (per rank %s MiB; device requests of "
                "%s KiB on average)%s, %s%s" % (
                    config, rnd, name, len(per), t, nbytes / t / 1e9, peak / MIB, read / MIB,
                    "/".join("%.0f" % (p["read"] / MIB) for p in per),
                    "%.0f" % per[0]["req"] if per[0]["req"] else "?",
                    " (strata: %.0f MiB over all ranks)" % (
                        (st.get("all_bytes") or st.get("bytes")) / MIB) if st else "",
                    "digest ok" if ok else "DIGEST MISMATCH",
                    "" if per[0]["dropped"] else " (page cache NOT dropped)"))
    meta["seconds"] = now() - t0
    ts.rmtree(root)
    ts.rmtree(os.path.dirname(shm_root))
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "rows": rows.rows}, f)


# =============================================================================================
# the driver
# =============================================================================================

def fio_gbps(rw, size_mb):
    path = os.path.join(BENCH_DIR, "fio.bin")
    cmd = ["fio", "--name=disk", "--filename=" + path, "--rw=" + rw, "--bs=8M",
           "--size=%dM" % size_mb, "--direct=1", "--ioengine=libaio", "--iodepth=4",
           "--end_fsync=1", "--output-format=json"]
    j = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    k = "write" if rw == "write" else "read"
    job = j["jobs"][0][k]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9


def drop_caches_permitted():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def run_phase(kind, config, rnd, tmp):
    out = os.path.join(tmp, "%s-r%d.json" % (config, rnd))
    dtype = config.split("-")[1]
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    t0 = now()
    p0 = pressure()
    subprocess.run([PY, os.path.abspath(__file__), "_phase", kind, dtype, str(rnd), out],
                   check=True, env=env)
    p1 = pressure()
    with open(out) as f:
        got = json.load(f)
    wall = now() - t0
    got["meta"]["phase_s"] = wall
    # the share of the phase's time during which some task waited for a CPU / for I/O
    # (Linux PSI): other users of this shared machine show here
    for k in p0:
        got["rows"].append({"config": config, "round": rnd, "system": "env",
                            "metric": "psi_" + k, "value": (p1[k] - p0[k]) / 1e6 / wall * 100})
    return got


def pressure():
    out = {}
    for k in ("cpu", "io"):
        try:
            with open("/proc/pressure/" + k) as f:
                for line in f:
                    if line.startswith("some"):
                        out[k] = int(line.split("total=")[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def main():
    import torch_report
    import torch_systems as ts
    t_start = now()
    os.makedirs(BENCH_DIR, exist_ok=True)
    os.makedirs(OUT_DIR, exist_ok=True)
    tmp = os.path.join(BENCH_DIR, "phases")
    os.makedirs(tmp, exist_ok=True)
    dropped = drop_caches_permitted()
    size_mb = int(GIB * 1024)
    log("bench-torch: %.2f GiB state, %d rounds, a checkpoint every %d steps, configs %s, in %s"
        " (page cache drop: %s)" % (GIB, ROUNDS, K, ",".join(CONFIGS), BENCH_DIR,
                                    "permitted" if dropped else "NOT permitted"))
    rows, metas = [], {}
    for rnd in range(ROUNDS):
        # the disk as strata uses it (its I/O buffers; and 4 KiB pages), then as fio does
        disk = ts.strata_disk(BENCH_DIR, size_mb)
        for kind, sysname in (("strata", "disk"), ("4k", "disk4k")):
            d = disk[kind]
            for m in ("write_gbps", "read_gbps", "write_req_kib", "read_req_kib"):
                rows.append({"config": "env", "round": rnd, "system": sysname, "metric": m,
                             "value": d[m]})
            log("[round %d] disk through %s buffers (%s): write %.3f GB/s, cold read %.3f GB/s "
                "(requests of %.0f / %.0f KiB; %d MiB, O_DIRECT, 8 MiB writes, %.0f KiB reads, 4 "
                "threads)" % (rnd + 1, "strata's" if kind == "strata" else "4 KiB-page",
                              d["pages"], d["write_gbps"], d["read_gbps"], d["write_req_kib"],
                              d["read_req_kib"], size_mb, d["read_kib"]))
        pages = disk["strata"]["pages"]
        fpath = os.path.join(BENCH_DIR, "fio.bin")
        w = fio_gbps("write", size_mb)
        drop_caches_permitted()
        r = fio_gbps("read", size_mb)
        os.unlink(fpath)
        log("[round %d] fio: disk write %.3f GB/s, cold read %.3f GB/s (%d MiB, O_DIRECT, 8 MiB "
            "blocks, queue depth 4, its own buffers)" % (rnd + 1, w, r, size_mb))
        rows.append({"config": "env", "round": rnd, "system": "fio", "metric": "write_gbps",
                     "value": w})
        rows.append({"config": "env", "round": rnd, "system": "fio", "metric": "read_gbps",
                     "value": r})
        for cfg in rotate(CONFIGS, rnd):
            kind = "single" if cfg.startswith("1p") else "dist"
            got = run_phase(kind, cfg, rnd, tmp)
            rows.extend(got["rows"])
            rows.append({"config": cfg, "round": rnd, "system": "env", "metric": "loadavg",
                         "value": os.getloadavg()[0]})
            metas.setdefault(cfg, []).append(got["meta"])
            log("[round %d] %s took %.0f s (%.0f s so far)" % (rnd + 1, cfg,
                                                                got["meta"]["phase_s"],
                                                                now() - t_start))
    info = {
        "gib": GIB, "rounds": ROUNDS, "k": K, "configs": CONFIGS, "bench_dir": BENCH_DIR,
        "disk_pages": pages,
        "drop_caches": dropped, "seconds": now() - t_start, "size_mb": size_mb,
        "versions": versions(), "machine": machine(),
    }
    with open(os.path.join(tmp, "all.json"), "w") as f:
        json.dump({"info": info, "metas": metas, "rows": rows}, f)
    line = torch_report.write(info, metas, rows, OUT_DIR)
    shutil.rmtree(tmp, ignore_errors=True)
    log(line)


def versions():
    out = {"python": platform.python_version()}
    for mod in ("torch", "strata", "numpy", "matplotlib"):
        try:
            out[mod] = subprocess.run([PY, "-c", "import %s; print(getattr(%s, '__version__', "
                                       "'?'))" % (mod, mod)], capture_output=True, text=True,
                                      check=True).stdout.strip()
        except Exception:
            out[mod] = "?"
    try:
        out["fio"] = subprocess.run(["fio", "--version"], capture_output=True,
                                    text=True).stdout.strip()
    except OSError:
        out["fio"] = "?"
    return out


def machine():
    m = {"kernel": platform.release(), "cores": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            m["mem_gib"] = int(f.readline().split()[1]) / 2**20
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    m["cpu"] = line.split(":", 1)[1].strip()
                    break
        d = subprocess.run(["df", "-PT", BENCH_DIR], capture_output=True, text=True).stdout
        parts = d.splitlines()[1].split()
        m["fs"] = "%s (%s, on %s)" % (parts[6], parts[1], parts[0])
    except Exception:
        pass
    return m


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_phase":
        kind, dtype, rnd, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
        if kind == "single":
            phase_single(dtype, rnd, out)
        else:
            phase_dist(dtype, rnd, out)
    else:
        main()
