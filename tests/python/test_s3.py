"""strata.torch on s3:// against moto's S3 server, started on 127.0.0.1 by the fixture (moto's
ThreadedMotoServer, stopped at the end): save / load round trips in one process and with 2
gloo ranks (resharded: saved by 2, loaded by 1), the CheckpointManager with tiers
[mem://, a disk directory, s3://] restoring from the fastest tier that holds the step (and
from S3 once the faster copies are gone), latest() listing an S3 tier, retention on S3.
Skipped without moto (make venv installs it) or a libstrata built without libcurl."""

import os
import shutil
import socket

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
