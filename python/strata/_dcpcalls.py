"""DCP's call sites as strata.torch takes them: the keyword arguments of
torch.distributed.checkpoint's save, async_save and load (checkpoint_id, storage_writer /
storage_reader, planner, no_dist, use_collectives, async_checkpointer_type, async_stager)
turned into strata's, and the protocol of what DCP's async_save returns (a
concurrent.futures.Future; an AsyncSaveResponse of a staging and an upload future where a
stager stages in the background) for strata.torch.AsyncSave.

What strata honours: a path (checkpoint_id=, or the path of DCP's own FileSystemWriter /
FileSystemReader); FileSystemWriter(overwrite=True) - its default - as replace=True (an atomic
replace), sync_files=False as sync=False; DefaultLoadPlanner(allow_partial_load=True) as
partial=True. DCP's DefaultSavePlanner's options (flattening, dedup, plan caching) are what
strata does anyway. Anything else DCP lets a caller plug in (a planner, writer, reader or
stager of its own) is refused with InvalidArgumentError saying what strata does instead:
strata plans, writes, reads and snapshots by itself."""

import concurrent.futures
import os
import time

import strata as _S


def _classes():
    """DCP's classes strata accepts (imported when a DCP argument is given: the caller has
    imported DCP already)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import staging
    return dcp, staging


def _name(x):
    return "%s.%s" % (type(x).__module__, type(x).__qualname__)


def _one_path(what, path, checkpoint_id, io_path):
    """The URIs of a save or load (a list: one path, or tiers): `path` (strata's positional
    argument) or checkpoint_id (DCP's keyword; both: they must be the same), else the path
    of DCP's FileSystemWriter or FileSystemReader (which DCP too replaces by checkpoint_id
    where both are given)."""
    if path is not None and checkpoint_id is not None:
        same = (isinstance(path, (list, tuple)) == isinstance(checkpoint_id, (list, tuple))
                and _fspaths(path) == _fspaths(checkpoint_id))
        if not same:
            raise _S.InvalidArgumentError("%s: path %r and checkpoint_id=%r differ; give one "
                                          "of them" % (what, path, checkpoint_id))
    got = path if path is not None else checkpoint_id if checkpoint_id is not None else io_path
    if got is None:
        raise _S.InvalidArgumentError("%s: no path: give it as checkpoint_id= (as to DCP) or "
                                      "as the argument after the state dict" % what)
    uris = _fspaths(got)
    if not uris:
        raise ValueError("strata.torch: no path given")
    return uris


def _fspaths(p):
    return [os.fspath(x) for x in p] if isinstance(p, (list, tuple)) else [os.fspath(p)]


def save_args(what, path, checkpoint_id, storage_writer, planner, use_collectives, replace,
              options):
    """(URIs, replace) of a save given DCP's arguments; options (the save's keyword options,
    a dict) gets sync=False where the writer asks for no fsync."""
    if use_collectives is not True:
        raise _S.InvalidArgumentError(
            "%s: use_collectives=%r: strata's save always "
            "agrees on one plan over the ranks (its collectives run on a gloo group "
            "of its own); drop it, or pass no_dist=True to save in this process "
            "alone" % (what, use_collectives))
    io_path = None
    if planner is not None or storage_writer is not None:
        dcp, _ = _classes()
        if planner is not None and type(planner) is not dcp.DefaultSavePlanner:
            raise _S.InvalidArgumentError(
                "%s: planner=%s is not DCP's "
                "DefaultSavePlanner: strata plans a save itself (replicated tensors "
                "written once, the writes balanced over the ranks, the plan kept for "
                "the next save of the same layout); drop planner=" % (what, _name(planner)))
        if storage_writer is not None:
            w = storage_writer
            if type(w) is not dcp.FileSystemWriter:
                raise _S.InvalidArgumentError(
                    "%s: storage_writer=%s is not DCP's "
                    "FileSystemWriter: strata writes through its own storage (a "
                    "directory, file://, mem://, s3://): give the path as "
                    "checkpoint_id=" % (what, _name(w)))
            fmt = getattr(w, "serialization_format", None)
            if fmt is not None and getattr(fmt, "name", "TORCH_SAVE") != "TORCH_SAVE":
                raise _S.InvalidArgumentError(
                    "%s: FileSystemWriter(serialization_format="
                    "%s): strata writes its own format; "
                    "strata.torch.export_safetensors writes safetensors from it"
                    % (what, fmt))
            if getattr(getattr(w, "transforms", None), "extensions", None):
                raise _S.InvalidArgumentError(
                    "%s: FileSystemWriter(_extensions=...): "
                    "strata writes its own format (every chunk checksummed), with no "
                    "stream transforms" % what)
            io_path = w.path
            replace = replace or bool(w.overwrite)
            if not w.sync_files:
                options.setdefault("sync", False)
    return _one_path(what, path, checkpoint_id, io_path), replace


def load_args(what, path, checkpoint_id, storage_reader, planner, partial):
    """(URIs, partial) of a load given DCP's arguments."""
    io_path = None
    if planner is not None or storage_reader is not None:
        dcp, _ = _classes()
        if planner is not None:
            if type(planner) is not dcp.DefaultLoadPlanner:
                raise _S.InvalidArgumentError(
                    "%s: planner=%s is not DCP's "
                    "DefaultLoadPlanner: strata plans a load itself (any saved layout "
                    "into the target's); for keys the checkpoint lacks pass "
                    "partial=True, for another dtype cast=True; drop planner="
                    % (what, _name(planner)))
            partial = partial or bool(planner.allow_partial_load)
        if storage_reader is not None:
            if type(storage_reader) is not dcp.FileSystemReader:
                raise _S.InvalidArgumentError(
                    "%s: storage_reader=%s is not DCP's "
                    "FileSystemReader: strata reads through its own storage (a "
                    "directory, file://, mem://, s3://; strata's checkpoints, DCP's, "
                    "safetensors, torch.save, Megatron, DeepSpeed): give the path as "
                    "checkpoint_id=" % (what, _name(storage_reader)))
            io_path = storage_reader.path
    return _one_path(what, path, checkpoint_id, io_path), partial


# ---- async_save: when the caller may change the state, and what it gets back ---------------

STRATA, SYNC, ASYNC = "strata", "sync", "async"


def staging(what, dcp_call, storage_writer, async_stager):
    """How an async_save returns: STRATA (strata's own call, a path after the state dict: at
    once, the caller calls wait_snapshot() before changing the tensors), SYNC (a DCP call
    site whose staging DCP does before returning - its default, and a blocking stager: once
    the snapshot is taken, an AsyncSave, which is a Future) or ASYNC (a stager that stages in
    the background, DefaultStager(StagingOptions(use_async_staging=True)): at once, an
    AsyncSaveResponse). strata takes the snapshot itself, into its pool, whatever the
    stager: a stager given is never called."""
    if async_stager is None:
        return SYNC if dcp_call or storage_writer is not None else STRATA
    _, st = _classes()
    if type(async_stager) is st.DefaultStager:
        return ASYNC if async_stager._config.use_async_staging else SYNC
    if isinstance(async_stager, st.BlockingAsyncStager):
        return SYNC
    raise _S.InvalidArgumentError(
        "%s: async_stager=%s is not DCP's DefaultStager: strata "
        "copies the state into its own pool in the background (the returned save's "
        "staging_completion, or wait_snapshot(), says when it is done); pass "
        "DefaultStager(...) or none" % (what, _name(async_stager)))


def response(save):
    """DCP's AsyncSaveResponse of an AsyncSave: staging_completion ends with its snapshot,
    upload_completion is the AsyncSave itself."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    return AsyncSaveResponse(staging_completion=_Snapshot(save), upload_completion=save)


class Future(concurrent.futures.Future):
    """The Future protocol of DCP's async_save on strata.torch.AsyncSave: result(timeout)
    waits for the commit and returns the save's stats (DCP's: its Metadata), or raises its
    error; exception(timeout) returns it; done() (AsyncSave's) turns True once committed;
    a save in flight cannot be cancelled. Callbacks (add_done_callback) run when wait() or
    result() finds the save ended (strata commits in C, without calling into Python);
    concurrent.futures.wait and as_completed see it ended then too. The subclass calls
    _dcp_settle once wait() has the outcome."""

    def _dcp_until(self, timeout):
        """Returns once done() or raises TimeoutError after timeout seconds (None: at once:
        wait() then waits)."""
        if timeout is None:
            return
        deadline = time.monotonic() + timeout
        delay = 0.001
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise concurrent.futures.TimeoutError()
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.05)

    def result(self, timeout=None):
        self._dcp_until(timeout)
        return self.wait()

    def exception(self, timeout=None):
        self._dcp_until(timeout)
        try:
            self.wait()
        except Exception as e:
            return e
        return None

    def cancel(self):
        return False

    def cancelled(self):
        return False

    def running(self):
        return not self.done()

    def _dcp_settle(self):
        """The outcome wait() found (self._exc, self._result) as the Future's: once."""
        try:
            if self._exc is not None:
                concurrent.futures.Future.set_exception(self, self._exc)
            else:
                concurrent.futures.Future.set_result(self, self._result)
        except concurrent.futures.InvalidStateError:   # settled already
            pass


class _Snapshot(concurrent.futures.Future):
    """staging_completion of an AsyncSaveResponse: done once the save's snapshot is taken
    (result() is its wait_snapshot(): None, or the save's error so far). A timeout is not
    needed: the snapshot is a copy into host memory, and result() waits for it."""

    def __init__(self, save):
        super().__init__()
        self._save = save

    def result(self, timeout=None):
        e = self.exception()
        if e is not None:
            raise e

    def exception(self, timeout=None):
        if not super().done():
            try:
                try:
                    self._save.wait_snapshot()
                except Exception as e:
                    self.set_exception(e)
                else:
                    self.set_result(None)
            except concurrent.futures.InvalidStateError:   # another thread settled it
                pass
        return self._exception

    def done(self):
        return super().done() or self._save.done()

    def cancel(self):
        return False

    def running(self):
        return not self.done()
