"""One open per load: strata.Loader and strata.torch.load.

- strata.Loader opens a checkpoint once: its index (what strata.Checkpoint says), then loads
  of other state dicts with no second read (the index may be gone from the disk meanwhile),
  the plan reused for a request that repeats, tier fallback.
- strata.torch.load across 3 gloo processes (a checkpoint saved by 2, FSDP-style Shard(0)
  DTensors): every torch.distributed.broadcast during the load is counted - one, the
  loader's - and the index is read once, by rank 0 (stats meta_reads / meta_bcasts). It
  used to be read and broadcast by Python (two broadcasts), then again by the C load (two
  more).
"""

import os

import pytest
import torch

import _dist


def _hide(path, hide):
    for n in ("COMMIT", "metadata.bin"):
        a, b = os.path.join(path, n), os.path.join(path, n + ".away")
        os.rename(a, b) if hide else os.rename(b, a)


def _model_sd(n=3):
    return {"w%d" % i: torch.arange(6 * (i + 1), dtype=torch.float32).reshape(i + 1, 6) * (i + 1)
            for i in range(n)}


def _add(state, name, t):
    state.add_shard(name, "f32", tuple(t.shape), data_ptr=t.data_ptr(),
                    nbytes=t.numel() * t.element_size(), keep=t)


def test_loader_index_and_repeated_loads(tmp_path):
    import strata
    import strata.torch as st
    path = str(tmp_path / "ck")
    sd = _model_sd()
    sd["step"] = 7
    st.save(sd, path)
    ck = strata.Checkpoint(path)
    with strata.Loader(path) as ld:
        ix = ld.index()
        assert ld.tier == 0 and ld.uri == path
        assert ix["uri"] == 0 and ix["f"] == "strata" and ix["step"] == ck.step
        assert ix["chunk_bytes"] == ck.chunk_bytes and ix["data_bytes"] == ck.data_bytes
        assert ix["t"] == [[t["name"], t["dtype"], list(t["shape"])] for t in ck.tensors]
        assert ix["b"] == [[b["name"], b["owner"], b["bytes"]] for b in ck.blobs]
        _hide(path, True)   # loads never read the index again
        try:
            for i, cached in [(0, False), (1, False), (1, True), (2, False)]:
                out = torch.zeros(i + 1, 6)
                s = strata.State()
                _add(s, "w%d" % i, out)
                stats = ld.load([s])
                assert torch.equal(out, sd["w%d" % i])
                assert stats["plan_cached"] is cached
                assert stats["meta_reads"] == 1 and stats["meta_bcasts"] == 0
                assert stats["tier"] == 0
        finally:
            _hide(path, False)
    with pytest.raises(strata.InvalidArgumentError, match="closed"):
        ld.index()


def test_loader_tiers_and_errors(tmp_path):
    import strata
    import strata.torch as st
    good = str(tmp_path / "good")
    st.save(_model_sd(1), good)
    missing = str(tmp_path / "missing")
    with strata.Loader([missing, good]) as ld:
        assert ld.tier == 1 and ld.uri == good
        out = torch.zeros(1, 6)
        s = strata.State()
        _add(s, "w0", out)
        stats = ld.load([s])
        assert stats["tier"] == 1 and stats["meta_reads"] == 2
        assert torch.equal(out, _model_sd(1)["w0"])
    with pytest.raises(strata.MissingError, match="missing"):
        strata.Loader(missing)
    with pytest.raises(strata.MissingError, match="no copy could be loaded"):
        strata.Loader([missing, missing])
    with pytest.raises(strata.InvalidArgumentError):
        strata.Loader([])
    with pytest.raises(TypeError):
        strata.Loader(good, comm=3)


def saver(path):
    """2 ranks save FSDP-style Shard(0) DTensors and a value."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _model_sd(4).items()}
    sd["step"] = 11
    st.save(sd, path)


def loader(path):
    """3 ranks load it resharded, counting every torch.distributed.broadcast in the load."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)])
          for k, v in _model_sd(4).items()}
    sd["step"] = 0
    st._group(None)             # the group's gloo groups exist before counting
    calls = []
    real = dist.broadcast

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.broadcast = counting
    try:
        stats = st.load(sd, path)
    finally:
        dist.broadcast = real
    ok = all(torch.equal(sd[k].full_tensor(), v) for k, v in _model_sd(4).items())
    return {"bcasts": len(calls), "meta_reads": stats["meta_reads"],
            "meta_bcasts": stats["meta_bcasts"], "ok": ok and sd["step"] == 11}


@pytest.mark.slow
def test_torch_load_opens_once(tmp_path):
    path = str(tmp_path / "ck")
    _dist.run(saver, 2, path, timeout=180)
    res = _dist.run(loader, 3, path, timeout=180)
    for rank, r in enumerate(res):
        assert r["ok"], rank
        assert r["bcasts"] == 1, (rank, r)
        assert r["meta_bcasts"] == 1, (rank, r)
        assert r["meta_reads"] == (1 if rank == 0 else 0), (rank, r)
