"""strata as a Megatron-Core dist_checkpointing backend (megatron-core 0.16.1).

    import strata.megatron
    strata.megatron.enable()              # once, after torch.distributed is initialised
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=("strata", 1))
    dist_checkpointing.load(sharded_sd, ckpt_dir)     # metadata.json names "strata"
    # an existing torch_dist checkpoint, loaded through strata into any layout:
    dist_checkpointing.load(sharded_sd, old_dir, sharded_strategy=("strata", 1))
    # asynchronous: Megatron's own entry point
    req = dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=("strata", 1),
                                  async_sharded_save=True)
    queue.schedule_async_request(req)     # a megatron AsyncCallsQueue; no process forked
    ...                                   # training goes on; the next optimizer step waits
    queue.maybe_finalize_async_calls()    # for the snapshot copy only if it is unfinished

enable() registers a save and a load strategy with Megatron's registry under the backend
"strata", version 1 (metadata.json then says so, and a load without a strategy picks
strata's). The checkpoint directory holds Megatron's own common.pt and metadata.json and
one strata checkpoint, ckpt_dir/strata, committed as a whole: every rank's ShardedTensors
under their keys (each distinct piece written once, strata's planner balancing the replicas'
writes over the ranks that hold them; the distributed optimizer's bucket pieces as flat
pieces), ShardedObjects and the common state as strata values (never pickled unless
enable(pickle=True)), with strata's checksums and commit record. strata inspect,
strata.Checkpoint(ckpt_dir), strata.torch.load and strata export read it like any strata
checkpoint. A load plans from whatever layout saved (another TP/PP/DP degree, another
distributed-optimizer partition, a torch_dist checkpoint) into the one asking.

Asynchronous saves are lazy: async_save returns once the plan is made, strata copies the
tensors into its pool and writes them in the background, and commits as soon as every rank
has written. Megatron's AsyncCallsQueue serves strata's requests from strata's handle (enable
teaches its schedule_async_request to; no process is forked); a global optimizer step
pre-hook waits for the snapshot before any torch optimizer changes the tensors (call
wait_snapshot() yourself before changing them otherwise). metadata.json is written by
Megatron's finalize, after strata's commit: a kill at any instant leaves the previous
checkpoint loadable and the new one not a checkpoint (no metadata.json; its strata/ without
a commit record, or with one).

Details: docs/DESIGN.md, "strata.megatron"; the names: _megatron.py.
"""

import itertools
import os
import threading

from torch.optim.optimizer import register_optimizer_step_pre_hook

try:
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.strategies import async_utils as _mg_async
    from megatron.core.dist_checkpointing.strategies import base as _mg_base
    from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy,
                                                                  LoadShardedStrategy,
                                                                  SaveCommonStrategy,
                                                                  StrategyAction)
except ImportError as _e:   # pragma: no cover - the package needs megatron-core
    raise ImportError("strata.megatron needs megatron-core 0.16.1 and packaging "
                      "(pip install 'strata[megatron]'): %s" % _e) from _e

import strata as _S
from strata import _megatron
# strata.torch's process-group adapter, its agreement step and its saver (internal helpers)
from strata._group import _agree, _group
from strata._save import _save_saver
from strata._tensor import _sync_cuda, _sync_loaded

__all__ = ["enable", "disable", "enabled", "wait_snapshot", "BACKEND", "VERSION", "SUBDIR",
           "StrataSaveShardedStrategy", "StrataLoadShardedStrategy"]

BACKEND = "strata"
VERSION = 1
SUBDIR = "strata"      # the strata checkpoint inside a Megatron checkpoint directory


def _ckpt(checkpoint_dir):
    return os.path.join(os.fspath(checkpoint_dir), SUBDIR)


# ---- the common state: Megatron's common.pt, and strata values too ----------------------

_COMMON = {}    # realpath of a checkpoint directory: the common state Megatron saved there


class _CommonCapture(SaveCommonStrategy):
    """Megatron's own common save strategy (it writes common.pt, as always), which also
    hands the common state to strata's sharded save that follows in the same
    dist_checkpointing.save (Megatron gives a sharded strategy only the sharded part)."""

    def __init__(self, inner):
        super().__init__(inner.backend, inner.version)
        self.inner = inner

    def save_common(self, common_state_dict, checkpoint_dir):
        self.inner.save_common(common_state_dict, checkpoint_dir)
        _COMMON[os.path.realpath(os.fspath(checkpoint_dir))] = common_state_dict

    def save_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        return self.inner.save_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

    @property
    def can_handle_sharded_objects(self):
        return self.inner.can_handle_sharded_objects


# ---- saves in flight ----------------------------------------------------------------------

_INFLIGHT = {}              # id: _InFlight
_IDS = itertools.count(1)


class _InFlight:
    """One asynchronous save: strata's handle and what its snapshot reads."""

    def __init__(self, handle, keep):
        self.id = next(_IDS)
        self.handle, self.keep = handle, keep
        self.snapshot_done = False
        self.error = None
        _INFLIGHT[self.id] = self

    def wait_snapshot(self):
        if not self.snapshot_done:
            self.snapshot_done = True
            try:
                self.handle.wait_snapshot()
            except _S.Error as e:     # raised by finalize (wait_durable) on every rank
                self.error = e
            self.keep = None

    def done(self):
        return bool(self.handle.done())

    def finalize(self):
        """Megatron's finalize (before it writes metadata.json): the commit's outcome."""
        _INFLIGHT.pop(self.id, None)
        try:
            self.wait_snapshot()
            return self.handle.wait_durable()
        finally:
            self.handle.close()
            self.keep = None


def wait_snapshot():
    """Returns once every asynchronous save in flight has copied its tensors out of the
    training state (the tensors may change after it). Called by the optimizer step
    pre-hook that enable() installs; call it yourself before changing saved tensors by
    other means than a torch optimizer's step."""
    for s in list(_INFLIGHT.values()):
        s.wait_snapshot()


def _before_step(optimizer, args, kwargs):
    if _INFLIGHT:
        wait_snapshot()


def _serve(save_id, pid):
    """The AsyncRequest's async_fn. Megatron's AsyncCallsQueue, once enable() ran, never
    calls it (it serves the request from strata's handle); AsyncRequest.execute_sync (a
    synchronous save through the async path) does, in this process: the save's commit.
    Run by another process (a queue not taught by enable()), it has nothing to do: the
    save is this process's, and the finalize waits for its commit."""
    s = _INFLIGHT.get(save_id)
    if s is not None and os.getpid() == pid:
        s.wait_snapshot()
        s.handle.wait_durable()


def _inflight_of(req):
    if getattr(req, "async_fn", None) is not _serve:
        return None
    save_id, pid = req.async_fn_args
    return _INFLIGHT.get(save_id) if pid == os.getpid() else None


class _StrataCaller(_mg_async.AsyncCaller):
    """Megatron's AsyncCaller for a strata save: done when strata's handle is (committed or
    failed), agreed across ranks as Megatron's callers do (sync_all_async_calls)."""

    def __init__(self, inflight):
        self.inflight = inflight

    def schedule_async_call(self, async_req):
        pass

    def is_current_async_call_done(self, blocking=False, no_dist=False):
        alive = 0 if self.inflight.done() else 1
        if alive and blocking:
            self.inflight.wait_snapshot()
            try:
                self.inflight.handle.wait_durable()
            except _S.Error:          # finalize raises it
                pass
            alive = 0
        return not alive if no_dist else bool(self.sync_all_async_calls(alive))

    def close(self, abort=False):
        pass

    def __del__(self):
        pass


_ORIG = {}


def _schedule_async_request(self, async_request):
    """AsyncCallsQueue.schedule_async_request, taught by enable(): a strata request is
    served by strata's handle (no process); any other as before."""
    inflight = _inflight_of(async_request)
    if inflight is None:
        return _ORIG["schedule"](self, async_request)
    self.call_idx += 1
    if len(async_request._fields) != len(_mg_async.AsyncRequest._fields):
        async_request = _mg_async.AsyncRequest(**async_request._asdict())
    async_request = async_request.freeze()
    self.async_calls.append(_mg_async._ActiveAsyncRequest(self.call_idx,
                                                          _StrataCaller(inflight), async_request))
    return self.call_idx


# ---- the strategies -------------------------------------------------------------------------

class StrataSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Megatron's save strategy for strata (backend "strata", version 1). save() returns
    once the checkpoint is committed; async_save() once the plan is made (an AsyncRequest
    whose finalize raises the save's error). pickle, pool, replace and the saves' options
    (chunk_bytes, io_threads, direct, sync, bg_nice) as enable() was given."""

    def __init__(self, backend=BACKEND, version=VERSION, *, pickle=False, pool=None,
                 replace=False, options=None):
        super().__init__(backend, version)
        self.pickle, self.pool, self.replace = pickle, pool, replace
        self.options = dict(options or {})

    @property
    def can_handle_sharded_objects(self):
        return True

    def _prepare(self, sharded_state_dict, checkpoint_dir, what):
        group = _group(None)
        rank = group.rank if group is not None else 0
        common = _COMMON.pop(os.path.realpath(os.fspath(checkpoint_dir)), None)
        prep, err = None, None
        try:
            prep = _megatron._SaveState(sharded_state_dict, rank, common, self.pickle)
        except Exception as e:    # every rank must reach the agreement
            err = e
        _agree(group, what, err)
        _sync_cuda(prep.cuda)
        it = (common or {}).get("iteration")
        step = it if type(it) is int and it >= 0 else 0
        return group, prep, step

    def _replace(self, checkpoint_dir):
        """replace=, or True where checkpoint_dir/strata is committed but Megatron never
        finalized the checkpoint (no metadata.json: a save killed between strata's commit
        and Megatron's finalize): Megatron saves there again, and the orphan is replaced
        atomically. A finalized checkpoint is never overwritten unless replace=True."""
        if self.replace:
            return True
        d = os.fspath(checkpoint_dir)
        if os.path.lexists(os.path.join(d, "metadata.json")):
            return False
        try:
            return bool(_S.probe(_ckpt(d))["committed"])
        except _S.Error:     # none there (or not a checkpoint: the save refuses it)
            return False

    def save(self, sharded_state_dict, checkpoint_dir):
        group, prep, step = self._prepare(sharded_state_dict, checkpoint_dir,
                                          "strata.megatron save")
        _save_saver(group).save([_ckpt(checkpoint_dir)], [prep.state], step=step,
                                replace=self._replace(checkpoint_dir), **self.options)

    def async_save(self, sharded_state_dict, checkpoint_dir):
        group, prep, step = self._prepare(sharded_state_dict, checkpoint_dir,
                                          "strata.megatron async_save")
        h = _save_saver(group, self.pool).start([_ckpt(checkpoint_dir)], [prep.state],
                                                step=step, replace=self._replace(checkpoint_dir),
                                                **self.options)
        s = _InFlight(h, prep)
        return _mg_async.AsyncRequest(_serve, (s.id, os.getpid()), [s.finalize])


class StrataLoadShardedStrategy(LoadShardedStrategy):
    """Megatron's load strategy for strata: a checkpoint saved through strata, or a
    torch_dist one (check_backend_compatibility accepts both), into any layout.
    ShardedObjects too (a torch_dist one's by strata's restricted reader, never unpickled
    unless pickle=True)."""

    def __init__(self, *, pickle=False):
        super().__init__()
        self.pickle = pickle

    @property
    def can_handle_sharded_objects(self):
        return True

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend not in (BACKEND, "torch_dist"):
            raise CheckpointingException("strata loads checkpoints saved through strata or "
                                         "torch_dist, not %r" % (loaded_backend,))

    def check_version_compatibility(self, loaded_version):
        if loaded_version != 1:
            raise CheckpointingException("strata loads version 1 of its backend and of "
                                         "torch_dist, not %r" % (loaded_version,))

    def load(self, sharded_state_dict, checkpoint_dir):
        group = _group(None)
        with _S.Loader([os.fspath(checkpoint_dir)],
                       group.comm if group is not None else None) as ld:
            prep, err = None, None
            try:
                prep = _megatron._LoadState(sharded_state_dict, _megatron._Index(ld),
                                            self.pickle)
            except Exception as e:    # every rank must reach the agreement
                err = e
            _agree(group, "strata.megatron load", err)
            _sync_cuda(prep.cuda)
            ld.load([prep.state], cast=True, widen=True)
        _sync_loaded(prep.cuda)
        values = prep.finish()
        return dict_list_map_inplace(lambda x: values[id(x)], sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        with _S.Loader([os.fspath(checkpoint_dir)]) as ld:
            return _megatron.sharded_metadata(ld, objects=False)

    def load_sharded_metadata(self, checkpoint_dir):
        with _S.Loader([os.fspath(checkpoint_dir)]) as ld:
            return _megatron.sharded_metadata(ld, objects=True)


# ---- enable / disable -----------------------------------------------------------------------

_LOCK = threading.Lock()


def enable(*, pickle=False, pool=None, replace=False, **options):
    """Registers strata's strategies with Megatron-Core's dist_checkpointing as backend
    "strata", version 1 (call on every rank, after torch.distributed is initialised and
    before the first save or load). pickle=True: a ShardedObject or common-state value
    strata's value format lacks is pickled (and unpickled at load, which can run code);
    without it such a save fails naming the value. pool: a strata.Pool for the
    asynchronous saves' snapshots (default: the saver's own). replace=True: a committed
    checkpoint_dir/strata is replaced atomically (else a save there is ExistsError).
    options: strata.Saver options (chunk_bytes, io_threads, direct, sync, bg_nice).
    Also wraps Megatron's common save strategy (common.pt as Megatron writes it, and the
    same state kept as strata values), teaches AsyncCallsQueue to serve strata's requests
    and installs a global optimizer step pre-hook (wait_snapshot). Calling it again
    replaces the options. Returns the save strategy."""
    with _LOCK:
        save = StrataSaveShardedStrategy(pickle=pickle, pool=pool, replace=replace,
                                         options=options)
        load = StrataLoadShardedStrategy(pickle=pickle)
        _mg_base.register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, save)
        _mg_base.register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, load)
        common = _mg_base.default_strategies[StrategyAction.SAVE_COMMON.value]
        inner = common.get(("torch", 1))
        if inner is not None and not isinstance(inner, _CommonCapture):
            _ORIG["common"] = inner
            common[("torch", 1)] = _CommonCapture(inner)
        if "schedule" not in _ORIG:
            _ORIG["schedule"] = _mg_async.AsyncCallsQueue.schedule_async_request
            _mg_async.AsyncCallsQueue.schedule_async_request = _schedule_async_request
        if "hook" not in _ORIG:
            _ORIG["hook"] = register_optimizer_step_pre_hook(_before_step)
        return save


def enabled():
    """Is strata registered with Megatron's dist_checkpointing?"""
    regs = _mg_base.default_strategies[StrategyAction.SAVE_SHARDED.value]
    return isinstance(regs.get((BACKEND, VERSION)), StrataSaveShardedStrategy)


def disable():
    """Undoes enable(): strata's strategies unregistered, Megatron's common strategy and
    AsyncCallsQueue as they were, the step hook removed (saves in flight go on; finalize
    them first)."""
    with _LOCK:
        for action in (StrategyAction.SAVE_SHARDED, StrategyAction.LOAD_SHARDED):
            _mg_base.default_strategies[action.value].pop((BACKEND, VERSION), None)
        if "common" in _ORIG:
            _mg_base.default_strategies[StrategyAction.SAVE_COMMON.value][("torch", 1)] = \
                _ORIG.pop("common")
        if "schedule" in _ORIG:
            _mg_async.AsyncCallsQueue.schedule_async_request = _ORIG.pop("schedule")
        if "hook" in _ORIG:
            _ORIG.pop("hook").remove()
        _COMMON.clear()
