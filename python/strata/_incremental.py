"""A CheckpointManager's incremental saves: which base each save names (the newest step
below it committed on every tier the save writes, chosen by rank 0; none for the first save
and every full_every-th one), and - with trust_version - which plain tensors a save takes
as unchanged since the base without reading them (the _version rule, docs/DESIGN.md
"Incremental saves"). Threading: the manager's thread."""

from strata._group import _from_root
from strata._statedict import _version_of


class Incremental:
    """enabled: saves name a base (incremental=); full_every: every full_every-th save
    since the last full one is full; trust_version: the _version rule."""

    def __init__(self, enabled, full_every, trust_version):
        self.enabled = bool(enabled)
        self.full_every = int(full_every)
        if self.full_every < 1:
            raise ValueError("CheckpointManager: full_every must be at least 1")
        self.trust_version = bool(trust_version)
        self._snap = None        # (step name, {key: (tensor, _version_of)}): the last save's
        self._since_full = None  # incremental saves since the last full one (None: none yet)

    def base(self, tiers, group, step, saved):
        """The base of the save of step to the tiers of the indices saved: the name of the
        newest step below it committed on all of them, or None (a full save: not
        incremental, none committed yet, or the full_every-th save). With a process group
        rank 0 chooses it for every rank."""
        if not self.enabled or self._since_full is None or self._since_full >= self.full_every:
            return None
        return _from_root(group, lambda: tiers.newest_below(step, saved))

    def options(self, base):
        """The save's keyword options for base."""
        return {"base": base, "incremental": True} if self.enabled else {}

    def unmoved(self, base):
        """The _version rule for a save on base (trust_version): a test of (key, tensor), or
        None where base is not the last save's."""
        snap = self._snap
        if not self.trust_version or base is None or snap is None or snap[0] != base:
            return None
        rec = snap[1]

        def test(key, t):
            r = rec.get(key)
            if r is None:
                return False
            held, v = r
            return _version_of(t) == v and held._version == v[-1]
        return test

    def record(self, step, prep):
        """What the _version rule keeps of the save of step as it starts: its plain tensors
        (held: their memory is not reused while held) and their _version_of."""
        if not self.trust_version:
            return None
        rec = {}
        for key, t in prep.plain:
            v = _version_of(t)
            if v is not None:
                rec[key] = (t, v)
        return "step-%08d" % step, rec

    def ended(self, base, committed, snap):
        """Counts the save just ended toward full_every; keeps its tensors' versions (snap,
        from record) where it committed on every tier, else forgets them."""
        if committed:
            self._since_full = 0 if base is None else self._since_full + 1
        self._snap = snap if committed else None

    def forget(self):
        """A load moved the counters of what it filled: no tensor is taken as unchanged."""
        self._snap = None
