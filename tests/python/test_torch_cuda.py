"""CUDA tensors through strata.torch: the engine's device path (cudaMemcpyAsync into pinned
or scratch buffers on a save, cudaMemcpy on a load), ordered after the caller's current
stream. Run by `make test-gpu` (marker gpu) on a machine with a GPU.

Every test skips where torch.cuda.is_available() is false (`make test` on a machine without
a GPU), unless STRATA_TEST_GPU is set (make test-gpu): then that is a failure.

- every dtype strata has (bf16 and both fp8 kinds included), random bytes (NaN patterns
  too), a non-contiguous and an offset view, saved from CUDA and loaded into CUDA and CPU
  tensors (and a contiguous and a transposed target), bitwise;
- async_save: wait_snapshot(), then the CUDA tensors are overwritten at once; the checkpoint
  holds the values from before (the saver's own pool, and a 1 MiB pool smaller than the
  state);
- ordering: a tensor written on a side stream that is the current stream, behind a kernel
  that keeps it busy, saved with no synchronisation (save and async_save): the checkpoint
  holds what the stream wrote; a load on such a stream is read there at once;
- DTensors on a one-rank CUDA mesh (Shard, Replicate), in a process group of one;
- the CUDA RNG state, and the checkpoint manager with CUDA tensors.
"""

import os

import pytest
import torch

import strata
import strata.torch as st

import _dist
from _tensors import bits, same

pytestmark = pytest.mark.gpu

DTYPES = [getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64",
    "int32", "int16", "int8", "uint8", "bool") if hasattr(torch, n)]


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        if os.environ.get("STRATA_TEST_GPU"):
            pytest.fail("STRATA_TEST_GPU is set, but torch.cuda.is_available() is false "
                        "(torch %s, CUDA %s)" % (torch.__version__, torch.version.cuda))
        pytest.skip("no CUDA device (torch.cuda.is_available() is false)")


def sample(dtype, shape, seed, device="cuda"):
    """Random bytes as a tensor of dtype on the device (any bit pattern: NaNs, infinities and
    subnormals for the float types; 0/1 for bool)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g, device=device,
                             dtype=torch.uint8).view(torch.bool)
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * esize,), generator=g, device=device, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def filled(shape, dtype, device="cuda", byte=0x5A):
    """A tensor whose every byte is `byte` (not the values a load must put there)."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    t.view(torch.uint8).fill_(byte)
    return t


def scribble(t):
    """Overwrites every byte of t (in place, on the current stream)."""
    with torch.no_grad():
        t.view(torch.uint8).bitwise_not_()


# ---- every dtype, CUDA -> checkpoint -> CUDA and CPU ------------------------------------------

def test_every_dtype_cuda_to_cuda_and_cpu(tmp_path):
    assert set(DTYPES) <= set(st._TO_STRATA), "a dtype strata.torch does not map"
    state = {"t.%s" % str(dt).split(".")[-1]: sample(dt, (61, 33), i)
             for i, dt in enumerate(DTYPES)}
    state["big"] = sample(torch.float32, (1031, 1027), 100)        # 4 MiB: several chunks
    state["transposed"] = sample(torch.bfloat16, (40, 70), 101).t()   # not contiguous
    state["offset"] = sample(torch.float16, (100,), 102)[13:77]     # a storage offset
    state["step"] = 12
    want = {k: v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
    assert not state["transposed"].is_contiguous()
    assert state["offset"].storage_offset() == 13
    path = str(tmp_path / "ck")
    st.save(state, path)

    # into CUDA tensors, contiguous (filled with other bytes first) and a transposed view
    cuda = {k: filled(w.shape, w.dtype) for k, w in want.items()}
    cuda["transposed"] = filled((40, 70), torch.bfloat16).t()    # not contiguous either
    cuda["step"] = None
    st.load(cuda, path)
    for k, w in want.items():
        assert cuda[k].is_cuda and same(cuda[k], w), k
    assert cuda["step"] == 12

    # into CPU tensors
    cpu = {k: torch.zeros(w.shape, dtype=w.dtype) for k, w in want.items()}
    st.load(cpu, path)
    for k, w in want.items():
        assert not cpu[k].is_cuda and same(cpu[k], w), k

    # and a checkpoint saved from the CPU loads into CUDA tensors the same
    path2 = str(tmp_path / "from-cpu")
    st.save(dict(want), path2)
    back = {k: filled(w.shape, w.dtype) for k, w in want.items()}
    st.load(back, path2)
    for k, w in want.items():
        assert same(back[k], w), k


# ---- async_save: the snapshot, then the tensors change at once ---------------------------------

@pytest.mark.parametrize("pool_bytes", [None, 1 << 20])
def test_async_save_snapshot_then_overwrite(tmp_path, pool_bytes):
    state = {"w%d" % i: sample(torch.float32, (1024, 1021 + i), 10 + i) for i in range(4)}
    state["bf16"] = sample(torch.bfloat16, (777, 513), 20)
    state["fp8"] = sample(torch.float8_e5m2, (1000, 999), 21)
    state["step"] = 3
    want = {k: v.cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
    path = str(tmp_path / "ck")
    opts = {}
    pool = None
    if pool_bytes:
        pool = strata.Pool(pool_bytes)    # smaller than the state: the buffers cycle
        opts["chunk_bytes"] = 256 << 10
    h = st.async_save(state, path, pool=pool, **opts)
    h.wait_snapshot()
    for k in want:                        # at once, as an optimizer step would
        scribble(state[k])
    torch.cuda.synchronize()              # the new bytes are in place before the commit
    h.wait()
    for k, w in want.items():
        assert not same(state[k], w), k   # the tensors did change
    back = {k: filled(w.shape, w.dtype, "cpu") for k, w in want.items()}
    back["step"] = None
    st.load(back, path)
    for k, w in want.items():
        assert same(back[k], w), "%s: the overwrite after wait_snapshot() leaked" % k
    assert back["step"] == 3


# ---- ordering after the current stream ------------------------------------------------------

SLEEP_CYCLES = 200_000_000    # ~0.1 s of GPU time: the stream is still busy when save starts


def _busy_write(stream, dst, src):
    """On stream: a kernel that keeps it busy, then dst <- src; returns with both pending."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        dst.copy_(src)
    assert not stream.query(), "the side stream finished too soon for the test to mean much"


# Marked per rank: a replicated tensor's replica check hashes it on the current stream and
# reads the digest back (a synchronisation of its own), so only a per-rank tensor (or a
# DTensor) shows whether save itself orders its copies after the current stream.

def test_save_ordered_after_current_side_stream(tmp_path):
    src = sample(torch.float32, (1 << 20,), 30)
    src2 = sample(torch.bfloat16, (3, 1 << 19), 31)
    t = torch.zeros_like(src)
    t2 = torch.zeros_like(src2)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    path = str(tmp_path / "sync")
    with torch.cuda.stream(s):
        _busy_write(s, t, src)
        st.save({"t": st.per_rank(t)}, path)    # no synchronisation by the caller
    back = {"t": torch.empty(t.shape, dtype=t.dtype)}
    st.load(back, path)
    assert same(back["t"], src), "save read the tensor before the current stream wrote it"

    apath = str(tmp_path / "async")
    with torch.cuda.stream(s):
        _busy_write(s, t2, src2)
        h = st.async_save({"t2": st.per_rank(t2)}, apath)
        h.wait_snapshot()
        t2.zero_()                        # on the same stream, after the snapshot
    h.wait()
    back = {"t2": torch.empty(t2.shape, dtype=t2.dtype)}
    st.load(back, apath)
    assert same(back["t2"], src2), "async_save did not snapshot what the current stream wrote"


def test_load_read_at_once_on_side_stream(tmp_path):
    src = sample(torch.float32, (4 << 20,), 40)
    path = str(tmp_path / "ck")
    st.save({"t": src}, path)
    torch.cuda.synchronize()
    hsrc = sample(torch.float16, (48, 64), 41)
    st.save({"h": hsrc}, str(tmp_path / "h"))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        tgt = torch.zeros_like(src)
        tr = torch.zeros(64, 48, dtype=torch.float16, device="cuda").t()  # not contiguous:
        st.load({"t": tgt}, path)                                          # copied in after
        got = tgt.clone()                 # read on the current stream at once
        st.load({"h": tr}, str(tmp_path / "h"))
        got_h = tr.clone()
    s.synchronize()
    assert same(got, src), "a load into CUDA memory was not complete when it returned"
    assert not tr.is_contiguous() and same(got_h, hsrc)


# ---- DTensors on a one-rank CUDA mesh -------------------------------------------------------

def _dtensor_job(root):
    """One rank, gloo process group (the test harness's), a CUDA device mesh of 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (1,))
    local = {"w": (sample(torch.float32, (67, 31), 1), [Shard(0)]),
             "b": (sample(torch.bfloat16, (29, 5), 2), [Replicate()]),
             "f8": (sample(torch.float8_e4m3fn, (16, 24), 3), [Shard(1)])}

    def dstate(tensors):
        d = {k: DTensor.from_local(tensors[k], mesh, pl, run_check=False)
             for k, (_, pl) in local.items()}
        return d

    state = dstate({k: v for k, (v, _) in local.items()})
    state["plain"] = sample(torch.int16, (100, 3), 4)
    state["step"] = 5
    want = {k: v.cpu().clone() for k, (v, _) in local.items()}
    want["plain"] = state["plain"].cpu().clone()
    out = {}
    st.save(state, os.path.join(root, "ck"))

    # async: snapshot, then overwrite the local shards at once
    apath = os.path.join(root, "ack")
    h = st.async_save(state, apath)
    h.wait_snapshot()
    for k in local:
        scribble(state[k].to_local())
    scribble(state["plain"])
    torch.cuda.synchronize()
    h.wait()

    for name, path in (("sync", os.path.join(root, "ck")), ("async", apath)):
        tgt = dstate({k: filled(v.shape, v.dtype) for k, (v, _) in local.items()})
        tgt["plain"] = filled((100, 3), torch.int16)
        tgt["step"] = None
        st.load(tgt, path)
        for k in local:
            out["%s dtensor %s" % (name, k)] = (tgt[k].to_local().is_cuda
                                                and same(tgt[k].to_local(), want[k]))
        out["%s plain" % name] = same(tgt["plain"], want["plain"])
        out["%s step" % name] = tgt["step"] == 5
        # the DTensors' checkpoint into plain CUDA and CPU tensors
        for dev in ("cuda", "cpu"):
            p = {k: filled(want[k].shape, want[k].dtype, dev) for k in local}
            st.load(p, path)
            for k in local:
                out["%s into %s %s" % (name, dev, k)] = same(p[k], want[k])
    return out


def test_dtensor_one_rank_cuda_mesh(tmp_path):
    res = _dist.run(_dtensor_job, 1, str(tmp_path), timeout=180)[0]
    bad = [k for k, ok in res.items() if not ok]
    assert res and not bad, "not bitwise equal: %s" % bad


# ---- the CUDA RNG state, the checkpoint manager ---------------------------------------------

def test_cuda_rng_state(tmp_path):
    torch.cuda.manual_seed_all(1234)
    torch.rand(17, device="cuda")
    path = str(tmp_path / "rng")
    st.save({"rng": st.rng_state()}, path)
    want = torch.rand(1000, device="cuda")
    torch.rand(333, device="cuda")         # move on
    loaded = {"rng": st.rng_state()}
    st.load(loaded, path)
    st.set_rng_state(loaded["rng"])
    assert same(torch.rand(1000, device="cuda"), want)


def test_manager_cuda(tmp_path):
    tiers = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    w = sample(torch.bfloat16, (300, 301), 50)
    saved = {}
    with st.CheckpointManager(tiers, keep=2, pool_bytes=16 << 20) as mgr:
        for step in range(3):
            h = mgr.save(step, {"w": w, "step": step})
            h.wait_snapshot()
            saved[step] = w.cpu().clone()
            scribble(w)
        mgr.wait()
        assert mgr.latest() == 2
        tgt = {"w": torch.zeros_like(w), "step": None}
        assert mgr.load(tgt) == 2
        assert tgt["step"] == 2 and same(tgt["w"], saved[2])
        tgt = {"w": torch.zeros_like(w), "step": None}
        assert mgr.load(tgt, step=1) == 1 and same(tgt["w"], saved[1])
