"""strata.torch's process groups: a torch.distributed process group as strata sees it (a
gloo group of its own, the strata.Comm over it, the Savers made on it), and the agreement
every rank runs before strata's own collectives in a save or load (libstrata's
strata_comm_agree through Comm.agree). Threading: the caller's thread; a Saver's commit
thread calls its own gloo group's collectives (_BgOps)."""

import ctypes
import json
import time
import warnings

import torch
import torch.distributed as dist

import strata as _S
from strata import _values


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


def _release():
    """At exit (strata/__init__.py), after the saves in flight have finished: drops every
    _Group, so that its Savers are freed (their commit threads joined) and its gloo groups
    destroyed now."""
    import gc
    _GROUPS.clear()
    gc.collect()


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


def _from_root(group, choose):
    """choose() - a value _values encodes - run on rank 0 alone, its result on every rank
    (one broadcast); without a group of several ranks, choose()."""
    if group is None or group.size == 1:
        return choose()
    v = choose() if group.rank == 0 else None
    return _values.decode(group.bcast_bytes(_values.encode(v)))[1]


def _dcp_group(process_group, no_dist):
    """The _Group of a save or load: none with no_dist=True (DCP's: this process alone)."""
    return None if no_dist else _group(process_group)



# ---- agreeing before strata's own step ---------------------------------------------------

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
