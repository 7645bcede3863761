"""Incremental saves through CheckpointManager: a LoRA-style state (a frozen base, small
adapters and their AdamW moments) saved 20 times - bytes written per save from the files on
disk, every step loaded bitwise and verified, keep 3 removing bases that newer steps refer
to; full_every; dense training writing everything; incremental=False; kill -9 during an
incremental save."""

import os
import signal
import subprocess
import sys
import textwrap
import time

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
