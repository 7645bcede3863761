"""State dicts as strata loads into them: what the checkpoint holds, from the index of the
Loader that loads it (_Meta), and the strata.State a rank registers to load into a state
dict, matched against it before anything is written (_LoadPrep), then finished: blobs
decoded and checked, values set, Stateful objects restored. No collective here:
strata.torch.load runs them around its own (_agree) and strata's."""

import bisect
import collections.abc
import ctypes
import re

import torch

import strata as _S
from strata import _torchsave, _values
from strata._dtensor import _dtensor_boxes, _is_dtensor
from strata._keys import _is_container, _is_stateful, _items, _join, _pr_name, _rebuild
from strata._statedict import PerRank
from strata._tensor import (_FROM_STRATA, _TO_STRATA, _check_tensor, _nbytes, _sdtype,
                            _with_key, _writable)


def _plain(v, depth=0):
    """True if v holds no tensor, no Stateful and no per_rank (it is one value)."""
    if isinstance(v, (torch.Tensor, PerRank)) or _is_stateful(v):
        return False
    if _is_container(v) and depth < 1000:
        return all(_plain(c, depth + 1) for _, c in _items(v))
    return True


def _bump_version(t):
    """Moves t's version counter, as an in-place op would (none for an inference tensor)."""
    if not t.is_inference():
        torch.autograd.graph.increment_version(t)


class _Meta:
    """What load needs to know of the checkpoint: tensor dtypes and shapes, blob sizes, from
    the index of the Loader that loads it (strata.Loader.index(): no second read)."""

    _VALUE = (None, -1)   # value_src of a value of a pickle (a torch.save source's)

    def __init__(self, d):
        self.step = d["step"]
        self.uri = d["uri"]
        self.format = d.get("f", "strata")
        self.tensors = {n: (dt, tuple(shape)) for n, dt, shape in d["t"]}
        self.blobs = {(n, o): b for n, o, b in d["b"]}
        # a torch.save source: its values are in its files' pickles (never executed)
        self.values = {}
        for name, pkl in d.get("p", []):
            self.values.update(_torchsave.pickle_values(pkl, name))
        # Megatron torch_dist: the state every rank shares, common.pt's values (of_loader);
        # a common.pt the restricted reader refuses (a global off the allow-list, e.g. an
        # argparse.Namespace) fails only a load that asks for a key not found elsewhere,
        # naming why (missing())
        self.common_error = d.get("c_error")
        self.values.update((k, v) for k, v in d.get("c", {}).items() if k not in self.tensors)
        self.names = sorted(set(self.tensors) | set(n for n, _ in self.blobs)
                            | set(self.values))

    @property
    def owners(self):
        """The ranks that saved per-rank entries (only an error message needs them)."""
        return sorted(set(o for _, o in self.blobs if o >= 0)
                      | set(int(m.group(1)) for m in
                            (re.search(r"@rank(\d+)$", n) for n in self.tensors) if m))

    @staticmethod
    def of_loader(ld):
        """What _Meta takes, from the index of the strata.Loader ld (no second read); for a
        torch.save source also its files' pickles (its blobs), loaded through ld (with a
        group every rank calls this: each pickle is read once and reaches every rank)."""
        d = ld.index()
        if d["f"] == "torch.save":   # its blobs are its files' pickles
            d["p"] = _load_blobs(ld, d["b"])
            d["b"] = []
        elif d["f"] == "megatron":
            d["c"], d["c_error"] = _common_values(ld, d)
        return d

    def value_src(self, key, rank):
        if key in self.values:
            return self._VALUE
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
        owners = self.owners
        if any((key, o) in self.blobs for o in owners) or any(
                _pr_name(key, o) in self.tensors for o in owners):
            return _S.NotFoundError(
                "%s: the checkpoint holds it per rank, but not for rank %d (saved by "
                "ranks %s): per-rank values are not resharded"
                % (key, rank, _ranges(owners)))
        if isinstance(self.common_error, _S.ChecksumError):
            return _S.ChecksumError(
                "%s: not in the checkpoint's index, and its common.pt "
                "is corrupt: %s" % (key, self.common_error))
        if self.common_error is not None:
            return _S.NotFoundError(
                "%s: not in the checkpoint's index, and its common.pt "
                "could not be read: %s" % (key, self.common_error))
        return _S.NotFoundError("%s: not in the checkpoint" % key)


def _mismatch(key, dt, shape, sdt, tshape, cast):
    """The MismatchError of a tensor saved as dt[shape] whose target is sdt[tshape],
    saying what would load it."""
    why = ""
    if tuple(shape) == tuple(tshape) and dt != sdt:
        if not _S.load_converts(dt, sdt, cast=True):
            why = (" (strata converts floats to floats and integers only where exact, not %s "
                   "to %s)" % (dt, sdt))
        elif not cast:
            why = (" (a narrowing conversion, which rounds: load with cast=True to convert "
                   "it, to nearest even)")
    return _S.MismatchError(
        "%s: the checkpoint holds %s%s, the target is %s%s%s"
        % (key, dt, list(shape), sdt, list(tshape), why))


def _copy_in(t, x):
    with torch.no_grad():
        t.copy_(x)


def _dcp_value(key, data, target):
    """A non-tensor value of a PyTorch DCP checkpoint: its blob is the torch.save archive of
    the object (docs/FORMAT.md, "DCP as strata reads it"), decoded by strata's restricted
    reader (_torchsave.archive_values: C, never Python's pickle; an io.BytesIO, which DCP
    saves the same way, comes back as one)."""
    if target is not None:
        raise _S.MismatchError("%s: the checkpoint holds a value, the target is a tensor" % key)
    return _torchsave.archive_values(data, name=key)


def _load_blobs(ld, blobs):
    """[(name, bytes)] of the global blobs ([name, owner, size] of Loader.index()) through
    the loader ld, in one load."""
    bufs = [ctypes.create_string_buffer(max(size, 1)) for _, _, size in blobs]
    st = _S.State()
    for (name, owner, size), buf in zip(blobs, bufs):
        st.add_blob(name, data_ptr=ctypes.addressof(buf), nbytes=size, owner=owner, keep=buf)
    if blobs:
        ld.load([st])
    return [(name, ctypes.string_at(ctypes.addressof(buf), size))
            for (name, _, size), buf in zip(blobs, bufs)]


_MG_COMMON = "common.pt"


def _common_values(ld, d):
    """Megatron torch_dist: ({flattened key: value} of common.pt, the state every rank
    shares; the strata.Error that refused it, or None). common.pt is the global blob
    "common.pt" of the index (src_megatron.c), taken out of d["b"]: read through the loader
    ld as every blob is (the file checked to be the one opened; with a group, read once and
    reaching every rank, each zip entry's CRC-32 checked), parsed by strata's restricted
    torch.save reader. A common.pt that fails its CRC-32s is refused like one the reader
    refuses (its bytes never reach a value; a key only it could hold is ChecksumError); a
    read that fails otherwise raises the loader's error."""
    blob = [b for b in d["b"] if b[0] == _MG_COMMON and b[1] == -1]
    if not blob:
        return {}, None
    d["b"] = [b for b in d["b"] if b is not blob[0]]
    name = ld.uri.rstrip("/") + "/" + _MG_COMMON
    if blob[0][2] > _torchsave.MAX_FILE_VALUES:
        return {}, _S.FormatError(
            "%s: over %d bytes, the most read for its values"
            % (name, _torchsave.MAX_FILE_VALUES))
    try:
        data = _load_blobs(ld, blob)[0][1]
    except _S.ChecksumError as e:
        return {}, e
    try:
        return _torchsave.file_values(data, name), None
    except _S.Error as e:
        return {}, e


def _ranges(xs):
    xs = sorted(xs)
    if xs and xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return "%d-%d" % (xs[0], xs[-1])
    return ",".join(str(x) for x in xs[:16]) + (",..." if len(xs) > 16 else "")


def _materialise(t):
    """A tensor to load into in place of t, one on the meta device (DCP's load does the
    same): uninitialised, of t's dtype and shape, on the CPU; a DTensor's local tensor on
    its mesh's device type (the current CUDA device for "cuda"), same mesh and placements."""
    if not _is_dtensor(t):
        return torch.empty(tuple(t.shape), dtype=t.dtype)
    mesh = t.device_mesh
    dev = torch.device("cpu")
    if mesh.device_type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    local = torch.empty(tuple(t._local_tensor.shape), dtype=t.dtype, device=dev)
    return type(t).from_local(local, device_mesh=mesh, placements=t.placements,
                              run_check=False, shape=t.size(), stride=t.stride())


class _LoadPrep:
    """One rank's strata.State for loading into a state dict, and what to do after."""

    def __init__(self, state_dict, meta, rank, pickle, cast=False, partial=False):
        if not isinstance(state_dict, collections.abc.Mapping):
            raise TypeError("strata.torch.load: a state dict is a dict; got %s"
                            % type(state_dict).__name__)
        self.meta = meta
        self.rank = rank
        self.pickle = pickle
        self.cast = cast    # any dtype strata converts (else only widenings: _converts)
        self.partial = partial
        self.missing = []   # partial: the keys the checkpoint lacks, left as they are
        self.state = _S.State()
        self.copies = []    # (target, buffer): copy after the load
        self.inplace = []   # tensors the load writes through their address
        self.blobs = []     # (key, buffer, size, setter, tensor target or None)
        self.values = []    # (setter, value): values of a pickle
        self.new = []       # (setter, tensor): values saved as tensors
        self.finals = []    # post-order: tuple rebuilds, load_state_dict
        self.cuda = set()
        self._container(state_dict, "", False, None, True)

    def _walk(self, v, key, pr, setter, fill):
        if isinstance(v, PerRank):
            def set_pr(x, h=v):
                h.value = x
            self._walk(v.value, key, True, set_pr, fill)
            return
        if isinstance(v, torch.Tensor):
            try:
                self._tensor(key, v, setter)
            except _S.Error as e:
                raise _with_key(e, key) from None
            return
        if _is_stateful(v):
            sd = v.state_dict()
            if not isinstance(sd, collections.abc.Mapping):
                raise _S.InvalidArgumentError(
                    "%s: state_dict() returned a %s, not a dict"
                    % (key, type(sd).__name__))
            self._container(sd, key, pr, None, False)
            self.finals.append(lambda obj=v, sd=sd: obj.load_state_dict(sd))
            return
        if _is_container(v):
            m = self.meta
            if not _plain(v) or (m.value_src(key, self.rank) is None
                                 and m.tensor_name(key, self.rank) is None
                                 and m.has_prefix(key)):
                self._container(v, key, pr, setter, fill)
                return
        self._value(key, pr, setter)

    def _container(self, v, key, pr, setter, fill):
        items = _items(v)
        if not items and key and self.meta.has_prefix(key):
            if fill and isinstance(v, collections.abc.MutableMapping):
                self._fill(v, key)
                return
            raise _S.NotFoundError(
                "%s: the checkpoint holds entries under %r but the target's %r is "
                "empty (an optimizer whose state is not initialised yet? create it "
                "first, e.g. with torch.distributed.checkpoint.state_dict."
                "get_state_dict)" % (key, key + ".", key))
        if isinstance(v, tuple):
            tmp = list(v)
            for i, c in items:
                self._walk(c, _join(key, i), pr, lambda x, l=tmp, i=i: l.__setitem__(i, x),
                           fill)
            if setter is not None:
                self.finals.append(lambda: setter(_rebuild(v, tmp)))
            return
        for k, c in items:
            self._walk(c, _join(key, k), pr, lambda x, d=v, k=k: d.__setitem__(k, x), fill)
            if not key and not _is_stateful(c) and isinstance(v, collections.abc.MutableMapping):
                # DCP's contract: every entry of the state dict that is not Stateful is
                # replaced by its loaded value (itself, where it was loaded in place)
                self.finals.append(lambda d=v, k=k: d.__setitem__(k, d[k]))

    def _fill(self, d, key):
        """An empty dict d at key, and checkpoint entries under key: d gets every one of
        them (this rank's own of those saved per rank), under the rest of its dotted name
        (the checkpoint keeps no nesting: "model.l1.weight" fills d["l1.weight"]), a value
        or a new CPU tensor."""
        p = key + "."
        i = bisect.bisect_left(self.meta.names, p)
        names = self.meta.names
        seen = set()
        while i < len(names) and names[i].startswith(p):
            n = names[i]
            i += 1
            m = re.search(r"@rank(\d+)$", n)
            if m is not None and n in self.meta.tensors:
                if int(m.group(1)) != self.rank:
                    continue
                n = n[:m.start()]
            if n in seen or (self.meta.value_src(n, self.rank) is None
                             and self.meta.tensor_name(n, self.rank) is None):
                continue
            seen.add(n)
            self._value(n, False, lambda x, d=d, k=n[len(p):]: d.__setitem__(k, x))

    def _value(self, key, pr, setter):
        m = self.meta
        src = m.value_src(key, self.rank)
        if src is None:
            name = m.tensor_name(key, self.rank)
            if name is None:
                self._absent(key, pr)
                return
            dt, shape = m.tensors[name]
            t = torch.empty(shape, dtype=_FROM_STRATA[dt])
            self.state.add_shard(name, dt, shape, data_ptr=t.data_ptr(), nbytes=_nbytes(t),
                                 keep=t)
            self.new.append((setter, t))
            return
        if src is m._VALUE:
            self.values.append((setter, m.values[key]))
            return
        self._blob(key, src, setter, None)

    def _blob(self, key, src, setter, target):
        owner, size = src
        buf = ctypes.create_string_buffer(max(size, 1))
        self.state.add_blob(key, data_ptr=ctypes.addressof(buf), nbytes=size, owner=owner,
                            keep=buf)
        self.blobs.append((key, buf, size, setter, target))

    def _tensor(self, key, t, setter):
        if t.device.type == "meta":
            t = _materialise(t)
            self.new.append((setter, t))
        _check_tensor(key, t)
        sdt = _sdtype(key, t)
        gshape = tuple(t.shape)
        m = self.meta
        name = m.tensor_name(key, self.rank)
        if name is None:
            src = m.value_src(key, self.rank)
            if src is None:
                self._absent(key, False)
                return
            if src is m._VALUE:
                v = m.values[key]
                if (isinstance(v, torch.Tensor) and not t.numel() and v.shape == t.shape
                        and (v.dtype == t.dtype or self.cast)):
                    return      # an empty tensor of a torch.save file: nothing to fill
                if (isinstance(v, torch.Tensor) and not _is_dtensor(t) and v.shape == t.shape
                        and v.dtype == t.dtype):
                    # a tensor among values (Megatron's common.pt): copied in after the load
                    self.values.append((lambda x, t=t: _copy_in(t, x), v))
                    return
                raise _S.MismatchError(
                    "%s: the checkpoint holds a value (%s), the target "
                    "is a tensor" % (key, type(v).__name__))
            # a blob: an empty tensor, or a value (a mismatch). Refused here, before the load
            # writes anything, wherever its size tells: a target with elements can hold no
            # empty tensor, and the target's own would be exactly this many bytes
            if t.numel() or src[1] != len(_values.encode_empty_tensor(sdt, gshape)):
                raise _S.MismatchError(
                    "%s: the checkpoint holds a value or an empty tensor (a %d-byte "
                    "blob), the target is %s%s" % (key, src[1], sdt, list(gshape)))
            self._blob(key, src, None, t)
            return
        dt, shape = m.tensors[name]
        if shape != gshape or not self._converts(dt, sdt):
            raise _mismatch(key, dt, shape, sdt, gshape, self.cast)
        if _is_dtensor(t):
            pieces = [(offs, lens, view) for offs, lens, view in _dtensor_boxes(key, t)]
        else:
            pieces = [(None, None, t)]
        for offs, lens, view in pieces:
            buf, fix = _writable(view)
            if fix is not None:
                self.copies.append(fix)
            else:
                self.inplace.append(buf)
            if buf.is_cuda:
                self.cuda.add(buf.device)
            self.state.add_shard(name, sdt, gshape, offs, lens, data_ptr=buf.data_ptr(),
                                 nbytes=_nbytes(buf), device=buf.is_cuda, keep=buf)

    def _absent(self, key, pr):
        """key (of the target) is not in the checkpoint: NotFoundError, or with partial
        recorded and left as it is. A key that only a corrupt common.pt could hold is its
        ChecksumError, partial or not."""
        e = self.meta.missing(key, self.rank, pr)
        if not isinstance(e, _S.NotFoundError):
            raise e
        if not self.partial:
            raise _S.NotFoundError(
                "%s (partial=True leaves a key the checkpoint lacks as it is)" % e)
        self.missing.append(key)

    def _converts(self, saved, target):
        """Does the load fill a tensor of dtype target from one saved as saved (strata's
        names): equal, a widening (every value exact), or with cast=True any pair strata
        converts."""
        return saved == target or _S.load_converts(saved, target, cast=self.cast, widen=True)

    def touched(self):
        """Moves the version counter of every tensor the load writes through its address
        (an in-place change, counted as copy_ would: CheckpointManager's _version rule) -
        after the load, failed or not: a failed one may have written some."""
        for t in self.inplace:
            _bump_version(t)

    def finish(self):
        """After the load: every blob decoded and checked, then the targets changed."""
        values = list(self.values)
        for key, buf, size, setter, target in self.blobs:
            v = self._decode(key, ctypes.string_at(ctypes.addressof(buf), size), target)
            if target is None:
                values.append((setter, v))
        with torch.no_grad():
            for target, buf in self.copies:
                target.copy_(buf)
        for setter, v in values:
            setter(v)
        for setter, t in self.new:
            setter(t)
        for f in self.finals:
            f()

    def _decode(self, key, data, target):
        """The value of a blob (a new empty tensor for one), checked against target (a
        tensor the blob must describe exactly, or None)."""
        if self.meta.format in ("dcp", "megatron"):  # ShardedObjects: DCP values
            return _dcp_value(key, data, target)
        try:
            kind, v = _values.decode(data, pickle=self.pickle)
        except PermissionError as e:
            raise _S.InvalidArgumentError("%s: %s" % (key, e)) from None
        except ValueError as e:
            raise _S.FormatError("%s: a malformed value: %s" % (key, e)) from None
        if kind != "empty":
            if target is not None:
                raise _S.MismatchError(
                    "%s: the checkpoint holds a value (%s), the "
                    "target is a tensor" % (key, type(v).__name__))
            return v
        dt, shape = v
        if dt not in _FROM_STRATA:
            raise _S.FormatError("%s: unknown dtype %r" % (key, dt))
        if target is not None:
            sdt = _TO_STRATA.get(target.dtype)
            if tuple(target.shape) != tuple(shape) or not self._converts(dt, sdt):
                raise _mismatch(key, dt, shape, sdt, target.shape, self.cast)
            return None
        try:
            return torch.empty(shape, dtype=_FROM_STRATA[dt])
        except RuntimeError as e:   # a shape whose other dims overflow
            raise _S.FormatError(
                "%s: an empty tensor of shape %s: %s"
                % (key, list(shape), e)) from None
