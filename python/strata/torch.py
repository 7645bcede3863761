"""strata for PyTorch: save and load state dicts where torch.distributed.checkpoint is used.

    import strata.torch as st
    st.save({"model": model, "optim": optimizer, "rng": st.rng_state(), "step": step}, path)
    st.load(state, path)                         # in place, into tensors already allocated
    h = st.async_save(state, path); h.wait_snapshot(); optimizer.step(); ...; h.wait()
    mgr = st.CheckpointManager(["/dev/shm/ckpt", "/data/ckpt"], keep=3)
    st.export_safetensors(path, "hf-model/", prefix="model.", dtype=torch.bfloat16)

DCP's calls work as written (import strata.torch as dcp): dcp.save(state, checkpoint_id=p),
dcp.load(state, checkpoint_id=p), f = dcp.async_save(...); f.result() (_dcpcalls).

State dicts hold (nested in dicts, lists and tuples; flattened to dotted keys such as
"optim.state.layers.0.w.exp_avg"):
  - plain tensors: replicated - every rank holds the same bytes (checked at save: a key
    whose bytes differ across ranks is an error naming it, and nothing is written);
  - DTensors (Shard, Replicate, _StridedShard placements: tensor parallel, FSDP2, FSDP2 x
    TP), each rank describing its boxes of the global tensor, several where its rows are not
    contiguous. Load reshards: any saved layout into any target layout;
  - Stateful objects (state_dict() / load_state_dict(): modules, optimizers, your own),
    expanded at save and restored through load_state_dict at load;
  - values (None, bool, int, float, str, bytes, io.BytesIO, lists, tuples and dicts of
    them) in the tagged format of docs/FORMAT.md ("Python values"), which loads without
    running code; anything else only with pickle=True on both save and load;
  - per_rank(x): a value (or tensor, or nested state) each rank saves for itself and gets
    back for itself (RNG states, data-loader positions): rng_state() / set_rng_state().

With an initialised process group (or the one given) every rank calls together; strata's
collectives run on a dedicated gloo group. Without one, everything runs in this process.

This module is the facade: the process group adapter, save, async_save, load and export.
The rest lives beside it: _tensor (dtypes, errors, tensor checks), _dtensor (a DTensor's
boxes), _statedict (flattening, per-rank values, what a rank registers to save or load),
_manager (CheckpointManager).
"""

import ctypes
import json
import logging
import os
import time
import warnings

import torch
import torch.distributed as dist

import strata as _S
from strata import _dcpcalls
from strata._statedict import (PerRank, _LoadPrep, _Meta, _SavePrep, per_rank,  # noqa: F401
                               rng_state, set_rng_state)
from strata._tensor import (_FROM_STRATA, _TO_STRATA, _sync_cuda,  # noqa: F401
                            _sync_loaded)

_log = logging.getLogger("strata.torch")

__all__ = ["save", "load", "async_save", "AsyncSave", "per_rank", "PerRank", "rng_state",
           "set_rng_state", "CheckpointManager", "export_safetensors"]


# ---- the process group ------------------------------------------------------------------

def _as_u8(mv):
    """A uint8 tensor over the memoryview's bytes (no copy); mv non-empty."""
    if mv.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(mv, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


def _tobytes(t):
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _u8_from_bytes(b):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _timeout_of(pg):
    """The time limit of process group pg's collectives, or None (torch's default)."""
    for dev in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout
        except Exception:
            continue
    return None


def _settle(*tensors):
    """Returns once gloo's worker threads have dropped their references to a finished
    collective's tensors (each tensor's use count is back to its Python object's alone),
    waiting with the GIL released; at most 1 s. A worker drops them a little after the
    caller's wait returned, and doing so needs the GIL (torch keeps a tensor's Python
    object alive while C++ holds it); if the process exits meanwhile, Python's finalization
    ends that thread inside C++ and the process aborts ("terminate called without an active
    exception"). strata.torch's last collective is often a job's last."""
    deadline = None
    for t in tensors:
        while t._use_count() > 1:
            now = time.monotonic()
            if deadline is None:
                deadline = now + 1.0
            elif now > deadline:
                return
            time.sleep(0)


class _Group:
    """A process group as strata sees it: a dedicated gloo group, the strata Comm over it,
    and the Savers made on it (one per pool), kept for the life of the process. As in DCP's
    async_save, the Savers' commit threads run their collectives on gloo groups of their
    own (one made with this one, more if more Savers ask), never on the one the caller's
    thread uses."""

    def __init__(self, pg):
        self.pg = pg
        self.ranks = list(dist.get_process_group_ranks(pg))
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.gloo = self._new_gloo()
        self._bg_first = [self._new_gloo()]    # the first commit thread's (see _dup)
        self.comm = _S.Comm.host(self.rank, self.size, self._allgather, self._alltoallv,
                                 self._bcast, dup=self._dup)
        self.savers = {}
        self._into = True

    def _new_gloo(self):
        """A gloo group of this group's ranks (a collective), with the caller's group's
        time limit (torch's default for gloo, 30 minutes, where it cannot be read), so that
        a commit thread waiting for a dead or stopped peer gives up when the caller's
        collectives would."""
        pg, kw = self.pg, {"backend": "gloo", "timeout": _timeout_of(self.pg)}
        if pg is dist.group.WORLD:
            return dist.new_group(**kw)
        if self.size == dist.get_world_size():
            return dist.new_group(ranks=self.ranks, **kw)
        return dist.new_group(ranks=self.ranks, use_local_synchronization=True, **kw)

    def _dup(self):
        """A Saver's commit thread's collectives (strata calls this on every rank at the
        Saver's first start, so every rank makes the same groups): a gloo group no other
        thread uses, the one made with this group for the first Saver, a new one for each
        later Saver (destroyed when the Saver's commit thread lets go of it)."""
        g = self._bg_first.pop() if self._bg_first else self._new_gloo()
        ops = _BgOps(self, g)
        return ops.allgather, ops.alltoallv, ops.bcast

    def _gather_into(self, out, inp, group=None):
        """all_gather_single (equal sizes), or all_gather into views of out where the
        backend lacks it (older gloo)."""
        group = group or self.gloo
        if self._into:
            try:
                _all_gather_single(out, inp, group=group)
                _settle(out, inp)
                return
            except (RuntimeError, NotImplementedError) as e:
                if "support" not in str(e).lower():
                    raise
                self._into = False
        parts = list(out.chunk(self.size))
        dist.all_gather(parts, inp, group=group)
        _settle(inp, *parts)

    # the Comm's callbacks (run on the thread in save/load, GIL held; a commit thread's
    # on that thread, with their own group)
    def _allgather(self, send, recv, group=None):
        if send.nbytes == 0:
            return
        self._gather_into(_as_u8(recv), _as_u8(send), group)

    def _alltoallv(self, send, scounts, recv, rcounts, group=None):
        scounts = [int(c) for c in scounts]
        rcounts = [int(c) for c in rcounts]
        inp = _as_u8(send)[:sum(scounts)] if send.nbytes else torch.empty(0, dtype=torch.uint8)
        out = _as_u8(recv)[:sum(rcounts)] if recv.nbytes else torch.empty(0, dtype=torch.uint8)
        dist.all_to_all_single(out, inp, output_split_sizes=rcounts,
                               input_split_sizes=scounts, group=group or self.gloo)
        _settle(out, inp)

    def _bcast(self, buf, root, group=None):
        if buf.nbytes == 0:
            return
        t = _as_u8(buf)
        dist.broadcast(t, src=self.ranks[root], group=group or self.gloo)
        _settle(t)

    # collectives of strata.torch itself
    def allgather_bytes(self, data):
        """Every rank's `data` (all the same length)."""
        n = len(data)
        out = torch.empty(n * self.size, dtype=torch.uint8)
        if n:
            self._gather_into(out, _u8_from_bytes(data))
        b = _tobytes(out)
        return [b[i * n:(i + 1) * n] for i in range(self.size)]

    def bcast_bytes(self, data):
        """Rank 0's data (bytes) on every rank."""
        hdr = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(hdr, src=self.ranks[0], group=self.gloo)
        _settle(hdr)
        n = int(hdr[0])
        buf = _u8_from_bytes(data) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        if n:
            dist.broadcast(buf, src=self.ranks[0], group=self.gloo)
            _settle(buf)
        return _tobytes(buf)

    def saver(self, pool=None):
        """The group's saver for pool (its plan cache makes repeated saves of one layout
        cheap): the one of no pool, and the one of the last pool given; a saver holds its
        pool, so an older pool's is dropped, and the pool freed once the caller drops it."""
        s = self.savers.get(id(pool))
        if s is None or s[1] is not pool:
            if pool is not None:
                for k in [k for k, v in self.savers.items() if v[1] is not None]:
                    del self.savers[k]
            s = (_S.Saver(self.comm, pool) if pool is not None else _S.Saver(self.comm), pool)
            self.savers[id(pool)] = s
        return s[0]


class _BgOps:
    """The collectives of one Saver's commit thread, over gloo group g of a _Group; when
    the Saver's duplicate communicator drops them, g is destroyed (locally)."""

    def __init__(self, group, g):
        self.group, self.g = group, g

    def allgather(self, send, recv):
        self.group._allgather(send, recv, self.g)

    def alltoallv(self, send, scounts, recv, rcounts):
        self.group._alltoallv(send, scounts, recv, rcounts, self.g)

    def bcast(self, buf, root):
        self.group._bcast(buf, root, self.g)

    def __del__(self):
        try:
            dist.destroy_process_group(self.g)
        except Exception:   # the default group already destroyed, interpreter exit
            pass


_GROUPS = {}


def _group(process_group):
    """The _Group of process_group (default: the default group), or None without one."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    g = _GROUPS.get(process_group)
    if g is None:
        g = _Group(process_group)
        _GROUPS[process_group] = g
    return g


def _uris(path):
    if isinstance(path, (list, tuple)):
        uris = [os.fspath(p) for p in path]
    else:
        uris = [os.fspath(path)]
    if not uris:
        raise ValueError("strata.torch: no path given")
    return uris


def _exchange(group, what, err, payload=b"", inline=0, same=False):
    """The collective step before strata's own in a save or load: every rank learns whether
    every rank got ready - else all raise: this rank's own error, or the first failing
    rank's, named ("<what> failed on rank r") - and gets every rank's payload (bytes), a
    list by rank; or None where `same` and every rank's payload is the same. libstrata's
    agreement (strata_comm_agree, through Comm.agree on the group's Comm): one allgather
    when every rank is ready and either every payload fits in `inline` bytes (sent with the
    status) or `same` and all are equal; else one more, of the payloads that did not fit."""
    if group is None or group.size == 1:
        if err is not None:
            raise err
        return None if same else [payload]
    if err is None:
        return group.comm.agree(payload, what=what, inline=inline, same=same)
    try:   # every rank must reach the collective; this rank then raises its own error
        group.comm.agree(what=what, error=err, inline=inline, same=same)
    except _S.Error:
        pass
    raise err


def _agree(group, what, err, checks=()):
    """_exchange for strata.torch's save and load: for a save, every rank compares the
    hashes of its replicated entries (a key whose bytes differ across ranks:
    InvalidArgumentError naming it). One allgather when all is well."""
    # (JSON: the C encoder, ~10x faster than _values for 297 keys)
    got = _exchange(group, what, err, json.dumps(sorted(checks)).encode(), same=True)
    if got is None:
        return
    table = {}
    for r, g in enumerate(got):
        for k, h in json.loads(g):
            table.setdefault(k, {}).setdefault(h, []).append(r)
    bad = sorted(k for k, hs in table.items() if len(hs) > 1)
    if bad:
        k = bad[0]
        groups = sorted(table[k].values())
        raise _S.InvalidArgumentError(
            "%s: %r differs across ranks (ranks %s hold different bytes%s); a value "
            "each rank keeps for itself must be marked strata.torch.per_rank(...); "
            "nothing was written"
            % (what, k, " vs ".join(",".join(str(r) for r in g[:8]) for g in groups[:4]),
               "; also %s" % ", ".join(repr(b) for b in bad[1:6]) if len(bad) > 1 else ""))


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


def _dcp_group(process_group, no_dist):
    """The _Group of a save or load: none with no_dist=True (DCP's: this process alone)."""
    return None if no_dist else _group(process_group)


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
    path, replace = _dcpcalls.save_args("strata.torch.save", path, checkpoint_id,
                                        storage_writer, planner, use_collectives, replace,
                                        options)
    group = _dcp_group(process_group, no_dist)
    uris = _uris(path)
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
    path, replace = _dcpcalls.save_args(what, path, checkpoint_id, storage_writer, planner,
                                        use_collectives, replace, options)
    group = _dcp_group(process_group, no_dist)
    uris = _uris(path)
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


def load(state_dict, path=None, process_group=None, *, checkpoint_id=None, storage_reader=None,
         planner=None, no_dist=False, pickle=False, cast=False, partial=False, **options):
    """Loads the checkpoint at path (or the first of several tiers, fastest first, that is
    committed and reads back intact) into state_dict, in place: tensors (and DTensors, in
    whatever layout they have now) are filled, values replaced, Stateful objects restored
    with load_state_dict. Keys of the checkpoint that the state dict lacks are ignored; a
    key of the state dict the checkpoint lacks is NotFoundError naming it - unless
    partial=True (or DCP's DefaultLoadPlanner(allow_partial_load=True)): such keys are left
    as they are, and listed, sorted, in the returned stats' "missing" (and logged at INFO
    on the logger "strata.torch"). A shape that differs is MismatchError; a tensor saved in
    another dtype is converted as it is read where every value is exact in the target's
    (a widening, as DCP does: f16 and bf16 to f32 or f64, f32 to f64, integers to wider
    ones or to floats that hold them) and else MismatchError - unless cast=True, which also
    converts floats to narrower floats (rounded once to nearest even, as Tensor.to does
    from float32; any other pair is MismatchError). As DCP's load: keys are taken in
    sorted order on every rank (Stateful objects may run collectives), every top-level
    entry that is not Stateful is set again after the load, tensors on the meta device are
    replaced by new loaded ones (CPU; a DTensor's on its mesh's device), and an empty dict
    (outside a Stateful) is filled with what the checkpoint holds under its key. Returns
    the load's stats. options: io_threads, max_io_bytes, direct, skip_crc. A DCP checkpoint,
    a torch.save file (or Hugging Face pytorch_model.bin), a DeepSpeed ZeRO tag and a
    Megatron checkpoint carry a zip CRC-32 per entry: every entry the load reads a byte of
    is read whole and checked before its bytes reach the tensors (a mismatch is
    ChecksumError naming the tensor, the entry and the file; stats crc_checked, crc_bytes:
    the bytes read only for that). skip_crc=True reads only the bytes needed and checks
    none (stats crc_skipped). safetensors carries no checksum; strata's own checksums are
    always verified.

    DCP's call (torch.distributed.checkpoint.load) works as written: the path as
    checkpoint_id=, or DCP's FileSystemReader(path) as storage_reader=; planner= DCP's
    DefaultLoadPlanner (allow_partial_load=True is partial=True); no_dist=True loads in
    this process alone. A planner or reader of another kind is InvalidArgumentError."""
    path, partial = _dcpcalls.load_args("strata.torch.load", path, checkpoint_id,
                                        storage_reader, planner, partial)
    group = _dcp_group(process_group, no_dist)
    # one open: the loader reads the index once (with a group, rank 0 reads it and one
    # broadcast agrees on it), the state dict is matched against that index, and the load
    # runs on the same loader - never a second read of the metadata
    with _S.Loader(_uris(path), group.comm if group is not None else None) as ld:
        meta = _Meta(_Meta.of_loader(ld))
        rank = group.rank if group is not None else 0
        prep, err = None, None
        try:
            prep = _LoadPrep(state_dict, meta, rank, pickle, cast, partial)
        except Exception as e:
            err = e
        _agree(group, "strata.torch.load", err)
        _sync_cuda(prep.cuda)
        try:
            stats = ld.load([prep.state], cast=cast, widen=True, **options)
        finally:
            prep.touched()
    _sync_loaded(prep.cuda)
    prep.finish()
    if partial:
        stats["missing"] = sorted(prep.missing)
        if prep.missing:
            _log.info("strata.torch.load: %d key(s) not in %s left as they were: %s",
                      len(prep.missing), meta.uri, ", ".join(stats["missing"][:20]))
    return stats


# ---- export -----------------------------------------------------------------------------

def export_safetensors(path, out, *, prefix=None, max_file_bytes=None, dtype=None,
                       progress=None, io_threads=None, direct=True, include=None, exclude=None,
                       model_only=None, skip_crc=False):
    """Writes the tensors of the checkpoint at path, merged to their full global shapes
    whatever layout they were saved in (DTensor shards, FSDP flat pieces, replicas), as
    Hugging Face safetensors files in the directory out (made if missing):
    model-0000i-of-0000N.safetensors and model.safetensors.index.json (one file:
    model.safetensors alone, as Hugging Face writes it), readable by
    safetensors.torch.load_file and transformers' from_pretrained. Values and per-rank
    entries (non-tensor state) are not exported. Memory stays bounded (windows of at most
    64 MiB; every checksum is verified, a zip entry's CRC-32 included, before any file is
    in place: skip_crc=True leaves those unchecked); files are renamed into place only once
    all are complete, and a failure leaves none.

    prefix: stripped from the start of names ("model." turns "model.layers.0.w" into
    "layers.0.w"; other names are kept). max_file_bytes: the most tensor bytes per file
    (default 5e9; a larger tensor gets a file of its own). dtype: None keeps every saved
    dtype; torch.bfloat16 (or "bf16") converts float64/32/16 tensors to bfloat16 (round to
    nearest even), other dtypes as saved. progress: called as progress(done, total) in
    tensor bytes after each window; if it raises, the export stops with strata.AbortedError
    (the exception as its __cause__). Not collective: call it in one process (the
    checkpoint must be committed). io_threads: the reads' threads; direct=False: never
    O_DIRECT (by default the files are written with it where the file system allows, leaving
    the page cache alone). Returns {data_bytes, bytes, io_calls, seconds, meta_reads,
    crc_checked, crc_bytes, crc_skipped} (meta_reads: the reads of the checkpoint's index:
    one, the export opens it once).

    Which tensors (all by default): include / exclude, a glob or a list of them (fnmatch on
    the checkpoint's names, "*" crossing dots; exclude wins); model_only="model" (or True)
    keeps what the model's state_dict holds in a save of {"model": model, "optim": opt, ...}:
    the tensors named "model.<name>", written as "<name>", never a per_rank one
    ("<key>@rank<r>") nor the optimizer's state (under "optim."); not with prefix. A
    selection that keeps nothing raises strata.NotFoundError, nothing written.
    """
    if isinstance(dtype, torch.dtype):
        if dtype != torch.bfloat16:
            raise _S.InvalidArgumentError(
                "export dtype %s: only torch.bfloat16 (or None: "
                "as saved)" % dtype)
        dtype = "bf16"
    return _S.export_safetensors(os.fspath(path), os.fspath(out), prefix=prefix,
                                 max_file_bytes=max_file_bytes, dtype=dtype, progress=progress,
                                 io_threads=io_threads, direct=direct, include=include,
                                 exclude=exclude, model_only=model_only, skip_crc=skip_crc)


from strata._manager import CheckpointManager  # noqa: E402,F401  (it uses save and load above)
