"""strata as DeepSpeed's checkpoint engine (strata.deepspeed): DeepSpeed 0.19.8 on CPU, gloo.

The runs (tests/python/_ds_worker.py): ZeRO stages 1, 2 and 3 on 2 processes save through
strata at step 10, then a later save of each stage is killed with SIGKILL at a random point
(one launch, shared by the tests below, the `ref_run` fixture). test_zero_kill_resume
resumes from DeepSpeed's `latest` on 2 processes: state and losses must equal the
uninterrupted run's bitwise. test_reshard resumes step 10 of ZeRO 1, 2 and 3 on 3 and on
1 processes. test_fp32_weights loads a tag with strata.torch.load in this process. The other
tests run the engine in this process, without a process group.
"""

import os
import random
import signal
import sys
import time

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
import strata  # noqa: E402
import strata.deepspeed as sds  # noqa: E402
from strata import _ds_entry  # noqa: E402
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _launch as _launch_mod  # noqa: E402
from _ds_worker import RESHARD as _STAGES_RESHARD, STAGES, STEPS  # noqa: E402


def _launch(mode, out, ws=2):
    return _launch_mod.launch([os.path.join(HERE, "_ds_worker.py"), mode, out], ws,
                              log=lambda r: os.path.join(out, "log-%s-%d" % (mode, r)))


def _logs(out, mode, ws=2):
    return "\n".join(open(os.path.join(out, "log-%s-%d" % (mode, r))).read()[-3000:]
                     for r in range(ws))


def _wait_file(path, procs, out, mode, timeout=600):
    end = time.time() + timeout
    while not os.path.exists(path):
        if any(p.poll() is not None for p in procs) or time.time() > end:
            for p in procs:
                p.kill()
            pytest.fail("%s: the ranks ended (or timed out) before %s\n%s"
                        % (mode, path, _logs(out, mode)))
        time.sleep(0.01)


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory):
    """The ref launch, killed at a random point of its later saves: (its directory, the
    delay of the kill after stage 1's later save started)."""
    out = str(tmp_path_factory.mktemp("ds"))
    procs = _launch("ref", out)
    _wait_file(os.path.join(out, "started1"), procs, out, "ref")   # stage 1's is in flight
    delay = random.uniform(0, 0.15)         # the three take ~0.2 s here
    time.sleep(delay)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    return out, delay


def _run(mode, out, ws=2):
    rcs = _launch_mod.wait(_launch(mode, out, ws))
    assert rcs == [0] * ws, "%s rank failed (%s)\n%s" % (mode, rcs, _logs(out, mode, ws))


@pytest.mark.slow
def test_zero_kill_resume(ref_run, figures):
    import json
    out, delay = ref_run
    _run("resume", out)
    seen = []
    for r in range(2):
        with open(os.path.join(out, "resume-%d.json" % r)) as f:
            rep = json.load(f)
        for stage in STAGES:
            x = rep[str(stage)]
            where = "stage %d rank %d (%s)" % (stage, r, x["tag"])
            assert x["tag"] in ("step10", "step%d" % STEPS), where
            if x["tag"] != "step10":     # latest moves only once the tag is committed
                assert x["later"] == "committed", where
                assert rep["%d-by-tag" % stage]["tag"] == "step10", where
            else:                        # killed before its commit (or before latest)
                assert x["later"] in ("committed", "IncompleteError", "MissingError"), where
            for x in [x] + [rep[k] for k in rep if k == "%d-by-tag" % stage]:
                where = "stage %d rank %d (%s)" % (stage, r, x["tag"])
                assert x["state_diff"] == [], "%s: loaded state differs: %s" % (
                    where, x["state_diff"][:8])
                assert x["losses"] == x["losses_want"], where
                assert x["final_diff"] == [], "%s: final state differs: %s" % (
                    where, x["final_diff"][:8])
            if r == 0:
                seen.append("stage %d: resumed from %s, the later save %s"
                            % (stage, x["tag"], x["later"]))
    figures("deepspeed kill", "SIGKILL %.3f s after stage 1's later save started; %s" % (delay, "; ".join(seen)))


@pytest.mark.slow
def test_kill_and_reuse(tmp_path):
    """DeepSpeed under kill and reuse, 2 processes, ZeRO 2. A tag saved again once committed
    is refused (ExistsError) before any file of it changes; a kill inside save_checkpoint
    (each rank SIGKILLs itself after handing over its first file: STRATA_DS_TEST_KILL_AT_STUB)
    leaves latest at the previous tag, which a new run resumes from bitwise, and the killed
    tag not loadable (its strata checkpoint was never started: MissingError); saving that
    tag again works; latest naming a tag whose commit record is missing makes
    load_checkpoint raise IncompleteError, and the committed tags still load by name."""
    import json
    out = str(tmp_path)
    rcs = _launch_mod.wait(_launch("reuse1", out))
    for r in range(2):
        with open(os.path.join(out, "reuse1-%d.json" % r)) as f:
            rep = json.load(f)
        assert rep["again"].startswith("ExistsError: ") and "committed already" in rep["again"], rep
        assert rep["stubs_untouched"], rep
    assert rcs == [-signal.SIGKILL] * 2, "reuse1: %s\n%s" % (rcs, _logs(out, "reuse1"))
    with open(os.path.join(out, "reuse", "latest")) as f:
        assert f.read() == "a"
    _run("reuse2", out)
    for r in range(2):
        with open(os.path.join(out, "reuse-%d.json" % r)) as f:
            rep = json.load(f)
        assert "strata" not in rep["b_files"] and rep["b_files"], rep   # stubs only
        assert rep["latest"] == "a" and rep["a_diff"] == [], rep
        assert rep["b_by_tag"].startswith("MissingError: "), rep
        assert rep["latest_after"] == "b", rep
        assert rep["latest_uncommitted"].startswith("IncompleteError: "), rep
        assert "/c/strata" in rep["latest_uncommitted"], rep
        assert rep["b_diff"] == [], rep


# ---- in this process ------------------------------------------------------------------

def _save(engine, save_dir, tag, files):
    """engine.save_checkpoint's calls for files {name: object}, then the strata save."""
    engine.create(CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=True))
    for name, obj in files.items():
        path = os.path.join(save_dir, tag, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)     # as DeepSpeed does
        engine.save(obj, path)
    engine.start()
    return engine


def test_objects_roundtrip(tmp_path):
    """DeepSpeed's own objects, OrderedDict, torch.Size, parameters, empty and shared
    tensors come back as saved, without pickle; latest names the tag once committed."""
    import collections
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    w = torch.randn(5, 3)
    obj = {"module": collections.OrderedDict(w=w, tied=w, empty=torch.empty(0, 7)),
           "param": torch.nn.Parameter(torch.arange(11.0)),
           "shapes": [collections.OrderedDict(w=torch.Size([5, 3]))],
           "scaler": DynamicLossScaler(2.0 ** 12, 1000, 1.0, 2, True), "stage": ZeroStageEnum.gradients,
           "map": {0: fragment_address(numel=7, start=3)}, "dtype": torch.bfloat16,
           "step": torch.tensor(17), 1: (None, True, 2.5, "s", b"b")}
    e = sds.StrataCheckpointEngine()
    d = str(tmp_path)
    _save(e, d, "global_step7", {"a.pt": obj, "sub/b.pt": {"x": torch.ones(3)}})
    assert e.get_commit_info().tag == "global_step7"    # the step must wait for the copy
    e.commit(e.get_commit_info())
    e.wait()
    assert open(os.path.join(d, "latest")).read() == "global_step7"
    assert strata.Checkpoint(os.path.join(d, "global_step7", "strata")).step == 7
    got = e.load(os.path.join(d, "global_step7", "a.pt"))
    assert list(got) == list(obj) and type(got["module"]) is collections.OrderedDict
    assert torch.equal(got["module"]["w"], w) and got["module"]["tied"] is got["module"]["w"]
    assert got["module"]["empty"].shape == (0, 7)
    assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
    assert type(got["shapes"][0]["w"]) is torch.Size and got["shapes"][0]["w"] == (5, 3)
    assert type(got["scaler"]) is DynamicLossScaler and vars(got["scaler"]) == vars(obj["scaler"])
    assert got["stage"] is ZeroStageEnum.gradients and got["dtype"] is torch.bfloat16
    assert got["map"] == {0: fragment_address(numel=7, start=3)}
    assert got["step"].dtype == torch.int64 and int(got["step"]) == 17
    assert got[1] == (None, True, 2.5, "s", b"b")
    assert torch.equal(e.load(os.path.join(d, "global_step7", "sub", "b.pt"))["x"], torch.ones(3))


def test_flat_partitions(tmp_path):
    """Flat partitions (as ZeRO's, here two with a given layout) are stored as ranges of
    named full tensors and their gaps as the file's tensors: each file comes back bitwise,
    strata.torch.load gives the full tensors, a partial load skips the partitions, and a
    partition seen again (its names taken) is a plain tensor."""
    import strata.torch
    w, b, m = torch.randn(2, 3), torch.randn(3), torch.randn(5)
    pa = torch.cat([torch.tensor([7.0]), w.reshape(-1), b])      # gap, w, b
    pb = torch.cat([m, torch.tensor([-1.5, 0.0])])               # m, gap
    e = sds.StrataCheckpointEngine()
    e._layout = {pa.data_ptr(): (10, torch.float32, "%s", [(1, 6, "w", 0, (2, 3)),
                                                           (7, 3, "b", 0, (3,))]),
                 pb.data_ptr(): (7, torch.float32, "m.%s", [(0, 5, "w", 0, (5,))])}
    d = str(tmp_path)
    _save(e, d, "t", {"r0.pt": {"p": [pa], "x": torch.ones(2)}, "r1.pt": {"p": pb[:5]},
                      "r2.pt": {"again": pa}}).wait()
    ck = strata.Checkpoint(os.path.join(d, "t", "strata"))
    assert {t["name"] for t in ck.tensors} == {"w", "b", "m.w", "r0.pt#0", "r0.pt#1",
                                               "r2.pt#0"}    # pb[:5]: no gap
    got = e.load(os.path.join(d, "t", "r0.pt"))
    assert torch.equal(got["p"][0], pa) and torch.equal(got["x"], torch.ones(2))
    assert torch.equal(e.load(os.path.join(d, "t", "r1.pt"))["p"], m)
    assert torch.equal(e.load(os.path.join(d, "t", "r2.pt"))["again"], pa)
    sd = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "m.w": torch.zeros(5)}
    strata.torch.load(sd, os.path.join(d, "t", "strata"))
    assert torch.equal(sd["w"], w) and torch.equal(sd["b"], b) and torch.equal(sd["m.w"], m)
    part = sds.load_entry(os.path.join(d, "t", "strata"), "r0.pt", partitions=False)
    assert part["p"] == [None] and torch.equal(part["x"], torch.ones(2))


def _flat_tag(d, tag, monkeypatch, mutate=None):
    """A tag whose entry r0.pt holds one flat partition (a gap of 1, then w 2x3, then b 3),
    its "F" node changed by mutate(node) before it is written, as a crafted file would."""
    w, b = torch.randn(2, 3), torch.randn(3)
    pa = torch.cat([torch.tensor([7.0]), w.reshape(-1), b])
    e = sds.StrataCheckpointEngine()
    e._layout = {pa.data_ptr(): (10, torch.float32, "%s", [(1, 6, "w", 0, (2, 3)),
                                                           (7, 3, "b", 0, (3,))])}
    if mutate is not None:
        enc = sds._values.encode

        def encode(tree):
            for n in sds._flat_nodes(tree):
                mutate(n)
            return enc(tree)
        monkeypatch.setattr(sds._values, "encode", encode)
    _save(e, d, tag, {"r0.pt": {"p": pa}}).wait()
    monkeypatch.undo()
    return pa, os.path.join(d, tag, "r0.pt")


def test_flat_hostile(tmp_path, monkeypatch):
    """A malformed "F" node (flat partition) of an entry is refused, naming the entry:
    pieces naming a tensor the checkpoint lacks (a named range or a gap) NotFoundError,
    pieces that fall short of the partition UnfilledError, pieces past it, a range outside
    its tensor or a malformed piece FormatError, a dtype other than the tensor's
    MismatchError."""
    d = str(tmp_path)
    e = sds.StrataCheckpointEngine()
    pa, path = _flat_tag(d, "ok", monkeypatch)
    assert torch.equal(e.load(path)["p"], pa)
    where = r"strata: entry 'r0\.pt'"
    cases = [
        ("name", lambda n: n[4][1].__setitem__(1, "nope"), strata.NotFoundError,
         where + r": no tensor 'nope' in the checkpoint"),
        ("short", lambda n: n[4].pop(), strata.UnfilledError,
         where + r": flat pieces of 7 elements for a partition of 10"),
        ("gap", lambda n: n[4][0].__setitem__(1, 5), strata.NotFoundError,
         where + r": a flat partition's gap, tensor 'r0\.pt#5', is not in the checkpoint"),
        ("long", lambda n: n[4].append(["n", "b", 0, 3]), strata.FormatError,
         where + r": flat pieces of more than the partition's 10 elements"),
        ("range", lambda n: n[4][2].__setitem__(2, 1), strata.FormatError,
         where + r": elements \[1, 4\) of 'b', which has 3"),
        ("piece", lambda n: n[4][1].__setitem__(2, -1), strata.FormatError,
         where + r": a malformed flat piece \['n', 'w', -1, 6\]"),
        ("kind", lambda n: n[4][1].__setitem__(0, "q"), strata.FormatError,
         where + r": a malformed flat piece \['q'"),
        ("node", lambda n: n.__setitem__(2, "10"), strata.FormatError,
         where + r": a malformed flat partition"),
        ("dtype", lambda n: n.__setitem__(1, "bf16"), strata.MismatchError,
         where + r": 'w' is f32 \(2, 3\) in the checkpoint, bf16 \(flat\) here"),
    ]
    for tag, mutate, err, msg in cases:
        _, path = _flat_tag(d, tag, monkeypatch, mutate)
        with pytest.raises(err, match=msg):
            e.load(path)
        part = sds.load_entry(os.path.join(d, tag, "strata"), "r0.pt", partitions=False)
        assert part == {"p": None}, tag      # the partition unread: no error


class _Pair:
    """Two ranks of one process (threads) whose strata.Comm meets over a barrier; the
    collectives of rank 0 counted."""

    def __init__(self):
        import threading
        self.barrier, self.buf, self.calls = threading.Barrier(2), [None, None], 0

    def _comm(self, r):
        def meet(data):
            self.buf[r] = data
            self.barrier.wait()
            got = list(self.buf)
            self.calls += r == 0
            self.barrier.wait()
            return got

        def allgather(send, recv):
            recv[:] = b"".join(meet(bytes(send)))

        def alltoallv(send, scounts, recv, rcounts):
            mine = bytes(send)
            parts = [mine[sum(scounts[:d]):sum(scounts[:d + 1])] for d in range(2)]
            recv[:] = b"".join(p[r] for p in meet(parts))

        def bcast(buf, root):
            raise AssertionError("not used")
        return strata.Comm.host(r, 2, allgather, alltoallv, bcast)

    def run(self, fn, args):
        """fn(group of rank r, *args[r]) on both ranks: [result or exception] by rank."""
        import threading
        out = [None, None]

        class Rank:
            size = 2

            def __init__(rk, r):
                rk.rank, rk.comm = r, self._comm(r)

        def one(r):
            try:
                out[r] = fn(Rank(r), *args[r])
            except Exception as e:
                out[r] = e
        ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out


def test_agree_files():
    """The ranks' file lists of a tag are agreed in one collective when all is well (and
    when a rank failed, briefly), two for lists longer than _FILES_INLINE; a file of two
    ranks, or a rank's failure, is raised on every rank, naming them."""
    p = _Pair()
    files = [["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
             ["zero_pp_rank_1_mp_rank_00_optim_states.pt"]]
    assert p.run(sds._agree_files, [(files[0], None), (files[1], None)]) == [None, None]
    assert p.calls == 1
    p = _Pair()
    got = p.run(sds._agree_files, [(["a.pt"], None), (["b.pt", "a.pt"], None)])
    assert p.calls == 1 and all(isinstance(g, strata.InvalidArgumentError) for g in got)
    assert all("a.pt: saved by ranks 0 and 1 in one tag" in str(g) for g in got)
    p = _Pair()
    got = p.run(sds._agree_files, [(["a.pt"], None), ([], strata.MismatchError("boom"))])
    assert p.calls == 1 and isinstance(got[0], strata.MismatchError)
    assert "strata.deepspeed save failed on rank 1: boom" in str(got[0])
    assert str(got[1]) == "boom"
    p = _Pair()
    many = [["f%03d.pt" % i for i in range(60)], ["g%03d.pt" % i for i in range(60)]]
    assert p.run(sds._agree_files, [(many[0], None), (many[1], None)]) == [None, None]
    assert p.calls == 2


class Opaque:
    def __init__(self):
        self.v = 3


def test_pickle_opt_in(tmp_path):
    """An object strata does not rebuild is refused by name without pickle=True, and needs
    pickle=True again at load."""
    d = str(tmp_path)
    e = sds.StrataCheckpointEngine()
    with pytest.raises(strata.InvalidArgumentError, match=r"m\.pt\['sched'\]\['fn'\]: a .*Opaque "
                       r"cannot be saved without pickle"):
        _save(e, d, "t1", {"m.pt": {"sched": {"fn": Opaque()}}})
    assert not os.path.exists(os.path.join(d, "t1", "strata"))
    p = sds.StrataCheckpointEngine(pickle=True)
    _save(p, d, "t2", {"m.pt": {"sched": {"fn": Opaque()}}}).wait()
    with pytest.raises(strata.InvalidArgumentError, match="holds a pickled object"):
        e.load(os.path.join(d, "t2", "m.pt"))
    assert p.load(os.path.join(d, "t2", "m.pt"))["sched"]["fn"].v == 3


def test_load_errors(tmp_path):
    """A tag not committed, a stub naming another place, a torch.save file without pickle,
    a missing file: each its own error."""
    d = str(tmp_path)
    e = sds.StrataCheckpointEngine()
    _save(e, d, "ok", {"m.pt": {"x": torch.ones(2)}}).wait()
    os.remove(os.path.join(d, "ok", "strata", "COMMIT"))    # as a kill before the commit
    with pytest.raises(strata.IncompleteError):
        e.load(os.path.join(d, "ok", "m.pt"))
    os.makedirs(os.path.join(d, "evil"))
    with open(os.path.join(d, "evil", "m.pt"), "wb") as f:
        f.write(sds.STUB_MAGIC + b"../ok/m.pt\n")
    with pytest.raises(strata.FormatError, match="not this file's place"):
        e.load(os.path.join(d, "evil", "m.pt"))
    torch.save({"x": 1}, os.path.join(d, "plain.pt"))
    with pytest.raises(strata.InvalidArgumentError, match="a torch.save file"):
        e.load(os.path.join(d, "plain.pt"))
    assert sds.StrataCheckpointEngine(pickle=True).load(os.path.join(d, "plain.pt")) == {"x": 1}
    with pytest.raises(strata.MissingError):
        e.load(os.path.join(d, "none.pt"))
    with pytest.raises(strata.InvalidArgumentError, match="outside the tag directory"):
        _save(e, d, "t3", {"../x.pt": {}})


def test_class_not_allowed(tmp_path, monkeypatch):
    """An entry naming a class off the allow-list is FormatError naming it, never imported."""
    d = str(tmp_path)
    name = "%s.%s" % (Opaque.__module__, Opaque.__qualname__)
    monkeypatch.setattr(_ds_entry, "_OBJECTS", _ds_entry._OBJECTS | {name})  # as a crafted
    _save(sds.StrataCheckpointEngine(), d, "t", {"m.pt": {"o": Opaque()}}).wait()  # file would
    monkeypatch.setattr(_ds_entry, "_OBJECTS", _ds_entry._OBJECTS - {name})
    with pytest.raises(strata.FormatError, match="names the class '%s', which strata does not "
                       "rebuild" % name):
        sds.StrataCheckpointEngine(pickle=True).load(os.path.join(d, "t", "m.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("ws", [3, 1])
def test_reshard(ref_run, ws, figures):
    """Step 10 of ZeRO 1, 2 and 3, saved on 2 ranks, resumed on ws: the fp32 master weights
    and AdamW moments (gathered whole) bitwise, step, lr scheduler, loss scale and client
    state equal, and the next losses within 1e-5 relative of the uninterrupted run's."""
    import json
    out, _ = ref_run
    _run("reshard", out, ws)
    worst = 0.0
    for r in range(ws):
        with open(os.path.join(out, "reshard%d-%d.json" % (ws, r))) as f:
            rep = json.load(f)
        for stage in _STAGES_RESHARD:
            x = rep[str(stage)]
            where = "stage %d on %d ranks, rank %d" % (stage, ws, r)
            assert x["path"] is not None and x["client"], where
            assert x["full_diff"] == [], "%s: differs: %s" % (where, x["full_diff"][:8])
            assert x["scalars"] == x["scalars_want"], where
            assert len(x["losses"]) == len(x["losses_want"]) > 0, where
            for got, want in zip(x["losses"], x["losses_want"]):
                rel = abs(got - want) / abs(want)
                worst = max(worst, rel)
                assert rel <= 1e-5, "%s: loss %r, uninterrupted %r" % (where, got, want)
    figures("deepspeed reshard 2->%d" % ws, "ZeRO %s: weights and moments bitwise; losses of "
            "steps %d-%d within %.2g relative" % (_STAGES_RESHARD, 10, 13, worst))


@pytest.mark.slow
def test_fp32_weights(ref_run, tmp_path):
    """A strata-engine tag of ZeRO 1, 2 and 3 (saved on 2 ranks) loaded by strata.torch.load
    into plain tensors, and exported as safetensors: bitwise the fp32 master weights (and
    moments) the optimizer held at save time, under zero_to_fp32's names."""
    import json
    import strata.torch
    from safetensors.torch import load_file
    from _ds_worker import Model
    out, _ = ref_run
    for stage in _STAGES_RESHARD:
        want = torch.load(os.path.join(out, "full%d.pt" % stage))
        ck = os.path.join(out, "ck%d" % stage, "step10", "strata")
        sd = {k: torch.full_like(v, float("nan")) for k, v in Model().state_dict().items()}
        strata.torch.load(sd, ck)
        for k, v in sd.items():
            assert torch.equal(v.view(torch.int32), want[k].view(torch.int32)), (stage, k)
        ex = str(tmp_path / ("st%d" % stage))
        strata.torch.export_safetensors(ck, ex, exclude=["*#*"])   # not the files' own
        got = {}
        index = os.path.join(ex, "model.safetensors.index.json")
        for f in (set(json.load(open(index))["weight_map"].values()) if os.path.exists(index)
                  else ["model.safetensors"]):       # one file: no index
            got.update(load_file(os.path.join(ex, f)))
        assert sorted(got) == sorted(want), stage
        for k, v in want.items():
            assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), (stage, k)
