"""A path that is not a strata checkpoint is named for what it is, not called "incomplete":
DeepSpeed, torch.save files (zip and
legacy pickle), a directory of strata checkpoints (naming one), an empty or unrelated directory, a missing path - each with its
code (FormatError for a format strata cannot read yet, MissingError for no checkpoint) -
through strata.torch.load, strata.Checkpoint (also incomplete=True) and the export; a real
strata checkpoint without its commit record stays IncompleteError. Detection is by content:
files named like DCP's but holding text are no DCP checkpoint."""

import json
import os
import pickle
import warnings

import pytest
import torch

import strata
import strata.torch as st


def attempts(path):
    """Every way in: (what, callable)."""
    return [("load", lambda: st.load({"w": torch.zeros(6)}, path)),
            ("open", lambda: strata.Checkpoint(path)),
            ("open incomplete", lambda: strata.Checkpoint(path, incomplete=True)),
            ("export", lambda: strata.export_safetensors(path, path + ".out"))]


def refused(path, exc, *words):
    for what, call in attempts(path):
        with pytest.raises(exc) as ei:
            call()
        msg = str(ei.value)
        assert "incomplete" not in msg and "commit record" not in msg, (what, msg)
        for w in words:
            assert w in msg, (what, w, msg)
        assert not os.path.exists(path + ".out")


def dcp_save(state, path):
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=path)


def test_megatron_torch_dist_is_read(tmp_path):
    path = str(tmp_path / "megatron")
    dcp_save({"w": torch.arange(6.0)}, path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    # read now, as Megatron torch_dist (tests/python/test_megatron_source.py), not plain DCP
    assert strata.Checkpoint(path).format == "megatron"
    got = {"w": torch.zeros(6)}
    st.load(got, path)
    assert torch.equal(got["w"], torch.arange(6.0))


def test_deepspeed(tmp_path):
    top = tmp_path / "ds"
    (top / "global_step5").mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, str(top / "global_step5" /
                                                     "mp_rank_00_model_states.pt"))
    (top / "latest").write_text("global_step5")
    refused(str(top), strata.FormatError, "DeepSpeed checkpoint")
    refused(str(top / "global_step5"), strata.FormatError, "DeepSpeed checkpoint")


def test_torch_save_files(tmp_path):
    """torch.save files are read (test_torchsave.py); what is left is named: the legacy
    format (UnsupportedError), a directory of them without pytorch_model.bin, a zip that is
    not torch.save's, a bare pickle."""
    zipped, legacy = str(tmp_path / "model.pt"), str(tmp_path / "legacy.pt")
    torch.save({"w": torch.ones(2)}, zipped)
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert strata.Checkpoint(zipped).format == "torch.save"
    refused(legacy, strata.UnsupportedError, "is in torch.save's legacy format")
    hf = tmp_path / "hf"
    hf.mkdir()
    torch.save({"w": torch.ones(2)}, str(hf / "pytorch_model.bin"))
    (hf / "config.json").write_text("{}")
    assert strata.Checkpoint(str(hf)).format == "torch.save"
    other = tmp_path / "other"
    other.mkdir()
    torch.save({"w": torch.ones(2)}, str(other / "weights.pt"))
    refused(str(other), strata.FormatError, "holds PyTorch torch.save files (1, such as "
            "weights.pt) but neither pytorch_model.bin nor pytorch_model.bin.index.json")
    import zipfile
    with zipfile.ZipFile(str(tmp_path / "x.pt"), "w") as z:
        z.writestr("a/b.txt", "not torch")
    refused(str(tmp_path / "x.pt"), strata.FormatError, "a zip archive without a <dir>/data.pkl")
    (tmp_path / "p.pt").write_bytes(pickle.dumps({"w": 1}, protocol=4))
    refused(str(tmp_path / "p.pt"), strata.FormatError, "is a bare pickle")


def test_names_alone_are_not_enough(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ".metadata").write_text("not a pickle")
    (fake / "__0_0.distcp").write_text("x")
    (fake / "weights.pt").write_text("text, not torch.save")
    refused(str(fake), strata.MissingError, "is not a checkpoint: it holds no strata files")


def test_directory_of_checkpoints_empty_and_missing(tmp_path):
    parent = tmp_path / "run"
    for step in (1, 2):
        st.save({"w": torch.arange(6.0)}, str(parent / ("step-%d" % step)), step=step)
    refused(str(parent), strata.MissingError, "is a directory of checkpoints, not one (2 "
            "committed under it); did you mean %s/step-2?" % parent, "strata ls")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(str(empty), strata.MissingError, "is an empty directory, not a checkpoint")
    refused(str(tmp_path / "absent"), strata.MissingError, "No such file or directory")


def test_incomplete_strata_checkpoint_stays_incomplete(tmp_path):
    path = str(tmp_path / "ck")
    st.save({"w": torch.arange(6.0)}, path)
    os.unlink(os.path.join(path, "COMMIT"))
    with pytest.raises(strata.IncompleteError, match="no commit record"):
        st.load({"w": torch.zeros(6)}, path)
    # a directory of checkpoints none of which is committed
    with pytest.raises(strata.MissingError, match="none of the 1 under it is committed"):
        strata.Checkpoint(str(tmp_path))
