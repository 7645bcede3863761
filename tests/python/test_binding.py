"""Layer 1: the extension strata._strata (re-exported by strata), with torch CPU tensors as
buffers. One process; ranks are logical ranks (states) or threads over a Python host Comm."""

import fcntl
import gc
import os
import threading
import time
import weakref

import pytest
import torch

import strata

TORCH_DTYPES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool",
}


def nbytes(t):
    return t.numel() * t.element_size()


def add(state, name, t, global_shape, offsets=None, lengths=None, flat=None, keep=True):
    """Registers the contiguous CPU tensor t as a shard."""
    assert t.is_contiguous()
    state.add_shard(name, TORCH_DTYPES[t.dtype], global_shape, offsets, lengths,
                    data_ptr=t.data_ptr(), nbytes=nbytes(t), flat=flat,
                    keep=t if keep else None)


def add_blob(state, name, data, **kw):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    state.add_blob(name, data_ptr=t.data_ptr(), nbytes=nbytes(t), keep=t, **kw)
    return t


def new_blob(state, name, size, **kw):
    t = torch.zeros(size, dtype=torch.uint8)
    state.add_blob(name, data_ptr=t.data_ptr(), nbytes=size, keep=t, **kw)
    return t


def matrix(rows=6, cols=4, dtype=torch.float32):
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols).to(dtype)


def two_rank_states(m, step_blob=b"step=7"):
    """m saved as two row halves by two logical ranks, plus a global and per-rank blobs."""
    rows, cols = m.shape
    h = rows // 2
    s0, s1 = strata.State(), strata.State()
    add(s0, "w", m[:h].contiguous(), (rows, cols), (0, 0), (h, cols))
    add(s1, "w", m[h:].contiguous(), (rows, cols), (h, 0), (rows - h, cols))
    for r, s in enumerate((s0, s1)):
        add_blob(s, "config", step_blob)
        add_blob(s, "rng", bytes([r]) * 5, rank_local=True)
    return [s0, s1]


def uri(tmp_path, name="ck"):
    return str(tmp_path / name)


def load_matrix(where, shape=(6, 4), dtype=torch.float32, **kw):
    out = torch.zeros(shape, dtype=dtype)
    s = strata.State()
    add(s, "w", out, shape)
    stats = strata.load(where, [s], **kw)
    return out, stats


# ---- basics --------------------------------------------------------------------------------


def test_module_surface():
    assert strata.DTYPES == ("f64", "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "i64", "i32",
                             "i16", "i8", "u8", "bool")
    assert [strata.dtype_size(d) for d in strata.DTYPES] == [8, 4, 2, 2, 1, 1, 8, 4, 2, 1, 1, 1]
    with pytest.raises(strata.InvalidArgumentError, match="complex64"):
        strata.dtype_size("complex64")
    names = {
        -1: "InvalidArgumentError", -2: "OutOfMemoryError", -3: "StorageError",
        -4: "NoSpaceError", -5: "FormatError", -6: "ChecksumError", -7: "IncompleteError",
        -8: "MismatchError", -9: "NotFoundError", -10: "UnfilledError", -11: "ExistsError",
        -12: "SchemeError", -13: "MissingError", -14: "OverlapError", -15: "AbortedError",
        -16: "DeviceError", -17: "BusyError", -18: "ChangedError", -19: "UnsupportedError",
        -20: "NotCheckpointError", -21: "ReplicaLostError",
    }
    assert {c: k.__name__ for c, k in strata.ERRORS.items()} == names
    for code, cls in strata.ERRORS.items():
        assert issubclass(cls, strata.Error)
        assert getattr(strata, cls.__name__) is cls
        assert cls.code == code and cls.name.startswith("STRATA_E")
    assert strata.ChecksumError.name == "STRATA_ECHECKSUM"


def test_round_trip_two_ranks_reshard(tmp_path):
    m = matrix()
    stats = strata.Saver().save(uri(tmp_path), two_rank_states(m), step=7, sync=False)
    assert stats["data_bytes"] == 6 * 4 * 4 + len(b"step=7") + 2 * 5
    assert set(stats) == {"data_bytes", "bytes", "io_calls", "seconds", "max_writer_bytes",
                          "writers", "balance_bound", "all_bytes", "plan_cached", "tier"}
    # whole, then as a column half plus a flat piece of the other half (2 logical ranks)
    out, stats = load_matrix(uri(tmp_path))
    assert torch.equal(out, m) and stats["tier"] == 0
    # a load's stats add how often it read and broadcast the index (one read, no Comm), and
    # the zip CRC-32s checked (none: strata's own checksums are verified chunk by chunk), and
    # have none of a save's writers' fields
    assert set(stats) == {"data_bytes", "bytes", "io_calls", "seconds", "all_bytes",
                          "plan_cached", "tier", "meta_reads", "meta_bcasts", "crc_checked",
                          "crc_bytes", "crc_skipped"}
    assert stats["meta_reads"] == 1 and stats["meta_bcasts"] == 0
    assert stats["crc_checked"] == stats["crc_bytes"] == 0 and not stats["crc_skipped"]
    left = torch.zeros(6, 2)
    right = torch.zeros(7)
    a, b = strata.State(), strata.State()
    add(a, "w", left, (6, 4), (0, 0), (6, 2))
    add(b, "w", right, (6, 4), (0, 2), (6, 2), flat=(3, 10))
    cfg = new_blob(a, "config", 6)
    rng1 = new_blob(b, "rng", 5, owner=1)
    strata.load([uri(tmp_path)], [a, b])
    assert torch.equal(left, m[:, :2])
    assert torch.equal(right, m[:, 2:].reshape(-1)[3:10])
    assert bytes(cfg.tolist()) == b"step=7" and bytes(rng1.tolist()) == b"\x01" * 5


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_every_dtype(tmp_path, dtype):
    src = (torch.arange(-30, 30, dtype=torch.float32) / 3).reshape(6, 10).to(dtype)
    s = strata.State()
    add(s, "t", src, (6, 10))
    strata.Saver().save(uri(tmp_path), [s], sync=False)
    dst = torch.zeros(6, 10, dtype=dtype)
    d = strata.State()
    add(d, "t", dst, (6, 10))
    strata.load(uri(tmp_path), d)
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
    assert strata.Checkpoint(uri(tmp_path)).tensors[0]["dtype"] == TORCH_DTYPES[dtype]


def test_scalar_and_empty_and_pathlike(tmp_path):
    scalar = torch.tensor(3.5, dtype=torch.float64)
    empty = torch.zeros(0, 4)
    s = strata.State()
    add(s, "scalar", scalar, ())
    add(s, "empty", empty, (0, 4))
    strata.Saver().save(tmp_path / "ck", [s])  # an os.PathLike as the one URI
    got = torch.zeros((), dtype=torch.float64)
    d = strata.State()
    add(d, "scalar", got, ())
    strata.load([tmp_path / "ck"], [d])
    assert got.item() == 3.5


def test_add_shard_checks():
    s = strata.State()
    t = torch.zeros(3, 4)
    with pytest.raises(strata.InvalidArgumentError, match="'w'.*nbytes is 44.*48"):
        s.add_shard("w", "f32", (3, 4), data_ptr=t.data_ptr(), nbytes=44)
    with pytest.raises(strata.InvalidArgumentError, match="'w'.*complex"):
        s.add_shard("w", "complex64", (3, 4), data_ptr=t.data_ptr(), nbytes=48)
    with pytest.raises(strata.InvalidArgumentError, match="exceeds the global size"):
        s.add_shard("w", "f32", (3, 4), (2, 0), (3, 4), data_ptr=t.data_ptr(), nbytes=48)
    with pytest.raises(strata.InvalidArgumentError, match="negative"):
        s.add_shard("w", "f32", (3, -4), data_ptr=t.data_ptr(), nbytes=48)
    with pytest.raises(strata.InvalidArgumentError, match="flat range"):
        s.add_shard("w", "f32", (3, 4), flat=(5, 20), data_ptr=t.data_ptr(), nbytes=60)
    with pytest.raises(strata.InvalidArgumentError, match="name is empty"):
        s.add_shard("", "f32", (3, 4), data_ptr=t.data_ptr(), nbytes=48)
    with pytest.raises(strata.InvalidArgumentError, match="UTF-8"):
        s.add_shard("bad\udc80", "f32", (3, 4), data_ptr=t.data_ptr(), nbytes=48)
    with pytest.raises(TypeError, match="data_ptr"):
        s.add_shard("w", "f32", (3, 4), nbytes=48)
    with pytest.raises(strata.InvalidArgumentError, match="offsets"):
        s.add_shard("w", "f32", (3, 4), (0,), data_ptr=t.data_ptr(), nbytes=48)
    # a flat piece: nbytes is that of the range
    s.add_shard("w", "f32", (3, 4), flat=(2, 7), data_ptr=t.data_ptr(), nbytes=20, keep=t)
    with pytest.raises(strata.InvalidArgumentError, match="owner"):
        s.add_blob("b", data_ptr=t.data_ptr(), nbytes=4, owner=-2)


def test_keep_holds_the_tensor_until_clear(tmp_path):
    s = strata.State()
    t = torch.arange(12, dtype=torch.float32)
    ref = weakref.ref(t)
    add(s, "v", t, (12,))
    del t
    gc.collect()
    assert ref() is not None  # the State keeps it
    strata.Saver().save(uri(tmp_path), [s], sync=False)
    out = torch.zeros(12)
    d = strata.State()
    add(d, "v", out, (12,))
    strata.load(uri(tmp_path), [d])
    assert torch.equal(out, torch.arange(12, dtype=torch.float32))
    s.clear()
    gc.collect()
    assert ref() is None
    # reusable after clear
    t2 = torch.ones(2)
    add(s, "v", t2, (2,))


# ---- asynchronous saves, tiers -------------------------------------------------------------


def test_async_snapshot_then_durable(tmp_path):
    m = matrix(64, 1024)  # 256 KiB
    src = m.clone()
    saver = strata.Saver(pool=strata.Pool(8 << 20))
    s = strata.State()
    add(s, "w", src, tuple(m.shape))
    h = saver.start([uri(tmp_path)], [s], step=3, chunk_bytes=64 << 10)
    h.wait_snapshot()
    src.add_(1000)  # after the snapshot: must not reach the checkpoint
    stats = h.wait_durable()
    assert stats["data_bytes"] == nbytes(m)
    assert h.done() and h.status() == (0, "")
    assert h.wait_durable() == stats  # again: the same outcome
    with pytest.raises(strata.InvalidArgumentError, match="in use"):
        s.clear()  # held by the handle until close
    h.close()
    h.close()  # idempotent
    assert h.closed and h.done()
    s.clear()
    out, _ = load_matrix(uri(tmp_path), tuple(m.shape))
    assert torch.equal(out, m)
    assert strata.Checkpoint(uri(tmp_path)).step == 3


def test_pool_close_frees_it_once_no_saver_holds_it(tmp_path):
    pool = strata.Pool(8 << 20)
    assert pool.nbytes == 8 << 20
    saver = strata.Saver(pool=pool)
    s = strata.State()
    add(s, "w", matrix(64, 64), (64, 64))
    h = saver.start([uri(tmp_path, "a"), uri(tmp_path, "b")], [s])
    with pytest.raises(strata.BusyError, match=r"1 strata.Saver\(s\) hold this pool"):
        pool.close()   # the save in flight still copies into it
    h.close()
    with pytest.raises(strata.BusyError):
        pool.close()   # the saver still holds it
    del h, saver
    gc.collect()
    pool.close()
    pool.close()   # idempotent
    assert pool.nbytes == 0
    with pytest.raises(strata.InvalidArgumentError, match="the pool is closed"):
        strata.Saver(pool=pool)
    with strata.Pool(4 << 20) as p2:
        assert p2.nbytes == 4 << 20
    assert p2.nbytes == 0
    out, _ = load_matrix(uri(tmp_path, "b"), (64, 64))
    assert torch.equal(out, matrix(64, 64))


def test_handle_keeps_states_alive(tmp_path):
    saver = strata.Saver()
    refs = []

    def start():
        t = matrix(256, 256)  # 256 KiB
        refs.append(weakref.ref(t))
        s = strata.State()
        add(s, "w", t, (256, 256))
        refs.append(weakref.ref(s))
        return saver.start(uri(tmp_path), [s])  # no reference to s or t is left here

    h = start()
    gc.collect()
    assert all(r() is not None for r in refs)
    done_polls = 0
    while not h.done():
        done_polls += 1
        time.sleep(0.001)
    h.close()
    gc.collect()
    assert all(r() is None for r in refs)
    out, _ = load_matrix(uri(tmp_path), (256, 256))
    assert torch.equal(out, matrix(256, 256))
    # a handle never closed is closed by its dealloc (it waits)
    h2 = saver.start(uri(tmp_path, "ck2"), two_rank_states(matrix()))
    del h2
    assert strata.probe(uri(tmp_path, "ck2"))["committed"]


def test_context_manager_and_failed_async(tmp_path):
    m = matrix()
    strata.Saver().save(uri(tmp_path), two_rank_states(m))
    with strata.Saver().start(uri(tmp_path), two_rank_states(m)) as h:
        with pytest.raises(strata.ExistsError) as ei:
            h.wait_durable()
        assert h.done()
        code, msg = h.status()
        assert code == strata.ExistsError.code and msg == str(ei.value)
    assert h.closed
    with pytest.raises(strata.ExistsError):
        h.wait_durable()  # the outcome stays after close


def test_tiers_and_fallback(tmp_path, monkeypatch):
    m = matrix()
    tiers = [uri(tmp_path, "fast"), uri(tmp_path, "slow")]
    stats = strata.Saver().save(tiers, two_rank_states(m), step=5)
    assert all(strata.probe(t)["committed"] for t in tiers)
    out, stats = load_matrix(tiers)
    assert torch.equal(out, m) and stats["tier"] == 0
    # the fast tier missing, then corrupt: loads from the slow one
    out, stats = load_matrix([uri(tmp_path, "absent")] + tiers[1:])
    assert torch.equal(out, m) and stats["tier"] == 1
    corrupt_first_data_byte(tiers[0])
    out, stats = load_matrix(tiers)
    assert torch.equal(out, m) and stats["tier"] == 1
    # mem:// (shared memory, under $STRATA_MEM_ROOT: here a directory of the test's own) and
    # a directory; a tier that fails names itself, and the others are committed
    monkeypatch.setenv("STRATA_MEM_ROOT", str(tmp_path / "shm"))
    both = ["mem://run/a", uri(tmp_path, "disk")]
    strata.Saver().save(both, two_rank_states(m))
    assert os.path.exists(tmp_path / "shm" / "run" / "a" / "COMMIT")
    out, stats = load_matrix(both)
    assert torch.equal(out, m) and stats["tier"] == 0
    again = ["mem://run/b", both[0]]
    with pytest.raises(strata.ExistsError, match="shm/run/a"):
        strata.Saver().save(again, two_rank_states(m))
    assert strata.probe(again[0])["committed"]


# ---- errors ------------------------------------------------------------------------------


def data_files(where):
    return sorted(f for f in os.listdir(where) if f.startswith("data-"))


def corrupt_first_data_byte(where):
    path = os.path.join(where, data_files(where)[0])
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))


def test_checksum_error_names_tensor_and_file(tmp_path):
    m = matrix()
    s = strata.State()
    add(s, "layers.0.weight", m, (6, 4))
    strata.Saver().save(uri(tmp_path), [s])
    corrupt_first_data_byte(uri(tmp_path))
    out = torch.zeros(6, 4)
    d = strata.State()
    add(d, "layers.0.weight", out, (6, 4))
    with pytest.raises(strata.ChecksumError) as ei:
        strata.load(uri(tmp_path), [d])
    e = ei.value
    assert e.code == -6 and e.name == "STRATA_ECHECKSUM"
    assert "layers.0.weight" in str(e) and data_files(uri(tmp_path))[0] in str(e)
    with pytest.raises(strata.ChecksumError) as ei:
        strata.Checkpoint(uri(tmp_path)).verify()
    assert "layers.0.weight" in str(ei.value)
    assert len(ei.value.bad) == 1
    obj, file, msg = ei.value.bad[0]
    assert obj == "layers.0.weight" and file == data_files(uri(tmp_path))[0] and msg


def saved(tmp_path, name="ck"):
    strata.Saver().save(uri(tmp_path, name), two_rank_states(matrix()))
    return uri(tmp_path, name)


def test_not_found_mismatch_unfilled(tmp_path):
    where = saved(tmp_path)
    t = torch.zeros(6, 4)
    s = strata.State()
    add(s, "nope", t, (6, 4))
    with pytest.raises(strata.NotFoundError, match="nope"):
        strata.load(where, s)
    s = strata.State()
    add(s, "w", torch.zeros(4, 6), (4, 6))
    with pytest.raises(strata.MismatchError, match="'w'"):
        strata.load(where, s)
    s = strata.State()
    add(s, "w", torch.zeros(6, 4, dtype=torch.float64), (6, 4))
    with pytest.raises(strata.MismatchError, match="'w'"):
        strata.load(where, s)
    # a tensor saved in part only
    part = strata.State()
    add(part, "half", torch.ones(3, 4), (6, 4), (0, 0), (3, 4))
    strata.Saver().save(uri(tmp_path, "part"), [part])
    s = strata.State()
    add(s, "half", torch.zeros(6, 4), (6, 4))
    with pytest.raises(strata.UnfilledError, match="half"):
        strata.load(uri(tmp_path, "part"), s)
    # a blob of another size
    s = strata.State()
    new_blob(s, "config", 3)
    with pytest.raises(strata.MismatchError, match="config"):
        strata.load(where, s)


def test_incomplete_missing_scheme_exists_format(tmp_path):
    where = saved(tmp_path)
    with pytest.raises(strata.ExistsError, match="committed"):
        saved(tmp_path)
    os.unlink(os.path.join(where, "COMMIT"))
    with pytest.raises(strata.IncompleteError, match="incomplete"):
        load_matrix(where)
    with pytest.raises(strata.IncompleteError):
        strata.Checkpoint(where)
    ck = strata.Checkpoint(where, incomplete=True)
    assert not ck.committed
    with pytest.raises(strata.MissingError):
        load_matrix(uri(tmp_path, "absent"))
    with pytest.raises(strata.MissingError):
        strata.Checkpoint(uri(tmp_path, "absent"))
    with pytest.raises(strata.SchemeError, match="s3"):
        load_matrix("gs://bucket/ck")
    with pytest.raises(strata.SchemeError, match="s3"):
        strata.Saver().save("gs://bucket/ck", two_rank_states(matrix()))
    strata.remove_incomplete(where)
    assert not os.path.exists(os.path.join(where, "metadata.bin"))
    # metadata that is not metadata, under a valid commit record
    other = saved(tmp_path, "fmt")
    with open(os.path.join(other, "metadata.bin"), "r+b") as f:
        f.seek(0)
        f.write(b"garbage!")
    with pytest.raises((strata.FormatError, strata.IncompleteError)):
        strata.Checkpoint(other)


def test_replica_marks_the_copies_that_are_not_main(tmp_path):
    """replica=True (STRATA_SHARD_REPLICA): three logical ranks hold b whole - rank 0 the main
    copy, rank 1 a marked identical copy (one more holder: saved once) - and rank 2 a flat
    piece of it cut elsewhere, marked (saved by no one: the main copy holds it whole).
    Unmarked, that piece overlaps the main copy; a marked piece with no main copy of its
    tensor leaves it unfilled."""
    b = torch.arange(9, dtype=torch.float32)
    states = [strata.State() for _ in range(3)]
    for r, st in enumerate(states):
        t, flat = (b[:5].clone(), (0, 5)) if r == 2 else (b.clone(), None)
        st.add_shard("b", "f32", (9,), data_ptr=t.data_ptr(), nbytes=nbytes(t), flat=flat,
                     keep=t, replica=r > 0)
    stats = strata.Saver().save(uri(tmp_path), states, sync=False)
    assert stats["data_bytes"] == 9 * 4
    out = torch.zeros(9)
    s = strata.State()
    add(s, "b", out, (9,))
    strata.load([uri(tmp_path)], [s])
    assert torch.equal(out, b)
    a, c = strata.State(), strata.State()
    add(a, "b", b.clone(), (9,))
    add(c, "b", b[:5].clone(), (9,), flat=(0, 5))
    with pytest.raises(strata.OverlapError, match="'b'"):
        strata.Saver().save(uri(tmp_path, "unmarked"), [a, c])
    c = strata.State()
    t = b[:5].clone()
    c.add_shard("b", "f32", (9,), data_ptr=t.data_ptr(), nbytes=nbytes(t), flat=(0, 5), keep=t,
                replica=True)
    with pytest.raises(strata.UnfilledError, match="'b'"):
        strata.Saver().save(uri(tmp_path, "no-main"), [strata.State(), c])


def test_overlap_and_layout_errors(tmp_path):
    a, b = strata.State(), strata.State()
    add(a, "w", torch.zeros(4, 4), (6, 4), (0, 0), (4, 4))
    add(b, "w", torch.ones(4, 4), (6, 4), (2, 0), (4, 4))
    with pytest.raises(strata.OverlapError, match="'w'"):
        strata.Saver().save(uri(tmp_path), [a, b])
    a, b = strata.State(), strata.State()
    add(a, "w", torch.zeros(6, 4), (6, 4))
    add(b, "w", torch.zeros(6, 4, dtype=torch.float64), (6, 4))
    with pytest.raises(strata.MismatchError, match="'w'"):
        strata.Saver().save(uri(tmp_path), [a, b])
    with pytest.raises(strata.InvalidArgumentError, match="at least one"):
        strata.Saver().save(uri(tmp_path), [])
    with pytest.raises(TypeError):
        strata.Saver().save(uri(tmp_path), [object()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")
def test_device_error_without_cuda():
    s = strata.State()
    t = torch.zeros(4)
    with pytest.raises(strata.DeviceError, match="'d'"):
        s.add_shard("d", "f32", (4,), data_ptr=t.data_ptr(), nbytes=16, device=True)


def test_busy_while_another_process_holds_the_lock(tmp_path):
    where = uri(tmp_path)
    os.makedirs(where)
    open(os.path.join(where, "data-000000.bin"), "wb").close()  # something of strata's
    fd = os.open(os.path.join(where, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # a POSIX record lock, as another process's save would hold its OFD lock (the two
        # kinds conflict even within one process). strata closing its own descriptor of
        # LOCK drops this process's POSIX locks on it, so it is taken again before each try.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(strata.BusyError) as ei:
            strata.Saver().save(where, two_rank_states(matrix()))
        assert ei.value.code == -17 and ei.value.name == "STRATA_EBUSY"
        assert where in str(ei.value) and "LOCK" in str(ei.value)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(strata.BusyError):
            strata.remove_incomplete(where)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(strata.BusyError):
            strata.Saver().start(where, two_rank_states(matrix())).wait_durable()
    finally:
        os.close(fd)
    strata.Saver().save(where, two_rank_states(matrix()))  # free now
    assert strata.probe(where)["committed"]


# ---- a host Comm over threads --------------------------------------------------------------


class ThreadGroup:
    """Collectives between `size` threads of this process: each exchange is a write into
    shared slots, a barrier, reads, a barrier. abort() breaks the barrier for every rank."""

    def __init__(self, size, fail=None):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots = [None] * size
        self.calls = [0] * size
        self.fail = fail  # (rank, call index) whose callback raises

    def _maybe_fail(self, rank):
        self.calls[rank] += 1
        if self.fail and self.fail == (rank, self.calls[rank]):
            self.barrier.abort()
            raise RuntimeError("rank %d gives up on purpose" % rank)

    def comm(self, rank):
        size = self.size

        def allgather(send, recv):
            assert send.readonly and not recv.readonly and len(recv) == size * len(send)
            self._maybe_fail(rank)
            self.slots[rank] = bytes(send)
            self.barrier.wait()
            n = len(send)
            for r in range(size):
                recv[r * n:(r + 1) * n] = self.slots[r]
            self.barrier.wait()

        def alltoallv(send, scounts, recv, rcounts):
            assert len(scounts) == len(rcounts) == size
            assert len(send) == sum(scounts) and len(recv) == sum(rcounts)
            self._maybe_fail(rank)
            pieces, o = [], 0
            for c in scounts:
                pieces.append(bytes(send[o:o + c]))
                o += c
            self.slots[rank] = pieces
            self.barrier.wait()
            o = 0
            for s in range(size):
                piece = self.slots[s][rank]
                assert len(piece) == rcounts[s]
                recv[o:o + len(piece)] = piece
                o += len(piece)
            self.barrier.wait()

        def bcast(buf, root):
            self._maybe_fail(rank)
            if rank == root:
                self.slots[root] = bytes(buf)
            self.barrier.wait()
            if rank != root:
                buf[:] = self.slots[root]
            self.barrier.wait()

        return strata.Comm.host(rank, size, allgather, alltoallv, bcast)


def on_threads(size, fn, timeout=120):
    """Runs fn(rank) on `size` threads; returns their results or raises the first error."""
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread hangs"
    return results, errors


def row_block(m, rank, size):
    rows = m.shape[0]
    lo, hi = rows * rank // size, rows * (rank + 1) // size
    return lo, hi


def test_host_comm_threads_save_and_load(tmp_path):
    m = matrix(12, 5, torch.float64)
    sync_dir, async_dir = uri(tmp_path, "sync"), uri(tmp_path, "async")
    group = ThreadGroup(3)

    def rank_fn(rank):
        comm = group.comm(rank)
        assert (comm.rank, comm.size) == (rank, 3)
        lo, hi = row_block(m, rank, 3)
        s = strata.State()
        add(s, "w", m[lo:hi].contiguous(), (12, 5), (lo, 0), (hi - lo, 5))
        add(s, "replicated", torch.arange(10, dtype=torch.int32), (10,))
        add_blob(s, "rank", b"r%d" % rank, rank_local=True)
        saver = strata.Saver(comm)
        st1 = saver.save(sync_dir, [s], step=1, sync=False)
        h = saver.start([async_dir], [s], step=2, sync=False)
        h.wait_snapshot()
        st2 = h.wait_durable()
        h.close()
        # a handle only dropped: its dealloc runs the commit's collective on every rank
        h = saver.start([uri(tmp_path, "dropped")], [s], step=3, sync=False)
        del h
        # load as 2 column blocks on ranks 0 and 1, nothing for "w" on rank 2
        got = {}
        d = strata.State()
        if rank < 2:
            got["w"] = torch.zeros(12, 3 if rank == 0 else 2, dtype=torch.float64)
            add(d, "w", got["w"], (12, 5), (0, 3 * rank), tuple(got["w"].shape))
        got["replicated"] = torch.zeros(10, dtype=torch.int32)
        add(d, "replicated", got["replicated"], (10,))
        got["rank"] = new_blob(d, "rank", 2, owner=(rank + 1) % 3)
        st3 = strata.load([async_dir], [d], comm)
        return st1, st2, st3, got

    results, errors = on_threads(3, rank_fn)
    assert errors == [None] * 3, errors
    for rank, (st1, st2, st3, got) in enumerate(results):
        assert st1["data_bytes"] == st2["data_bytes"] == st3["data_bytes"]
        assert st1["all_bytes"] == st1["data_bytes"]
        assert st3["tier"] == 0
        if rank < 2:
            cols = slice(0, 3) if rank == 0 else slice(3, 5)
            assert torch.equal(got["w"], m[:, cols])
        assert torch.equal(got["replicated"], torch.arange(10, dtype=torch.int32))
        assert bytes(got["rank"].tolist()) == b"r%d" % ((rank + 1) % 3)
    ck = strata.Checkpoint(async_dir)
    assert ck.step == 2 and ck.committed
    assert strata.Checkpoint(uri(tmp_path, "dropped")).step == 3
    assert sorted(b["owner"] for b in ck.blobs) == [0, 1, 2]


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_host_comm_callback_raises_everywhere(tmp_path, failing_call):
    group = ThreadGroup(3, fail=(1, failing_call))
    m = matrix(12, 5)

    def rank_fn(rank):
        comm = group.comm(rank)
        lo, hi = row_block(m, rank, 3)
        s = strata.State()
        add(s, "w", m[lo:hi].contiguous(), (12, 5), (lo, 0), (hi - lo, 5))
        strata.Saver(comm).save(uri(tmp_path), [s], sync=False)

    _, errors = on_threads(3, rank_fn)
    assert all(isinstance(e, strata.AbortedError) for e in errors), errors
    assert "gives up on purpose" in str(errors[1])
    assert isinstance(errors[1].__cause__, RuntimeError)
    assert isinstance(errors[0].__cause__, threading.BrokenBarrierError)
    assert not os.path.exists(uri(tmp_path)) or not strata.probe(uri(tmp_path))["committed"]


def test_host_comm_agree():
    """Comm.agree (strata_comm_agree): every rank's payload on every rank, in one
    collective when all fit inline or are the same; a failing rank's error on every rank,
    its code and text, naming it; a callback that raises is AbortedError with its cause."""
    def agree(size, fn, fail=None):
        group = ThreadGroup(size, fail=fail)
        results, errors = on_threads(size, lambda r: fn(r, group.comm(r)))
        return results, errors, group.calls

    pay = [b"a", b"bb", b"ccc"]
    res, err, calls = agree(3, lambda r, c: c.agree(pay[r], what="the step", inline=8))
    assert err == [None] * 3 and res == [pay] * 3 and calls == [1, 1, 1]
    res, err, calls = agree(3, lambda r, c: c.agree(pay[r], inline=2))
    assert err == [None] * 3 and res == [pay] * 3 and calls == [2, 2, 2]
    res, err, calls = agree(3, lambda r, c: c.agree(b"x" * 5000, same=True))
    assert err == [None] * 3 and res == [None] * 3 and calls == [1, 1, 1]
    res, err, calls = agree(3, lambda r, c: c.agree(pay[r], same=True))
    assert err == [None] * 3 and res == [pay] * 3 and calls == [2, 2, 2]
    res, err, calls = agree(2, lambda r, c: c.agree())
    assert err == [None] * 2 and res == [[b"", b""]] * 2

    mine = [None, strata.MismatchError("boom"), ValueError("not a strata error")]
    for inline in (0, 64):
        res, err, calls = agree(3, lambda r, c: c.agree(pay[r], what="the step", error=mine[r],
                                                        inline=inline, same=True))
        assert calls == [1 if inline else 2] * 3
        assert type(err[0]) is strata.MismatchError
        assert str(err[0]) == "the step failed on rank 1: boom"
        assert type(err[1]) is strata.MismatchError and str(err[1]) == "boom"
        assert type(err[2]) is strata.InvalidArgumentError
        assert str(err[2]) == "not a strata error"
    res, err, _ = agree(3, lambda r, c: c.agree(b"x"), fail=(2, 1))
    assert all(isinstance(e, strata.AbortedError) for e in err), err
    assert isinstance(err[2].__cause__, RuntimeError)
    with pytest.raises(TypeError, match="exception"):
        strata.Comm.self().agree(error="no")
    assert strata.Comm.self().agree(b"solo") == [b"solo"]


def test_host_comm_rejects_bad_arguments():
    f = lambda *a: None  # noqa: E731
    with pytest.raises(strata.InvalidArgumentError, match="rank 3 of 3"):
        strata.Comm.host(3, 3, f, f, f)
    with pytest.raises(TypeError, match="callable"):
        strata.Comm.host(0, 1, f, None, f)
    c = strata.Comm.self()
    assert (c.rank, c.size) == (0, 1)
    c.set_timeout(1000)
    assert c.timeout == 1000


def test_comm_released_with_its_callables():
    class Owner:
        def __init__(self):
            self.comm = strata.Comm.host(0, 1, self.ag, self.a2a, self.bc)

        def ag(self, send, recv):
            recv[:] = send

        def a2a(self, send, sc, recv, rc):
            recv[:] = send

        def bc(self, buf, root):
            pass

    o = Owner()
    saver = strata.Saver(o.comm)
    o.saver = saver  # a cycle: owner -> saver -> comm -> bound methods -> owner
    ref = weakref.ref(o)
    del o, saver
    gc.collect()
    assert ref() is None


# ---- GIL -------------------------------------------------------------------------------------


def test_gil_is_released_during_a_long_save(tmp_path):
    big = torch.arange(48 << 20, dtype=torch.uint8)  # 48 MiB
    s = strata.State()
    add(s, "big", big, (big.numel(),))
    stamps = []
    stop = threading.Event()

    def spin():  # notes the time now and then, as long as it gets the GIL
        i = 0
        while not stop.is_set():
            i += 1
            if i % 64 == 0:
                stamps.append(time.perf_counter())

    def ran_inside(t0, t1):
        """Stamps in the middle half of [t0, t1]: the other thread ran during the call."""
        lo, hi = t0 + (t1 - t0) / 4, t1 - (t1 - t0) / 4
        return sum(lo < t < hi for t in stamps)

    t = threading.Thread(target=spin)
    t.start()
    try:
        while not stamps:
            time.sleep(0.001)
        t0 = time.perf_counter()
        strata.Saver().save(uri(tmp_path), [s], sync=True, direct=False)
        t1 = time.perf_counter()
        h = strata.hash_bytes(big.data_ptr(), nbytes(big))
        out = torch.zeros_like(big)
        d = strata.State()
        add(d, "big", out, (big.numel(),))
        t2 = time.perf_counter()
        strata.load(uri(tmp_path), [d])
        t3 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert ran_inside(t0, t1) > 10, "no Python thread ran during the save (%.3f s)" % (t1 - t0)
    assert ran_inside(t2, t3) > 10, "no Python thread ran during the load (%.3f s)" % (t3 - t2)
    assert strata.hash_bytes(out.data_ptr(), nbytes(out)) == h


# ---- describing, probing, retention, hashing -------------------------------------------------


def test_checkpoint_metadata(tmp_path):
    m = matrix()
    states = two_rank_states(m)
    flat = strata.State()  # a flat piece of another tensor
    add(flat, "f", torch.arange(5, dtype=torch.int64), (4, 3), flat=(2, 7))
    strata.Saver().save(uri(tmp_path), states + [flat], step=42, chunk_bytes=8192)
    ck = strata.Checkpoint(uri(tmp_path))
    assert (ck.step, ck.committed, ck.chunk_bytes) == (42, True, 8192)
    assert ck.data_bytes == 96 + 6 + 10 + 40
    tensors = {t["name"]: t for t in ck.tensors}
    w = tensors["w"]
    assert (w["dtype"], w["shape"], w["bytes"]) == ("f32", (6, 4), 96)
    boxes = sorted((s["offsets"], s["lengths"], s["flat"]) for s in w["shards"])
    assert boxes == [((0, 0), (3, 4), None), ((3, 0), (3, 4), None)]
    for s in w["shards"]:
        assert s["file"].startswith("data-") and s["bytes"] == 48 and s["file_offset"] % 4096 == 0
    assert tensors["f"]["shards"][0]["flat"] == (2, 7)
    assert tensors["f"]["dtype"] == "i64"
    blobs = sorted((b["name"], b["owner"], b["bytes"]) for b in ck.blobs)
    assert blobs == [("config", -1, 6), ("rng", 0, 5), ("rng", 1, 5)]
    assert sum(f["bytes"] for f in ck.files) >= ck.data_bytes
    ck.verify()
    assert "step 42" in repr(ck)


def test_probe_and_retain(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    for step in (1, 2, 3, 4):
        strata.Saver().save(str(root / ("step-%d" % step)), two_rank_states(matrix()), step=step)
        time.sleep(0.01)  # distinct commit times
    p = strata.probe(str(root / "step-3"))
    assert p["is_ckpt"] and p["has_commit"] and p["committed"] and p["has_metadata"]
    assert p["step"] == 3 and p["disk_bytes"] > 0
    (root / "empty").mkdir()
    assert strata.probe(str(root / "empty"))["is_ckpt"] is False
    with pytest.raises(strata.MissingError):
        strata.probe(str(root / "nothing"))
    os.unlink(str(root / "step-4" / "COMMIT"))  # incomplete: removed by retain
    p = strata.probe(str(root / "step-4"))
    assert p["is_ckpt"] and not p["has_commit"] and not p["committed"]
    assert strata.retain(str(root), 2) == 2  # step-1 and the incomplete step-4
    left = sorted(os.listdir(root))
    assert left == ["empty", "step-2", "step-3"]
    assert strata.retain(str(root), 2) == 0
    with pytest.raises(strata.InvalidArgumentError):
        strata.retain(str(root), -1)


def test_hash_bytes():
    a = torch.arange(1000, dtype=torch.int32)
    b = a.clone()
    assert strata.hash_bytes(a.data_ptr(), nbytes(a)) == strata.hash_bytes(b.data_ptr(), nbytes(b))
    b[500] += 1
    assert strata.hash_bytes(a.data_ptr(), nbytes(a)) != strata.hash_bytes(b.data_ptr(), nbytes(b))
    assert strata.hash_bytes(0, 0) == 0x2D06800538D394C2  # XXH3-64 of no bytes


def test_host_comm_dup_commits_on_a_thread_of_the_saver(tmp_path):
    """Comm.host(dup=...): at a Saver's first start() strata asks for the callables of a
    second channel, and the Saver's commit thread (not this one) calls them: done() turns
    True and the checkpoint is committed with no wait_durable. Without dup, or when dup
    raises, the commit stays in wait_durable and Saver.background says why."""
    import threading
    import time
    threads = []

    def ops(tag):
        def allgather(send, recv):
            threads.append((tag, threading.get_ident()))
            recv[:] = send

        def alltoallv(send, scounts, recv, rcounts):
            recv[:rcounts[0]] = send[:scounts[0]]

        def bcast(buf, root):
            pass
        return allgather, alltoallv, bcast

    def bad_dup():
        raise RuntimeError("no second group here")

    cases = [(lambda: ops("bg"), True, ""), (None, False, "no dup callable"),
             (bad_dup, False, "RuntimeError: no second group here")]
    for i, (dup, bg, why) in enumerate(cases):
        del threads[:]
        comm = strata.Comm.host(0, 1, *ops("fg"), dup=dup)
        saver = strata.Saver(comm)
        assert saver.background == (None, "no asynchronous save yet")
        s = strata.State()
        add(s, "w", matrix(), (6, 4))
        path = uri(tmp_path, "ck%d" % i)
        h = saver.start([path], [s], step=1, sync=False)
        h.wait_snapshot()
        got, reason = saver.background
        assert got is bg and why in reason, (got, reason)
        t0 = time.monotonic()
        while bg and not h.done() and time.monotonic() - t0 < 30:
            time.sleep(0.001)
        assert strata.probe(path)["committed"] is bg   # before any wait_durable
        h.wait_durable()
        h.close()
        assert strata.probe(path)["committed"]
        main = threading.get_ident()
        commit_threads = {t for tag, t in threads if tag == "bg"}
        assert bool(commit_threads) is bg and main not in commit_threads
