"""Starting N torch.distributed ranks as fresh interpreters with the env:// variables, the
way DeepSpeed's launcher starts them (DeepSpeed reads them; the fork server of _dist.py
does not fit an engine that imports half of PyTorch itself): tests/python/test_deepspeed.py,
test_zero_source.py and bench/bench_deepspeed.py, bench_zero_export.py.

    procs = launch([script, arg...], world, log=lambda r: path_of_rank_r_log)
    rcs = wait(procs, timeout=600)
"""

import os
import signal
import socket
import subprocess
import sys


def launch(args, world, log, env=None):
    """Starts `world` processes of `python args...`: rank r with RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT (one free port of 127.0.0.1), OMP_NUM_THREADS=1,
    PYTHONWARNINGS=ignore and the variables of env, its stdout and stderr into the file
    log(r). Returns their Popen objects, rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        e = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                 PYTHONWARNINGS="ignore", **(env or {}))
        with open(log(r), "w") as f:
            procs.append(subprocess.Popen([sys.executable] + list(args), env=e, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait(procs, timeout=600):
    """The exit codes of procs, each waited for up to timeout seconds (None: no limit): one
    still running then is killed and its code is "timeout". Once one has failed, the others
    (likely stuck in a collective with it) are killed."""
    rcs = []
    for p in procs:
        if any(rc != 0 for rc in rcs):
            p.kill()
        try:
            rcs.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rcs.append("timeout")
    reap(procs)
    return rcs


def reap(procs):
    """Kills what the processes started and left behind (each is its own session's leader:
    its group outlives it while a child of it runs)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
