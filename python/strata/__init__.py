"""strata: a checkpoint engine for sharded training state.

This package re-exports the binding of the C library (``strata._strata``, layer 1: states,
savers, handles, loads, checkpoints, errors). ``strata.torch`` (layer 2) saves and loads
PyTorch state dicts on top of it; it is imported on its own (``import strata.torch``) so that
this package needs no torch.

Pickles are read, never executed: ``strata._strata.unpickle(data, tensor=None, glob=None)``
turns a pickle (a torch.save archive's data.pkl) and ``strata._strata.unpickle_archive(data,
tensor=None, glob=None)`` the bytes of a whole torch.save archive (a DCP non-tensor item,
raw bytes or a torch.save'd object) into Python values with strata's restricted reader:
None, bool, int, float, str, bytes, tuple, list, dict, OrderedDict (torch.Size as a tuple);
each tensor becomes ``tensor(name, dtype, shape, data)`` (name: its keys joined with ".";
dtype: strata's name such as "f32"; data: its bytes for an archive, None for a bare pickle),
each global used as a value ``glob(module, name)``; anything else is strata.FormatError.
``strata._torchsave.archive_values(data)`` does the first with torch (tensors rebuilt as new
CPU tensors, dtypes as torch dtypes).
"""
from ._strata import (  # noqa: F401
    DEFAULT_CHUNK,
    DTYPES,
    ERRORS,
    LEVEL_DURABLE,
    LEVEL_LOCAL,
    LEVEL_REPLICATED,
    MAX_DIMS,
    MAX_NAME,
    MAX_TIERS,
    VERSION,
    Checkpoint,
    Comm,
    Error,
    Handle,
    Loader,
    Pool,
    Saver,
    State,
    copy,
    dtype_size,
    export_safetensors,
    hash_bytes,
    list_dirs,
    load,
    load_converts,
    probe,
    remove_incomplete,
    retain,
    unpickle,
    unpickle_archive,
    uri_path,
)
from . import _strata

# A process that returns from main with an asynchronous save still in flight (no wait())
# finishes it here, before the interpreter finalizes: the commit's collectives run on the
# Saver's commit thread, which needs the GIL (as concurrent.futures joins its workers).
# Then (atexit runs last-registered first) the Savers and gloo groups strata.torch keeps
# for the life of the process go, their commit threads joined, while the interpreter is
# whole rather than during its finalization, where a gloo group's teardown can abort the
# process.
import atexit as _atexit


def _release_groups():
    import sys
    g = sys.modules.get("strata._group")
    if g is not None:
        g._release()


_atexit.register(_release_groups)
_atexit.register(_strata.finish_saves)
del _atexit

# One exception class per C error code (strata.ChecksumError, ...), all under strata.Error.
for _cls in ERRORS.values():
    globals()[_cls.__name__] = _cls
del _cls

__version__ = "%d.%d.0" % VERSION

__all__ = [
    "DEFAULT_CHUNK", "DTYPES", "ERRORS", "LEVEL_DURABLE", "LEVEL_LOCAL", "LEVEL_REPLICATED",
    "MAX_DIMS", "MAX_NAME", "MAX_TIERS", "VERSION",
    "Checkpoint", "Comm", "Error", "Handle", "Loader", "Pool", "Saver", "State",
    "copy", "dtype_size", "export_safetensors", "hash_bytes", "list_dirs", "load", "load_converts", "probe",
    "remove_incomplete", "retain", "unpickle", "unpickle_archive", "uri_path",
] + sorted(c.__name__ for c in ERRORS.values())
