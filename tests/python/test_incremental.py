"""Incremental saves through CheckpointManager: a LoRA-style state (a frozen base, small
adapters and their AdamW moments) saved 20 times - bytes written per save from the files on
disk, every step loaded bitwise and verified, keep 3 removing bases that newer steps refer
to; full_every; dense training writing everything; incremental=False; kill -9 during an
incremental save."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn

import strata
import strata.torch as st


class Lora(nn.Module):
    def __init__(self, d=256, r=4):
        super().__init__()
        self.base = nn.Linear(d, d)          # frozen: 257 KiB of f32
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, d) * 0.01)
        self.b = nn.Parameter(torch.zeros(d, r))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def train_step(m, opt, seed):
    torch.manual_seed(seed)
    x = torch.randn(8, 256)
    loss = m(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()



def own_bytes(path):
    """Bytes of the data files the save wrote itself (data-*.bin), and the ref-* count."""
    names = os.listdir(path)
    own = sum(os.path.getsize(os.path.join(path, n)) for n in names if n.startswith("data-"))
    return own, sum(n.startswith("ref-") for n in names)


def state_of(m, opt, step):
    return {"model": m, "optim": opt, "step": step}


def values(m, opt):
    out = [t.detach().clone() for t in m.state_dict().values()]
    for s in opt.state_dict()["state"].values():
        out += [v.clone() for v in s.values() if torch.is_tensor(v)]
    return out


def fresh():
    torch.manual_seed(12345)
    m = Lora()
    opt = torch.optim.AdamW([m.a, m.b], lr=1e-2)
    train_step(m, opt, 0)          # the moments exist from now on
    return m, opt


def test_lora_twenty_saves_keep_3(tmp_path):
    root = str(tmp_path / "ck")
    mgr = st.CheckpointManager(root, keep=3, pool_bytes=8 << 20, full_every=100)
    m, opt = fresh()
    want = {}
    frozen = sum(t.numel() * 4 for t in m.base.state_dict().values())
    for step in range(20):
        train_step(m, opt, step + 1)
        h = mgr.save(step, state_of(m, opt, step))
        h.wait()
        want[step] = values(m, opt)
        p = mgr.path(step)
        ck = strata.Checkpoint(p)
        own, nref = own_bytes(p)
        if step == 0:
            assert ck.base is None and nref == 0
            assert ck.written_bytes == ck.data_bytes
        else:
            assert ck.base == "step-%08d" % (step - 1)
            assert nref == 1
            # the frozen weight and bias are not written: only adapters, moments, values
            assert ck.written_bytes == ck.data_bytes - frozen
            assert own < frozen / 4, (own, frozen)
        ck.verify()
    mgr.close()
    # keep 3: steps 0..16 are gone, the bases 17..19 refer to among them
    assert sorted(os.listdir(root)) == ["step-%08d" % s for s in (17, 18, 19)]
    for step in (17, 18, 19):
        m2, opt2 = fresh()
        sd = state_of(m2, opt2, -1)
        st.load(sd, mgr.path(step))
        assert sd["step"] == step
        got = values(m2, opt2)
        assert len(got) == len(want[step])
        assert all(torch.equal(a, b) for a, b in zip(got, want[step])), step
        strata.Checkpoint(mgr.path(step)).verify()


def test_every_step_loads_bitwise(tmp_path):
    root = str(tmp_path / "ck")
    mgr = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, async_save=False)
    m, opt = fresh()
    want = {}
    for step in range(20):
        train_step(m, opt, step + 1)
        mgr.save(step, state_of(m, opt, step))
        want[step] = values(m, opt)
    for step in range(20):
        m2, opt2 = fresh()
        sd = state_of(m2, opt2, -1)
        st.load(sd, mgr.path(step))
        assert all(torch.equal(a, b) for a, b in zip(values(m2, opt2), want[step])), step
        strata.Checkpoint(mgr.path(step)).verify()


def test_full_every(tmp_path):
    mgr = st.CheckpointManager(str(tmp_path / "ck"), keep=0, pool_bytes=8 << 20,
                               full_every=3, async_save=False)
    m, opt = fresh()
    bases = []
    for step in range(9):
        train_step(m, opt, step + 1)
        mgr.save(step, state_of(m, opt, step))
        bases.append(strata.Checkpoint(mgr.path(step)).base)
    full = [s for s, b in enumerate(bases) if b is None]
    assert full == [0, 4, 8], bases


def test_base_missing_on_one_tier(tmp_path):
    """A step one tier lacks (failed there, or removed) is no base: the next save is a full
    one on both tiers rather than failing on both (and every save after it)."""
    mgr = st.CheckpointManager([str(tmp_path / "a"), str(tmp_path / "b")], keep=0,
                               pool_bytes=8 << 20, async_save=False)
    m, opt = fresh()
    for step in range(3):
        train_step(m, opt, step + 1)
        if step == 1:
            shutil.rmtree(mgr.path(0, 1))          # tier b lost step 0
        mgr.save(step, state_of(m, opt, step))
        want = values(m, opt)
        for tier in (0, 1):
            ck = strata.Checkpoint(mgr.path(step, tier))
            assert ck.base == {0: None, 1: None, 2: "step-00000001"}[step], (step, tier)
            m2, opt2 = fresh()
            st.load(state_of(m2, opt2, -1), mgr.path(step, tier))
            assert all(torch.equal(a, b) for a, b in zip(values(m2, opt2), want))
    mgr.close()


def test_dense_writes_everything_and_switch_off(tmp_path):
    for incremental in (True, False):
        root = str(tmp_path / ("ck%d" % incremental))
        mgr = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, async_save=False,
                                   incremental=incremental)
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            torch.manual_seed(step)
            m(torch.randn(4, 64)).pow(2).mean().backward()
            opt.step()
            mgr.save(step, {"model": m, "optim": opt})
            ck = strata.Checkpoint(mgr.path(step))
            assert ck.written_bytes == ck.data_bytes
            assert ck.base is None      # nothing referred to: the metadata names no base
            assert own_bytes(mgr.path(step))[1] == 0


KILLED = textwrap.dedent("""
    import sys, torch, strata.torch as st
    root = sys.argv[1]
    mgr = st.CheckpointManager(root, keep=0, pool_bytes=32 << 20)
    torch.manual_seed(0)
    frozen = torch.randn(4 << 20)              # 16 MiB, never changes
    ad = torch.zeros(1 << 16)
    step = 0
    while True:
        ad.fill_(step)
        h = mgr.save(step, {"frozen": frozen, "ad": ad, "step": step})
        h.wait()
        print(step, flush=True)
        step += 1
""")


def test_kill_during_incremental_saves(tmp_path):
    root = str(tmp_path / "ck")
    script = tmp_path / "saver.py"
    script.write_text(KILLED)
    torch.manual_seed(0)
    frozen = torch.randn(4 << 20)
    for delay in (0.3, 0.7, 1.1):
        p = subprocess.Popen([sys.executable, str(script), root], stdout=subprocess.PIPE)
        first = p.stdout.readline()            # one save committed at least
        assert first
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        committed = [d for d in os.listdir(root)
                     if strata.probe(os.path.join(root, d))["committed"]]
        assert committed
        for d in committed:
            sd = {"frozen": torch.zeros(4 << 20), "ad": torch.zeros(1 << 16), "step": -1}
            st.load(sd, os.path.join(root, d))
            assert torch.equal(sd["frozen"], frozen), d
            assert torch.equal(sd["ad"], torch.full((1 << 16,), float(sd["step"]))), d
            strata.Checkpoint(os.path.join(root, d)).verify()
        strata.retain(root, 2)                 # the killed save's leftovers go too
        shutil_left = [d for d in os.listdir(root)
                       if not strata.probe(os.path.join(root, d))["committed"]]
        assert shutil_left == []


# ---- unchanged tensors not even read: frozen= and the _version rule ----------------------

UNREADABLE = textwrap.dedent("""
    # A frozen tensor in pages made PROT_NONE after the first save: a save that read it (to
    # hash or copy it) would die of SIGSEGV. save and async_save with frozen= refer to the
    # base's bytes instead; the checkpoints load the frozen values and the new adapters.
    import ctypes, mmap, sys, torch, strata, strata.torch as st
    root = sys.argv[1]
    n = 1 << 20
    mm = mmap.mmap(-1, 4 * n)
    frozen = torch.frombuffer(mm, dtype=torch.float32)
    frozen.copy_(torch.arange(n, dtype=torch.float32))
    ad = torch.zeros(4096)
    st.save({"frozen": frozen, "ad": ad}, root + "/s0", incremental=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(addr, 4 * n, 0) == 0          # PROT_NONE
    ad.fill_(1)
    s1 = st.save({"frozen": frozen, "ad": ad}, root + "/s1", base="s0", incremental=True,
                 frozen=["frozen"])
    ad.fill_(2)
    h = st.async_save({"frozen": frozen, "ad": ad}, root + "/s2", base="s1",
                      incremental=True, frozen=lambda k, t: k == "frozen")
    h.wait_snapshot()
    s2 = h.wait()
    assert libc.mprotect(addr, 4 * n, 3) == 0          # readable again
    for p, v, s in ((root + "/s1", 1, s1), (root + "/s2", 2, s2)):
        assert s["bytes"] == 4096 * 4, s
        sd = {"frozen": torch.zeros(n), "ad": torch.zeros(4096)}
        st.load(sd, p)
        assert torch.equal(sd["frozen"], torch.arange(n, dtype=torch.float32)), p
        assert torch.equal(sd["ad"], torch.full((4096,), float(v))), p
        strata.Checkpoint(p).verify()
    print("ok")
""")


def test_frozen_bytes_not_read(tmp_path):
    script = tmp_path / "unreadable.py"
    script.write_text(UNREADABLE)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


class LoraBuf(Lora):
    """Lora with a buffer that changes every step (a buffer is never a frozen parameter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(64))


def test_frozen_true_marks_frozen_params_only(tmp_path):
    """frozen=True marks the parameters with requires_grad=False, and only them: the
    adapters, the optimizer's moments and a changing buffer are written. The mark is a
    promise, not checked: a frozen weight changed through .data after the base was saved is
    saved as the base's values (which shows its bytes were not read)."""
    mgr = st.CheckpointManager(str(tmp_path / "ck"), keep=0, pool_bytes=8 << 20, frozen=True)
    torch.manual_seed(3)
    m = LoraBuf()
    opt = torch.optim.AdamW([m.a, m.b], lr=1e-2)
    frozen = sum(t.numel() * 4 for t in m.base.state_dict().values())
    w0 = m.base.weight.detach().clone()
    for step in range(3):
        train_step(m, opt, step + 1)
        m.seen.add_(1)
        if step == 2:
            m.base.weight.data.add_(1)       # a broken promise
        mgr.save(step, state_of(m, opt, step)).wait()
        want = values(m, opt)
        ck = strata.Checkpoint(mgr.path(step))
        assert ck.written_bytes == (ck.data_bytes if step == 0 else ck.data_bytes - frozen)
        m2, opt2 = fresh()
        m2 = LoraBuf()
        opt2 = torch.optim.AdamW([m2.a, m2.b], lr=1e-2)
        train_step(m2, opt2, 0)
        st.load(state_of(m2, opt2, -1), mgr.path(step))
        got = values(m2, opt2)
        names = list(m.state_dict())
        for i, (a, b) in enumerate(zip(got, want)):
            if step == 2 and i < len(names) and names[i] == "base.weight":
                assert torch.equal(a, w0) and not torch.equal(a, b)
            else:
                assert torch.equal(a, b), (step, i)
        ck.verify()
    mgr.close()


def test_frozen_names_and_fallback(tmp_path):
    """frozen= by names and prefixes; a name that matches nothing is refused, nothing
    written. Where the base does not hold the marked tensor as it is now (another shape,
    another dtype, a key it lacks), the mark is ignored: the changed values are written and
    load (trusting them would load the base's)."""
    r = str(tmp_path)
    st.save({"m": {"w": torch.zeros(10), "v": torch.zeros(10), "u": torch.zeros(4)}},
            r + "/b", incremental=True)
    with pytest.raises(strata.InvalidArgumentError, match="'m.x'"):
        st.save({"m": {"w": torch.zeros(10)}}, r + "/bad", base="b", incremental=True,
                frozen=["m.w", "m.x"])
    assert not os.path.exists(r + "/bad")
    with pytest.raises(strata.InvalidArgumentError, match="frozen"):
        st.save({"m": {"w": torch.zeros(10)}}, r + "/bad", frozen=[3])
    new = {"m": {"w": torch.ones(12),                      # another shape
                 "v": torch.ones(10, dtype=torch.float64),  # another dtype
                 "u": torch.zeros(4),                       # as the base: referred to
                 "z": torch.ones(3)}}                       # not in the base
    s = st.save(new, r + "/n", base="b", incremental=True, frozen=["m"])
    assert s["bytes"] == 12 * 4 + 10 * 8 + 3 * 4
    got = {"m": {"w": torch.zeros(12), "v": torch.zeros(10, dtype=torch.float64),
                 "u": torch.ones(4), "z": torch.zeros(3)}}
    st.load(got, r + "/n")
    for k in new["m"]:
        assert torch.equal(got["m"][k], new["m"][k]), k
    strata.Checkpoint(r + "/n").verify()


def _mgr_twice(tmp_path, change, trust=True, other=None):
    """A manager (trust_version) saves {"w", "ad"} as step 0, change(sd) runs, the manager
    saves step 1: returns what step 1 loads and the values of sd after change."""
    root = str(tmp_path / "ck")
    mgr = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, async_save=False,
                               trust_version=trust)
    sd = {"w": torch.arange(1 << 16, dtype=torch.float32), "ad": torch.zeros(16)}
    mgr.save(0, sd)
    sd = change(sd) or sd
    if other is not None:
        other(root)
    sd["ad"].add_(1)
    mgr.save(2, sd)
    mgr.close()
    got = {"w": torch.zeros(1 << 16), "ad": torch.zeros(16)}
    st.load(got, mgr.path(2))
    strata.Checkpoint(mgr.path(2)).verify()
    return got, sd, strata.Checkpoint(mgr.path(2))


def _through_data(sd):
    sd["w"].data[5] = -1.0


def _through_storage(sd):
    src = sd["w"].clone()
    src[5] = -1.0
    sd["w"].untyped_storage().copy_(src.untyped_storage())   # a storage has no counter


@pytest.mark.parametrize("write", [_through_data, _through_storage])
def test_version_rule_skips_unmoved(tmp_path, write):
    """trust_version: a tensor whose _version has not moved since the manager's last save is
    referred to without being read - so a write its counter does not see (through .data,
    through untyped_storage().copy_()) is saved as the base's bytes: those are the rule's
    documented blind spots (the manager's docstring names each), and why it is opt-in.
    Without the opt-in the same write is hashed, found changed and written."""
    assert {"untyped_storage()", ".data"} <= set(
        w for w in (st.CheckpointManager.__doc__ or "").replace(",", " ").split()
        if w in ("untyped_storage()", ".data"))
    for trust in (True, False):
        got, sd, ck = _mgr_twice(tmp_path / str(trust), write, trust)
        assert torch.equal(got["ad"], sd["ad"])
        if trust:
            assert got["w"][5] == 5.0 and ck.written_bytes == 16 * 4
        else:
            assert torch.equal(got["w"], sd["w"]) and ck.written_bytes == ck.data_bytes


def _inplace(sd):
    with torch.no_grad():
        sd["w"][5] = -1.0                       # in place, through indexing: counted


def _through_view(sd):
    sd["w"].detach().view(256, 256)[0, 5] = -1.0   # detach() and views share the counter


def _set_(sd):
    sd["w"].set_(torch.full((1 << 16,), -1.0).untyped_storage())


def _new_tensor(sd):
    sd["w"] = torch.arange(1 << 16, dtype=torch.float32).neg_()   # same shape, new tensor


def _loaded(sd):
    # strata's load writes through the address: it moves the counter of what it fills
    p = str(sd["_dir"]) + "/other"
    st.save({"w": torch.full((1 << 16,), -1.0)}, p)
    st.load({"w": sd["w"]}, p)


def _inference(sd):
    with torch.inference_mode():
        w = torch.arange(1 << 16, dtype=torch.float32)
    sd["w"] = w                                # no version counter: never trusted


@pytest.mark.parametrize("change", [_inplace, _through_view, _set_, _new_tensor, _loaded])
def test_version_rule_sees_changes(tmp_path, change):
    """Every change the rule accounts for, each of which would load the base's values if the
    rule trusted the tensor: the new values are written and load."""
    def run(sd):
        sd["_dir"] = tmp_path
        out = change(sd)
        sd.pop("_dir")
        return out
    got, sd, ck = _mgr_twice(tmp_path, run)
    assert not torch.equal(sd["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert torch.equal(got["w"], sd["w"])
    assert ck.written_bytes == ck.data_bytes


def test_version_rule_inference_and_other_base(tmp_path):
    """An inference tensor (no counter) is never trusted, even changed in place in inference
    mode; and a base that is not the manager's own last save (another manager saved a newer
    step with other values in between) is not trusted either, though the counter did not
    move."""
    def inf(sd):
        _inference(sd)
    root = str(tmp_path / "a")
    mgr = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, async_save=False,
                               trust_version=True)
    sd = {"w": None, "ad": torch.zeros(16)}
    inf(sd)
    mgr.save(0, sd)
    with torch.inference_mode():
        sd["w"][5] = -1.0
    mgr.save(1, sd)
    got = {"w": torch.zeros(1 << 16), "ad": torch.zeros(16)}
    st.load(got, mgr.path(1))
    assert got["w"][5] == -1.0
    mgr.close()

    def other(root):
        m2 = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, async_save=False)
        m2.save(1, {"w": torch.full((1 << 16,), -2.0), "ad": torch.zeros(16)})
        m2.close()
    got, sd, ck = _mgr_twice(tmp_path / "b", lambda sd: None, other=other)
    assert torch.equal(got["w"], sd["w"])     # step 1's -2.0s would be wrong
    assert ck.written_bytes == ck.data_bytes


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, os.environ.get("BUILD", "build"),
                                                  "strata")


def test_ls_and_inspect_count_linked_bytes(tmp_path):
    """strata ls: per checkpoint, the bytes of its files, those its save wrote and those it
    links from its base (ref-*.bin); inspect: the linked files' bytes and each one marked."""
    r = str(tmp_path)
    frozen = torch.arange(1 << 18, dtype=torch.float32)       # 1 MiB
    st.save({"f": frozen, "a": torch.zeros(1024)}, r + "/s0", incremental=True)
    st.save({"f": frozen, "a": torch.ones(1024)}, r + "/s1", base="s0", incremental=True,
            frozen=["f"])
    out = subprocess.run([STRATA, "ls", r], capture_output=True, text=True, check=True).stdout
    rows = {ln.split()[-1]: ln.split() for ln in out.splitlines()[1:]}
    sizes = {d: {n: os.path.getsize(os.path.join(r, d, n)) for n in os.listdir(os.path.join(r, d))}
             for d in ("s0", "s1")}
    for d in ("s0", "s1"):
        state, total, written, linked = rows[os.path.join(r, d)][:4]
        refs = sum(b for n, b in sizes[d].items() if n.startswith("ref-"))
        assert state == "committed"
        assert int(total) == sum(sizes[d].values())
        assert int(linked) == refs and (refs > 0) == (d == "s1")
        assert int(written) == int(total) - refs
    assert int(rows[os.path.join(r, "s1")][3]) == sizes["s0"]["data-000000.bin"]
    out = subprocess.run([STRATA, "inspect", r + "/s1"], capture_output=True, text=True,
                         check=True).stdout
    assert "(%d bytes of files, stored once)" % sizes["s0"]["data-000000.bin"] in out
    assert " bytes (linked)" in out
    j = json.loads(subprocess.run([STRATA, "inspect", "--json", r + "/s1"], capture_output=True,
                                  text=True, check=True).stdout)
    assert j["linked_file_bytes"] == sizes["s0"]["data-000000.bin"] and j["base"] == "s0"


def dist_lora(root):
    """Rank's part of test_process_group_incremental: a frozen [512, 256] weight and a
    [256] bias (replicated), an adapter [8, 256] that changes, all as DTensors sharded by
    rows but the bias, saved 6 times through a CheckpointManager on the default group;
    returns what rank 0 saw on disk and each step's values, and whether every step loads
    bitwise on the 2 ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    w_full, bias = torch.randn(512, 256), torch.randn(256)
    w = distribute_tensor(w_full, mesh, [Shard(0)])
    mgr = st.CheckpointManager(root, keep=0, pool_bytes=8 << 20, full_every=100)
    assert mgr._group() is not None and mgr._group().size == 2
    want = {}
    for step in range(6):
        torch.manual_seed(100 + step)
        a_full = torch.randn(8, 256)
        sd = {"w": w, "bias": bias, "a": distribute_tensor(a_full, mesh, [Shard(0)]),
              "step": step}
        mgr.save(step, sd).wait()
        want[step] = a_full
    mgr.close()
    disk = {}
    for step in range(6):
        p = mgr.path(step)
        names = os.listdir(p)
        refs = [n for n in names if n.startswith("ref-")]
        ck = strata.Checkpoint(p)
        disk[step] = (ck.base, ck.written_bytes, ck.data_bytes, len(refs),
                      min((os.stat(os.path.join(p, n)).st_nlink for n in refs), default=0),
                      own_bytes(p)[0])
    loads = []
    for step in range(6):
        sd = {"w": distribute_tensor(torch.zeros(512, 256), mesh, [Shard(0)]),
              "bias": torch.zeros(256), "a": distribute_tensor(torch.zeros(8, 256), mesh,
                                                               [Shard(0)]), "step": -1}
        st.load(sd, mgr.path(step))
        loads.append(torch.equal(sd["w"].full_tensor(), w_full) and
                     torch.equal(sd["bias"], bias) and
                     torch.equal(sd["a"].full_tensor(), want[step]) and sd["step"] == step)
    return (disk if dist.get_rank() == 0 else None), want, w_full, bias, loads


def test_process_group_incremental(tmp_path):
    """CheckpointManager with a process group (2 gloo ranks) saves incrementally: from the
    second save on, each rank's rows of the frozen weight (and the bias, in one of them)
    are its base's data file, hard-linked; only the adapter is written; every step loads
    bitwise on 2 ranks and on 1 process, and verifies."""
    import _dist
    root = str(tmp_path / "ck")
    res = _dist.run(dist_lora, 2, root, timeout=240)
    disk, want, w_full, bias = res[0][:4]
    frozen = (512 * 256 + 256) * 4
    for rank, r in enumerate(res):
        assert all(r[4]), "rank %d: steps that do not load bitwise: %s" % (rank, r[4])
    for step in range(6):
        base, written, data, nref, nlink, own = disk[step]
        if step == 0:
            assert base is None and nref == 0 and written == data, disk[step]
        else:
            assert base == "step-%08d" % (step - 1), disk[step]
            assert nref == 2 and nlink >= 2, disk[step]       # each rank's file, linked
            assert written == data - frozen, disk[step]
            assert own < frozen / 8, disk[step]               # the adapter alone
        sd = {"w": torch.zeros(512, 256), "bias": torch.zeros(256), "a": torch.zeros(8, 256),
              "step": -1}
        st.load(sd, os.path.join(root, "step-%08d" % step))   # one process, whole tensors
        assert torch.equal(sd["w"], w_full) and torch.equal(sd["bias"], bias), step
        assert torch.equal(sd["a"], want[step]) and sd["step"] == step, step
        strata.Checkpoint(os.path.join(root, "step-%08d" % step)).verify()
