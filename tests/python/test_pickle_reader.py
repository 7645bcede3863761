"""The restricted pickle reader and the zip reader (src/source/pickle.c, src/source/zip.c) over
real files written here by torch.save and torch.distributed.checkpoint.

build/tests/pickle_dump (the internal API; built by `make`) prints a canonical JSON
description of a file's pickle. It is compared with the same description built by CPython's
own unpickler (a pickle.Unpickler whose find_class returns markers and whose persistent_load
records the id: nothing of the file is run), and each tensor with what torch says of the
tensor itself: dtype, shape, stride, storage offset, and the CRC-32 of its storage's bytes as
read by the zip reader. A pickle planting a __reduce__ that would create a file is refused
with STRATA_EFORMAT naming the global, and the file is never created.
"""

import codecs
import collections
import ctypes
import json
import os
import pickle
import subprocess
import warnings
import zlib

import pytest
import torch

import _dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DUMP = os.path.join(ROOT, os.environ.get("BUILD", "build"), "tests", "pickle_dump")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not os.path.exists(DUMP):
        subprocess.run(["make", "-s", "-C", ROOT, os.path.relpath(DUMP, ROOT)], check=True)


class Err(str):
    """pickle_dump's refusal: "ERROR <code>: <message>"."""


def dump(path, raw=False):
    p = subprocess.run([DUMP] + (["--raw"] if raw else []) + [path], capture_output=True,
                       text=True)
    if p.returncode != 0:
        return Err(p.stdout.strip() + p.stderr)
    return json.loads(p.stdout)


# ---- the expected description, from CPython's unpickler (nothing is called) ----

class _Obj:
    """An instance of a marker class: a call of the global it stands for."""

    def __new__(cls, *args):
        o = object.__new__(cls)
        o.args, o.newobj, o.state = args, True, None
        return o

    def __init__(self, *args):
        self.newobj = False  # called by REDUCE (cls(*args)), not NEWOBJ (cls.__new__)

    def __setstate__(self, state):
        self.state = state


class _Pid:
    def __init__(self, pid):
        self.pid = pid


def _marker(mod, name):
    return type(name, (_Obj,), {"qual": "%s.%s" % (mod, name)})


class _Reader(pickle.Unpickler):
    def find_class(self, mod, name):
        if (mod, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (mod, name) == ("_codecs", "encode"):
            return codecs.encode
        return _marker(mod, name)

    def persistent_load(self, pid):
        return _Pid(pid)


def canon(x):
    if x is None or isinstance(x, (bool, str, float)):
        return x
    if isinstance(x, int):
        if -2**63 <= x < 2**63:
            return x
        return {"bigint_le": pickle.encode_long(x).hex()}
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, tuple):
        return {"tuple": [canon(v) for v in x]}
    if isinstance(x, list):
        return [canon(v) for v in x]
    if isinstance(x, dict):
        st = getattr(x, "__dict__", None)
        return {"dict": [[canon(k), canon(v)] for k, v in x.items()],
                "ordered": isinstance(x, collections.OrderedDict),
                "state": canon(st) if st else None}
    if isinstance(x, _Pid):
        return {"pid": canon(x.pid)}
    if isinstance(x, type) and issubclass(x, _Obj):
        return {"global": x.qual}
    if isinstance(x, _Obj):
        return {"call": x.qual, "newobj": x.newobj, "args": canon(tuple(x.args)),
                "state": canon(x.state) if x.state is not None else None}
    raise TypeError(type(x))


def strip_crc(x):
    """The C description without what only the zip reader adds."""
    if isinstance(x, dict):
        return {k: strip_crc(v) for k, v in x.items() if k not in ("storage_crc", "storage_bytes")}
    if isinstance(x, list):
        return [strip_crc(v) for v in x]
    return x


def expected_from_zip(path):
    import zipfile
    with zipfile.ZipFile(path) as z:
        name = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
        return canon(_Reader(z.open(name)).load())


def check_tensor(desc, t):
    """desc: the C description of a _rebuild_tensor_v2 call; t: the tensor torch loaded."""
    args = desc["args"]["tuple"]
    pid = args[0]["pid"]["tuple"]
    assert pid[0] == "storage"
    if desc["call"] == "torch._utils._rebuild_tensor_v3":   # dtypes without a typed storage
        assert pid[1] == {"global": "torch.storage.UntypedStorage"}
        assert args[6] == {"global": "torch.%s" % str(t.dtype)[6:]}
    else:
        assert desc["call"] == "torch._utils._rebuild_tensor_v2"
        with warnings.catch_warnings():   # the legacy typed storage classes warn
            warnings.simplefilter("ignore", UserWarning)
            assert getattr(torch, pid[1]["global"].split(".")[1]).dtype == t.dtype
    assert args[1] == t.storage_offset()
    assert args[2]["tuple"] == list(t.shape)
    assert args[3]["tuple"] == list(t.stride())
    st = t.untyped_storage()
    assert desc["storage_bytes"] == st.nbytes()
    assert desc["storage_crc"] == zlib.crc32(ctypes.string_at(st.data_ptr(), st.nbytes()))


def tensors_of(desc):
    out = {}
    for k, v in desc["dict"]:
        out[k] = v
    return out


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool, torch.complex64]


def test_state_dict_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i, dt in enumerate(DTYPES):
        base = (torch.randn(23, 7, generator=g) * 50)
        sd["t%d_%s" % (i, str(dt)[6:])] = base.to(dt)
    big = torch.arange(5 * 11, dtype=torch.float32).reshape(5, 11)
    sd["view_T"] = big.t()                # strided view
    sd["view_slice"] = big[2:, 3:9]        # storage offset, shares big's storage
    sd["whole"] = big
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.empty(0, 3)
    path = str(tmp_path / "sd.pt")
    torch.save(sd, path)
    got = dump(path)
    assert not isinstance(got, Err), got
    assert strip_crc(got) == expected_from_zip(path)
    loaded = torch.load(path, weights_only=True)
    ts = tensors_of(got)
    assert set(ts) == set(loaded)
    for k, t in loaded.items():
        check_tensor(ts[k], t)
    # shared storage: the views and the base name the same storage key
    key = lambda k: ts[k]["args"]["tuple"][0]["pid"]["tuple"][2]
    assert key("view_T") == key("view_slice") == key("whole")


def test_module_state_dict_and_hf_bin(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5),
                            torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3, bias=False))
    sd = m.state_dict()
    assert hasattr(sd, "_metadata")
    path = str(tmp_path / "pytorch_model.bin")
    torch.save(sd, path)   # what HF's save_pretrained(safe_serialization=False) writes
    got = dump(path)
    assert not isinstance(got, Err), got
    assert got["ordered"] is True and got["state"] is not None   # _metadata kept as state
    assert strip_crc(got) == expected_from_zip(path)
    ts = tensors_of(got)
    for k, t in sd.items():
        check_tensor(ts[k], t)


def test_plain_values(tmp_path):
    obj = {"step": 7, "lr": 1e-3, "neg": -5, "big": 2**100 + 3, "nbig": -(2**70),
           "i64max": 2**63 - 1, "i64min": -2**63, "s": "h\u00e9llo \u2603", "b": b"\x00\xff\x7f",
           "t": (1, 2, 3, 4, 5), "t1": (None,), "l": [True, False, None, 1.5],
           "nested": {"a": [{"b": (1,)}]}, "od": collections.OrderedDict([("x", 1), ("y", 2)]),
           "shared": None}
    lst = [1, 2]
    obj["shared"] = [lst, lst]
    path = str(tmp_path / "vals.pt")
    torch.save(obj, path)
    got = dump(path)
    assert not isinstance(got, Err), got
    assert strip_crc(got) == expected_from_zip(path)
    # protocol 2 bytes arrive as _codecs.encode(str, 'latin1'), folded to bytes
    assert dict(tensors_of(got))["b"] == {"bytes": "00ff7f"}
    for proto in (2, 3, 4, 5):
        raw = str(tmp_path / ("vals%d.pkl" % proto))
        with open(raw, "wb") as f:
            pickle.dump(obj, f, protocol=proto)
        with open(raw, "rb") as f:
            exp = canon(_Reader(f).load())
        assert dump(raw, raw=True) == exp, proto


def _dcp_save(path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "step": 5, "extra": {"note": "hi", "vals": [1, 2.5]},
          "dt": distribute_tensor(torch.arange(46, dtype=torch.float32).reshape(23, 2), mesh,
                                  [Shard(0)])}
    dcp.save(sd, checkpoint_id=path)
    return True


@pytest.mark.slow
def test_dcp_metadata(tmp_path):
    path = str(tmp_path / "dcp")
    _dist.run(_dcp_save, 2, path)
    meta = os.path.join(path, ".metadata")
    got = dump(meta, raw=True)
    assert not isinstance(got, Err), got
    with open(meta, "rb") as f:
        assert got == canon(_Reader(f).load())
    assert got["call"] == "torch.distributed.checkpoint.metadata.Metadata"
    # the real Metadata agrees: every fqn of its state_dict_metadata is in the description
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    text = json.dumps(got)
    for fqn in md.state_dict_metadata:
        assert json.dumps(fqn) in text
    # the non-tensor values DCP saved are torch.save'd objects in the data files: each one's
    # bytes, cut out by its _StorageInfo, parses
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    seen = 0
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            seen += 1
            with open(os.path.join(path, info.relative_path), "rb") as f:
                f.seek(info.offset)
                blob = f.read(info.length)
            one = str(tmp_path / ("obj_%s.pt" % idx.fqn))
            with open(one, "wb") as f:
                f.write(blob)
            d = dump(one)
            assert not isinstance(d, Err), d
            assert strip_crc(d) == expected_from_zip(one)
    assert seen >= 4  # step, extra.note, extra.vals.*, the optimizer's param_groups values


class _Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, ("touch " + self.target,))


class _EvilOpen:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("cls,glob", [(_Evil, "posix.system"), (_EvilOpen, "io.open")])
def test_planted_reduce_never_runs(tmp_path, cls, glob):
    target = str(tmp_path / "pwned")
    path = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": cls(target)}, path)
    raw = str(tmp_path / "evil.pkl")
    with open(raw, "wb") as f:
        pickle.dump(cls(target), f, protocol=4)
    for p, r in ((path, False), (raw, True)):
        out = dump(p, raw=r)
        assert isinstance(out, Err) and out.startswith("ERROR STRATA_EFORMAT:"), out
        assert "global '%s' is not allowed" % glob in out, out
        assert p in out
        assert not os.path.exists(target)
