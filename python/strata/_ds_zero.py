"""ZeRO 1 and 2 flat partitions as ranges of named full tensors (strata.deepspeed's side).

A DeepSpeedZeroOptimizer rank holds, per param group, one flat fp32 partition and the base
optimizer's per-element states (AdamW's exp_avg, exp_avg_sq) of the same length; each
parameter with a fragment on this rank has param._hp_mapping: the fragment's offset in the
parameter (lp_fragment_address) and in the partition (hp_fragment_address). Saved, a
fragment is the flat range [lp.start, lp.start + numel) of the tensor `<fqn>` (the fp32
master weight, fqn as DeepSpeed's param_names: zero_to_fp32's names) or
`optim.state.<fqn>.<key>`; what lies between fragments (alignment and the last rank's
padding) stays a plain tensor of the file. Loading on another data-parallel world size
reads, for each fragment of the live optimizer, that range into the live partition.

Threading: DeepSpeed's thread only.
"""

import torch

import strata as _S
from strata._tensor import _TO_STRATA, _error, _nbytes

FP32 = "%s"        # the name of the fp32 master weight of fqn (optim.state.<fqn>.<key>:
                   # its optimizer state key, _moment_fmt)


def _zero_optimizer(engine):
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return None
    opt = getattr(engine, "optimizer", None)
    return opt if isinstance(opt, DeepSpeedZeroOptimizer) else None


def _fragments(opt, g):
    """[(hp start, numel, fqn, lp start, full shape)] of param group g on this rank, by hp
    start."""
    out = []
    for lp in opt.bit16_groups[g]:
        m = getattr(lp, "_hp_mapping", None)
        if m is None:
            continue
        hp, lpa = m.hp_fragment_address, m.lp_fragment_address
        out.append((hp.start, hp.numel, opt.param_names[lp], lpa.start, tuple(lp.shape)))
    out.sort()
    return out


def _moments(opt, base):
    """{key: tensor} of the base optimizer's per-element states of the flat partition base."""
    st = opt.optimizer.state.get(base, {})
    return {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == base.shape}


def layout(engine):
    """{data_ptr: (partition numel, dtype, name format, fragments)} of every flat partition
    tensor of engine's ZeRO 1/2 optimizer (fp32 weights and moments), taken when a save
    begins: a tensor of the saved files that starts there is stored as named ranges. {}
    for any other optimizer (ZeRO 3 keeps its files' tensors as they are)."""
    opt = _zero_optimizer(engine)
    if opt is None:
        return {}
    out = {}
    for g, base in enumerate(opt.single_partition_of_fp32_groups):
        frags = _fragments(opt, g)
        out[base.data_ptr()] = (base.numel(), base.dtype, FP32, frags)
        for key, t in _moments(opt, base).items():
            out[t.data_ptr()] = (t.numel(), t.dtype, _moment_fmt(key), frags)
    return out


def _moment_fmt(key):
    return "optim.state.%s." + str(key).replace("%", "%%")


def pieces(lay, v):
    """v as [(partition offset, numel, name or None, flat start, full shape)] covering it
    (name None: a gap, kept as a plain tensor), if v is a flat partition of lay; else None."""
    if v.dim() != 1 or v.numel() == 0 or not v.is_contiguous() or v.data_ptr() not in lay:
        return None
    numel, dtype, fmt, frags = lay[v.data_ptr()]
    n = v.numel()
    if v.dtype != dtype or n > numel:
        return None
    out, pos = [], 0
    for hs, cnt, fqn, ls, shape in frags:
        if hs >= n:
            break
        if hs > pos:
            out.append((pos, hs - pos, None, 0, None))
        cnt = min(cnt, n - hs)
        out.append((hs, cnt, fmt % fqn, ls, shape))
        pos = hs + cnt
    if pos < n:
        out.append((pos, n - pos, None, 0, None))
    return out


def reshard_load(engine, load_dir, tag, load_entry, stub_of):
    """Loads tag (saved through strata.deepspeed on any data-parallel world size) into
    engine's ZeRO 1/2 optimizer: each fragment of the live partitions is read from its
    named range, the loss scaler and clip from the saved optimizer state of DP rank 0 and
    the base optimizer's step and param-group values likewise. Returns False if engine's
    optimizer is no ZeRO 1/2 one (DeepSpeed's own load then runs, and refuses)."""
    opt = _zero_optimizer(engine)
    if opt is None:
        return False
    name = engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank, 0,
                                           engine.bfloat16_enabled())
    stub = stub_of(name)
    if stub is None:
        raise _error("InvalidArgumentError", "%s: not saved through strata.deepspeed; a "
                     "checkpoint of DeepSpeed's own engine loads only on the DP world size "
                     "that wrote it" % name)
    ckpt, entry = stub
    sd = load_entry(ckpt, entry, partitions=False)["optimizer_state_dict"]
    opt._load_global_state(sd)
    base_sd = sd["base_optimizer_state"]
    groups = opt.optimizer.param_groups
    if isinstance(base_sd, dict):      # rigid: the torch optimizer's state_dict
        saved_groups = base_sd["param_groups"]
        saved_states = [base_sd["state"].get(pg["params"][0], {}) for pg in saved_groups]
    else:                              # elastic: one lean state per group and the step
        saved_groups = [{"step": sd["base_optimizer_state_step"]}] * len(base_sd)
        saved_states = base_sd
    if len(saved_groups) != len(groups):
        raise _error("MismatchError", "%s: %d optimizer param groups saved, %d now"
                     % (name, len(saved_groups), len(groups)))
    # (as DeepSpeed's own load, what is set before a failing read stays set)
    state, want = _S.State(), []
    for g, base in enumerate(opt.single_partition_of_fp32_groups):
        live = opt.optimizer.state.setdefault(base, {})   # empty before the first step
        targets = [(FP32, base)]
        for k, v in saved_states[g].items():
            if v is None:             # a flat partition (read below, into this layout)
                if not (torch.is_tensor(live.get(k)) and live[k].shape == base.shape):
                    live[k] = torch.zeros_like(base)
                targets.append((_moment_fmt(k), live[k]))
            elif torch.is_tensor(v) and v.dim() > 0:
                raise _error("MismatchError", "%s: optimizer state %r of group %d has shape %s, "
                             "not a flat partition's" % (name, k, g, tuple(v.shape)))
            else:                     # step and the like
                live[k] = v.clone() if torch.is_tensor(v) else v
        for k, v in saved_groups[g].items():
            if k != "params":
                groups[g][k] = v
        for hs, cnt, fqn, ls, shape in _fragments(opt, g):
            for fmt, t in targets:
                want.append((fmt % fqn, shape, ls, cnt, t.narrow(0, hs, cnt)))
    ck = _S.Checkpoint(ckpt)
    idx = {t["name"]: t for t in ck.tensors}
    for tname, shape, ls, cnt, dst in want:
        t = idx.get(tname)
        if t is None:
            raise _error("NotFoundError", "%s: no tensor %r (ZeRO state this optimizer holds)"
                         % (ckpt, tname))
        if tuple(t["shape"]) != shape or t["dtype"] != _TO_STRATA[dst.dtype]:
            raise _error("MismatchError", "%s: %r is %s %s in the checkpoint, %s %s here"
                         % (ckpt, tname, t["dtype"], tuple(t["shape"]),
                            _TO_STRATA[dst.dtype], shape))
        state.add_shard(tname, t["dtype"], shape, flat=(ls, ls + cnt), data_ptr=dst.data_ptr(),
                        nbytes=_nbytes(dst), device=dst.is_cuda, keep=dst)
    _S.load([ckpt], [state], None)
    opt._link_all_hp_params()     # as DeepSpeed's own load; and the fragments' views of
    opt._hp_optimizer_states_linked = False     # the optimizer states (DeepSpeed makes
    opt._lazy_init_hp_params_optimizer_state()  # them at the first step)
    return True
