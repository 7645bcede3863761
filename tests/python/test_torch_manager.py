"""CheckpointManager: tiers fastest first, <tier>/step-NNNNNNNN on every tier, retention
(keep K per tier), latest(), load(state, step=None) from the newest committed step on the
fastest tier holding it; async saves wait for the previous one. One process, and 2 ranks."""

import os
import shutil

import pytest
import torch
import torch.nn as nn

import strata
import strata.torch as st

import _dist


def steps_in(tier):
    return sorted(d for d in os.listdir(tier) if d.startswith("step-"))


def model_at(step):
    torch.manual_seed(step)
    return nn.Sequential(nn.Linear(9, 5), nn.Linear(5, 2))


def params(m):
    return [p.detach().clone() for p in m.state_dict().values()]


def test_manager_tiers_retention_latest_load(tmp_path):
    tiers = [str(tmp_path / "shm"), str(tmp_path / "disk")]
    mgr = st.CheckpointManager(tiers, keep=2, pool_bytes=8 << 20)
    assert mgr.latest() is None
    with pytest.raises(strata.Error):
        mgr.load({"model": model_at(0)})
    saved = {}
    for step in (1, 2, 3, 4):
        m = model_at(step)
        saved[step] = params(m)
        h = mgr.save(step, {"model": m, "step": step})
        if isinstance(h, st.AsyncSave):
            h.wait_snapshot()
    mgr.wait()
    assert mgr.latest() == 4
    for t in tiers:
        assert steps_in(t) == ["step-00000003", "step-00000004"], (t, os.listdir(t))
        assert strata.probe(os.path.join(t, "step-00000004"))["committed"]
        assert strata.Checkpoint(os.path.join(t, "step-00000004")).step == 4

    m = model_at(99)
    sd = {"model": m, "step": 0}
    assert mgr.load(sd) == 4
    assert sd["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(params(m), saved[4]))
    sd = {"model": m, "step": 0}
    assert mgr.load(sd, step=3) == 3
    assert all(torch.equal(a, b) for a, b in zip(params(m), saved[3]))

    # the fastest tier loses step 4's commit record: step 4 comes from the next tier
    os.remove(os.path.join(tiers[0], "step-00000004", "COMMIT"))
    assert mgr.latest() == 4
    m = model_at(98)
    assert mgr.load({"model": m, "step": 0}) == 4
    assert all(torch.equal(a, b) for a, b in zip(params(m), saved[4]))
    mgr.close()
    mgr.close()


def test_manager_sync_saves_return_stats(tmp_path):
    with st.CheckpointManager(str(tmp_path / "ck"), keep=1, async_save=False,
                              pool_bytes=4 << 20) as mgr:
        for step in (10, 20):
            r = mgr.save(step, {"w": torch.full((4,), float(step))})
            assert isinstance(r, dict)
        assert steps_in(str(tmp_path / "ck")) == ["step-00000020"]
        back = {"w": torch.zeros(4)}
        assert mgr.load(back) == 20
        assert torch.equal(back["w"], torch.full((4,), 20.0))


def test_manager_async_save_then_step(tmp_path):
    """The manager's async save: wait_snapshot, then change the tensors at once."""
    mgr = st.CheckpointManager(str(tmp_path / "ck"), keep=3, pool_bytes=16 << 20)
    assert mgr.pool is None
    pool = mgr.prepare().pool     # allocated at setup, not in the first save
    assert pool is not None and pool.nbytes == 16 << 20
    w = torch.arange(100000, dtype=torch.float32)
    for step in (1, 2):
        h = mgr.save(step, {"w": w})
        h.wait_snapshot()
        w.add_(1000)                  # the "optimizer step"
    assert mgr.pool is pool       # the same pool every save
    mgr.close()
    for step, base in ((1, 0.0), (2, 1000.0)):
        back = {"w": torch.zeros(100000)}
        st.load(back, str(tmp_path / "ck" / ("step-%08d" % step)))
        assert torch.equal(back["w"], torch.arange(100000, dtype=torch.float32) + base), step


def dist_manager(root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tiers = [os.path.join(root, "fast"), os.path.join(root, "slow")]
    mgr = st.CheckpointManager(tiers, keep=2, pool_bytes=8 << 20)
    full = torch.arange(77 * 5, dtype=torch.float32).reshape(77, 5)
    for step in range(1, 5):
        w = distribute_tensor(full + step, mesh, [Shard(0)])
        h = mgr.save(step, {"w": w, "rng": st.rng_state(), "step": step})
        h.wait_snapshot()
    mgr.wait()
    latest = mgr.latest()
    w = distribute_tensor(torch.zeros(77, 5), mesh, [Shard(0)])
    sd = {"w": w, "rng": st.rng_state(), "step": 0}
    got = mgr.load(sd)
    ok = torch.equal(sd["w"].full_tensor(), full + 4)
    mgr.close()
    listing = [sorted(d for d in os.listdir(t) if d.startswith("step-")) for t in tiers]
    return latest, got, sd["step"], ok, listing


@pytest.mark.slow
def test_manager_two_ranks(tmp_path):
    res = _dist.run(dist_manager, 2, str(tmp_path), timeout=120)
    for rank, (latest, got, step, ok, listing) in enumerate(res):
        assert latest == 4 and got == 4 and step == 4, (rank, latest, got, step)
        assert ok, "rank %d: the loaded tensor differs" % rank
        assert listing == [["step-00000003", "step-00000004"]] * 2, listing


def failing_tiers(tmp_path):
    """[a tier that always fails (its root is a file), a disk tier]."""
    bad = tmp_path / "not-a-dir"
    bad.write_bytes(b"")
    return [str(bad), str(tmp_path / "disk")]


@pytest.mark.parametrize("async_save", [True, False])
def test_manager_failing_tier_does_not_stop_the_others(tmp_path, async_save):
    tiers = failing_tiers(tmp_path)
    mgr = st.CheckpointManager(tiers, keep=2, pool_bytes=8 << 20, async_save=async_save)
    with pytest.warns(UserWarning) as caught:
        for step in range(1, 11):
            h = mgr.save(step, {"w": torch.full((1000,), float(step)), "step": step})
            if isinstance(h, st.AsyncSave):
                h.wait_snapshot()
        assert mgr.wait() is None
        mgr.close()
    msgs = [str(w.message) for w in caught]
    # every step saved on the disk tier, each failure reported once, naming its step
    for step in range(1, 11):
        mine = [m for m in msgs if ("step %d is committed on %s only" % (step, tiers[1])) in m]
        assert len(mine) == 1, (step, msgs)
        assert "not-a-dir" in mine[0] and "Not a directory" in mine[0], mine[0]
    assert len(msgs) == 10, msgs
    # retention ran on the tier that committed
    assert steps_in(tiers[1]) == ["step-00000009", "step-00000010"]
    assert mgr.latest() == 10
    back = {"w": torch.zeros(1000), "step": 0}
    assert st.CheckpointManager(tiers).load(back) == 10
    assert back["step"] == 10 and torch.equal(back["w"], torch.full((1000,), 10.0))


def test_manager_no_tier_commits_raises_once_with_the_step(tmp_path):
    bad = tmp_path / "not-a-dir"
    bad.write_bytes(b"")
    mgr = st.CheckpointManager([str(bad)], keep=2, pool_bytes=8 << 20)
    h = mgr.save(1, {"w": torch.ones(10)})
    with pytest.raises(strata.MissingError, match=r"^step 1 was saved on no tier: .*not-a-dir"):
        h.wait()
    mgr.save(2, {"w": torch.ones(10)})     # step 1's error is not reported again
    with pytest.raises(strata.MissingError, match=r"^step 2 was saved on no tier"):
        mgr.close()
    mgr = st.CheckpointManager([str(bad)], keep=2, pool_bytes=8 << 20)
    mgr.save(3, {"w": torch.ones(10)})
    with pytest.warns(UserWarning, match=r"step 3 was saved on no tier"):
        mgr.save(4, {"w": torch.ones(10)})   # not waited for: warned of by the next save
    with pytest.raises(strata.MissingError, match=r"^step 4 "):
        mgr.wait()
    mgr.close()


def test_manager_latest_and_load_from_mem_tiers(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_MEM_ROOT", str(tmp_path / "shm"))
    mgr = st.CheckpointManager("mem://run", keep=3, pool_bytes=8 << 20)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((5,), float(step))}).wait_snapshot()
    mgr.close()
    assert steps_in(str(tmp_path / "shm" / "run")) == ["step-00000001", "step-00000002"]
    mgr = st.CheckpointManager("mem://run")
    assert mgr.latest() == 2
    back = {"w": torch.zeros(5)}
    assert mgr.load(back) == 2 and torch.equal(back["w"], torch.full((5,), 2.0))

    tiers = ["mem://both", str(tmp_path / "disk")]
    with st.CheckpointManager(tiers, keep=3, pool_bytes=8 << 20) as mgr:
        for step in (3, 4):
            mgr.save(step, {"w": torch.full((5,), float(step))}).wait_snapshot()
    for d in steps_in(tiers[1]):
        shutil.rmtree(os.path.join(tiers[1], d))   # the disk copies are gone
    mgr = st.CheckpointManager(tiers)
    assert mgr.latest() == 4
    back = {"w": torch.zeros(5)}
    assert mgr.load(back) == 4 and torch.equal(back["w"], torch.full((5,), 4.0))
    assert strata.uri_path("mem://both/x") == str(tmp_path / "shm" / "both" / "x")


def dist_failing_tier(root):
    import warnings
    import torch.distributed as dist
    tiers = [os.path.join(root, "foreign"), os.path.join(root, "disk")]
    mgr = st.CheckpointManager(tiers, keep=2, pool_bytes=8 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((64,), float(step)),
                            "r": st.per_rank(dist.get_rank())}).wait_snapshot()
        mgr.close()
    latest = mgr.latest()
    return ([str(w.message) for w in caught if "CheckpointManager" in str(w.message)],
            steps_in(tiers[1]), latest)


@pytest.mark.slow
def test_manager_failing_tier_two_ranks(tmp_path):
    for step in range(1, 5):   # a file not strata's in each step's directory of tier 0
        d = tmp_path / "foreign" / ("step-%08d" % step)
        d.mkdir(parents=True)
        (d / "notes.txt").write_bytes(b"mine")
    res = _dist.run(dist_failing_tier, 2, str(tmp_path), timeout=120)
    for rank, (msgs, listing, latest) in enumerate(res):
        assert len(msgs) == 4, (rank, msgs)
        for step, m in zip(range(1, 5), msgs):
            assert "step %d is committed on %s only" % (step, tmp_path / "disk") in m, (rank, m)
            assert "not strata's" in m, m
        assert listing == ["step-00000003", "step-00000004"] and latest == 4, (rank, listing)
