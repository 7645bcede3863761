"""Megatron-Core torch_dist as a source: checkpoints written in this run by megatron-core
0.16.1's dist_checkpointing.save (torch_dist backend, its own FileSystemWriterAsync and
planner) on 1 and 2 gloo processes - TP-sharded model weights (row- and column-parallel,
replicated biases), the distributed optimizer's state in Megatron 0.16.1's layout
('dp_reshardable': each bucket a 1-D tensor whose pieces, one per parameter and padding, are
flat ranges held by the data-parallel ranks; the ShardedTensors are built here as
DistributedOptimizer.sharded_param_state_dp_reshardable builds them, since that class needs
a DDP model on GPUs), ShardedObjects, and common state (common.pt)
- opened by strata (format "megatron"), loaded into plain tensors, into other world sizes
and into DTensors, and compared bitwise with what Megatron saved; `strata inspect` /
`verify` name the format. A legacy N-D flattened tensor (megatron-core < 0.14: flat ranges
of boxes, reformulated into an (N+1)-d DCP tensor with its original shape in the
Metadata's mcore_data) is written by 0.16.1's writer in that layout, the mcore_data set on
the Metadata as the old MCoreSavePlanner did, and loaded back in its original shape.
Hostile metadata.json (another backend, truncated JSON, a duplicate key, no backend) and a
missing .metadata get their exact codes.

megatron-core 0.16.1's save runs on CPU here only with two CUDA calls stubbed (it is written
for GPUs): filesystem_async.preload_tensors calls torch.cuda.synchronize() ("Torch not
compiled with CUDA enabled") and state_dict_saver.save_state_dict_async_finalize makes
its all-reduced failure flag on torch.cuda.current_device(); the stubs make the first a
no-op (the tensors are already on the CPU) and the second "cpu" (so gloo reduces it). The
bytes, .metadata, metadata.json and common.pt are Megatron's own."""

import os
import pickle
import subprocess
import warnings

import pytest
import torch

import _dist
import strata
import strata.torch as st
from _tensors import load_dtensors, same
from _zipflip import entries, entry_of, flip, raw

mcore = pytest.importorskip("megatron.core.dist_checkpointing",
                            reason="megatron-core 0.16.1 is not installed (make venv installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")

BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_0"
NBUCKET = 63      # the bucket's unpadded elements (64 padded: 32 per rank on 2)
# The pieces of the bucket each data-parallel rank holds (parameters and intra-bucket
# padding, as Megatron's dp_reshardable cuts them); the last padding is not saved.
PIECES = {1: [[(0, 10), (10, 25), (25, 40), (40, 63)]],
          2: [[(0, 10), (10, 25), (25, 32)], [(32, 40), (40, 63)]]}
# name: (global shape, dtype, TP dim or None for replicated)
MODEL = {"decoder.layers.0.mlp.linear_fc1.weight": ((22, 7), torch.float32, 0),
         "decoder.layers.0.mlp.linear_fc2.weight": ((5, 14), torch.float32, 1),
         "decoder.layers.0.mlp.linear_fc1.bias": ((22,), torch.bfloat16, 0),
         "decoder.final_layernorm.weight": ((7,), torch.bfloat16, None),
         "embedding.position_ids": ((9,), torch.int64, None)}
COMMON_TENSOR = torch.arange(96, dtype=torch.float32) / 7
FLAT = "optimizer.state.exp_avg.decoder.layers.0.self_attention.linear_qkv.weight"
FLAT_SHAPE = (6, 4)   # cut into 2 x 1 boxes of 3 x 4 (12 elements): reformulated (2, 1, 12)


def ref(name, shape, dtype):
    """The value saved under name: the same on every rank, seeded by the name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype == torch.int64:
        return torch.randint(-(1 << 40), 1 << 40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def references():
    out = {k: ref(k, s, d) for k, (s, d, _) in MODEL.items()}
    for part in ("param", "exp_avg", "exp_avg_sq"):
        out[BUCKET + "." + part] = ref(BUCKET + "." + part, (NBUCKET,), torch.float32)
    return out


def _cpu_only_megatron():
    """The two CUDA calls megatron-core 0.16.1's torch_dist save makes (module docstring)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def mg_write(path, legacy_flat):
    """megatron-core's dist_checkpointing.save of the model, the optimizer buckets, a
    ShardedObject and common state, on this run's ranks, to path."""
    import torch.distributed as dist
    _cpu_only_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing import ShardedTensor, save
        from megatron.core.dist_checkpointing.mapping import ShardedObject
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {"model": {}, "optimizer": {"param_state": {}}}
    for name, (shape, dtype, tp) in MODEL.items():
        full = ref(name, shape, dtype)
        if tp is None:   # replicated across TP: only rank 0's copy is the main replica
            sd["model"][name] = ShardedTensor.from_rank_offsets(name, full.clone(),
                                                               replica_id=rank)
        else:            # tensor-parallel: this rank's slice along dim tp
            n = shape[tp] // world
            local = full.narrow(tp, rank * n, n).clone()
            sd["model"][name] = ShardedTensor.from_rank_offsets(name, local, (tp, rank, world))
    for part in ("param", "exp_avg", "exp_avg_sq"):
        key = BUCKET + "." + part
        full = ref(key, (NBUCKET,), torch.float32)
        sd["optimizer"]["param_state"][part] = [
            ShardedTensor(key, full[lo:hi].clone(), torch.float32, (hi - lo,), (NBUCKET,),
                          (lo,), axis_fragmentations=None, flattened_range=None,
                          allow_shape_mismatch=False, replica_id=(0, 0, 0))
            for lo, hi in PIECES[world][rank]]
    if legacy_flat:
        # the layout megatron-core < 0.14 gave an N-D flattened tensor: box (i, 0) of the
        # (6, 4) tensor's 2 x 1 grid is row (i, 0) of a (2, 1, 12) tensor, a flat range
        # [s, e) of the box the chunk at offsets (i, 0, s) of lengths (1, 1, e - s)
        full = ref(FLAT, FLAT_SHAPE, torch.float32).reshape(2, 1, 12)
        mine = {0: [(0, 0, 5), (1, 0, 7)], 1: [(0, 5, 12), (1, 7, 12)]}[rank] \
            if world == 2 else [(0, 0, 5), (0, 5, 12), (1, 0, 12)]
        sd["optimizer"]["flat"] = [
            ShardedTensor(FLAT, full[i, :, s:e].reshape(1, 1, e - s).clone(), torch.float32,
                          (1, 1, e - s), (2, 1, 12), (i, 0, s), axis_fragmentations=None,
                          replica_id=(0, 0, 0))
            for i, s, e in mine]
    sd["rng_state"] = ShardedObject("rng_state", {"seed": 1000 + rank}, (world,), (rank,),
                                    replica_id=0)
    sd["iteration"] = 12
    sd["args"] = {"lr": 0.5, "tp": world}
    sd["loss_scale"] = COMMON_TENSOR.clone()     # a tensor of the common state: common.pt
    save(sd, path)
    dist.barrier()
    if legacy_flat and rank == 0:
        # what megatron-core < 0.14's MCoreSavePlanner.create_global_plan did: the original
        # shape of each N-D flattened tensor on the Metadata it pickles
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(path).read_metadata()
        md.mcore_data = {FLAT: {"nd_reformulated_orig_global_shape": FLAT_SHAPE}}
        for k in MODEL:
            md.mcore_data[k] = {}
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(md, f)
    dist.barrier()
    return sorted(os.listdir(path))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("megatron"))
    out = {}
    for world in (1, 2):
        path = os.path.join(base, "tp%d" % world)
        os.mkdir(path)
        files = _dist.run(mg_write, world, path, world == 2, timeout=240)[0]
        assert {"metadata.json", "common.pt", ".metadata"} <= set(files), files
        out[world] = path
    return out


def test_megatron_wrote_it(written):
    """What megatron-core wrote: metadata.json naming torch_dist, common.pt, the DCP files."""
    import json
    for world, path in written.items():
        with open(os.path.join(path, "metadata.json")) as f:
            assert json.load(f)["sharded_backend"] == "torch_dist"
        assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 2 * world


def test_inspect(written):
    """Format "megatron"; the TP slices are boxes; each optimizer piece is a shard of its
    bucket; the ShardedObjects and common.pt are blobs; the legacy flattened tensor has its
    original shape."""
    for world, path in written.items():
        ck = strata.Checkpoint(path)
        assert ck.format == "megatron" and ck.committed and ck.chunk_bytes == 0
        t = {x["name"]: x for x in ck.tensors}
        for name, (shape, dtype, tp) in MODEL.items():
            assert tuple(t[name]["shape"]) == shape, name
            assert len(t[name]["shards"]) == (1 if tp is None else world), name
        pieces = sorted((tuple(s["offsets"]), tuple(s["lengths"]))
                        for s in t[BUCKET + ".exp_avg"]["shards"])
        assert pieces == sorted(((lo,), (hi - lo,)) for r in PIECES[world] for lo, hi in r)
        blobs = sorted(b["name"] for b in ck.blobs)
        assert blobs == ["common.pt"] + ["rng_state/shard_%d_%d" % (r, world)
                                         for r in range(world)]
        if world == 2:
            assert tuple(t[FLAT]["shape"]) == FLAT_SHAPE and t[FLAT]["dtype"] == "f32"
            assert len(t[FLAT]["shards"]) == 4
        else:
            assert FLAT not in t


@needs_cli
def test_cli_names_the_format(written):
    path = written[2]
    r = subprocess.run([STRATA, "inspect", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Megatron-Core torch_dist %s: 9 tensors, 3 blobs" % path), r.stdout
    r = subprocess.run([STRATA, "verify", path], capture_output=True, text=True)
    assert r.returncode == 0 and "Megatron torch_dist has no strata checksums" in r.stdout, r


def test_load_plain_tensors(written):
    """Into whole plain tensors, in the pytest process: bitwise what Megatron saved."""
    refs = references()
    refs[FLAT] = ref(FLAT, FLAT_SHAPE, torch.float32)
    for world, path in written.items():
        sd = {k: torch.full_like(v, 7) for k, v in refs.items() if k != FLAT or world == 2}
        st.load(sd, path)
        for k, v in sd.items():
            assert same(v, refs[k]), (world, k)


def test_load_slices_of_flat_pieces(written):
    """A request across the flat pieces of the legacy tensor and of the buckets: rows 2..4 of
    the (6, 4) tensor (the end of box 0, held by two pieces, and the start of box 1)."""
    path = written[2]
    full = ref(FLAT, FLAT_SHAPE, torch.float32)
    ck = strata.Checkpoint(path)
    assert {x["name"] for x in ck.tensors} >= {FLAT}
    got = torch.zeros(6, 4)
    st.load({FLAT: got}, path)
    assert same(got, full)


def mg_load(path, world_saved):
    """On this run's ranks: every tensor into a DTensor sharded along dim 0 (Shard(0): the
    bucket's 63 elements cut across the saved pieces) and the TP weights along the other dim
    too (load_dtensors); (mismatches, cases)."""
    import torch.distributed as dist
    refs = references()
    if world_saved == 2:
        refs[FLAT] = ref(FLAT, FLAT_SHAPE, torch.float32)
    bad, cases = load_dtensors(refs, path)
    return ["rank %d: %s Shard(%d) from %d ranks" % (dist.get_rank(), k, dim, world_saved)
            for k, dim in bad], cases


@pytest.mark.parametrize("world", [3, 1])
def test_load_other_world_sizes(written, world):
    """The 2-process checkpoint on 3 and 1 processes, the 1-process one too: DTensors
    Shard(0) and Shard(1), bitwise."""
    for saved, path in written.items():
        res = _dist.run(mg_load, world, path, saved, timeout=240)
        bad = [b for r in res for b in r[0]]
        assert res[0][1] == (12 if saved == 2 else 10), res[0][1]
        assert not bad, "\n".join(bad)


def test_sharded_objects_are_never_unpickled(written):
    """A ShardedObject is a DCP value (a torch.save archive): decoded by strata's restricted
    torch.save reader (strata._torchsave.archive_values), never unpickled."""
    path = written[2]
    sd = {"rng_state/shard_1_2": None}
    st.load(sd, path)
    assert sd["rng_state/shard_1_2"] == [{"seed": 1001}]


def test_common_state_values(written, tmp_path):
    """The state every rank shares is in common.pt (megatron-core's torch.save of it): its
    values load by strata's restricted reader, never unpickled; a common.pt strata refuses
    fails only the keys found nowhere else, naming why."""
    for world, path in written.items():
        sd = {"iteration": 0, "args": {}}
        st.load(sd, path)
        assert sd["iteration"] == 12
        assert sd["args"] == {"lr": 0.5, "tp": world}
    bad = copy_of(written[1], str(tmp_path / "bad"))
    planted = str(tmp_path / "planted")

    class Plant:
        def __reduce__(self):
            return (os.system, ("touch " + planted,))
    torch.save({"iteration": Plant()}, os.path.join(bad, "common.pt"))
    name = sorted(MODEL)[0]
    sd = {name: torch.zeros(MODEL[name][0], dtype=MODEL[name][1])}
    st.load(sd, bad)        # the sharded state loads: common.pt is not needed
    assert same(sd[name], ref(name, *MODEL[name][:2]))
    with pytest.raises(strata.NotFoundError) as ei:
        st.load({"iteration": 0}, bad)
    assert "common.pt could not be read" in str(ei.value) and "system" in str(ei.value), \
        str(ei.value)
    assert not os.path.exists(planted)


def _blob_of(path, name, size):
    """The bytes of the global blob name (size bytes) of the checkpoint at path, loaded
    through a strata.Loader (also returned, open: the caller closes it)."""
    ld = strata.Loader([path])
    t = torch.zeros(size, dtype=torch.uint8)
    s = strata.State()
    s.add_blob(name, data_ptr=t.data_ptr(), nbytes=size, keep=t)
    ld.load([s])
    return ld, s, t


def test_common_pt_is_a_blob(written, tmp_path):
    """common.pt is the index's global blob "common.pt", the whole file, read through the
    loader as every blob (with a group: once, reaching every rank): bitwise the file's
    bytes; a common.pt replaced after the loader opened the checkpoint is the loader's
    ChangedError on the next load, never values of another file."""
    path = copy_of(written[1], str(tmp_path / "ck"))
    common = os.path.join(path, "common.pt")
    with open(common, "rb") as f:
        data = f.read()
    ck = strata.Checkpoint(path)
    assert [(b["owner"], b["bytes"]) for b in ck.blobs if b["name"] == "common.pt"] == \
        [(-1, len(data))]
    ld, s, t = _blob_of(path, "common.pt", len(data))
    with ld:
        assert bytes(t.numpy()) == data
        torch.save({"iteration": 99}, common + ".new")
        os.replace(common + ".new", common)
        with pytest.raises(strata.ChangedError, match="common.pt"):
            ld.load([s])


def test_hostile_common_pt(written, tmp_path):
    """A common.pt that is not a regular file (a directory; a FIFO, which a plain read
    would wait on forever) is refused when the checkpoint is opened, with the loader's
    code, naming it; one whose data.pkl fails its zip CRC-32 fails `strata verify`
    (reported, naming common.pt) and, as a refused one, only the keys it alone holds."""
    import zipfile
    for kind in ("dir", "fifo"):
        path = copy_of(written[1], str(tmp_path / kind))
        common = os.path.join(path, "common.pt")
        os.remove(common)
        os.mkdir(common) if kind == "dir" else os.mkfifo(common)
        refused(path, strata.StorageError, "common.pt", 1)
    path = copy_of(written[1], str(tmp_path / "crc"))
    common = os.path.join(path, "common.pt")
    with zipfile.ZipFile(common) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    with open(common, "r+b") as f:
        f.seek(info.header_offset + 26)
        n, e = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + n + e + info.file_size // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    name = sorted(MODEL)[0]
    sd = {name: torch.zeros(MODEL[name][0], dtype=MODEL[name][1])}
    st.load(sd, path)
    assert same(sd[name], ref(name, *MODEL[name][:2]))
    with pytest.raises(strata.ChecksumError, match="CRC-32"):
        st.load({"iteration": 0}, path)
    if os.access(STRATA, os.X_OK):
        r = subprocess.run([STRATA, "verify", path], capture_output=True, text=True)
        assert r.returncode == 3 and "STRATA_ECHECKSUM" in r.stderr and \
            "common.pt: item 'common.pt' at 0: zip CRC-32 of" in r.stderr, \
            (r.returncode, r.stdout, r.stderr)


# ---- a byte of a tensor flipped: every read checks the zip CRC-32 (issue 28) -------------------

FLIPPED = "decoder.layers.0.mlp.linear_fc1.weight"


def flip_distcp(src, dst):
    """A copy of the checkpoint at src with one byte of FLIPPED's first saved chunk flipped:
    its item's archive at the offset .metadata gives in its .distcp file, the byte inside the
    entry holding the chunk's storage (from its local header). (copy, entry, file)."""
    from torch.distributed.checkpoint import FileSystemReader
    path = copy_of(src, dst)
    md = FileSystemReader(path).read_metadata()
    info = min((v for k, v in md.storage_data.items() if k.fqn == FLIPPED),
               key=lambda v: (v.relative_path, v.offset))
    f = os.path.join(path, info.relative_path)
    with open(f, "rb") as h:
        h.seek(info.offset)
        item = h.read(info.length)
    (entry, at, size), = [e for e in entries(item) if "/data/" in e[0] and
                          not e[0].endswith("data.pkl")]
    flip(f, info.offset + at + size // 2)
    return path, entry, info.relative_path


def test_flipped_tensor(written, tmp_path):
    """strata.torch.load raises ChecksumError naming the tensor, the entry and the .distcp
    file; a tensor of another item loads; skip_crc loads and says so."""
    refs = references()
    path, entry, fname = flip_distcp(written[2], str(tmp_path / "flip"))
    with pytest.raises(strata.ChecksumError) as ei:
        st.load({k: torch.zeros_like(v) for k, v in refs.items()}, path)
    msg = str(ei.value)
    assert "tensor '%s'" % FLIPPED in msg and "zip entry '%s'" % entry in msg and fname in msg, msg
    other = "decoder.final_layernorm.weight"
    sd = {other: torch.zeros_like(refs[other])}
    st.load(sd, path)
    assert same(sd[other], refs[other])
    sd = {FLIPPED: torch.zeros_like(refs[FLIPPED])}
    s = st.load(sd, path, skip_crc=True)
    assert s["crc_skipped"] and not same(sd[FLIPPED], refs[FLIPPED]), s


@needs_cli
def test_flipped_tensor_export_exits_3(written, tmp_path):
    path, entry, fname = flip_distcp(written[2], str(tmp_path / "flip"))
    out = str(tmp_path / "out")
    r = subprocess.run([STRATA, "export", path, out, "--quiet"], capture_output=True, text=True)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "zip entry '%s'" % entry in r.stderr and fname in r.stderr, r.stderr
    assert not os.path.exists(out)


def mg_load_flipped(path):
    """On this run's ranks: the model tensors into DTensors Shard(0) (load_dtensors); the
    exception class name each rank got (or "ok")."""
    refs = {k: v for k, v in references().items() if k in MODEL}
    try:
        load_dtensors(refs, path)
    except strata.Error as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.slow
def test_flipped_tensor_fails_every_rank(written, tmp_path):
    """Loaded into DTensors on 2 and 3 gloo processes: every rank raises ChecksumError."""
    path, entry, _ = flip_distcp(written[2], str(tmp_path / "flip"))
    for world in (2, 3):
        res = _dist.run(mg_load_flipped, world, path, timeout=240)
        assert [r[0] for r in res] == ["ChecksumError"] * world, res
        assert all(entry in r[1] for r in res), res


def test_flipped_common_tensor(written, tmp_path):
    """A byte of the common state's tensor flipped in common.pt (a blob read whole): loading
    that key raises ChecksumError naming common.pt's entry, never its corrupt values; the
    sharded tensors still load (common.pt is not needed for them)."""
    for world, src in written.items():
        sd = {"loss_scale": torch.zeros(96)}
        st.load(sd, src)
        assert same(sd["loss_scale"], COMMON_TENSOR)
        path = copy_of(src, str(tmp_path / ("c%d" % world)))
        common = os.path.join(path, "common.pt")
        entry, at = entry_of(open(common, "rb").read(), raw(COMMON_TENSOR))
        flip(common, at + 40)
        with pytest.raises(strata.ChecksumError) as ei:
            st.load({"loss_scale": torch.zeros(96)}, path)
        assert "zip entry '%s'" % entry in str(ei.value) and "common.pt" in str(ei.value), \
            str(ei.value)
        name = sorted(MODEL)[0]
        sd = {name: torch.zeros(MODEL[name][0], dtype=MODEL[name][1])}
        st.load(sd, path)
        assert same(sd[name], ref(name, *MODEL[name][:2]))


# ---- hostile inputs ---------------------------------------------------------------------------

def copy_of(src, dst):
    os.mkdir(dst)
    for f in os.listdir(src):
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
            b.write(a.read())
    return dst


def refused(path, exc, words, code):
    for call in (lambda: strata.Checkpoint(path),
                 lambda: st.load({"a": torch.zeros(3)}, path)):
        with pytest.raises(exc) as ei:
            call()
        assert words in str(ei.value), (words, str(ei.value))
    if os.access(STRATA, os.X_OK):
        r = subprocess.run([STRATA, "inspect", path], capture_output=True, text=True)
        assert r.returncode == code and words in r.stderr, (r.returncode, r.stderr)


@pytest.mark.parametrize("text,exc,words,code", [
    ('{"sharded_backend": "zarr", "sharded_backend_version": 1}', strata.UnsupportedError,
     "sharded_backend 'zarr' is not one strata reads", 1),
    ('{"sharded_backend": "torch_dist", "sharded_backend_version": 2}',
     strata.UnsupportedError, "torch_dist version 2 is not one strata reads", 1),
    ('{"sharded_backend": "torch_dist", "common_backend": "zarr"}', strata.UnsupportedError,
     "common_backend 'zarr' is not one strata reads", 1),
    ('{"sharded_backend": "torch_dist", "sharded_backend_ver', strata.FormatError,
     "metadata.json at byte 54 of its JSON: unterminated string", 3),
    ('{"sharded_backend": "torch_dist",', strata.FormatError,
     "metadata.json at byte 33 of its JSON: the JSON ends early", 3),
    ('{"sharded_backend": "torch_dist", "sharded_backend": "torch_dist"}', strata.FormatError,
     'key "sharded_backend" is there twice', 3),
    ('{"sharded_backend": 1, "x": "\\"sharded_backend\\""}', strata.FormatError,
     '"sharded_backend" is not a string', 3),
    ('{"x": "sharded_backend", "y": "\\"sharded_backend\\""}', strata.FormatError,
     'no "sharded_backend"', 3),
    ('{"sharded_backend": "torch_dist"} x', strata.FormatError,
     "something follows the JSON object", 3),
    # lone surrogate escapes name no character (json.loads takes them; strata does not)
    ('{"sharded_backend": "torch_dist", "x\\ud800": 1}', strata.FormatError,
     "a high surrogate", 3),
    ('{"sharded_backend": "torch_dist", "x": "\\udc00"}', strata.FormatError,
     "a lone low surrogate", 3),
    ('{"sharded_backend": "torch_dist", "x": "\\ud800\\u0041"}', strata.FormatError,
     "a high surrogate", 3),
])
def test_hostile_metadata_json(written, tmp_path, text, exc, words, code):
    path = copy_of(written[1], str(tmp_path / "bad"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write(text)
    refused(path, exc, words, code)


def test_metadata_json_over_its_limit(written, tmp_path):
    path = copy_of(written[1], str(tmp_path / "big"))
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "pad": "%s"}' % ("x" * 70000))
    refused(path, strata.FormatError, "metadata.json': over the limit of 65536 bytes", 3)


def test_missing_dcp_metadata(written, tmp_path):
    path = copy_of(written[1], str(tmp_path / "nometa"))
    os.remove(os.path.join(path, ".metadata"))
    refused(path, strata.MissingError, "its DCP metadata (.metadata) is missing", 1)


def test_hostile_mcore_data(written, tmp_path):
    """mcore_data whose shape does not match the reformulated tensor, or names a tensor the
    checkpoint lacks: refused naming it."""
    from torch.distributed.checkpoint import FileSystemReader
    for shape, words in [((7, 4), "dim 0 of 7 is not cut into 2 equal parts"),
                         ((6, 8), "its flat dim holds 12 elements, its boxes 24")]:
        path = copy_of(written[2], str(tmp_path / ("shape%d" % shape[1])))
        md = FileSystemReader(path).read_metadata()
        md.mcore_data = {FLAT: {"nd_reformulated_orig_global_shape": shape}}
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        refused(path, strata.FormatError, words, 3)
    path = copy_of(written[2], str(tmp_path / "noname"))
    md = FileSystemReader(path).read_metadata()
    md.mcore_data = {"nope": {"nd_reformulated_orig_global_shape": (4,)}}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    refused(path, strata.FormatError, "mcore_data names 'nope', which is not a tensor", 3)


@needs_cli
def test_export_to_safetensors(written, tmp_path):
    """`strata export` of the 2-process checkpoint: safe_open reads every tensor back
    bitwise, the legacy flattened one in its original shape."""
    from safetensors import safe_open
    out = str(tmp_path / "out")
    subprocess.run([STRATA, "export", written[2], out, "--quiet"], check=True)
    refs = references()
    refs[FLAT] = ref(FLAT, FLAT_SHAPE, torch.float32)
    got = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), "pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(got) == sorted(refs)
    for k, v in refs.items():
        assert same(got[k], v), k
