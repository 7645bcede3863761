"""strata.torch's tensors: the dtype map, a strata error naming its key, and what a tensor
must be for strata to read or fill it (checks, contiguous copies, digests, CUDA syncs)."""

import hashlib
import struct

import torch

import strata as _S

# ---- dtypes -----------------------------------------------------------------------------

_DTYPE_NAMES = [("float64", "f64"), ("float32", "f32"), ("float16", "f16"),
                ("bfloat16", "bf16"), ("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2"),
                ("int64", "i64"), ("int32", "i32"), ("int16", "i16"), ("int8", "i8"),
                ("uint8", "u8"), ("bool", "bool")]
_TO_STRATA = {}
for _tn, _sn in _DTYPE_NAMES:
    _dt = getattr(torch, _tn, None)
    if _dt is not None:
        _TO_STRATA[_dt] = _sn
_FROM_STRATA = {v: k for k, v in _TO_STRATA.items()}
del _tn, _sn, _dt


def _sdtype(key, t):
    try:
        return _TO_STRATA[t.dtype]
    except KeyError:
        raise _S.InvalidArgumentError(
            "%s: dtype %s has no strata dtype (strata holds %s)"
            % (key, t.dtype, ", ".join(str(d) for d in _TO_STRATA))) from None


# ---- errors -----------------------------------------------------------------------------

def _with_key(e, key):
    """e (a strata.Error raised while registering key) again, its message naming key."""
    msg = str(e)
    if key in msg:
        return e
    return type(e)("%s: %s" % (key, msg))


# ---- tensors ----------------------------------------------------------------------------

def _check_tensor(key, t):
    if t.device.type == "meta":
        raise _S.InvalidArgumentError(
            "%s: a tensor on the meta device has no data (materialise it first, "
            "e.g. to_empty() and init)" % key)
    if t.layout != torch.strided:
        raise _S.InvalidArgumentError(
            "%s: a %s tensor: strata saves dense (strided) tensors; convert it "
            "(to_dense()) or keep it in a value" % (key, t.layout))
    if t.device.type not in ("cpu", "cuda"):
        raise _S.InvalidArgumentError(
            "%s: a tensor on device %s: strata reads CPU and CUDA memory" % (key, t.device))
    if t.is_quantized:
        raise _S.InvalidArgumentError("%s: quantized tensors are not supported" % key)


def _readable(t):
    """A tensor holding t's values contiguously, row-major: t itself where it can."""
    if t.requires_grad:   # (detach costs ~6 us a tensor: only where it is needed)
        t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def _writable(t):
    """(buffer the engine writes into, (t, buffer) to copy back after the load, or None)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t, None
    tmp = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    return tmp, (t, tmp)


def _nbytes(t):
    return t.numel() * t.element_size()


def _hash_tensor(t):
    """A 64-bit digest of the bytes of a contiguous tensor, for the replica check: XXH3-64
    of host memory; on a GPU, _device_digest (no copy to the host)."""
    if t.device.type != "cpu":
        return _device_digest(t)
    return _S.hash_bytes(t.data_ptr(), _nbytes(t))


def _device_digest(t, chunk=1 << 24):
    """A digest of a tensor's bytes computed where they are (a GPU), without copying them to
    the host: three sums over the bytes b[i] (plain, and weighted by two functions of the
    position i), in int64 arithmetic that wraps - so the same bytes give the same digest
    whatever the order of the reduction - chunk by chunk to bound the temporary memory.
    Not a cryptographic hash: it detects ranks whose bytes differ, which is its use."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    acc = torch.zeros(3, dtype=torch.int64, device=t.device)
    for s in range(0, n, chunk):
        x = b[s:s + chunk].to(torch.int64)
        i = torch.arange(s, s + x.numel(), dtype=torch.int64, device=t.device)
        acc[0] += x.sum()
        acc[1] += (x * (i % 65521 + 1)).sum()
        acc[2] += (x * ((i * 2654435761 + 40503) % 4294967291)).sum()
    a0, a1, a2 = (v & 0xFFFFFFFFFFFFFFFF for v in acc.tolist())
    return int.from_bytes(hashlib.blake2b(struct.pack("<QQQQ", n, a0, a1, a2),
                                          digest_size=8).digest(), "little")


def _sync_cuda(devices):
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


def _sync_loaded(devices):
    """After a load into CUDA memory: strata's cudaMemcpy from pageable host memory may
    return before its DMA has landed, and a non-blocking stream (the caller's current one
    may be such) is not ordered after it; wait for the device before anyone reads."""
    for d in devices:
        torch.cuda.synchronize(d)
