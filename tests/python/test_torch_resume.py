"""Resume: a small transformer trained on 4 processes as FSDP2 x TP=2 with AdamW for 20 steps,
saved at step 10 (model, optimizer, RNG per rank, a data-loader position per rank, the step),
resumes from the checkpoint on 2 processes as FSDP2=2, TP=1 and trains to step 20.

- After the load, parameters and optimizer state are bitwise those saved (full tensors,
  gathered with DTensor.full_tensor(); the first run writes them to a file at step 10).
- Each rank's RNG state and data-loader position come back as that rank saved them.
- Losses at steps 11-20 match the uninterrupted run's within 1e-5 relative. The data is a
  function of the global step: every step's global batch is split over the dp ranks (dp = 2
  in both runs) and the loss reported is the mean over the global batch.

Odd sizes: hidden 63, 5 heads (63 is not divisible by 5: heads of dim 13, projected from 63 to
65 and back), MLP 125, vocabulary 1001, 3 layers. Tensor parallel: attention q/k/v column-wise
(outputs gathered: 5 heads cannot split evenly over 2 ranks), o row-wise; MLP fc1 column-wise
(sharded activations), fc2 row-wise; embedding row-wise, LM head column-wise; norms and the
position table replicated over TP. FSDP2 shards all of it over dp; torch makes the TP-sharded
parameters [_StridedShard(0, sf=2), Shard(0)] (or [Shard(0), Shard(1)]).
"""

import os
import random
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import _dist
from _tensors import bits

HIDDEN, HEADS, HEAD_DIM, VOCAB, LAYERS, MLP = 63, 5, 13, 1001, 3, 125
SEQ, BATCH, STEPS, SAVE_AT = 12, 8, 20, 10
LR = 3e-3
REL_TOL = 1e-5


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.v = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, MLP)
        self.fc2 = nn.Linear(MLP, HIDDEN)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build(dp, tp):
    """The model on dp x tp ranks (same initial values everywhere), its AdamW and dp mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Transformer()
    if tp > 1:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        plan = {"tok": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(LAYERS):
            for n in "qkv":
                plan["layers.%d.attn.%s" % (i, n)] = ColwiseParallel(output_layouts=Replicate())
            plan["layers.%d.attn.o" % i] = RowwiseParallel(input_layouts=Replicate())
            plan["layers.%d.fc1" % i] = ColwiseParallel(use_local_output=False)
            plan["layers.%d.fc2" % i] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    else:
        dp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, opt, dp_mesh


def batch(step, dp_rank, dp):
    """This dp rank's part of the global batch of `step`: sequences that follow a rule
    (next = 7 * token + 3 mod V) with some noise, so that the loss falls."""
    g = torch.Generator().manual_seed(1000 + step)
    first = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    toks = [first]
    for _ in range(SEQ):
        toks.append((toks[-1] * 7 + 3) % VOCAB)
    toks = torch.cat(toks, dim=1)
    noise = torch.rand(toks.shape, generator=g) < 0.1
    toks = torch.where(noise, torch.randint(0, VOCAB, toks.shape, generator=g), toks)
    per = BATCH // dp
    toks = toks[dp_rank * per:(dp_rank + 1) * per]
    return toks[:, :-1], toks[:, 1:]


def train_step(model, opt, step, dp_rank, dp):
    """One step; returns the loss over the global batch (the same on every rank)."""
    import torch.distributed as dist
    x, y = batch(step, dp_rank, dp)
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    # every rank of a dp group holds the same loss: the mean over the world is the mean over dp
    total = loss.detach().clone()
    dist.all_reduce(total)
    # per-rank randomness (as dropout would use): each rank's generator moves differently
    torch.rand(dist.get_rank() + 3)
    random.random()
    return total.item() / dist.get_world_size()


def full_state(model, opt):
    """{dotted key: full tensor} of get_state_dict(model, opt), plus the non-tensor values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor
    msd, osd = get_state_dict(model, opt)
    out, values = {}, {}

    def walk(v, key):
        if isinstance(v, DTensor):
            out[key] = v.full_tensor()
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().clone()
        elif isinstance(v, dict):
            for k, c in v.items():
                walk(c, "%s.%s" % (key, k))
        elif isinstance(v, (list, tuple)):
            for i, c in enumerate(v):
                walk(c, "%s.%d" % (key, i))
        else:
            values[key] = v
    walk(msd, "model")
    walk(osd, "optim")
    return out, values


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


# ---- the runs ----------------------------------------------------------------------------------

def first_run(ckpt, ref):
    """4 ranks, FSDP2 x TP=2: 20 steps, saving at step 10."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import strata.torch as st
    rank = dist.get_rank()
    model, opt, dp_mesh = build(2, 2)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    torch.manual_seed(100 + rank)            # every rank its own random stream
    random.seed(200 + rank)
    placements = sorted({str(p.placements) for p in model.parameters()})
    losses, save_s, stats = [], None, None
    for step in range(1, STEPS + 1):
        losses.append(train_step(model, opt, step, dp_rank, dp))
        if step == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            loader = {"rank": rank, "dp_rank": dp_rank, "next_step": step + 1,
                      "samples_seen": step * BATCH}
            state = {"model": msd, "optim": osd, "rng": st.rng_state(),
                     "loader": st.per_rank(loader), "step": step}
            mine = {"cpu_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                    "loader": loader}
            dist.barrier()
            t0 = time.perf_counter()
            stats = st.save(state, ckpt, step=step)
            save_s = time.perf_counter() - t0
            # the reference: what was saved, as full tensors (collective), and this rank's own
            full, values = full_state(model, opt)
            if rank == 0:
                torch.save({"full": full, "values": values}, ref + ".full")
            torch.save(mine, ref + ".rank%d" % rank)
            # draw after the save: the saved RNG state must give these numbers after a resume
            mine_next = torch.rand(5)
            torch.save(mine_next, ref + ".next%d" % rank)
            torch.set_rng_state(mine["cpu_rng"])
            random.setstate(mine["py_rng"])
    return {"losses": losses, "save_s": save_s, "stats": stats, "placements": placements}


def second_run(ckpt, ref):
    """2 ranks, FSDP2=2, TP=1: load the step-10 checkpoint, train to step 20."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import strata.torch as st
    rank = dist.get_rank()
    torch.manual_seed(999)                   # not what was saved: the load must restore it
    random.seed(999)
    model, opt, dp_mesh = build(2, 1)
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    msd, osd = get_state_dict(model, opt)    # allocates the optimizer's state to load into
    state = {"model": msd, "optim": osd, "rng": st.rng_state(), "loader": st.per_rank(None),
             "step": 0}
    dist.barrier()
    t0 = time.perf_counter()
    stats = st.load(state, ckpt)
    load_s = time.perf_counter() - t0
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    st.set_rng_state(state["rng"])
    problems = []
    if state["step"] != SAVE_AT:
        problems.append("step is %r, saved %d" % (state["step"], SAVE_AT))

    # bitwise: parameters and optimizer state, as full tensors, against those saved
    full, values = full_state(model, opt)
    saved = torch.load(ref + ".full")
    if sorted(full) != sorted(saved["full"]):
        problems.append("keys differ: only saved %s, only loaded %s" % (
            sorted(set(saved["full"]) - set(full)), sorted(set(full) - set(saved["full"]))))
    compared = 0
    for key in sorted(set(full) & set(saved["full"])):
        a, b = full[key], saved["full"][key]
        compared += 1
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            problems.append("%s: loaded %s%s differs from saved %s%s" % (
                key, a.dtype, list(a.shape), b.dtype, list(b.shape)))
    for key, v in saved["values"].items():
        if values.get(key) != v:
            problems.append("%s: loaded %r, saved %r" % (key, values.get(key), v))

    # per rank: this rank's RNG and data-loader position, as rank `rank` of the first run saved
    mine = torch.load(ref + ".rank%d" % rank)
    loader = state["loader"].value if isinstance(state["loader"], st.PerRank) else state["loader"]
    if loader != mine["loader"]:
        problems.append("rank %d: loader position %r, this rank saved %r"
                        % (rank, loader, mine["loader"]))
    if not torch.equal(torch.get_rng_state(), mine["cpu_rng"]):
        problems.append("rank %d: the CPU RNG state is not the one this rank saved" % rank)
    if random.getstate() != mine["py_rng"]:
        problems.append("rank %d: Python's RNG state is not the one this rank saved" % rank)
    nxt = torch.rand(5)
    if not torch.equal(nxt, torch.load(ref + ".next%d" % rank)):
        problems.append("rank %d: the restored RNG draws other numbers" % rank)
    torch.set_rng_state(mine["cpu_rng"])

    losses = {}
    for step in range(loader["next_step"], STEPS + 1):
        losses[step] = train_step(model, opt, step, dp_rank, dp)
    return {"losses": losses, "load_s": load_s, "stats": stats, "problems": problems,
            "compared": compared}


@pytest.mark.slow
def test_resume_fsdp_tp4_to_fsdp2(tmp_path, figures):
    ckpt = str(tmp_path / "ckpt")
    ref = str(tmp_path / "ref")
    t0 = time.perf_counter()
    first = _dist.run(first_run, 4, ckpt, ref, timeout=300)
    t1 = time.perf_counter()
    second = _dist.run(second_run, 2, ckpt, ref, timeout=300)
    t2 = time.perf_counter()

    import strata
    info = strata.probe(ckpt)
    assert info["committed"] and info["step"] == SAVE_AT, info
    uninterrupted = first[0]["losses"]
    for r in first[1:]:
        assert r["losses"] == uninterrupted   # the global loss: the same on every rank
    problems = [p for r in second for p in r["problems"]]
    assert second[0]["compared"] > 0
    assert not problems, "\n".join(problems)

    resumed = second[0]["losses"]
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    rel = {s: abs(resumed[s] - uninterrupted[s - 1]) / abs(uninterrupted[s - 1]) for s in resumed}
    worst = max(rel.values())
    stats = first[0]["stats"]
    figures("resume", "FSDP2 x TP=2 on 4 ranks -> FSDP2 on 2 ranks; placements saved: %s"
            % ", ".join(first[0]["placements"]))
    figures("resume", "losses 1..20: %s" % " ".join("%.4f" % x for x in uninterrupted))
    figures("resume", "max relative loss difference, steps 11-20: %.3g (tolerance %g)"
            % (worst, REL_TOL))
    figures("resume", "checkpoint: %d bytes on disk (stats: data_bytes %s, bytes %s); "
            "save %.3f s (slowest rank), load %.3f s (slowest rank)"
            % (dir_bytes(ckpt), stats.get("data_bytes"), stats.get("bytes"),
               max(r["save_s"] for r in first), max(r["load_s"] for r in second)))
    figures("resume", "%d tensors compared bitwise after the load; runs %.1f s + %.1f s"
            % (second[0]["compared"], t1 - t0, t2 - t1))
    for r in second[1:]:
        assert r["losses"] == resumed
    assert uninterrupted[-1] < uninterrupted[0], "the loss does not fall: %r" % uninterrupted
    bad = {s: (uninterrupted[s - 1], resumed[s]) for s in rel if rel[s] > REL_TOL}
    assert not bad, "losses differ after the resume (step: uninterrupted, resumed): %r" % bad
