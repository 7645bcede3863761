"""strata.torch.load: a tensor saved in one dtype loads into a target of another, converted
as it is read: by default where every value is exact (a widening: bf16 / f16 to f32 / f64,
f32 to f64, integers to wider ones - DCP widens silently), with cast=True any float pair
too (PyTorch DCP's test_dtype_mismatch_casting: an f32 model's checkpoint into a bf16
model); a narrowing without cast=True is MismatchError saying cast=True would convert it.

The reference is torch's own cast, Tensor.to, for every pair from a 16- or 32-bit float
(round to nearest even, once). From f64 to f16 / bf16 torch rounds twice (through f32: f64
1 + 2**-8 + 2**-30 becomes bf16 1.0, not the nearest 1 + 2**-7), strata once, so there the
reference is f64 -> f32 rounded to odd, then Tensor.to: the one-rounding result. NaNs are
compared as NaNs (torch's own bf16 NaN is 0x7fc0 or 0xffff depending on its code path).
"""

import pytest
import torch
import torch.nn as nn

import _dist

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# the floats each float widens to: every value exact (loaded without cast=True)
WIDER = {torch.float64: (), torch.float32: (torch.float64,),
         torch.float16: (torch.float32, torch.float64),
         torch.bfloat16: (torch.float32, torch.float64)}
INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
          torch.bfloat16: torch.int16}


def _from_bits(bits, dtype):
    return torch.tensor(bits, dtype=torch.int64).to(INT_OF[dtype]).view(dtype)


def edge_values(dtype):
    """Every 16-bit pattern; for f32 / f64 the rounding midpoints of f16 and bf16 (and for
    f64 a sample of f32's) with the patterns either side, both signs, and the edges."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    vals = []
    for narrow in (torch.float16, torch.bfloat16):
        inf_bits = 0x7c00 if narrow == torch.float16 else 0x7f80
        lo = _from_bits(list(range(inf_bits)), narrow).to(torch.float64)
        hi = _from_bits(list(range(1, inf_bits + 1)), narrow).to(torch.float64)
        hi[-1] = 65536.0 if narrow == torch.float16 else 2.0 ** 128  # past the largest finite
        vals.append((lo + (hi - lo) / 2))
    if dtype == torch.float64:
        g = torch.Generator().manual_seed(5)
        b = torch.randint(0, 0x7f7fffff, (20000,), generator=g, dtype=torch.int64)
        lo = b.to(torch.int32).view(torch.float32).to(torch.float64)
        hi = (b + 1).to(torch.int32).view(torch.float32).to(torch.float64)
        vals.append(lo + (hi - lo) / 2)
    mid = torch.cat(vals).to(dtype)  # exact: one bit more than the narrow format
    ib = mid.view(INT_OF[dtype])
    around = torch.cat([ib, ib + 1, ib - 1])
    top = torch.iinfo(INT_OF[dtype]).min
    around = torch.cat([around, around | top])  # both signs
    if dtype == torch.float32:
        edges = [0, 1, 2, 0x007fffff, 0x00800000, 0x7f7fffff, 0x7f800000, 0x7f800001,
                 0x7fc00000, 0x7fc12345]
    else:
        edges = [0, 1, 0x000fffffffffffff, 0x0010000000000000, 0x7fefffffffffffff,
                 0x7ff0000000000000, 0x7ff0000000000001, 0x7ff8000000000000]
    e = torch.tensor(edges, dtype=torch.int64).to(INT_OF[dtype])
    g = torch.Generator().manual_seed(9)
    rnd = torch.randint(torch.iinfo(INT_OF[dtype]).min, torch.iinfo(INT_OF[dtype]).max,
                        (20000,), generator=g, dtype=torch.int64).to(INT_OF[dtype])
    return torch.cat([around, e, e | top, rnd]).view(dtype)


def reference(x, dtype):
    """x converted to dtype, rounded once to nearest even."""
    if x.dtype == torch.float64 and dtype in (torch.float16, torch.bfloat16):
        f = x.to(torch.float32)
        bits = f.view(torch.int32).clone()
        inexact = (f.to(torch.float64) != x) & ~torch.isnan(x)
        away = f.to(torch.float64).abs() > x.abs()
        bits = torch.where(inexact & away, bits - 1, bits)       # toward zero ...
        bits = torch.where(inexact, bits | 1, bits)              # ... then odd
        return bits.view(torch.float32).to(dtype)
    return x.to(dtype)


def same(got, want):
    """Bitwise equal, NaN for NaN. Returns the indices that differ."""
    gn, wn = torch.isnan(got.to(torch.float64)), torch.isnan(want.to(torch.float64))
    gi, wi = got.view(INT_OF[got.dtype]), want.view(INT_OF[want.dtype])
    bad = (gn != wn) | (~gn & (gi != wi))
    return bad.nonzero().flatten()


def test_torch_rounds_f64_twice():
    """Why the f64 -> f16 / bf16 reference is not Tensor.to (if torch changes, this says so)."""
    x = torch.tensor([1 + 2.0 ** -8 + 2.0 ** -30], dtype=torch.float64)
    assert x.to(torch.bfloat16).item() == 1.0
    assert reference(x, torch.bfloat16).item() == 1 + 2.0 ** -7


@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_every_float_pair(tmp_path, src):
    import strata
    import strata.torch as st
    x = edge_values(src)
    path = str(tmp_path / "ck")
    st.save({"x": x.reshape(-1, 7) if x.numel() % 7 == 0 else x}, path)
    for dst in FLOATS:
        if dst == src:
            continue
        target = {"x": torch.empty((x.reshape(-1, 7) if x.numel() % 7 == 0 else x).shape,
                                   dtype=dst)}
        if dst in WIDER[src]:   # every value exact: loaded by default, as DCP does
            st.load(target, path)
        else:                   # it rounds: only with cast=True, and the error says so
            with pytest.raises(strata.MismatchError, match="cast=True"):
                st.load(target, path)
            st.load(target, path, cast=True)
        got = target["x"].reshape(-1)
        bad = same(got, reference(x, dst))
        assert bad.numel() == 0, "%s -> %s: %d differ, first at %d: saved %r got %r want %r" % (
            src, dst, bad.numel(), bad[0], x[bad[0]].item(), got[bad[0]].item(),
            reference(x, dst)[bad[0]].item())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(37, 23)
        self.b = nn.Linear(23, 5, bias=False)
        self.register_buffer("steps", torch.arange(3, dtype=torch.int64))


def test_f32_model_into_bf16_model(tmp_path):
    """DCP's test_dtype_mismatch_casting: an f32 model's checkpoint into a bf16 model."""
    import strata
    import strata.torch as st
    torch.manual_seed(0)
    src = Net()
    path = str(tmp_path / "ck")
    st.save(src.state_dict(), path)
    dst = Net().to(torch.bfloat16)
    for p in dst.parameters():
        nn.init.constant_(p, 7.0)
    with pytest.raises(strata.MismatchError, match="bf16"):
        st.load(dst.state_dict(), path)
    st.load(dst.state_dict(), path, cast=True)
    for k, v in src.state_dict().items():
        w = dst.state_dict()[k]
        assert w.dtype == (torch.int64 if k == "steps" else torch.bfloat16)
        assert torch.equal(w.view(INT_OF.get(w.dtype, w.dtype)),
                           v.to(w.dtype).view(INT_OF.get(w.dtype, w.dtype))), k


def test_widening_by_default_dcp_call(tmp_path):
    """A bf16 model's checkpoint (and i32 / f16 / bool entries) into an f32 / f64 / i64 model,
    through DCP's call (checkpoint_id=): no cast=True, every value exact; the narrowing
    way back is refused in Python terms (cast=True), and converts with it."""
    import strata
    import strata.torch as st
    torch.manual_seed(3)
    src = Net().to(torch.bfloat16)
    extra = {"ids": torch.randint(-2 ** 31, 2 ** 31 - 1, (17,), dtype=torch.int32),
             "h": torch.randn(5, 3).to(torch.float16), "mask": torch.rand(9) > 0.5}
    path = str(tmp_path / "ck")
    st.save({"model": src, "extra": extra}, checkpoint_id=path)
    dst = Net()                                   # f32, steps i64
    wide = {"ids": torch.zeros(17, dtype=torch.int64), "h": torch.zeros(5, 3, dtype=torch.float64),
            "mask": torch.zeros(9, dtype=torch.int32)}
    st.load({"model": dst, "extra": wide}, checkpoint_id=path)
    for k, v in src.state_dict().items():
        w = dst.state_dict()[k]
        assert w.dtype == (torch.int64 if k == "steps" else torch.float32)
        assert torch.equal(w, v.to(w.dtype)) and torch.equal(w.to(v.dtype), v), k
    for k, v in extra.items():
        assert torch.equal(wide[k], v.to(wide[k].dtype)), k
    # back: f32 into bf16 rounds - refused, in Python's words, until cast=True
    path2 = str(tmp_path / "f32")
    st.save({"model": dst}, checkpoint_id=path2)
    back = Net().to(torch.bfloat16)
    with pytest.raises(strata.MismatchError) as e:
        st.load({"model": back}, checkpoint_id=path2)
    assert "cast=True" in str(e.value) and "STRATA_" not in str(e.value), str(e.value)
    assert "narrowing" in str(e.value)
    st.load({"model": back}, checkpoint_id=path2, cast=True)
    for k, v in src.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_widening_from_dcp_checkpoint(tmp_path):
    """A checkpoint DCP itself wrote in bf16 (dcp.save), loaded into an f32 model by
    strata.torch.load as DCP's load is called: widened bitwise, as dcp.load does."""
    import torch.distributed.checkpoint as dcp
    import strata.torch as st
    torch.manual_seed(4)
    src = Net().to(torch.bfloat16)
    path = str(tmp_path / "dcp")
    with pytest.warns(UserWarning):   # DCP: "torch.distributed is ... uninitialized"
        dcp.save({"model": src.state_dict()}, checkpoint_id=path)
    want = {"model": Net().state_dict()}
    with pytest.warns(UserWarning):
        dcp.load(want, checkpoint_id=path)
    got = {"model": Net().state_dict()}
    st.load(got, checkpoint_id=path)
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
        assert torch.equal(v.to(src.state_dict()[k].dtype), src.state_dict()[k]), k


def test_refused_pair(tmp_path):
    import strata
    import strata.torch as st
    path = str(tmp_path / "ck")
    st.save({"w": torch.ones(4, 3)}, path)
    with pytest.raises(strata.MismatchError) as e:
        st.load({"w": torch.empty(4, 3, dtype=torch.int32)}, path, cast=True)
    assert str(e.value).startswith("w: ") and "not f32 to i32" in str(e.value)
    with pytest.raises(strata.MismatchError):  # shapes must still agree
        st.load({"w": torch.empty(3, 4, dtype=torch.bfloat16)}, path, cast=True)


# ---- DTensors on 2 gloo ranks ------------------------------------------------------------

def _full(i, shape):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(shape, generator=g, dtype=torch.float32) * 1e3


def dtensor_cast(path):
    """Saves f32 DTensors sharded by rows; loads them into bf16 and f16 DTensors sharded by
    columns, cast=True; returns the mismatching keys."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("a",))
    shapes = {"w1": (37, 11), "w2": (5, 64), "w3": (9, 3)}
    sd = {k: distribute_tensor(_full(i, s), mesh, [Shard(0)], src_data_rank=None)
          for i, (k, s) in enumerate(shapes.items())}
    st.save(sd, path)
    dist.barrier()
    bad = []
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        tgt = {k: distribute_tensor(torch.zeros(s, dtype=dt), mesh, [Shard(1)],
                                    src_data_rank=None) for k, s in shapes.items()}
        st.load(tgt, path, cast=True)
        for i, (k, s) in enumerate(shapes.items()):
            got = tgt[k].full_tensor()
            want = _full(i, s).to(dt)
            if got.dtype != dt or not torch.equal(got.view(INT_OF[dt]), want.view(INT_OF[dt])):
                bad.append("%s as %s" % (k, dt))
    return bad


@pytest.mark.slow
def test_dtensors_two_ranks(tmp_path):
    res = _dist.run(dtensor_cast, 2, str(tmp_path / "ck"), timeout=180)
    assert res == [[], []]
