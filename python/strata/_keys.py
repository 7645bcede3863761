"""How strata.torch walks a state dict and names its entries: a mapping's items in sorted
key order (so that every rank calls Stateful objects' state_dict() / load_state_dict() in
one order), keys joined with "." ("optim.state.0.exp_avg"), a rank's own entry as
"<key>@rank<r>". Used to flatten state dicts (_statedict) and the values of torch.save
pickles (_torchsave) the same way."""

import collections.abc

import torch

import strata as _S


def _is_stateful(v):
    return (not isinstance(v, (torch.Tensor, type))
            and callable(getattr(v, "state_dict", None))
            and callable(getattr(v, "load_state_dict", None)))


def _is_container(v):
    return isinstance(v, (collections.abc.Mapping, list, tuple))


def _key_order(kv):
    k = kv[0]
    return (type(k).__name__, k if isinstance(k, (str, int)) else repr(k))


def _items(v):
    """v's (key, child) pairs: a mapping's in sorted key order, so that every rank walks a
    state dict, and so calls state_dict() / load_state_dict() of its Stateful objects
    (which may run collectives), in one order whatever order its keys were inserted in."""
    if isinstance(v, collections.abc.Mapping):
        return sorted(v.items(), key=_key_order)
    return list(enumerate(v))


def _join(key, k):
    if isinstance(k, str):
        part = k
    elif isinstance(k, int):
        part = str(int(k))
    else:
        raise _S.InvalidArgumentError(
            "%s: a state dict key of type %s (%r): keys are str or int"
            % (key or "<root>", type(k).__name__, k))
    return part if not key else key + "." + part


def _rebuild(orig, items):
    t = type(orig)
    if t is tuple:
        return tuple(items)
    if hasattr(t, "_make"):   # namedtuple
        return t._make(items)
    return t(items)


def _pr_name(key, rank):
    return "%s@rank%d" % (key, rank)
