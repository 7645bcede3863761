"""Peer-memory replicas through CheckpointManager(peer_replicas=R) on gloo: ranks grouped
into simulated nodes (STRATA_LOAD_NODES), each node's memory tier a directory of its own
(STRATA_MEM_ROOT per node). 4 nodes x 2 ranks save steps 1-3; the ranks of node 2 are
SIGKILLed while step 3 replicates; node 2's memory is gone; the job restarts on the 3
surviving nodes with another layout (3 x 2 and 2 x 3 ranks) and loads the newest step the
survivors rebuild (2: step 3's replication never committed), bitwise."""

import json
import os
import shutil

import pytest
import torch

import strata
import strata.torch as st

import _dist

SHAPE = (77, 5)


def full(step):
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + step


def as_node(root, dirs):
    """This rank's node (consecutive groups of ranks) and its memory root."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    node = dirs[rank * len(dirs) // world]
    mem = os.path.join(root, "node%d" % node)
    os.makedirs(mem, mode=0o700, exist_ok=True)
    os.environ["STRATA_MEM_ROOT"] = mem
    os.environ["STRATA_LOAD_NODES"] = str(len(dirs))
    return rank


def save_job(root, kill_step, kill_ranks):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    rank = as_node(root, [0, 1, 2, 3])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mgr = st.CheckpointManager(["mem://run"], keep=3, pool_bytes=8 << 20, peer_replicas=1)
    out = {}
    for step in (1, 2, 3):
        if step == kill_step:   # the ranks of one node die while step 3 replicates
            os.environ["STRATA_PEER_FAULT"] = "kill:" + ",".join(map(str, kill_ranks))
        h = mgr.save(step, {"w": distribute_tensor(full(step), mesh, [Shard(0)]),
                            "step": step})
        h.wait_snapshot()
        h.wait()
        out[step] = h.level()
        with open(os.path.join(root, "levels-%d.json" % rank), "w") as f:
            json.dump(out, f)
    os._exit(0)   # no teardown of a process group with dead members


def restore_job(root, dirs):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    as_node(root, dirs)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mgr = st.CheckpointManager(["mem://run"], keep=3, pool_bytes=8 << 20, peer_replicas=1)
    sd = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)]), "step": 0}
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = mgr.load(sd)
    ok = torch.equal(sd["w"].full_tensor(), full(got))
    mgr.close()
    return got, sd["step"], ok, [str(w.message) for w in caught]


@pytest.mark.slow
def test_peer_kill_node_restore_other_layout(tmp_path):
    root = str(tmp_path)
    try:
        _dist.run(save_job, 8, root, 3, [4, 5], timeout=180)
        raise AssertionError("ranks 4 and 5 were to be killed")
    except _dist.RankFailure as e:
        assert "rank 4" in str(e), str(e)[-2000:]
    levels = {r: json.load(open(os.path.join(root, "levels-%d.json" % r)))
              for r in range(8)}
    both = strata.LEVEL_LOCAL | strata.LEVEL_REPLICATED
    for r in range(8):   # steps 1 and 2 replicated on every rank, in memory only
        assert levels[r]["1"][0] == both and levels[r]["2"][0] == both, (r, levels[r])
    for r in (0, 1, 2, 3, 6, 7):   # step 3: committed, its replication failed
        assert levels[r].get("3", [strata.LEVEL_LOCAL])[0] & strata.LEVEL_REPLICATED == 0
    shutil.rmtree(os.path.join(root, "node2"))   # node 2 is lost, its memory with it
    for dirs, world in (([0, 1, 3], 6), ([1, 3], 6)):
        res = _dist.run(restore_job, world, root, dirs, timeout=180)
        for rank, (got, step, ok, warned) in enumerate(res):
            assert got == 2 and step == 2, (rank, got, step, warned)
            assert ok, "rank %d: the restored tensor differs" % rank
            assert any("step-00000003" in w for w in warned), warned


def parity_job(root, disk):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    as_node(root, [0, 1, 2, 3])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mgr = st.CheckpointManager(["mem://run", disk], keep=3, pool_bytes=8 << 20,
                               peer_parity=(2, 2))
    levels = []
    for step in (1, 2):
        h = mgr.save(step, {"w": distribute_tensor(full(step), mesh, [Shard(0)]),
                            "step": step})
        h.wait()
        levels.append(h.level()[0])
    mgr.close()
    return levels


def parity_restore_job(root, dirs, disk):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    as_node(root, dirs)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mgr = st.CheckpointManager(["mem://run", disk], keep=3, pool_bytes=8 << 20,
                               peer_parity=(2, 2))
    sd = {"w": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)]), "step": 0}
    import warnings
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = mgr.load(sd)
    mem = strata.probe("mem://run/step-%08d" % got)["committed"]
    ok = torch.equal(sd["w"].full_tensor(), full(got))
    mgr.close()
    return got, ok, mem


@pytest.mark.slow
@pytest.mark.parametrize("lost", [[1, 2], [0, 1, 2]])
def test_peer_parity_restore_or_disk(tmp_path, lost):
    """k = 2, m = 2 over 4 nodes with a disk tier behind: two nodes lost restore from the
    survivors' memory (2 nodes x 3 ranks); three lost cannot, and the load falls back to
    the disk copy."""
    root, disk = str(tmp_path), str(tmp_path / "disk")
    levels = _dist.run(parity_job, 8, root, disk, timeout=180)
    want = strata.LEVEL_LOCAL | strata.LEVEL_REPLICATED | strata.LEVEL_DURABLE
    assert all(lv == [want, want] for lv in levels), levels
    for n in lost:
        shutil.rmtree(os.path.join(root, "node%d" % n))
    dirs = [d for d in range(4) if d not in lost]
    res = _dist.run(parity_restore_job, 6, root, dirs, disk, timeout=180)
    for rank, (got, ok, mem) in enumerate(res):
        assert got == 2 and ok, (rank, got, ok)
        assert mem == (len(lost) == 2), (rank, mem)   # rebuilt in memory, or not at all
