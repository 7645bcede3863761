"""The model of `make bench-torch`: a GPT-style decoder and its AdamW, sized so that the
checkpointed state (parameters + AdamW's two moments) is about BENCH_TORCH_GB GiB, in one of
three layouts:

    plain    one process, the whole model (no process group)
    fsdp_tp  FSDP2 x TP on a (dp, tp) mesh: ColwiseParallel / RowwiseParallel blocks, then
             fully_shard over dp (torch gives the TP-sharded weights [_StridedShard, Shard])
    fsdp     FSDP2 alone over every rank (the resharded target: 4 processes -> 3)

The step is real: forward, cross-entropy, backward, fused AdamW step, grads zeroed in place.
A tiny batch (1 x SEQ tokens) keeps the compute small: the optimizer step over the whole
state, which checkpointing competes with, is the cost that scales with the state.
"""

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 16384
WIDTH = 1024
HEAD_DIM = 64
SEQ = 16


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x))
        # under TP the local qkv holds this rank's heads: the head count follows the width
        q, k, v = qkv.reshape(b, t, 3, -1, HEAD_DIM).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers, d=WIDTH, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def block_params(d=WIDTH):
    return 12 * d * d + 13 * d


def base_params(d=WIDTH, vocab=VOCAB):
    return 2 * vocab * d + 2 * d


def layers_for(gib, dtype):
    """Blocks for a state (parameters + two AdamW moments) of about gib GiB."""
    esize = torch.empty(0, dtype=dtype).element_size()
    params = gib * (1 << 30) / (3 * esize)
    return max(1, int(round((params - base_params()) / block_params())))


def state_bytes(layers, dtype):
    esize = torch.empty(0, dtype=dtype).element_size()
    return 3 * esize * (base_params() + layers * block_params())


def build(layout, layers, dtype, seed=0, world=1):
    """(model, optimizer) in `layout`, the optimizer's state initialised (one step taken)."""
    torch.manual_seed(seed)
    model = GPT(layers).to(dtype)
    if layout == "fsdp_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        tp = 2
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        plan = {"emb": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(layers):
            plan["blocks.%d.qkv" % i] = ColwiseParallel()
            plan["blocks.%d.proj" % i] = RowwiseParallel()
            plan["blocks.%d.fc1" % i] = ColwiseParallel()
            plan["blocks.%d.fc2" % i] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        # Block.forward takes its head count from the local width: under TP each rank
        # computes its own heads (the values are meaningless, the shapes and costs real)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        assert layout == "plain", layout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return model, opt


class Trainer:
    """One training step at a time, on fixed random tokens."""

    def __init__(self, model, opt, seed=0):
        self.model = model
        self.opt = opt
        g = torch.Generator().manual_seed(seed)
        self.idx = torch.randint(0, VOCAB, (1, SEQ), generator=g)

    def forward_backward(self):
        out = self.model(self.idx)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), self.idx.reshape(-1))
        loss.backward()
        return loss

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def step(self):
        self.forward_backward()
        self.optimizer_step()


def state_dict(model, opt):
    """The checkpointed state: model and optimizer through torch's get_state_dict (DTensors
    under FSDP2 / TP), and the step as a plain value."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def tensors(sd, prefix=""):
    """[(key, tensor)] of a nested state dict."""
    out = []
    items = sd.items() if isinstance(sd, dict) else enumerate(sd)
    for k, v in items:
        key = "%s.%s" % (prefix, k) if prefix else str(k)
        if isinstance(v, torch.Tensor):
            out.append((key, v))
        elif isinstance(v, (dict, list, tuple)):
            out.extend(tensors(v, key))
    return out


def local_bytes(sd):
    total = 0
    for _, t in tensors(sd):
        lt = t._local_tensor if hasattr(t, "_local_tensor") else t
        total += lt.numel() * lt.element_size()
    return total


def env_gib(default=2.0):
    return float(os.environ.get("BENCH_TORCH_GB", default))


__all__ = ["GPT", "build", "Trainer", "state_dict", "layers_for", "state_bytes", "tensors",
           "local_bytes", "env_gib", "math"]
