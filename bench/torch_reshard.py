"""strata.torch's resharded load across processes, beside dcp.load (issue 19, part 5):
4 gloo processes save FSDP-style Shard(0) DTensors (BENCH_RESHARD_GB GiB in all, default 2;
32 tensors of [rows, 4096] f32, rows uneven over the ranks), with strata.torch.save and
dcp.save; then 3 processes load them cold (page cache dropped before each load) into
Shard(0) DTensors of the 3-process mesh, strata.torch.load and dcp.load alternating which
goes first, ROUNDS times (default 3). Every load is checked against the saved values.
Prints each load's time (the slowest rank's) and, last, the medians and the ratio
strata / DCP of this run (one run: the machine is shared and noisy; the ratio is what
compares). `STRATA_PROFILE=1`: each strata load on rank 0 under cProfile (top functions
printed).

`--model`: instead, `make bench-torch`'s 4 -> 3 case alone (bench_torch.py's own code): the
4p-fp32 model (FSDP2 x TP, model and optimizer state, BENCH_TORCH_GB GiB) saved once by 4
ranks with strata.torch.save and dcp.save, then bench_torch.job_dist_load on 3 ranks (FSDP2)
ROUNDS times: each a cold DCP and a cold strata load, checked by digest.

    .venv/bin/python bench/torch_reshard.py [--model] [DIR]
"""

import os
import shutil
import statistics
import sys
import time

import torch  # noqa: F401  (imported before forking, no op run: torch_dist.run_job)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_dist  # noqa: E402
import torch_systems as ts  # noqa: E402

GB = float(os.environ.get("BENCH_RESHARD_GB", "2"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
NT = 32
COLS = 4096


def _rows():
    return max(1, int(GB * (1 << 30) / 4 / COLS / NT)) | 1   # odd: uneven shards


def _state(value_of):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows, sd = _rows(), {}
    for i in range(NT):
        shape = (rows, COLS)
        lshape, off = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        local = value_of(i, off[0], lshape[0])
        sd["layers.%d.w" % i] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                   shape=torch.Size(shape),
                                                   stride=(COLS, 1))
    return sd


def _pattern(i, row0, nrows):
    start = row0 * COLS
    return ((torch.arange(start, start + nrows * COLS, dtype=torch.int64) * 2654435761 + i)
            % 1000003).to(torch.float32).reshape(nrows, COLS)


def job_save(root):
    import torch.distributed.checkpoint as dcp
    import strata.torch as st
    sd = _state(_pattern)
    st.save(sd, os.path.join(root, "strata"))
    dcp.save(sd, checkpoint_id=os.path.join(root, "dcp"))
    return True


def job_load(root, rounds):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import strata.torch as st
    rank = dist.get_rank()
    sd = _state(lambda i, r0, n: torch.empty(n, COLS))
    st._group(None)   # the group's gloo groups, once, outside the timings
    out = []
    for rnd in range(rounds):
        order = ("dcp", "strata") if rnd % 2 == 0 else ("strata", "dcp")
        for sysname in order:
            for t in sd.values():
                t._local_tensor.fill_(-1.0)
            dist.barrier()
            dropped = ts.drop_caches() if rank == 0 else True
            dist.barrier()
            prof = None
            if sysname == "strata" and rank == 0 and os.environ.get("STRATA_PROFILE") == "1":
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            cs = 0.0
            if sysname == "dcp":
                dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
            else:
                cs = st.load(sd, os.path.join(root, "strata"))["seconds"]
            t = time.perf_counter() - t0
            if prof:
                prof.disable()
                import io
                import pstats
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
                print(s.getvalue(), file=sys.stderr)
            ok = all(torch.equal(t._local_tensor,
                                 _pattern(i, *_local_rows(t)))
                     for i, t in enumerate(sd.values()))
            out.append((rnd, sysname, t, ok, dropped, cs))
    return out


def _local_rows(t):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    lshape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return off[0], lshape[0]


def job_model_save(root):
    """bench-torch's 4p-fp32 state (FSDP2 x TP), saved by strata and DCP where its loads
    look (bench_torch.LOAD_SOURCE); its digest."""
    import torch.distributed.checkpoint as dcp
    import bench_torch as bb
    import torch_model as tm
    import torch_systems as ts
    import strata.torch as st
    layers = tm.layers_for(bb.GIB, torch.float32)
    model, opt = tm.build("fsdp_tp", layers, torch.float32, world=4)
    tm.Trainer(model, opt).step()
    sd = tm.state_dict(model, opt)
    st.save(sd, os.path.join(root, bb.LOAD_SOURCE["strata"]))
    path = os.path.join(root, bb.LOAD_SOURCE["dcp"])   # as bench-torch's "dcp_save_t4"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True, thread_count=4))
    return ts.digest(sd, tm.tensors)


def main_model(root):
    import bench_torch as bb
    dg = torch_dist.run_job(job_model_save, 4, root, timeout=1200)[0]
    times = {"dcp": [], "strata": []}
    for rnd in range(ROUNDS):
        res = torch_dist.run_job(bb.job_dist_load, 3, "fp32", rnd, root, dg, timeout=1200)
        for name in res[0]["loads"]:
            t = max(r["loads"][name]["s"] for r in res)
            ok = all(r["loads"][name]["ok"] for r in res)
            times[name.split("_")[0]].append(t)
            print("round %d %-14s %.3f s%s" % (rnd, name, t, "" if ok else "  WRONG VALUES"),
                  flush=True)
            if not ok:
                sys.exit("a load gave wrong values")
    md, ms = statistics.median(times["dcp"]), statistics.median(times["strata"])
    print("bench-torch 4 -> 3 (FSDP2), %d rounds: dcp.load median %.3f s, strata.torch.load "
          "median %.3f s, ratio strata/dcp %.2f" % (ROUNDS, md, ms, ms / md))


def main():
    args = [a for a in sys.argv[1:] if a != "--model"]
    root = args[0] if args else os.path.join(os.path.dirname(HERE), "build", "bench-reshard")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    if "--model" in sys.argv[1:]:
        main_model(root)
        shutil.rmtree(root, ignore_errors=True)
        return
    t0 = time.perf_counter()
    torch_dist.run_job(job_save, 4, root, timeout=900)
    print("saved %.1f GiB by 4 ranks (strata and DCP) in %.1f s" % (
        _rows() * COLS * 4 * NT / (1 << 30), time.perf_counter() - t0), flush=True)
    res = torch_dist.run_job(job_load, 3, root, ROUNDS, timeout=1800)
    times = {"dcp": [], "strata": []}
    for k in range(len(res[0])):
        rnd, sysname = res[0][k][0], res[0][k][1]
        t = max(r[k][2] for r in res)
        ok = all(r[k][3] for r in res)
        times[sysname].append(t)
        cs = " (strata's C load %s s)" % ", ".join("%.3f" % r[k][5] for r in res) \
            if sysname == "strata" else ""
        print("round %d %-6s %.3f s%s%s%s" % (rnd, sysname, t, cs, "" if ok else "  WRONG VALUES",
                                             "" if res[0][k][4] else "  (cache not dropped)"),
              flush=True)
        if not ok:
            sys.exit("a load gave wrong values")
    md, ms = statistics.median(times["dcp"]), statistics.median(times["strata"])
    print("4 -> 3 Shard(0), %d rounds: dcp.load median %.3f s, strata.torch.load median %.3f s,"
          " ratio strata/dcp %.2f" % (ROUNDS, md, ms, ms / md))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
