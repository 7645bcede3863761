"""A CheckpointManager's tiers: the roots, fastest first, under which it keeps one
checkpoint a step (step-<N:08d>; step-<N>, as a DCP-style loop names them, is found too).
Each tier is of a kind (tier()): one every save writes (a directory, file://, mem://), or
one behind the others that a save does not write and that is filled in the background
once the save has committed on a faster tier (an object store: s3://, copied by _flush).
A new kind of tier is a class here and an entry of _KINDS. No collective here: the manager
decides on rank 0 what needs deciding once (_group._from_root)."""

import os
import re

import strata as _S

_STEP_DIR = re.compile(r"step-(\d+)")


def committed(uri):
    """Is there a committed checkpoint at uri? (False where it cannot be probed.)"""
    try:
        return _S.probe(uri)["committed"]
    except _S.Error:
        return False


class Tier:
    """A root every save of the manager writes: a directory, file://, mem://."""

    behind = False   # not written by saves: filled once a faster tier holds the step (fill)

    def __init__(self, uri):
        self.uri = uri

    def __repr__(self):
        return "%s(%r)" % (type(self).__name__, self.uri)

    def path(self, step):
        return self.uri.rstrip("/") + "/step-%08d" % int(step)

    def steps(self):
        """The step directories here, [(step, name)] newest first ([] where it cannot be
        listed): the manager's own "step-00000042", and "step-42" as a DCP-style loop names
        them (torchtitan's), whose checkpoints latest() and load() find too."""
        try:
            names = _S.list_dirs(self.uri)   # mem:// and s3:// included
        except _S.Error:                     # missing, or no listable storage there
            return []
        return sorted(((int(m.group(1)), m.group(0)) for m in map(_STEP_DIR.fullmatch, names)
                       if m), reverse=True)

    def holds(self, step):
        """Is step committed here (under the manager's name for it)?"""
        return committed(self.path(step))

    def load_path(self, step):
        """Where step is here: path(step), or "step-<step>" where only that holds it
        committed (a DCP-style loop's name)."""
        p = self.path(step)
        q = self.uri.rstrip("/") + "/step-%d" % int(step)
        return q if not committed(p) and committed(q) else p

    def retain(self, keep):
        """Keeps the `keep` newest committed checkpoints here (strata.retain)."""
        _S.retain(self.uri, keep)

    def fill(self, src, step):
        raise NotImplementedError("%r is written by every save" % self)


class ObjectStoreTier(Tier):
    """An object store (s3://) behind faster tiers: a save does not write it; once the save
    has committed on a faster tier, the flusher copies that checkpoint here (fill:
    strata.copy, every chunk's checksum verified, the commit record written last)."""

    behind = True

    def fill(self, src, step):
        _S.copy(src, self.path(step))


class PeerTier(Tier):
    """The memory tier of every node (mem://), whose copies the other nodes' memory holds
    too: `replicas` copies of each node's files on the next nodes of the ring, sent by
    each save's commit (strata_save_opts.peer_replicas, on the Saver's commit thread).
    After nodes are lost, restore() rebuilds a step on the survivors' memory, committed on
    every node, for an ordinary load into any layout."""

    def __init__(self, uri, replicas=0, parity=None):
        super().__init__(uri)
        if not uri.startswith("mem://"):
            raise ValueError("CheckpointManager: peer replicas need the first tier in host "
                             "memory (mem://...), not %r" % uri)
        self.replicas = int(replicas)
        self.parity = tuple(int(v) for v in parity) if parity else None

    def save_options(self):
        """The save's keywords: peer_replicas=R, or peer_parity=(k, m)."""
        return {"peer_parity": self.parity} if self.parity else {"peer_replicas": self.replicas}

    def local_steps(self):
        """The steps whose directories this node's memory holds (newest first)."""
        return [s for s, _ in self.steps()]

    def restore(self, group, step):
        """strata_peer_restore of step (a collective): ReplicaLostError where the survivors
        cannot rebuild it."""
        return group.comm.peer_restore(self.path(step))


# (URI prefix, kind); any other URI is a Tier every save writes
_KINDS = [("s3://", ObjectStoreTier)]


def tier(uri):
    """The tier at uri, of the kind its scheme says."""
    uri = os.fspath(uri)
    for prefix, cls in _KINDS:
        if uri.startswith(prefix):
            return cls(uri)
    return Tier(uri)


class Tiers:
    """A manager's tiers, fastest first (a list of Tier)."""

    def __init__(self, roots, peer_replicas=0, peer_parity=None):
        roots = roots if isinstance(roots, (list, tuple)) else [roots]
        self.all = [tier(r) for r in roots]
        if not self.all:
            raise ValueError("CheckpointManager: no root")
        self.peer = None   # the PeerTier (the first), with peer_replicas
        if peer_replicas and peer_parity:
            raise ValueError("CheckpointManager: peer_replicas or peer_parity, not both")
        if peer_replicas or peer_parity:
            self.all[0] = self.peer = PeerTier(os.fspath(roots[0]), peer_replicas, peer_parity)

    def __len__(self):
        return len(self.all)

    def __getitem__(self, i):
        return self.all[i]

    @property
    def uris(self):
        return [t.uri for t in self.all]

    def plan(self, group):
        """(saved, behind): the indices of the tiers a save writes and of those filled in
        the background after it commits. Every tier is saved directly with a process group
        of more than one rank (a faster tier may be node-local: no one rank holds the whole
        checkpoint to copy) and where every tier is behind."""
        behind = [i for i, t in enumerate(self.all) if t.behind]
        if not behind or len(behind) == len(self.all) or (group is not None and group.size > 1):
            return list(range(len(self.all))), []
        return [i for i in range(len(self.all)) if i not in behind], behind

    def holding(self, step):
        """The indices of the tiers holding step committed."""
        return [i for i, t in enumerate(self.all) if t.holds(step)]

    def newest_below(self, step, saved):
        """The name of the newest step below step committed on every tier of saved (the
        tiers a save writes: a base one of them lacks would fail the save there), or None."""
        for s, _ in self.all[saved[0]].steps():
            if s < step and all(self.all[i].holds(s) for i in saved):
                return "step-%08d" % s
        return None

    def latest(self):
        """The newest step committed on any tier, or None."""
        best = None
        for t in self.all:
            for s, name in t.steps():
                if best is not None and s <= best:
                    break
                if committed(t.uri.rstrip("/") + "/" + name):
                    best = s
                    break
        return best

    def load_paths(self, step):
        return [t.load_path(step) for t in self.all]
