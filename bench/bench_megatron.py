"""make bench-megatron: Megatron-Core 0.16.1's dist_checkpointing through strata's strategy
(strata.megatron) beside Megatron's default torch_dist strategy, same state, on 2 gloo
processes (CPU). Writes bench/results/megatron.md and prints the table.

The state: a GPT of Megatron's own layers (tests/python/_mg_gpt.py: its DDP and
DistributedOptimizer after a real step, on CPU), saved at TP=2 (2 processes) with the
optimizer in Megatron's fully_reshardable format (model-space tensors; at DP=1 no gather),
loaded at TP=1 x DP=2 (another layout: each rank needs every weight and moment).
Each round runs both strategies in the same processes, the order alternating, and measures:

    blocked   the training loop's wait for an asynchronous checkpoint (Megatron's entry
              point: dist_checkpointing.save(..., async_sharded_save=True) and
              AsyncCallsQueue.schedule_async_request), then a stand-in for the forward and
              backward (BENCH_MG_STEP_S of matmuls, competing for the CPU), then for strata
              the wait for its snapshot copy before the optimizer step (the step pre-hook's
              wait, timed); torch_dist's async path copies nothing on CPU before its forked
              writer starts (that fork is in the call)
    sd        Megatron's sharded_state_dict before each save (the same for both; timed
              apart: the clocks of blocked, durable and sync start after it)
    durable   an asynchronous save until Megatron's finalize returned on every rank and
              every file of the checkpoint is fsync'd (torch_dist fsyncs its data files;
              common.pt and metadata.json are Megatron's, synced here for both)
    sync      a synchronous save (dist_checkpointing.save) until every file is fsync'd
    load      dist_checkpointing.load of the TP=2 checkpoint on TP=1 x DP=2, the
              checkpoint's files evicted from the page cache first (posix_fadvise
              DONTNEED: cold reads, nobody else's cache touched); strata's through its
              strategy, torch_dist's through Megatron's
Mechanism: bytes written per rank (each rank's data files), bytes read from storage per rank
during the load (/proc/self/io read_bytes) and through read calls (rchar), the device's
requests during the sync save and the load (/proc/diskstats of the device under BENCH_DIR:
bytes per write / read request; device-wide, so other processes' requests count too), the
collectives rank 0 calls during the load (torch.distributed's and strata's group's), the
load average at each round.

Environment: BENCH_MG_GB (state on disk, GiB, default 1), BENCH_MG_ROUNDS (default 5),
BENCH_MG_STEP_S (default 1.0), BENCH_DIR (default build/bench-megatron), BENCH_MG_OUT
(default bench/results).
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from _launch import launch, wait  # noqa: E402
sys.path.insert(0, HERE)
from diskstats import counters, device  # noqa: E402

GIB = float(os.environ.get("BENCH_MG_GB", "1"))
ROUNDS = int(os.environ.get("BENCH_MG_ROUNDS", "5"))
STEP_S = float(os.environ.get("BENCH_MG_STEP_S", "1.0"))
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-megatron"))
OUT_DIR = os.environ.get("BENCH_MG_OUT", os.path.join(HERE, "results"))
HIDDEN = 1024
SYSTEMS = ("strata", "torch_dist")


def layers():
    # on disk: fp32 weights, and the optimizer's fp32 param and two moments: 16 bytes a
    # parameter; a layer holds 12 x HIDDEN^2 of them
    return max(1, round(GIB * (1 << 30) / 16 / (12 * HIDDEN * HIDDEN)))


def order(r):
    return SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]


def _fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _evict(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _io():
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (ln.split(": ") for ln in f.read().splitlines())}


def _setup(tp):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import _mg_gpt
    m = _mg_gpt.Model(tp, 1, seed=1, hidden=HIDDEN, layers=layers(), vocab=1024)
    import strata.megatron
    strata.megatron.enable()
    from megatron.core import dist_checkpointing as dc
    return dist, m, dc


def _fresh(dist, path):
    import shutil
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()


def save_main(out):
    """Layout TP=2 (2 ranks): per round, for each strategy, blocked / durable / sync."""
    import torch
    dist, m, dc = _setup(2)
    import strata.megatron as smg
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    q = AsyncCallsQueue()
    rank = dist.get_rank()
    x = torch.randn(256, 256)
    # Megatron-LM with --ckpt-assume-constant-structure: torch_dist's plan cached, and the
    # integrity check of the sharding (a metadata all-gather) only on the first save
    strategy = {"strata": ("strata", 1),
                "torch_dist": TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)}

    def compute(seconds):       # stands for forward and backward
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            x.mm(x)

    def sd():
        """Megatron's sharded state dict (the DistributedOptimizer's fully_reshardable
        state built from its buffers: the same for both strategies), and the seconds it
        took on the slowest rank; the clocks below start after it."""
        t = time.perf_counter()
        state = m.sharded_state_dict("fully_reshardable")
        took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return state, float(took)

    res = []
    for r in range(-1, ROUNDS):            # round -1: a warm-up of each, not counted
        row = {"load": os.getloadavg()[0]}
        for sys_ in order(r):
            base = os.path.join(BENCH_DIR, sys_)
            # blocked: the call, the stand-in step, the wait for the snapshot
            path = os.path.join(base, "blocked")
            _fresh(dist, path)
            state, sd_s = sd()           # (Megatron-LM builds it for either strategy)
            dist.barrier()
            t0 = time.perf_counter()
            q.schedule_async_request(dc.save(state, path, sharded_strategy=strategy[sys_],
                                             async_sharded_save=True,
                                             validate_access_integrity=r < 0))
            call = time.perf_counter() - t0
            del state
            compute(STEP_S)
            t1 = time.perf_counter()
            smg.wait_snapshot()
            wait_s = time.perf_counter() - t1
            m.step(100 + r)              # (the hook finds the snapshot done)
            q.maybe_finalize_async_calls(blocking=True)
            w = torch.tensor([call + wait_s, call, wait_s], dtype=torch.float64)
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            # durable, asynchronous
            path = os.path.join(base, "durable")
            _fresh(dist, path)
            state, _ = sd()
            dist.barrier()
            t0 = time.perf_counter()
            q.schedule_async_request(dc.save(state, path, sharded_strategy=strategy[sys_],
                                             async_sharded_save=True,
                                             validate_access_integrity=r < 0))
            del state
            q.maybe_finalize_async_calls(blocking=True)
            _fsync_tree(path)
            dist.barrier()
            durable = time.perf_counter() - t0
            # synchronous (the checkpoint the load job reads)
            path = os.path.join(base, "sync")
            _fresh(dist, path)
            dev = device(path)
            state, _ = sd()
            dist.barrier()
            d0 = counters(dev)
            t0 = time.perf_counter()
            dc.save(state, path, sharded_strategy=strategy[sys_], validate_access_integrity=r < 0)
            del state
            _fsync_tree(path)
            dist.barrier()
            sync = time.perf_counter() - t0
            d1 = counters(dev)
            mine = [f for f in os.listdir(path if sys_ == "torch_dist"
                                          else os.path.join(path, "strata"))
                    if f.startswith("__%d_" % rank) or f == "data-%06d.bin" % rank]
            where = path if sys_ == "torch_dist" else os.path.join(path, "strata")
            written = torch.tensor([sum(os.path.getsize(os.path.join(where, f)) for f in mine)])
            allw = [torch.zeros_like(written) for _ in range(dist.get_world_size())]
            dist.all_gather(allw, written)
            row[sys_] = {"blocked": float(w[0]), "call": float(w[1]), "wait": float(w[2]),
                         "durable": durable, "sync": sync, "sd": sd_s,
                         "written": [int(v) for v in allw],
                         "wreq": d1[2] - d0[2], "wbytes": (d1[3] - d0[3]) * 512}
        if r >= 0:
            res.append(row)
    if rank == 0:
        total = {}
        for s in SYSTEMS:
            p = os.path.join(BENCH_DIR, s, "sync")
            total[s] = sum(os.path.getsize(os.path.join(root, f))
                           for root, _, fs in os.walk(p) for f in fs)
        with open(out, "w") as f:
            json.dump({"rounds": res, "bytes": total}, f)
    dist.barrier()
    dist.destroy_process_group()


_COLL = [0]


def _count_collectives():
    """Counts (in _COLL) the collective calls this process makes through torch.distributed
    (DCP's and Megatron's, by their module attribute) and strata's group (its all-gather
    alias)."""
    import torch.distributed as dist
    from strata import _group

    def counted(f):
        def g(*a, **k):
            _COLL[0] += 1
            return f(*a, **k)
        return g
    for name in ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce",
                 "all_to_all_single", "broadcast", "broadcast_object_list", "gather_object",
                 "scatter_object_list", "reduce_scatter_tensor", "barrier", "gather",
                 "scatter"):
        setattr(dist, name, counted(getattr(dist, name)))
    _group._all_gather_single = counted(_group._all_gather_single)


def load_main(out):
    """Layout TP=1 x DP=2 (2 ranks): per round, each strategy's cold load of its checkpoint
    saved at TP=2."""
    import torch
    dist, m, dc = _setup(1)
    rank = dist.get_rank()
    _count_collectives()
    res = []
    for r in range(-1, ROUNDS):
        row = {"load": os.getloadavg()[0]}
        for sys_ in order(r):
            path = os.path.join(BENCH_DIR, sys_, "sync")
            sd = m.sharded_state_dict("fully_reshardable", is_loading=True)
            if rank == 0:
                _evict(path)
            dev = device(path)
            dist.barrier()
            io0, d0, c0 = _io(), counters(dev), _COLL[0]
            t0 = time.perf_counter()
            dc.load(sd, path)          # metadata.json picks the strategy
            coll = _COLL[0] - c0
            dist.barrier()
            t = time.perf_counter() - t0
            io1, d1 = _io(), counters(dev)
            v = torch.tensor([io1["read_bytes"] - io0["read_bytes"],
                              io1["rchar"] - io0["rchar"]], dtype=torch.int64)
            allv = [torch.zeros_like(v) for _ in range(dist.get_world_size())]
            dist.all_gather(allv, v)
            row[sys_] = {"load_s": t, "read_bytes": [int(x[0]) for x in allv],
                         "rchar": [int(x[1]) for x in allv],
                         "rreq": d1[0] - d0[0], "rbytes": (d1[1] - d0[1]) * 512,
                         "coll": coll}
            del sd
        if r >= 0:
            res.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rounds": res}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(kind, out):
    procs = launch([__file__, kind, out], 2, log=lambda r: out + ".log%d" % r,
                   env={"GLOO_SOCKET_IFNAME": "lo"})
    rcs = wait(procs, timeout=3600)
    if any(rcs) or not os.path.exists(out):
        tail = open(out + ".log0").read()[-3000:]
        raise SystemExit("bench-megatron %s failed: exit %s\n%s" % (kind, rcs, tail))
    with open(out) as f:
        return json.load(f)


def med(xs):
    return statistics.median(xs)


def main():
    os.makedirs(BENCH_DIR, exist_ok=True)
    os.makedirs(OUT_DIR, exist_ok=True)
    saved = run("save", os.path.join(BENCH_DIR, "save.json"))
    loaded = run("load", os.path.join(BENCH_DIR, "load.json"))
    sr, lr = saved["rounds"], loaded["rounds"]
    m = {s: {k: med([row[s][k] for row in sr]) for k in ("blocked", "call", "wait", "durable",
                                                         "sync", "sd")} for s in SYSTEMS}
    for s in SYSTEMS:
        m[s]["load_s"] = med([row[s]["load_s"] for row in lr])
    cmd = ("BENCH_MG_GB=%g BENCH_MG_ROUNDS=%d BENCH_MG_STEP_S=%g make bench-megatron"
           % (GIB, ROUNDS, STEP_S))
    loads = [row["load"] for row in sr] + [row["load"] for row in lr]
    lines = ["# Megatron-Core dist_checkpointing on 2 gloo processes (CPU): strata's strategy "
             "beside torch_dist", "",
             "`%s` (bench/bench_megatron.py): a GPT of Megatron-Core 0.16.1's layers, %d "
             "layers of hidden %d, its DDP and DistributedOptimizer (fully_reshardable), "
             "saved at TP=2, loaded at TP=1 x DP=2; checkpoint %.2f GiB (strata) / %.2f GiB "
             "(torch_dist) on disk. Medians of %d rounds, the two strategies alternating in "
             "the same processes (a warm-up round of each not counted). Load average "
             "(1 min) over the rounds: %.1f-%.1f (median %.1f); this machine (2 cores) is "
             "shared." % (cmd, layers(), HIDDEN, saved["bytes"]["strata"] / (1 << 30),
                          saved["bytes"]["torch_dist"] / (1 << 30), ROUNDS, min(loads),
                          max(loads), med(loads)), "",
             "| strategy | blocked per async checkpoint (s) | of it: save call | of it: "
             "snapshot wait | async: time to durable (s) | sync save (s) | resharded load, "
             "cold (s) |",
             "|---|---|---|---|---|---|---|"]
    for s in SYSTEMS:
        lines.append("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            s, m[s]["blocked"], m[s]["call"], m[s]["wait"], m[s]["durable"], m[s]["sync"],
            m[s]["load_s"]))
    a, b = m["strata"], m["torch_dist"]
    goals = ((a["blocked"] / b["blocked"], 0.1, "blocked"),
             (a["durable"] / b["durable"], 0.5, "durable"),
             (a["load_s"] / b["load_s"], 0.6, "resharded load"))
    lines += ["", "strata / torch_dist: blocked %.3f, time to durable %.3f, sync save %.3f, "
              "resharded load %.3f" % (a["blocked"] / b["blocked"], a["durable"] / b["durable"],
                                       a["sync"] / b["sync"], a["load_s"] / b["load_s"]), "",
              "Goals (issue 33): blocked <= 0.1, durable <= 0.5, resharded load <= 0.6 of "
              "torch_dist's: " + ", ".join("%s %s" % (n, "met" if x <= g else "NOT met")
                                           for x, g, n in goals) + ".", "",
              "Megatron's own sharded_state_dict before each save (the DistributedOptimizer's "
              "fully_reshardable state built from its buffers: the same work whichever "
              "strategy saves, outside the clocks above): median %.3f s in strata's rounds, "
              "%.3f s in torch_dist's. Megatron-LM's save_checkpoint builds it before it "
              "calls save; with it added to both, strata / torch_dist: blocked %.3f, time to "
              "durable %.3f, sync save %.3f." % (
                  a["sd"], b["sd"], (a["blocked"] + a["sd"]) / (b["blocked"] + b["sd"]),
                  (a["durable"] + a["sd"]) / (b["durable"] + b["sd"]),
                  (a["sync"] + a["sd"]) / (b["sync"] + b["sd"])), "",
              "Per round (strata / torch_dist: blocked, durable, load; load average):", ""]
    for i, (x, y) in enumerate(zip(sr, lr)):
        lines.append("- round %d (%s first): blocked %.3f / %.3f, durable %.2f / %.2f, sync "
                     "%.2f / %.2f, load %.2f / %.2f; load average %.1f, %.1f" % (
                         i, order(i)[0], x["strata"]["blocked"], x["torch_dist"]["blocked"],
                         x["strata"]["durable"], x["torch_dist"]["durable"],
                         x["strata"]["sync"], x["torch_dist"]["sync"],
                         y["strata"]["load_s"], y["torch_dist"]["load_s"], x["load"], y["load"]))
    gib = float(1 << 30)
    w = {s: sr[-1][s]["written"] for s in SYSTEMS}
    rb = {s: [med([row[s]["read_bytes"][k] for row in lr]) for k in range(2)] for s in SYSTEMS}
    rc = {s: [med([row[s]["rchar"][k] for row in lr]) for k in range(2)] for s in SYSTEMS}
    dv = {s: {k: med([row[s][k] for row in rows]) for rows, k in
              ((sr, "wreq"), (sr, "wbytes"), (lr, "rreq"), (lr, "rbytes"), (lr, "coll"))}
          for s in SYSTEMS}
    lines += ["", "Mechanism (medians; rank 0, rank 1; the device's requests counted by "
              "/proc/diskstats over the whole device):", "",
              "| strategy | data written by each rank (GiB) | sync save: device writes, KiB "
              "per request | load: read from storage by each rank (GiB) | load: read() "
              "bytes by each rank (GiB) | load: device reads, KiB per request | load: "
              "collectives called by rank 0 |",
              "|---|---|---|---|---|---|---|"]
    for s in SYSTEMS:
        lines.append("| %s | %s | %.0f requests, %.3f GiB: %.0f | %s | %s | %.0f requests, "
                     "%.3f GiB: %.0f | %.0f |" % (
                         s, ", ".join("%.3f" % (v / gib) for v in w[s]),
                         dv[s]["wreq"], dv[s]["wbytes"] / gib,
                         dv[s]["wbytes"] / 1024 / max(dv[s]["wreq"], 1),
                         ", ".join("%.3f" % (v / gib) for v in rb[s]),
                         ", ".join("%.3f" % (v / gib) for v in rc[s]),
                         dv[s]["rreq"], dv[s]["rbytes"] / gib,
                         dv[s]["rbytes"] / 1024 / max(dv[s]["rreq"], 1), dv[s]["coll"]))
    lines += ["", "Both as Megatron-LM runs with --ckpt-assume-constant-structure: "
              "validate_access_integrity only on the first (warm-up) save, torch_dist's "
              "strategy with cached_metadata=True (its global plan reused).",
              "", "blocked = what the training loop waited: the save call (Megatron's own "
              "preprocessing and common.pt, the strategy's planning; torch_dist's "
              "includes forking its writer process) and, for strata, the wait for the "
              "snapshot copy at the next optimizer step, after %.1f s of stand-in compute "
              "(strata copies in the background while training runs; the copy competes for "
              "the 2 cores). The strata checkpoint is written by both ranks, each distinct "
              "piece once; torch_dist writes each rank's main replicas. The resharded load "
              "needs every weight and moment on each TP=1 rank (2x the checkpoint in all): "
              "strata's ranks each read what they need, a chunk two ranks of a node share "
              "through the page cache and counted for one of them (src/engine/dist_load.c); "
              "torch_dist's ranks each read() all of it, the second finding in the page "
              "cache most of what the first brought in. So on one node both read the "
              "checkpoint from storage about once (the read_bytes column) and the cold load "
              "is bounded by the device for both; across nodes torch_dist's ranks would "
              "each read it from storage. Both plan with a few collectives, then each rank "
              "reads alone (the collectives column)." % STEP_S,
              "", "Time to durable and the sync save: both write the checkpoint once "
              "(the data-written column); strata writes with O_DIRECT from its pool's "
              "buffers, torch_dist through the page cache, whose writeback merges its "
              "requests before its fsync (the KiB per write request column)."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(OUT_DIR, "megatron.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "save":
        save_main(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "load":
        load_main(sys.argv[2])
    else:
        main()
