"""strata.torch called as torch.distributed.checkpoint is called (issue 30, "DCP call sites
should work as written"): DCP's keywords (checkpoint_id, storage_writer / storage_reader,
planner, no_dist, use_collectives, async_stager, async_checkpointer_type) with DCP's own
objects (FileSystemWriter / FileSystemReader, DefaultSavePlanner / DefaultLoadPlanner,
DefaultStager) from torch 2.13, what async_save returns (a concurrent.futures.Future, or
an AsyncSaveResponse with a background stager), partial loads, and errors that name
Python's arguments, never the C flags behind them. One process here; the multi-process
training loop run both ways is test_dcp_switch.py."""

import concurrent.futures
import logging
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import strata
import strata.torch as st


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Linear(23, 11)
        self.b = nn.Linear(11, 5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def same_params(m, want):
    got = m.state_dict()
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def strata_ckpt(path):
    """A committed strata checkpoint at path (strata's own files, none of DCP's)."""
    return (strata.probe(path)["committed"] and os.path.exists(os.path.join(path, "COMMIT"))
            and not os.path.exists(os.path.join(path, ".metadata")))


# ---- save / load: checkpoint_id, state_dict first -------------------------------------------

def test_checkpoint_id_keyword(tmp_path):
    src = Net(1)
    want = params(src)
    p = str(tmp_path / "ck")
    stats = st.save({"model": src, "step": 7}, checkpoint_id=p)
    assert stats["data_bytes"] > 0 and strata_ckpt(p)
    dst, box = Net(2), {"model": None, "step": 0}
    box["model"] = dst
    st.load(state_dict=box, checkpoint_id=p)          # DCP's keyword for the state too
    assert same_params(dst, want) and box["step"] == 7
    # strata's own order still works, and the two given at once must agree
    st.load({"model": Net(3)}, p)
    st.load({"model": Net(3)}, p, checkpoint_id=p)
    with pytest.raises(strata.InvalidArgumentError, match="differ"):
        st.load({"model": Net(3)}, p, checkpoint_id=str(tmp_path / "other"))
    with pytest.raises(strata.InvalidArgumentError, match="checkpoint_id="):
        st.save({"model": src})


def test_no_dist_and_process_group_keywords(tmp_path):
    p = str(tmp_path / "ck")
    src = Net(4)
    st.save({"model": src}, checkpoint_id=p, process_group=None, no_dist=True)
    dst = Net(5)
    st.load({"model": dst}, checkpoint_id=p, process_group=None, no_dist=True)
    assert same_params(dst, params(src))


# ---- DCP's writer and reader ------------------------------------------------------------------

def test_filesystem_writer_and_reader(tmp_path):
    p = str(tmp_path / "ck")
    first = Net(6)
    st.save({"model": first}, storage_writer=dcp.FileSystemWriter(p))
    assert strata_ckpt(p)
    dst = Net(7)
    st.load({"model": dst}, storage_reader=dcp.FileSystemReader(p))
    assert same_params(dst, params(first))
    # overwrite=True (DCP's default): an atomic replace, the new checkpoint at the path
    second = Net(8)
    st.save({"model": second}, storage_writer=dcp.FileSystemWriter(p, overwrite=True))
    st.load({"model": dst}, storage_reader=dcp.FileSystemReader(p))
    assert same_params(dst, params(second)) and strata_ckpt(p)
    assert sorted(os.listdir(tmp_path)) == ["ck"]   # nothing left beside it
    # overwrite=False: a committed checkpoint is never overwritten, said in Python's words
    with pytest.raises(strata.ExistsError) as e:
        st.save({"model": first}, storage_writer=dcp.FileSystemWriter(p, overwrite=False))
    assert "replace=True" in str(e.value) and "STRATA_" not in str(e.value)
    # checkpoint_id given with a writer is the path, as DCP takes it
    q = str(tmp_path / "q")
    st.save({"model": first}, checkpoint_id=q, storage_writer=dcp.FileSystemWriter(p))
    assert strata_ckpt(q)
    st.load({"model": dst}, checkpoint_id=p)
    assert same_params(dst, params(second))
    # sync_files=False: taken (no fsync), the checkpoint as committed as any
    r = str(tmp_path / "r")
    st.save({"model": first}, storage_writer=dcp.FileSystemWriter(r, sync_files=False))
    assert strata_ckpt(r)


def test_foreign_writers_readers_planners_refused(tmp_path):
    p = str(tmp_path / "ck")
    sd = {"model": Net(9)}

    class MyWriter(dcp.FileSystemWriter):
        pass

    class MyReader(dcp.FileSystemReader):
        pass

    class MySavePlanner(dcp.DefaultSavePlanner):
        pass

    class MyLoadPlanner(dcp.DefaultLoadPlanner):
        pass

    cases = [
        (st.save, dict(storage_writer=MyWriter(p)), "storage_writer=.*MyWriter.*checkpoint_id="),
        (st.save, dict(checkpoint_id=p, planner=MySavePlanner()), "MySavePlanner.*plans a save"),
        (st.save, dict(checkpoint_id=p, use_collectives=False), "use_collectives=False"),
        (st.async_save, dict(checkpoint_id=p, planner=MySavePlanner()), "plans a save"),
        (st.save, dict(storage_writer=dcp.FileSystemWriter(
            p, serialization_format=dcp.filesystem.SerializationFormat.SAFETENSORS)),
         "export_safetensors"),
    ]
    for fn, kw, msg in cases:
        with pytest.raises(strata.InvalidArgumentError, match=msg):
            fn(sd, **kw)
        assert not os.path.exists(p), kw          # nothing written
    st.save(sd, checkpoint_id=p)
    for kw, msg in [(dict(storage_reader=MyReader(p)), "storage_reader=.*MyReader"),
                    (dict(checkpoint_id=p, planner=MyLoadPlanner()), "plans a load.*partial=True")]:
        with pytest.raises(strata.InvalidArgumentError, match=msg):
            st.load(sd, **kw)


def test_default_planners_accepted(tmp_path):
    """DCP's own planners, with their options: what they ask of a save strata does anyway."""
    src = Net(10)
    for i, planner in enumerate([dcp.DefaultSavePlanner(),
                                 dcp.DefaultSavePlanner(flatten_state_dict=False,
                                                        dedup_replicated_tensors=False,
                                                        enable_plan_caching=True)]):
        p = str(tmp_path / ("ck%d" % i))
        st.save({"model": src}, checkpoint_id=p, planner=planner)
        dst = Net(11)
        st.load({"model": dst}, checkpoint_id=p, planner=dcp.DefaultLoadPlanner())
        assert same_params(dst, params(src))


# ---- async_save: DCP's Future, and its staging / upload pair ---------------------------------

def test_async_save_is_a_future(tmp_path):
    """dcp.async_save's contract: a Future; the state may change as soon as it returns (DCP
    stages before returning); result() is the commit."""
    src = Net(12)
    want = params(src)
    p = str(tmp_path / "ck")
    called = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # no "changed in place before wait_snapshot()"
        f = st.async_save({"model": src}, checkpoint_id=p,
                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        assert isinstance(f, concurrent.futures.Future) and isinstance(f, st.AsyncSave)
        with torch.no_grad():                         # DCP's loop: optimizer.step() at once
            for q in src.parameters():
                q.add_(1.0)
        f.add_done_callback(called.append)
        stats = f.result(timeout=600)
    assert stats["data_bytes"] > 0 and f.done() and f.exception() is None
    assert not f.cancel() and not f.cancelled() and not f.running()
    assert called == [f]
    done, _ = concurrent.futures.wait([f], timeout=0)
    assert done == {f}
    dst = Net(13)
    st.load({"model": dst}, checkpoint_id=p)
    assert same_params(dst, want)                     # the values as async_save saw them
    # an error: result() raises it (the save's own), exception() returns it
    g = st.async_save({"model": src}, storage_writer=dcp.FileSystemWriter(p, overwrite=False))
    with pytest.raises(strata.ExistsError, match="replace=True"):
        g.result()
    assert isinstance(g.exception(), strata.ExistsError) and g.done()


def test_async_stager_response(tmp_path):
    """With a stager that stages in the background, DCP returns AsyncSaveResponse: strata
    returns one too, staging_completion ending with its snapshot."""
    src = Net(14)
    want = params(src)
    p = str(tmp_path / "ck")
    stager = DefaultStager(StagingOptions(False, False, True, False))
    r = st.async_save({"model": src}, checkpoint_id=p, async_stager=stager)
    assert isinstance(r, AsyncSaveResponse)
    assert isinstance(r.staging_completion, concurrent.futures.Future)
    assert r.staging_completion.result() is None and r.staging_completion.done()
    with torch.no_grad():
        for q in src.parameters():
            q.mul_(3.0)
    assert isinstance(r.upload_completion, st.AsyncSave)
    assert r.upload_completion.result()["data_bytes"] > 0
    stager.close()
    dst = Net(15)
    st.load({"model": dst}, checkpoint_id=p)
    assert same_params(dst, want)
    # a blocking stager (DCP's FileSystemWriter is one) stages before returning: a Future
    q = str(tmp_path / "q")
    f = st.async_save({"model": src}, checkpoint_id=q,
                      async_stager=DefaultStager(StagingOptions(False, False, False, False)))
    assert isinstance(f, st.AsyncSave) and f.result()["data_bytes"] > 0

    class MyStager(DefaultStager):
        pass
    with pytest.raises(strata.InvalidArgumentError, match="DefaultStager"):
        st.async_save({"model": src}, checkpoint_id=str(tmp_path / "z"),
                      async_stager=MyStager(StagingOptions(False, False, False, False)))


def test_strata_async_save_unchanged(tmp_path):
    """strata's own call (the path after the state) keeps strata's contract and methods:
    it returns at once; wait_snapshot() before changing the tensors, then wait()."""
    src = Net(16)
    p = str(tmp_path / "ck")
    a = st.async_save({"model": src}, p)
    a.wait_snapshot()
    assert a.wait()["data_bytes"] > 0 and a.result()["data_bytes"] > 0


# ---- partial loads --------------------------------------------------------------------------

class Tied(nn.Module):
    """A model with an output layer tied to its embedding: a checkpoint written without the
    tied copy (as transformers drops it) lacks lm_head.weight."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(13, 6)
        self.lm_head = nn.Linear(6, 13, bias=False)
        self.norm = nn.LayerNorm(6)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g))


def test_partial_load(tmp_path, caplog):
    src = Tied(1)
    sd = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    p = str(tmp_path / "ck")
    st.save({"model": sd, "step": 3}, checkpoint_id=p)

    dst = Tied(2)
    kept = dst.lm_head.weight.detach().clone()
    extra = {"count": 5, "buf": torch.arange(4.0)}
    state = {"model": dst, "step": 0, "extra": extra}
    with pytest.raises(strata.NotFoundError) as e:
        st.load({"model": dst}, checkpoint_id=p)
    assert "model.lm_head.weight" in str(e.value) and "partial=True" in str(e.value)
    assert torch.equal(dst.lm_head.weight, kept)

    # DCP's planner option
    with caplog.at_level(logging.INFO, logger="strata.torch"):
        stats = st.load(state, checkpoint_id=p,
                        planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert stats["missing"] == ["extra.buf", "extra.count", "model.lm_head.weight"]
    assert "model.lm_head.weight" in caplog.text
    assert torch.equal(dst.lm_head.weight, kept)                  # left as it was
    assert torch.equal(extra["buf"], torch.arange(4.0)) and extra["count"] == 5
    assert torch.equal(dst.emb.weight, sd["emb.weight"]) and state["step"] == 3
    assert torch.equal(dst.norm.bias, sd["norm.bias"])

    # strata's keyword, the same
    dst2 = Tied(3)
    stats = st.load({"model": dst2}, p, partial=True)
    assert stats["missing"] == ["model.lm_head.weight"]
    assert torch.equal(dst2.emb.weight, sd["emb.weight"])
    # nothing missing: an empty list
    assert st.load({"model": sd}, p, partial=True)["missing"] == []
    # the manager passes it through
    root = str(tmp_path / "run")
    mgr = st.CheckpointManager(root, async_save=False)
    mgr.save(1, {"model": sd})
    assert mgr.load({"model": Tied(4)}, partial=True) == 1
    with pytest.raises(strata.NotFoundError):
        mgr.load({"model": Tied(4)})
    mgr.close()


# ---- errors in Python's terms ----------------------------------------------------------------

def test_errors_name_python_arguments(tmp_path):
    """Messages of the C library reaching Python name the keyword argument, not the flag."""
    p = str(tmp_path / "ck")
    st.save({"w": torch.ones(3)}, p)
    with pytest.raises(strata.ExistsError) as e:          # STRATA_SAVE_REPLACE
        st.save({"w": torch.ones(3)}, p)
    assert "replace=True" in str(e.value) and "STRATA_" not in str(e.value)
    h = strata.Saver().start([p], [strata.State()])
    with pytest.raises(strata.ExistsError):
        h.wait_durable()
    code, msg = h.status()
    assert "replace=True" in msg and "STRATA_" not in msg
    h.close()
    # STRATA_LOAD_CAST / STRATA_LOAD_WIDEN, from the C planner through the binding
    buf = torch.empty(3, dtype=torch.bfloat16)
    s = strata.State()
    s.add_shard("w", "bf16", (3,), data_ptr=buf.data_ptr(), nbytes=6, keep=buf)
    with pytest.raises(strata.MismatchError) as e:
        strata.load([p], [s], widen=True)
    assert "cast=True would convert it" in str(e.value) and "STRATA_" not in str(e.value)
    wide = torch.empty(3, dtype=torch.float64)
    s = strata.State()
    s.add_shard("w", "f64", (3,), data_ptr=wide.data_ptr(), nbytes=24, keep=wide)
    with pytest.raises(strata.MismatchError) as e:
        strata.load([p], [s])
    assert "widen=True would convert it" in str(e.value) and "STRATA_" not in str(e.value)
    strata.load([p], [s], widen=True)
    assert torch.equal(wide, torch.ones(3, dtype=torch.float64))
    # strata_save_opts.base
    with pytest.raises(strata.InvalidArgumentError) as e:
        st.save({"w": torch.ones(3)}, str(tmp_path / "x"), base="a/b")
    assert str(e.value).startswith("base='a/b'") and "strata_save_opts" not in str(e.value)


def test_load_converts():
    assert strata.load_converts("f32", "f32")
    assert not strata.load_converts("bf16", "f32")
    assert strata.load_converts("bf16", "f32", widen=True)
    assert not strata.load_converts("f32", "bf16", widen=True)
    assert strata.load_converts("f32", "bf16", cast=True)
    assert not strata.load_converts("f32", "i32", cast=True, widen=True)
    assert strata.load_converts("i32", "i64", widen=True)
    with pytest.raises(strata.InvalidArgumentError):
        strata.load_converts("f33", "f32")


# ---- the newest checkpoint ----------------------------------------------------------------

def test_newest_checkpoint_of_a_dcp_style_loop(tmp_path):
    """Where a DCP script looks for .metadata to find the newest checkpoint, strata's is
    COMMIT (strata.probe tells), and CheckpointManager.latest() answers - for the step-<N>
    directories such a loop names (torchtitan's) as for the manager's own."""
    root = str(tmp_path / "run")
    for n in (5, 10, 15):
        st.save({"model": Net(n)}, checkpoint_id="%s/step-%d" % (root, n))
    os.remove(os.path.join(root, "step-15", "COMMIT"))      # a save that did not finish
    assert not strata.probe(root + "/step-15")["committed"]
    assert sorted(n for n in (5, 10, 15)
                  if os.path.exists("%s/step-%d/COMMIT" % (root, n))) == [5, 10]
    mgr = st.CheckpointManager(root, async_save=False)
    assert mgr.latest() == 10
    dst = Net(0)
    assert mgr.load({"model": dst}) == 10
    assert same_params(dst, params(Net(10)))
    mgr.save(12, {"model": Net(12)})                        # its own name beside them
    assert mgr.latest() == 12 and os.path.isdir(os.path.join(root, "step-00000012"))
    mgr.close()
