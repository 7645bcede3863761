"""CheckpointManager: the checkpoints of a training loop, on tiers, with retention. The
manager runs the saves and loads; beside it, _tiers.py (the tiers, their kinds and their
step directories), _retention.py (what each tier keeps), _incremental.py (each save's base,
the _version rule) and _flush.py (the background copies to tiers behind the others)."""

import warnings

import strata as _S
from strata import _flush
from strata._group import _from_root, _group
from strata._incremental import Incremental
from strata._load import load
from strata._retention import Retention
from strata._save import AsyncSave, _prepare_save, _versions
from strata._tiers import Tiers


class _TierSave(AsyncSave):
    """A save of the manager's (its AsyncSave): when it ends, wait() has the manager run
    retention on the tiers that committed it, and reports its error once: a warning where
    some tier committed it, else raised with its step."""

    def __init__(self, handle, prep, ended):
        super().__init__(handle, prep)
        self._ended = ended

    def wait_snapshot(self):
        """Returns once the state's bytes are copied out (strata's wait_snapshot returns
        then too, with the error of a tier that failed so far: wait() reports it)."""
        try:
            super().wait_snapshot()
        except _S.Error:
            pass

    def _dcp_settle(self):
        """(The Future's outcome is the one wait() below reports, after _ended.)"""

    def wait(self):
        if not self._finished:
            try:
                super().wait()
            except Exception:
                pass
            self._exc = self._ended(self._exc)
            AsyncSave._dcp_settle(self)
        if self._exc is not None:
            e, self._exc = self._exc, None
            raise e
        return self._result


class CheckpointManager:
    """Checkpoints of a training loop: root is one directory, or tiers fastest first (e.g.
    ["/dev/shm/run", "/local/run", "/shared/run"]); every save writes <tier>/step-NNNNNNNN
    on every tier, and after it commits keeps the `keep` newest committed checkpoints of each
    tier (strata.retain). It holds the buffer pool (pool_bytes, allocated at the first save)
    and the saver, whose cached plan makes repeated saves of one layout cheap.

        mgr = CheckpointManager(root, keep=3)
        start = mgr.load(state) + 1 if mgr.latest() is not None else 0
        for step in range(start, n):
            ...
            h = mgr.save(step, state)     # async: h.wait_snapshot() before optimizer.step()
        mgr.close()

    With a process group every rank makes the same calls; rank 0 chooses the step and
    applies retention.

    Object-store tiers (s3://) behind faster ones are flushed in the background: a save
    writes the other tiers, counts as saved once one of them commits, and a worker thread
    then copies that committed checkpoint to each s3:// tier (strata.copy: checksums
    verified, committed there last). wait_durable() and close() wait for the flushes;
    retention keeps on the faster tiers what is still being flushed; load() reads the
    fastest tier holding a committed copy. With a process group of more than one rank (a
    faster tier may be node-local), or where every tier is s3://, every tier is saved
    directly.

    Incremental saves (incremental=True, the default): each save names as its base the
    newest step below it committed on every tier the save writes (chosen by rank 0 with a
    process group; every tier's copy of it must be the same save, else the save is a full
    one),
    and tensors whose bytes equal the base's are neither copied nor written: the base's
    file holding them is hard-linked into the new checkpoint, which stays whole on its own
    (retention, gc and rm -r of the base free none of its bytes). Where a file system
    cannot link (or a rank cannot), that save (or that rank's part) is written in full.
    Every full_every-th save since the last full one (in this manager) is a full save, so
    that files kept alive by links stay few.

    Peer replicas (peer_replicas=R, with a process group over several nodes): the first
    tier must be host memory (mem://...), which each node holds for its own ranks; each
    save's commit then also sends every node's files to the memory of the R next nodes
    (a ring of nodes, strata_peer_replicate), in the background on the Saver's commit
    thread. The AsyncSave's level() says how far a save got (strata.LEVEL_LOCAL |
    LEVEL_REPLICATED | LEVEL_DURABLE). After losing up to R nodes, a job restarted on the
    survivors (any number of ranks and nodes, any layout) calls load(): it rebuilds the
    newest step the survivors' memory can rebuild (strata_peer_restore) unless a slower
    tier holds a newer one committed, then loads it through the ordinary planner; a step
    the survivors cannot rebuild comes from the slower tiers. Incremental saves are off
    with peer replicas (a replica holds whole files). peer_parity=(k, m) instead keeps
    Reed-Solomon parity (ISA-L): groups of k + m nodes, (1 + m/k) x a node's share in its
    memory, any m nodes of a group lost.

    Unchanged tensors not even read (an incremental save with a base, in one process: with
    a process group of more than one rank the marks are not carried between ranks, and a
    save hashes its candidates - and its replicated tensors, to agree on them):
      - frozen= (as strata.torch.save's: True for the modules' parameters with
        requires_grad=False, names, or a callable; save(frozen=...) overrides it for one
        save): the caller's promise that those tensors equal the base's. Their bytes are
        neither hashed nor copied; the promise is not checked.
      - trust_version=True: a plain tensor (not a DTensor, not an inference tensor, read in
        place) whose storage, address, shape, strides, dtype and _version counter are those
        it had when this manager's last save - the base, committed on every tier - started
        is taken as unchanged (the manager holds that save's tensors, so their memory cannot
        be reused by others meanwhile; strata.torch.load moves the counter of what it
        fills). Sound only where every write to such a tensor moves its counter: in-place
        torch ops do (optimizer.step, copy_, under no_grad too, through views and
        detach()); writes through .data, through its untyped_storage() (copy_, fill_: a
        storage has no counter), through numpy()/DLPack/ctypes/data_ptr(), through
        another tensor made over the same memory (set_, frombuffer, from_blob), and a
        storage freed and refilled in place (resize_, as FSDP does with unsharded
        parameters) do not, and would be saved as the base's bytes. Off by default."""

    def __init__(self, root, *, keep=3, pool_bytes=1 << 30, process_group=None,
                 async_save=True, pickle=False, incremental=True, full_every=10,
                 frozen=None, trust_version=False, peer_replicas=0, peer_parity=None):
        self._tiers = Tiers(root, peer_replicas, peer_parity)
        self.tiers = self._tiers.uris
        self.pool_bytes = int(pool_bytes)
        self.process_group = process_group
        self.async_save = bool(async_save)
        self.pickle = pickle
        self.frozen = frozen
        self._incr = Incremental(incremental and self._tiers.peer is None, full_every,
                                 trust_version)
        # the copies to tiers behind (s3://), then retention on every tier, on its thread
        self._flusher = _flush.Flusher(lambda job: self._retention.apply(None, range(len(
            self._tiers))))
        self._retention = Retention(self._tiers, keep, self._flusher.pending)
        self._pool = None
        self._saver = None
        self._pending = None
        self._closed = False

    def _group(self):
        return _group(self.process_group)

    def path(self, step, tier=0):
        return self._tiers[tier].path(step)

    @property
    def pool(self):
        """The manager's strata.Pool: None until prepare() or the first save made it."""
        return self._pool

    def prepare(self):
        """Allocates the pool (pool_bytes, pre-faulted) and the saver now, at setup, instead
        of in the first save, which would then wait for that allocation. With a process
        group every rank calls it. Returns self."""
        if self._closed:
            raise ValueError("strata CheckpointManager: closed")
        self._get_saver(self._group())
        return self

    def _get_saver(self, group):
        if self._saver is None:
            self._pool = _S.Pool(self.pool_bytes) if self.pool_bytes else None
            comm = group.comm if group is not None else None
            self._saver = _S.Saver(comm, self._pool) if self._pool is not None else _S.Saver(comm)
        return self._saver

    def save(self, step, state_dict, *, frozen=None):
        """Saves state_dict as step on every tier: returns the AsyncSave (async_save=True;
        its wait() returns the stats, or None where a tier failed) or the stats. The save in
        flight is waited for first; where it failed, its error is reported once, naming its
        step: a warning if some tier committed it (the others are retained as usual), else
        raised by the wait() made first - the AsyncSave's, the manager's, or close() - or,
        if none was, a warning here. A failing tier never stops the saves to the others."""
        if self._closed:
            raise ValueError("CheckpointManager: closed")
        self._wait(False)
        group = self._group()
        step = int(step)
        saved, behind = self._tiers.plan(group)
        uris = [self.path(step, i) for i in saved]
        base = self._incr.base(self._tiers, group, step, saved)
        prep = _prepare_save(state_dict, group, self.pickle,
                             self.frozen if frozen is None else frozen, self._incr.unmoved(base))
        snap = self._incr.record(step, prep)
        saver = self._get_saver(group)
        kw = self._incr.options(base)
        if self._tiers.peer is not None and group is not None and group.size > 1:
            kw.update(self._tiers.peer.save_options())
        jobs = []   # its copies to the tiers behind (none: none, or not started)

        def ended(exc):
            self._incr.ended(base, exc is None, snap)
            err = self._ended(group, step, exc)
            for job in jobs:
                self._flusher.ended(job, err is None)
            return err
        if self.async_save:
            versions = _versions(prep)
            h = saver.start(uris, [prep.state], step=step, **kw)
            jobs.extend(self._flush(step, saved, behind))
            self._pending = _TierSave(h, prep, ended)
            self._pending._versions = versions
            return self._pending
        try:
            stats = saver.save(uris, [prep.state], step=step, **kw)
        except _S.Error as e:
            jobs.extend(self._flush(step, saved, behind))
            err = ended(e)
            if err is not None:
                raise err from e
            return None
        jobs.extend(self._flush(step, saved, behind))
        ended(None)
        return stats

    def _flush(self, step, saved, behind):
        """[the copy of step to the tiers behind], submitted once its save has started (it
        copies once the save has committed on one of the tiers saved), or []."""
        if not behind:
            return []
        return [self._flusher.submit(step, [self.path(step, i) for i in saved],
                                     [self._tiers[i] for i in behind])]

    def _ended(self, group, step, exc):
        """After the save of step (exc: its error, or None): retention on the tiers that
        committed it (rank 0 looks, and tells the others); an error is warned of here where
        some tier committed the step, else returned, naming the step, to be raised."""
        if exc is None:
            self._retention.apply(group, self._tiers.plan(group)[0])
            return None
        ok = _from_root(group, lambda: self._tiers.holding(step))
        self._retention.apply(group, ok)
        if ok:
            warnings.warn("strata CheckpointManager: step %d is committed on %s only: %s"
                          % (step, ", ".join(self.tiers[i] for i in ok), exc))
            return None
        cls = type(exc) if isinstance(exc, _S.Error) else _S.InvalidArgumentError
        e = cls("step %d was saved on no tier: %s" % (step, exc))
        e.__cause__ = exc
        return e

    def _wait(self, raise_error):
        p, self._pending = self._pending, None
        if p is None:
            return None
        try:
            return p.wait()
        except _S.Error as e:
            if raise_error:
                raise
            warnings.warn("strata CheckpointManager: %s" % e)
            return None

    def wait(self):
        """Waits for the save in flight (if any) to end: returns its stats (None where a
        tier failed: warned of), and raises its error if it committed on no tier. The
        background flushes to object-store tiers go on (wait_durable waits for them)."""
        return self._wait(True)

    def wait_durable(self):
        """wait(), then waits for the background flushes to object-store tiers (s3://)
        submitted so far; raises the first flush that failed (each names its step and
        tier; the others are warned of)."""
        stats = self.wait()
        errors = self._flusher.wait()
        for e in errors[1:]:
            warnings.warn(str(e))
        if errors:
            raise errors[0]
        return stats

    def latest(self):
        """The newest step with a committed checkpoint on any tier, or None: the answer to
        "where do I resume from" (a directory is committed once its COMMIT file is there;
        strata.probe(path)["committed"] tells for one). Directories named step-<N> as well
        as the manager's own step-<N:08d> (so a root a DCP-style loop saved into too)."""
        return _from_root(self._group(), self._tiers.latest)

    def load(self, state_dict, step=None, **options):
        """Loads step (default: latest()) into state_dict from the fastest tier holding a
        committed copy (falling back through the others); returns the step. options: those
        of strata.torch.load (cast, partial, io_threads, ...)."""
        self._wait(False)
        if self._tiers.peer is not None:
            step = self._peer_restore(step)
        if step is None:
            step = self.latest()
            if step is None:
                raise _S.NotFoundError("no committed checkpoint under %s"
                                       % ", ".join(self.tiers))
        uris = self._tiers.load_paths(step)
        self._incr.forget()   # (the load moves the counters of what it fills anyway)
        load(state_dict, uris, self.process_group, pickle=self.pickle, **options)
        return int(step)

    def _peer_restore(self, step):
        """With a peer tier: the step to load - the newest (or the given) step the nodes'
        memory rebuilds, committed on every node (strata_peer_restore), unless a slower
        tier holds a newer one committed - or None (latest() decides then). Every rank
        learns the steps each node's memory holds; each restore is one collective."""
        group = self._group()
        if group is None or group.size == 1:
            return step
        peer = self._tiers.peer
        held = group.comm.agree(" ".join(map(str, peer.local_steps())).encode(),
                                what="listing the peer tier")
        cands = sorted({int(s) for b in held for s in b.split()}, reverse=True)
        slower = _from_root(group, lambda: max(
            (s for i, t in enumerate(self._tiers.all) if i > 0 for s, _ in t.steps()
             if t.holds(s)), default=None))
        lost = None
        for s in cands if step is None else [int(step)]:
            if step is None and slower is not None and s < slower:
                break
            try:
                peer.restore(group, s)
                if lost is not None:   # a newer step could not be rebuilt: said once
                    warnings.warn("strata CheckpointManager: %s; loading step %d" % (lost, s))
                return s
            except _S.ReplicaLostError as e:
                lost = e
        if step is not None or slower is not None:
            if lost is not None:   # the slower tiers hold it (the load falls back to them)
                warnings.warn("strata CheckpointManager: %s" % lost)
            return step if step is not None else slower
        raise _S.ReplicaLostError("no step under %s can be rebuilt from the nodes' memory and "
                                  "no other tier holds one%s" % (
                                      peer.uri, ": %s" % lost if lost else ""))

    def close(self):
        """Waits for the save in flight, then lets go of the saver and the pool."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            for e in self._flusher.close():   # the flushes end first: errors warned of
                warnings.warn(str(e))
            self._closed = True
            self._saver = None
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
