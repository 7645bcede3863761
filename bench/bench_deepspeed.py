"""make bench-deepspeed (run by bench-torch): strata's DeepSpeed checkpoint engine beside
DeepSpeed's own in a ZeRO-2 training loop on 2 gloo processes (CPU). Writes
bench/results/deepspeed.md and prints the table.

Engines: strata (strata.deepspeed.enable()), torch (DeepSpeed's default: torch.save per
file), fast (FastCheckpointEngine, "writer": {"type": "python"}: the "fast" type needs the
async_io op, libaio and a GPU build) and decoupled (DecoupledCheckpointEngine: the fast
engine in a helper process, "decoupled": true). Each round starts each engine in fresh
processes (the order rotates) and measures, on rank 0:

    blocked   the time save_checkpoint took (call) plus, for strata, the longest any rank's
              next step waited for the snapshot copy (the engine times its commit hook)
    stall     the time save_checkpoint took (call) plus how much longer than the median
              step (of 2K without a checkpoint) the step after it took: the step where a
              decoupled engine waits (strata: for the snapshot copy; decoupled: for the
              helper to have the files); "K steps" adds the excess of all K steps after the
              save (the background work competing for the CPU; noisy on a shared machine)
    durable   a save_checkpoint outside the loop until its bytes are on disk: strata until
              the tag is committed (DeepSpeed's latest written after it), the others until
              save_checkpoint returned (decoupled: and the next step's commit) and every
              file of the tag was fsync'd (DeepSpeed itself never fsyncs)

Environment: BENCH_DS_GB (training state GiB: model, fp32 master, Adam moments; default 1),
BENCH_DS_ROUNDS (default 3), BENCH_DS_K (default 6), BENCH_DS_ENGINES (default
"strata,torch,fast,decoupled"), BENCH_DIR (default build/bench-deepspeed), BENCH_DS_OUT
(default bench/results).
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
from _launch import launch  # noqa: E402  (the ranks as DeepSpeed's launcher starts them)

GIB = float(os.environ.get("BENCH_DS_GB", "1"))
ROUNDS = int(os.environ.get("BENCH_DS_ROUNDS", "3"))
K = int(os.environ.get("BENCH_DS_K", "6"))
ENGINES = [e for e in os.environ.get("BENCH_DS_ENGINES", "strata,torch,fast,decoupled").split(",")
           if e]
BENCH_DIR = os.path.abspath(os.environ.get("BENCH_DIR", "build/bench-deepspeed"))
OUT_DIR = os.environ.get("BENCH_DS_OUT", os.path.join(HERE, "results"))
WIDTH = 2048


def layers():
    # 16 bytes of state a parameter (fp32 weights, fp32 master, two Adam moments)
    return max(1, round(GIB * (1 << 30) / 16 / (WIDTH * WIDTH + WIDTH)))


# ---- a rank ---------------------------------------------------------------------------------

def rank_main(engine_name, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import deepspeed
    if engine_name == "strata":
        import strata.deepspeed
        strata.deepspeed.enable()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers())])
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
           "steps_per_print": 10 ** 6, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7,
                                 "allgather_bucket_size": 5e7},
           "checkpoint": {"tag_validation": "Ignore"}}
    if engine_name in ("fast", "decoupled"):
        # "data_parallel": without it DeepSpeed 0.19.8 fails without an mpu
        # (AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank')
        cfg["checkpoint"]["writer"] = {"type": "python", "decoupled": engine_name == "decoupled",
                                       "data_parallel": "replica"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    save_dir = os.path.join(BENCH_DIR, "ds-%s" % engine_name)

    def step():
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()

    def steps(n):
        ts = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t)
        return ts

    def fsync_tag(tag):
        for root, _, files in os.walk(os.path.join(save_dir, tag)):
            for f in files:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def latest_is(tag):
        try:
            with open(os.path.join(save_dir, "latest")) as f:
                return f.read() == tag
        except OSError:
            return False

    steps(2)
    med = statistics.median(steps(2 * K))
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(save_dir, tag="loop")
    call = time.perf_counter() - t0
    after = steps(K)
    ce = engine.checkpoint_engine
    # strata: the longest a rank's step waited for the snapshot copy (DeepSpeed's commit)
    wait = torch.tensor([getattr(ce, "snapshot_wait_s", 0.0)], dtype=torch.float64)
    dist.all_reduce(wait, op=dist.ReduceOp.MAX)
    if engine_name == "strata":
        ce.wait()
    elif ce.is_decoupled():
        engine._commit_decoupled_checkpoint()
    # time to durable, outside the loop
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(save_dir, tag="durable")
    if engine_name == "strata":
        if rank == 0:
            while not latest_is("durable"):
                time.sleep(0.002)
        ce.wait()
    else:
        if ce.is_decoupled():
            engine._commit_decoupled_checkpoint()
        fsync_tag("durable")
    dist.barrier()
    durable = time.perf_counter() - t0
    if rank == 0:
        size = 0
        for root, _, files in os.walk(os.path.join(save_dir, "durable")):
            size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        with open(out, "w") as f:
            json.dump({"stall": call + after[0] - med, "call": call,
                       "blocked": call + float(wait[0]),
                       "excess": call + sum(after) - K * med, "durable": durable, "step": med,
                       "bytes": size}, f)
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


# ---- the parent -----------------------------------------------------------------------------

def run_engine(name, out):
    import shutil
    shutil.rmtree(os.path.join(BENCH_DIR, "ds-%s" % name), ignore_errors=True)
    procs = launch([__file__, "rank", name, out], 2, log=lambda r: out + ".log%d" % r,
                   env={"CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2"})  # as its launcher
    failed_at, start = None, time.time()
    while any(p.poll() is None for p in procs):   # a rank that fails may leave the ranks
        if failed_at is None and (any(p.poll() for p in procs) or any(   # waiting forever
                "Error:" in open(out + ".log%d" % r).read() for r in range(2))):
            failed_at = time.time()
        if (failed_at is not None and time.time() - failed_at > 20) or time.time() - start > 1200:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    rcs = [p.wait() for p in procs]
    shutil.rmtree(os.path.join(BENCH_DIR, "ds-%s" % name), ignore_errors=True)
    if any(rcs) or not os.path.exists(out):
        errs = [ln.strip() for r in range(2) for ln in open(out + ".log%d" % r)
                if "Error:" in ln]
        return {"error": "exit %s: %s" % (rcs, errs[0] if errs else "no result")}
    with open(out) as f:
        return json.load(f)


def main():
    os.makedirs(BENCH_DIR, exist_ok=True)
    os.makedirs(OUT_DIR, exist_ok=True)
    results = {e: [] for e in ENGINES}
    for r in range(ROUNDS):
        for e in ENGINES[r % len(ENGINES):] + ENGINES[:r % len(ENGINES)]:
            res = run_engine(e, os.path.join(BENCH_DIR, "result-%s-%d.json" % (e, r)))
            print("round %d %s: %s" % (r, e, res), flush=True)
            results[e].append(res)
    cmd = ("BENCH_DS_GB=%g BENCH_DS_ROUNDS=%d BENCH_DS_K=%d make bench-deepspeed"
           % (GIB, ROUNDS, K))
    lines = ["# DeepSpeed ZeRO-2, 2 gloo processes (CPU): strata's checkpoint engine beside "
             "DeepSpeed's", "",
             "`%s` (bench/bench_deepspeed.py); %d layers of Linear(%d, %d), AdamW; medians of "
             "%d rounds, each engine in fresh processes; a checkpoint every %d steps for the "
             "stall." % (cmd, layers(), WIDTH, WIDTH, ROUNDS, K), "",
             "| engine | checkpoint bytes | step (s) | blocked per checkpoint (s) | "
             "save_checkpoint call (s) | stall: call + step excess (s) | excess over K steps "
             "(s) | time to durable (s) |",
             "|---|---|---|---|---|---|---|---|"]
    med = {}
    for e in ENGINES:
        ok = [x for x in results[e] if "error" not in x]
        if not ok:
            lines.append("| %s | %s | | | | | | |" % (e, results[e][0]["error"].replace("|", "/")[:160]))
            continue
        m = {k: statistics.median(x[k] for x in ok)
             for k in ("blocked", "stall", "call", "excess", "durable", "step", "bytes")}
        med[e] = m
        lines.append("| %s | %.2f GiB | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            e, m["bytes"] / (1 << 30), m["step"], m["blocked"], m["call"], m["stall"],
            m["excess"], m["durable"]))
    if "strata" in med and "torch" in med and med["torch"]["blocked"] > 0:
        lines += ["", "strata / default engine: blocked %.3f, stall (call + step excess) %.3f, "
                  "time to durable %.3f" % (
                      med["strata"]["blocked"] / med["torch"]["blocked"],
                      med["strata"]["stall"] / med["torch"]["stall"],
                      med["strata"]["durable"] / med["torch"]["durable"])]
    lines += ["", "blocked = the time the training loop waited for the checkpoint: the "
              "save_checkpoint call, plus (strata) the longest any rank's next step waited "
              "for the snapshot copy in DeepSpeed's commit hook (timed by the engine, "
              "StrataCheckpointEngine.snapshot_wait_s); DeepSpeed's torch and fast engines "
              "do all their work in the call. stall = call + how much longer the step after "
              "the save took than the median step: besides the blocking it counts the CPU "
              "the background copy, checksums and writes take from training (niced) and the "
              "noise of a shared 2-core machine, where a step varies by a second or more "
              "between runs (a negative excess: steps faster than the median). The fast "
              "engine runs with the python writer "
              "and data_parallel=replica (its fast writer needs the async_io op; without "
              "data_parallel DeepSpeed 0.19.8 fails with no mpu)."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(OUT_DIR, "deepspeed.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        main()
