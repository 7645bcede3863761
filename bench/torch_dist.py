"""Gloo process groups for `make bench-torch`: jobs of N ranks forked from this process.

    results = run_job(fn, nprocs, *args, timeout=600)

Forks `nprocs` children of the calling process (which must have imported torch but run no
torch op and started no thread: fork is then safe), each initialising a gloo process group
through a file:// store, calling fn(*args) and sending back its return value through a
pickle file. A rank that raises or dies fails the job (RuntimeError with every rank's
traceback and log tail); a job still running after `timeout` seconds is killed.
"""

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

THREADS = int(os.environ.get("BENCH_TORCH_RANK_THREADS", "1"))


def _child(tmp, rank, nprocs, timeout, fn, args):
    path = os.path.join(tmp, "result%d.pkl" % rank)

    def put(ok, value):
        with open(path + ".tmp", "wb") as f:
            pickle.dump((ok, value), f)
        os.rename(path + ".tmp", path)

    try:
        import datetime
        import faulthandler
        import torch
        import torch.distributed as dist
        faulthandler.enable()
        faulthandler.dump_traceback_later(max(timeout - 5, 1), exit=False)
        torch.set_num_threads(THREADS)
        if nprocs > 1:
            os.environ["RANK"] = str(rank)
            os.environ["WORLD_SIZE"] = str(nprocs)
            dist.init_process_group(
                "gloo", init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                world_size=nprocs, timeout=datetime.timedelta(seconds=max(timeout, 60)))
        value = fn(*args)
        if nprocs > 1:
            dist.barrier()
            dist.destroy_process_group()
        put(True, value)
    except BaseException:
        put(False, traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(fn, nprocs, *args, timeout=600):
    """fn(*args) on nprocs forked ranks (nprocs 1: one forked process, no process group);
    returns the ranks' return values."""
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as tmp:
        pids = []
        for r in range(nprocs):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    fd = os.open(os.path.join(tmp, "rank%d.log" % r),
                                 os.O_WRONLY | os.O_CREAT, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    _child(tmp, r, nprocs, timeout, fn, args)
                finally:
                    os._exit(1)
            pids.append(pid)
        deadline = time.monotonic() + timeout
        status = {}
        failed_at = None
        while len(status) < nprocs:
            for i, pid in enumerate(pids):
                if i in status:
                    continue
                got, st = os.waitpid(pid, os.WNOHANG)
                if got:
                    status[i] = st
                    if st != 0 and failed_at is None:
                        failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + 20):
                for i, pid in enumerate(pids):
                    if i not in status:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                        os.waitpid(pid, 0)
                        status[i] = "killed"
                break
            time.sleep(0.02)
        results, errors = [], []
        for r in range(nprocs):
            p = os.path.join(tmp, "result%d.pkl" % r)
            if os.path.exists(p):
                with open(p, "rb") as f:
                    ok, value = pickle.load(f)
                results.append(value if ok else None)
                if not ok:
                    errors.append("rank %d:\n%s" % (r, value))
            else:
                results.append(None)
                errors.append("rank %d: no result (status %s)" % (r, status.get(r)))
        if errors:
            logs = []
            for r in range(nprocs):
                try:
                    with open(os.path.join(tmp, "rank%d.log" % r), errors="replace") as f:
                        logs.append("[rank %d log]\n%s" % (r, f.read()[-4000:]))
                except OSError:
                    pass
            raise RuntimeError("%s on %d ranks failed:\n%s\n%s" % (
                getattr(fn, "__name__", fn), nprocs, "\n".join(errors), "\n".join(logs)))
        return results
