"""strata.megatron: Megatron-Core 0.16.1 saving and loading through strata's
dist_checkpointing strategy (backend "strata", version 1), on gloo, CPU.

The fixtures are Megatron's own: a GPT of its layers (local spec), its DDP and its
DistributedOptimizer after a real step (tests/python/_mg_gpt.py: how they run on CPU),
TP=2 x DP=2 on 4 processes, saved by megatron.core.dist_checkpointing.save through strata
and, beside it, through Megatron's default torch_dist strategy - the optimizer in both of
Megatron 0.16.1's formats: dp_reshardable (each gradient bucket a 1-D tensor cut into one
piece per parameter and padding) and fully_reshardable (model-space tensors). Megatron's
own load of its torch_dist checkpoint is the reference every strata load is compared with,
bitwise: the strata checkpoint loaded by Megatron through strata on TP=2 x DP=1 (another
distributed-optimizer partition; the optimizer state then goes through Megatron's own
load_state_dict), TP=1 x DP=3 and PP=2 x TP=1 (what dist_checkpointing.load returns: the
weights and the Adam moments in the new layout); the torch_dist checkpoint loaded through
strata's strategy the same way (a run switching to strata mid-life); plain tensors by
strata.torch.load and strata export against Megatron's load_plain_tensors.

megatron-core 0.16.1 facts these rely on: metadata.json is written from the strategy's
backend/version attributes after the sharded save (after its finalize when asynchronous);
common.pt is always written by its torch common strategy; fully_reshardable's
load_state_dict fails with torch's own Adam (its per-parameter "step" tensor: KeyError in
_set_main_param_and_optimizer_states), so that format is compared as loaded."""

import json
import os
import re
import signal
import subprocess
import warnings

import pytest
import torch

import _dist
import strata
import strata.torch as st

pytest.importorskip("megatron.core.dist_checkpointing",
                    reason="megatron-core 0.16.1 is not installed (make venv installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")
TIMEOUT = 420
SMALL = 150


def _mg():
    import _mg_gpt
    _mg_gpt.cpu_only_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import strata.megatron as smg
        from megatron.core import dist_checkpointing as dc
    smg.enable()
    return smg, dc


def _mkdir(path):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()


def _tensors(x, prefix=""):
    """{path: tensor (a copy)} of every tensor in a nested dict / list - but the
    distributed optimizer's padding pieces (dp_reshardable saves torch.empty there: any two
    saves differ) and its "step" (not stored: the local one comes back)."""
    out = {}
    if isinstance(x, dict):
        if x.get("padding") is True:
            return out
        for k, v in x.items():
            if k != "step":
                out.update(_tensors(v, "%s/%s" % (prefix, k)))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            out.update(_tensors(v, "%s[%d]" % (prefix, i)))
    elif isinstance(x, torch.Tensor):
        out[prefix] = x.detach().clone()
    return out


def _diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return sorted(k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))


# ---- the checkpoints: TP=2 x DP=2 -----------------------------------------------------------

def mg_save(base):
    """On 4 ranks: the GPT at TP=2 (DP=2), saved in both optimizer formats through torch_dist
    (the reference) and strata: dp_reshardable synchronously; fully_reshardable through
    Megatron's async entry point (AsyncCallsQueue), with an optimizer step while the save is
    in flight - the checkpoint must hold the state from before it."""
    import torch.distributed as dist
    import _mg_gpt
    m = _mg_gpt.Model(2, 1, seed=1)
    smg, dc = _mg()
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    for sharding in ("dp_reshardable", "fully_reshardable"):
        for be in ("torch_dist", "strata"):
            _mkdir(os.path.join(base, sharding, be))
    d = os.path.join(base, "dp_reshardable")
    dc.save(m.sharded_state_dict("dp_reshardable"), os.path.join(d, "torch_dist"))
    dc.save(m.sharded_state_dict("dp_reshardable"), os.path.join(d, "strata"),
            sharded_strategy=("strata", 1))
    d = os.path.join(base, "fully_reshardable")
    before = m.snapshot()
    dc.save(m.sharded_state_dict("fully_reshardable"), os.path.join(d, "torch_dist"))
    q = AsyncCallsQueue()
    req = dc.save(m.sharded_state_dict("fully_reshardable"), os.path.join(d, "strata"),
                  sharded_strategy=("strata", 1), async_sharded_save=True)
    q.schedule_async_request(req)
    caller = type(q.async_calls[0].async_caller).__name__
    meta_early = os.path.exists(os.path.join(d, "strata", "metadata.json"))
    # the optimizer step pre-hook waits for the snapshot before the step changes anything:
    # the first wait for this save's snapshot is made inside the step
    waits, orig = [], smg._InFlight.wait_snapshot
    smg._InFlight.wait_snapshot = lambda self: (waits.append(in_step[0]), orig(self))[1]
    in_step = [True]
    m.step(5)
    in_step[0] = False
    moved = sum(not torch.equal(v, m.snapshot()[k]) for k, v in before.items())
    q.maybe_finalize_async_calls(blocking=True)
    smg._InFlight.wait_snapshot = orig
    return {"meta_early": meta_early, "moved": moved, "n": len(before), "caller": caller,
            "waits": waits, "padding": _padding(m.sharded_state_dict("dp_reshardable"))}


def _padding(sd):
    """[(key, start, stop)]: the padding pieces of dp_reshardable's buckets (torch.empty
    when saved: undefined bytes, different in every save)."""
    out = []

    def walk(x):
        if isinstance(x, dict):
            if x.get("padding") is not None and getattr(x["padding"], "obj", False):
                for k, v in x.items():
                    if hasattr(v, "global_offset"):
                        out.append((v.key, v.global_offset[0],
                                    v.global_offset[0] + v.local_shape[0]))
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(sd)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("mgstrata"))
    res = _dist.run(mg_save, 4, base, timeout=TIMEOUT)
    return base, res


def test_async_save_is_lazy_and_commits_before_metadata(saved):
    """Megatron's async entry point: the AsyncCallsQueue serves strata's request from
    strata's handle (its caller strata's, no process forked); metadata.json is not there
    while the save is in flight; the optimizer step taken meanwhile first waited for the
    snapshot (its pre-hook), then changed the state (and the checkpoint, compared below with
    torch_dist's taken before the step, holds the old one)."""
    base, res = saved
    for r in res:
        assert r["caller"] == "_StrataCaller", r["caller"]
        assert r["waits"][:1] == [True], r["waits"]
        assert not r["meta_early"] and r["moved"] > r["n"] // 2, r
    assert os.path.exists(os.path.join(base, "fully_reshardable", "strata", "metadata.json"))


def test_layout_on_disk(saved):
    """Megatron's metadata.json names strata; common.pt is Megatron's torch.save; the data
    is one committed strata checkpoint (format strata.megatron) whose tensors are the
    ShardedTensor keys torch_dist saved, each written once (its pieces cover it exactly:
    replicas deduplicated), the bucket pieces flat ranges, the ShardedObjects blobs under
    torch_dist's names, and the common state values."""
    base, _ = saved
    for sharding in ("dp_reshardable", "fully_reshardable"):
        d = os.path.join(base, sharding, "strata")
        assert sorted(os.listdir(d)) == ["common.pt", "metadata.json", "strata"]
        with open(os.path.join(d, "metadata.json")) as f:
            assert json.load(f) == {"sharded_backend": "strata", "sharded_backend_version": 1,
                                    "common_backend": "torch", "common_backend_version": 1}
        assert torch.load(os.path.join(d, "common.pt"))["iteration"] == 7
        ck = strata.Checkpoint(d)
        assert ck.format == "strata.megatron" and ck.committed and ck.step == 7
        assert strata.probe(os.path.join(d, "strata"))["committed"]
        ref = strata.Checkpoint(os.path.join(base, sharding, "torch_dist"))
        rt = {t["name"]: t for t in ref.tensors}
        man = {"strata.megatron": None}       # which entries are the common state
        st.load(man, d)
        assert man["strata.megatron"]["version"] == 1, man
        common = set(man["strata.megatron"]["common"]) | {"strata.megatron"}
        assert {"iteration", "args"} <= common, common
        objs = sorted(b["name"] for b in ck.blobs if b["name"] not in common)
        assert objs == sorted(b["name"] for b in ref.blobs if b["name"] != "common.pt")
        names = {t["name"] for t in ck.tensors if "#" not in t["name"]} - common
        assert names == set(rt), sorted(names ^ set(rt))[:5]
        for t in ck.tensors:
            if t["name"] not in rt:
                continue
            assert tuple(t["shape"]) == tuple(rt[t["name"]]["shape"]), t["name"]
            numel = 1
            for s in t["shape"]:
                numel *= s
            got = 0
            for s in t["shards"]:
                n = 1
                for x in s["lengths"]:
                    n *= x
                got += s["flat"][1] - s["flat"][0] if s.get("flat") else n
            assert got == numel, (t["name"], got, numel)
            if ".bucket_idx_" in t["name"]:
                assert all(s.get("flat") for s in t["shards"]) and len(t["shards"]) > 4
        sd = {"iteration": 0, "args": {}}
        st.load(sd, d)
        assert sd == {"iteration": 7, "args": {"tp": 2, "lr": 0.01}}


def mg_load(base, tp, pp, sharding):
    """On tp * pp * dp ranks: the GPT built afresh (another seed), then each way of loading
    compared with Megatron's own load of its torch_dist checkpoint."""
    import _mg_gpt
    m = _mg_gpt.Model(tp, pp, seed=2)
    smg, dc = _mg()
    d = os.path.join(base, sharding)
    fresh = m.snapshot()
    ways = [("torch_dist", None), ("strata", None), ("torch_dist", ("strata", 1))]
    got = {}
    for be, strategy in ways:
        sd = m.sharded_state_dict(sharding, is_loading=True)
        loaded = dc.load(sd, os.path.join(d, be), sharded_strategy=strategy)
        got[(be, strategy)] = _tensors({"model": loaded["model"],
                                        "optimizer": loaded["optimizer"]})
        if sharding == "dp_reshardable":    # through the optimizer too, then its state
            m.load(loaded)
            got[(be, strategy, "state")] = m.snapshot()
    ref, out = got[ways[0]], {"n": len(got[ways[0]])}
    for w in ways[1:]:
        out[w] = _diff(ref, got[w])
        if sharding == "dp_reshardable":
            out[w + ("state",)] = _diff(got[ways[0] + ("state",)], got[w + ("state",)])
    if sharding == "dp_reshardable":
        out["unchanged"] = len(fresh) - len(_diff(fresh, got[ways[0] + ("state",)]))
    return out


@pytest.mark.parametrize("tp,pp,dp,sharding", [(2, 1, 1, "dp_reshardable"),
                                               (1, 1, 3, "fully_reshardable"),
                                               (1, 2, 1, "fully_reshardable")],
                         ids=["tp2dp1", "tp1dp3", "pp2tp1"])
def test_load_other_layouts(saved, tp, pp, dp, sharding):
    """The TP=2 x DP=2 checkpoints loaded by Megatron on another layout: strata's (its
    metadata.json picks strata's strategy) and torch_dist's through strata's strategy give
    bitwise what Megatron's own torch_dist load gives - every weight and Adam moment (for
    dp_reshardable also after Megatron's optimizer took them: another partition of the
    buckets), none left as the fresh model had it."""
    base, _ = saved
    res = _dist.run(mg_load, tp * pp * dp, base, tp, pp, sharding, timeout=TIMEOUT)
    for r, out in enumerate(res):
        assert out["n"] > 20, out
        for k, v in out.items():
            if isinstance(k, tuple):
                assert v == [], "rank %d %s: %s" % (r, k, v[:5])
        if sharding == "dp_reshardable":
            assert out["unchanged"] == 0, out


def mg_plain(path):
    """Megatron's load_plain_tensors (one process): every ShardedTensor whole."""
    _, dc = _mg()
    return {k: v.clone() for k, v in dc.load_plain_tensors(path).items()
            if isinstance(v, torch.Tensor)}


@needs_cli
def test_plain_tensors_and_export(saved, tmp_path):
    """strata.torch.load of the strata checkpoint into whole plain tensors, and strata
    export of it, give bitwise what Megatron's load_plain_tensors gives of torch_dist's."""
    from safetensors.torch import load_file
    base, res = saved
    pads = [p for r in res for p in r["padding"]]
    assert pads

    def unpadded(x):       # the padding pieces zeroed (their bytes are undefined)
        for key, lo, hi in pads:
            if key in x:
                x[key][lo:hi] = 0
        return x
    for sharding in ("dp_reshardable", "fully_reshardable"):
        ref = unpadded(_dist.run(mg_plain, 1, os.path.join(base, sharding, "torch_dist"),
                                 timeout=TIMEOUT)[0])
        d = os.path.join(base, sharding, "strata")
        sd = {k: torch.full_like(v, 7) for k, v in ref.items()}
        st.load(sd, d)
        assert _diff(ref, unpadded(sd)) == []
        out = str(tmp_path / sharding)
        r = subprocess.run([STRATA, "export", d, out, "--quiet"], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        ex = load_file(os.path.join(out, "model.safetensors"))
        assert _diff(ref, unpadded({k: ex[k] for k in ref})) == []
        r = subprocess.run([STRATA, "inspect", d], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith(
            "Megatron-Core (strata.megatron) %s: read from %s/strata: committed, step 7"
            % (d, d)), r.stdout
        r = subprocess.run([STRATA, "verify", d], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith("ok: "), (r.stdout, r.stderr)


def test_broken_directory_errors(saved, tmp_path):
    """A copy of a checkpoint Megatron saved through strata, broken three ways, read by
    strata.Checkpoint: its strata/ gone (MissingError naming it), its strata/ without a
    commit record (IncompleteError; it opens with incomplete=True), metadata.json naming
    strata version 2 (UnsupportedError naming the version); the intact copy opens."""
    import shutil
    base, _ = saved
    src = os.path.join(base, "dp_reshardable", "strata")

    def copy(name):
        d = str(tmp_path / name)
        shutil.copytree(src, d)
        return d
    ok = copy("ok")
    assert strata.Checkpoint(ok).format == "strata.megatron"
    gone = copy("gone")
    shutil.rmtree(os.path.join(gone, "strata"))
    with pytest.raises(strata.MissingError, match=re.escape(os.path.join(gone, "strata"))):
        strata.Checkpoint(gone)
    half = copy("half")
    os.unlink(os.path.join(half, "strata", "COMMIT"))
    with pytest.raises(strata.IncompleteError):
        strata.Checkpoint(half)
    ck = strata.Checkpoint(half, incomplete=True)
    assert ck.format == "strata.megatron" and not ck.committed
    v2 = copy("v2")
    with open(os.path.join(v2, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "strata", "sharded_backend_version": 2}, f)
    with pytest.raises(strata.UnsupportedError, match="strata version 2"):
        strata.Checkpoint(v2)


# ---- kill -9 during an asynchronous save ------------------------------------------------------

def _arm_kill(point):
    """A deterministic SIGKILL of this process inside the asynchronous save: "write" when
    strata's commit thread starts the save's commit collective (this rank's data is written
    and synced; no rank can commit without it), "finalize" when Megatron's finalize writes
    metadata.json (strata's commit done). Armed by _ARMED, so that only the save after it
    dies. (Test-only patches of strata's background collectives, strata._group._BgOps, and
    of Megatron's save_config; each is the first call of its kind in that save.)"""
    from strata import _group
    from megatron.core.dist_checkpointing import serialization

    def die(*a, **k):
        if _ARMED:
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "write":
        for name in ("allgather", "alltoallv", "bcast"):
            orig = getattr(_group._BgOps, name)
            setattr(_group._BgOps, name, lambda self, *a, _o=orig: (die(), _o(self, *a))[1])
    else:
        orig = serialization.save_config
        serialization.save_config = lambda *a, _o=orig: (die(), _o(*a))[1]


_ARMED = False


def mg_killed(base, point):
    """On 2 ranks (TP=2): checkpoint A saved through strata and torch_dist, then B through
    strata's asynchronous save, an optimizer step while it is in flight, and a SIGKILL of
    every rank at `point` (never returns)."""
    global _ARMED
    import _mg_gpt
    m = _mg_gpt.Model(2, 1, seed=1)
    smg, dc = _mg()
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    _arm_kill(point)
    for d in ("A", "A_td", "B"):
        _mkdir(os.path.join(base, d))
    dc.save(m.sharded_state_dict(), os.path.join(base, "A"), sharded_strategy=("strata", 1))
    dc.save(m.sharded_state_dict(), os.path.join(base, "A_td"))
    m.step(5)
    q = AsyncCallsQueue()
    _ARMED = True
    q.schedule_async_request(dc.save(m.sharded_state_dict(), os.path.join(base, "B"),
                                     sharded_strategy=("strata", 1), async_sharded_save=True))
    m.step(6)
    q.maybe_finalize_async_calls(blocking=True)
    return "not killed"


def mg_resume(base):
    """On 2 ranks: B refused by Megatron's load; A through strata bitwise what Megatron
    loads of A_td; B saved again through strata (over what the kill left) and loaded."""
    import _mg_gpt
    from megatron.core.dist_checkpointing.core import CheckpointingException
    m = _mg_gpt.Model(2, 1, seed=2)
    smg, dc = _mg()
    out = {}
    try:
        dc.load(m.sharded_state_dict(is_loading=True), os.path.join(base, "B"))
        out["B"] = "loaded"
    except CheckpointingException as e:
        out["B"] = str(e)
    got = {}
    for d in ("A_td", "A"):
        sd = m.sharded_state_dict(is_loading=True)
        m.load(dc.load(sd, os.path.join(base, d)))
        got[d] = m.snapshot()
    out["A"] = _diff(got["A_td"], got["A"])
    m.step(9)
    want = m.snapshot()
    dc.save(m.sharded_state_dict(), os.path.join(base, "B"), sharded_strategy=("strata", 1))
    m.step(10)
    m.load(dc.load(m.sharded_state_dict(is_loading=True), os.path.join(base, "B")))
    out["B_again"] = _diff(want, m.snapshot())
    return out


@pytest.mark.parametrize("point", ["write", "finalize"])
def test_kill_during_async_save(tmp_path, point):
    """kill -9 of every rank while an asynchronous save is in flight - after its data is
    written, before any commit ("write"), or after strata's commit, before Megatron's
    metadata.json ("finalize"): the previous checkpoint loads bitwise; the killed one is no
    Megatron checkpoint (no metadata.json: Megatron's load refuses it), its strata/ without
    a commit record ("write") or committed but never finalized; saving it again works."""
    base = str(tmp_path)
    with pytest.raises(_dist.RankFailure) as ei:
        _dist.run(mg_killed, 2, base, point, timeout=TIMEOUT)
    assert "ended without a result" in str(ei.value), str(ei.value)[-2000:]
    b = os.path.join(base, "B")
    assert "metadata.json" not in os.listdir(b), os.listdir(b)
    info = strata.probe(os.path.join(b, "strata"))
    assert info["committed"] == (point == "finalize"), info
    if point == "write":
        assert any(f.startswith("data-") for f in os.listdir(os.path.join(b, "strata")))
    res = _dist.run(mg_resume, 2, base, timeout=TIMEOUT)
    for out in res:
        assert "is not a distributed checkpoint" in out["B"], out
        assert out["A"] == [] and out["B_again"] == [], out


# ---- Megatron's own checks: StrictHandling, validate_sharding_integrity, pickle ----------------

def _small(rank, extra=None, bad_sharding=False):
    """A small sharded state dict: "a" cut along dim 0 over the 2 ranks, "b" replicated, a
    ShardedObject per rank, and common values."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    a = full[3 * rank:3 * rank + 3].clone()
    sd = {"a": ShardedTensor.from_rank_offsets("a", a, (0, 0 if bad_sharding else rank, 2)),
          "b": ShardedTensor.from_rank_offsets("b", torch.ones(5) * 3, replica_id=rank),
          "o": ShardedObject("o", {"r": rank, "dt": (torch.bfloat16, 2)}, (2,), (rank,)),
          "iteration": 3}
    sd.update(extra or {})
    return sd


def mg_strict(base):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    smg, dc = _mg()
    rank = dist.get_rank()
    out = {}
    for be in ("strata", "torch_dist"):
        _mkdir(os.path.join(base, be))
        dc.save(_small(rank), os.path.join(base, be), sharded_strategy=(be, 1))
    # a sharding whose main replicas overlap: refused by Megatron (on rank 0, which checks
    # the gathered metadata; the others would go on into the save and wait there for rank
    # 0, as they do with torch_dist) before anything is written
    _mkdir(os.path.join(base, "bad"))
    out["bad"] = "not checked here"
    if rank == 0:
        try:
            dc.save(_small(rank, bad_sharding=True), os.path.join(base, "bad"),
                    sharded_strategy=("strata", 1))
            out["bad"] = "saved"
        except CheckpointingException as e:
            out["bad"] = str(e)
    else:     # the collectives of rank 0's check (Megatron's save_preprocess), no more
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        save_preprocess(_small(rank, bad_sharding=True))
    dist.barrier()
    out["bad_files"] = sorted(os.listdir(os.path.join(base, "bad")))

    def request():         # "c" unexpected, "b" missing
        sd = _small(rank, {"c": ShardedTensor.from_rank_offsets("c", torch.zeros(2),
                                                                replica_id=rank)})
        sd["a"].data.zero_()
        del sd["b"], sd["iteration"]
        return sd
    strategies = {"strata": ("strata", 1), "torch_dist": None}
    for mode in (StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL,
                 StrictHandling.ASSUME_OK_UNEXPECTED):
        for be in ("strata", "torch_dist"):
            try:
                r = dc.load(request(), os.path.join(base, be), strict=mode,
                            sharded_strategy=strategies[be])
                if mode == StrictHandling.RETURN_ALL:
                    sd, missing, unexpected = r
                    r = (sorted(missing), sorted(unexpected), sd["a"].tolist(), sd["o"],
                         sd["iteration"])
                out[(mode.value, be)] = ("ok", r)
            except BaseException as e:    # (DCP's CheckpointException is a BaseException)
                out[(mode.value, be)] = (type(e).__name__, str(e))
    return out


def test_strict_handling_and_integrity(tmp_path):
    """Megatron's checks around strata's strategy: a sharding whose main replicas overlap is
    refused by validate_sharding_integrity before anything is written; StrictHandling
    RAISE_ALL and RETURN_ALL report the missing and unexpected keys exactly as with
    torch_dist (found by strata's load_sharded_metadata), RETURN_ALL loading the rest
    (ShardedObjects, dtype keys included); the default ASSUME_OK_UNEXPECTED leaves an
    unexpected key to the strategy: CheckpointingException naming it."""
    res = _dist.run(mg_strict, 2, str(tmp_path), timeout=SMALL)
    for rank, out in enumerate(res):
        if rank == 0:
            assert "Invalid access pattern" in out["bad"], out["bad"]
        assert out["bad_files"] == [], out["bad_files"]
        s, t = out[("raise_all", "strata")], out[("raise_all", "torch_dist")]
        assert s == t and s[0] == "CheckpointingException", (s, t)
        assert "Missing keys (for all ranks): {'b'}" in s[1] and "{'c'}" in s[1], s
        s, t = out[("return_all", "strata")], out[("return_all", "torch_dist")]
        assert s[0] == "ok" and s[1][:2] == (["b"], ["c"]), s
        assert s[1][2] == torch.arange(24.).reshape(6, 4)[3 * rank:3 * rank + 3].tolist(), s
        assert s[1][3] == {"r": rank, "dt": (torch.bfloat16, 2)} and s[1][4] == 3, s
        assert t == s, (t, s)
        s = out[("assume_ok_unexpected", "strata")]
        assert s[0] == "CheckpointingException" and "ShardedTensor c " in s[1], s


class Opaque:
    """Not a value strata's format holds (an object of a class of this module)."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, o):
        return isinstance(o, Opaque) and o.x == self.x


def mg_pickle(base):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    smg, dc = _mg()
    rank = dist.get_rank()
    out = {}

    def attempt(name, sd, **kw):
        _mkdir(os.path.join(base, name))
        try:
            dc.save(sd, os.path.join(base, name), sharded_strategy=("strata", 1), **kw)
            out[name] = "saved"
        except strata.Error as e:
            out[name] = "%s: %s" % (type(e).__name__, e)
        out[name + "_files"] = sorted(os.listdir(os.path.join(base, name)))
    obj = ShardedObject("o", Opaque(rank), (2,), (rank,))
    attempt("object", _small(rank, {"o": obj}))
    attempt("common", _small(rank, {"args": Opaque(1)}))
    smg.enable(pickle=True)
    attempt("pickled", _small(rank, {"o": obj}))
    sd = _small(rank)
    out["loaded"] = dc.load(sd, os.path.join(base, "pickled"))["o"] == Opaque(rank)
    smg.enable()
    try:
        dc.load(_small(rank), os.path.join(base, "pickled"))
        out["unpickled"] = "loaded"
    except strata.Error as e:
        out["unpickled"] = "%s: %s" % (type(e).__name__, e)
    return out


def test_values_need_pickle_to_be_pickled(tmp_path):
    """A ShardedObject or common value strata's value format lacks fails the save on every
    rank, naming it, before strata writes anything (no strata/, no metadata.json);
    enable(pickle=True) saves and loads it; a checkpoint holding a pickle loads only with
    pickle=True."""
    res = _dist.run(mg_pickle, 2, str(tmp_path), timeout=SMALL)
    for rank, out in enumerate(res):
        assert out["object"].startswith("InvalidArgumentError: ") and \
            "test_megatron_strata.Opaque cannot be saved without pickle" in out["object"], out
        assert ("o/shard_%d_2" % rank) in out["object"] or "failed on rank" in out["object"], out
        assert out["common"].startswith("InvalidArgumentError: ") and "args" in out["common"], out
        for name in ("object", "common"):
            assert out[name + "_files"] == ["common.pt"], out    # Megatron's, written first
        assert out["pickled"] == "saved" and out["loaded"] is True, out
        assert out["unpickled"].startswith("InvalidArgumentError: ") and \
            "holds a pickled object" in out["unpickled"], out
