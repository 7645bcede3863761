"""strata.torch's own cost per call: save, async_save (+ wait) and load of a 297-tensor
GPT-like state dict whose tensors are small (1.3 MB in all), so that the engine's I/O is
little and what is left is the Python around it (flattening, registering, checks, the
collectives' Python side). Checkpoints go to a directory in /dev/shm.

    python bench/torch_overhead.py [--ranks 2] [--runs 15] [--profile save|async|load]

Prints, per call kind, the median wall time of --runs calls and the median CPU time of
the calling thread (what strata.torch costs the training loop's thread, engine work on
that thread included, waits not; steadier than wall time on a busy machine). --profile prints cProfile's
top entries for that call (rank 0): the binding's calls into the engine show as
`{method ... of 'strata.Saver' objects}` and the like, the rest is Python. With --ranks N,
N processes on gloo (localhost) call together.
"""

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import tempfile
import time

import torch

LAYERS, D = 24, 32


def gpt_state():
    """297 tensors named as a GPT-2 state dict (24 blocks of 12, embeddings, final norm,
    head, and the blocks' causal-mask buffers of the first 4 blocks), and a few values."""
    g = torch.Generator().manual_seed(0)
    sd = {"wte.weight": torch.randn(256, D, generator=g), "wpe.weight": torch.randn(64, D, generator=g)}
    for i in range(LAYERS):
        p = "h.%d." % i
        for name, shape in (("ln_1.weight", (D,)), ("ln_1.bias", (D,)),
                            ("attn.c_attn.weight", (D, 3 * D)), ("attn.c_attn.bias", (3 * D,)),
                            ("attn.c_proj.weight", (D, D)), ("attn.c_proj.bias", (D,)),
                            ("ln_2.weight", (D,)), ("ln_2.bias", (D,)),
                            ("mlp.c_fc.weight", (D, 4 * D)), ("mlp.c_fc.bias", (4 * D,)),
                            ("mlp.c_proj.weight", (4 * D, D)), ("mlp.c_proj.bias", (D,))):
            sd[p + name] = torch.randn(shape, generator=g)
    sd["ln_f.weight"] = torch.ones(D)
    sd["ln_f.bias"] = torch.zeros(D)
    sd["lm_head.weight"] = torch.randn(256, D, generator=g)
    for i in range(4):
        sd["h.%d.attn.bias" % i] = torch.tril(torch.ones(1, 1, 16, 16))
    assert len(sd) == 297, len(sd)
    return {"model": sd, "step": 1000, "config": {"n_layer": LAYERS, "n_embd": D}}


def one_call(kind, st, state, target, root, i, group):
    path = os.path.join(root, "%s-%s" % (kind, i))
    if kind == "save":
        st.save(state, path, group)
    elif kind == "async":
        h = st.async_save(state, path, group)
        h.wait_snapshot()
        h.wait()
    else:
        st.load(target, os.path.join(root, "ref"), group)


def run(rank, world, args, root, initfile):
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + initfile, rank=rank,
                                world_size=world)
    torch.set_num_threads(1)
    import strata
    import strata.torch as st
    engine = [0.0]
    bare_load = strata.load

    def timed_load(*a, **k):   # the CPU of the engine's load (collectives included)
        c0 = time.thread_time()
        try:
            return bare_load(*a, **k)
        finally:
            engine[0] += time.thread_time() - c0
    strata.load = timed_load
    group = None
    state = gpt_state()
    target = gpt_state()
    st.save(state, os.path.join(root, "ref"), group)
    for i in range(3):   # warm: the group's gloo group and saver, the page cache
        for kind in ("save", "async", "load"):
            one_call(kind, st, state, target, root, "w%d" % i, group)
    out = {}
    for kind in ("save", "async", "load"):
        walls, cpus, engs = [], [], []
        for i in range(args.runs):
            engine[0] = 0.0
            t0, c0 = time.perf_counter(), time.thread_time()
            one_call(kind, st, state, target, root, i, group)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            engs.append(engine[0])
        out[kind] = (statistics.median(walls), statistics.median(cpus))
        if kind == "load":
            eng = statistics.median(engs)
    if args.profile:   # every rank calls (collectives); rank 0 prints
        pr = cProfile.Profile()
        pr.enable()
        for i in range(args.runs):
            one_call(args.profile, st, state, target, root, "p%d" % i, group)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        if rank == 0:
            print(s.getvalue())
    if rank == 0:
        print("ranks %d, 297 tensors, medians of %d calls (wall / the caller's CPU): %s" % (
            world, args.runs, ", ".join("%s %.1f / %.1f ms" % (k, w * 1e3, c * 1e3)
                                        for k, (w, c) in out.items())))
        print("  load: %.1f ms of its CPU in strata.load (the engine, collectives included)"
              % (eng * 1e3))
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--profile", choices=["save", "async", "load"])
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="strata-overhead-", dir="/dev/shm")
    try:
        if args.ranks == 1:
            run(0, 1, args, root, None)
        else:
            import torch.multiprocessing as mp
            mp.spawn(run, args=(args.ranks, args, root, os.path.join(root, "init")),
                     nprocs=args.ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
