"""Launching N-process gloo runs for the strata.torch tests.

    results = run(fn, nprocs, *args, timeout=120, **kwargs)

runs `fn(*args, **kwargs)` in `nprocs` fresh processes, each with torch.distributed
initialised (gloo, through a file:// store in a temporary directory; fn finds its rank with
torch.distributed.get_rank()), and returns their return values: `results[r]` is rank r's,
sent back through a pickle file. `fn` must be a module-level function of an importable
module (a test module: the children get the test process's sys.path).

If any rank raises, run() raises RankFailure with every failing rank's traceback (the first
to fail first) and the output of all ranks. A rank that dies without a result (a crash in C,
a kill) fails the run the same way. A run still going after `timeout` seconds is killed
(each rank dumps its Python stack shortly before): a hang fails the test instead of blocking
the suite. When one rank has failed, the others get a short grace period to fail too (they
are usually stuck in a collective with the dead rank) and are then killed.

`nprocs=0` runs `fn` in one child process *without* a process group.

Processes: importing torch and its distributed packages takes ~4 s of CPU per process, and
this machine has 2 cores, so instead of starting interpreters the ranks are forked from a
"fork server": one helper process (started on first use, kept for the test session) that has
imported torch, torch.distributed and its tensor/fsdp/checkpoint packages and nothing else
(no threads started, no process group, no strata). Each rank is a fork of it. Set
STRATA_TEST_FORK=0 to start a fresh interpreter per rank instead.

The ranks' stdout and stderr go to per-rank logs; run() prints them, prefixed with the rank,
when `echo=True`, and puts them in the failure message.
"""

import atexit
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# Threads per rank: N processes share 2 cores here; more threads only thrash.
THREADS = os.environ.get("STRATA_TEST_THREADS", "1")
# After one rank failed, how long the others get to end on their own before being killed.
GRACE = float(os.environ.get("STRATA_TEST_GRACE", "15"))

_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor",
            "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
            "torch.nn.parallel", "torch._dynamo", "torch.optim")


class RankFailure(AssertionError):
    pass


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", THREADS)
    env.setdefault("MKL_NUM_THREADS", THREADS)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("PYTHONWARNINGS", "ignore")
    if extra:
        env.update(extra)
    return env


# ---- the fork server ----------------------------------------------------------------------

class _ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import _dist; _dist._serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(), cwd=HERE)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("READY"):
            raise RuntimeError("fork server did not start: %r" % line)

    def alive(self):
        return self.proc.poll() is None

    def spawn(self, tmp, nprocs, timeout):
        self.proc.stdin.write(("RUN %s %d %d\n" % (tmp, nprocs, timeout)).encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().decode().split()
        if not line or line[0] != "PIDS":
            raise RuntimeError("fork server failed: %r" % line)
        return [_Forked(int(p)) for p in line[1:]]

    def close(self):
        if self.alive():
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except Exception:
                self.proc.kill()


class _Forked:
    """A rank forked by the server (reaped by the server: liveness by pid)."""

    def __init__(self, pid):
        self.pid = pid
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                with open("/proc/%d/stat" % self.pid) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state in ("Z", "X"):
                    self.returncode = "?"
            except (FileNotFoundError, ProcessLookupError, IndexError):
                self.returncode = "?"
        return self.returncode

    def kill(self):
        _killpg(self.pid)
        self.returncode = "killed"

    def wait(self):
        while self.poll() is None:
            time.sleep(0.01)


class _Spawned:
    def __init__(self, tmp, rank, nprocs, timeout, log):
        self.p = subprocess.Popen(
            [sys.executable, "-c", "import _dist; _dist._child(*__import__('sys').argv[1:])",
             tmp, str(rank), str(nprocs), str(timeout)],
            stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=tmp, start_new_session=True)

    def poll(self):
        return self.p.poll()

    @property
    def returncode(self):
        return self.p.returncode

    def kill(self):
        _killpg(self.p.pid)

    def wait(self):
        self.p.wait()


_server = None


def _get_server():
    global _server
    if _server is None or not _server.alive():
        _server = _ForkServer()
        atexit.register(_server.close)
    return _server


def _serve():
    """The fork server's main loop (runs in its own interpreter)."""
    import importlib
    for m in _PRELOAD:
        importlib.import_module(m)
    import torch
    torch.set_num_threads(int(THREADS))
    # ranks are reaped by the kernel; run() watches them by pid
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "RUN":
            continue
        tmp, nprocs, timeout = parts[1], int(parts[2]), int(parts[3])
        pids = []
        for r in range(max(nprocs, 1)):
            pid = os.fork()
            if pid == 0:
                try:
                    # a session of its own: run() kills the rank's whole group at its end,
                    # with whatever the rank started (a library's worker processes)
                    os.setsid()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    fd = os.open(os.path.join(tmp, "rank%d.log" % r), os.O_WRONLY | os.O_CREAT, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    sys.stdin.close()
                    os.chdir(tmp)
                    _child(tmp, r, nprocs, timeout)
                finally:
                    os._exit(1)
            pids.append(pid)
        out.write("PIDS %s\n" % " ".join(map(str, pids)))
        out.flush()


# ---- running a job -------------------------------------------------------------------------

def run(fn, nprocs, *args, timeout=120, echo=False, env=None, **kwargs):
    mod = fn.__module__
    name = fn.__qualname__
    if mod == "__main__" or "<" in name:
        raise ValueError("run(): fn must be a module-level function of an importable module")
    n = max(nprocs, 1)
    with tempfile.TemporaryDirectory(prefix="strata-dist-") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump((mod, name, args, kwargs, list(sys.path), env or {}), f)
        logs = [os.path.join(tmp, "rank%d.log" % r) for r in range(n)]
        start = time.monotonic()
        procs = []
        timed_out = False
        try:
            if os.environ.get("STRATA_TEST_FORK", "1") != "0":
                procs = _get_server().spawn(tmp, nprocs, timeout)
            else:
                for r in range(n):
                    with open(logs[r], "wb") as log:
                        procs.append(_Spawned(tmp, r, nprocs, timeout, log))
            deadline = start + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                failed = [r for r in range(n) if _failed(tmp, r, procs[r])]
                if failed:
                    grace = time.monotonic() + GRACE
                    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                        time.sleep(0.05)
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            # what a rank started and left behind (an orphan holds ~200 MB and never ends)
            for p in procs:
                _killpg(p.pid if isinstance(p, _Forked) else p.p.pid)
        elapsed = time.monotonic() - start
        outputs = []
        for path in logs:
            try:
                with open(path, "rb") as f:
                    outputs.append(f.read().decode("utf-8", "replace"))
            except FileNotFoundError:
                outputs.append("")
        results, errors = [], []
        for r in range(n):
            path = os.path.join(tmp, "result%d.pkl" % r)
            if os.path.exists(path):
                with open(path, "rb") as f:
                    ok, value, when = pickle.load(f)
                results.append(value if ok else None)
                if not ok:
                    errors.append((when, r, value))
            else:
                results.append(None)
                killed = timed_out or procs[r].returncode == "killed"
                # a rank that died on its own (a crash in C) is the likeliest cause: first
                errors.append((float("inf") if killed else 0.0, r,
                               "rank %d ended without a result (%s)" % (
                                   r, "killed at the timeout" if timed_out else
                                   "killed after another rank failed" if killed else
                                   "the process died: see its output below")))
        out = "".join("".join("[rank %d] %s\n" % (r, line) for line in o.splitlines())
                      for r, o in enumerate(outputs))
        if errors or timed_out:
            errors.sort(key=lambda e: (e[0], e[1]))
            msg = ["%s.%s on %d process(es) failed after %.1f s%s" % (
                mod, name, n, elapsed, " (TIMEOUT after %d s)" % timeout if timed_out else "")]
            for _, r, tb in errors:
                msg.append("---- rank %d ----\n%s" % (r, tb))
            if len(out) > 30000:
                out = out[:10000] + "\n[... output cut ...]\n" + out[-20000:]
            msg.append("---- output of all ranks ----\n" + out)
            raise RankFailure("\n".join(msg))
        if echo and out:
            print(out)
        return results


def _killpg(pid):
    """SIGKILL to the process group of rank process pid (its own session: setsid)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _failed(tmp, r, proc):
    """Has rank r failed (an exception reported, or the process gone without a result)?"""
    path = os.path.join(tmp, "result%d.pkl" % r)
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                return not pickle.load(f)[0]
        except Exception:
            return False
    return proc.poll() is not None


def _child(tmp, rank, nprocs, timeout):
    rank, nprocs, timeout = int(rank), int(nprocs), int(timeout)
    result_path = os.path.join(tmp, "result%d.pkl" % rank)

    def put(ok, value):
        try:
            data = pickle.dumps((ok, value, time.time()))
        except Exception:
            data = pickle.dumps((False, "result not picklable:\n" + traceback.format_exc(),
                                 time.time()))
        with open(result_path + ".tmp", "wb") as f:
            f.write(data)
        os.rename(result_path + ".tmp", result_path)

    try:
        import faulthandler
        import importlib
        faulthandler.enable()
        # a rank still running shortly before the parent kills it prints where it is
        faulthandler.dump_traceback_later(max(timeout - 3, 1), exit=False)
        with open(os.path.join(tmp, "job.pkl"), "rb") as f:
            mod, name, args, kwargs, path, env = pickle.load(f)
        sys.path[:] = path + [p for p in sys.path if p not in path]
        os.environ.update(env)
        import torch
        torch.set_num_threads(int(THREADS))
        fn = importlib.import_module(mod)
        for part in name.split("."):
            fn = getattr(fn, part)
        if nprocs > 0:
            import datetime
            import torch.distributed as dist
            dist.init_process_group(
                "gloo", init_method="file://" + os.path.join(tmp, "store"), rank=rank,
                world_size=nprocs, timeout=datetime.timedelta(seconds=max(timeout, 30)))
        value = fn(*args, **kwargs)
        if nprocs > 0:
            import torch.distributed as dist
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
    # skip interpreter teardown (torch's and strata's threads can make it slow)
    os._exit(0)
