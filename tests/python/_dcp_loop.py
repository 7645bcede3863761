"""A training loop written for torch.distributed.checkpoint, as PyTorch's DCP recipe writes
one: FSDP2 (fully_shard) over gloo, the model and optimizer in a Stateful AppState
(get_state_dict / set_state_dict), dcp.async_save every other step on a process group of
its own (as DCP's async recipe has it: the save's thread runs collectives while training
runs its own) with the previous save's Future waited for first, dcp.load to resume. test_dcp_switch.py runs it as it is and with
its import line alone changed to `import strata.torch as dcp`.

    python _dcp_loop.py ROOT FIRST LAST OUT     (env:// variables: RANK, WORLD_SIZE, ...)

resumes from ROOT/step-(FIRST-1) when FIRST > 0, trains steps FIRST..LAST-1 saving
ROOT/step-N after every odd step N, and rank 0 writes to OUT (torch.save) the mean loss of
every step and the full parameters at the end."""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class AppState(Stateful):
    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(24, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def main(root, first, last, out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    if first > 0:
        dcp.load(state, checkpoint_id="%s/step-%d" % (root, first - 1))

    losses, future = [], None
    for step in range(first, last):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if step % 2 == 1:
            if future is not None:
                future.result()
            future = dcp.async_save(state, checkpoint_id="%s/step-%d" % (root, step),
                                    process_group=checkpoint_group)
    if future is not None:
        future.result()

    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": losses, "params": full}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
