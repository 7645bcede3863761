"""strata for PyTorch: save and load state dicts where torch.distributed.checkpoint is used.

    import strata.torch as st
    st.save({"model": model, "optim": optimizer, "rng": st.rng_state(), "step": step}, path)
    st.load(state, path)                         # in place, into tensors already allocated
    h = st.async_save(state, path); h.wait_snapshot(); optimizer.step(); ...; h.wait()
    mgr = st.CheckpointManager(["/dev/shm/ckpt", "/data/ckpt"], keep=3)
    st.export_safetensors(path, "hf-model/", prefix="model.", dtype=torch.bfloat16)

State dicts hold (nested in dicts, lists and tuples; flattened to dotted keys such as
"optim.state.layers.0.w.exp_avg"):
  - plain tensors: replicated - every rank holds the same bytes (checked at save: a key
    whose bytes differ across ranks is an error naming it, and nothing is written);
  - DTensors (Shard, Replicate, _StridedShard placements: tensor parallel, FSDP2, FSDP2 x
    TP), each rank describing its boxes of the global tensor, several where its rows are not
    contiguous. Load reshards: any saved layout into any target layout;
  - Stateful objects (state_dict() / load_state_dict(): modules, optimizers, your own),
    expanded at save and restored through load_state_dict at load;
  - values (None, bool, int, float, str, bytes, lists, tuples and dicts of them) in the
    tagged format of docs/FORMAT.md ("Python values"), which loads without running code;
    anything else only with pickle=True on both save and load;
  - per_rank(x): a value (or tensor, or nested state) each rank saves for itself and gets
    back for itself (RNG states, data-loader positions): rng_state() / set_rng_state().

With an initialised process group (or the one given) every rank calls together; strata's
collectives run on a dedicated gloo group. Without one, everything runs in this process.
"""

import bisect
import collections.abc
import ctypes
import hashlib
import itertools
import os
import random as _pyrandom
import re
import struct
import warnings

import torch
import torch.distributed as dist

import strata as _S
from strata import _values

__all__ = ["save", "load", "async_save", "AsyncSave", "per_rank", "PerRank", "rng_state",
           "set_rng_state", "CheckpointManager", "export_safetensors"]

# ---- dtypes -----------------------------------------------------------------------------

_DTYPE_NAMES = [("float64", "f64"), ("float32", "f32"), ("float16", "f16"),
                ("bfloat16", "bf16"), ("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2"),
                ("int64", "i64"), ("int32", "i32"), ("int16", "i16"), ("int8", "i8"),
                ("uint8", "u8"), ("bool", "bool")]
_TO_STRATA = {}
for _tn, _sn in _DTYPE_NAMES:
    _dt = getattr(torch, _tn, None)
    if _dt is not None:
        _TO_STRATA[_dt] = _sn
_FROM_STRATA = {v: k for k, v in _TO_STRATA.items()}
del _tn, _sn, _dt


def _sdtype(key, t):
    try:
        return _TO_STRATA[t.dtype]
    except KeyError:
        raise _error("InvalidArgumentError",
                     "%s: dtype %s has no strata dtype (strata holds %s)"
                     % (key, t.dtype, ", ".join(str(d) for d in _TO_STRATA))) from None


# ---- errors -----------------------------------------------------------------------------

def _error(cls_name, msg):
    """An instance of strata.<cls_name> (strata.Error if unknown) carrying msg."""
    cls = getattr(_S, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, _S.Error)):
        cls = _S.InvalidArgumentError
    try:
        return cls(msg)
    except Exception:   # a binding whose classes take other arguments
        e = _S.Error(msg)
        return e


def _with_key(e, key):
    """e (a strata.Error raised while registering key) again, its message naming key."""
    msg = str(e)
    if key in msg:
        return e
    return _error(type(e).__name__, "%s: %s" % (key, msg))


# ---- DTensor ----------------------------------------------------------------------------

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
            raise _error("InvalidArgumentError",
                         "%s: a DTensor with a Partial placement (%s) holds partial sums, not "
                         "values: redistribute it to Replicate or Shard first" % (key, placements))
    coord = mesh.get_coordinate()
    if coord is None:
        return []
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
            raise _error("InvalidArgumentError",
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
        raise _error("InvalidArgumentError",
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


# ---- tensors ----------------------------------------------------------------------------

def _check_tensor(key, t):
    if t.device.type == "meta":
        raise _error("InvalidArgumentError",
                     "%s: a tensor on the meta device has no data (materialise it first, "
                     "e.g. to_empty() and init)" % key)
    if t.layout != torch.strided:
        raise _error("InvalidArgumentError",
                     "%s: a %s tensor: strata saves dense (strided) tensors; convert it "
                     "(to_dense()) or keep it in a value" % (key, t.layout))
    if t.device.type not in ("cpu", "cuda"):
        raise _error("InvalidArgumentError",
                     "%s: a tensor on device %s: strata reads CPU and CUDA memory" % (key, t.device))
    if t.is_quantized:
        raise _error("InvalidArgumentError", "%s: quantized tensors are not supported" % key)


def _readable(t):
    """A tensor holding t's values contiguously, row-major: t itself where it can."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _writable(t):
    """(buffer the engine writes into, (t, buffer) to copy back after the load, or None)."""
    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t, None
    tmp = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    return tmp, (t, tmp)


def _nbytes(t):
    return t.numel() * t.element_size()


def _hash_tensor(t):
    """A 64-bit digest of the bytes of a contiguous tensor, for the replica check: XXH3-64
    of host memory; on a GPU, _device_digest (no copy to the host)."""
    if t.device.type != "cpu":
        return _device_digest(t)
    return _S.hash_bytes(t.data_ptr(), _nbytes(t))


def _device_digest(t, chunk=1 << 24):
    """A digest of a tensor's bytes computed where they are (a GPU), without copying them to
    the host: three sums over the bytes b[i] (plain, and weighted by two functions of the
    position i), in int64 arithmetic that wraps - so the same bytes give the same digest
    whatever the order of the reduction - chunk by chunk to bound the temporary memory.
    Not a cryptographic hash: it detects ranks whose bytes differ, which is its use."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    acc = torch.zeros(3, dtype=torch.int64, device=t.device)
    for s in range(0, n, chunk):
        x = b[s:s + chunk].to(torch.int64)
        i = torch.arange(s, s + x.numel(), dtype=torch.int64, device=t.device)
        acc[0] += x.sum()
        acc[1] += (x * (i % 65521 + 1)).sum()
        acc[2] += (x * ((i * 2654435761 + 40503) % 4294967291)).sum()
    a0, a1, a2 = (v & 0xFFFFFFFFFFFFFFFF for v in acc.tolist())
    return int.from_bytes(hashlib.blake2b(struct.pack("<QQQQ", n, a0, a1, a2),
                                          digest_size=8).digest(), "little")


def _sync_cuda(devices):
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


def _sync_loaded(devices):
    """After a load into CUDA memory: strata's cudaMemcpy from pageable host memory may
    return before its DMA has landed, and a non-blocking stream (the caller's current one
    may be such) is not ordered after it; wait for the device before anyone reads."""
    for d in devices:
        torch.cuda.synchronize(d)


# ---- per-rank values --------------------------------------------------------------------

class PerRank:
    """A value each rank saves for itself and gets back for itself (see per_rank)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return "per_rank(%r)" % (self.value,)


def per_rank(value):
    """Marks value (a tensor, a value, or a nested state of them) as this rank's own: every
    rank saves its own (under the same key) and load gives each rank its own back. Without
    the marker, a value must be the same on every rank (else save fails naming the key).
    Per-rank values are not resharded: a load on more ranks than saved finds no value for
    the new ranks (NotFoundError naming the key)."""
    return value if isinstance(value, PerRank) else PerRank(value)


def _pr_name(key, rank):
    return "%s@rank%d" % (key, rank)


def rng_state():
    """This rank's random number generator states, marked per rank: torch's CPU generator,
    every CUDA device's (where CUDA is available) and Python's random module. Save it in a
    state dict; load into a fresh rng_state() and pass the result to set_rng_state()."""
    st = {"cpu": torch.get_rng_state(), "python": _pyrandom.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = list(torch.cuda.get_rng_state_all())
    return PerRank(st)


def set_rng_state(state):
    """Restores what rng_state() returned (or its loaded copy)."""
    v = state.value if isinstance(state, PerRank) else state
    if not isinstance(v, collections.abc.Mapping):
        raise TypeError("set_rng_state: expected what rng_state() returns, got %r" % type(v))
    if "cpu" in v:
        torch.set_rng_state(v["cpu"])
    if "cuda" in v and torch.cuda.is_available():
        cuda = list(v["cuda"])
        n = torch.cuda.device_count()
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, i)
    if "python" in v:
        p = v["python"]
        if isinstance(p, list):
            p = tuple(p)
        _pyrandom.setstate(p)


# ---- walking state dicts ----------------------------------------------------------------

def _is_stateful(v):
    return (not isinstance(v, (torch.Tensor, type))
            and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None)))


def _is_container(v):
    return isinstance(v, (collections.abc.Mapping, list, tuple))


def _items(v):
    if isinstance(v, collections.abc.Mapping):
        return list(v.items())
    return list(enumerate(v))


def _join(key, k):
    if isinstance(k, str):
        part = k
    elif isinstance(k, int):
        part = str(int(k))
    else:
        raise _error("InvalidArgumentError",
                     "%s: a state dict key of type %s (%r): keys are str or int"
                     % (key or "<root>", type(k).__name__, k))
    return part if not key else key + "." + part


def _plain(v, depth=0):
    """True if v holds no tensor, no Stateful and no per_rank (it is one value)."""
    if isinstance(v, (torch.Tensor, PerRank)) or _is_stateful(v):
        return False
    if _is_container(v) and depth < 1000:
        return all(_plain(c, depth + 1) for _, c in _items(v))
    return True


def _rebuild(orig, items):
    t = type(orig)
    if t is tuple:
        return tuple(items)
    if hasattr(t, "_make"):   # namedtuple
        return t._make(items)
    return t(items)


def _flatten(state_dict):
    """[(kind, key, value, per_rank)]: kind "tensor" or "value"."""
    if not isinstance(state_dict, collections.abc.Mapping):
        raise TypeError("strata.torch: a state dict is a dict (of tensors, Stateful objects, "
                        "values); got %s" % type(state_dict).__name__)
    out = []

    def walk(v, key, pr, out):
        if isinstance(v, PerRank):
            if walk(v.value, key, True, out):
                out.append(("value", key, v.value, True))
            return False
        if isinstance(v, torch.Tensor):
            out.append(("tensor", key, v, pr))
            return False
        if _is_stateful(v):
            sd = v.state_dict()
            if not isinstance(sd, collections.abc.Mapping):
                raise _error("InvalidArgumentError", "%s: state_dict() returned a %s, not a dict"
                             % (key, type(sd).__name__))
            container(sd, key, pr, out, True)
            return False
        if _is_container(v):
            return container(v, key, pr, out, False)
        return True

    def container(v, key, pr, out, force):
        sub, plain, allplain = [], [], True
        for k, c in _items(v):
            ck = _join(key, k)
            if walk(c, ck, pr, sub):
                plain.append((ck, c))
            else:
                allplain = False
        if allplain and not force:
            return True
        for ck, c in plain:
            sub.append(("value", ck, c, pr))
        out.extend(sub)
        return False

    container(state_dict, "", False, out, True)
    seen = set()
    for e in out:
        if e[1] in seen:
            raise _error("InvalidArgumentError",
                         "two entries of the state dict flatten to the same key %r" % e[1])
        seen.add(e[1])
    return out


# ---- the process group ------------------------------------------------------------------

def _as_u8(mv):
    """A uint8 tensor over the memoryview's bytes (no copy); mv non-empty."""
    if mv.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(mv, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


def _tobytes(t):
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _u8_from_bytes(b):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


class _Group:
    """A process group as strata sees it: a dedicated gloo group, the strata Comm over it,
    and the Savers made on it (one per pool), kept for the life of the process."""

    def __init__(self, pg):
        self.pg = pg
        self.ranks = list(dist.get_process_group_ranks(pg))
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        if pg is dist.group.WORLD or self.size == dist.get_world_size():
            if pg is dist.group.WORLD:
                self.gloo = dist.new_group(backend="gloo")
            else:
                self.gloo = dist.new_group(ranks=self.ranks, backend="gloo")
        else:
            self.gloo = dist.new_group(ranks=self.ranks, backend="gloo",
                                       use_local_synchronization=True)
        self.comm = _S.Comm.host(self.rank, self.size, self._allgather, self._alltoallv,
                                 self._bcast)
        self.savers = {}
        self._into = True

    def _gather_into(self, out, inp):
        """all_gather_into_tensor (equal sizes), or all_gather into views of out where the
        backend lacks it (older gloo)."""
        if self._into:
            try:
                dist.all_gather_into_tensor(out, inp, group=self.gloo)
                return
            except (RuntimeError, NotImplementedError) as e:
                if "support" not in str(e).lower():
                    raise
                self._into = False
        dist.all_gather(list(out.chunk(self.size)), inp, group=self.gloo)

    # the Comm's callbacks (run on the thread in save/load, GIL held)
    def _allgather(self, send, recv):
        if send.nbytes == 0:
            return
        self._gather_into(_as_u8(recv), _as_u8(send))

    def _alltoallv(self, send, scounts, recv, rcounts):
        scounts = [int(c) for c in scounts]
        rcounts = [int(c) for c in rcounts]
        inp = _as_u8(send)[:sum(scounts)] if send.nbytes else torch.empty(0, dtype=torch.uint8)
        out = _as_u8(recv)[:sum(rcounts)] if recv.nbytes else torch.empty(0, dtype=torch.uint8)
        dist.all_to_all_single(out, inp, output_split_sizes=rcounts,
                               input_split_sizes=scounts, group=self.gloo)

    def _bcast(self, buf, root):
        if buf.nbytes == 0:
            return
        dist.broadcast(_as_u8(buf), src=self.ranks[root], group=self.gloo)

    # collectives of strata.torch itself
    def allgather_bytes(self, data):
        """Every rank's `data` (all the same length)."""
        n = len(data)
        out = torch.empty(n * self.size, dtype=torch.uint8)
        if n:
            self._gather_into(out, _u8_from_bytes(data))
        b = _tobytes(out)
        return [b[i * n:(i + 1) * n] for i in range(self.size)]

    def bcast_bytes(self, data):
        """Rank 0's data (bytes) on every rank."""
        hdr = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(hdr, src=self.ranks[0], group=self.gloo)
        n = int(hdr[0])
        buf = _u8_from_bytes(data) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        if n:
            dist.broadcast(buf, src=self.ranks[0], group=self.gloo)
        return _tobytes(buf)

    def saver(self, pool=None):
        """The group's saver for pool (its plan cache makes repeated saves of one layout
        cheap): the one of no pool, and the one of the last pool given; a saver holds its
        pool, so an older pool's is dropped, and the pool freed once the caller drops it."""
        s = self.savers.get(id(pool))
        if s is None or s[1] is not pool:
            if pool is not None:
                for k in [k for k, v in self.savers.items() if v[1] is not None]:
                    del self.savers[k]
            s = (_S.Saver(self.comm, pool) if pool is not None else _S.Saver(self.comm), pool)
            self.savers[id(pool)] = s
        return s[0]


_GROUPS = {}
_LOCAL_SAVERS = {}


def _group(process_group):
    """The _Group of process_group (default: the default group), or None without one."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    g = _GROUPS.get(process_group)
    if g is None:
        g = _Group(process_group)
        _GROUPS[process_group] = g
    return g


def _saver(group, pool=None):
    """The saver for a save: the group's; without a group, one saver for saves without a
    pool, and a new one for each save with a pool (a saver without a communicator caches no
    plan, and one kept would keep its pool alive after the caller dropped it)."""
    if group is not None:
        return group.saver(pool)
    if pool is not None:
        return _S.Saver(None, pool)
    if _LOCAL_SAVERS.get(None) is None:
        _LOCAL_SAVERS[None] = _S.Saver()
    return _LOCAL_SAVERS[None]


def _uris(path):
    if isinstance(path, (list, tuple)):
        uris = [os.fspath(p) for p in path]
    else:
        uris = [os.fspath(path)]
    if not uris:
        raise ValueError("strata.torch: no path given")
    return uris


def _agree(group, what, err, checks=()):
    """The collective step before strata's own: every rank learns whether every rank got
    ready (else all raise, naming the failing rank) and, for a save, compares the hashes of
    its replicated entries (a key whose bytes differ across ranks: InvalidArgumentError
    naming it). One allgather when all is well."""
    if group is None or group.size == 1:
        if err is not None:
            raise err
        return
    if err is None:
        payload = _values.encode(sorted([k, h] for k, h in checks))
        status = 0
    else:
        payload = _values.encode([type(err).__name__, str(err)])
        status = 1
    digest = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    recs = [struct.unpack("<QQQ", r) for r in
            group.allgather_bytes(struct.pack("<QQQ", status, len(payload), digest))]
    if all(r[0] == 0 for r in recs) and len(set((r[1], r[2]) for r in recs)) == 1:
        return
    n = max(r[1] for r in recs)
    got = group.allgather_bytes(payload + b"\0" * (n - len(payload)))
    if err is not None:
        raise err
    for r, (st, ln, _) in enumerate(recs):
        if st:
            cls, msg = _values.decode(got[r][:ln])[1]
            raise _error(cls, "%s failed on rank %d: %s" % (what, r, msg))
    table = {}
    for r, (st, ln, _) in enumerate(recs):
        for k, h in _values.decode(got[r][:ln])[1]:
            table.setdefault(k, {}).setdefault(h, []).append(r)
    bad = sorted(k for k, hs in table.items() if len(hs) > 1)
    if bad:
        k = bad[0]
        groups = sorted(table[k].values())
        raise _error("InvalidArgumentError",
                     "%s: %r differs across ranks (ranks %s hold different bytes%s); a value "
                     "each rank keeps for itself must be marked strata.torch.per_rank(...); "
                     "nothing was written"
                     % (what, k, " vs ".join(",".join(str(r) for r in g[:8]) for g in groups[:4]),
                        "; also %s" % ", ".join(repr(b) for b in bad[1:6]) if len(bad) > 1 else ""))


# ---- save -------------------------------------------------------------------------------

class _SavePrep:
    """One rank's strata.State for a state dict, and its replica hashes (only with other
    ranks to compare with: alone, hashing every plain tensor would only add to the stall)."""

    def __init__(self, state_dict, rank, pickle, replicas=True):
        self.rank = rank
        self.pickle = pickle
        self.replicas = replicas
        self.state = _S.State()
        self.checks = []
        self.cuda = set()
        for kind, key, v, pr in _flatten(state_dict):
            try:
                if kind == "tensor":
                    self._tensor(key, v, pr)
                else:
                    self._value(key, v, pr)
            except _S.Error as e:
                raise _with_key(e, key) from None

    def _blob(self, key, data, pr, check=True):
        buf = ctypes.create_string_buffer(max(len(data), 1))
        ctypes.memmove(buf, data, len(data))
        self.state.add_blob(key, data_ptr=ctypes.addressof(buf), nbytes=len(data),
                            rank_local=pr, keep=buf)
        if check and not pr and self.replicas:
            self.checks.append((key, int.from_bytes(
                hashlib.blake2b(data, digest_size=8).digest(), "little")))

    def _value(self, key, v, pr):
        try:
            data = _values.encode(v)
        except _values.NeedsPickle as e:
            if not self.pickle:
                raise _error("InvalidArgumentError",
                             "%s%s: %s cannot be saved without pickle: pass pickle=True to "
                             "both save and load (loading then unpickles it, which can run "
                             "code), or store it as None/bool/int/float/str/bytes/list/tuple/"
                             "dict" % (key, e.path, e)) from None
            data = _values.encode_pickle(v)
        self._blob(key, data, pr)

    def _tensor(self, key, t, pr):
        _check_tensor(key, t)
        sdt = _sdtype(key, t)
        if _is_dtensor(t):
            if pr:
                raise _error("InvalidArgumentError",
                             "%s: per_rank() of a DTensor: a DTensor is already split over "
                             "the ranks; save it without the marker" % key)
            gshape = tuple(t.shape)
            if t.numel() == 0:
                self._blob(key, _values.encode_empty_tensor(sdt, gshape), False)
                return
            for offs, lens, view in _dtensor_boxes(key, t):
                src = _readable(view)
                self._shard(key, sdt, gshape, offs, lens, src)
            return
        if t.numel() == 0:
            self._blob(key, _values.encode_empty_tensor(sdt, tuple(t.shape)), pr)
            return
        src = _readable(t)
        name = _pr_name(key, self.rank) if pr else key
        self._shard(name, sdt, tuple(src.shape), None, None, src)
        if not pr and self.replicas:
            self.checks.append((key, _hash_tensor(src)))

    def _shard(self, name, sdt, gshape, offs, lens, src):
        if src.is_cuda:
            self.cuda.add(src.device)
        self.state.add_shard(name, sdt, gshape, offs, lens, data_ptr=src.data_ptr(),
                             nbytes=_nbytes(src), device=src.is_cuda, keep=src)


def _prepare_save(state_dict, group, pickle):
    rank = group.rank if group is not None else 0
    prep, err = None, None
    try:
        prep = _SavePrep(state_dict, rank, pickle, group is not None and group.size > 1)
    except Exception as e:   # every rank must reach the collective below
        err = e
    _agree(group, "strata.torch.save", err, prep.checks if prep is not None else ())
    _sync_cuda(prep.cuda)
    return prep


def save(state_dict, path, process_group=None, *, step=0, pickle=False, **options):
    """Saves state_dict to path (a directory: a plain path, "file:///abs" or "mem://name";
    or a list of them, tiers fastest first) and returns once it is committed, with the
    save's stats. With a process group (the default one if initialised), every rank calls
    it. options: chunk_bytes, io_threads, sync, direct, bg_nice (strata.Saver.save)."""
    group = _group(process_group)
    uris = _uris(path)
    prep = _prepare_save(state_dict, group, pickle)
    return _saver(group).save(uris, [prep.state], step=step, **options)


class AsyncSave:
    """A save in flight (async_save). wait_snapshot() returns once the state's bytes have
    been copied out (change the tensors only after it: call it before optimizer.step());
    wait() returns once committed, with the stats, and raises the save's error; done()
    tells without waiting. With a process group, wait() is collective: every rank calls it."""

    def __init__(self, handle, prep, on_done=None):
        self._h = handle
        self._prep = prep
        self._on_done = on_done
        self._result = None
        self._exc = None
        self._finished = False

    def wait_snapshot(self):
        if not self._finished:
            self._h.wait_snapshot()

    def wait(self):
        if not self._finished:
            self._finished = True
            try:
                self._result = self._h.wait_durable()
            except BaseException as e:
                self._exc = e
            finally:
                try:
                    self._h.close()
                finally:
                    self._prep = None
            if self._exc is None and self._on_done is not None:
                self._on_done()
        if self._exc is not None:
            raise self._exc
        return self._result

    def done(self):
        return self._finished or bool(self._h.done())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.wait()
        else:
            try:
                self.wait()
            except Exception:
                pass


def async_save(state_dict, path, process_group=None, *, step=0, pool=None, pickle=False,
               **options):
    """Starts saving state_dict to path and returns an AsyncSave once the plan is made: no
    tensor is copied on this thread (strata snapshots them in the background, into the
    pool: a strata.Pool, or the saver's own). Do not change the tensors before
    wait_snapshot(); call wait() (every rank) to commit."""
    group = _group(process_group)
    uris = _uris(path)
    prep = _prepare_save(state_dict, group, pickle)
    h = _saver(group, pool).start(uris, [prep.state], step=step, **options)
    return AsyncSave(h, prep)


# ---- load -------------------------------------------------------------------------------

class _Meta:
    """What load needs to know of the checkpoint: tensor dtypes and shapes, blob sizes."""

    def __init__(self, d):
        self.step = d["step"]
        self.uri = d["uri"]
        self.tensors = {n: (dt, tuple(shape)) for n, dt, shape in d["t"]}
        self.blobs = {(n, o): b for n, o, b in d["b"]}
        self.names = sorted(set(self.tensors) | set(n for n, _ in self.blobs))
        self.owners = sorted(set(o for _, o in self.blobs if o >= 0)
                             | set(int(m.group(1)) for m in
                                   (re.search(r"@rank(\d+)$", n) for n in self.tensors) if m))

    @staticmethod
    def read(uris):
        last = None
        for i, u in enumerate(uris):
            try:
                ck = _S.Checkpoint(u)
            except _S.Error as e:
                last = e
                continue
            return {"step": ck.step, "uri": i,
                    "t": [[t["name"], t["dtype"], list(t["shape"])] for t in ck.tensors],
                    "b": [[b["name"], b["owner"], b["bytes"]] for b in ck.blobs]}
        if len(uris) > 1:
            raise _error(type(last).__name__, "no tier holds a readable checkpoint (%s); "
                         "the last: %s" % (", ".join(uris), last))
        raise last

    def value_src(self, key, rank):
        if (key, -1) in self.blobs:
            return -1, self.blobs[(key, -1)]
        if (key, rank) in self.blobs:
            return rank, self.blobs[(key, rank)]
        return None

    def tensor_name(self, key, rank):
        if key in self.tensors:
            return key
        n = _pr_name(key, rank)
        return n if n in self.tensors else None

    def has_prefix(self, key):
        p = key + "."
        i = bisect.bisect_left(self.names, p)
        return i < len(self.names) and self.names[i].startswith(p)

    def missing(self, key, rank, pr):
        if any((key, o) in self.blobs for o in self.owners) or any(
                _pr_name(key, o) in self.tensors for o in self.owners):
            return _error("NotFoundError",
                          "%s: the checkpoint holds it per rank, but not for rank %d (saved by "
                          "ranks %s): per-rank values are not resharded"
                          % (key, rank, _ranges(self.owners)))
        return _error("NotFoundError", "%s: not in the checkpoint" % key)


def _ranges(xs):
    xs = sorted(xs)
    if xs and xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return "%d-%d" % (xs[0], xs[-1])
    return ",".join(str(x) for x in xs[:16]) + (",..." if len(xs) > 16 else "")


def _read_meta(uris, group):
    if group is None or group.size == 1:
        return _Meta(_Meta.read(uris))
    data, err = b"", None
    if group.rank == 0:
        try:
            data = _values.encode({"ok": _Meta.read(uris)})
        except Exception as e:
            err = e
            data = _values.encode({"error": [type(e).__name__, str(e)]})
    got = _values.decode(group.bcast_bytes(data))[1]
    if err is not None:
        raise err
    if "error" in got:
        raise _error(got["error"][0], got["error"][1])
    return _Meta(got["ok"])


class _LoadPrep:
    """One rank's strata.State for loading into a state dict, and what to do after."""

    def __init__(self, state_dict, meta, rank, pickle):
        if not isinstance(state_dict, collections.abc.Mapping):
            raise TypeError("strata.torch.load: a state dict is a dict; got %s"
                            % type(state_dict).__name__)
        self.meta = meta
        self.rank = rank
        self.pickle = pickle
        self.state = _S.State()
        self.copies = []    # (target, buffer): copy after the load
        self.blobs = []     # (key, buffer, size, setter, tensor target or None)
        self.new = []       # (setter, tensor): values saved as tensors
        self.finals = []    # post-order: tuple rebuilds, load_state_dict
        self.cuda = set()
        self._container(state_dict, "", False, None)

    def _walk(self, v, key, pr, setter):
        if isinstance(v, PerRank):
            def set_pr(x, h=v):
                h.value = x
            self._walk(v.value, key, True, set_pr)
            return
        if isinstance(v, torch.Tensor):
            try:
                self._tensor(key, v)
            except _S.Error as e:
                raise _with_key(e, key) from None
            return
        if _is_stateful(v):
            sd = v.state_dict()
            if not isinstance(sd, collections.abc.Mapping):
                raise _error("InvalidArgumentError", "%s: state_dict() returned a %s, not a dict"
                             % (key, type(sd).__name__))
            self._container(sd, key, pr, None)
            self.finals.append(lambda obj=v, sd=sd: obj.load_state_dict(sd))
            return
        if _is_container(v):
            m = self.meta
            if not _plain(v) or (m.value_src(key, self.rank) is None
                                 and m.tensor_name(key, self.rank) is None
                                 and m.has_prefix(key)):
                self._container(v, key, pr, setter)
                return
        self._value(key, pr, setter)

    def _container(self, v, key, pr, setter):
        items = _items(v)
        if not items and key and self.meta.has_prefix(key):
            raise _error("NotFoundError",
                         "%s: the checkpoint holds entries under %r but the target's %r is "
                         "empty (an optimizer whose state is not initialised yet? create it "
                         "first, e.g. with torch.distributed.checkpoint.state_dict."
                         "get_state_dict)" % (key, key + ".", key))
        if isinstance(v, tuple):
            tmp = list(v)
            for i, c in items:
                self._walk(c, _join(key, i), pr, lambda x, l=tmp, i=i: l.__setitem__(i, x))
            if setter is not None:
                self.finals.append(lambda: setter(_rebuild(v, tmp)))
            return
        for k, c in items:
            self._walk(c, _join(key, k), pr, lambda x, d=v, k=k: d.__setitem__(k, x))

    def _value(self, key, pr, setter):
        m = self.meta
        src = m.value_src(key, self.rank)
        if src is None:
            name = m.tensor_name(key, self.rank)
            if name is None:
                raise m.missing(key, self.rank, pr)
            dt, shape = m.tensors[name]
            t = torch.empty(shape, dtype=_FROM_STRATA[dt])
            self.state.add_shard(name, dt, shape, data_ptr=t.data_ptr(), nbytes=_nbytes(t),
                                 keep=t)
            self.new.append((setter, t))
            return
        self._blob(key, src, setter, None)

    def _blob(self, key, src, setter, target):
        owner, size = src
        buf = ctypes.create_string_buffer(max(size, 1))
        self.state.add_blob(key, data_ptr=ctypes.addressof(buf), nbytes=size, owner=owner,
                            keep=buf)
        self.blobs.append((key, buf, size, setter, target))

    def _tensor(self, key, t):
        _check_tensor(key, t)
        sdt = _sdtype(key, t)
        gshape = tuple(t.shape)
        m = self.meta
        name = m.tensor_name(key, self.rank)
        if name is None:
            src = m.value_src(key, self.rank)
            if src is None:
                raise m.missing(key, self.rank, False)
            self._blob(key, src, None, t)   # an empty tensor (or a value: a mismatch)
            return
        dt, shape = m.tensors[name]
        if dt != sdt or shape != gshape:
            raise _error("MismatchError",
                         "%s: the checkpoint holds %s%s, the target is %s%s"
                         % (key, dt, list(shape), sdt, list(gshape)))
        if _is_dtensor(t):
            pieces = [(offs, lens, view) for offs, lens, view in _dtensor_boxes(key, t)]
        else:
            pieces = [(None, None, t)]
        for offs, lens, view in pieces:
            buf, fix = _writable(view)
            if fix is not None:
                self.copies.append(fix)
            if buf.is_cuda:
                self.cuda.add(buf.device)
            self.state.add_shard(name, sdt, gshape, offs, lens, data_ptr=buf.data_ptr(),
                                 nbytes=_nbytes(buf), device=buf.is_cuda, keep=buf)

    def finish(self):
        with torch.no_grad():
            for target, buf in self.copies:
                target.copy_(buf)
        for key, buf, size, setter, target in self.blobs:
            data = ctypes.string_at(ctypes.addressof(buf), size)
            try:
                kind, v = _values.decode(data, pickle=self.pickle)
            except PermissionError as e:
                raise _error("InvalidArgumentError", "%s: %s" % (key, e)) from None
            except ValueError as e:
                raise _error("FormatError", "%s: a malformed value: %s" % (key, e)) from None
            if kind == "empty":
                dt, shape = v
                if dt not in _FROM_STRATA:
                    raise _error("FormatError", "%s: unknown dtype %r" % (key, dt))
                if target is not None:
                    sdt = _TO_STRATA.get(target.dtype)
                    if sdt != dt or tuple(target.shape) != tuple(shape):
                        raise _error("MismatchError", "%s: the checkpoint holds %s%s, the "
                                     "target is %s%s" % (key, dt, list(shape), sdt,
                                                         list(target.shape)))
                    continue
                v = torch.empty(shape, dtype=_FROM_STRATA[dt])
            elif target is not None:
                raise _error("MismatchError", "%s: the checkpoint holds a value (%s), the "
                             "target is a tensor" % (key, type(v).__name__))
            setter(v)
        for setter, t in self.new:
            setter(t)
        for f in self.finals:
            f()


def load(state_dict, path, process_group=None, *, pickle=False, **options):
    """Loads the checkpoint at path (or the first of several tiers, fastest first, that is
    committed and reads back intact) into state_dict, in place: tensors (and DTensors, in
    whatever layout they have now) are filled, values replaced, Stateful objects restored
    with load_state_dict. Keys of the checkpoint that the state dict lacks are ignored; a
    key of the state dict the checkpoint lacks is NotFoundError naming it, a dtype or shape
    that differs MismatchError. Returns the load's stats. options: io_threads, max_io_bytes,
    direct."""
    group = _group(process_group)
    uris = _uris(path)
    meta = _read_meta(uris, group)
    rank = group.rank if group is not None else 0
    prep, err = None, None
    try:
        prep = _LoadPrep(state_dict, meta, rank, pickle)
    except Exception as e:
        err = e
    _agree(group, "strata.torch.load", err)
    _sync_cuda(prep.cuda)
    stats = _S.load(uris, [prep.state], group.comm if group is not None else None, **options)
    _sync_loaded(prep.cuda)
    prep.finish()
    return stats


# ---- export -----------------------------------------------------------------------------

def export_safetensors(path, out, *, prefix=None, max_file_bytes=None, dtype=None,
                       progress=None, io_threads=None, direct=True):
    """Writes the tensors of the checkpoint at path, merged to their full global shapes
    whatever layout they were saved in (DTensor shards, FSDP flat pieces, replicas), as
    Hugging Face safetensors files in the directory out (made if missing):
    model-0000i-of-0000N.safetensors and model.safetensors.index.json, readable by
    safetensors.torch.load_file and transformers' from_pretrained. Values and per-rank
    entries (non-tensor state) are not exported. Memory stays bounded (windows of at most
    64 MiB; every checksum is verified); files are renamed into place only once all are
    complete, and a failure leaves none.

    prefix: stripped from the start of names ("model." turns "model.layers.0.w" into
    "layers.0.w"; other names are kept). max_file_bytes: the most tensor bytes per file
    (default 5e9; a larger tensor gets a file of its own). dtype: None keeps every saved
    dtype; torch.bfloat16 (or "bf16") converts float64/32/16 tensors to bfloat16 (round to
    nearest even), other dtypes as saved. progress: called as progress(done, total) in
    tensor bytes after each window; if it raises, the export stops with strata.AbortedError
    (the exception as its __cause__). Not collective: call it in one process (the
    checkpoint must be committed). io_threads: the reads' threads; direct=False: never
    O_DIRECT (by default the files are written with it where the file system allows, leaving
    the page cache alone). Returns {data_bytes, bytes, io_calls, seconds}.
    """
    if isinstance(dtype, torch.dtype):
        if dtype != torch.bfloat16:
            raise _error("InvalidArgumentError", "export dtype %s: only torch.bfloat16 (or None: "
                         "as saved)" % dtype)
        dtype = "bf16"
    return _S.export_safetensors(os.fspath(path), os.fspath(out), prefix=prefix,
                                 max_file_bytes=max_file_bytes, dtype=dtype, progress=progress,
                                 io_threads=io_threads, direct=direct)


# ---- checkpoint manager -----------------------------------------------------------------

_STEP_DIR = re.compile(r"step-(\d+)")


def _local_dir(uri):
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if "://" in uri:
        return None
    return uri


class CheckpointManager:
    """Checkpoints of a training loop: root is one directory, or tiers fastest first (e.g.
    ["/dev/shm/run", "/local/run", "/shared/run"]); every save writes <tier>/step-NNNNNNNN
    on every tier, and after it commits keeps the `keep` newest committed checkpoints of each
    tier (strata.retain). It holds the buffer pool (pool_bytes, allocated at the first save)
    and the saver, whose cached plan makes repeated saves of one layout cheap.

        mgr = CheckpointManager(root, keep=3)
        start = mgr.load(state) + 1 if mgr.latest() is not None else 0
        for step in range(start, n):
            ...
            h = mgr.save(step, state)     # async: h.wait_snapshot() before optimizer.step()
        mgr.close()

    With a process group every rank makes the same calls; rank 0 chooses the step and
    applies retention."""

    def __init__(self, root, *, keep=3, pool_bytes=1 << 30, process_group=None,
                 async_save=True, pickle=False):
        if isinstance(root, (list, tuple)):
            self.tiers = [os.fspath(r) for r in root]
        else:
            self.tiers = [os.fspath(root)]
        if not self.tiers:
            raise ValueError("CheckpointManager: no root")
        self.keep = int(keep)
        self.pool_bytes = int(pool_bytes)
        self.process_group = process_group
        self.async_save = bool(async_save)
        self.pickle = pickle
        self._pool = None
        self._saver = None
        self._pending = None
        self._closed = False

    def _group(self):
        return _group(self.process_group)

    def path(self, step, tier=0):
        return self.tiers[tier].rstrip("/") + "/step-%08d" % int(step)

    @property
    def pool(self):
        """The manager's strata.Pool: None until prepare() or the first save made it."""
        return self._pool

    def prepare(self):
        """Allocates the pool (pool_bytes, pre-faulted) and the saver now, at setup, instead
        of in the first save, which would then wait for that allocation. With a process
        group every rank calls it. Returns self."""
        if self._closed:
            raise ValueError("strata CheckpointManager: closed")
        self._get_saver(self._group())
        return self

    def _get_saver(self, group):
        if self._saver is None:
            self._pool = _S.Pool(self.pool_bytes) if self.pool_bytes else None
            comm = group.comm if group is not None else None
            self._saver = _S.Saver(comm, self._pool) if self._pool is not None else _S.Saver(comm)
        return self._saver

    def _retain(self, group):
        if self.keep <= 0 or (group is not None and group.rank != 0):
            return
        for t in self.tiers:
            try:
                _S.retain(t, self.keep)
            except _S.Error as e:
                warnings.warn("strata CheckpointManager: retention in %s: %s" % (t, e))

    def save(self, step, state_dict):
        """Waits for the previous save (raising its error), then saves state_dict as step on
        every tier: returns the AsyncSave (async_save=True) or the stats."""
        if self._closed:
            raise ValueError("CheckpointManager: closed")
        self.wait()
        group = self._group()
        uris = [self.path(step, i) for i in range(len(self.tiers))]
        prep = _prepare_save(state_dict, group, self.pickle)
        saver = self._get_saver(group)
        if self.async_save:
            h = saver.start(uris, [prep.state], step=int(step))
            self._pending = AsyncSave(h, prep, on_done=lambda: self._retain(group))
            return self._pending
        stats = saver.save(uris, [prep.state], step=int(step))
        self._retain(group)
        return stats

    def wait(self):
        """Waits for the save in flight (if any) to commit; raises its error."""
        p, self._pending = self._pending, None
        if p is not None:
            p.wait()

    def _scan(self):
        best = None
        for t in self.tiers:
            d = _local_dir(t)
            if d is None or not os.path.isdir(d):
                continue
            steps = sorted((int(m.group(1)) for m in map(_STEP_DIR.fullmatch, os.listdir(d))
                            if m), reverse=True)
            for s in steps:
                if best is not None and s <= best:
                    break
                try:
                    committed = _S.probe(os.path.join(d, "step-%08d" % s))["committed"]
                except _S.Error:
                    committed = False
                if committed:
                    best = s
                    break
        return best

    def latest(self):
        """The newest step with a committed checkpoint on any tier, or None."""
        group = self._group()
        if group is None or group.size == 1:
            return self._scan()
        best = self._scan() if group.rank == 0 else None
        return _values.decode(group.bcast_bytes(_values.encode(best)))[1]

    def load(self, state_dict, step=None):
        """Loads step (default: latest()) into state_dict from the fastest tier holding a
        committed copy (falling back through the others); returns the step."""
        self.wait()
        if step is None:
            step = self.latest()
            if step is None:
                raise _error("NotFoundError", "no committed checkpoint under %s"
                             % ", ".join(self.tiers))
        uris = [self.path(step, i) for i in range(len(self.tiers))]
        load(state_dict, uris, self.process_group, pickle=self.pickle)
        return int(step)

    def close(self):
        """Waits for the save in flight, then lets go of the saver and the pool."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._saver = None
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
