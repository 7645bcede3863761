"""DeepSpeed ZeRO checkpoints of DeepSpeed's DEFAULT engine as a source (format "deepspeed").

DeepSpeed 0.19.8 on CPU (gloo, 2 processes: tests/python/_ds_zero_worker.py, one launch)
writes one checkpoint of each ZeRO stage 1, 2 and 3 of a small transformer with odd sizes,
a tied weight, a frozen parameter, a buffer and two AdamW param groups. Then, on the same
files, against DeepSpeed's own zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint),
bitwise: strata.torch.load into plain tensors, into DTensors on 2 and 3 gloo processes
(Shard(0), Shard(1)), `strata export` to safetensors; `strata inspect` / `verify` and their
exit codes; the optimizer moments against the ranks' partitions read with torch.load; and
hostile variants of the files, each refused with its own error.
"""

import os
import shutil
import subprocess

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
import _dist  # noqa: E402
import _launch  # noqa: E402
import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from _tensors import load_dtensors, same  # noqa: E402
from _zipflip import entries, entry_of, flip, raw  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"), "strata")
needs_cli = pytest.mark.skipif(not os.access(STRATA, os.X_OK),
                               reason="no strata command built (" + STRATA + ")")
STAGES = (1, 2, 3)
TAG = "step3"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_to_fp32(path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return {k: v.detach().contiguous().clone()
            for k, v in get_fp32_state_dict_from_zero_checkpoint(path).items()}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{stage: save_dir} written by DeepSpeed's default engine, and {stage: zero_to_fp32's
    state dict} (also in <base>/ref<stage>.pt for the DTensor ranks)."""
    base = str(tmp_path_factory.mktemp("zero"))
    procs = _launch.launch([os.path.join(HERE, "_ds_zero_worker.py"), base], 2,
                           log=lambda r: os.path.join(base, "log%d" % r))
    rcs = _launch.wait(procs)
    assert rcs == [0, 0], (rcs, open(os.path.join(base, "log0")).read()[-3000:])
    dirs = {s: os.path.join(base, "z%d" % s) for s in STAGES}
    refs = {}
    for s, d in dirs.items():
        refs[s] = _zero_to_fp32(d)
        torch.save(refs[s], os.path.join(base, "ref%d.pt" % s))
    return dirs, refs


def test_deepspeed_wrote_it(written):
    """What the default engine wrote: torch.save files named by rank, `latest` naming the tag;
    zero_to_fp32 gives the tied, frozen and buffer entries this test relies on."""
    dirs, refs = written
    for s, d in dirs.items():
        with open(os.path.join(d, "latest")) as f:
            assert f.read().strip() == TAG
        files = sorted(os.listdir(os.path.join(d, TAG)))
        model = (["mp_rank_00_model_states.pt"] if s < 3 else
                 ["zero_pp_rank_%d_mp_rank_00_model_states.pt" % r for r in range(2)])
        optim = ["zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r for r in range(2)]
        assert files == sorted(model + optim), files
        assert {"head.weight", "scale"} <= set(refs[s])
        assert ("frozen.weight" in refs[s]) == (s > 1)     # stage 1 saves no frozen params


def test_load_plain_tensors(written):
    """Every tensor zero_to_fp32 gives, loaded in this process from the save_dir (`latest`)
    and from the tag directory: bitwise the same, same names (besides optim.state.*)."""
    dirs, refs = written
    for s, d in dirs.items():
        for path in (d, os.path.join(d, TAG)):
            ck = strata.Checkpoint(path)
            assert ck.format == "deepspeed" and ck.committed and ck.step == 3
            names = {t["name"] for t in ck.tensors}
            assert {n for n in names if not n.startswith("optim.state.")} == set(refs[s])
            sd = {k: torch.full_like(v, 7) for k, v in refs[s].items()}
            st.load(sd, path)
            for k, v in refs[s].items():
                assert same(sd[k], v), (s, path, k)


def _moments_by_hand(tag_dir, stage):
    """{fqn.key: tensor} cut by hand from the ranks' partitions read with torch.load."""
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith("_optim_states.pt"))
    osd = [torch.load(os.path.join(tag_dir, f), weights_only=False)["optimizer_state_dict"]
           for f in files]
    model = "mp_rank_00_model_states.pt" if stage < 3 else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    shapes = torch.load(os.path.join(tag_dir, model), weights_only=False)["param_shapes"]
    R, out = len(osd), {}
    if stage < 3:
        for g, group in enumerate(shapes):
            lens = [o["single_partition_of_fp32_groups"][g].numel() for o in osd]
            for key in MOMENTS:
                flat = torch.cat([o["base_optimizer_state"]["state"][g][key][:n]
                                  for o, n in zip(osd, lens)])
                at = 0
                for name, shape in group.items():
                    n = shape.numel()
                    out[name + "." + key] = flat[at:at + n].view(shape)
                    at += n
    else:
        at = 0
        for group in shapes:
            for name, shape in group.items():
                n = shape.numel()
                pn = -(-n // R)
                for key in MOMENTS:
                    flat = [torch.cat([o["optimizer_state_dict"]["state"][k][key]
                                       for k in sorted(o["optimizer_state_dict"]["state"])])
                            for o in osd]
                    out[name + "." + key] = torch.cat([f[at:at + pn] for f in flat])[:n].view(shape)
                at += pn
    return out


def test_optimizer_moments(written):
    """optim.state.<fqn>.exp_avg / exp_avg_sq: the base optimizer's per-element state cut
    from the flat partitions, bitwise what the ranks' files hold (read with torch.load)."""
    dirs, _ = written
    for s, d in dirs.items():
        want = _moments_by_hand(os.path.join(d, TAG), s)
        ck = strata.Checkpoint(d)
        have = {t["name"][len("optim.state."):] for t in ck.tensors
                if t["name"].startswith("optim.state.")}
        assert have == set(want), (s, sorted(have ^ set(want)))
        sd = {"optim.state." + k: torch.full_like(v, 5) for k, v in want.items()}
        st.load(sd, d)
        for k, v in want.items():
            assert same(sd["optim.state." + k], v), (s, k)
            assert not torch.equal(v, torch.zeros_like(v)), k     # trained: moments not 0


def zero_load(base, stage):
    """On this run's ranks: zero_to_fp32's tensors of `stage` into DTensors Shard(0) and, for
    2-D ones, Shard(1) (load_dtensors); (mismatches, cases)."""
    import torch.distributed as dist
    refs = torch.load(os.path.join(base, "ref%d.pt" % stage))
    bad, cases = load_dtensors(refs, os.path.join(base, "z%d" % stage))
    return ["rank %d: %s Shard(%d) stage %d" % (dist.get_rank(), k, dim, stage)
            for k, dim in bad], cases


@pytest.mark.parametrize("world", [2, 3])
def test_load_dtensors(written, world):
    """Every stage's checkpoint into DTensors on 2 and 3 gloo processes, bitwise."""
    dirs, refs = written
    base = os.path.dirname(dirs[1])
    for s in STAGES:
        res = _dist.run(zero_load, world, base, s, timeout=240)
        assert not [b for r in res for b in r[0]], [b for r in res for b in r[0]]
        assert res[0][1] == len(refs[s]) + sum(v.dim() >= 2 for v in refs[s].values())


def _exported(out):
    from safetensors import safe_open
    got = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), "pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys()})
    return got


@needs_cli
def test_export_to_safetensors(written, tmp_path):
    """`strata export` of each stage gives what zero_to_fp32 gives (issue 30): exactly its
    names, bitwise, read back by the safetensors package; so does --model-only; the
    moments only when asked for (--include 'optim.state.*')."""
    dirs, refs = written
    for s, d in dirs.items():
        for how in ([], ["--model-only"]):
            out = str(tmp_path / ("out%d%s" % (s, "".join(how))))
            subprocess.run([STRATA, "export", d, out, "--quiet"] + how, check=True)
            got = _exported(out)
            assert set(got) == set(refs[s]), (s, how, sorted(set(got) ^ set(refs[s])))
            for k, v in refs[s].items():
                assert same(got[k], v), (s, how, k)
        out = str(tmp_path / ("moments%d" % s))
        subprocess.run([STRATA, "export", d, out, "--quiet", "--include", "optim.state.*"],
                       check=True)
        got = _exported(out)
        assert set(got) == {"optim.state.%s.%s" % (k, m) for k in refs[s] for m in MOMENTS
                            if "optim.state.%s.%s" % (k, m) in got} and got, (s, sorted(got))
        assert {k.rsplit(".", 1)[1] for k in got} == set(MOMENTS), s


@needs_cli
def test_inspect_and_verify(written, tmp_path):
    """inspect names the format, exit 0; verify checks every zip CRC-32: 0 on the files as
    written, 3 naming the entry when a byte of a partition is flipped."""
    dirs, _ = written
    d = dirs[2]
    r = subprocess.run([STRATA, "inspect", d], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DeepSpeed ZeRO %s: tag step3 (named by latest), step 3, " % d), \
        r.stdout                      # the tag `latest` named, which was read (issue 30)
    r = subprocess.run([STRATA, "inspect", os.path.join(d, TAG)], capture_output=True,
                       text=True)
    assert r.stdout.startswith("DeepSpeed ZeRO %s: step 3, " % os.path.join(d, TAG)), r.stdout
    assert "optim.state.layer.linear1.weight.exp_avg_sq" in r.stdout
    r = subprocess.run([STRATA, "verify", d], capture_output=True, text=True)
    assert r.returncode == 0 and "every zip entry's CRC-32 matched" in r.stdout, r
    bad = _copy(d, tmp_path / "flip")
    f = os.path.join(bad, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    ck = strata.Checkpoint(bad)
    sh = [x for t in ck.tensors if t["name"] == "layer.linear2.weight" for x in t["shards"]
          if x["file"].startswith("zero_pp_rank_1")][0]
    with open(f, "r+b") as h:
        h.seek(sh["file_offset"])
        b = h.read(1)
        h.seek(sh["file_offset"])
        h.write(bytes([b[0] ^ 0x40]))
    r = subprocess.run([STRATA, "verify", bad], capture_output=True, text=True)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "CORRUPT: zip entry" in r.stderr and "zero_pp_rank_1_mp_rank_00_optim_states.pt" \
        in r.stderr, r.stderr


# ---- a byte of a partition flipped: every read checks the zip CRC-32 (issue 28) ----

RANK1_OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def _flip_partition(save_dir, dst):
    """A copy of the stage-2 checkpoint with one byte of rank 1's fp32 partition of group 0
    flipped, near its end (found from the zip entry's local header). Returns (copy, entry
    name, the flipped byte's file offset, a tensor of the index with a piece in that entry
    not holding the byte, one with no byte in the file)."""
    d = _copy(save_dir, dst)
    f = os.path.join(d, TAG, RANK1_OPTIM)
    part = torch.load(f, weights_only=False)["optimizer_state_dict"][
        "single_partition_of_fp32_groups"][0]
    data = open(f, "rb").read()
    entry, at = entry_of(data, raw(part))
    at += part.numel() * 4 - 8
    (start, end), = [(a, a + n) for name, a, n in entries(data) if name == entry]
    flip(f, at)
    inside = outside = None
    for t in strata.Checkpoint(d).tensors:
        in_file = [x for x in t["shards"] if x["file"] == RANK1_OPTIM]
        if not in_file and not t["name"].startswith("optim.") and outside is None:
            outside = t["name"]
        for x in in_file:
            lo, hi = x["file_offset"], x["file_offset"] + x["bytes"]
            if start <= lo and hi <= end and not lo <= at < hi and \
                    inside is None and not t["name"].startswith("optim."):
                inside = t["name"]
    assert inside and outside, (inside, outside)
    return d, entry, at, inside, outside


def test_flipped_partition(written, tmp_path):
    """strata.torch.load raises ChecksumError naming the tensor, the entry and the file - a
    load of one parameter whose piece lies in that entry but not on the flipped byte too (the
    whole entry is read for the check); a tensor with no byte in the file loads; skip_crc
    loads and says so."""
    dirs, refs = written
    d, entry, _, inside, outside = _flip_partition(dirs[2], tmp_path / "flip")
    for names in (list(refs[2]), [inside]):
        sd = {k: torch.zeros_like(refs[2][k]) for k in names}
        with pytest.raises(strata.ChecksumError) as ei:
            st.load(sd, d)
        msg = str(ei.value)
        assert "zip entry '%s'" % entry in msg and RANK1_OPTIM in msg, msg
    sd = {inside: torch.zeros_like(refs[2][inside]), outside: torch.zeros_like(refs[2][outside])}
    s = st.load({outside: sd[outside]}, d)
    assert same(sd[outside], refs[2][outside]) and s["crc_checked"] >= 1, s
    s = st.load(sd, d, skip_crc=True)
    assert s["crc_skipped"] and same(sd[inside], refs[2][inside]), s


@needs_cli
def test_flipped_partition_export_exits_3(written, tmp_path):
    dirs, _ = written
    d, entry, _, _, _ = _flip_partition(dirs[2], tmp_path / "flip")
    out = str(tmp_path / "out")
    r = subprocess.run([STRATA, "export", d, out, "--quiet"], capture_output=True, text=True)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "zip entry '%s'" % entry in r.stderr and RANK1_OPTIM in r.stderr, r.stderr
    assert not os.path.exists(out)


def zero_load_flipped(path, ref_file):
    """On this run's ranks: zero_to_fp32's tensors into DTensors Shard(0) from path; the
    exception class name each rank got (or "ok")."""
    refs = torch.load(ref_file)
    try:
        load_dtensors(refs, path)
    except strata.Error as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.slow
def test_flipped_partition_fails_every_rank(written, tmp_path):
    """Loaded into DTensors on 2 and 3 gloo processes, each needing part of every partition:
    every rank raises ChecksumError (one rank reads the entry whole and checks it)."""
    dirs, _ = written
    d, entry, _, _, _ = _flip_partition(dirs[2], tmp_path / "flip")
    ref = os.path.join(os.path.dirname(dirs[2]), "ref2.pt")
    for world in (2, 3):
        res = _dist.run(zero_load_flipped, world, d, ref, timeout=240)
        assert [r[0] for r in res] == ["ChecksumError"] * world, res
        assert all(entry in r[1] for r in res), res


# ---- hostile inputs ----

def _copy(save_dir, dst):
    dst = str(dst)
    shutil.copytree(save_dir, dst)
    return dst


def _edit(path, fn):
    """torch.load the file, let fn change the object, torch.save it back."""
    obj = torch.load(path, weights_only=False)
    fn(obj)
    torch.save(obj, path)


def _refused(path, exc, words, code):
    with pytest.raises(exc) as ei:
        strata.Checkpoint(path)
    assert words in str(ei.value), (words, str(ei.value))
    if os.access(STRATA, os.X_OK):
        r = subprocess.run([STRATA, "inspect", path], capture_output=True, text=True)
        assert r.returncode == code and words in r.stderr, (r.returncode, r.stderr)


def _resize(g, by):
    """Rank's partition of group g, and its moments with it, by elements more or less."""
    def cut(t):
        return t[:by].clone() if by < 0 else torch.cat([t, torch.zeros(by)])

    def fn(o):
        osd = o["optimizer_state_dict"]
        p = osd["single_partition_of_fp32_groups"]
        p[g] = cut(p[g])
        for k in MOMENTS:
            osd["base_optimizer_state"]["state"][g][k] = \
                cut(osd["base_optimizer_state"]["state"][g][k])
    return fn


def _half(o):
    p = o["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    p[1] = p[1].half()


def _shapes_wrong(o):
    o["param_shapes"][0]["layer.linear1.weight"] = torch.Size([46, 23])


# (stage, file in the tag, edit or None to remove it, exception, words, CLI exit code)
HOSTILE = [
    (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", _resize(1, -40), strata.UnfilledError,
     "parameter 'layer.norm2.bias' (23 elements at 229 of group 1) is not covered by the "
     "ranks' partitions", 1),
    (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", _resize(0, 40), strata.MismatchError,
     "param_shapes of group 0 account for 5037 elements, the ranks' partitions hold 5077", 1),
    (1, "mp_rank_00_model_states.pt", _shapes_wrong, strata.UnfilledError,
     "parameter 'layer.linear2.weight' (1035 elements at 4025 of group 0) is not covered", 1),
    (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt", None, strata.MissingError,
     "'zero_pp_rank_1_mp_rank_00_optim_states.pt' is missing (partition_count in "
     "'zero_pp_rank_0_mp_rank_00_optim_states.pt' says 2 data-parallel ranks)", 1),
    (3, "zero_pp_rank_1_mp_rank_00_model_states.pt", None, strata.MissingError,
     "'zero_pp_rank_1_mp_rank_00_model_states.pt' is missing", 1),
    (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt", _half, strata.UnsupportedError,
     "'zero_pp_rank_0_mp_rank_00_optim_states.pt': the partition of group 1 is f16, not fp32",
     1),
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_hostile(written, tmp_path, case):
    """Each bad variant refused with its own error class (and CLI exit code), naming the
    file or tensor."""
    stage, name, edit, exc, words, code = HOSTILE[case]
    dirs, _ = written
    d = _copy(dirs[stage], tmp_path / "bad")
    f = os.path.join(d, TAG, name)
    if edit is None:
        os.remove(f)
    else:
        _edit(f, edit)
    _refused(d, exc, words, code)


def test_stage3_shapes_disagree(written, tmp_path):
    """ZeRO-3: param_shapes giving a parameter more elements than the flat groups hold is
    refused as not covered; fewer, as a disagreement."""
    dirs, _ = written
    for n, exc, words in [(47, strata.UnfilledError, "is not covered by the ranks' "
                           "fp32_flat_groups"),
                          (33, strata.MismatchError, "param_shapes account for")]:
        d = _copy(dirs[3], tmp_path / ("s%d" % n))
        f = os.path.join(d, TAG, "zero_pp_rank_0_mp_rank_00_model_states.pt")

        def fn(o):
            o["param_shapes"][1] = {k: (torch.Size([n]) if k == "head.bias" else v)
                                    for k, v in o["param_shapes"][1].items()}
        _edit(f, fn)
        _refused(d, exc, words, 1)


def test_truncated_and_corrupt(written, tmp_path):
    """A truncated optim file and one whose pickle's CRC-32 is wrong: refused naming it."""
    dirs, _ = written
    d = _copy(dirs[2], tmp_path / "trunc")
    f = os.path.join(d, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(f, "r+b") as h:
        h.truncate(os.path.getsize(f) - 100)
    _refused(d, strata.FormatError, "zero_pp_rank_1_mp_rank_00_optim_states.pt", 3)
    d = _copy(dirs[2], tmp_path / "crc")
    f = os.path.join(d, TAG, "mp_rank_00_model_states.pt")
    data = bytearray(open(f, "rb").read())
    at = data.index(b"param_shapes")
    data[at] ^= 0x20
    open(f, "wb").write(bytes(data))
    with pytest.raises(strata.ChecksumError) as ei:
        strata.Checkpoint(d)
    assert "mp_rank_00_model_states.pt" in str(ei.value)


def test_model_parallel_refused(written, tmp_path):
    """A second model-parallel rank's file: UnsupportedError naming it."""
    dirs, _ = written
    d = _copy(dirs[2], tmp_path / "mp")
    shutil.copy(os.path.join(d, TAG, "mp_rank_00_model_states.pt"),
                os.path.join(d, TAG, "mp_rank_01_model_states.pt"))
    _refused(d, strata.UnsupportedError, "second model-parallel rank "
             "('mp_rank_01_model_states.pt')", 1)


def test_latest_naming_nothing(written, tmp_path):
    """`latest` naming a tag that is not there: not a checkpoint strata knows."""
    dirs, _ = written
    d = _copy(dirs[1], tmp_path / "lat")
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step9")
    with pytest.raises(strata.Error):
        strata.Checkpoint(d)
