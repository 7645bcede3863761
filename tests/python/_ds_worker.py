"""A rank of test_deepspeed.py's DeepSpeed runs (2 gloo processes, CPU), one mode a launch:

    ref OUT     each ZeRO stage of STAGES in turn: train STEPS steps uninterrupted, saving
                through strata's engine at step SAVE_AT (lazily: training goes on at once),
                with the state at SAVE_AT and at the end and every loss dumped to OUT; then a
                later save of every stage (STEPS, with 32 MiB of client state), writing
                OUT/started<stage> as each is in flight - the test kills the ranks with SIGKILL
                at a random point after started1
    resume OUT  each stage: a new engine (other initial weights) loads its newest tag
                (DeepSpeed's `latest`) through strata's engine; its state must equal the dump
                of that step bitwise, and training on must give the uninterrupted run's
                losses and final state bitwise. Writes OUT/resume-<rank>.json.
    reuse1 OUT  ZeRO 2: saves tag "a" (committed, latest "a"), saves "a" again (refused with
                ExistsError before anything is written), then saves tag "b" with
                STRATA_DS_TEST_KILL_AT_STUB=b: each rank SIGKILLs itself right after its
                first file of "b" is handed over (a kill inside save_checkpoint)
    reuse2 OUT  a new engine: loads latest ("a", the state reuse1 saved), tag "b" by name
                (not saved: its error), saves "b" again (the interrupted tag: saved,
                latest "b"), then rank 0 makes a copy "c" of "b" without its commit
                record and points latest at it: load_checkpoint raises its error.
                Writes OUT/reuse-<rank>.json.
    reshard OUT on another world size (1 or 3 ranks), each stage of RESHARD: a new engine
                loads tag step<SAVE_AT> (saved by ref on 2 ranks); its fp32 master weights
                and AdamW moments, gathered whole, must equal ref's bitwise, its step, lr
                scheduler and client state ref's, and the losses of training on (the same
                global batch) ref's within 1e-5 relative. Writes OUT/reshard<N>-<rank>.json.

The global batch is GLOBAL samples a step, drawn from the step's seed and split evenly
among the ranks, so that every world size dividing GLOBAL trains on the same data; a
step's loss is the mean over the global batch.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed env://).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

STAGES = (1, 2, 3)
RESHARD = (1, 2, 3)
STEPS, SAVE_AT = 14, 10
VOCAB, DIM, FF, SEQ, BATCH = 37, 23, 45, 7, 3     # odd sizes: uneven ZeRO partitions
GLOBAL = 2 * BATCH        # the global batch: BATCH a rank on 2 ranks, 2 on 3, 6 on 1
CLIENT = {"note": "client", "at": list(range(5))}  # client state of the step-SAVE_AT tag


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, 1, FF, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


def make_engine(stage, seed):
    import deepspeed
    torch.manual_seed(seed)
    model = Model()
    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": 1,
           "train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(),
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 20}}}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_step(engine, step):
    g = torch.Generator().manual_seed(1000 * step)
    n = GLOBAL // dist.get_world_size()
    x = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)[dist.get_rank() * n:][:n]
    loss = nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), x.reshape(-1))
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone() / dist.get_world_size()
    dist.all_reduce(mean)
    return mean.item()


def full_state(engine):
    """{name: tensor} of the fp32 master weights and AdamW moments, gathered whole (a
    collective), named as strata.deepspeed stores them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out["optim.state.%s.%s" % (name, key)] = safe_get_full_optimizer_state(p, key).clone()
    return out


def scalars(engine):
    """The step, lr scheduler and loss scaler, which a resume must restore too."""
    opt = engine.optimizer.optimizer
    steps = sorted({float(s["step"]) for s in opt.state.values() if "step" in s})
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "adam_steps": steps, "lr": [g["lr"] for g in opt.param_groups],
            "sched": {k: v for k, v in engine.lr_scheduler.state_dict().items()},
            "scale": engine.optimizer.loss_scaler.cur_scale}


def flat_state(engine):
    """Everything the engine would checkpoint, as {dotted name: tensor clone or value}."""
    out = {}

    def walk(v, key):
        if isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, "%s.%s" % (key, k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, "%s.%d" % (key, i))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:                                          # LossScaler, fragment_address, ...
            out[key] = (type(v).__name__, repr(sorted(vars(v).items()))
                        if hasattr(v, "__dict__") else repr(v))
    walk(engine.module_state_dict(), "module")
    walk(engine.optimizer.state_dict(), "optim")
    walk({"global_steps": engine.global_steps, "global_samples": engine.global_samples,
          "skipped_steps": engine.skipped_steps}, "engine")
    return out


def diff(a, b):
    """The names whose values differ (bitwise for tensors), or [] if a equals b."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.reshape(-1).view(torch.uint8),
                                    y.reshape(-1).view(torch.uint8)))
        else:
            same = x == y
        if not same:
            bad.append(k)
    return bad


def ref(out):
    import strata.deepspeed
    strata.deepspeed.enable()
    rank = dist.get_rank()
    engines = {}
    for stage in STAGES:
        engine = make_engine(stage, seed=0)
        losses = []
        for step in range(STEPS):
            if step == SAVE_AT:
                engine.save_checkpoint(os.path.join(out, "ck%d" % stage), tag="step%d" % step,
                                       client_state=CLIENT)
                torch.save(flat_state(engine), os.path.join(out, "s%d-%d-r%d.pt" % (stage, step, rank)))
                if stage in RESHARD:
                    full = full_state(engine)
                    if rank == 0:
                        torch.save(full, os.path.join(out, "full%d.pt" % stage))
                        with open(os.path.join(out, "scalars%d.json" % stage), "w") as f:
                            json.dump(scalars(engine), f)
            losses.append(train_step(engine, step))
        torch.save(flat_state(engine), os.path.join(out, "s%d-%d-r%d.pt" % (stage, STEPS, rank)))
        with open(os.path.join(out, "losses%d-r%d.json" % (stage, rank)), "w") as f:
            json.dump(losses, f)
        engines[stage] = engine
    dist.barrier()
    big = {"big": torch.arange(8 << 20, dtype=torch.float32) * (rank + 1)}
    t0 = time.time()
    for stage in STAGES:
        engines[stage].save_checkpoint(os.path.join(out, "ck%d" % stage), tag="step%d" % STEPS,
                                       client_state=big)
        if rank == 0:
            with open(os.path.join(out, "started%d" % stage), "w") as f:
                f.write("%.3f" % (time.time() - t0))
    for stage in STAGES:
        engines[stage].checkpoint_engine.wait()
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "saved"), "w") as f:
            f.write("%.3f" % (time.time() - t0))
    time.sleep(600)        # the test kills the ranks before this ends


def resume_one(out, stage, tag):
    """A new engine resumed from tag (None: DeepSpeed's latest), checked, trained on."""
    import strata
    rank = dist.get_rank()
    ck = os.path.join(out, "ck%d" % stage)
    engine = make_engine(stage, seed=1)
    path, client = engine.load_checkpoint(ck, tag=tag)
    tag = os.path.basename(os.path.dirname(path))
    at = int(tag[len("step"):])
    r = {"tag": tag, "path": path}
    r["state_diff"] = diff(flat_state(engine),
                           torch.load(os.path.join(out, "s%d-%d-r%d.pt" % (stage, at, rank)),
                                      weights_only=False))
    later = os.path.join(ck, "step%d" % STEPS, "strata")
    try:
        strata.Checkpoint(later)
        r["later"] = "committed"
    except strata.Error as e:
        r["later"] = type(e).__name__
    with open(os.path.join(out, "losses%d-r%d.json" % (stage, rank))) as f:
        want = json.load(f)
    r["losses"] = [train_step(engine, step) for step in range(at, STEPS)]
    r["losses_want"] = want[at:]
    r["final_diff"] = diff(flat_state(engine),
                           torch.load(os.path.join(out, "s%d-%d-r%d.pt" % (stage, STEPS, rank)),
                                      weights_only=False))
    engine.destroy()
    return r


def reshard(out):
    import strata.deepspeed
    strata.deepspeed.enable()
    rank, ws = dist.get_rank(), dist.get_world_size()
    report = {}
    for stage in RESHARD:
        engine = make_engine(stage, seed=1)
        path, client = engine.load_checkpoint(os.path.join(out, "ck%d" % stage),
                                              tag="step%d" % SAVE_AT)
        r = {"path": path, "client": {k: client.get(k) for k in CLIENT} == CLIENT}
        want = torch.load(os.path.join(out, "full%d.pt" % stage))
        r["full_diff"] = diff(full_state(engine), want)
        with open(os.path.join(out, "scalars%d.json" % stage)) as f:
            r["scalars_want"] = json.load(f)
        r["scalars"] = json.loads(json.dumps(scalars(engine)))
        with open(os.path.join(out, "losses%d-r0.json" % stage)) as f:
            r["losses_want"] = json.load(f)[SAVE_AT:]
        r["losses"] = [train_step(engine, step) for step in range(SAVE_AT, STEPS)]
        engine.destroy()
        report[stage] = r
    with open(os.path.join(out, "reshard%d-%d.json" % (ws, rank)), "w") as f:
        json.dump(report, f, indent=1)


def resume(out):
    import strata.deepspeed
    strata.deepspeed.enable()
    rank = dist.get_rank()
    report = {}
    for stage in STAGES:
        ck = os.path.join(out, "ck%d" % stage)
        with open(os.path.join(ck, "latest")) as f:
            tag = f.read()
        report[stage] = resume_one(out, stage, None)
        assert report[stage]["tag"] == tag
        if tag != "step%d" % SAVE_AT:     # the later save committed: step 10's too, by tag
            report["%d-by-tag" % stage] = resume_one(out, stage, "step%d" % SAVE_AT)
    with open(os.path.join(out, "resume-%d.json" % rank), "w") as f:
        json.dump(report, f, indent=1)


def _error_of(call):
    import strata
    try:
        call()
        return "ok"
    except strata.Error as e:
        return "%s: %s" % (type(e).__name__, e)


def reuse1(out):
    import strata.deepspeed
    strata.deepspeed.enable()
    rank = dist.get_rank()
    ck = os.path.join(out, "reuse")
    engine = make_engine(2, seed=0)
    train_step(engine, 0)
    engine.save_checkpoint(ck, tag="a")
    engine.checkpoint_engine.wait()
    torch.save(flat_state(engine), os.path.join(out, "reuse-a-r%d.pt" % rank))
    dist.barrier()
    stubs = {n: os.stat(os.path.join(ck, "a", n)).st_mtime_ns
             for n in os.listdir(os.path.join(ck, "a")) if n != "strata"}
    again = _error_of(lambda: engine.save_checkpoint(ck, tag="a"))
    same = stubs == {n: os.stat(os.path.join(ck, "a", n)).st_mtime_ns
                     for n in os.listdir(os.path.join(ck, "a")) if n != "strata"}
    with open(os.path.join(out, "reuse1-%d.json" % rank), "w") as f:
        json.dump({"again": again, "stubs_untouched": same}, f)
    dist.barrier()
    train_step(engine, 1)
    os.environ["STRATA_DS_TEST_KILL_AT_STUB"] = "b"
    engine.save_checkpoint(ck, tag="b")     # never returns: SIGKILL after the first stub


def reuse2(out):
    import shutil
    import strata.deepspeed
    strata.deepspeed.enable()
    rank = dist.get_rank()
    ck = os.path.join(out, "reuse")
    r = {"b_files": sorted(os.listdir(os.path.join(ck, "b")))}
    engine = make_engine(2, seed=1)
    path, _ = engine.load_checkpoint(ck)
    r["latest"] = os.path.basename(os.path.dirname(path))
    r["a_diff"] = diff(flat_state(engine), torch.load(os.path.join(out, "reuse-a-r%d.pt" % rank),
                                                      weights_only=False))
    r["b_by_tag"] = _error_of(lambda: engine.load_checkpoint(ck, tag="b"))
    train_step(engine, 1)
    engine.save_checkpoint(ck, tag="b")
    engine.checkpoint_engine.wait()
    want = flat_state(engine)
    dist.barrier()
    with open(os.path.join(ck, "latest")) as f:
        r["latest_after"] = f.read()
    dist.barrier()  # every rank has read it before rank 0 rewrites it
    if rank == 0:
        shutil.copytree(os.path.join(ck, "b"), os.path.join(ck, "c"))
        os.remove(os.path.join(ck, "c", "strata", "COMMIT"))
        with open(os.path.join(ck, "latest"), "w") as f:
            f.write("c")
    dist.barrier()
    other = make_engine(2, seed=2)
    r["latest_uncommitted"] = _error_of(lambda: other.load_checkpoint(ck))
    path, _ = other.load_checkpoint(ck, tag="b")
    r["b_diff"] = diff(flat_state(other), want)
    with open(os.path.join(out, "reuse-%d.json" % rank), "w") as f:
        json.dump(r, f, indent=1)


def run_rank(main, *args):
    """A rank's life: gloo up, main(*args), every rank at a barrier before the group goes,
    then out without the interpreter's teardown. A DeepSpeed rank that has written its
    report and left the group can still abort in the C++ static destructors that teardown
    runs ("terminate called without an active exception", SIGABRT: seen on rank 1 of
    test_ds_both_ways's back launch, DeepSpeed's own engine, strata not enabled, even after
    the barrier), which would fail a test whose work is done; what the test checks is the
    files and reports written before this point."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    main(*args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_rank({"ref": ref, "resume": resume, "reshard": reshard, "reuse1": reuse1,
              "reuse2": reuse2}[sys.argv[1]], sys.argv[2])
