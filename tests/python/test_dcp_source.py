"""PyTorch DCP (torch.distributed.checkpoint) as a source: checkpoints written in this run by
torch 2.13's dcp.save on 1, 2 and 4 gloo processes - plain tensors, FSDP2 (fully_shard:
uneven and empty shards), TP (Shard(0) and Shard(1) DTensors), FSDP2 x TP on a 2 x 2 mesh,
each with AdamW state from get_state_dict and non-tensor values - are loaded by
strata.torch.load into other layouts on other world sizes (1 and 3 processes: plain, DDP,
FSDP2, TP, and the strided layout DCP refuses to save) and compared bitwise with the
reference values; `strata export` of the 4-process FSDP2 x TP checkpoint is read back by
safetensors' safe_open bitwise; inspect / verify / ls name the format. Hostile inputs
(truncated .metadata and .distcp, chunks that overlap or do not cover, a chunk without
storage, offsets past the end, '../' and absolute relative_path, a planted __reduce__ that
must never run, compressed zip entries, zip sizes that lie, transform_descriptors, complex
dtypes, a missing .distcp) each get their exact error, from Python and from the CLI.

Cost on 2 cores: 3 save runs (1, 2, 4 processes) and 2 load runs (1 and 3 processes), all
forked from _dist's fork server."""

import copy
import glob
import io
import os
import pickle
import shutil
import struct
import subprocess
import warnings
import zipfile

import pytest
import torch

import _dist
import strata
import strata.torch as st
from _tensors import same
from test_torch_layouts import (LAYOUTS, _without_numpy, build, check, fill, ref_tensor,
                                tensors)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")

WRITTEN = {1: ("plain",), 2: ("fsdp", "tp"), 4: ("fsdp", "tp", "fsdp_tp")}


# ---- the runs ---------------------------------------------------------------------------------

def dcp_write(base, world):
    """dcp.save of every layout of WRITTEN[world], reference-filled, to base/<layout>-<world>."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    _without_numpy()
    for layout in WRITTEN[world]:
        sd, keep = build(layout, world)
        fill(sd)
        bad = check(sd, "self-check before dcp.save of %s on %d" % (layout, world))
        assert not bad, "\n".join(bad)
        dcp.save(sd, checkpoint_id=os.path.join(base, "%s-%d" % (layout, world)))
        dist.barrier()
    return True


def tensor_view(d):
    """The same nested dicts holding only the tensors (the same objects): what is loaded."""
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            v = tensor_view(v)
            if v is not None and not (isinstance(v, dict) and not v):
                out[k] = v
        return out
    return d if isinstance(d, torch.Tensor) else None


def dcp_load(sources, world):
    """strata.torch.load of every DCP checkpoint into every layout that exists on `world`
    ranks; (mismatches and errors, cases)."""
    import torch.distributed as dist
    bad, cases = [], 0
    for layout, worlds in LAYOUTS.items():
        if world not in worlds:
            continue
        sd, keep = build(layout, world)
        view = tensor_view(sd)
        for src, path in sources:
            where = "DCP %s -> %s on %d" % (src, layout, world)
            fill(view, salt="garbage")
            cases += 1
            try:
                st.load(view, path)
            except strata.Error as e:
                bad.append("%s: load raised %s: %s" % (where, type(e).__name__, e))
                dist.barrier()
                continue
            bad.extend(check(view, where))
            if len(tensors(view)) < 10:
                bad.append("%s: only %d tensors loaded" % (where, len(tensors(view))))
    return bad, cases


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("dcp"))
    for world in WRITTEN:
        _dist.run(dcp_write, world, base, world, timeout=180)
    return [("%s-%d" % (layout, w), os.path.join(base, "%s-%d" % (layout, w)))
            for w, layouts in WRITTEN.items() for layout in layouts]


def test_inspect_each(written):
    """Every fixture opens as format "dcp": the chunks of a DTensor are its shards (FSDP2 on 4
    processes: uneven, the empty ones left out), the non-tensor values blobs."""
    for name, path in written:
        ck = strata.Checkpoint(path)
        assert ck.format == "dcp", name
        assert ck.chunk_bytes == 0 and ck.committed, name
        t = {x["name"]: x for x in ck.tensors}
        assert "model.emb.weight" in t and "optim.state.fc1.weight.exp_avg" in t, (name, list(t))
        blobs = {b["name"] for b in ck.blobs}
        assert "meta.epoch" in blobs and "meta.tag" in blobs, (name, blobs)
        assert all(b["owner"] == -1 for b in ck.blobs)
        world = int(name.rsplit("-", 1)[1])
        assert all(f["name"].endswith(".distcp") for f in ck.files), name
        assert len(ck.files) == world, (name, ck.files)
        emb = t["model.emb.weight"]
        assert list(emb["shape"]) == [37, 11] and emb["dtype"] == "f32"
        boxes = {k: [(tuple(x["offsets"]), tuple(x["lengths"])) for x in v["shards"]]
                 for k, v in t.items()}
        if name == "fsdp-4":   # Shard(0): 37 rows as 10, 10, 10, 7; fc2's 5 as 2, 2, 1, (0)
            assert len(boxes["model.emb.weight"]) == 4
            assert sorted(boxes["model.fc2.weight"]) == [((0, 0), (2, 7)), ((2, 0), (2, 7)),
                                                         ((4, 0), (1, 7))]
        if name == "tp-4":     # RowwiseParallel fc2: Shard(1), 7 columns as 2, 2, 2, 1
            assert sorted(boxes["model.fc2.weight"]) == [((0, 0), (5, 2)), ((0, 2), (5, 2)),
                                                         ((0, 4), (5, 2)), ((0, 6), (5, 1))]
        if name == "fsdp_tp-4":  # 2-D: dp rows x tp columns
            assert sorted(boxes["model.fc2.weight"]) == [((0, 0), (3, 4)), ((0, 4), (3, 3)),
                                                         ((3, 0), (2, 4)), ((3, 4), (2, 3))]
        if name == "plain-1":
            assert len(boxes["model.emb.weight"]) == 1


def test_load_on_three(written):
    """4-, 2- and 1-process DCP checkpoints into plain, DDP, FSDP2, TP and the strided layout
    DCP refuses, on 3 processes: bitwise."""
    res = _dist.run(dcp_load, 3, written, 3, timeout=300)
    bad = [b for r in res for b in r[0]]
    assert res[0][1] == 5 * len(written)
    assert not bad, "\n".join(bad)


def test_load_on_one(written):
    res = _dist.run(dcp_load, 1, written, 1, timeout=300)
    assert res[0][1] == 4 * len(written)
    assert not res[0][0], "\n".join(res[0][0])


LOAD_STATS = {"data_bytes", "bytes", "io_calls", "seconds", "all_bytes", "plan_cached", "tier",
              "meta_reads", "meta_bcasts", "crc_checked", "crc_bytes", "crc_skipped"}


def dcp_load_stats(path):
    """The stats of strata.torch.load of two whole tensors of a DCP checkpoint."""
    sd = {"model": {"emb.weight": torch.zeros(37, 11), "fc2.weight": torch.zeros(5, 7)}}
    return st.load(sd, path)


def test_load_stats(written):
    """A DCP load's stats are a load's (issue 30): on 2 processes each rank's io_calls are
    the reads it made (not 0 where it read bytes), all_bytes their bytes summed; in one
    process the same; no save's fields (max_writer_bytes, writers, balance_bound)."""
    path = dict(written)["fsdp-2"]
    want = (37 * 11 + 5 * 7) * 4
    res = _dist.run(dcp_load_stats, 2, path, timeout=180)
    for r in res:
        assert set(r) == LOAD_STATS, sorted(r)
        assert (r["io_calls"] > 0) == (r["bytes"] > 0), r
        assert r["all_bytes"] == sum(x["bytes"] for x in res) >= want, r
    assert sum(r["io_calls"] for r in res) >= 2, res     # the two ranks' files
    one = dcp_load_stats(path)
    assert set(one) == LOAD_STATS and one["bytes"] >= want and one["io_calls"] >= 2, one


def test_load_plain_tensors_in_process(written):
    """No process group: into plain tensors of the pytest process."""
    for name, path in written:
        ck = strata.Checkpoint(path)
        want = {t["name"]: t for t in ck.tensors}
        sd = {k: torch.empty(t["shape"], dtype=getattr(torch, {"f32": "float32",
              "bf16": "bfloat16", "i64": "int64"}[t["dtype"]])) for k, t in want.items()}
        st.load(sd, path)
        for k, v in sd.items():
            assert same(v, ref_tensor(k, tuple(v.shape), v.dtype)), (name, k)


def test_large_items(tmp_path):
    """Items over the 64 KiB the zip end-record read covers (their local headers and data.pkl
    come from the item's first 4 KiB): each loaded bitwise, a row range of one too."""
    import torch.distributed.checkpoint as dcp
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(300, 1000, generator=g),
          "mid": torch.randn(70 * 1024, generator=g).to(torch.bfloat16),
          "ids": torch.randint(0, 1 << 40, (9000,), generator=g)}
    path = str(tmp_path / "large")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=path)
    got = {k: torch.zeros_like(v) for k, v in sd.items()}
    st.load(got, path)
    for k in sd:
        assert same(got[k], sd[k]), k
    ck = strata.Checkpoint(path)
    assert {t["name"]: t["bytes"] for t in ck.tensors} == {
        "big": 1200000, "mid": 143360, "ids": 72000}


def test_values_are_never_unpickled(written):
    """A non-tensor value of a DCP checkpoint is a torch.save archive: decoded by strata's
    restricted torch.save reader (strata._torchsave.archive_values), never unpickled."""
    path = dict(written)["plain-1"]
    sd = {"meta": {"epoch": None}}
    st.load(sd, path)
    assert sd["meta"]["epoch"] == 3


@needs_cli
def test_export_fsdp_tp_safe_open(written, tmp_path):
    from safetensors import safe_open
    path = dict(written)["fsdp_tp-4"]
    out = str(tmp_path / "out")
    subprocess.run([STRATA, "export", path, out, "--quiet"], check=True)
    ck = strata.Checkpoint(path)
    names = {t["name"] for t in ck.tensors}
    got = set()
    for f in glob.glob(os.path.join(out, "*.safetensors")):
        with safe_open(f, framework="pt") as s:
            for k in s.keys():
                v = s.get_tensor(k)
                assert same(v, ref_tensor(k, tuple(v.shape), v.dtype)), k
                got.add(k)
    assert got == names


@needs_cli
def test_cli_inspect_verify_ls(written):
    path = dict(written)["fsdp-4"]
    r = subprocess.run([STRATA, "inspect", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PyTorch DCP %s: " % path), r.stdout
    assert "NO strata CHECKSUMS" in r.stdout
    r = subprocess.run([STRATA, "verify", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok: %s: " % path) and "every zip CRC-32 matches" in r.stdout
    r = subprocess.run([STRATA, "ls", os.path.dirname(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "fsdp-4" in r.stdout, r.stdout + r.stderr


# ---- hostile inputs -----------------------------------------------------------------------------

def small(path):
    """A one-process DCP checkpoint; its Metadata."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
                  "step": 7}, checkpoint_id=path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def rewrite(path, md):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def key_of(md, fqn):
    return [k for k in md.storage_data if k.fqn == fqn][0]


def refused(path, exc, *words, code=3):
    """Refused the same from strata.Checkpoint, strata.torch.load and the CLI."""
    for call in (lambda: strata.Checkpoint(path),
                 lambda: st.load({"a": torch.zeros(3, 4)}, path)):
        with pytest.raises(exc) as ei:
            call()
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
    if os.access(STRATA, os.X_OK):
        r = subprocess.run([STRATA, "inspect", path], capture_output=True, text=True)
        assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
        for w in words:
            assert w in r.stderr, (w, r.stderr)


def case(tmp_path, name):
    path = str(tmp_path / name)
    return path, small(path)


def test_hostile_metadata(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path, md = case(tmp_path, "trunc")
    raw = open(os.path.join(path, ".metadata"), "rb").read()
    open(os.path.join(path, ".metadata"), "wb").write(raw[:len(raw) // 2])
    refused(path, strata.FormatError, ".metadata: pickle byte")

    path, md = case(tmp_path, "overlap")
    md.state_dict_metadata["a"].chunks.append(
        ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([1, 4])))
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a': two of its chunks overlap")

    path, md = case(tmp_path, "cover")
    md.state_dict_metadata["a"].size = torch.Size([4, 4])
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a': its chunks hold 12 of its 16 elements")

    path, md = case(tmp_path, "nostorage")
    del md.storage_data[key_of(md, "a")]
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a': its chunk at offsets (0, 0) has no "
            "storage_data entry")

    path, md = case(tmp_path, "past")
    md.storage_data[key_of(md, "a")].offset = 1 << 40
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a' at 1099511627776", "runs past the end of the file")

    for name, rel, words in (("dotdot", "../__0_0.distcp", "leaves the checkpoint directory"),
                             ("abs", os.path.abspath(path) + "/__0_0.distcp", "is absolute"),
                             ("sub", "x/__0_0.distcp", "is not a plain file name")):
        path, md = case(tmp_path, name)
        md.storage_data[key_of(md, "a")].relative_path = rel
        rewrite(path, md)
        refused(path, strata.FormatError, "item 'a': relative_path '%s' %s" % (rel, words))

    # a NUL byte: the name must not be cut there (it would name __0_0.distcp)
    path, md = case(tmp_path, "nul")
    md.storage_data[key_of(md, "a")].relative_path = "__0_0.distcp\x00.evil"
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a': its relative_path holds a NUL byte")

    path, md = case(tmp_path, "transform")
    md.storage_data[key_of(md, "a")].transform_descriptors = ["zstd"]
    rewrite(path, md)
    refused(path, strata.UnsupportedError, "item 'a': compressed/transformed items are not read",
            code=1)

    path, md = case(tmp_path, "complex")
    md.state_dict_metadata["a"].properties.dtype = torch.complex64
    rewrite(path, md)
    refused(path, strata.UnsupportedError, "dtype torch.complex64 is not one strata reads",
            code=1)

    path, md = case(tmp_path, "missing")
    os.unlink(os.path.join(path, "__0_0.distcp"))
    refused(path, strata.MissingError, "__0_0.distcp' is missing", code=1)


class Planted:
    """Pickles as a call of os.system: never to be run by strata."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def test_planted_reduce_never_runs(tmp_path):
    path, md = case(tmp_path, "planted")
    marker = str(tmp_path / "PWNED")
    md.planner_data = {"a": Planted(marker)}
    rewrite(path, md)
    refused(path, strata.FormatError, ".metadata: pickle byte", "posix.system")
    assert not os.path.exists(marker)


def archive_of(path, md, fqn):
    info = md.storage_data[key_of(md, fqn)]
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return info, f.read(info.length)


def test_hostile_distcp(tmp_path):
    # a .distcp that is a symlink to a file outside the checkpoint (the same bytes): refused,
    # never followed, as strata's own format refuses links
    path, md = case(tmp_path, "symlink")
    f = os.path.join(path, "__0_0.distcp")
    outside = str(tmp_path / "outside.distcp")
    os.rename(f, outside)
    os.symlink(outside, f)
    refused(path, strata.FormatError, "__0_0.distcp' is a symlink: not followed")

    path, md = case(tmp_path, "truncated")
    f = os.path.join(path, "__0_0.distcp")
    os.truncate(f, os.path.getsize(f) - 100)
    refused(path, strata.FormatError, "runs past the end of the file")

    # an item's archive rewritten with deflated entries, appended, the metadata pointing at it
    path, md = case(tmp_path, "deflated")
    info, arch = archive_of(path, md, "a")
    src = zipfile.ZipFile(io.BytesIO(arch))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for e in src.infolist():
            z.writestr(e.filename, src.read(e.filename))
    f = os.path.join(path, "__0_0.distcp")
    info.offset, info.length = os.path.getsize(f), len(buf.getvalue())
    with open(f, "ab") as out:
        out.write(buf.getvalue())
    rewrite(path, md)
    refused(path, strata.FormatError, "item 'a'", "compressed")

    # the central directory says data/0 is bigger than its local header does
    path, md = case(tmp_path, "lying")
    info, arch = archive_of(path, md, "a")
    name = b"archive/data/0"
    at = [i for i in range(len(arch)) if arch.startswith(b"PK\x01\x02", i)
          and arch[i + 46:i + 46 + len(name)] == name][0]
    lie = bytearray(arch)
    size = struct.unpack_from("<I", lie, at + 20)[0]
    struct.pack_into("<II", lie, at + 20, size + 64, size + 64)
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(lie))
    refused(path, strata.FormatError, "item 'a'", "archive/data/0")


@needs_cli
def test_verify_checks_zip_crc(tmp_path):
    """One flipped byte in a tensor's stored bytes: strata's load cannot tell (DCP keeps no
    strata checksums), verify names the item by its zip CRC-32 (exit 3, STRATA_ECHECKSUM)."""
    path, md = case(tmp_path, "flip")
    r = subprocess.run([STRATA, "verify", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    ck = strata.Checkpoint(path)
    shard = [t for t in ck.tensors if t["name"] == "a"][0]["shards"][0]
    info, arch = archive_of(path, md, "a")
    # the bytes strata reads for 'a' are the archive's data/0 entry, inside the item
    data_at = shard["file_offset"]
    z = zipfile.ZipFile(io.BytesIO(arch))
    assert arch[data_at - info.offset:][:48] == z.read("archive/data/0")
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.seek(data_at + 5)
        b = f.read(1)
        f.seek(data_at + 5)
        f.write(bytes([b[0] ^ 0x40]))
    r = subprocess.run([STRATA, "verify", path], capture_output=True, text=True)
    assert r.returncode == 3, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "item 'a' at %d: zip CRC-32 of archive/data/0 is" % info.offset in out, out
    assert "item 'b'" not in out, out


def test_names_alone_are_not_enough(tmp_path):
    """A .metadata that is not a pickle is no DCP checkpoint."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ".metadata").write_text("not a pickle")
    (fake / "__0_0.distcp").write_text("x")
    with pytest.raises(strata.MissingError):
        strata.Checkpoint(str(fake))
