"""Tensor helpers shared by the strata.torch tests: the dtypes strata has, bitwise
comparison (NaN-proof, on the CPU), and seeded sample tensors."""
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
