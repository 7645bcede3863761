"""One process, no process group (scripts, notebooks, conversion tools): save, load and
async_save work as DCP's do, on every dtype strata has, values, Stateful objects, nested
optimizer state, several tiers; values load without running code unless pickle=True is
passed to both save and load."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import strata
import strata.torch as st
from _tensors import DTYPES, bits, same, sample

def test_no_process_group():
    assert not (dist.is_available() and dist.is_initialized())


def test_every_dtype_round_trips_bitwise(tmp_path):
    sd = {str(dt).replace("torch.", ""): sample(dt, (5, 3, 7), i) for i, dt in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    sd["empty"] = torch.zeros(0, 4)
    # float specials, bitwise (NaN payloads, -0.0, inf)
    sd["specials"] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    path = str(tmp_path / "ck")
    stats = st.save(sd, path, step=42)
    assert isinstance(stats, dict)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    st.load(back, path)
    for k in sd:
        assert same(back[k], sd[k]), k
    ck = strata.Checkpoint(path)
    assert ck.committed and ck.step == 42
    names = {t["name"]: t for t in ck.tensors}
    assert names["bfloat16"]["dtype"] == "bf16" and tuple(names["bfloat16"]["shape"]) == (5, 3, 7)
    assert names["float8_e4m3fn"]["dtype"] == "fp8_e4m3"
    assert names["float8_e5m2"]["dtype"] == "fp8_e5m2"


def test_views_with_offsets_round_trip(tmp_path):
    """data_ptr() includes the storage offset: a view into the middle of a storage."""
    base = torch.arange(100, dtype=torch.float32)
    sd = {"mid": base[37:61], "row": base.view(10, 10)[3]}
    path = str(tmp_path / "ck")
    st.save(sd, path)
    back = {"mid": torch.zeros(24), "row": torch.zeros(10)}
    st.load(back, path)
    assert torch.equal(back["mid"], base[37:61]) and torch.equal(back["row"], base[30:40])
    # loading into views writes through to their storage, nowhere else
    target = torch.full((100,), -1.0)
    st.load({"mid": target[10:34]}, path)
    assert torch.equal(target[10:34], base[37:61])
    assert (target[:10] == -1).all() and (target[34:] == -1).all()


def test_values_round_trip(tmp_path):
    values = {"i": -(2 ** 62), "big": 2 ** 80, "f": 0.1, "nan": float("nan"), "s": "héllo\x00",
              "b": b"\x00\xff", "t": True, "fa": False, "none": None,
              "lst": [1, "two", 3.0, None, [4, [5]]], "tup": (1, (2, 3)),
              "d": {"a": {"b": {"c": [1, 2]}}, "k": "v"}, "empty": {}, "el": []}
    path = str(tmp_path / "ck")
    st.save({"v": values, "t": torch.ones(2)}, path)
    back = {"v": {k: None for k in values}, "t": torch.zeros(2)}
    st.load(back, path)
    got = back["v"]
    for k, v in values.items():
        if k == "nan":
            assert got[k] != got[k]
        else:
            assert got[k] == v and type(got[k]) is type(v), (k, got[k], v)


def test_stateful_module_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 13)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    st.save({"model": model, "optim": opt, "step": 1}, path)
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(13, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    model2(torch.randn(5, 13)).sum().backward()
    opt2.step()                         # state allocated, other values
    sd = {"model": model2, "optim": opt2, "step": 0}
    st.load(sd, path)
    assert sd["step"] == 1
    for (k, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert same(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 1e-3
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert same(s1["state"][i][k], s2["state"][i][k]), (i, k)


class Counter:
    """A Stateful of one's own."""

    def __init__(self, n=0):
        self.n = n
        self.history = [n]

    def state_dict(self):
        return {"n": self.n, "history": list(self.history), "buf": torch.full((3,), float(self.n))}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.history = sd["history"]
        self.buf = sd["buf"]


def test_custom_stateful(tmp_path):
    c = Counter(7)
    c.history.append(8)
    st.save({"c": c}, str(tmp_path / "ck"))
    c2 = Counter(0)
    st.load({"c": c2}, str(tmp_path / "ck"))
    assert c2.n == 7 and c2.history == [7, 8] and torch.equal(c2.buf, torch.full((3,), 7.0))


class Evil:
    ran = []

    def __reduce__(self):
        return (Evil.ran.append, ("code ran",))


class Plain:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Plain) and other.x == self.x


def test_pickle_only_when_asked_on_both_sides(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(strata.Error):
        st.save({"obj": Plain(3)}, path)
    st.save({"obj": Plain(3), "evil": Evil()}, path, pickle=True)
    Evil.ran.clear()
    # loading without pickle=True: an error, and nothing of the pickle runs
    with pytest.raises(strata.Error) as ei:
        st.load({"obj": None, "evil": None}, path)
    assert "pickle" in str(ei.value)
    assert Evil.ran == []
    back = {"obj": None}
    st.load(back, path, pickle=True)
    assert back["obj"] == Plain(3)


def test_async_save_one_process(tmp_path):
    t = torch.arange(10000, dtype=torch.float32)
    h = st.async_save({"t": t, "n": 1}, str(tmp_path / "ck"), step=2)
    h.wait_snapshot()
    t.zero_()
    h.wait()
    back = {"t": torch.empty(10000), "n": 0}
    st.load(back, str(tmp_path / "ck"))
    assert torch.equal(back["t"], torch.arange(10000, dtype=torch.float32)) and back["n"] == 1


def test_tiers_save_everywhere_load_from_fastest(tmp_path):
    tiers = [str(tmp_path / "fast"), "file://" + str(tmp_path / "slow")]
    sd = {"w": torch.randn(64, 3)}
    st.save(sd, tiers, step=5)
    for p in (tiers[0], str(tmp_path / "slow")):
        assert strata.probe(p)["committed"]
    back = {"w": torch.zeros(64, 3)}
    assert st.load(back, tiers)["tier"] == 0
    assert torch.equal(back["w"], sd["w"])
    os.remove(os.path.join(tiers[0], "COMMIT"))
    back = {"w": torch.zeros(64, 3)}
    assert st.load(back, tiers)["tier"] == 1
    assert torch.equal(back["w"], sd["w"])


def test_mem_uri(tmp_path):
    import shutil
    import uuid
    name = "strata-test-%s" % uuid.uuid4().hex
    sd = {"w": torch.randn(9, 4)}
    try:
        st.save(sd, "mem://" + name)
        back = {"w": torch.zeros(9, 4)}
        st.load(back, "mem://" + name)
        assert torch.equal(back["w"], sd["w"])
    finally:   # mem:// lives in /dev/shm (strata-<uid>/<name>): do not leave it there
        shm = "/dev/shm/strata-%d/%s" % (os.getuid(), name)
        if os.path.isdir(shm):
            shutil.rmtree(shm)


def test_nested_lists_and_tuples_of_tensors(tmp_path):
    sd = {"layers": [{"w": torch.ones(2)}, {"w": torch.full((2,), 2.0)}],
          "pair": (torch.arange(3), "x")}
    st.save(sd, str(tmp_path / "ck"))
    back = {"layers": [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}],
            "pair": (torch.zeros(3, dtype=torch.int64), None)}
    st.load(back, str(tmp_path / "ck"))
    assert torch.equal(back["layers"][1]["w"], torch.full((2,), 2.0))
    assert torch.equal(back["pair"][0], torch.arange(3)) and back["pair"][1] == "x"


def test_a_committed_checkpoint_is_never_replaced(tmp_path):
    path = str(tmp_path / "ck")
    st.save({"a": torch.ones(2)}, path)
    with pytest.raises(strata.ExistsError):
        st.save({"a": torch.zeros(2)}, path)
    back = {"a": torch.zeros(2)}
    st.load(back, path)
    assert torch.equal(back["a"], torch.ones(2))


def test_replace_a_fixed_path(tmp_path):
    """DCP and torch.save users write to one path ("latest"): a committed checkpoint there is
    never overwritten, unless replace=True swaps the new one in atomically (save and
    async_save); nothing is left beside it."""
    path = str(tmp_path / "latest")
    a = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    st.save(a, path, step=1)
    b = {"w": torch.arange(1000, dtype=torch.float32) * 2, "step": 2}
    with pytest.raises(strata.ExistsError):
        st.save(b, path, step=2)
    st.save(b, path, step=2, replace=True)
    back = {"w": torch.zeros(1000), "step": 0}
    st.load(back, path)
    assert same(back["w"], b["w"]) and back["step"] == 2
    c = {"w": torch.arange(1000, dtype=torch.float32) * 3, "step": 3}
    with st.async_save(c, path, step=3, replace=True) as h:
        h.wait_snapshot()
    st.load(back, path)
    assert same(back["w"], c["w"]) and back["step"] == 3
    assert strata.Checkpoint(path).step == 3
    assert sorted(os.listdir(tmp_path)) == ["latest"]
