"""Errors raised in C arrive through strata.torch as the right exception class, with the C
message: corrupt data (ChecksumError naming the tensor and the file), a missing tensor
(NotFoundError), a shape or dtype mismatch (MismatchError), an incomplete checkpoint
(IncompleteError); and the errors strata.torch raises itself name the key."""

import os
import shutil

import pytest
import torch

import strata
import strata.torch as st

import _dist


def state():
    g = torch.Generator().manual_seed(7)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.randn(7, generator=g)},
            "extra": torch.arange(11, dtype=torch.int64), "step": 5}


def target():
    return {"model": {"w": torch.zeros(300, 7), "b": torch.zeros(7)},
            "extra": torch.zeros(11, dtype=torch.int64), "step": 0}


def flip_byte(path, tensor):
    """Flips a byte in the middle of `tensor`'s data in its data file; returns the file."""
    ck = strata.Checkpoint(path)
    entry = [t for t in ck.tensors if t["name"] == tensor]
    assert entry, "no tensor %r in %s: %s" % (tensor, path, [t["name"] for t in ck.tensors])
    shard = entry[0]["shards"][0]
    fname = shard["file"]
    full = fname if os.path.isabs(fname) else os.path.join(path, fname)
    at = shard["file_offset"] + shard["bytes"] // 2
    with open(full, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
    return os.path.basename(full)


def test_exception_classes():
    for name in ("ChecksumError", "NotFoundError", "MismatchError", "IncompleteError",
                 "InvalidArgumentError", "AbortedError"):
        cls = getattr(strata, name)
        assert issubclass(cls, strata.Error)
        assert cls in strata.ERRORS.values()


def test_corrupt_data_is_checksum_error_naming_tensor_and_file(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    fname = flip_byte(path, "model.w")
    t = target()
    with pytest.raises(strata.ChecksumError) as ei:
        st.load(t, path)
    msg = str(ei.value)
    assert "model.w" in msg, msg
    assert fname in msg, msg
    assert ei.value.name == "STRATA_ECHECKSUM"
    # verify() finds it too; the tensors the corruption does not touch still load
    with pytest.raises(strata.ChecksumError):
        strata.Checkpoint(path).verify()
    t2 = {"model": {"b": torch.zeros(7)}, "extra": torch.zeros(11, dtype=torch.int64)}
    st.load(t2, path)
    assert torch.equal(t2["model"]["b"], state()["model"]["b"])


def test_corrupt_tier_falls_back_to_the_next(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    st.save(state(), tiers)
    flip_byte(tiers[0], "model.w")
    t = target()
    stats = st.load(t, tiers)
    assert stats["tier"] == 1
    assert torch.equal(t["model"]["w"], state()["model"]["w"])


def test_missing_tensor_is_not_found_error(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    t = target()
    t["model"]["zz_missing"] = torch.zeros(3)
    with pytest.raises(strata.NotFoundError) as ei:
        st.load(t, path)
    assert "model.zz_missing" in str(ei.value)


def test_missing_value_is_not_found_error(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    t = target()
    t["epoch"] = 0
    with pytest.raises(strata.NotFoundError) as ei:
        st.load(t, path)
    assert "epoch" in str(ei.value)


def test_shape_mismatch_is_mismatch_error(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    t = target()
    t["model"]["w"] = torch.zeros(301, 7)
    with pytest.raises(strata.MismatchError) as ei:
        st.load(t, path)
    assert "model.w" in str(ei.value)


def test_dtype_mismatch_is_mismatch_error(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    t = target()
    t["model"]["b"] = torch.zeros(7, dtype=torch.float16)   # narrowing: f32 -> f16 rounds
    with pytest.raises(strata.MismatchError) as ei:
        st.load(t, path)
    assert "model.b" in str(ei.value) and "cast=True" in str(ei.value)


def test_incomplete_checkpoint_is_incomplete_error(tmp_path):
    path = str(tmp_path / "ck")
    st.save(state(), path)
    os.remove(os.path.join(path, "COMMIT"))
    assert not strata.probe(path)["committed"]
    with pytest.raises(strata.IncompleteError) as ei:
        st.load(target(), path)
    assert str(ei.value)
    assert ei.value.name == "STRATA_EINCOMPLETE"


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(strata.Error):
        st.load(target(), str(tmp_path / "nothing-here"))


def test_unsupported_dtype_names_the_tensor(tmp_path):
    with pytest.raises(strata.Error) as ei:
        st.save({"ok": torch.zeros(2), "weird": {"z": torch.zeros(3, dtype=torch.complex64)}},
                str(tmp_path / "ck"))
    assert "weird.z" in str(ei.value)
    assert not os.path.exists(str(tmp_path / "ck")) or not strata.probe(str(tmp_path / "ck"))["committed"]


def test_meta_tensor_is_refused_naming_the_key(tmp_path):
    with pytest.raises(Exception) as ei:
        st.save({"ok": torch.ones(2), "on_meta": torch.empty(4, device="meta")},
                str(tmp_path / "ck"))
    assert "on_meta" in str(ei.value) and "meta" in str(ei.value).replace("on_meta", "")


def test_not_contiguous_conj_neg_are_copied_or_refused_naming_the_key(tmp_path):
    """The spec allows either: a copy (then the values round-trip) or an error naming the key."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cases = {"transposed": base.t(), "strided": base[:, ::2],
             "neg": torch.arange(4.0)._neg_view(),
             "conj": torch.tensor([1 + 2j], dtype=torch.complex64).conj()}
    for key, t in cases.items():
        path = str(tmp_path / key)
        try:
            st.save({key: t}, path)
        except strata.Error as e:
            assert key in str(e), (key, str(e))
            continue
        if t.is_complex():
            pytest.fail("%s: a complex tensor was saved (strata has no complex dtype)" % key)
        back = {key: torch.zeros(t.shape, dtype=t.dtype)}
        st.load(back, path)
        assert torch.equal(back[key], t.resolve_neg().resolve_conj()), key


def test_value_needing_pickle_is_refused_naming_the_key(tmp_path):
    class Opaque:
        pass
    with pytest.raises(strata.Error) as ei:
        st.save({"cfg": {"thing": Opaque()}}, str(tmp_path / "ck"))
    assert "cfg" in str(ei.value) and "pickle" in str(ei.value)


# ---- the same errors on several ranks -----------------------------------------------------

def dist_errors(base):
    """2 ranks, a DTensor over both: each error must reach every rank as a strata.Error
    (never a hang), and the right class where it happened."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(4000, dtype=torch.float32).reshape(400, 10)

    def sd():
        return {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
                "r": torch.ones(5), "n": 3}

    def zero_sd():
        d = sd()
        d["w"].to_local().zero_()
        d["r"].zero_()
        d["n"] = 0
        return d

    path = os.path.join(base, "ck")
    st.save(sd(), path)
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except strata.Error as e:
            out[name] = (type(e).__name__, str(e))
        dist.barrier()

    def mismatch():
        d = zero_sd()
        d["r"] = torch.zeros(6)
        st.load(d, path)
    attempt("mismatch", mismatch)

    def missing():
        d = zero_sd()
        d["zz"] = torch.zeros(2)
        st.load(d, path)
    attempt("missing", missing)

    # corrupt rank 1's rows of w (the second half of the tensor)
    if rank == 0:
        ck = strata.Checkpoint(path)
        w = [t for t in ck.tensors if t["name"] == "w"][0]
        shard = max(w["shards"], key=lambda s: s["offsets"][0] if s["offsets"] else 0)
        fname = shard["file"] if os.path.isabs(shard["file"]) else os.path.join(path, shard["file"])
        at = shard["file_offset"] + shard["bytes"] - 3
        with open(fname, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        out["corrupt_file"] = os.path.basename(fname)
    dist.barrier()
    attempt("corrupt", lambda: st.load(zero_sd(), path))

    if rank == 0:
        shutil.copytree(path, os.path.join(base, "inc"))
        os.remove(os.path.join(base, "inc", "COMMIT"))
    dist.barrier()
    attempt("incomplete", lambda: st.load(zero_sd(), os.path.join(base, "inc")))
    return out


@pytest.mark.slow
def test_errors_on_two_ranks(tmp_path):
    res = _dist.run(dist_errors, 2, str(tmp_path), timeout=120)
    for case, cls in (("mismatch", "MismatchError"), ("missing", "NotFoundError"),
                      ("incomplete", "IncompleteError")):
        for rank, r in enumerate(res):
            assert r[case] is not None, "%s: rank %d loaded without an error" % (case, rank)
            assert r[case][0] == cls, "%s: rank %d raised %s: %s" % (case, rank, *r[case])
    # corrupt: every rank fails; the rank(s) that read the bad chunk say ChecksumError naming
    # the tensor and the file, the others may say that another rank failed
    fname = res[0]["corrupt_file"]
    got = [r["corrupt"] for r in res]
    assert all(g is not None for g in got), got
    checks = [g for g in got if g[0] == "ChecksumError"]
    assert checks, got
    for cls, msg in checks:
        assert "'w'" in msg, msg
        assert fname in msg, msg
    for cls, msg in got:
        assert cls in ("ChecksumError", "AbortedError"), got
