"""torch.save files as a load source (src/source/torchsave.c, src/source/torchsave_src.c) and
their values in strata.torch (python/strata/_strata_pickle.c, _torchsave.py).

Every fixture is written here by torch.save (torch 2.13): every dtype strata has, views at
storage offsets, storages shared by several tensors, nested values, a Hugging Face sharded
pytorch_model.bin set (torch.save + json, laid out as transformers' save_pretrained(...,
safe_serialization=False) does). Each is loaded by strata (plain tensors; DTensors on 2 gloo
processes) and compared bitwise with what torch.load reads; values compared equal. Hostile
archives (compressed entries, lying sizes, a planted __reduce__, duplicate keys, non-contiguous
or complex tensors, the legacy format) are refused with their exact error class, and the
planted __reduce__ never runs.
"""

import collections
import io
import json
import os
import subprocess
import zipfile

import pytest
import torch

import _dist
import strata
import strata.torch as st
from _tensors import DTYPES, same, sample
from strata import _torchsave

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")


def values():
    return {"lr": 0.1, "name": "run-7", "betas": (0.9, 0.999), "big": 2 ** 100,
            "neg": -(2 ** 70) - 3, "raw": b"\x00\xff", "none": None, "flag": True,
            "od": collections.OrderedDict([("b", 1), ("a", [1, 2])]),
            "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "nested": [1, [2, {"x": 3}]]}


def state():
    """A torch.save'd training state: every dtype, views, shared storages, values."""
    model = {"w_%s" % str(dt).split(".")[1]: sample(dt, (23, 5), i)
             for i, dt in enumerate(DTYPES)}
    base = sample(torch.float32, (31, 7), 99)
    model["views"] = {"base": base, "rows": base[3:9], "row": base[5], "tail": base[20:],
                      "scalar": base[2, 3], "empty": base[4:4]}
    emb = sample(torch.float16, (11, 3), 7)
    model["tied"] = [emb, emb]          # one storage, two names (tied weights)
    model["param"] = torch.nn.Parameter(sample(torch.bfloat16, (4, 6), 5))
    return {"model": model, "step": 7, "cfg": values()}


def zeros_like_state(ref):
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v.detach())
        if isinstance(v, dict):
            return {k: z(c) for k, c in v.items()}
        if isinstance(v, list):
            return [z(c) for c in v]
        return None
    return {"model": z(ref["model"]), "step": 0, "cfg": {}}


def check_tensors(got, ref, key=""):
    if isinstance(ref, torch.Tensor):
        assert same(got, ref.detach()), key
    elif isinstance(ref, dict):
        for k in ref:
            check_tensors(got[k], ref[k], key + "." + k)
    else:
        for i, (g, r) in enumerate(zip(got, ref)):
            check_tensors(g, r, "%s.%d" % (key, i))


def check_values(cfg):
    want = values()
    want["size"] = (2, 3)   # torch.Size is read as a tuple
    assert cfg == want
    assert type(cfg["od"]) is collections.OrderedDict and list(cfg["od"]) == ["b", "a"]
    assert cfg["dtype"] is torch.bfloat16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ts")
    path = str(d / "train.pt")
    torch.save(state(), path)
    return path


def test_every_dtype_views_shared_storages_and_values(saved):
    ref = torch.load(saved, weights_only=True)
    ck = strata.Checkpoint(saved)
    assert ck.format == "torch.save" and ck.chunk_bytes == 0
    names = {t["name"] for t in ck.tensors}
    assert "model.views.rows" in names and "model.tied.1" in names and "model.param" in names
    sd = zeros_like_state(ref)
    st.load(sd, saved)
    check_tensors(sd["model"], ref["model"])
    assert sd["step"] == 7
    check_values(sd["cfg"])


def test_meta_tensors_and_empty_dicts_are_filled(saved):
    ref = torch.load(saved, weights_only=True)
    sd = {"model": {}, "step": None, "cfg": None}
    st.load(sd, saved)
    assert same(sd["model"]["views.rows"], ref["model"]["views"]["rows"])
    assert same(sd["model"]["w_bfloat16"], ref["model"]["w_bfloat16"])
    check_values(sd["cfg"])


def test_a_value_where_a_tensor_is_wanted_is_a_mismatch(saved):
    with pytest.raises(strata.MismatchError, match="step: the checkpoint holds a value"):
        st.load({"step": torch.zeros(1)}, saved)


def test_archive_values_from_bytes():
    """A DCP non-tensor item: a torch.save'd object in memory, decoded without pickle."""
    buf = io.BytesIO()
    obj = {"epoch": 3, "t": torch.arange(6, dtype=torch.int16)[2:], "cfg": values()}
    torch.save(obj, buf)
    got = _torchsave.archive_values(buf.getvalue())
    assert same(got["t"], obj["t"]) and got["epoch"] == 3
    check_values(got["cfg"])
    plain = strata.unpickle_archive(buf.getvalue(), tensor=lambda *a: a[:3],
                                    glob=lambda m, n: m + "." + n)
    assert plain["t"] == ("t", "i16", (4,)) and plain["cfg"]["dtype"] == "torch.bfloat16"
    with pytest.raises(strata.InvalidArgumentError, match="tensor 't': no tensor callback"):
        strata.unpickle_archive(buf.getvalue())


def test_dcp_values_bytesio_included(tmp_path):
    """DCP's non-tensor values are torch.save archives of the objects (an io.BytesIO too,
    which needs the global _io.BytesIO): strata.torch decodes them without pickle."""
    import torch.distributed.checkpoint as dcp
    buf = io.BytesIO(b"loader state")
    buf.seek(3)
    path = str(tmp_path / "dcp")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0), "buf": buf, "cfg": {"lr": 0.5, "big": 2 ** 80},
                  "step": 7}, checkpoint_id=path)
    sd = {"w": torch.zeros(4), "buf": None, "cfg": {"lr": None, "big": None}, "step": None}
    st.load(sd, path)
    assert torch.equal(sd["w"], torch.arange(4.0))
    assert isinstance(sd["buf"], io.BytesIO) and sd["buf"].getvalue() == b"loader state"
    assert sd["buf"].tell() == 3
    assert sd["cfg"] == {"lr": 0.5, "big": 2 ** 80} and sd["step"] == 7


# ---- DTensor layouts on 2 gloo processes ----------------------------------------------------

def load_dtensors(path):
    """Rank r's boxes of every 2-dim tensor (Shard(0) or Shard(1)) loaded from the file and
    compared bitwise with the same boxes of what torch.load reads (local tensors: gloo
    gathers no fp8)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    ref = torch.load(path, weights_only=True)
    mesh = init_device_mesh("cpu", (2,))
    sd, want = {}, {}

    def dt(full, dim):
        return distribute_tensor(full, mesh, [Shard(dim)], src_data_rank=None)

    for i, (k, v) in enumerate(sorted(ref["model"].items())):
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            sd[k], want[k] = dt(torch.zeros_like(v.detach()), i % 2), dt(v.detach(), i % 2)
    views = ref["model"]["views"]
    sd["views"] = {"rows": dt(torch.zeros(6, 7), 1), "tail": dt(torch.zeros(11, 7), 0)}
    want["rows"], want["tail"] = dt(views["rows"], 1), dt(views["tail"], 0)
    full = {"model": sd, "step": 0, "cfg": {}}
    st.load(full, path)
    got = dict(sd, **sd["views"])
    bad = [k for k in want if not same(got[k].to_local(), want[k].to_local())]
    v = values()
    v["size"] = (2, 3)
    return bad, sorted(want), full["step"], full["cfg"] == v, dist.get_rank()


def test_dtensor_layouts_on_two_processes(saved):
    res = _dist.run(load_dtensors, 2, saved, timeout=180)
    assert [r[0] for r in res] == [[], []]
    assert len(res[0][1]) == 15     # the 12 dtypes' tensors, param; views.rows, views.tail
    assert all(r[2] == 7 and r[3] for r in res)


# ---- a Hugging Face sharded pytorch_model.bin set ------------------------------------------

def hf_set(d):
    """pytorch_model-0000i-of-00002.bin + pytorch_model.bin.index.json, as transformers lays
    them out (torch.save of flat state dicts of contiguous tensors; the index json)."""
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
             "model.norm.weight", "lm_head.weight"]
    dts = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32,
           torch.bfloat16]
    shapes = [(37, 16), (24, 16), (16,), (24, 16), (16,), (37, 16)]
    sd = {n: sample(dt, s, i) for i, (n, dt, s) in enumerate(zip(names, dts, shapes))}
    files = ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    parts = [dict(list(sd.items())[:3]), dict(list(sd.items())[3:])]
    wm = {}
    for f, p in zip(files, parts):
        torch.save(p, os.path.join(d, f))
        wm.update({n: f for n in p})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(d, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)
    return sd


def test_hf_sharded_set_loads_and_exports(tmp_path):
    from safetensors import safe_open
    d = tmp_path / "hf"
    d.mkdir()
    sd = hf_set(str(d))
    ck = strata.Checkpoint(str(d))
    assert ck.format == "torch.save" and len(ck.files) == 2
    got = {n: torch.zeros_like(t) for n, t in sd.items()}
    st.load(got, str(d))
    assert all(same(got[n], sd[n]) for n in sd)
    out = tmp_path / "st"
    p = subprocess.run([CLI, "export", str(d), str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    seen = set()
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            with safe_open(str(out / f), "pt") as s:
                for k in s.keys():
                    assert same(s.get_tensor(k), sd[k]), k
                    seen.add(k)
    assert seen == set(sd)


def load_hf_dtensors(d):
    """The HF set's 2-dim tensors into Shard(0) / Shard(1) DTensors on 2 ranks, each rank's
    boxes compared bitwise with the same boxes of the torch.load'ed shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    ref = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".bin"):
            ref.update(torch.load(os.path.join(d, f), weights_only=True))
    mesh = init_device_mesh("cpu", (2,))
    sd, want = {}, {}
    for i, (k, v) in enumerate(sorted(ref.items())):
        if v.dim() == 2:
            sd[k] = distribute_tensor(torch.zeros_like(v), mesh, [Shard(i % 2)],
                                      src_data_rank=None)
            want[k] = distribute_tensor(v, mesh, [Shard(i % 2)], src_data_rank=None)
        else:
            sd[k] = torch.zeros_like(v)
            want[k] = v
    st.load(sd, d)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return [k for k in want if not same(local(sd[k]), local(want[k]))], len(want)


def test_hf_sharded_set_into_dtensors_on_two_processes(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    hf_set(str(d))
    res = _dist.run(load_hf_dtensors, 2, str(d), timeout=180)
    assert res == [([], 6), ([], 6)]


def test_hf_index_naming_a_tensor_elsewhere_is_refused(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    hf_set(str(d))
    idx = d / "pytorch_model.bin.index.json"
    j = json.loads(idx.read_text())
    j["weight_map"]["lm_head.weight"] = "pytorch_model-00001-of-00002.bin"
    idx.write_text(json.dumps(j))
    with pytest.raises(strata.FormatError, match="maps tensor 'lm_head.weight' to "
                       "'pytorch_model-00001-of-00002.bin', but it is in"):
        strata.Checkpoint(str(d))


# ---- the command line ------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([CLI] + list(args), capture_output=True, text=True)


def test_cli_inspect_and_verify(saved, tmp_path):
    p = cli("inspect", saved)
    assert p.returncode == 0 and "torch.save %s:" % saved in p.stdout
    assert "NO STRATA CHECKSUMS" in p.stdout and "model.views.rows" in p.stdout
    p = cli("verify", saved)
    assert p.returncode == 0 and "every zip entry's CRC-32 matched" in p.stdout
    # one byte of a storage flipped: the CRC-32 of its entry tells
    bad = str(tmp_path / "bad.pt")
    data = bytearray(open(saved, "rb").read())
    with zipfile.ZipFile(saved) as z:
        info = z.getinfo(next(n for n in z.namelist() if n.endswith("/data/0")))
    h = info.header_offset    # the local header's name and extra lengths, then the data
    at = h + 30 + int.from_bytes(data[h + 26:h + 28], "little") + int.from_bytes(
        data[h + 28:h + 30], "little")
    data[at + 1] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    p = cli("verify", bad)
    assert p.returncode == 3 and "CORRUPT: zip entry 'train/data/0' in file 'bad.pt'" in p.stderr
    assert "STRATA_ECHECKSUM" in p.stderr
    with pytest.raises(strata.ChecksumError):
        strata.Checkpoint(bad).verify()


# ---- hostile archives ------------------------------------------------------------------------

def rezip(src, dst, change=None, compress=None):
    """dst: src's entries written again by zipfile (stored unless compress(name)); change(name,
    data) may replace an entry's bytes."""
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w") as zo:
        for n in zi.namelist():
            data = zi.read(n)
            if change:
                data = change(n, data)
            method = zipfile.ZIP_DEFLATED if compress and compress(n) else zipfile.ZIP_STORED
            zo.writestr(zipfile.ZipInfo(n), data, compress_type=method)


def small(path):
    torch.save({"a": torch.arange(10.0), "dupA": 1, "dupB": 2}, path)


def test_rezipped_archive_still_loads(tmp_path):
    """The control of the hostile cases below: rewritten by zipfile, unchanged, it loads."""
    small(str(tmp_path / "s.pt"))
    rezip(str(tmp_path / "s.pt"), str(tmp_path / "r.pt"))
    sd = {"a": torch.zeros(10), "dupA": 0}
    st.load(sd, str(tmp_path / "r.pt"))
    assert torch.equal(sd["a"], torch.arange(10.0)) and sd["dupA"] == 1


def test_compressed_entry_is_refused_naming_it(tmp_path):
    small(str(tmp_path / "s.pt"))
    rezip(str(tmp_path / "s.pt"), str(tmp_path / "c.pt"), compress=lambda n: "/data/" in n)
    with pytest.raises(strata.UnsupportedError, match="entry 's/data/0' is compressed"):
        strata.Checkpoint(str(tmp_path / "c.pt"))


def test_entry_lying_about_its_storage_size_is_refused(tmp_path):
    small(str(tmp_path / "s.pt"))
    rezip(str(tmp_path / "s.pt"), str(tmp_path / "l.pt"),
          change=lambda n, d: d + b"\0" * 4 if n.endswith("/data/0") else d)
    with pytest.raises(strata.FormatError, match="entry 's/data/0' holds 44 bytes, its "
                       "storage 40"):
        strata.Checkpoint(str(tmp_path / "l.pt"))


def test_shape_of_2_80_elements_is_refused_saying_so(tmp_path):
    """A shape whose element count overflows 64 bits ([2^40, 2^40], written over a real
    [300, 400] one): refused naming the shape, never as a wrapped count ("its 0 elements")."""
    torch.save({"w": torch.zeros(300, 400)}, str(tmp_path / "s.pt"))
    size = b"M\x2c\x01M\x90\x01\x86"                    # BININT2 300, BININT2 400, TUPLE2
    huge = b"\x8a\x06\x00\x00\x00\x00\x00\x01" * 2 + b"\x86"  # LONG1 2^40, twice, TUPLE2

    def change(n, d):
        if n.endswith("data.pkl"):
            assert d.count(size) == 1
            return d.replace(size, huge)
        return d
    rezip(str(tmp_path / "s.pt"), str(tmp_path / "h.pt"), change=change)
    with pytest.raises(strata.FormatError) as ei:
        strata.Checkpoint(str(tmp_path / "h.pt"))
    msg = str(ei.value)
    assert "tensor 'w': its shape (1099511627776, 1099511627776) holds 2^64 elements or more" \
        in msg and "its 0 elements" not in msg, msg


def test_truncated_archive_is_refused(tmp_path):
    small(str(tmp_path / "s.pt"))
    data = open(str(tmp_path / "s.pt"), "rb").read()
    (tmp_path / "t.pt").write_bytes(data[:len(data) - 30])
    with pytest.raises(strata.FormatError, match="t.pt: not a zip archive: no end of central "
                       "directory record"):
        strata.Checkpoint(str(tmp_path / "t.pt"))


def test_duplicate_dict_keys_are_refused(tmp_path):
    small(str(tmp_path / "s.pt"))
    rezip(str(tmp_path / "s.pt"), str(tmp_path / "d.pt"),
          change=lambda n, d: d.replace(b"dupB", b"dupA") if n.endswith("data.pkl") else d)
    with pytest.raises(strata.FormatError, match="holds the key 'dupA' twice"):
        strata.Checkpoint(str(tmp_path / "d.pt"))
    with pytest.raises(strata.FormatError, match="holds the key 'dupA' twice"):
        _torchsave.archive_values(open(str(tmp_path / "d.pt"), "rb").read())


def test_non_contiguous_and_complex_tensors_are_refused_naming_them(tmp_path):
    torch.save({"ok": torch.ones(2), "w": {"t": torch.ones(3, 4).t()}}, str(tmp_path / "n.pt"))
    with pytest.raises(strata.UnsupportedError, match="tensor 'w.t' is not contiguous"):
        strata.Checkpoint(str(tmp_path / "n.pt"))
    torch.save({"c": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "c.pt"))
    with pytest.raises(strata.UnsupportedError, match="tensor 'c' is complex"):
        strata.Checkpoint(str(tmp_path / "c.pt"))


def test_legacy_format_is_refused(tmp_path):
    p = str(tmp_path / "old.pt")
    torch.save({"w": torch.ones(2)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(strata.UnsupportedError, match="legacy format"):
        strata.Checkpoint(p)
    r = cli("inspect", p)
    assert r.returncode != 0 and "(STRATA_ENOTSUP)" in r.stderr


class Planted:
    """Unpickled by a pickle-running loader, creates the file self.path."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_reduce_is_never_run(tmp_path):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": Planted(marker)}, path)
    r = cli("inspect", path)
    assert r.returncode == 3 and "io.open" in r.stderr and "STRATA_EFORMAT" in r.stderr
    with pytest.raises(strata.FormatError, match="io.open"):
        strata.Checkpoint(path)
    with pytest.raises(strata.FormatError, match="io.open"):
        st.load({"w": torch.zeros(2)}, path)
    with pytest.raises(strata.FormatError, match="io.open"):
        _torchsave.archive_values(open(path, "rb").read())
    assert not os.path.exists(marker)
    # the plant is real: a loader that runs pickle creates the file
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)
