"""Ranks that return from main without AsyncSave.wait(): two gloo ranks (fresh
interpreters) async_save, wait_snapshot() and return, the AsyncSave still referenced or
dropped. Both exit (an exit handler finishes every save still in flight while the
interpreter can still run the commit's collectives) and the checkpoint is committed and
loads. Before, both hung in interpreter finalization: the handle's destructor waited for a
commit that the Saver's commit thread could not run without the GIL."""

import os

import pytest
import torch

import strata
import strata.torch as st

import _launch
from _exit_worker import state

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["return", "drop"])
def test_exit_without_wait(tmp_path, mode):
    """async_save, wait_snapshot(), return: both ranks exit and the save is committed."""
    path = str(tmp_path / "ck")
    logs = lambda r: str(tmp_path / ("rank%d.log" % r))
    procs = _launch.launch([os.path.join(HERE, "_exit_worker.py"), path, mode], 2, logs)
    rcs = _launch.wait(procs, timeout=int(os.environ.get("STRATA_EXIT_TIMEOUT", "240")))
    out = "".join(open(logs(r)).read() for r in range(2))
    assert rcs == [0, 0], "exit codes %s:\n%s" % (rcs, out)
    assert "returning without wait()" in out
    info = strata.probe(path)
    assert info["committed"] and info["step"] == 7, info
    for rank in range(2):
        want = state(rank)
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        st.load(got, path)
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.slow
def test_exit_after_the_exit_handler(tmp_path):
    """A save started after strata's exit handler ran (in a later exit handler) is in flight
    when the interpreter finalizes: its destructor cannot wait for a commit that needs
    Python threads, so it never waits - both ranks exit, the save is left uncommitted
    (gc removes it), and each says so on stderr."""
    path = str(tmp_path / "ck")
    logs = lambda r: str(tmp_path / ("rank%d.log" % r))
    procs = _launch.launch([os.path.join(HERE, "_exit_worker.py"), path, "late"], 2, logs)
    rcs = _launch.wait(procs, timeout=int(os.environ.get("STRATA_EXIT_TIMEOUT", "240")))
    out = [open(logs(r)).read() for r in range(2)]
    assert rcs == [0, 0], "exit codes %s:\n%s" % (rcs, "".join(out))
    for o in out:
        assert "returning without wait()" in o and "left uncommitted" in o, o
    assert not strata.probe(path)["committed"]
    assert strata.retain(str(tmp_path), 0) == 1 and not os.path.exists(path)
