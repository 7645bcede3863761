"""How long after its last byte is written an asynchronous distributed save is committed,
with no wait() call (issue 17). Each of N gloo ranks (strata.torch.async_save of ~32 MB
per rank: a replicated tensor and one of its own), then no strata call: rank 0 polls
strata.probe(path)["committed"] every millisecond for up to 3 s. The last byte's time is
the newest data file's mtime (the file system's clock, a few ms coarse). Then wait().

    .venv/bin/python bench/bg_commit_latency.py [N ...]      (default: 1 2 4)

Prints, per N, the median over 3 saves of (committed seen - last data byte) in ms, or
"not committed within 3 s" (before background commits, a save committed only in wait()).
"""
import glob
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))
import _dist  # noqa: E402


def one_rank(root, saves):
    import torch
    import torch.distributed as dist
    import strata
    import strata.torch as st
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(5)
    state = {"shared": torch.randn(4 << 20, generator=g),
             "own": st.per_rank(torch.randn(4 << 20, generator=g) + rank)}
    out = []
    for i in range(saves):
        path = os.path.join(root, "ck%d" % i)
        h = st.async_save(state, path, step=i)
        h.wait_snapshot()
        seen = None
        if rank == 0:
            t0 = time.time()
            while time.time() - t0 < 3:
                if strata.probe(path)["committed"]:
                    seen = time.time()
                    break
                time.sleep(0.001)
        h.wait()
        dist.barrier()
        if rank == 0:
            last = max(os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(path, "data-*")))
            out.append(None if seen is None else seen - last / 1e9)
    return out


def main():
    import bg_commit_latency as me   # _dist runs functions of importable modules
    ns = [int(a) for a in sys.argv[1:]] or [1, 2, 4]
    for n in ns:
        with tempfile.TemporaryDirectory(prefix="strata-bgc-") as root:
            lat = _dist.run(me.one_rank, n, root, 3, timeout=300)[0]
        if any(x is None for x in lat):
            print("%d gloo rank(s): not committed within 3 s of the snapshot without wait() "
                  "(%d of %d saves)" % (n, sum(x is None for x in lat), len(lat)))
        else:
            print("%d gloo rank(s): committed %.1f ms after the last data byte (median of %d; "
                  "%s)" % (n, statistics.median(lat) * 1e3, len(lat),
                           ", ".join("%.1f" % (x * 1e3) for x in lat)))


if __name__ == "__main__":
    main()
