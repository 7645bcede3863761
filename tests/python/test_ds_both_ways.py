"""DeepSpeed both ways (issue 30): tags saved through strata.deepspeed (DeepSpeed 0.19.8 on
CPU, gloo, 2 processes: tests/python/_ds_back_worker.py) read by the `strata` command, and
written back as DeepSpeed's default engine writes them.

One launch saves ZeRO 1, 2 and 3 of a model with odd sizes, a tied weight, a frozen
parameter, a buffer and two AdamW param groups through strata's engine (tags step1 and
step3, `latest` step3). Then:
- `python -m strata.deepspeed convert` writes each save_dir's latest tag back; DeepSpeed's own
  engine (strata not enabled) resumes from it on 2 processes with the state bitwise the
  saved one and the next losses bitwise the uninterrupted run's; the zero_to_fp32.py the
  command puts beside it reads it (and the one DeepSpeed copied beside strata's tags does
  not: what the README says);
- `strata export` of the strata tags (the save_dir through `latest`, and the tag directory)
  gives what zero_to_fp32 gives on the tag written back, bitwise, names included; so does
  `--model-only`, on strata's tags and on DeepSpeed's own;
- `strata ls` and `inspect` of the save_dir recognise strata's tags and say which tag
  `latest` named.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
import _launch  # noqa: E402
from _tensors import same  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")
STAGES = (1, 2, 3)


def _launch_mode(mode, out):
    procs = _launch.launch([os.path.join(HERE, "_ds_back_worker.py"), mode, out], 2,
                           log=lambda r: os.path.join(out, "log-%s-%d" % (mode, r)))
    rcs = _launch.wait(procs)
    logs = "".join(open(os.path.join(out, "log-%s-%d" % (mode, r))).read()[-3000:]
                   for r in range(2))
    assert rcs == [0, 0], (mode, rcs, logs)


def _convert(save_dir, out_dir, *args):
    return subprocess.run([sys.executable, "-m", "strata.deepspeed", "convert", save_dir,
                           out_dir] + list(args), capture_output=True, text=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The save launch, each stage's latest tag written back (back<stage>), the back launch:
    the directory."""
    out = str(tmp_path_factory.mktemp("dsback"))
    _launch_mode("save", out)
    for s in STAGES:
        r = _convert(os.path.join(out, "s%d" % s), os.path.join(out, "back%d" % s))
        assert r.returncode == 0, r.stderr
        assert "wrote %s" % os.path.join(out, "back%d" % s, "step3") in r.stdout, r.stdout
    _launch_mode("back", out)
    return out


def _zero_to_fp32(script):
    """The module of a zero_to_fp32.py file (the script DeepSpeed copies into a save_dir)."""
    spec = importlib.util.spec_from_file_location("zero_to_fp32_%d" % abs(hash(script)), script)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _reference(out, s):
    """zero_to_fp32.py's state dict of the tag written back (its own copy beside it)."""
    back = os.path.join(out, "back%d" % s)
    sd = _zero_to_fp32(os.path.join(back, "zero_to_fp32.py")) \
        .get_fp32_state_dict_from_zero_checkpoint(back)
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def _exported(out):
    from safetensors.torch import load_file
    assert os.listdir(out) == ["model.safetensors"], os.listdir(out)
    return load_file(os.path.join(out, "model.safetensors"))


@pytest.mark.slow
def test_way_back_resumes_in_deepspeeds_engine(run):
    """DeepSpeed's default engine resumes from the tag written back: state bitwise, the
    client state, and the next losses bitwise."""
    for r in range(2):
        with open(os.path.join(run, "back-%d.json" % r)) as f:
            rep = json.load(f)
        for s in STAGES:
            x = rep[str(s)]
            where = "stage %d rank %d" % (s, r)
            assert os.path.dirname(x["path"]).endswith(os.path.join("back%d" % s, "step3")), where
            assert x["client"] == 3, where
            assert x["state_diff"] == [], "%s: differs: %s" % (where, x["state_diff"][:8])
            assert x["losses"] == x["losses_want"], where


@pytest.mark.slow
def test_way_back_written_as_deepspeed_writes(run):
    """The tag written back holds DeepSpeed's files (torch.save archives, no stub), latest
    and zero_to_fp32.py beside it; converting again is refused; the zero_to_fp32.py
    DeepSpeed copied beside strata's own tags cannot read them (their files are stubs)."""
    back = os.path.join(run, "back2")
    assert open(os.path.join(back, "latest")).read() == "step3"
    files = sorted(os.listdir(os.path.join(back, "step3")))
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"], files
    for f in files:
        with open(os.path.join(back, "step3", f), "rb") as h:
            assert h.read(4) == b"PK\x03\x04", f
    r = _convert(os.path.join(run, "s2"), back)
    assert r.returncode == 1 and "already there (a tag is never overwritten)" in r.stderr, r
    with pytest.raises(Exception):
        _zero_to_fp32(os.path.join(run, "s2", "zero_to_fp32.py")) \
            .get_fp32_state_dict_from_zero_checkpoint(os.path.join(run, "s2"))


@needs_cli
@pytest.mark.slow
def test_export_of_strata_tags_is_zero_to_fp32s(run, tmp_path):
    """`strata export` of strata's tags, by save_dir (latest) and by tag directory, with and
    without --model-only: exactly zero_to_fp32's names and values, bitwise (buffer, frozen
    parameter where DeepSpeed saves it, the tied weight's alias included); --model-only on
    the tag DeepSpeed's default engine reads (written back) the same."""
    for s in STAGES:
        want = _reference(run, s)
        assert {"scale", "head.weight", "emb.weight"} <= set(want), sorted(want)
        assert ("frozen.weight" in want) == (s > 1), sorted(want)
        srcs = [(os.path.join(run, "s%d" % s), []),
                (os.path.join(run, "s%d" % s, "step3"), ["--model-only"]),
                (os.path.join(run, "back%d" % s), ["--model-only"])]
        for i, (src, how) in enumerate(srcs):
            out = str(tmp_path / ("e%d-%d" % (s, i)))
            r = subprocess.run([STRATA, "export", src, out, "--quiet"] + how,
                               capture_output=True, text=True)
            assert r.returncode == 0, (src, how, r.stderr)
            got = _exported(out)
            assert set(got) == set(want), (src, how, sorted(set(got) ^ set(want)))
            for k, v in want.items():
                assert same(got[k], v), (src, how, k)


@needs_cli
@pytest.mark.slow
def test_ls_and_inspect_know_strata_tags(run, tmp_path):
    """ls of a save_dir lists strata's tags with their state and step, the latest marked;
    inspect and export read the tag latest names and say which; verify checks its
    checksums."""
    d = os.path.join(run, "s3")
    r = subprocess.run([STRATA, "export", d, str(tmp_path / "x")], capture_output=True,
                       text=True)
    assert r.returncode == 0 and " from tag step3 (named by its latest) to " in r.stdout, r
    r = subprocess.run([STRATA, "ls", d], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[1:]
    assert len(rows) == 2, r.stdout
    assert rows[0].startswith("committed") and rows[0].split()[4] == "1" and rows[0].endswith(
        "%s/step1 (DeepSpeed tag, strata.deepspeed)" % d), rows[0]
    assert rows[1].split()[4] == "3" and rows[1].endswith(
        "%s/step3 (DeepSpeed tag, strata.deepspeed) (latest)" % d), rows[1]
    r = subprocess.run([STRATA, "inspect", d], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DeepSpeed (strata.deepspeed) %s: tag step3 (named by latest), "
                               "read from %s/step3/strata: committed, step 3, " % (d, d)), r.stdout
    r = subprocess.run([STRATA, "inspect", "--json", d], capture_output=True, text=True)
    j = json.loads(r.stdout)
    assert j["format"] == "strata.deepspeed" and j["tag"] == "step3" and j["checksums"], j
    r = subprocess.run([STRATA, "verify", os.path.join(d, "step1")], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok: "), (r.stdout, r.stderr)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not in a venv (make venv makes one)")
def test_make_venv_built_the_op():
    """`make venv` built DeepSpeed's CPU shared-memory op once, into the venv's
    torch_extensions (where tests/run.sh points TORCH_EXTENSIONS_DIR), and the venv's Python
    looks there when TORCH_EXTENSIONS_DIR is not set: a first DeepSpeed run compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    r = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TORCH_EXTENSIONS_DIR'))"],
                       env=env, capture_output=True, text=True)
    want = os.path.join(sys.prefix, "torch_extensions")
    assert r.stdout.strip() == want, r
    assert os.path.isfile(os.path.join(want, "deepspeed_shm_comm", "deepspeed_shm_comm.so"))
