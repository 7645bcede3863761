"""DTensors as strata sees them: which boxes of the global tensor this rank holds (Shard,
Replicate, _StridedShard placements, an explicit shard order; or, for a local tensor that is
a LocalShardsWrapper, its shards at their own offsets), each a view of its local tensor."""

import itertools

import torch

import strata as _S

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:   # torch < 2.5
    try:
        from torch.distributed._tensor import DTensor as _DTensor
    except ImportError:
        _DTensor = None

try:
    from torch.distributed.tensor.placement_types import _StridedShard, Shard as _Shard
except ImportError:
    try:
        from torch.distributed._tensor.placement_types import _StridedShard, Shard as _Shard
    except ImportError:
        _StridedShard = None
        _Shard = None


def _is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def _is_shards_wrapper(local):
    """A local tensor that lists its own shards and their offsets (torch's
    LocalShardsWrapper: DCP takes its chunks, not the placements, as what the rank holds)."""
    return (callable(getattr(local, "local_shards", None))
            and callable(getattr(local, "local_offsets", None)))


def _wrapper_boxes(key, local, gshape):
    """The boxes of a LocalShardsWrapper: each local shard at its own offsets."""
    shards = list(local.local_shards())
    offsets = [tuple(int(x) for x in o) for o in local.local_offsets()]
    if len(offsets) != len(shards):
        raise _S.InvalidArgumentError(
            "%s: a LocalShardsWrapper with %d shards and %d "
            "offsets" % (key, len(shards), len(offsets)))
    out = []
    for i, (shard, offs) in enumerate(zip(shards, offsets)):
        lens = tuple(int(x) for x in shard.shape)
        if (len(offs) != len(gshape) or len(lens) != len(gshape)
                or any(o < 0 or o + n > g for o, n, g in zip(offs, lens, gshape))):
            raise _S.InvalidArgumentError(
                "%s: local shard %d of its LocalShardsWrapper (shape %s at offsets "
                "%s) lies outside the DTensor's global shape %s"
                % (key, i, lens, offs, gshape))
        if shard.numel():
            out.append((offs, lens, shard))
    return out


def _chunk_pick(idx, k, c):
    """torch.chunk(idx, k)[c], or empty where chunk gives fewer than k pieces."""
    n = idx.numel()
    if n == 0:
        return idx
    size = -(-n // k)
    start = min(c * size, n)
    return idx[start:min(start + size, n)]


def _strided_pick(idx, sf, k, c):
    """_StridedShard(split_factor=sf) over k chunks, chunk c: split into sf pieces, each into
    k, and take piece c of each (torch's _StridedShard._split_tensor)."""
    parts = [_chunk_pick(_chunk_pick(idx, sf, j), k, c) for j in range(sf)]
    return torch.cat(parts) if parts else idx[:0]


def _runs(ix):
    """[(global start, length, local start)] of the contiguous runs of the index list ix."""
    n = ix.numel()
    if n == 0:
        return []
    if n == 1 or int(ix[-1]) - int(ix[0]) == n - 1 and bool((ix[1:] - ix[:-1] == 1).all()):
        return [(int(ix[0]), n, 0)]
    breaks = ((ix[1:] - ix[:-1]) != 1).nonzero().flatten().tolist()
    out, s = [], 0
    for b in breaks + [n - 1]:
        out.append((int(ix[s]), b + 1 - s, s))
        s = b + 1
    return out


def _dtensor_boxes(key, dt):
    """This rank's pieces of DTensor dt: [(offsets, lengths, local view)]; several where its
    rows are not contiguous in the global tensor (_StridedShard), none where it holds no
    element or is not part of the mesh."""
    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    gshape = tuple(dt.shape)
    local = dt._local_tensor
    for p in placements:
        if p.is_partial():
            raise _S.InvalidArgumentError(
                "%s: a DTensor with a Partial placement (%s) holds partial sums, not "
                "values: redistribute it to Replicate or Shard first" % (key, placements))
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    if _is_shards_wrapper(local):
        return _wrapper_boxes(key, local, gshape)
    strided = _StridedShard is not None and any(isinstance(p, _StridedShard) for p in placements)
    # the order in which mesh dims shard each tensor dim: placements left to right, unless
    # the spec carries an explicit shard order (torch >= 2.9, without _StridedShard)
    order = None
    spec = getattr(dt, "_spec", None)
    so = getattr(spec, "shard_order", None)
    if so is not None and not strided:
        default = None
        fn = getattr(type(spec), "compute_default_shard_order", None)
        if fn is not None:
            default = fn(placements)
        if default is not None and tuple(so) != tuple(default):
            order = [(e.tensor_dim, tuple(e.mesh_dims)) for e in so]
    if not strided and order is None:
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:   # torch < 2.5
            from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
        lshape, goff = compute_local_shape_and_global_offset(gshape, mesh, placements)
        lshape = tuple(int(x) for x in lshape)
        if lshape != tuple(local.shape):
            raise _S.InvalidArgumentError(
                "%s: the DTensor's local tensor has shape %s, its placements %s on "
                "mesh %s give %s" % (key, tuple(local.shape), placements,
                                      tuple(mesh.shape), lshape))
        if local.numel() == 0:
            return []
        return [(tuple(int(x) for x in goff), lshape, local)]
    idx = {}
    if order is None:
        steps = [(p.dim, md) for md, p in enumerate(placements)
                 if isinstance(p, _Shard) or isinstance(p, _StridedShard)]
    else:
        steps = [(d, md) for d, mds in order for md in mds]
    for d, md in steps:
        p = placements[md]
        cur = idx.get(d)
        if cur is None:
            cur = torch.arange(gshape[d], dtype=torch.int64)
        k = mesh.size(md)
        c = coord[md]
        if order is None and isinstance(p, _StridedShard):
            sf = p._split_factor_int() if hasattr(p, "_split_factor_int") else int(p.split_factor)
            cur = _strided_pick(cur, sf, k, c)
        else:
            cur = _chunk_pick(cur, k, c)
        idx[d] = cur
    lshape = tuple(idx[d].numel() if d in idx else gshape[d] for d in range(len(gshape)))
    if lshape != tuple(local.shape):
        raise _S.InvalidArgumentError(
            "%s: the DTensor's local tensor has shape %s, its placements %s on mesh "
            "%s give %s" % (key, tuple(local.shape), placements, tuple(mesh.shape),
                            lshape))
    if local.numel() == 0:
        return []
    runs = [_runs(idx[d]) if d in idx else [(0, gshape[d], 0)] for d in range(len(gshape))]
    out = []
    for combo in itertools.product(*runs):
        offs = tuple(r[0] for r in combo)
        lens = tuple(r[1] for r in combo)
        view = local[tuple(slice(r[2], r[2] + r[1]) for r in combo)]
        out.append((offs, lens, view))
    return out
