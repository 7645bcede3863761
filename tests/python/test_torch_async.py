"""async_save: after wait_snapshot() the caller may change its tensors at once - the
optimizer step that follows never leaks into the checkpoint, which holds the pre-step
values bitwise. In one process (no process group) and on 2 ranks with FSDP2."""

import time

import pytest
import torch
import torch.nn as nn

import strata.torch as st
from _tensors import bits

import _dist


def flat(d, prefix=""):
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        key = "%s.%s" % (prefix, k) if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, (dict, list, tuple)):
            out.update(flat(v, key))
    return out


def make(width=512, depth=12, seed=0):
    """~3M parameters (12 MB) and an AdamW with state after one step, and grads ready for
    the next."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, width)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()     # grads for the step after the snapshot
    return model, opt


def snapshot_then_step(model, opt, path, state_fn, group=None):
    """async_save, wait_snapshot, optimizer.step() at once; returns (pre-step copies,
    post-step copies, the handle's stats, seconds to the snapshot, seconds to durable)."""
    state = state_fn(model, opt)
    pre = {k: v.detach().clone() for k, v in flat(state).items()}
    t0 = time.perf_counter()
    h = st.async_save(state, path, group, step=3)
    h.wait_snapshot()
    t_snap = time.perf_counter() - t0
    opt.step()                               # at once: before the save is durable
    with torch.no_grad():
        for p in model.parameters():         # and more: scribble over every parameter
            p.mul_(-3.0)
    post = {k: v.detach().clone() for k, v in flat(state_fn(model, opt)).items()}
    stats = h.wait()
    t_durable = time.perf_counter() - t0
    assert h.done()
    return pre, post, stats, t_snap, t_durable


def plain_state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def test_async_save_snapshot_then_step_one_process(tmp_path, figures):
    model, opt = make()
    path = str(tmp_path / "ck")
    pre, post, stats, t_snap, t_dur = snapshot_then_step(model, opt, path, plain_state)
    changed = [k for k in pre if not torch.equal(bits(pre[k]), bits(post[k]))]
    assert len(changed) > len(pre) // 2, "the step changed too little to show anything"
    model2, opt2 = make(seed=1)
    back = plain_state(model2, opt2)
    st.load(back, path)
    got = flat(back)
    assert sorted(got) == sorted(pre)
    leaked = [k for k in pre if not torch.equal(bits(got[k]), bits(pre[k]))]
    assert not leaked, "the checkpoint does not hold the pre-step values of %s" % leaked
    figures("async_save, one process", "%.1f MB: snapshot after %.3f s, durable after %.3f s"
            % (sum(v.numel() * v.element_size() for v in pre.values()) / 1e6, t_snap, t_dur))


def test_async_save_done_and_wait_twice(tmp_path):
    t = {"a": torch.arange(1000.0)}
    h = st.async_save(t, str(tmp_path / "ck"))
    h.wait_snapshot()
    h.wait_snapshot()
    s1 = h.wait()
    assert h.done()
    assert isinstance(s1, dict)
    h.wait()
    back = {"a": torch.zeros(1000)}
    st.load(back, str(tmp_path / "ck"))
    assert torch.equal(back["a"], torch.arange(1000.0))


def test_a_pool_given_is_freed_with_the_callers_last_reference(tmp_path):
    """strata.torch keeps no pool the caller passed alive: once the save is waited for and
    the caller drops the pool, it goes (a pool is its bytes: 2 GiB in a training run)."""
    import gc
    import weakref

    import strata
    t = {"a": torch.arange(1000.0)}
    refs = []
    for i in range(3):
        pool = strata.Pool(8 << 20)
        refs.append(weakref.ref(pool))
        st.async_save(t, str(tmp_path / ("ck%d" % i)), pool=pool).wait()
        del pool
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    back = {"a": torch.zeros(1000)}
    st.load(back, str(tmp_path / "ck2"))
    assert torch.equal(back["a"], torch.arange(1000.0))


def test_no_saver_outlives_its_save_without_a_group(tmp_path):
    """Without pool= and a process group, the saver a save makes (and the pool it makes,
    up to 1 GiB) is freed once the save is waited for: none is kept for the process."""
    import gc

    import strata
    t = {"a": torch.arange(1000.0)}
    st.save(t, [str(tmp_path / "s0"), str(tmp_path / "s1")])      # tiers: through a pool
    h = st.async_save(t, str(tmp_path / "a0"))
    h.wait()
    gc.collect()
    assert [o for o in gc.get_objects() if type(o) is strata.Saver] == []
    back = {"a": torch.zeros(1000)}
    st.load(back, str(tmp_path / "a0"))
    assert torch.equal(back["a"], torch.arange(1000.0))


def test_async_save_error_arrives_at_wait(tmp_path):
    import strata
    path = str(tmp_path / "ck")
    st.save({"a": torch.ones(3)}, path)
    # a committed checkpoint is never replaced: the save fails (at start or at wait)
    with pytest.raises(strata.Error):
        h = st.async_save({"a": torch.zeros(3)}, path)
        h.wait_snapshot()
        h.wait()
    back = {"a": torch.zeros(3)}
    st.load(back, path)
    assert torch.equal(back["a"], torch.ones(3))


def fsdp_async(path):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(257, 255) if i % 2 == 0 else nn.Linear(255, 257)
                                for i in range(8)])
        for m in model:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 257)
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        model(x).square().mean().backward()
        return model, opt

    def state(model, opt):
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def full(d):
        from torch.distributed.tensor import DTensor
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v.detach().clone())
                for k, v in flat(d).items()}

    model, opt = build(0)
    s = state(model, opt)
    pre_full = full(s)
    h = st.async_save(s, path, step=3)
    h.wait_snapshot()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    post_full = full(state(model, opt))
    h.wait()
    model2, opt2 = build(1)
    s2 = state(model2, opt2)
    st.load(s2, path)
    got = full(s2)
    leaked = [k for k in pre_full if not torch.equal(bits(got[k]), bits(pre_full[k]))]
    changed = [k for k in pre_full if not torch.equal(bits(post_full[k]), bits(pre_full[k]))]
    return leaked, len(changed), len(pre_full)


@pytest.mark.slow
def test_async_save_snapshot_then_step_fsdp_two_ranks(tmp_path):
    res = _dist.run(fsdp_async, 2, str(tmp_path / "ck"), timeout=120)
    for rank, (leaked, changed, total) in enumerate(res):
        assert changed > total // 2, "the step changed too little to show anything"
        assert not leaked, "rank %d: the checkpoint does not hold the pre-step values of %s" % (
            rank, leaked)


def replace_two_ranks(path):
    import os
    import torch.distributed as dist
    r = dist.get_rank()
    out = []
    for v in (1, 2, 3):
        sd = {"w": torch.arange(4099, dtype=torch.float32) * v,
              "mine": st.per_rank(torch.full((7,), float(10 * v + r)))}
        if v == 1:
            st.save(sd, path, step=v)
        elif v == 2:
            st.save(sd, path, step=v, replace=True)
        else:
            h = st.async_save(sd, path, step=v, replace=True)
            h.wait_snapshot()
            h.wait()
        back = {"w": torch.zeros(4099), "mine": st.per_rank(torch.zeros(7))}
        st.load(back, path)
        out.append(bool(torch.equal(back["w"], sd["w"].detach()))
                   and bool(torch.equal(back["mine"].value, torch.full((7,), float(10 * v + r)))))
    dist.barrier()
    return out, sorted(os.listdir(os.path.dirname(path)))


def test_replace_two_ranks(tmp_path):
    """replace=True on 2 ranks (save and async_save): rank 0 swaps the new checkpoint in
    after the commit; every rank loads each version in turn; nothing is left beside it."""
    path = str(tmp_path / "latest")
    for out, names in _dist.run(replace_two_ranks, 2, path):
        assert out == [True, True, True]
        assert names == ["latest"]


# ---- background commits (issue 17) -----------------------------------------------------

def _bg_state(rank, size):
    """A replicated tensor (the same on every rank), one each rank saves for itself, and a
    value; odd sizes."""
    g = torch.Generator().manual_seed(1234)
    mine = torch.Generator().manual_seed(77 + rank)
    return {"w": torch.randn(257, 63, generator=g),
            "b": torch.randn(1001, generator=g).to(torch.bfloat16),
            "own": st.per_rank(torch.randn(311, generator=mine)),
            "cfg": {"size": size, "name": "bg"}}


def killed_when_done(path, flags):
    """async_save, then no wait(): poll done() until True (the commit thread committed it),
    leave a flag file, and SIGKILL this rank (as a job dies)."""
    import os
    import signal
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    h = st.async_save(_bg_state(rank, size), path, step=7)
    h.wait_snapshot()
    t0 = time.monotonic()
    while not h.done():
        if time.monotonic() - t0 > 30:
            raise AssertionError("rank %d: done() still False 30 s after the snapshot, with no "
                                 "wait(): the commit waits for the caller" % rank)
        time.sleep(0.002)
    with open(os.path.join(flags, "done%d" % rank), "w") as f:
        f.write("%.4f" % (time.monotonic() - t0))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_all_ranks_killed_after_done_without_wait_the_checkpoint_is_committed(tmp_path,
                                                                              nprocs):
    """DCP users wait for the previous save just before the next; a job dies between. Once
    done() is True the save is committed, with no wait() on any rank: every rank is
    SIGKILLed there, and the checkpoint probes committed and loads bitwise."""
    import strata
    path, flags = str(tmp_path / "ck"), tmp_path / "flags"
    flags.mkdir()
    with pytest.raises(_dist.RankFailure) as ei:
        _dist.run(killed_when_done, nprocs, path, str(flags), timeout=120)
    assert "Traceback" not in str(ei.value), str(ei.value)
    for r in range(nprocs):
        assert (flags / ("done%d" % r)).exists(), "rank %d died before done() was True" % r
    assert strata.probe(path)["committed"]
    for r in range(nprocs):
        want = _bg_state(r, nprocs)
        back = {"w": torch.zeros(257, 63), "b": torch.zeros(1001, dtype=torch.bfloat16),
                "own@rank%d" % r: torch.zeros(311), "cfg": None}
        st.load(back, path)
        assert torch.equal(bits(back["w"]), bits(want["w"]))
        assert torch.equal(bits(back["b"]), bits(want["b"]))
        assert torch.equal(bits(back["own@rank%d" % r]), bits(want["own"].value))
        assert back["cfg"] == {"size": nprocs, "name": "bg"}


def dies_in_commit(prev, path, victim, out, stop=False):
    """A committed save to prev; then an async save whose commit thread's first collective
    SIGKILLs rank `victim` (with stop, SIGSTOPs it: a peer that neither answers nor closes
    its connections, under a 5 s time limit of the caller's group). The others report when
    done() turned True, the error wait() raised, and what probe() says (then, with stop,
    kill the stopped rank)."""
    import datetime
    import json
    import os
    import signal
    import torch.distributed as dist
    import strata
    rank, size = dist.get_rank(), dist.get_world_size()
    if stop:   # before strata.torch makes its groups, which take this limit
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))
    st.save(_bg_state(rank, size), prev, step=1)
    group = st._group(None)
    if rank == victim:
        real = group._allgather

        def dying(send, recv, group=None):
            if group is not None:   # a commit thread's collective
                if stop:
                    with open(os.path.join(out, "victim.pid"), "w") as f:
                        f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP if stop else signal.SIGKILL)
            return real(send, recv, group)
        group._allgather = dying
    h = st.async_save(_bg_state(rank, size), path, step=2)
    t0 = time.monotonic()
    h.wait_snapshot()
    while not h.done() and time.monotonic() - t0 < 60:
        time.sleep(0.005)
    seconds = time.monotonic() - t0
    try:
        h.wait()
        err = None
    except strata.Error as e:
        err = type(e).__name__
    rec = {"rank": rank, "done": h.done(), "seconds": seconds, "error": err,
           "probe": strata.probe(path), "prev": strata.probe(prev)}
    with open(os.path.join(out, "rank%d.json" % rank), "w") as f:
        json.dump(rec, f)
    if stop:
        with open(os.path.join(out, "victim.pid")) as f:
            os.kill(int(f.read()), signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_rank_in_the_background_commit_times_out_with_the_callers_limit(tmp_path):
    """A peer stopped (SIGSTOP) in the commit: the commit thread's own gloo group has the
    caller's group's time limit (5 s here; torch's default for new groups is 30 minutes),
    so the other rank's done() turns True within it, wait() raises AbortedError and nothing
    is committed."""
    import json
    import strata
    prev, path, out = str(tmp_path / "prev"), str(tmp_path / "ck"), tmp_path / "out"
    out.mkdir()
    with pytest.raises(_dist.RankFailure):
        _dist.run(dies_in_commit, 2, prev, path, 1, str(out), stop=True, timeout=90)
    rec = json.loads((out / "rank0.json").read_text())
    assert rec["done"] and rec["seconds"] < 40, rec
    assert rec["error"] == "AbortedError", rec
    assert not strata.probe(path)["has_commit"]
    assert strata.probe(prev)["committed"]


@pytest.mark.slow
@pytest.mark.parametrize("nprocs,victim", [(2, 1), (3, 0)])
def test_a_rank_dies_during_the_background_commit(tmp_path, nprocs, victim, figures):
    """No rank hangs: the others' commit threads fail (gloo sees the peer gone), done()
    turns True, wait() raises AbortedError, and nothing is committed (no commit record);
    the previous checkpoint still loads."""
    import json
    import strata
    prev, path, out = str(tmp_path / "prev"), str(tmp_path / "ck"), tmp_path / "out"
    out.mkdir()
    with pytest.raises(_dist.RankFailure):
        _dist.run(dies_in_commit, nprocs, prev, path, victim, str(out), timeout=120)
    recs = [json.loads((out / ("rank%d.json" % r)).read_text())
            for r in range(nprocs) if r != victim]
    assert len(recs) == nprocs - 1
    for rec in recs:
        assert rec["done"], rec
        assert rec["error"] == "AbortedError", rec
        assert not rec["probe"]["committed"] and not rec["probe"]["has_commit"], rec
        assert rec["prev"]["committed"], rec
    p = strata.probe(path)
    assert not p["committed"] and not p["has_commit"]
    back = {"w": torch.zeros(257, 63), "b": torch.zeros(1001, dtype=torch.bfloat16)}
    st.load(back, prev)
    assert torch.equal(bits(back["w"]), bits(_bg_state(0, nprocs)["w"]))
    figures("a rank killed in the commit (%d ranks, rank %d)" % (nprocs, victim),
            "the others' done() True after %s s" % ", ".join("%.2f" % r["seconds"] for r in recs))


def collectives_warn_nothing(path):
    """Every collective strata.torch runs (the agreement, save, async save with its
    background commit, load) with warnings turned into errors."""
    import warnings
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        st.save(_bg_state(rank, size), path + "-sync")
        st.async_save(_bg_state(rank, size), path + "-async").wait()
        back = {"w": torch.zeros(257, 63)}
        st.load(back, path + "-async")
    return bool(torch.equal(back["w"], _bg_state(rank, size)["w"]))


@pytest.mark.slow
def test_no_deprecation_warning_from_the_collectives(tmp_path):
    """torch 2.13 deprecates all_gather_into_tensor (for all_gather_single): strata.torch's
    collectives warn nothing on a multi-rank group."""
    assert _dist.run(collectives_warn_nothing, 2, str(tmp_path / "ck"), timeout=120) == [True,
                                                                                         True]
