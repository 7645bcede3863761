"""Export selection on a real training state saved by strata.torch ({"model", "optim" after
an AdamW step, "step", per-rank RNG state}): model_only gives exactly the model's state_dict
(bitwise, loadable with strict=True), include / exclude pick by glob with exclude winning,
through strata.torch.export_safetensors, strata.export_safetensors and `strata export`; a
selection that keeps nothing is NotFoundError and writes nothing."""

import fnmatch
import json
import os
import subprocess

import pytest
import torch

import strata
import strata.torch as st

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")


def trained(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    st.save({"model": model, "optim": opt, "step": 3, "rng": st.rng_state()}, path)
    return model


def read_all(out):
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):   # one file
        assert os.listdir(out) == ["model.safetensors"], os.listdir(out)
        return safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    idx = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    got = {}
    for f in sorted(set(idx["weight_map"].values())):
        got.update(safetensors_torch.load_file(os.path.join(out, f)))
    assert set(got) == set(idx["weight_map"])
    return got


def test_model_only_is_the_models_state_dict(tmp_path):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    model = trained(ck)
    st.export_safetensors(ck, str(tmp_path / "all"))
    everything = read_all(str(tmp_path / "all"))
    assert any(k.startswith("optim.") for k in everything)
    assert any("@rank" in k for k in everything)
    stats = st.export_safetensors(ck, out, model_only="model")
    got = read_all(out)
    sd = model.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert stats["data_bytes"] == sum(v.numel() * v.element_size() for v in sd.values())
    fresh = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fresh.load_state_dict(got, strict=True)
    # True means "model"; the module-level call takes the same
    out2 = str(tmp_path / "out2")
    strata.export_safetensors(ck, out2, model_only=True)
    assert set(read_all(out2)) == set(sd)


def test_include_exclude(tmp_path):
    ck = str(tmp_path / "ck")
    trained(ck)
    st.export_safetensors(ck, str(tmp_path / "all"))
    names = set(read_all(str(tmp_path / "all")))
    out = str(tmp_path / "out")
    strata.export_safetensors(ck, out, include="optim.*", exclude=["*exp_avg_sq", "*.step"])
    want = {n for n in names if fnmatch.fnmatchcase(n, "optim.*") and
            not fnmatch.fnmatchcase(n, "*exp_avg_sq") and not fnmatch.fnmatchcase(n, "*.step")}
    assert want and want < names
    assert set(read_all(out)) == want
    assert all(k.endswith("exp_avg") for k in want)


@pytest.mark.skipif(not os.access(STRATA, os.X_OK), reason="no strata command built")
def test_cli_model_only_and_globs(tmp_path):
    ck = str(tmp_path / "ck")
    model = trained(ck)
    out = str(tmp_path / "out")
    subprocess.run([STRATA, "export", ck, out, "--quiet", "--model-only"], check=True)
    assert set(read_all(out)) == set(model.state_dict())
    out2 = str(tmp_path / "out2")
    subprocess.run([STRATA, "export", ck, out2, "--quiet", "--model-only=model",
                    "--exclude", "*.bias"], check=True)
    assert set(read_all(out2)) == {"0.weight", "2.weight"}
    r = subprocess.run([STRATA, "export", ck, str(tmp_path / "none"), "--include", "decoder.*"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "no tensor of the checkpoint's" in r.stderr and "STRATA_ENOTFOUND" in r.stderr
    assert not os.path.exists(str(tmp_path / "none"))


def test_selection_errors(tmp_path):
    ck = str(tmp_path / "ck")
    trained(ck)
    out = str(tmp_path / "out")
    with pytest.raises(strata.NotFoundError, match='include "decoder.\\*"'):
        st.export_safetensors(ck, out, include=["decoder.*"])
    with pytest.raises(strata.NotFoundError, match="model_only \"rng\""):
        st.export_safetensors(ck, out, model_only="rng")  # only per-rank tensors there
    assert not os.path.exists(out)
    with pytest.raises(strata.InvalidArgumentError, match="cannot be given with it"):
        st.export_safetensors(ck, out, model_only="model", prefix="model.")
    with pytest.raises(TypeError, match="model_only must be a str"):
        st.export_safetensors(ck, out, model_only=3)
    with pytest.raises(TypeError):
        st.export_safetensors(ck, out, include=[1])
    assert not os.path.exists(out)
