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
STEPS, SAVE_AT = 14, 10
VOCAB, DIM, FF, SEQ, BATCH = 37, 23, 45, 7, 3     # odd sizes: uneven ZeRO partitions


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
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_step(engine, step):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss = nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), x.reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss.item()


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
                engine.save_checkpoint(os.path.join(out, "ck%d" % stage), tag="step%d" % step)
                torch.save(flat_state(engine), os.path.join(out, "s%d-%d-r%d.pt" % (stage, step, rank)))
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


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    {"ref": ref, "resume": resume}[sys.argv[1]](sys.argv[2])
    dist.destroy_process_group()
