"""strata.torch's saves: save, async_save and the AsyncSave they return (what a rank
registers is _statedict's _SavePrep; every rank agrees on it with _group's _agree before
strata's save starts)."""

import warnings

import strata as _S
from strata import _dcpcalls
from strata._group import _agree, _dcp_group
from strata._statedict import _SavePrep
from strata._tensor import _sync_cuda


def _prepare_save(state_dict, group, pickle, frozen=None, unmoved=None):
    rank = group.rank if group is not None else 0
    prep, err = None, None
    try:
        prep = _SavePrep(state_dict, rank, pickle, group is not None and group.size > 1,
                         frozen, unmoved)
    except Exception as e:   # every rank must reach the collective below
        err = e
    _agree(group, "strata.torch.save", err, prep.checks if prep is not None else ())
    _sync_cuda(prep.cuda)
    return prep


def _save_saver(group, pool=None):
    """The saver of one save: the group's (its cached plan); without a group a new one,
    freed with the save's handle, and with it the pool it made for the save (without a
    communicator a saver caches no plan, so one kept would only keep its pool, up to 1 GiB,
    for the life of the process)."""
    return group.saver(pool) if group is not None else _S.Saver(None, pool)


def save(state_dict, path=None, process_group=None, *, checkpoint_id=None, storage_writer=None,
         planner=None, no_dist=False, use_collectives=True, step=0, pickle=False, replace=False,
         frozen=None, **options):
    """Saves state_dict to path (a directory: a plain path, "file:///abs" or "mem://name";
    or a list of them, tiers fastest first) and returns once it is committed, with the
    save's stats. With a process group (the default one if initialised), every rank calls
    it. A committed checkpoint at path is never overwritten (ExistsError) unless
    replace=True: then the new one is written beside it and swapped in atomically after its
    commit, so path always holds a complete checkpoint (a fixed path such as "latest");
    a path holding anything but a strata checkpoint (a directory of other files, a run
    directory of step-N checkpoints) is never replaced (NotCheckpointError).
    options: chunk_bytes, io_threads, sync, direct, bg_nice, base, incremental
    (strata.Saver.save).

    DCP's call (torch.distributed.checkpoint.save) works as written: the path as
    checkpoint_id=, or DCP's FileSystemWriter(path) as storage_writer= (its overwrite=True,
    DCP's default, is replace=True; sync_files=False is sync=False); planner= DCP's
    DefaultSavePlanner (its options are what strata does anyway); no_dist=True saves in this
    process alone. A planner or writer of another kind is InvalidArgumentError (_dcpcalls).

    frozen: with base= (an incremental save), the tensors the caller promises are byte for
    byte those of the base at the same key: True (the parameters with requires_grad=False
    of the modules in state_dict), names (a key, or a prefix of keys ending before a dot:
    "model.base"; a name matching no tensor is InvalidArgumentError), or a callable
    (key, tensor) -> bool. Where the base holds such a tensor as it is now (dtype, shape,
    layout), its bytes are not read at all - no hash, no copy, no write - and the new
    checkpoint refers to the base's; elsewhere the mark is ignored. The promise is not
    checked: a marked tensor changed since the base is saved holding the base's values."""
    uris, replace = _dcpcalls.save_args("strata.torch.save", path, checkpoint_id,
                                        storage_writer, planner, use_collectives, replace,
                                        options)
    group = _dcp_group(process_group, no_dist)
    prep = _prepare_save(state_dict, group, pickle, frozen)
    return _save_saver(group).save(uris, [prep.state], step=step, replace=replace, **options)


class AsyncSave(_dcpcalls.Future):
    """A save in flight (async_save). wait_snapshot() returns once the state's bytes have
    been copied out (change the tensors only after it: call it before optimizer.step());
    wait() returns once committed, with the stats, and raises the save's error; done()
    tells without waiting. The save commits by itself once every rank has written it (with a
    process group, on the Saver's commit thread and gloo group: done() then turns True with
    no wait() on any rank). It is also the concurrent.futures.Future DCP's async_save
    returns: result(timeout=None) is wait() (after waiting up to timeout for done()),
    exception(), add_done_callback() (_dcpcalls.Future)."""

    def __init__(self, handle, prep, on_done=None):
        super().__init__()
        self._h = handle
        self._prep = prep
        self._on_done = on_done
        self._result = None
        self._exc = None
        self._finished = False
        self._versions = None   # [(name, tensor, its _version at the start)]

    def wait_snapshot(self):
        if not self._finished:
            self._h.wait_snapshot()
            self._check_versions()

    def _check_versions(self):
        """Warns (once a save) if a tensor the snapshot reads was changed in place before
        it ended (its version counter moved): an optimizer.step() before wait_snapshot()
        saves post-step values for some tensors. Changes through .data or raw memory are
        not counted, and a change after the snapshot ended but before wait_snapshot() is
        warned of too (it broke the contract, though the bytes were already copied)."""
        vs, self._versions = self._versions, None
        for name, t, v in vs or ():
            if t._version != v:
                warnings.warn("strata.torch.async_save: %r was changed in place before "
                              "wait_snapshot() returned (its version counter moved): the "
                              "checkpoint may hold the new values; call wait_snapshot() "
                              "before optimizer.step()" % name, RuntimeWarning, stacklevel=3)
                return

    def wait(self):
        if not self._finished:
            self._finished = True
            try:
                if self._versions is not None:   # wait_snapshot() was not called
                    self._h.wait_snapshot()
                    self._check_versions()
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
            self._dcp_settle()
        if self._exc is not None:
            raise self._exc
        return self._result

    def done(self):
        return self._finished or bool(self._h.done())

    def level(self):
        """(levels, message) without waiting: strata.LEVEL_LOCAL (the first tier
        committed), LEVEL_REPLICATED (peer replicas committed on every node),
        LEVEL_DURABLE (a tier not in memory committed); the message says why a replication
        failed."""
        return self._h.level()

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


def async_save(state_dict, path=None, process_group=None, *, checkpoint_id=None,
               storage_writer=None, planner=None, async_checkpointer_type=None,
               async_stager=None, no_dist=False, use_collectives=True, step=0, pool=None,
               pickle=False, replace=False, frozen=None, **options):
    """Starts saving state_dict to path and returns an AsyncSave once the plan is made: no
    tensor is copied on this thread (strata snapshots them in the background, into the
    pool: a strata.Pool, else the saver's own - with a process group kept with the group's
    saver, without one made for this save, up to 1 GiB, and freed once it is waited for).
    Do not change the tensors before wait_snapshot(). It commits in the background as soon
    as every rank has written it; wait() returns the outcome.
    replace=True, frozen= and base= as in save(): a frozen tensor the base holds is neither
    hashed nor copied into the pool.

    DCP's call (torch.distributed.checkpoint.async_save: checkpoint_id= or storage_writer=,
    and planner, no_dist, use_collectives as save() takes them) keeps DCP's contract: it
    returns once the snapshot is taken (DCP stages before returning), so the caller may
    change the tensors at once; the AsyncSave is the Future DCP returns (result(), done()).
    With async_stager=DefaultStager(StagingOptions(use_async_staging=True, ...)) it returns
    at once DCP's AsyncSaveResponse: staging_completion ends with the snapshot,
    upload_completion is the AsyncSave. strata snapshots into its pool whatever the stager
    (which is never called); async_checkpointer_type is taken as given (strata's background
    work is threads of C that do not hold the GIL)."""
    what = "strata.torch.async_save"
    mode = _dcpcalls.staging(what, checkpoint_id is not None or planner is not None,
                             storage_writer, async_stager)
    uris, replace = _dcpcalls.save_args(what, path, checkpoint_id, storage_writer, planner,
                                        use_collectives, replace, options)
    group = _dcp_group(process_group, no_dist)
    prep = _prepare_save(state_dict, group, pickle, frozen)
    versions = _versions(prep)
    h = _save_saver(group, pool).start(uris, [prep.state], step=step, replace=replace,
                                       **options)
    a = AsyncSave(h, prep)
    a._versions = versions
    if mode == _dcpcalls.SYNC:
        try:
            a.wait_snapshot()
        except _S.Error:    # the save failed: its Future's result() raises the error, as DCP's
            pass
    elif mode == _dcpcalls.ASYNC:
        return _dcpcalls.response(a)
    return a


def _versions(prep):
    """What AsyncSave._check_versions compares: the version counters as the save starts."""
    return [(name, t, t._version) for name, t in prep.sources]
