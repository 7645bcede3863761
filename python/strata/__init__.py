"""strata: a checkpoint engine for sharded training state.

This package re-exports the binding of the C library (``strata._strata``, layer 1: states,
savers, handles, loads, checkpoints, errors). ``strata.torch`` (layer 2) saves and loads
PyTorch state dicts on top of it; it is imported on its own (``import strata.torch``) so that
this package needs no torch.
"""
from ._strata import (  # noqa: F401
    DEFAULT_CHUNK,
    DTYPES,
    ERRORS,
    MAX_DIMS,
    MAX_NAME,
    MAX_TIERS,
    VERSION,
    Checkpoint,
    Comm,
    Error,
    Handle,
    Pool,
    Saver,
    State,
    dtype_size,
    export_safetensors,
    hash_bytes,
    load,
    probe,
    remove_incomplete,
    retain,
    uri_path,
)
from . import _strata

# One exception class per C error code (strata.ChecksumError, ...), all under strata.Error.
for _cls in ERRORS.values():
    globals()[_cls.__name__] = _cls
del _cls

__version__ = "%d.%d.0" % VERSION

__all__ = [
    "DEFAULT_CHUNK", "DTYPES", "ERRORS", "MAX_DIMS", "MAX_NAME", "MAX_TIERS", "VERSION",
    "Checkpoint", "Comm", "Error", "Handle", "Pool", "Saver", "State",
    "dtype_size", "export_safetensors", "hash_bytes", "load", "probe", "remove_incomplete",
    "retain", "uri_path",
] + sorted(c.__name__ for c in ERRORS.values())
