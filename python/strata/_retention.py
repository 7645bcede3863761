"""A CheckpointManager's retention: after each save, the `keep` newest committed
checkpoints of each tier are kept and the older ones removed (strata.retain), by rank 0;
on a tier that object stores are filled from, the newest ones still to be copied are kept
on top of `keep`. Threading: the manager's thread (after a save) and its flusher's (after
a copy) apply it, one at a time."""

import threading
import warnings

import strata as _S


class Retention:
    """keep: how many checkpoints each tier keeps (0: all); pending(): how many copies to
    tiers behind are not done yet (their sources are the newest of the faster tiers)."""

    def __init__(self, tiers, keep, pending):
        self.tiers = tiers
        self.keep = int(keep)
        self._pending = pending
        self._lock = threading.Lock()

    def apply(self, group, which):
        """Retention on the tiers of the indices `which` (with a process group, on rank 0
        only); a tier where it fails is warned of."""
        if self.keep <= 0 or (group is not None and group.rank != 0):
            return
        with self._lock:
            for i in which:
                t = self.tiers[i]
                keep = self.keep if t.behind else self.keep + self._pending()
                try:
                    t.retain(keep)
                except _S.Error as e:
                    warnings.warn("strata CheckpointManager: retention in %s: %s" % (t.uri, e))
