"""Tensor helpers shared by the strata.torch tests: the dtypes strata has, bitwise
comparison (NaN-proof, on the CPU), seeded sample tensors, and a foreign checkpoint loaded
into DTensors of every layout a 1-D mesh gives."""
import torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """t's bytes as an integer tensor on the CPU (bool as its bytes)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_INT_OF_SIZE[t.element_size()])


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -10 ** 6), min(info.max, 10 ** 6), shape, generator=g).to(dtype)


def load_dtensors(refs, path):
    """On this run's ranks (a process group up): each tensor of refs {key: tensor} into a
    DTensor on a 1-D CPU mesh of every rank, sharded along dim 0 (Shard(0)), then those of 2+
    dims along dim 1 (a TP-like layout: column- and row-parallel); each filled with 3, then
    strata.torch.load of path. Returns ([(key, dim)] whose local part is not bitwise refs'
    slice, cases)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import strata.torch as st
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    bad, cases = [], 0
    for dim in (0, 1):
        sd, want = {}, {}
        for k, v in refs.items():
            if dim >= v.dim():
                continue
            d = distribute_tensor(v, mesh, [Shard(dim)])
            want[k] = d.to_local().clone()
            d.to_local().fill_(3)
            sd[k] = d
        st.load(sd, path)
        for k, d in sd.items():
            cases += 1
            if not same(d.to_local(), want[k]):
                bad.append((k, dim))
    return bad, cases
