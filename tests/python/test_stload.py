"""Loading Hugging Face safetensors through strata: a model written by the `safetensors`
package (several files plus an index written here, every dtype) loads into 3 ranks with row
blocks and into 2 ranks with flat pieces, bitwise, reading exactly the requested bytes; into
a plain state dict with strata.torch.load; and into DTensors on 2 gloo processes, each rank
reading only its shards. Skips when the safetensors package is missing."""

import json
import os

import pytest
import torch

import strata
import strata.torch as st
from _tensors import DTYPES, same, sample
import _dist

safetensors_torch = pytest.importorskip("safetensors.torch")

TORCH_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool",
}


def model():
    sd = {}
    for i, dt in enumerate(DTYPES):
        sd["model.layers.%d.weight" % i] = sample(dt, (11 + i, 3 + i % 4), i)
        sd["model.layers.%d.bias" % i] = sample(dt, (7 + i,), 50 + i)
    sd["model.embed"] = sample(torch.float32, (257, 64), 99)
    sd["model.scale"] = sample(torch.float32, (), 98)
    return sd


def write_sharded(sd, out, files=3):
    """sd as `files` safetensors files written by the safetensors package, with the index."""
    os.makedirs(out, exist_ok=True)
    names = sorted(sd)
    weight_map = {}
    for f in range(files):
        part = {n: sd[n] for n in names[f::files]}
        fname = "model-%05d-of-%05d.safetensors" % (f + 1, files)
        safetensors_torch.save_file(part, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def nbytes(t):
    return t.numel() * t.element_size()


def add(state, name, t, gshape, offsets=None, lengths=None, flat=None):
    state.add_shard(name, TORCH_DTYPES[t.dtype], gshape, offsets, lengths,
                    data_ptr=t.data_ptr(), nbytes=nbytes(t), flat=flat, keep=t)


def fill(t):
    """Poison: a loaded tensor must be all new bytes."""
    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return t


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    sd = model()
    out = str(tmp_path_factory.mktemp("hf") / "model")
    write_sharded(sd, out)
    return sd, out


def test_rows_into_three_ranks(published):
    sd, out = published
    states = [strata.State() for _ in range(3)]
    got = {}
    for name, full in sd.items():
        if full.dim() == 0:
            t = fill(torch.empty((), dtype=full.dtype))
            add(states[0], name, t, ())
            got[name] = [(slice(None), t)]
            continue
        rows = full.shape[0]
        got[name] = []
        for r in range(3):
            a, b = rows * r // 3, rows * (r + 1) // 3
            t = fill(torch.empty((b - a,) + tuple(full.shape[1:]), dtype=full.dtype))
            add(states[r], name, t, tuple(full.shape), (a,) + (0,) * (full.dim() - 1),
                tuple(t.shape))
            got[name].append((slice(a, b), t))
    stats = strata.load(out, states)
    for name, parts in got.items():
        for sl, t in parts:
            want = sd[name] if sd[name].dim() == 0 else sd[name][sl]
            assert same(t, want), name
    assert stats["bytes"] == sum(nbytes(t) for t in sd.values())


def test_flat_pieces_into_two_ranks(published):
    sd, out = published
    states = [strata.State() for _ in range(2)]
    got = []
    for name, full in sd.items():
        n = full.numel()
        cut = n * 2 // 5
        for r, (a, b) in enumerate(((0, cut), (cut, n))):
            t = fill(torch.empty(b - a, dtype=full.dtype))
            add(states[r], name, t, tuple(full.shape), flat=(a, b))
            got.append((name, a, b, t))
    stats = strata.load(out, states)
    for name, a, b, t in got:
        assert same(t, sd[name].reshape(-1)[a:b]), name
    assert stats["bytes"] == sum(nbytes(t) for t in sd.values())


def test_reads_only_what_is_asked(published):
    sd, out = published
    emb = sd["model.embed"]
    t = fill(torch.empty(10, 64, dtype=torch.float32))
    s = strata.State()
    add(s, "model.embed", t, tuple(emb.shape), (100, 0), (10, 64))
    stats = strata.load(out, [s])
    assert same(t, emb[100:110])
    assert stats["bytes"] == nbytes(t)


def test_strata_torch_load(published):
    sd, out = published
    target = {k: fill(torch.empty_like(v)) for k, v in sd.items()}
    st.load(target, out)
    for k in sd:
        assert same(target[k], sd[k]), k
    # a single file, and its path
    single = os.path.join(os.path.dirname(out), "single")
    os.makedirs(single)
    safetensors_torch.save_file(sd, os.path.join(single, "model.safetensors"))
    for where in (single, os.path.join(single, "model.safetensors")):
        target = {k: fill(torch.empty_like(v)) for k, v in sd.items()}
        st.load(target, where)
        assert all(same(target[k], sd[k]) for k in sd)


def test_view_and_errors(published, tmp_path):
    sd, out = published
    ck = strata.Checkpoint(out)
    assert ck.chunk_bytes == 0 and ck.committed and ck.format == "safetensors"
    assert sorted(t["name"] for t in ck.tensors) == sorted(sd)
    # a wrong dtype, a missing tensor: the package's exceptions
    with pytest.raises(strata.MismatchError):
        st.load({"model.embed": torch.empty(257, 64, dtype=torch.float16)}, out)
    with pytest.raises(strata.NotFoundError):
        st.load({"model.nope": torch.empty(3)}, out)
    # a hostile index: a file outside the directory
    bad = tmp_path / "bad"
    bad.mkdir()
    safetensors_torch.save_file({"a": torch.ones(3)}, str(bad / "x.safetensors"))
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x"}}))
    with pytest.raises(strata.FormatError, match="not a plain file name"):
        st.load({"a": torch.empty(3)}, str(bad))


def dtensor_load(out, names):
    """Rank r of 2: loads the named tensors as DTensors sharded on dim 0 (Shard(0)) and on
    dim 1 (Shard(1)); returns its local shards and the load's bytes read by this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = safetensors_torch.load_file(out + "/" + "model-00001-of-00003.safetensors")
    target = {}
    for n in names:
        shape, dt = full[n].shape, full[n].dtype
        pl = Shard(0) if n.endswith("embed") else Shard(1)
        target[n] = distribute_tensor(torch.zeros(shape, dtype=dt), mesh, [pl])
    stats = st.load(target, out)
    dist.barrier()
    return {n: v.to_local().clone() for n, v in target.items()}, stats["bytes"]


def test_dtensors_on_two_processes(published, tmp_path):
    sd, out = published
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    names = [n for n, f in idx["weight_map"].items()
             if f.startswith("model-00001") and sd[n].dim() == 2 and sd[n].shape[1] >= 2]
    assert "model.embed" in names or len(names) >= 2
    res = _dist.run(dtensor_load, 2, out, names, timeout=180)
    total = 0
    for r in range(2):
        local, read = res[r]
        total += read
        for n in names:
            full = sd[n]
            dim = 0 if n.endswith("embed") else 1
            chunks = torch.chunk(full, 2, dim=dim)
            want = chunks[r] if r < len(chunks) else full.narrow(dim, 0, 0)
            assert same(local[n], want.contiguous()), (r, n)
    # read once over the two ranks: the bytes of the tensors asked for, no more
    assert total == sum(nbytes(sd[n]) for n in names)
