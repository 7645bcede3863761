"""Export to Hugging Face safetensors, read back by the `safetensors` package bitwise: through
the `strata export` command (tests skip when it is not built), and through the Python calls
strata.export_safetensors / strata.torch.export_safetensors. A state saved by strata.torch,
every dtype; split over several files; --prefix; bf16; the issue's Megatron layout
(tp=2, pp=2, dp=2, zero=1, eight logical ranks) read back with safe_open; errors."""

import json
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

import strata
import strata.torch as st
from _tensors import DTYPES, same, sample

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")

TO_STRATA = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16",
             torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3",
             torch.float8_e5m2: "fp8_e5m2", torch.int64: "i64", torch.int32: "i32",
             torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}

def state():
    sd = {}
    for i, dt in enumerate(DTYPES):
        sd["net.w_%d" % i] = sample(dt, (37, 5 + i), i)
        sd["net.s_%d" % i] = sample(dt, (), 100 + i)
    sd["net.big"] = sample(torch.float32, (300, 1000), 99)
    sd["other.x"] = sample(torch.float16, (7,), 7)
    return sd


def read_all(out):
    """{name: tensor} of an export and its index: model.safetensors.index.json, or for one
    file, model.safetensors alone (no index, as Hugging Face writes it) and the index it
    would have."""
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        assert os.listdir(out) == ["model.safetensors"], os.listdir(out)
        got = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
        return got, {"weight_map": {k: "model.safetensors" for k in got}, "metadata": {
            "total_size": sum(t.numel() * t.element_size() for t in got.values())}}
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    got = {}
    for f in sorted(set(idx["weight_map"].values())):
        part = safetensors_torch.load_file(os.path.join(out, f))
        assert not set(part) & set(got)
        got.update(part)
    assert set(got) == set(idx["weight_map"])
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got, idx


def export(ck, out, *args):
    subprocess.run([STRATA, "export", ck, out, "--quiet", *args], check=True)


@needs_cli
def test_export_bitwise_every_dtype(tmp_path):
    sd = state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    export(ck, str(tmp_path / "out"))
    got, _ = read_all(str(tmp_path / "out"))
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert same(got[k], v), k


@needs_cli
def test_export_split_and_prefix(tmp_path):
    sd = state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    out = str(tmp_path / "out")
    export(ck, out, "--max-file-gb", "0.000005", "--prefix", "net.")
    got, idx = read_all(out)
    assert len(set(idx["weight_map"].values())) > 2
    want = {(k[4:] if k.startswith("net.") else k): v for k, v in sd.items()}
    assert set(got) == set(want)
    for k, v in want.items():
        assert same(got[k], v), k


def special_state():
    sd = state()
    sd["special"] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                  3.4e38, 1.00390625, 1.01171875, -1.00390625])
    return sd


def check_bf16(sd, got):
    for k, v in sd.items():
        if v.dtype in (torch.float32, torch.float16):
            want = v.to(torch.bfloat16)
            g = got[k]
            assert g.dtype == torch.bfloat16, k
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(g), nan), k
            assert same(g[~nan], want[~nan]), k
        elif v.dtype == torch.float64:
            # rounded once from f64 (torch may round twice, through f32): within half a bf16 ulp
            g = got[k].double()
            assert got[k].dtype == torch.bfloat16
            assert torch.allclose(g, v, rtol=2 ** -8, atol=0), k
        else:
            assert same(got[k], v), k


@needs_cli
def test_export_bf16(tmp_path):
    sd = special_state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    out = str(tmp_path / "out")
    export(ck, out, "--dtype", "bf16")
    got, _ = read_all(out)
    check_bf16(sd, got)


# ---- the Python calls ----------------------------------------------------------------------


def total_size(out):
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    return idx["metadata"]["total_size"]


def test_api_bitwise_every_dtype_split_prefix_progress(tmp_path):
    sd = state()
    ck, out = tmp_path / "ck", tmp_path / "out"   # os.PathLike accepted
    st.save(sd, ck)
    calls = []
    stats = st.export_safetensors(ck, out, prefix="net.", max_file_bytes=5000,
                                  progress=lambda done, total: calls.append((done, total)))
    got, idx = read_all(str(out))
    assert len(set(idx["weight_map"].values())) > 2
    want = {(k[4:] if k.startswith("net.") else k): v for k, v in sd.items()}
    assert set(got) == set(want)
    for k, v in want.items():
        assert same(got[k], v), k
    total = total_size(str(out))
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    assert stats["bytes"] == total == nbytes and stats["data_bytes"] == nbytes
    assert stats["seconds"] > 0 and stats["io_calls"] > 0
    # once before the first write, then after each window; done never goes back, ends at total
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) > 2
    assert all(t == total for _, t in calls)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]


def test_api_bf16(tmp_path):
    sd = special_state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    st.export_safetensors(ck, str(tmp_path / "a"), dtype=torch.bfloat16)
    strata.export_safetensors(ck, str(tmp_path / "b"), dtype="bf16")
    for out in ("a", "b"):
        got, _ = read_all(str(tmp_path / out))
        check_bf16(sd, got)
    # the same bytes from both calls
    for f in os.listdir(tmp_path / "a"):
        assert open(tmp_path / "a" / f, "rb").read() == open(tmp_path / "b" / f, "rb").read()


def test_api_bf16_every_f16_and_f64_rounded_once(tmp_path):
    # every f16 bit pattern (subnormals, infinities, NaNs): f16 -> f32 is exact, so the
    # bf16 must be torch's; f64 values whose rounding through f32 would land on a bf16 tie
    # and round the wrong way (1 + 2^-8 + 2^-30 is above the tie: up), overflow, underflow
    f16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    e = 2.0 ** -8
    f64 = torch.tensor([1 + e + 2 ** -30, 1 + e - 2 ** -30, 1 + e, 1 + 3 * e, 1 + 3 * e - 2 ** -30,
                        -(1 + e + 2 ** -30), 2.0 ** -134, 2.0 ** -134 + 2.0 ** -160, 2.0 ** -133,
                        3.4e38, 1e300, -1e300, 1e-300, -1e-300, float("nan"), 0.0, -0.0],
                       dtype=torch.float64)
    want64 = torch.tensor([1 + 2 * e, 1.0, 1.0, 1 + 4 * e, 1 + 2 * e, -(1 + 2 * e), 0.0,
                           2.0 ** -133, 2.0 ** -133, float("inf"), float("inf"), -float("inf"),
                           0.0, -0.0, float("nan"), 0.0, -0.0], dtype=torch.bfloat16)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    st.save({"h": f16, "d": f64}, ck)
    st.export_safetensors(ck, out, dtype=torch.bfloat16)
    got, _ = read_all(out)
    want16 = f16.to(torch.bfloat16)
    nan = torch.isnan(want16)
    assert torch.equal(torch.isnan(got["h"]), nan)
    assert same(got["h"][~nan], want16[~nan])
    # a NaN stays a NaN of its sign
    assert torch.equal(torch.signbit(got["h"][nan]), torch.signbit(f16[nan]))
    nan = torch.isnan(want64)
    assert torch.equal(torch.isnan(got["d"]), nan)
    assert same(got["d"][~nan], want64[~nan])


def test_api_direct_buffered_and_tmpfs_same_bytes(tmp_path):
    # O_DIRECT (the default where allowed: a padded last block, then truncated), buffered
    # writes (direct=False), and tmpfs (which refuses O_DIRECT before Linux 6.6: buffered
    # there) give the same bytes; files whose sizes end mid-block
    sd = state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    outs = [str(tmp_path / "a"), str(tmp_path / "b")]
    strata.export_safetensors(ck, outs[0], max_file_bytes=300000)
    strata.export_safetensors(ck, outs[1], max_file_bytes=300000, direct=False)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        outs.append(tempfile.mkdtemp(dir="/dev/shm", prefix="strata-export-test-"))
        strata.export_safetensors(ck, outs[2], max_file_bytes=300000)
    try:
        names = sorted(os.listdir(outs[0]))
        assert len(names) > 2
        assert any(os.path.getsize(os.path.join(outs[0], n)) % 4096 for n in names)
        for o in outs[1:]:
            assert sorted(os.listdir(o)) == names
            for n in names:
                assert open(os.path.join(o, n), "rb").read() == \
                    open(os.path.join(outs[0], n), "rb").read(), (o, n)
        got, _ = read_all(outs[0])
        for k, v in sd.items():
            assert same(got[k], v), k
    finally:
        if len(outs) > 2:
            shutil.rmtree(outs[2])


def test_api_window_larger_tensor(tmp_path):
    # a tensor larger than the 64 MiB window, saved as two odd row blocks: several loads,
    # each a flat range that cuts rows, written at their offsets
    full = sample(torch.float32, (4099, 4111), 5)   # 67.4 MB
    s0, s1 = strata.State(), strata.State()
    for s, rows in ((s0, slice(0, 2049)), (s1, slice(2049, 4099))):
        t = full[rows].contiguous()
        s.add_shard("big", "f32", full.shape, (rows.start, 0), (t.shape[0], full.shape[1]),
                    data_ptr=t.data_ptr(), nbytes=t.numel() * 4, keep=t)
    ck = str(tmp_path / "ck")
    strata.Saver().save(ck, [s0, s1], sync=False)
    calls = []
    strata.export_safetensors(ck, str(tmp_path / "out"), progress=lambda d, t: calls.append(d))
    assert len(calls) >= 3   # before, and at least two windows
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert same(f.get_tensor("big"), full)


def test_api_errors(tmp_path):
    sd = state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    out = str(tmp_path / "out")
    # a missing checkpoint: MissingError, STRATA_ENOENT, nothing made
    with pytest.raises(strata.MissingError) as ei:
        strata.export_safetensors(str(tmp_path / "absent"), out)
    assert ei.value.code == -13 and ei.value.name == "STRATA_ENOENT"
    assert "absent" in str(ei.value)
    with pytest.raises(strata.MissingError):
        st.export_safetensors(str(tmp_path / "absent"), out)
    # dtypes other than bf16, bad sizes and types
    for bad in (torch.float16, torch.float32):
        with pytest.raises(strata.InvalidArgumentError, match="bfloat16") as ei:
            st.export_safetensors(ck, out, dtype=bad)
        assert ei.value.code == -1
    for bad in ("f16", "bfloat16", 3):
        with pytest.raises(strata.InvalidArgumentError, match="only 'bf16'"):
            strata.export_safetensors(ck, out, dtype=bad)
    with pytest.raises(strata.InvalidArgumentError, match="max_file_bytes"):
        strata.export_safetensors(ck, out, max_file_bytes=0)
    with pytest.raises(strata.InvalidArgumentError, match="negative"):
        strata.export_safetensors(ck, out, max_file_bytes=-1)
    with pytest.raises(TypeError):
        strata.export_safetensors(ck, out, progress=3)
    with pytest.raises(TypeError):
        strata.export_safetensors(ck, out, prefix=b"net.")
    with pytest.raises(strata.SchemeError, match="s3"):
        strata.export_safetensors(ck, "gs://bucket/out")
    # two names the same once the prefix is stripped
    st.save({"a.x": torch.ones(2), "b.a.x": torch.ones(2)}, str(tmp_path / "dup"))
    with pytest.raises(strata.InvalidArgumentError, match="same name"):
        strata.export_safetensors(str(tmp_path / "dup"), out, prefix="b.")
    assert not os.path.exists(out)
    # a progress callable that raises stops the export: AbortedError from it, no file left
    def stop(done, total):
        if done:
            raise KeyError("enough")
    with pytest.raises(strata.AbortedError, match="KeyError") as ei:
        strata.export_safetensors(ck, out, max_file_bytes=5000, progress=stop)
    assert isinstance(ei.value.__cause__, KeyError)
    assert not os.path.exists(out)
    # Ctrl-C (a KeyboardInterrupt, not an Exception) stops it and is raised as it is
    def interrupt(done, total):
        if done:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        strata.export_safetensors(ck, out, max_file_bytes=5000, progress=interrupt)
    assert not os.path.exists(out)
    # a directory holding files no export writes: ExistsError, nothing touched
    os.makedirs(out)
    open(os.path.join(out, "keep"), "w").close()
    with pytest.raises(strata.ExistsError, match="holds 'keep'"):
        strata.export_safetensors(ck, out)
    assert os.listdir(out) == ["keep"]
    os.unlink(os.path.join(out, "keep"))
    # incomplete: IncompleteError; corrupt: ChecksumError; an earlier export in out is kept
    strata.export_safetensors(ck, out)
    earlier = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    info = strata.Checkpoint(ck)
    shard = info.tensors[0]["shards"][0]
    with open(os.path.join(ck, shard["file"]), "r+b") as f:
        f.seek(shard["file_offset"])
        b = f.read(1)
        f.seek(shard["file_offset"])
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(strata.ChecksumError) as ei:
        strata.export_safetensors(ck, out)
    assert info.tensors[0]["name"] in str(ei.value)
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == earlier
    os.unlink(os.path.join(ck, "COMMIT"))
    with pytest.raises(strata.IncompleteError):
        strata.export_safetensors(ck, out)
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == earlier
    assert not [f for f in os.listdir(tmp_path) if ".strata-export-" in f]


# ---- the test: Megatron tp=2, pp=2, dp=2, zero=1 ----------------------------------

TP, PP, DP = 2, 2, 2


def megatron_model():
    """The full tensors, for every dtype: per dtype an embedding (vocab-parallel: rows split
    over tp, stage 0), two layers (layer l on pipeline stage l) with a column-parallel qkv
    weight and bias (rows split over tp), a row-parallel projection (columns split over tp)
    and a layernorm weight (replicated over tp), a final layernorm (stage 1), and a scalar on
    every rank; and for every parameter its optimizer state (optim.exp_avg.*), flat-sharded
    over dp (ZeRO-1) within each tp/pp box. Returns {name: (tensor, split dim or None,
    stage or None for every stage, zero)}."""
    H, V = 6, 10
    model = {}
    for i, dt in enumerate(DTYPES):
        p = "d%d." % i
        params = {p + "embed": ((V, H), 0, 0)}
        for layer in range(PP):
            q = "%slayers.%d." % (p, layer)
            params[q + "qkv.weight"] = ((3 * H, H), 0, layer)
            params[q + "qkv.bias"] = ((3 * H,), 0, layer)
            params[q + "proj.weight"] = ((H, 2 * H + 2), 1, layer)
            params[q + "ln.weight"] = ((H + 1,), None, layer)
        params[p + "final_ln.weight"] = ((H - 1,), None, PP - 1)
        for k, (shape, split, stage) in params.items():
            seed = len(model) + 1
            model[k] = (sample(dt, shape, seed), split, stage, False)
            model["optim.exp_avg." + k] = (sample(dt, shape, seed + 1000), split, stage, True)
        model[p + "scale"] = (sample(dt, (), 500 + i), None, None, False)
    return model


def megatron_states(model):
    """The 8 logical ranks' states (rank = (pp * DP + dp) * TP + tp)."""
    states = [strata.State() for _ in range(TP * PP * DP)]
    for pp in range(PP):
        for dp in range(DP):
            for tp in range(TP):
                s = states[(pp * DP + dp) * TP + tp]
                for name, (full, split, stage, zero) in model.items():
                    if stage is not None and stage != pp:
                        continue
                    shape = tuple(full.shape)
                    offs, lens, box = [0] * len(shape), list(shape), full
                    if split is not None:
                        n = shape[split] // TP
                        offs[split], lens[split] = tp * n, n
                        box = full.narrow(split, tp * n, n)
                    box = box.contiguous().reshape(-1)
                    flat = None
                    if zero:   # a contiguous element range of the box, cutting rows
                        cut = box.numel() // DP + 1
                        flat = (0, cut) if dp == 0 else (cut, box.numel())
                        box = box[flat[0]:flat[1]]
                    t = box.contiguous()
                    s.add_shard(name, TO_STRATA[full.dtype], shape, offs, lens,
                                data_ptr=t.data_ptr(), nbytes=t.numel() * t.element_size(),
                                flat=flat, keep=t)
    return states


def test_megatron_tp2_pp2_dp2_zero1_every_dtype(tmp_path):
    """The issue's test: an exported checkpoint (saved as tp=2,pp=2,dp=2,zero=1) read back with
    the safetensors package (safe_open) is bitwise equal to the full tensors, for every dtype;
    split across several files when the file size is small."""
    model = megatron_model()
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    strata.Saver().save(ck, megatron_states(model), sync=False)
    info = strata.Checkpoint(ck)
    flat_shards = sum(1 for t in info.tensors for s in t["shards"] if s["flat"])
    assert flat_shards == sum(2 * (TP if split is not None else 1)
                              for _, split, _, zero in model.values() if zero)
    stats = strata.export_safetensors(ck, out, max_file_bytes=600)
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) > 10
    assert files == sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert all(f == "model-%05d-of-%05d.safetensors" % (i + 1, len(files))
               for i, f in enumerate(files))
    assert set(idx["weight_map"]) == set(model)
    seen = set()
    for fname in files:
        size = os.path.getsize(os.path.join(out, fname))
        with safe_open(os.path.join(out, fname), framework="pt") as f:
            keys = list(f.keys())
            data = 0
            for k in keys:
                assert idx["weight_map"][k] == fname and k not in seen
                seen.add(k)
                got, want = f.get_tensor(k), model[k][0]
                assert got.dtype == want.dtype and same(got, want), k
                data += got.numel() * got.element_size()
            # a file holds at most max_file_bytes of data, unless one tensor alone is larger
            assert data <= 600 or len(keys) == 1
        with open(os.path.join(out, fname), "rb") as raw:
            hlen = int.from_bytes(raw.read(8), "little")
        assert hlen % 8 == 0 and size == 8 + hlen + data
    assert seen == set(model)
    want_total = sum(t.numel() * t.element_size() for t, _, _, _ in model.values())
    assert idx["metadata"]["total_size"] == want_total == stats["bytes"]
