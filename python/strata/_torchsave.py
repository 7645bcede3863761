"""Values of torch.save archives for strata.torch, never executing pickle.

A torch.save source (a .pt/.pth/.bin file, a Hugging Face pytorch_model.bin directory) has
its tensors in strata's index (the C load fills them) and its other values in each file's
pickle, data.pkl, which the index lists as a blob "<file>/<dir>/data.pkl". strata.torch reads
those blobs and turns them into values with strata's restricted reader
(strata._strata.unpickle): pickle_values() gives {flattened key: value} the way
strata.torch flattens a state dict (a container without tensors is one value under its key).

archive_values(data) turns the bytes of a whole torch.save archive (a DCP non-tensor item)
into its value, tensors rebuilt from the archive's bytes (copies, torch.frombuffer).
file_values(data, name) does that for a whole file's bytes (Megatron's common.pt) and flattens
it as pickle_values does.
"""

import collections

import torch

import strata as _S
from strata._keys import _items, _join
from strata._tensor import _FROM_STRATA


class TensorAt:
    """A tensor of a pickle whose bytes the load fills: its strata name, dtype, shape."""
    __slots__ = ("name", "dtype", "shape")

    def __init__(self, name, dtype, shape, _data=None):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)


def _glob(module, name):
    """A global used as a value: torch dtypes only."""
    v = getattr(torch, name, None) if module == "torch" else None
    if isinstance(v, torch.dtype):
        return v
    raise _S.FormatError("a value %s.%s, which strata does not convert" % (module, name))


def _tensor(name, dtype, shape, data):
    t = torch.empty(tuple(shape), dtype=_FROM_STRATA[dtype])
    if t.numel():
        t.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


def archive_values(data, name="torch.save archive"):
    """The value a torch.save archive holds (bytes or a buffer), read by strata's rules
    (docs/FORMAT.md, "torch.save as strata reads it"): tensors as new CPU tensors."""
    return _S._strata.unpickle_archive(data, tensor=_tensor, glob=_glob, name=name)


def _has_tensor(v, cls=None):
    """Does v hold (at any depth of mappings, lists and tuples) an instance of cls (default
    TensorAt: a tensor of a source's index)?"""
    cls = TensorAt if cls is None else cls
    if isinstance(v, cls):
        return True
    if isinstance(v, collections.abc.Mapping):
        return any(_has_tensor(c, cls) for c in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_tensor(c, cls) for c in v)
    return False


def pickle_values(pkl, name="data.pkl"):
    """{key: value} of a torch.save source's pickle: every entry that holds no tensor, under
    its key as strata.torch flattens (keys joined with "."; tensors are the index's, but
    for the empty ones, which are values here)."""
    root = _S._strata.unpickle(pkl, tensor=TensorAt, glob=_glob, name=name)
    out = {}

    def walk(v, key):
        for k, c in _items(v):
            ck = _join(key, k)
            if isinstance(c, TensorAt):
                if 0 in c.shape:    # not in the index (no bytes): a value
                    out[ck] = torch.empty(c.shape, dtype=_FROM_STRATA[c.dtype])
                continue
            if _has_tensor(c):
                walk(c, ck)
            else:
                out[ck] = c

    if isinstance(root, (collections.abc.Mapping, list, tuple)):
        walk(root, "")
    return out


MAX_FILE_VALUES = 256 << 20   # bytes of a torch.save file read whole for its values


def file_values(data, name):
    """{flattened key: value} of the bytes of a whole torch.save file (name: what messages
    call it), read by strata's rules: Megatron's common.pt, the state every rank shares,
    read through the loader (a blob of its index). Tensors come back as new CPU tensors
    (values, not index entries)."""
    root = archive_values(data, name=name)
    out = {}

    def walk(v, key):
        for k, c in _items(v):
            ck = _join(key, k)
            if isinstance(c, (collections.abc.Mapping, list, tuple)) and _has_tensor(c, torch.Tensor):
                walk(c, ck)
            else:
                out[ck] = c

    if isinstance(root, collections.abc.Mapping):
        walk(root, "")
    return out

