"""A gloo rank that starts an async_save, waits for its snapshot and returns from main
without wait() (nor destroy_process_group): tests/python/test_torch_exit.py runs two of
them as fresh interpreters (tests/python/_launch.py), which must exit, the save committed.

    python _exit_worker.py PATH MODE

MODE "return": the AsyncSave is still referenced when main returns (a global);
"drop": it is dropped at once after wait_snapshot() (its destructor, not the interpreter's
exit, ends the save); "late": the save starts in an exit handler that runs after strata's
(registered before strata is imported), so the interpreter finalizes with it in flight:
the process must still exit, leaving it uncommitted with a warning."""

import atexit
import sys


def _late():
    main(sys.argv[1], "return")


if __name__ == "__main__" and sys.argv[2] == "late":
    atexit.register(_late)   # before strata registers its own: runs after it

import torch
import torch.distributed as dist

import strata.torch as st

KEEP = []


def state(rank):
    torch.manual_seed(0)
    return {"w": torch.randn(257, 63), "b": torch.arange(1000, dtype=torch.int64),
            "r%d" % rank: torch.full((17,), float(rank))}


def main(path, mode):
    dist.init_process_group("gloo")
    h = st.async_save(state(dist.get_rank()), path, step=7)
    h.wait_snapshot()
    if mode == "return":
        KEEP.append(h)
    print("returning without wait()", flush=True)


if __name__ == "__main__" and sys.argv[2] != "late":
    main(sys.argv[1], sys.argv[2])
