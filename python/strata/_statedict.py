"""State dicts as strata saves them: per-rank values, flattening to dotted keys (walked and
named as _keys says), and the strata.State a rank registers to save a state dict
(_SavePrep; loading into one is _loadprep's). No collective here: strata.torch runs them
around its own (_agree) and strata's."""

import collections.abc
import ctypes
import hashlib
import random as _pyrandom

import torch

import strata as _S
from strata import _values
from strata._dtensor import _dtensor_boxes, _is_dtensor
from strata._keys import _is_container, _is_stateful, _items, _join, _pr_name
from strata._tensor import (_check_tensor, _hash_tensor, _nbytes, _readable, _sdtype,
                            _with_key)

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


# ---- flattening ---------------------------------------------------------------------------

def _flatten(state_dict, frozen_params=None):
    """[(kind, key, value, per_rank)]: kind "tensor" or "value". frozen_params (a set, or
    None) gets the keys of the parameters with requires_grad=False of every nn.Module met."""
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
            if frozen_params is not None and isinstance(v, torch.nn.Module):
                frozen_params.update(_join(key, n) for n, p in
                                     v.named_parameters(remove_duplicate=False)
                                     if not p.requires_grad)
            sd = v.state_dict()
            if not isinstance(sd, collections.abc.Mapping):
                raise _S.InvalidArgumentError(
                    "%s: state_dict() returned a %s, not a dict"
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
            raise _S.InvalidArgumentError(
                "two entries of the state dict flatten to the same key %r" % e[1])
        seen.add(e[1])
    return out


# ---- save -------------------------------------------------------------------------------

def _frozen_test(frozen, params):
    """frozen= (save, async_save, CheckpointManager) as a test of (key, tensor) -> the name
    of frozen= that marks it (True where a callable or True did), or None. frozen: None
    (nothing), True (the parameters with requires_grad=False of the modules in the state
    dict: their keys are params), a callable (key, tensor) -> bool, or names: a str or an
    iterable of them, each a key of the flattened state dict or a prefix of keys ending
    before a dot ("model.base" marks "model.base.weight")."""
    if frozen is None or frozen is False:
        return None
    if frozen is True:
        return lambda key, t: key in params or None
    if callable(frozen):
        return lambda key, t: bool(frozen(key, t)) or None
    names = [frozen] if isinstance(frozen, str) else list(frozen)
    for n in names:
        if not isinstance(n, str) or not n:
            raise _S.InvalidArgumentError(
                "frozen=: %r is not a name (a key of the "
                "state dict, or a prefix of keys ending before a dot)" % (n,))
    names = set(names)

    def test(key, t):
        parts = key.split(".")
        for i in range(1, len(parts) + 1):
            k = ".".join(parts[:i])
            if k in names:
                return k
        return None
    test.names = names
    return test


def _version_of(t):
    """What the _version rule compares (CheckpointManager(trust_version=True)): where t's
    bytes are and its version counter - for a plain tensor (not a subclass such as DTensor)
    read in place (contiguous, no conj/neg bit), not an inference tensor (which has no
    counter); else None (never skipped by the rule)."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_inference()
            or not t.is_contiguous() or t.is_conj() or t.is_neg()):
        return None
    return (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.data_ptr(),
            tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


class _SavePrep:
    """One rank's strata.State for a state dict, and its replica hashes (only with other
    ranks to compare with: alone, hashing every plain tensor would only add to the stall).
    frozen (frozen=, _frozen_test) and unmoved (a test of (key, tensor): the manager's
    _version rule) choose the tensors registered unchanged=True (STRATA_SHARD_UNCHANGED)."""

    def __init__(self, state_dict, rank, pickle, replicas=True, frozen=None, unmoved=None):
        self.rank = rank
        self.pickle = pickle
        self.replicas = replicas
        self.state = _S.State()
        self.checks = []
        self.cuda = set()
        self.sources = []   # (name, tensor the engine reads)
        self.plain = []     # (key, tensor read in place): the _version rule's record
        params = set() if frozen is True else None
        items = _flatten(state_dict, params)
        marks = _frozen_test(frozen, params)
        matched = set()
        for kind, key, v, pr in items:
            try:
                if kind == "tensor":
                    by = marks(key, v) if marks is not None else None
                    if by is not None:
                        matched.add(by)
                    mark = by is not None or (unmoved is not None and unmoved(key, v))
                    self._tensor(key, v, pr, mark)
                else:
                    self._value(key, v, pr)
            except _S.Error as e:
                raise _with_key(e, key) from None
        missing = sorted(getattr(marks, "names", set()) - matched)
        if missing:
            raise _S.InvalidArgumentError(
                "frozen=: %r names no tensor of the state dict "
                "(a key, or a prefix of keys ending before a dot)" % missing[0])

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
                raise _S.InvalidArgumentError(
                    "%s%s: %s cannot be saved without pickle: pass pickle=True to "
                    "both save and load (loading then unpickles it, which can run "
                    "code), or store it as None/bool/int/float/str/bytes/list/tuple/"
                    "dict" % (key, e.path, e)) from None
            data = _values.encode_pickle(v)
        self._blob(key, data, pr)

    def _tensor(self, key, t, pr, mark=False):
        _check_tensor(key, t)
        sdt = _sdtype(key, t)
        if _is_dtensor(t):
            if pr:
                raise _S.InvalidArgumentError(
                    "%s: per_rank() of a DTensor: a DTensor is already split over "
                    "the ranks; save it without the marker" % key)
            gshape = tuple(t.shape)
            if t.numel() == 0:
                self._blob(key, _values.encode_empty_tensor(sdt, gshape), False)
                return
            for offs, lens, view in _dtensor_boxes(key, t):
                src = _readable(view)
                self._shard(key, sdt, gshape, offs, lens, src, mark)
                self._source(key, view, src)
            return
        if t.numel() == 0:
            self._blob(key, _values.encode_empty_tensor(sdt, tuple(t.shape)), pr)
            return
        src = _readable(t)
        name = _pr_name(key, self.rank) if pr else key
        self._shard(name, sdt, tuple(src.shape), None, None, src, mark)
        self._source(name, t, src)
        if src is t or src.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            self.plain.append((key, src))
        if not pr and self.replicas:
            self.checks.append((key, _hash_tensor(src)))

    def _source(self, name, t, src):
        """Keeps src for async_save's check of in-place changes during the snapshot, unless
        it is a copy made here (a change to t then cannot reach the checkpoint)."""
        if src is t or src.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            self.sources.append((name, src))

    def _shard(self, name, sdt, gshape, offs, lens, src, mark=False):
        if src.is_cuda:
            self.cuda.add(src.device)
        self.state.add_shard(name, sdt, gshape, offs, lens, data_ptr=src.data_ptr(),
                             nbytes=_nbytes(src), device=src.is_cuda, keep=src,
                             unchanged=mark)
