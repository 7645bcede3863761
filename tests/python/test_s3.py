"""strata.torch on s3:// against moto's S3 server, started on 127.0.0.1 by the fixture (moto's
ThreadedMotoServer, stopped at the end): save / load round trips in one process and with 2
gloo ranks (resharded: saved by 2, loaded by 1), the CheckpointManager with tiers
[mem://, a disk directory, s3://] restoring from the fastest tier that holds the step (and
from S3 once the faster copies are gone), latest() listing an S3 tier, retention on S3.
Skipped without moto (make venv installs it) or a libstrata built without libcurl."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import strata
import strata.torch as st

import _dist

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "strata-py"


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The endpoint (AWS_* set for this process and the ranks it forks), a bucket made."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:%d" % port, "AWS_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "strata-py", "AWS_SECRET_ACCESS_KEY": "strata-py-secret"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                              region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        try:
            strata.probe("s3://%s/probe" % BUCKET)
        except strata.Error as e:
            if "without libcurl" in str(e):
                pytest.skip("libstrata built without libcurl")
        yield client
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def keys_under(client, prefix):
    out = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for o in out.get("Contents", []))


def test_save_load_one_process(s3):
    torch.manual_seed(0)
    state = {"w": torch.randn(700, 3001), "b": torch.arange(10, dtype=torch.int64),
             "h": torch.randn(33, 7).to(torch.bfloat16)}
    uri = "s3://%s/one/step-1" % BUCKET
    st.save(state, uri)
    assert keys_under(s3, "one/step-1/") == ["COMMIT", "data-000000.bin", "metadata.bin"]
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    st.load(back, uri)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    with pytest.raises(strata.ExistsError):
        st.save(state, uri)      # committed: never written again


def dist_save(uri, env):
    os.environ.update(env)   # the ranks fork from a server started before the fixture
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)
    st.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, uri)
    return dist.get_rank()


@pytest.mark.slow
def test_two_ranks_save_one_loads(s3):
    uri = "s3://%s/dist/step-1" % BUCKET
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    assert _dist.run(dist_save, 2, uri, env, timeout=120) == [0, 1]
    back = {"w": torch.zeros(1000, 64)}
    st.load(back, uri)   # resharded: both ranks' rows, into one process
    assert torch.equal(back["w"], torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64))


def test_manager_tiers_mem_disk_s3(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_MEM_ROOT", str(tmp_path / "shm"))
    tiers = ["mem://run", str(tmp_path / "disk"), "s3://%s/mgr" % BUCKET]
    with st.CheckpointManager(tiers, keep=2, pool_bytes=8 << 20) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1000,), float(step))}).wait_snapshot()
    # every tier committed each step; retention kept the 2 newest on each, S3 included
    assert keys_under(s3, "mgr/") == sorted(
        "step-%08d/%s" % (s, f) for s in (2, 3)
        for f in ("COMMIT", "data-000000.bin", "metadata.bin"))
    mgr = st.CheckpointManager(tiers)
    assert mgr.latest() == 3
    back = {"w": torch.zeros(1000)}
    assert mgr.load(back) == 3 and torch.equal(back["w"], torch.full((1000,), 3.0))
    # the node is gone: the memory and disk copies with it; S3 alone holds the steps
    shutil.rmtree(tmp_path / "shm")
    shutil.rmtree(tmp_path / "disk")
    mgr = st.CheckpointManager(tiers)
    assert mgr.latest() == 3     # listed on S3
    back = {"w": torch.zeros(1000)}
    assert mgr.load(back, step=2) == 2 and torch.equal(back["w"], torch.full((1000,), 2.0))
    assert strata.list_dirs("s3://%s/mgr" % BUCKET) == ["step-00000002", "step-00000003"]


def test_manager_flushes_s3_in_background(s3, tmp_path, monkeypatch):
    """The save writes the faster tiers only; the S3 copy is made afterwards by the
    manager's flusher (held back here until released), retention keeps on the faster tiers
    what is still unflushed, wait_durable() waits for the flushes, and after the node is
    gone S3 alone restores bitwise."""
    monkeypatch.setenv("STRATA_MEM_ROOT", str(tmp_path / "shm"))
    from strata import _flush
    gate, copied, real_copy = threading.Event(), [], strata.copy

    def held_copy(src, dst):
        assert gate.wait(60)
        copied.append((src, dst))
        return real_copy(src, dst)
    monkeypatch.setattr(_flush._S, "copy", held_copy)
    tiers = ["mem://bg", str(tmp_path / "disk"), "s3://%s/bg" % BUCKET]
    states = {s: {"w": torch.randn(300, 301), "n": torch.arange(s, s + 50)} for s in (1, 2, 3)}
    mgr = st.CheckpointManager(tiers, keep=1, pool_bytes=8 << 20)
    for s in (1, 2, 3):
        mgr.save(s, states[s]).wait()
    # committed on memory and disk, nothing on S3 yet; keep=1, but the three steps wait
    # to be flushed, so retention left them on the faster tiers
    assert keys_under(s3, "bg/") == []
    for t in tiers[:2]:
        assert strata.list_dirs(t) == ["step-%08d" % s for s in (1, 2, 3)]
        for s in (1, 2, 3):
            assert strata.probe(t + "/step-%08d" % s)["committed"]
    back = {"w": torch.zeros(300, 301), "n": torch.zeros(50, dtype=torch.int64)}
    assert mgr.load(back, step=2) == 2 and torch.equal(back["w"], states[2]["w"])
    gate.set()
    mgr.wait_durable()
    # copied from the fastest tier, in order; retention then kept 1 on every tier
    assert copied == [("mem://bg/step-%08d" % s, "s3://%s/bg/step-%08d" % (BUCKET, s))
                      for s in (1, 2, 3)]
    assert keys_under(s3, "bg/") == ["step-00000003/" + f
                                     for f in ("COMMIT", "data-000000.bin", "metadata.bin")]
    for t in tiers[:2]:
        assert strata.list_dirs(t) == ["step-00000003"]
    mgr.close()
    shutil.rmtree(tmp_path / "shm")
    shutil.rmtree(tmp_path / "disk")
    mgr = st.CheckpointManager(tiers)
    assert mgr.latest() == 3
    back = {"w": torch.zeros(300, 301), "n": torch.zeros(50, dtype=torch.int64)}
    assert mgr.load(back) == 3
    assert torch.equal(back["w"], states[3]["w"]) and torch.equal(back["n"], states[3]["n"])
    mgr.close()


def test_manager_flush_error_raised_by_wait_durable(s3, tmp_path):
    """A flush that fails (the S3 tier already holds that step committed) is raised by
    wait_durable() naming the step and the tier; the save itself stood."""
    st.save({"w": torch.ones(10)}, "s3://%s/bgerr/step-00000005" % BUCKET)
    mgr = st.CheckpointManager([str(tmp_path / "disk"), "s3://%s/bgerr" % BUCKET], keep=2)
    mgr.save(5, {"w": torch.zeros(10)}).wait()
    assert strata.probe(str(tmp_path / "disk" / "step-00000005"))["committed"]
    with pytest.raises(strata.ExistsError, match="flushing step 5 to s3://strata-py/bgerr"):
        mgr.wait_durable()
    mgr.close()


def test_copy_verifies_checksums_and_commits_last(s3, tmp_path):
    """strata.copy to S3: bitwise the same checkpoint; a corrupt source byte is a
    ChecksumError naming the tensor, and leaves no object (nor upload) at the destination."""
    src = str(tmp_path / "src")
    w = torch.randn(4000, 1000)   # 16 MB: several 5 MiB parts
    st.save({"w": w, "b": torch.arange(7)}, src)
    dst = "s3://%s/copy/ok" % BUCKET
    stats = strata.copy(src, dst)
    assert stats["bytes"] == os.path.getsize(os.path.join(src, "data-000000.bin"))
    back = {"w": torch.zeros(4000, 1000), "b": torch.zeros(7, dtype=torch.int64)}
    st.load(back, dst)
    assert torch.equal(back["w"], w) and torch.equal(back["b"], torch.arange(7))
    with pytest.raises(strata.ExistsError):
        strata.copy(src, dst)
    data = os.path.join(src, "data-000000.bin")
    with open(data, "r+b") as f:   # one byte of w, deep in the file
        f.seek(9 << 20)
        b = f.read(1)
        f.seek(9 << 20)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(strata.ChecksumError, match="'w'"):
        strata.copy(src, "s3://%s/copy/bad" % BUCKET)
    assert keys_under(s3, "copy/bad/") == []
    ups = s3.list_multipart_uploads(Bucket=BUCKET, Prefix="copy/bad/")
    assert not ups.get("Uploads")


def test_killed_flush_leaves_nothing_committed(s3, tmp_path, monkeypatch):
    """A process killed while copying to S3 leaves no commit record there; gc (retain)
    removes what it wrote and aborts its multipart uploads once its lease has expired."""
    src = str(tmp_path / "src")
    st.save({"w": torch.randn(12000, 1000)}, src)    # 48 MB
    dst = "s3://%s/killed/step-00000001" % BUCKET
    env = dict(os.environ, STRATA_S3_PART_MB="5", STRATA_S3_LEASE_S="1")
    p = subprocess.Popen([sys.executable, "-c", "import strata, sys; "
                          "strata.copy(sys.argv[1], sys.argv[2])", src, dst], env=env)
    try:
        for _ in range(600):
            if s3.list_multipart_uploads(Bucket=BUCKET, Prefix="killed/").get("Uploads"):
                break
            if p.poll() is not None:
                pytest.fail("the copy ended before an upload was seen")
            time.sleep(0.01)
        else:
            pytest.fail("no multipart upload seen")
    finally:
        p.kill()
        p.wait()
    assert "step-00000001/COMMIT" not in keys_under(s3, "killed/")
    assert not strata.probe(dst)["committed"]
    time.sleep(2.5)    # the dead copy's lease runs out
    monkeypatch.setenv("STRATA_S3_LEASE_S", "1")
    strata.retain("s3://%s/killed" % BUCKET, 1)
    assert keys_under(s3, "killed/") == []
    assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix="killed/").get("Uploads")


def test_replace_refused_on_s3(s3):
    """replace=True needs an atomic swap of two prefixes, which S3 has not: refused before
    anything is written, with a message saying so and what to do instead."""
    with pytest.raises(strata.UnsupportedError, match="object storage has no atomic rename"):
        st.save({"w": torch.ones(10)}, "s3://%s/repl/latest" % BUCKET, replace=True)
    assert keys_under(s3, "repl/") == []


@pytest.mark.parametrize("copy_max_mb", [None, 5])
def test_incremental_save_on_s3(s3, monkeypatch, copy_max_mb):
    """An incremental save to s3:// names its base: the base's data file is copied by the
    server (CopyObject; UploadPartCopy in 5 MiB parts when $STRATA_S3_COPY_MAX_MB is below
    its size) instead of uploaded, and the new checkpoint stands alone once the base is
    gone."""
    if copy_max_mb:
        monkeypatch.setenv("STRATA_S3_COPY_MAX_MB", str(copy_max_mb))
        monkeypatch.setenv("STRATA_S3_PART_MB", "5")
    root = "incr-%s" % copy_max_mb
    frozen = torch.randn(3000, 1000)           # 12 MB, unchanged between the saves
    st.save({"f": frozen, "m": torch.zeros(100)}, "s3://%s/%s/step-1" % (BUCKET, root),
            incremental=True)
    stats = st.save({"f": frozen, "m": torch.ones(100)}, "s3://%s/%s/step-2" % (BUCKET, root),
                    base="step-1", incremental=True)
    assert stats["bytes"] < 1 << 20            # only m was uploaded
    ck = strata.Checkpoint("s3://%s/%s/step-2" % (BUCKET, root))
    assert ck.base == "step-1"
    names = keys_under(s3, root + "/step-2/")
    assert any(n.startswith("ref-") for n in names), names
    strata.retain("s3://%s/%s" % (BUCKET, root), 1)   # the base goes
    assert keys_under(s3, root + "/step-1/") == []
    back = {"f": torch.zeros(3000, 1000), "m": torch.zeros(100)}
    st.load(back, "s3://%s/%s/step-2" % (BUCKET, root))
    assert torch.equal(back["f"], frozen) and torch.equal(back["m"], torch.ones(100))
    strata.Checkpoint("s3://%s/%s/step-2" % (BUCKET, root)).verify()


def test_manager_sync_saves_flush_too(s3, tmp_path):
    """async_save=False: each save returns once the disk tier committed; the S3 copies
    follow in the background, and wait_durable() waits for them."""
    tiers = [str(tmp_path / "disk"), "s3://%s/bgsync" % BUCKET]
    with st.CheckpointManager(tiers, keep=2, async_save=False) as mgr:
        for s in (1, 2, 3):
            assert mgr.save(s, {"w": torch.full((100,), float(s))})["bytes"] > 0
        mgr.wait_durable()
        assert strata.list_dirs(tiers[1]) == ["step-00000002", "step-00000003"]
        assert strata.list_dirs(tiers[0]) == ["step-00000002", "step-00000003"]
    back = {"w": torch.zeros(100)}
    st.load(back, tiers[1] + "/step-00000003")
    assert torch.equal(back["w"], torch.full((100,), 3.0))
