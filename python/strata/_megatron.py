"""Megatron-Core's sharded state as strata sees it (strata.megatron's strategies): what one
rank registers to save a sharded state dict (_SaveState) or to load into one (_LoadState),
and what a checkpoint holds for Megatron (sharded_metadata). No collective here; the
strategies run them around their own and strata's. docs/FORMAT.md, "Megatron checkpoints
saved through strata (strata.megatron)".

Names: a ShardedTensor is the strata tensor of its key (a box of it, or a flat piece: the
distributed optimizer's 1-D bucket pieces, a flattened_range of older Megatron versions);
a ShardedObject is the global blob of its unique_key ("<key>/shard_<offsets>_<shape>") holding
its object as a tree of plain values (strata.deepspeed's tree, FORMAT.md "DeepSpeed tags")
whose tensors are "<unique_key>#<i>"; the common state (the state every rank shares, which
Megatron also keeps in its own common.pt) is rank 0's, flattened as strata.torch flattens
a state dict; MANIFEST names the common state's entries, so that the rest is Megatron's."""

import collections
import ctypes
import io

import torch

# strata's internal helpers, in one place (the lead re-points them when modules move)
import strata as _S
from strata import _torchsave, _values
from strata._statedict import _SavePrep, _flatten
from strata._tensor import (_FROM_STRATA, _check_tensor, _nbytes, _readable, _sdtype,
                            _writable)
from strata._ds_entry import _Tree, _build

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                      is_main_replica)

MANIFEST = "strata.megatron"   # global blob: {"version": 1, "common": [names]}
COMMON_PT = "common.pt"        # a torch_dist checkpoint's common state, a blob of its index

# what a ShardedObject's tree holds without pickle
_PLAIN = (type(None), bool, int, float, str, bytes, io.BytesIO, list, tuple, dict,
          collections.OrderedDict, torch.Size, torch.dtype)


def _box(sh):
    """(offsets, lengths, flat) of ShardedTensor sh in its global tensor: its box (prepended
    axes of length 1), narrowed to its flattened_range where it has one; a 1-D piece off any
    regular grid (the distributed optimizer's bucket pieces) as the flat range of the whole
    1-D tensor."""
    lens = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    offs = tuple(sh.global_offset)
    fr = getattr(sh, "flattened_range", None)
    if fr is not None:
        return offs, lens, (fr.start, fr.stop)
    if sh.axis_fragmentations is None and len(lens) == 1:
        return (0,), (sh.global_shape[0],), (offs[0], offs[0] + lens[0])
    return offs, lens, None


class _ObjTree(_Tree):
    """A ShardedObject's data as a tree (strata.deepspeed's): plain values, containers,
    torch.Size, torch.dtype, io.BytesIO and tensors; anything else needs pickle=True."""

    def node(self, v, path):
        if type(v) is io.BytesIO:
            return ["v", v]       # (a value of the tagged format)
        if not self.pickle and not (isinstance(v, torch.Tensor) or type(v) in _PLAIN):
            t = type(v)
            raise _S.InvalidArgumentError(
                "%s%s: a %s.%s cannot be saved without pickle: pass pickle=True to "
                "strata.megatron.enable() (loading then unpickles it, which can run code), or "
                "keep plain values, tensors, torch.dtype there"
                % (self.name, path, t.__module__, t.__qualname__))
        return super().node(v, path)


def _blob(state, name, data, **kw):
    buf = ctypes.create_string_buffer(data, len(data))
    state.add_blob(name, data_ptr=ctypes.addressof(buf), nbytes=len(data), keep=buf, **kw)


class _SaveState:
    """One rank's strata.State for a sharded state dict (and, on rank 0, the common state):
    every replica of every ShardedTensor (strata's planner writes each distinct piece once,
    balanced over the ranks holding it), the main replica of every ShardedObject. .sources:
    the tensors the snapshot reads; .cuda: their devices."""

    def __init__(self, sharded_state_dict, rank, common=None, pickle=False):
        self.state = _S.State()
        self.sources, self.cuda = [], set()
        names = []
        if rank == 0:
            if common:
                prep = _SavePrep(common, 0, pickle, replicas=False)
                self.state, self.cuda = prep.state, set(prep.cuda)
                self.sources = [t for _, t in prep.sources]
                names = [key for _, key, _, _ in _flatten(common)]
            _blob(self.state, MANIFEST, _values.encode({"version": 1, "common": names}))
        self.common = set(names)
        seen, objs = set(), set()
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                self._tensor(sh, seen)
            elif isinstance(sh, ShardedObject):
                if is_main_replica(sh.replica_id):
                    self._object(sh, objs, pickle)
            else:
                raise CheckpointingException("strata.megatron: %r is neither a ShardedTensor "
                                             "nor a ShardedObject" % (sh,))

    def _add(self, name, t, gshape, offs, lens, flat):
        src = _readable(t)
        if src.is_cuda:
            self.cuda.add(src.device)
        self.state.add_shard(name, _sdtype(name, src), gshape, offs, lens, flat=flat,
                             data_ptr=src.data_ptr(), nbytes=_nbytes(src), device=src.is_cuda,
                             keep=src)
        self.sources.append(src)

    def _tensor(self, sh, seen):
        if sh.data is None:
            raise CheckpointingException("`data` attr is None for %s" % (sh,))
        if sh.key in self.common:
            raise _S.InvalidArgumentError("%s: both a ShardedTensor's key and an entry "
                                          "of the common state" % sh.key)
        _check_tensor(sh.key, sh.data)
        offs, lens, flat = _box(sh)
        where = (sh.key, offs, lens, flat)
        if where in seen:      # one piece twice on this rank (a replica of itself)
            return
        seen.add(where)
        self._add(sh.key, sh.data, tuple(sh.global_shape), offs, lens, flat)

    def _object(self, sh, objs, pickle):
        name = sh.unique_key
        if name in objs:
            raise CheckpointingException("strata.megatron: two main replicas of the "
                                         "ShardedObject %s on one rank" % name)
        if name in self.common:
            raise _S.InvalidArgumentError("%s: both a ShardedObject and an entry of the "
                                          "common state" % name)
        objs.add(name)
        tree = _ObjTree(name, pickle)
        root = tree.node(sh.data, "")
        for i, t in enumerate(tree.tensors):
            n = "%s#%d" % (name, i)
            self._add(n, t, tuple(t.shape), None, None, None)
        _blob(self.state, name, _values.encode(root))


# ---- load -------------------------------------------------------------------------------

class _Index:
    """What a checkpoint holds for Megatron, from a strata.Loader's index: its format
    ("strata.megatron": saved through strata; "megatron": torch_dist), tensors
    {name: (dtype, shape)}, global blobs {name: bytes}."""

    def __init__(self, ld):
        d = ld.index()
        self.format = d["f"]
        self.uri = d["uri"]
        self.tensors = {n: (dt, tuple(s)) for n, dt, s in d["t"]}
        self.blobs = {n: b for n, o, b in d["b"] if o == -1}
        if self.format not in ("strata.megatron", "megatron"):
            raise CheckpointingException("%s: a %s checkpoint, not Megatron's (saved through "
                                         "strata, or torch_dist)" % (self.uri, self.format))

    def objects_tensors(self, name):
        """{i: (dtype, shape)} of the tensors of ShardedObject name's tree."""
        p = name + "#"
        return {int(n[len(p):]): v for n, v in self.tensors.items()
                if n.startswith(p) and n[len(p):].isdigit()}


def _blob_values(ld, names, sizes):
    """{name: bytes} of global blobs, read through ld in one load."""
    st, bufs = _S.State(), {}
    for n in names:
        bufs[n] = ctypes.create_string_buffer(max(sizes[n], 1))
        st.add_blob(n, data_ptr=ctypes.addressof(bufs[n]), nbytes=sizes[n], keep=bufs[n])
    if names:
        ld.load([st])
    return {n: ctypes.string_at(ctypes.addressof(b), sizes[n]) for n, b in bufs.items()}


def sharded_metadata(ld, objects=True):
    """{key: ShardedTensor (no data, unsharded)} of the checkpoint ld reads - and with
    objects, {unique_key: ShardedObject} too (Megatron's load_tensors_metadata and
    load_sharded_metadata)."""
    ix = _Index(ld)
    if ix.format == "megatron":        # torch_dist: DCP tensors and bytes items
        common, objs = set(), [n for n in ix.blobs if n != COMMON_PT]
    else:
        man = _blob_values(ld, [MANIFEST], ix.blobs) if MANIFEST in ix.blobs else {}
        common = set()
        if man:
            kind, v = _values.decode(man[MANIFEST])
            common = set(v["common"]) if kind == "value" and isinstance(v, dict) else set()
        objs = [n for n in ix.blobs if n != MANIFEST and n not in common]
    inside = set("%s#%d" % (o, i) for o in objs for i in ix.objects_tensors(o))
    out = {}
    for n, (dt, shape) in ix.tensors.items():
        if n in common or n in inside:
            continue
        t = torch.empty(shape, dtype=_FROM_STRATA[dt], device="meta")
        out[n] = ShardedTensor.from_rank_offsets(n, t).without_data()
    if objects:
        for n in objs:
            try:
                o = ShardedObject.empty_from_unique_key(n)
            except Exception:      # a bytes item of another kind: not Megatron's object
                continue
            out[o.unique_key] = o
    return out


class _LoadState:
    """One rank's strata.State for loading a sharded state dict from the checkpoint of
    index ix: each ShardedTensor's piece (its data allocated where None), each
    ShardedObject's blob and tensors. finish() after the load maps the state dict's leaves
    to their loaded values (Megatron's strategies return it so)."""

    def __init__(self, sharded_state_dict, ix, pickle=False):
        self.ix, self.pickle = ix, pickle
        self.state = _S.State()
        self.copies, self.cuda = [], set()
        self.objects = {}     # unique_key: (blob buffer, {i: tensor})
        self.values = {}      # id(ShardedBase): what replaces it
        counts = collections.Counter()
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                self._tensor(sh)
            elif isinstance(sh, ShardedObject):
                self._object(sh, counts)
            else:
                raise CheckpointingException("strata.megatron: %r is neither a ShardedTensor "
                                             "nor a ShardedObject" % (sh,))

    def _missing(self, what, key):
        return CheckpointingException(
            "%s %s from the sharded state dict is not in the checkpoint %s (StrictHandling "
            "other than ASSUME_OK_UNEXPECTED reports such keys before loading)"
            % (what, key, self.ix.uri))

    def _tensor(self, sh):
        if sh.key not in self.ix.tensors:
            raise self._missing("ShardedTensor", sh.key)
        dt, saved = self.ix.tensors[sh.key]
        if sh.data is None:
            sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
        else:     # (as Megatron's torch_dist: the loaded value shares the data's storage)
            sh.data = sh.data.detach()
            if sh.allow_shape_mismatch:
                sh.data.zero_()
        _check_tensor(sh.key, sh.data)
        self.values[id(sh)] = sh.data
        offs, lens, flat = _box(sh)
        view = sh.data
        if saved != tuple(sh.global_shape):
            if not sh.allow_shape_mismatch:
                raise CheckpointingException(
                    "Global shape mismatch for loaded (%s) and expected (%s) tensor for key %s"
                    % (saved, tuple(sh.global_shape), sh.key))
            if flat is not None or len(saved) != len(lens):
                raise CheckpointingException("%s: allow_shape_mismatch with a flat piece or "
                                             "another rank: strata loads neither" % sh.key)
            # what of the box the saved tensor holds (the rest stays zero)
            clip = [min(o + n, s) - o for o, n, s in zip(offs, lens, saved)]
            if min(clip) <= 0:
                return
            view = sh.data.view(lens)
            for d, n in enumerate(clip):
                view = view.narrow(d, 0, n)
            lens = tuple(clip)
        buf, fix = _writable(view)
        if fix is not None:
            self.copies.append(fix)
        if buf.is_cuda:
            self.cuda.add(buf.device)
        self.state.add_shard(sh.key, _sdtype(sh.key, buf), saved, offs, lens, flat=flat,
                             data_ptr=buf.data_ptr(), nbytes=_nbytes(buf), device=buf.is_cuda,
                             keep=buf)

    def _object(self, sh, counts):
        name = sh.unique_key
        if name not in self.ix.blobs:
            raise self._missing("ShardedObject", name)
        self.values[id(sh)] = (name, counts[name])
        counts[name] += 1
        if name in self.objects:
            return
        size = self.ix.blobs[name]
        buf = ctypes.create_string_buffer(max(size, 1))
        self.state.add_blob(name, data_ptr=ctypes.addressof(buf), nbytes=size, keep=buf)
        tensors = {}
        if self.ix.format == "strata.megatron":
            for i, (dt, shape) in self.ix.objects_tensors(name).items():
                t = torch.empty(shape, dtype=_FROM_STRATA[dt])
                tensors[i] = t
                self.state.add_shard("%s#%d" % (name, i), dt, shape, data_ptr=t.data_ptr(),
                                     nbytes=_nbytes(t), keep=t)
        self.objects[name] = (buf, size, tensors)

    def _decode(self, name):
        buf, size, tensors = self.objects[name]
        data = ctypes.string_at(ctypes.addressof(buf), size)
        where = "%s: ShardedObject %s" % (self.ix.uri, name)
        if self.ix.format == "megatron":   # torch_dist: torch.save([data, ...]) of a rank
            try:
                return _torchsave.archive_values(data, name=where)
            except _S.FormatError:
                if not self.pickle:
                    raise
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        try:
            kind, tree = _values.decode(data)
        except ValueError as e:
            raise _S.FormatError("%s: %s" % (where, e)) from None
        if kind != "value":
            raise _S.FormatError("%s is not a tree of values" % where)
        if not self.pickle and _has_pickle(tree):
            raise _S.InvalidArgumentError("%s holds a pickled object: load it with "
                                          "strata.megatron.enable(pickle=True) (unpickling "
                                          "can run code)" % where)
        try:
            return [_build(tree, tensors, self.pickle, where)]
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
            raise _S.FormatError("%s: a malformed tree (%s: %s)"
                                 % (where, type(e).__name__, e)) from None

    def finish(self):
        """After the load: copies into non-contiguous targets, objects decoded; returns
        {id(ShardedBase): loaded value}."""
        with torch.no_grad():
            for target, buf in self.copies:
                target.copy_(buf)
        decoded = {n: self._decode(n) for n in self.objects}
        out = {}
        for k, v in self.values.items():
            if isinstance(v, tuple):
                name, i = v
                objs = decoded[name]
                if not isinstance(objs, list) or not objs:
                    raise _S.FormatError("%s: ShardedObject %s: not a list of objects"
                                         % (self.ix.uri, name))
                v = objs[min(i, len(objs) - 1)]
            out[k] = v
        return out


def _has_pickle(n):
    if not isinstance(n, list) or not n:
        return False
    if n[0] == "p":
        return True
    if n[0] in ("l", "t"):
        return any(_has_pickle(x) for x in n[1])
    if n[0] in ("d", "o"):
        return any(_has_pickle(k) or _has_pickle(x) for k, x in n[1])
    if n[0] in ("e", "x"):
        return _has_pickle(n[2])
    return False
