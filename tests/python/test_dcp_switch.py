"""Switching a DCP training loop to strata changes its import line and nothing else (issue
30): _dcp_loop.py, written for torch.distributed.checkpoint (FSDP2 on gloo, a Stateful
AppState, async_save with the previous Future waited for, load to resume), is run as it is
and with `import torch.distributed.checkpoint as dcp` replaced by `import strata.torch as
dcp`: 2 processes train and save, then 3 resume from the last save (resharded) and go on.
Both runs give the same losses and the same final parameters, bitwise; the DCP run wrote
DCP's checkpoints (.metadata), the strata one strata's (COMMIT, no .metadata)."""

import difflib
import os

import pytest
import torch

import _launch
import strata

HERE = os.path.dirname(os.path.abspath(__file__))
DCP_IMPORT = "import torch.distributed.checkpoint as dcp\n"
STRATA_IMPORT = "import strata.torch as dcp\n"


def run(script, root, first, last, world, out, logs):
    procs = _launch.launch([script, root, str(first), str(last), out], world,
                           log=lambda r: os.path.join(logs, "%s-%d-%d.log"
                                                      % (os.path.basename(root), first, r)))
    rcs = _launch.wait(procs, timeout=300)
    if any(rc != 0 for rc in rcs):
        text = "".join(open(os.path.join(logs, f)).read()[-3000:]
                       for f in sorted(os.listdir(logs)) if f.startswith(os.path.basename(root)))
        pytest.fail("%s %d..%d on %d: exit codes %s\n%s" % (script, first, last, world, rcs, text))
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_dcp_loop_runs_on_strata_unchanged(tmp_path, figures):
    src = open(os.path.join(HERE, "_dcp_loop.py")).read()
    assert src.count(DCP_IMPORT) == 1
    variants = {"dcp": src, "strata": src.replace(DCP_IMPORT, STRATA_IMPORT)}
    changed = [l for l in difflib.unified_diff(src.splitlines(), variants["strata"].splitlines(),
                                                lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert changed == ["-" + DCP_IMPORT.strip(), "+" + STRATA_IMPORT.strip()]
    figures("lines a DCP loop changes to switch", "%d" % (len(changed) // 2))
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    got = {}
    for name, text in variants.items():
        script = str(tmp_path / ("loop_%s.py" % name))
        with open(script, "w") as f:
            f.write(text)
        root = str(tmp_path / name)
        a = run(script, root, 0, 6, 2, str(tmp_path / (name + "_a.pt")), logs)
        b = run(script, root, 6, 10, 3, str(tmp_path / (name + "_b.pt")), logs)
        got[name] = (a, b)
        for step in (1, 3, 5, 7, 9):
            d = os.path.join(root, "step-%d" % step)
            if name == "dcp":
                assert os.path.exists(os.path.join(d, ".metadata")), d
            else:
                assert strata.probe(d)["committed"], d
                assert os.path.exists(os.path.join(d, "COMMIT"))
                assert not os.path.exists(os.path.join(d, ".metadata"))
    for part in (0, 1):
        want, have = got["dcp"][part], got["strata"][part]
        assert have["losses"] == want["losses"], part
        assert set(have["params"]) == set(want["params"])
        for k, v in want["params"].items():
            assert torch.equal(have["params"][k], v), (part, k)
    # the resumed run went on from where the first stopped (its loss is not the first's)
    assert len(got["strata"][1]["losses"]) == 4
