"""Per-rank values are never lost.

- A value that differs across ranks under one key, without the marker, fails the save on
  every rank with an error naming the key, and commits nothing.
- Marked with strata.torch.per_rank(...), each rank gets its own back - tensors (even of
  different shapes on different ranks), values, nested states, rng_state().
- On fewer ranks, rank r gets rank r's; on more ranks, a rank that saved nothing gets an
  error naming the key, never another rank's value.
"""

import os

import pytest
import torch

import _dist


def committed(path):
    import strata
    if not os.path.exists(path):
        return False
    try:
        return bool(strata.probe(path)["committed"])
    except strata.Error:
        return False


def unmarked(base):
    """Each case: a state dict where one key differs across ranks, without per_rank."""
    import torch.distributed as dist
    import strata
    import strata.torch as st
    rank = dist.get_rank()
    cases = {
        "tensor": ({"same": torch.ones(4), "w": torch.full((3,), float(rank))}, "w"),
        "nested_tensor": ({"model": {"a": torch.ones(2), "b": torch.arange(3) + rank}},
                          "model.b"),
        "value": ({"same": torch.ones(4), "pos": 17 + rank}, "pos"),
        "nested_value": ({"loader": {"epoch": 1, "offset": [rank, 2]}, "t": torch.ones(1)},
                         "loader"),
    }
    torch.manual_seed(rank)         # the "rng" case: every rank its own generator state
    cases["rng"] = ({"rng": {"cpu": torch.get_rng_state()}}, "rng.cpu")
    out = {}
    for name, (sd, key) in cases.items():
        path = os.path.join(base, name)
        try:
            st.save(sd, path)
            out[name] = (None, key, committed(path))
        except strata.Error as e:
            dist.barrier()
            out[name] = ((type(e).__name__, str(e)), key, committed(path))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_differing_value_without_marker_fails_naming_the_key(tmp_path, world):
    res = _dist.run(unmarked, world, str(tmp_path), timeout=120)
    problems = []
    for rank, r in enumerate(res):
        for name, (err, key, was_committed) in r.items():
            if err is None:
                problems.append("%s: rank %d saved a value differing across ranks under %r"
                                % (name, rank, key))
                continue
            cls, msg = err
            if cls != "InvalidArgumentError":
                problems.append("%s: rank %d raised %s (expected InvalidArgumentError): %s"
                                % (name, rank, cls, msg))
            if key not in msg:
                problems.append("%s: rank %d's error does not name %r: %s"
                                % (name, rank, key, msg))
            if was_committed:
                problems.append("%s: a checkpoint was committed" % name)
    for name in res[0]:
        if committed(os.path.join(str(tmp_path), name)):
            problems.append("%s: committed after the failed save" % name)
    assert not problems, "\n".join(problems)


def marked_save(path):
    import torch.distributed as dist
    import strata.torch as st
    rank = dist.get_rank()
    torch.manual_seed(50 + rank)
    sd = {
        "shared": torch.arange(6, dtype=torch.float32),
        "t": st.per_rank(torch.arange(rank + 2, dtype=torch.int32) * (rank + 1)),
        "pos": st.per_rank({"rank": rank, "name": "r%d" % rank, "offsets": [rank, rank * 10]}),
        "nested": st.per_rank({"buf": torch.full((2, 3), float(rank)), "n": rank}),
        "rng": st.rng_state(),
        "step": 9,
    }
    st.save(sd, path, step=9)
    return torch.get_rng_state()


def marked_load(path, saved_ranks):
    """Loads on this run's ranks; returns (own values or None, error or None)."""
    import torch.distributed as dist
    import strata
    import strata.torch as st
    rank = dist.get_rank()
    torch.manual_seed(12345)
    # per-rank tensors are loaded into tensors of this rank's shape (a rank that saved nothing
    # gets an error before any shape matters)
    n = rank + 2 if rank < saved_ranks else 2
    sd = {
        "shared": torch.zeros(6),
        "t": st.per_rank(torch.zeros(n, dtype=torch.int32)),
        "pos": st.per_rank(None),
        "nested": st.per_rank({"buf": torch.zeros(2, 3), "n": -1}),
        "rng": st.rng_state(),
        "step": 0,
    }
    try:
        st.load(sd, path)
    except strata.Error as e:
        return None, (type(e).__name__, str(e))
    st.set_rng_state(sd["rng"])
    val = lambda x: x.value if isinstance(x, st.PerRank) else x   # noqa: E731
    return {"shared": sd["shared"], "t": val(sd["t"]), "pos": val(sd["pos"]),
            "nested": val(sd["nested"]), "rng": torch.get_rng_state(), "step": sd["step"]}, None


def check_own(rank, got, rng):
    problems = []
    if not torch.equal(got["shared"], torch.arange(6, dtype=torch.float32)):
        problems.append("rank %d: shared is %s" % (rank, got["shared"]))
    want_t = torch.arange(rank + 2, dtype=torch.int32) * (rank + 1)
    if not torch.equal(got["t"], want_t):
        problems.append("rank %d: t is %s, this rank saved %s" % (rank, got["t"], want_t))
    want_pos = {"rank": rank, "name": "r%d" % rank, "offsets": [rank, rank * 10]}
    if got["pos"] != want_pos:
        problems.append("rank %d: pos is %r, this rank saved %r" % (rank, got["pos"], want_pos))
    nb = got["nested"]
    if nb["n"] != rank or not torch.equal(nb["buf"], torch.full((2, 3), float(rank))):
        problems.append("rank %d: nested is %r" % (rank, nb))
    if not torch.equal(got["rng"], rng):
        problems.append("rank %d: the RNG state is not the one this rank saved" % rank)
    if got["step"] != 9:
        problems.append("rank %d: step is %r" % (rank, got["step"]))
    return problems


@pytest.mark.slow
def test_marked_values_come_back_to_their_rank(tmp_path):
    path = str(tmp_path / "ck")
    rngs = _dist.run(marked_save, 3, path, timeout=120)
    assert committed(path)
    problems = []
    # the same ranks
    for rank, (got, err) in enumerate(_dist.run(marked_load, 3, path, 3, timeout=120)):
        if err:
            problems.append("3 -> 3: rank %d raised %s: %s" % (rank, *err))
        else:
            problems.extend("3 -> 3: " + p for p in check_own(rank, got, rngs[rank]))
    # fewer ranks: rank r gets rank r's
    for rank, (got, err) in enumerate(_dist.run(marked_load, 2, path, 3, timeout=120)):
        if err:
            problems.append("3 -> 2: rank %d raised %s: %s" % (rank, *err))
        else:
            problems.extend("3 -> 2: " + p for p in check_own(rank, got, rngs[rank]))
    # more ranks: rank 3 saved nothing - an error naming a per-rank key, never someone else's
    res = _dist.run(marked_load, 4, path, 3, timeout=120)
    got3, err3 = res[3]
    if err3 is None:
        problems.append("3 -> 4: rank 3 loaded per-rank values it never saved: %r" % (got3,))
    elif not any(k in err3[1] for k in ("t:", "'t'", "pos", "nested", "rng")):
        problems.append("3 -> 4: rank 3's error names no per-rank key: %s: %s" % err3)
    for rank, (got, err) in enumerate(res[:3]):
        if err is None:
            problems.extend("3 -> 4: " + p for p in check_own(rank, got, rngs[rank]))
    assert not problems, "\n".join(problems)


def test_per_rank_in_one_process(tmp_path):
    """Without a process group the marker changes nothing visible: the value comes back."""
    import strata.torch as st
    path = str(tmp_path / "ck")
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    st.save({"pos": st.per_rank({"a": 1}), "rng": st.rng_state(),
             "t": st.per_rank(torch.arange(3))}, path)
    torch.rand(10)
    sd = {"pos": st.per_rank(None), "rng": st.rng_state(), "t": st.per_rank(torch.zeros(3, dtype=torch.int64))}
    st.load(sd, path)
    st.set_rng_state(sd["rng"])
    assert torch.equal(torch.get_rng_state(), rng)
    assert sd["pos"].value == {"a": 1}
    assert torch.equal(sd["t"].value, torch.arange(3))
