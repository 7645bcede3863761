"""The zip CRC-32s of torch.save files, Hugging Face pytorch_model.bin directories and PyTorch
DCP checkpoints are checked by every read, not only by `strata verify` (issue 28, item 1).

Each fixture is written here by torch (torch.save, dcp.save); one byte inside a tensor's
data is flipped, the byte found from the zip entry's local header (for DCP, inside the item's
archive that .metadata places in its .distcp file). Then: strata.torch.load raises
ChecksumError naming the tensor, the entry and the file; `strata export` exits 3 naming them
and leaves OUT as it was; a load on 2 and 3 gloo processes fails on every rank; a load that
needs only part of an entry (a row block of a tensor, in one process and on several) still
detects a flip in the part it does not need, reading the rest for the check (stats
crc_bytes); an entry larger than a read is checked across its reads; skip_crc=True / --skip-crc
load and export the corrupt bytes and say so (crc_skipped). ZeRO and Megatron: their own
test files (test_zero_source.py, test_megatron_source.py)."""

import os
import subprocess

import pytest
import torch

import _dist
import strata
import strata.torch as st
from _tensors import same
from _zipflip import entry_of, flip, raw

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")


def ref_state():
    g = torch.Generator().manual_seed(28)
    return {"w": torch.randn(600, 16, generator=g), "b": torch.randn(37, generator=g)}


def corrupt_pt(path, name="w", byte=None):
    """Flips a byte of tensor `name` (by default one in its last rows) of the torch.save file
    at path; returns (entry name, offset flipped)."""
    data = open(path, "rb").read()
    want = raw(torch.load(path)[name])
    entry, at = entry_of(data, want)
    at += len(want) - 100 if byte is None else byte
    flip(path, at)
    return entry, at


def write_pt(tmp_path):
    p = str(tmp_path / "model.pt")
    torch.save(ref_state(), p)
    return p


def write_hf(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    torch.save(ref_state(), str(d / "pytorch_model.bin"))
    return str(d)


def write_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp
    d = str(tmp_path / "dcp")
    dcp.save(ref_state(), checkpoint_id=d)
    return d


def corrupt_dcp(path, name="w", byte=None):
    """Flips a byte of tensor `name` of the DCP checkpoint at path: its item's archive is at
    the offset .metadata gives in its .distcp file, the tensor's bytes in an entry of it."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == name]
    f = os.path.join(path, info.relative_path)
    with open(f, "rb") as h:
        h.seek(info.offset)
        item = h.read(info.length)
    entry, at = entry_of(item, raw(ref_state()[name]))
    at += info.offset + (len(raw(ref_state()[name])) - 100 if byte is None else byte)
    flip(f, at)
    return entry, at


# (writer, corrupter, the file named in messages)
KINDS = {"pt": (write_pt, corrupt_pt, "model.pt"),
         "hf": (write_hf, lambda d, **k: corrupt_pt(os.path.join(d, "pytorch_model.bin"), **k),
                "pytorch_model.bin"),
         "dcp": (write_dcp, corrupt_dcp, "__0_0.distcp")}


def zeros():
    return {k: torch.zeros_like(v) for k, v in ref_state().items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_clean_load_checks_every_entry(tmp_path, kind):
    """A file as written loads bitwise; each entry read is checked (stats), nothing extra
    read: a whole-tensor load needs every byte of each entry."""
    path = KINDS[kind][0](tmp_path)
    sd = zeros()
    s = st.load(sd, path)
    for k, v in ref_state().items():
        assert same(sd[k], v), k
    assert s["crc_checked"] == 2 and s["crc_bytes"] == 0 and not s["crc_skipped"], s


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_flipped_byte_fails_the_load(tmp_path, kind):
    write, corrupt, fname = KINDS[kind]
    path = write(tmp_path)
    entry, _ = corrupt(path)
    with pytest.raises(strata.ChecksumError) as ei:
        st.load(zeros(), path)
    msg = str(ei.value)
    assert "tensor 'w'" in msg and "zip entry '%s'" % entry in msg and fname in msg, msg
    assert "CRC-32" in msg, msg
    # a load of the other tensor alone reads no byte of w's entry: it loads
    sd = {"b": torch.zeros(37)}
    st.load(sd, path)
    assert same(sd["b"], ref_state()["b"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_skip_crc_loads_the_corrupt_bytes_and_says_so(tmp_path, kind):
    write, corrupt, _ = KINDS[kind]
    path = write(tmp_path)
    corrupt(path)
    sd = zeros()
    s = st.load(sd, path, skip_crc=True)
    assert s["crc_skipped"] and s["crc_checked"] == 0 and s["crc_bytes"] == 0, s
    assert not same(sd["w"], ref_state()["w"])      # the flipped element came through
    assert same(sd["b"], ref_state()["b"])


@needs_cli
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_exits_3(tmp_path, kind):
    write, corrupt, fname = KINDS[kind]
    path = write(tmp_path)
    out = str(tmp_path / "out")
    r = subprocess.run([STRATA, "export", path, out, "--quiet"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    entry, _ = corrupt(path)
    r = subprocess.run([STRATA, "export", path, out, "--quiet"], capture_output=True,
                       text=True)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "zip entry '%s'" % entry in r.stderr and fname in r.stderr, r.stderr
    # out holds the clean export still, never the corrupt bytes
    from safetensors.torch import load_file
    names = [n for n in os.listdir(out) if n.endswith(".safetensors")]
    got = {}
    for n in names:
        got.update(load_file(os.path.join(out, n)))
    assert same(got["w"], ref_state()["w"])
    r = subprocess.run([STRATA, "export", path, str(tmp_path / "out2"), "--skip-crc"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "zip CRC-32s not checked" in r.stdout, (r.stdout, r.stderr)


def test_partial_load_checks_the_whole_entry(tmp_path):
    """A load needing rows 0..299 of w reads the rest of its entry for the check (crc_bytes)
    and detects a flip in a row it does not need; skip_crc reads only its rows."""
    path = write_pt(tmp_path)
    w = ref_state()["w"]

    def load_rows(**kw):
        t = torch.zeros(300, 16)
        s = strata.State()
        s.add_shard("w", "f32", [600, 16], [0, 0], [300, 16], data_ptr=t.data_ptr(),
                    nbytes=t.numel() * 4, keep=t)
        return strata.load([path], [s], **kw), t

    stats, t = load_rows()
    assert same(t, w[:300])
    assert stats["bytes"] == 300 * 16 * 4 and stats["crc_bytes"] == 300 * 16 * 4, stats
    assert stats["crc_checked"] == 1, stats
    corrupt_pt(path)                                   # in row 598
    with pytest.raises(strata.ChecksumError, match="zip entry"):
        load_rows()
    stats, t = load_rows(skip_crc=True)
    assert same(t, w[:300]) and stats["crc_skipped"] and stats["crc_bytes"] == 0, stats


def test_entry_larger_than_a_read(tmp_path):
    """With reads of 8 KiB, w's 38400-byte entry spans five reads: their CRC-32s are
    combined and compared once; a flip in the first read is found."""
    path = write_pt(tmp_path)
    sd = zeros()
    s = st.load(sd, path, max_io_bytes=8192)
    assert same(sd["w"], ref_state()["w"]) and s["crc_checked"] == 2, s
    corrupt_pt(path, byte=5)
    with pytest.raises(strata.ChecksumError, match="tensor 'w'"):
        st.load(zeros(), path, max_io_bytes=8192)


def dist_load(path, nrows):
    """On this run's ranks: w into a DTensor Shard(0) (rank r: its rows), then b replicated;
    ('ok', crc_checked, bitwise) or (exception class name, message)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref = ref_state()
    sd = {"w": distribute_tensor(torch.zeros(600, 16), mesh, [Shard(0)]),
          "b": distribute_tensor(torch.zeros(37), mesh, [Replicate()])}
    try:
        s = st.load(sd, path)
    except strata.Error as e:
        return type(e).__name__, str(e)
    want = distribute_tensor(ref["w"], mesh, [Shard(0)]).to_local()
    return "ok", s["crc_checked"], same(sd["w"].to_local(), want) and \
        same(sd["b"].to_local(), ref["b"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pt", "dcp"])
def test_multi_process_load_fails_on_every_rank(tmp_path, kind):
    """2 and 3 gloo ranks, each needing a row block of w: clean, every entry is checked
    once (by the one rank that reads it whole) and the load is bitwise; with a byte of the
    last rows flipped (rank 0 needs none of them), every rank raises ChecksumError."""
    write, corrupt, fname = KINDS[kind]
    path = write(tmp_path)
    for world in (2, 3):
        res = _dist.run(dist_load, world, path, 600, timeout=180)
        assert all(r[0] == "ok" and r[2] for r in res), res
        assert sum(r[1] for r in res) == 2, res          # w's entry and b's, once each
    corrupt(path)
    for world in (2, 3):
        res = _dist.run(dist_load, world, path, 600, timeout=180)
        assert [r[0] for r in res] == ["ChecksumError"] * world, res
        assert all("zip entry" in r[1] and fname in r[1] for r in res), res


def test_export_view_reads_its_entry_once(tmp_path):
    """Export of a tensor that is a view of part of its storage: the windows read its rows,
    the export reads the rest of the storage's entry once at the end for the check
    (crc_bytes) and fails on a flip there; a big tensor exported in several windows is read
    once (not once per window)."""
    base = torch.randn(100, 16, generator=torch.Generator().manual_seed(3))
    p = str(tmp_path / "v.pt")
    torch.save({"v": base[10:20]}, p)
    out = str(tmp_path / "out")
    s = strata.export_safetensors(p, out)
    assert s["crc_checked"] == 1 and s["crc_bytes"] == 90 * 16 * 4, s
    data = open(p, "rb").read()
    _, at = entry_of(data, raw(base))
    flip(p, at + 50 * 16 * 4)                          # row 50: not exported
    with pytest.raises(strata.ChecksumError, match="zip entry"):
        strata.export_safetensors(p, str(tmp_path / "out2"))
    assert not os.path.exists(str(tmp_path / "out2"))
    s = strata.export_safetensors(p, str(tmp_path / "out3"), skip_crc=True)
    assert s["crc_skipped"] and s["crc_checked"] == 0, s


def test_export_of_many_windows_checks_once(tmp_path):
    """A 96 MiB tensor is exported in two 64 MiB windows: its entry is checked once from the
    bytes the windows read (no read twice: io_calls of one pass of 4 MiB reads), and a flip
    in its first window is found only when the second completes the entry: the export fails
    and publishes nothing."""
    big = torch.arange(24 << 20, dtype=torch.float32)
    p = str(tmp_path / "big.pt")
    torch.save({"big": big}, p)
    s = strata.export_safetensors(p, str(tmp_path / "out"))
    assert s["crc_checked"] == 1 and s["crc_bytes"] == 0, s
    # 24 reads of 4 MiB and 13 writes of 8 MiB (once per window each: 48 reads)
    assert s["io_calls"] <= 24 + 16, s
    data = open(p, "rb").read()
    _, at = entry_of(data, raw(big))
    del data
    flip(p, at + 1000)
    with pytest.raises(strata.ChecksumError, match="tensor 'big'"):
        strata.export_safetensors(p, str(tmp_path / "out2"))
    assert not os.path.exists(str(tmp_path / "out2"))
