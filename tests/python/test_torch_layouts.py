"""The layout matrix: a state dict saved in layout A on N processes loads, bitwise, into
layout B on M processes, for A and B among

    plain    every rank holds the whole model (replicated plain tensors)
    ddp      DistributedDataParallel (plain tensors, FQNs through get_state_dict)
    fsdp     FSDP2 fully_shard over all ranks: Shard(0), uneven and empty trailing shards
    tp       tensor parallel over all ranks: ColwiseParallel / RowwiseParallel (Shard(0),
             Shard(1)), replicated norms and buffers
    fsdp_tp  FSDP2 x TP on a 2 x 2 mesh (torch makes [_StridedShard(0, sf=2), Shard(0)])
    strided  [_StridedShard(0, sf=2)] on 1-D meshes, [Shard(0), _StridedShard(0, sf=2)] on a
             2 x 2 mesh: a rank's rows are not contiguous - the layout DCP refuses to save

and N, M in 1..4 (each layout at the world sizes where it exists). The state dict is the
model's and an AdamW's (torch.distributed.checkpoint.state_dict.get_state_dict) plus a plain
value; the model has odd sizes, a bf16 parameter and an int64 buffer.

Every tensor of the source is set to a reference value known on every rank (a function of
its key); every tensor of the target to other values; after the load each one, gathered
with DTensor.full_tensor(), must be bitwise the reference.

Cost on 2 cores: 4 save runs and 4 load runs of one process group each (see _dist.py).
"""

import os
import time
import zlib

import pytest
import torch
import torch.nn as nn

import _dist
from _tensors import bits, same as same_bits

LAYOUTS = {
    "plain": (1, 2, 3, 4),
    "ddp": (1, 2, 3, 4),
    "fsdp": (1, 2, 3, 4),
    "tp": (1, 2, 3, 4),
    "fsdp_tp": (4,),
    "strided": (2, 3, 4),
}

LR_SAVED = 0.0123


# ---- the model -----------------------------------------------------------------------------

class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 13).to(torch.bfloat16))


class Small(nn.Module):
    """Odd sizes: uneven shards on 2, 3 and 4 ranks, empty ones for `head` on 3 and 4."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 11)
        self.fc1 = nn.Linear(11, 7)
        self.fc2 = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(11)
        self.head = nn.Linear(5, 2)
        self.extra = Extra()
        self.register_buffer("count", torch.arange(5, dtype=torch.int64))


def ref_tensor(key, shape, dtype, salt=""):
    g = torch.Generator().manual_seed(zlib.crc32((salt + key).encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def tensors(d, prefix=""):
    """[(dotted key, tensor)] of a nested state dict."""
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, (list, tuple)) else ()
    for k, v in items:
        key = "%s.%s" % (prefix, k) if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out.append((key, v))
        else:
            out.extend(tensors(v, key))
    return out


def put_full(t, full):
    """Sets t (a plain tensor or a DTensor in any layout) to the global value full."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(t, DTensor):
            local = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(local.to_local())
        else:
            t.copy_(full)


def full_of(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


# ---- building a layout -----------------------------------------------------------------------

def _strided_sd(world):
    """The plain layout's state dict with every tensor of rank >= 1 as a DTensor whose rows
    are not contiguous on a rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        placements = [Shard(0), _StridedShard(0, split_factor=2)]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("a",))
        placements = [_StridedShard(0, split_factor=2)]
    sd, _ = build("plain", world)

    def conv(v):
        if isinstance(v, dict):
            return {k: conv(c) for k, c in v.items()}
        if isinstance(v, list):
            return [conv(c) for c in v]
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return distribute_tensor(v.detach().clone(), mesh, placements, src_data_rank=None)
        return v
    return conv(sd), placements


def build(layout, world):
    """(state dict, keep-alive) of the small model and an AdamW in `layout` on `world` ranks
    (the process group's ranks)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    if layout == "strided":
        sd, placements = _strided_sd(world)
        return sd, placements
    assert dist.get_world_size() == world
    torch.manual_seed(0)
    model = Small()
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model.extra, mesh=mesh)      # its own group: a bf16 parameter
        fully_shard(model, mesh=mesh)
    elif layout in ("tp", "fsdp_tp"):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        if layout == "tp":
            tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        else:
            mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            tp_mesh = mesh2["tp"]
        parallelize_module(model, tp_mesh, {
            "emb": RowwiseParallel(input_layouts=Replicate()),
            "fc1": ColwiseParallel(use_local_output=False),
            "fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),
        })
        if layout == "fsdp_tp":
            from torch.distributed.fsdp import fully_shard
            fully_shard(model.extra, mesh=mesh2["dp"])
            fully_shard(model, mesh=mesh2["dp"])
    else:
        assert layout == "plain", layout
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "meta": {"epoch": 3, "tag": "odd"}}, (model, opt)


def fill(sd, salt=""):
    for key, t in tensors(sd):
        put_full(t, ref_tensor(key, tuple(t.shape), t.dtype, salt))


def check(sd, where):
    """Bitwise comparison of every tensor of sd with its reference: a list of mismatches."""
    bad = []
    for key, t in tensors(sd):
        full = full_of(t)
        ref = ref_tensor(key, tuple(t.shape), t.dtype)
        if not same_bits(full, ref):
            diff = (bits(full).reshape(-1) != bits(ref).reshape(-1)).sum().item() \
                if full.shape == ref.shape else "shape"
            bad.append("%s: %s %s differs from the reference (%s of %d elements)"
                       % (where, key, getattr(t, "placements", "plain"), diff, ref.numel()))
    return bad


# ---- the runs ----------------------------------------------------------------------------------

def save_layouts(base, world):
    """Saves every layout that exists on `world` ranks to base/<layout>-<world>."""
    import torch.distributed as dist
    import strata.torch as st
    out = {}
    for layout, worlds in LAYOUTS.items():
        if world not in worlds:
            continue
        sd, keep = build(layout, world)
        fill(sd)
        if layout != "strided":
            keep[1].param_groups[0]["lr"] = LR_SAVED
            sd["optim"]["param_groups"][0]["lr"] = LR_SAVED
        # the reference itself must round-trip through torch (else the test is wrong, not strata)
        bad = check(sd, "self-check before the save of %s on %d" % (layout, world))
        assert not bad, "\n".join(bad)
        path = os.path.join(base, "%s-%d" % (layout, world))
        dist.barrier()
        t0 = time.perf_counter()
        stats = st.save(sd, path, step=world)
        out[layout] = (time.perf_counter() - t0, stats)
    return out


def load_layouts(sources, world):
    """Loads every saved checkpoint into every layout that exists on `world` ranks; returns
    (mismatches and errors, number of cases, seconds)."""
    import torch.distributed as dist
    import strata
    import strata.torch as st
    bad, cases = [], 0
    t0 = time.perf_counter()
    for layout, worlds in LAYOUTS.items():
        if world not in worlds:
            continue
        sd, keep = build(layout, world)
        for src_layout, src_world, path in sources:
            where = "%s on %d -> %s on %d" % (src_layout, src_world, layout, world)
            fill(sd, salt="garbage")
            sd["meta"] = None
            if layout != "strided":
                sd["optim"]["param_groups"][0]["lr"] = 0.5
            cases += 1
            try:
                st.load(sd, path)
            except strata.Error as e:
                bad.append("%s: load raised %s: %s" % (where, type(e).__name__, e))
                dist.barrier()
                continue
            bad.extend(check(sd, where))
            if sd["meta"] != {"epoch": 3, "tag": "odd"}:
                bad.append("%s: meta is %r" % (where, sd["meta"]))
            if layout != "strided" and src_layout != "strided":
                lr = sd["optim"]["param_groups"][0]["lr"]
                if lr != LR_SAVED:
                    bad.append("%s: param_groups[0].lr is %r, saved %r" % (where, lr, LR_SAVED))
    return bad, cases, time.perf_counter() - t0


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("layouts"))
    sources, seconds = [], {}
    for world in (1, 2, 3, 4):
        t0 = time.perf_counter()
        res = _dist.run(save_layouts, world, base, world, timeout=180)
        seconds[world] = time.perf_counter() - t0
        for layout in res[0]:
            sources.append((layout, world, os.path.join(base, "%s-%d" % (layout, world))))
    return sources, seconds


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_matrix(saved, world, figures):
    import strata
    sources, save_seconds = saved
    for layout, src_world, path in sources:
        info = strata.probe(path)
        assert info["committed"], "%s on %d: not committed: %r" % (layout, src_world, info)
    t0 = time.perf_counter()
    res = _dist.run(load_layouts, world, sources, world, timeout=300)
    wall = time.perf_counter() - t0
    bad, cases, seconds = [], res[0][1], res[0][2]
    for rank, r in enumerate(res):
        bad.extend("rank %d: %s" % (rank, b) for b in r[0])
    figures("layout matrix, load on %d" % world,
            "%d cases (%d sources x target layouts) in %.1f s (run %.1f s; saves on %d: %.1f s)"
            % (cases, len(sources), seconds, wall, world, save_seconds[world]))
    assert not bad, "%d of %d cases wrong:\n%s" % (len(bad), cases, "\n".join(bad))


# ---- the layout DCP refuses ---------------------------------------------------------------------

def _without_numpy():
    """torch's object collectives (which dcp.save uses to gather plans) unpickle through
    tensor.numpy(); this venv has no numpy. In this worker process only, the same function
    without numpy."""
    import importlib.util
    import io
    import torch.distributed.distributed_c10d as c10d
    if importlib.util.find_spec("numpy") is not None:
        return

    def _tensor_to_object(tensor, tensor_size, group):
        buf = bytes(tensor.cpu().contiguous().view(torch.uint8)[:tensor_size].tolist())
        return c10d._unpickler(io.BytesIO(buf)).load()
    c10d._tensor_to_object = _tensor_to_object


def dcp_save_error(sd, path):
    """What torch.distributed.checkpoint.save makes of sd: None if it saved, else the error."""
    import torch.distributed.checkpoint as dcp
    _without_numpy()
    try:
        dcp.save(sd, checkpoint_id=path)
    except BaseException as e:    # DCP's CheckpointException is a BaseException
        return "dcp.save raised %s: %s" % (type(e).__name__, e)
    return None


def strided_refused(base):
    import torch.distributed as dist
    import strata.torch as st
    from torch.distributed.tensor import DTensor
    world = dist.get_world_size()
    sd, placements = build("strided", world)
    fill(sd)
    # this rank's rows of a 2-D tensor really are not contiguous
    w = sd["model"]["emb.weight"]
    assert isinstance(w, DTensor) and tuple(w.placements) == tuple(placements)
    err = dcp_save_error({"model": sd["model"]}, os.path.join(base, "dcp"))
    dist.barrier()
    path = os.path.join(base, "strata")
    st.save(sd, path)
    bad = []
    for layout in ("strided", "fsdp", "tp", "fsdp_tp", "plain"):
        target, keep = build(layout, world)
        fill(target, salt="garbage")
        st.load(target, path)
        bad.extend(check(target, "strided on %d -> %s on %d" % (world, layout, world)))
    return err, str(placements), bad


@pytest.mark.slow
def test_dcp_refuses_strided_layout_strata_saves_it(tmp_path, figures):
    res = _dist.run(strided_refused, 4, str(tmp_path), timeout=180)
    err, placements, bad = res[0]
    assert err is not None, "DCP saved %s: this test no longer shows a layout DCP refuses" % placements
    assert "overlap" in err, err
    why = [line.strip() for line in err.splitlines() if "overlapping" in line][0]
    figures("layout DCP refuses", "%s on a 2x2 mesh: %s: %s" % (
        placements, err.split(":")[0], why[:260]))
    for r in res:
        assert r[0] is not None, "DCP refused on rank 0 but not on every rank: %r" % (r[0],)
        bad.extend(b for b in r[2] if b not in bad)
    assert not bad, "\n".join(bad)
