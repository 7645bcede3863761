"""`strata export`: a state saved by strata.torch, exported to safetensors, read back by the
`safetensors` package (safetensors.torch.load_file) bitwise, every dtype; split over several
files; --prefix; --dtype bf16. Skips when the command or the package is missing."""

import json
import os
import subprocess

import pytest
import torch

import strata.torch as st
from _tensors import DTYPES, bits, same, sample

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
if not os.access(STRATA, os.X_OK):
    pytest.skip("no strata command built (" + STRATA + ")", allow_module_level=True)

def state():
    sd = {}
    for i, dt in enumerate(DTYPES):
        sd["net.w_%d" % i] = sample(dt, (37, 5 + i), i)
        sd["net.s_%d" % i] = sample(dt, (), 100 + i)
    sd["net.big"] = sample(torch.float32, (300, 1000), 99)
    sd["other.x"] = sample(torch.float16, (7,), 7)
    return sd


def read_all(out):
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


def test_export_bitwise_every_dtype(tmp_path):
    sd = state()
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    export(ck, str(tmp_path / "out"))
    got, _ = read_all(str(tmp_path / "out"))
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert same(got[k], v), k


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


def test_export_bf16(tmp_path):
    sd = state()
    sd["special"] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40,
                                  3.4e38, 1.00390625, 1.01171875, -1.00390625])
    ck = str(tmp_path / "ck")
    st.save(sd, ck)
    out = str(tmp_path / "out")
    export(ck, out, "--dtype", "bf16")
    got, _ = read_all(out)
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
