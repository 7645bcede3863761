"""A CheckpointManager's background copies: tiers behind the others (object stores, s3://:
_tiers.Tier.behind) are not written by a save; once the save has committed on a faster
tier, a worker thread copies that committed checkpoint to each of them (Tier.fill; for an
object store strata.copy: every chunk's checksum verified, the commit record written
last). Threading: one worker per manager, started at the first copy; submit, ended,
pending, wait and close are called by the manager's thread (pending by the worker too)."""

import collections
import threading
import warnings

import strata as _S
from strata._tiers import committed

_POLL_S = 0.05   # how often a job waiting for its save looks for the commit record


class Job:
    """The copy of one step: from the first of sources (paths) that holds it committed to
    each of dests (tiers behind), once the save has ended (Flusher.ended) or a source is
    seen committed."""

    def __init__(self, step, sources, dests):
        self.step = step
        self.sources = sources
        self.dests = dests
        self.ok = None   # the save's outcome once known: True (some source committed) or False


class Flusher:
    """Runs the flush jobs one at a time, in the order submitted. after(job) runs on the
    worker after each job (the manager's retention); errors are kept for wait()."""

    def __init__(self, after):
        self._after = after
        self._cv = threading.Condition()
        self._jobs = collections.deque()
        self._busy = 0          # jobs submitted whose after() has not run yet
        self._unflushed = 0     # jobs submitted and not copied yet
        self._errors = []
        self._thread = None
        self._stop = False

    def submit(self, step, sources, dests):
        """Queues the copy of step from sources to dests (see Job); returns its Job."""
        job = Job(step, sources, dests)
        with self._cv:
            self._jobs.append(job)
            self._busy += 1
            self._unflushed += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name="strata-flush",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return job

    def ended(self, job, ok):
        """job's save has ended: some source committed it (ok), or none did."""
        with self._cv:
            job.ok = bool(ok)
            self._cv.notify_all()

    def pending(self):
        """Jobs submitted and not finished: the newest checkpoints of the faster tiers are
        theirs, which retention there keeps on top of its `keep`."""
        with self._cv:
            return self._unflushed

    def wait(self):
        """Waits until every job submitted has finished; returns (and forgets) their errors,
        each naming its step and tier."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            errors, self._errors = self._errors, []
        return errors

    def close(self):
        errors = self.wait()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            t, self._thread = self._thread, None
        if t is not None:
            t.join()
        return errors

    def _main(self):
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            try:
                self._run(job)
            except BaseException as e:   # never lose the worker: report it
                with self._cv:
                    self._errors.append(e)
            with self._cv:
                self._jobs.popleft()
                self._unflushed -= 1
            try:
                self._after(job)
            except Exception as e:
                warnings.warn("strata CheckpointManager: after the flush of step %d: %s"
                              % (job.step, e))
            with self._cv:
                self._busy -= 1
                self._cv.notify_all()

    def _source(self, job):
        """The committed source of job, waiting for its save; None if the save failed."""
        while True:
            if job.ok is False:
                return None
            for s in job.sources:
                if committed(s):
                    return s
            if job.ok is True:   # ended, yet no source committed: removed meanwhile
                return None
            with self._cv:
                self._cv.wait(_POLL_S)

    def _run(self, job):
        src = self._source(job)
        if src is None:
            if job.ok is True:
                with self._cv:
                    self._errors.append(_S.MissingError(
                        "strata CheckpointManager: step %d: no committed copy left on %s to "
                        "flush to %s" % (job.step, ", ".join(job.sources),
                                         ", ".join(d.path(job.step) for d in job.dests))))
            return
        for d in job.dests:
            try:
                d.fill(src, job.step)
            except _S.Error as e:
                err = type(e)("strata CheckpointManager: flushing step %d to %s: %s"
                              % (job.step, d.path(job.step), e))
                err.__cause__ = e
                with self._cv:
                    self._errors.append(err)
