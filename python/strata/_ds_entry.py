"""strata.deepspeed's entries: the object DeepSpeed saves as one file of a tag, as one
entry of the tag's strata checkpoint - a tree of plain values (nodes [tag, ...], in the
tagged value format of docs/FORMAT.md "Python values", a blob) whose tensors are strata
tensors "<file>#<i>" or ranges of named ones (ZeRO's flat partitions, _ds_zero) - and the
same object read back (load_entry). Used by the engine (deepspeed.py) and by the way back
to DeepSpeed's own files (_ds_convert.py). Threading: the caller's thread only."""

import collections
import ctypes
import importlib
import math
import pickle as _pickle

import torch

import strata as _S
from strata import _ds_zero, _values
from strata._tensor import _FROM_STRATA, _check_tensor, _nbytes, _readable, _sdtype

# DeepSpeed's objects in its checkpoints, rebuilt from their fields (as pickle would, by
# __new__ and __dict__) or, for enums, from their value; nothing else is ever imported
_OBJECTS = {"deepspeed.runtime.fp16.loss_scaler.LossScaler",
            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
            "deepspeed.utils.tensor_fragment.fragment_address"}
_ENUMS = {"deepspeed.runtime.zero.config.ZeroStageEnum"}


def _qualname(t):
    return "%s.%s" % (t.__module__, t.__qualname__)


def _allowed(qn, table):
    if qn not in table:
        raise _S.FormatError(
            "a DeepSpeed entry names the class %r, which strata "
            "does not rebuild" % qn)
    mod, _, name = qn.rpartition(".")
    return getattr(importlib.import_module(mod), name)


# ---- an object as plain values and tensors ----------------------------------------------

class _Tree:
    """One file's object as a tree of plain values (nodes [tag, ...]) and its tensors."""

    def __init__(self, name, pickle, layout=None, named=None, whole=None, frags=None):
        self.name, self.pickle = name, pickle
        self.tensors, self._seen = [], {}
        self.layout = layout or {}     # ZeRO flat partitions (_ds_zero.layout)
        # {name: (shape, start, view)}; start None: view is the whole tensor `name`
        self.named = named if named is not None else {}
        self.whole = whole or {}       # {id(tensor): name}: stored as the whole tensor name
        self.frags = frags or {}       # {id(tensor): pieces}: a flat partition (_model_names)

    def node(self, v, path):
        t = type(v)
        if v is None or t in (bool, int, float, str, bytes):
            return ["v", v]
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if t in (list, tuple):
            return ["l" if t is list else "t",
                    [self.node(x, "%s[%d]" % (path, i)) for i, x in enumerate(v)]]
        if t in (dict, collections.OrderedDict):
            return ["d" if t is dict else "o",
                    [[self.node(k, "%s<key>" % path), self.node(x, "%s[%r]" % (path, k))]
                     for k, x in v.items()]]
        if t is torch.Size:
            return ["S", list(v)]
        if t is torch.dtype:
            return ["y", str(v).replace("torch.", "")]
        qn = _qualname(t)
        if qn in _ENUMS:
            return ["e", qn, self.node(v.value, path)]
        if qn in _OBJECTS:
            return ["x", qn, self.node(dict(vars(v)), path)]
        if not self.pickle:
            raise _S.InvalidArgumentError(
                "%s%s: a %s cannot be saved without pickle: pass pickle=True to "
                "strata.deepspeed.enable() (loading then unpickles it, which can run "
                "code), or keep plain values there" % (self.name, path, qn))
        return ["p", _pickle.dumps(v)]

    def tensor(self, v, path):
        if id(v) in self._seen:      # one tensor twice in a file (tied weights): once
            return self._seen[id(v)]
        _check_tensor(self.name + path, v)
        flags = (1 if isinstance(v, torch.nn.Parameter) else 0) | (2 if v.requires_grad else 0)
        ps = self.frags.get(id(v))
        if ps is None and self.layout:
            ps = _ds_zero.pieces(self.layout, v)
        whole = self.whole.get(id(v))
        if whole is not None and v.numel() and whole not in self.named:
            _sdtype(self.name + path, v)
            n = ["N", whole, flags]
            self.named[whole] = (tuple(v.shape), None, _readable(v))
        elif ps is not None and not any(p[2] in self.named for p in ps):
            n = ["F", _sdtype(self.name + path, v), v.numel(), flags, []]
            for off, cnt, name, start, shape in ps:
                piece = _readable(v.detach().narrow(0, off, cnt))
                if name is None:
                    n[4].append(["T", len(self.tensors), 0])
                    self.tensors.append(piece)
                else:
                    n[4].append(["n", name, start, cnt])
                    self.named[name] = (shape, start, piece)
        elif v.numel() == 0:
            n = ["E", _sdtype(self.name + path, v), list(v.shape), flags]
        else:
            _sdtype(self.name + path, v)
            n = ["T", len(self.tensors), flags]
            self.tensors.append(_readable(v))
        self._seen[id(v)] = n
        return n


def _tensor_name(entry, i):
    return "%s#%d" % (entry, i)


def _build(n, tensors, pickle, where):
    """The object of node n (tensors: the entry's loaded tensors)."""
    tag = n[0]
    if tag == "v":
        return n[1]
    if tag in ("l", "t"):
        xs = [_build(x, tensors, pickle, where) for x in n[1]]
        return xs if tag == "l" else tuple(xs)
    if tag in ("d", "o"):
        d = {} if tag == "d" else collections.OrderedDict()
        for k, x in n[1]:
            d[_build(k, tensors, pickle, where)] = _build(x, tensors, pickle, where)
        return d
    if tag == "S":
        return torch.Size(n[1])
    if tag == "y":
        dt = getattr(torch, n[1], None)
        if not isinstance(dt, torch.dtype):
            raise _S.FormatError("%s: unknown dtype %r" % (where, n[1]))
        return dt
    if tag == "N":                # (_load_named appended the tensor read)
        t = n[3]
        return (torch.nn.Parameter(t, requires_grad=bool(n[2] & 2)) if n[2] & 1
                else t.requires_grad_(True) if n[2] & 2 else t)
    if tag == "F":
        if len(n) < 6:            # its named pieces not loaded (partitions=False)
            return None
        t, off = n[5], 0          # (_load_flat checked that its pieces cover it)
        for x in n[4]:
            if x[0] == "T":       # a gap (padding): a plain tensor of the entry
                g = tensors[x[1]].reshape(-1)
                t.narrow(0, off, g.numel()).copy_(g)
                off += g.numel()
            else:
                off += x[3]
        return (torch.nn.Parameter(t, requires_grad=bool(n[3] & 2)) if n[3] & 1
                else t.requires_grad_(True) if n[3] & 2 else t)
    if tag in ("T", "E"):
        if tag == "T":
            t = tensors[n[1]]
        else:
            t = torch.empty(n[2], dtype=_FROM_STRATA[n[1]])
        flags = n[-1]
        if flags & 1:
            return torch.nn.Parameter(t, requires_grad=bool(flags & 2))
        return t.requires_grad_(True) if flags & 2 else t
    if tag == "e":
        return _allowed(n[1], _ENUMS)(_build(n[2], tensors, pickle, where))
    if tag == "x":
        cls = _allowed(n[1], _OBJECTS)
        o = cls.__new__(cls)
        o.__dict__.update(_build(n[2], tensors, pickle, where))
        return o
    if tag == "p":
        if not pickle:
            raise _S.InvalidArgumentError(
                "%s: holds a pickled object; load it with "
                "strata.deepspeed.enable(pickle=True) (unpickling can run code)"
                % where)
        return _pickle.loads(n[1])
    raise _S.FormatError("%s: a node of unknown kind %r" % (where, tag))


def _blob(state, name, buf, **kw):
    """Registers the bytearray buf (never empty: a value starts with its magic) as blob name."""
    c = (ctypes.c_char * len(buf)).from_buffer(buf)
    state.add_blob(name, data_ptr=ctypes.addressof(c), nbytes=len(buf), keep=c, **kw)


# ---- an entry read back -----------------------------------------------------------------

def load_entry(ckpt, entry, pickle=False, partitions=True, loader=None):
    """The object DeepSpeed saved as entry (a file's path in its tag directory) in the
    strata checkpoint ckpt (save_dir/tag/strata); in this process only. partitions=False:
    ZeRO flat partitions (stored as named ranges) come back as None, unread. loader: ckpt
    open already (a strata.Loader of it, kept open), else it is opened here. Raises
    strata.MissingError / IncompleteError for a checkpoint not there or not committed,
    NotFoundError for an entry it lacks; a malformed tree is FormatError, a flat partition
    whose pieces name a tensor the checkpoint lacks NotFoundError, one whose pieces fall
    short of it UnfilledError (_load_flat)."""
    if loader is None:
        with _S.Loader([ckpt]) as ld:
            return load_entry(ckpt, entry, pickle, partitions, ld)
    ix = loader.index()
    idx = _ds_zero.tensor_index(ix)
    owners = [b for b in ix["b"] if b[0] == entry]
    if not owners:
        raise _S.NotFoundError("%s: no entry %r" % (ckpt, entry))
    if owners[0][2] == 0:
        raise _S.FormatError("%s: entry %r is empty" % (ckpt, entry))
    state = _S.State()
    blob = bytearray(owners[0][2])
    _blob(state, entry, blob, owner=owners[0][1])
    prefix = entry + "#"
    tensors = {}
    for name, (dtype, shape) in idx.items():
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            x = torch.empty(shape, dtype=_FROM_STRATA[dtype])
            tensors[int(name[len(prefix):])] = x
            state.add_shard(name, dtype, shape, data_ptr=x.data_ptr(), nbytes=_nbytes(x), keep=x)
    loader.load([state])
    where = "%s: entry %r" % (ckpt, entry)
    try:
        kind, tree = _values.decode(bytes(blob))
    except ValueError as e:
        raise _S.FormatError("%s: %s" % (where, e)) from None
    if kind != "value":
        raise _S.FormatError("%s is not a tree" % where)
    try:
        _load_named(loader, idx, where, tree)
        if partitions:
            _load_flat(loader, idx, where, entry, tree)
        return _build(tree, tensors, pickle, where)
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise _S.FormatError(
            "%s: a malformed tree (%s: %s)"
            % (where, type(e).__name__, e)) from None


def _flat_nodes(n, kind="F"):
    """The nodes of tree n tagged kind: "F" (ZeRO flat partitions), "N" (whole named
    tensors)."""
    tag = n[0]
    if tag == kind:
        yield n
    elif tag in ("l", "t"):
        for x in n[1]:
            yield from _flat_nodes(x, kind)
    elif tag in ("d", "o"):
        for k, x in n[1]:
            yield from _flat_nodes(k, kind)
            yield from _flat_nodes(x, kind)
    elif tag in ("e", "x"):
        yield from _flat_nodes(n[2], kind)


def _load_named(ld, idx, where, tree):
    """Reads the named tensor of every "N" node of tree whole, through the open loader ld
    (idx: its tensors), appending it to the node; one read for them all. A malformed node
    is FormatError, a name the checkpoint lacks NotFoundError."""
    state, got = _S.State(), {}
    for n in _flat_nodes(tree, "N"):
        if len(n) != 3 or type(n[1]) is not str or type(n[2]) is not int:
            raise _S.FormatError("%s: a malformed named tensor %.200r" % (where, n))
        if n[1] not in got:
            t = idx.get(n[1])
            if t is None:
                raise _S.NotFoundError("%s: no tensor %r in the checkpoint" % (where, n[1]))
            x = got[n[1]] = torch.empty(t[1], dtype=_FROM_STRATA[t[0]])
            state.add_shard(n[1], t[0], t[1], data_ptr=x.data_ptr(), nbytes=_nbytes(x), keep=x)
        n.append(got[n[1]])
    if got:
        ld.load([state])


def _count(x):
    return type(x) is int and x >= 0


def _load_flat(ld, idx, where, entry, tree):
    """Reads the named ranges of every "F" node of tree into a new flat tensor, appended
    to the node (its gaps are filled by _build from the entry's own tensors), through the
    open loader ld (idx: its tensors). Each node's pieces must be well formed and cover
    its numel exactly: fewer elements are UnfilledError, more FormatError; a gap tensor or
    a named tensor the checkpoint lacks NotFoundError (read_ranges: another dtype
    MismatchError, a range outside the named tensor FormatError)."""
    wants = []
    for n in _flat_nodes(tree):
        if (len(n) != 5 or n[1] not in _FROM_STRATA or not _count(n[2]) or type(n[3]) is not int
                or type(n[4]) is not list):
            raise _S.FormatError("%s: a malformed flat partition %.200r" % (where, n))
        t = torch.empty(n[2], dtype=_FROM_STRATA[n[1]])
        off = 0
        for x in n[4]:
            if type(x) is list and len(x) == 3 and x[0] == "T" and _count(x[1]):
                gap = idx.get(_tensor_name(entry, x[1]))
                if gap is None:
                    raise _S.NotFoundError(
                        "%s: a flat partition's gap, tensor %r, is not "
                        "in the checkpoint" % (where, _tensor_name(entry, x[1])))
                cnt = math.prod(gap[1])
            elif (type(x) is list and len(x) == 4 and x[0] == "n" and type(x[1]) is str
                  and _count(x[2]) and _count(x[3])):
                cnt = x[3]
                if off + cnt <= n[2]:
                    wants.append((x[1], None, x[2], cnt, t.narrow(0, off, cnt)))
            else:
                raise _S.FormatError("%s: a malformed flat piece %.200r" % (where, x))
            off += cnt
            if off > n[2]:
                raise _S.FormatError(
                    "%s: flat pieces of more than the partition's %d "
                    "elements" % (where, n[2]))
        if off < n[2]:
            raise _S.UnfilledError(
                "%s: flat pieces of %d elements for a partition of %d"
                % (where, off, n[2]))
        n.append(t)
    _ds_zero.read_ranges(ld, idx, where, wants)
