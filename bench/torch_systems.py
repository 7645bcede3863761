"""The checkpoint systems `make bench-torch` compares, behind one small interface, and the
measuring tools (RSS peaks, storage reads, the page cache, digests).

A system: setup(sd) once (pools, stagers; warmed where the system keeps them), start(sd,
path, step) -> handle (returns when the call returns: a blocking save is durable then),
snapshot(h) (the state may change after it), durable(h), done(h) (without waiting),
close(). `fmt` names the format a load reads it back with.
"""

import contextlib
import ctypes
import gc
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

# ---- measuring ------------------------------------------------------------------------------


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss():
    return _status("VmRSS")


def hwm():
    return _status("VmHWM")


def hwm_reset():
    """Resets the peak RSS (VmHWM) to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_bytes():
    """Bytes this process has caused to be read from storage (/proc/self/io)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def disk_counters(path):
    """(requests, bytes) read so far by the block device holding path (/proc/diskstats:
    every process's reads count), or None where none is listed."""
    try:
        st = os.stat(path)
        maj, mnr = os.major(st.st_dev), os.minor(st.st_dev)
        with open("/proc/diskstats") as f:
            for line in f:
                x = line.split()
                if int(x[0]) == maj and int(x[1]) == mnr:
                    return int(x[3]), int(x[5]) * 512
    except (OSError, ValueError, IndexError):
        pass
    return None


def request_kib(c0, c1):
    """Average KiB per device read request between two disk_counters (None if unknown)."""
    if not c0 or not c1 or c1[0] <= c0[0]:
        return None
    return (c1[1] - c0[1]) / (c1[0] - c0[0]) / 1024


STRATA_CLI = os.environ.get("STRATA_CLI") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "strata")


def strata_disk(path, size_mb):
    """The disk under path measured the way strata uses it (`strata bench disk`: O_DIRECT,
    8 MiB writes and fsync, cold reads of a load's size, 4 threads), through strata's I/O
    buffers ("strata") and through buffers of 4 KiB pages ("4k"): {kind: {write_gbps,
    read_gbps, write_req_kib, read_req_kib, max_request_kib, read_kib, pages}}."""
    import subprocess
    out = subprocess.run([STRATA_CLI, "bench", "disk", "--dir", path, "--size-mb",
                          str(size_mb)], check=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.splitlines():
        head, _, pages = line.partition(' pages="')
        kv = dict(x.split("=", 1) for x in head.split())
        d = {k: float(v) for k, v in kv.items() if k not in ("run", "buffers")}
        d["pages"] = pages.rstrip('"')
        res[kv["buffers"]] = d
    return res


_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def trim():
    """Frees what can be freed: Python garbage and glibc's unused heap."""
    gc.collect()
    _libc.malloc_trim(0)


def drop_caches():
    """sync, then empties the page cache; False where it is not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def memcpy_gbps(nbytes=1 << 30, reps=3):
    """This machine's single-thread memcpy rate (libc memmove, pre-faulted buffers)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = None
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    del src, dst
    trim()
    return nbytes / best / 1e9


def local_of(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def copy_state_gbps(sd, tensors):
    """A plain copy_ of the state into tensors allocated (and touched) ahead: the floor for
    any snapshot (torch's own threads)."""
    pairs = []
    for _, t in tensors(sd):
        lt = local_of(t)
        pairs.append((torch.empty_like(lt), lt))
    nbytes = sum(s.numel() * s.element_size() for _, s in pairs)
    for d, s in pairs:
        d.copy_(s)
    t0 = time.perf_counter()
    for d, s in pairs:
        d.copy_(s)
    dt = time.perf_counter() - t0
    del pairs
    trim()
    return nbytes / dt / 1e9, dt


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(sd, tensors):
    """{key: int}: the sum of each tensor's element bit patterns (as int64, wrapping), over
    the whole global tensor: each rank adds the pieces it owns, then one all_reduce. A
    DTensor's piece is owned by the ranks of the lowest-numbered of the meshes it lives on
    (TP ranks each hold an FSDP-sharded copy of a norm on a mesh of their own) at
    coordinate 0 of its Replicate dims; a plain tensor by rank 0. The same value in any
    layout: a resharded load compares with the saved state."""
    items = tensors(sd)
    rank = dist.get_rank() if dist.is_initialized() else 0
    mins = []
    for _, t in items:
        if hasattr(t, "_local_tensor"):
            mins.append(int(t.device_mesh.mesh.min()))
        else:
            mins.append(0)
    lowest = torch.tensor(mins, dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    lowest = lowest.tolist()
    keys, sums = [], []
    for (k, t), mine, low in zip(items, mins, lowest):
        keys.append(k)
        own = True
        if hasattr(t, "_local_tensor"):
            coord = t.device_mesh.get_coordinate()
            if coord is None or mine != low:
                own = False
            else:
                for i, p in enumerate(t.placements):
                    if p.is_replicate() and coord[i] != 0:
                        own = False
        elif rank != 0:
            own = False
        lt = local_of(t)
        if own and lt.numel():
            b = lt.detach().reshape(-1).view(_BITS[lt.element_size()])
            sums.append(int(b.sum(dtype=torch.int64)))
        else:
            sums.append(0)
    v = torch.tensor(sums, dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(v)
    return dict(zip(keys, v.tolist()))


def scribble(sd, tensors):
    """Sets every tensor of sd to zero: a load that misses a byte then fails the digest."""
    with torch.no_grad():
        for _, t in tensors(sd):
            local_of(t).zero_()


def rmtree(path):
    shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the systems ----------------------------------------------------------------------------


class System:
    name = "?"
    label = "?"
    fmt = None
    is_async = False
    dist_ok = True

    def setup(self, sd):
        pass

    def start(self, sd, path, step):
        raise NotImplementedError

    def snapshot(self, h):
        pass

    def durable(self, h):
        pass

    def done(self, h):
        return True

    def close(self):
        pass

    def options(self):
        return ""


class TorchSave(System):
    name = "torch_save"
    label = "torch.save"
    fmt = "torch"
    dist_ok = False

    def start(self, sd, path, step):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.pt"), "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path)
        return None

    def options(self):
        return "torch.save into an open file, flush, os.fsync(file), fsync(directory)"


def _dcp():
    import torch.distributed.checkpoint as dcp
    return dcp


class DcpSave(System):
    fmt = "dcp"

    def __init__(self, threads):
        self.threads = threads
        self.name = "dcp_save_t%d" % threads
        self.label = "DCP save t%d" % threads

    def start(self, sd, path, step):
        dcp = _dcp()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True,
                                                         thread_count=self.threads))
        return None

    def options(self):
        return "dcp.save, FileSystemWriter(sync_files=True, thread_count=%d)" % self.threads


# StagingOptions fields in order: use_pinned_memory, use_shared_memory, use_async_staging,
# use_non_blocking_copy
STAGER_CONFIGS = {
    "dcp_async": None,                                   # async_save's default
    "dcp_async_stager": (False, False, False, False),    # a DefaultStager kept across saves
    "dcp_async_shm": (False, True, False, False),
    "dcp_async_astage": (False, False, True, False),
    "dcp_async_shm_astage": (False, True, True, False),
}
STAGER_LABELS = {
    "dcp_async": "DCP async (default)",
    "dcp_async_stager": "DCP async stager",
    "dcp_async_shm": "DCP async stager shm",
    "dcp_async_astage": "DCP async stager async-staging",
    "dcp_async_shm_astage": "DCP async stager shm+async-staging",
}


def probe_staging_options():
    """Each StagingOptions flag alone, on this machine: [(flag, "ok" | "ignored: ..." |
    "fails: ...")]."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    out = []
    names = ["use_pinned_memory", "use_shared_memory", "use_async_staging",
             "use_non_blocking_copy"]
    for n in names:
        kw = {m: (m == n) for m in names}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                s = DefaultStager(StagingOptions(**kw))
                r = s.stage({"a": torch.ones(4)})
                if hasattr(r, "result"):
                    r.result()
                s.close()
                msgs = [str(x.message) for x in w if "pin" in str(x.message).lower()
                        or "ignor" in str(x.message).lower()]
                out.append((n, "ignored: " + msgs[0] if msgs else "ok"))
            except BaseException as e:   # noqa: BLE001 - the reason is the result
                out.append((n, "fails: %s: %s" % (type(e).__name__, str(e).strip())))
    return out


class DcpAsync(System):
    fmt = "dcp"
    is_async = True

    def __init__(self, name):
        self.name = name
        self.label = STAGER_LABELS[name]
        self.config = STAGER_CONFIGS[name]
        self.stager = None

    def setup(self, sd):
        if self.config is not None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.stager = DefaultStager(StagingOptions(*self.config))
            r = self.stager.stage(sd)       # warm: its cached copy is allocated here
            if hasattr(r, "result"):
                r.result()
            del r

    def start(self, sd, path, step):
        dcp = _dcp()
        return dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                              async_stager=self.stager)

    @staticmethod
    def _upload(h):
        return h.upload_completion if hasattr(h, "upload_completion") else h

    def snapshot(self, h):
        if hasattr(h, "staging_completion"):
            h.staging_completion.result()

    def durable(self, h):
        self._upload(h).result()

    def done(self, h):
        return self._upload(h).done()

    def close(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def options(self):
        w = "FileSystemWriter(sync_files=True, thread_count=1)"
        if self.config is None:
            return "dcp.async_save(%s) with no stager: its default (a new DefaultStager(" \
                   "StagingOptions(False, False, False, False)) per save, closed after)" % w
        return "dcp.async_save(%s, async_stager=DefaultStager(StagingOptions(" \
               "use_pinned_memory=%s, use_shared_memory=%s, use_async_staging=%s, " \
               "use_non_blocking_copy=%s))), the stager kept across saves and warmed by " \
               "one stage() at setup" % ((w,) + self.config)


class StrataSave(System):
    name = "strata_save"
    label = "strata save"
    fmt = "strata"

    def start(self, sd, path, step):
        import strata.torch as st
        return st.save(sd, path, step=step)

    def options(self):
        return "strata.torch.save(state, path): defaults (io_threads 4, fsync, O_DIRECT " \
               "where the filesystem takes it)"


class StrataAsync(System):
    name = "strata_async"
    label = "strata async_save"
    fmt = "strata"
    is_async = True

    def __init__(self, pool_bytes):
        self.pool_bytes = pool_bytes
        self.pool = None

    def setup(self, sd):
        import strata
        self.pool = strata.Pool(self.pool_bytes)    # allocated and pre-faulted here

    def start(self, sd, path, step):
        import strata.torch as st
        return st.async_save(sd, path, step=step, pool=self.pool)

    def snapshot(self, h):
        h.wait_snapshot()

    def durable(self, h):
        h.wait()

    def done(self, h):
        return h.done()

    def close(self):
        # strata.torch keeps a Saver per pool for the life of the process (its plan cache),
        # and the Saver holds the pool: the pool's memory stays until the process ends
        self.pool = None

    def options(self):
        return "strata.torch.async_save(state, path, pool=strata.Pool(%d MiB)) made at " \
               "setup; wait_snapshot() before optimizer.step(), wait() at the next " \
               "checkpoint" % (self.pool_bytes >> 20)


class StrataManager(System):
    name = "strata_mgr"
    label = "strata manager (shm+disk)"
    fmt = "strata_mgr"
    is_async = True

    def __init__(self, pool_bytes, shm_root, disk_root):
        self.pool_bytes = pool_bytes
        self.tiers = [shm_root, disk_root]
        self.mgr = None

    def setup(self, sd):
        import strata.torch as st
        self.mgr = st.CheckpointManager(self.tiers, keep=1,
                                        pool_bytes=self.pool_bytes).prepare()

    def start(self, sd, path, step):
        return self.mgr.save(step, sd)

    def snapshot(self, h):
        h.wait_snapshot()

    def durable(self, h):
        h.wait()

    def done(self, h):
        return h.done()

    def close(self):
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None

    def options(self):
        return "strata.torch.CheckpointManager([%s, %s], keep=1, pool_bytes=%d MiB)" \
               ".prepare(): the pool allocated at setup" % (
                   "/dev/shm/...", "<disk>/...", self.pool_bytes >> 20)


def make_systems(pool_bytes, shm_root, disk_root, distributed):
    out = [TorchSave(), DcpSave(1), DcpSave(4)]
    out += [DcpAsync(n) for n in STAGER_CONFIGS]
    out += [StrataSave(), StrataAsync(pool_bytes),
            StrataManager(pool_bytes, shm_root, disk_root)]
    return [s for s in out if s.dist_ok or not distributed]


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
