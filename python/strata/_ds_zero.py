"""ZeRO flat partitions as ranges of named full tensors (strata.deepspeed's side).

A ZeRO optimizer rank holds flat fp32 partitions and the base optimizer's per-element
states (AdamW's exp_avg, exp_avg_sq) of the same length, each made of fragments of
parameters: a fragment is elements [start, start + numel) of the flattened parameter,
at an offset of the partition.

- Stage 1, 2 (DeepSpeedZeroOptimizer): one partition per param group,
  single_partition_of_fp32_groups[g]; each parameter with a fragment on this rank has
  param._hp_mapping: the fragment's offset in the parameter (lp_fragment_address) and in
  the partition (hp_fragment_address).
- Stage 3 (DeepSpeedZeroOptimizer_Stage3): one partition per sub group,
  fp32_partitioned_groups_flat[i], the parameters of fp16_groups[i] one after another,
  partition_numel() = ceil(numel / ranks) elements each; DP rank r holds elements
  [r * that, (r + 1) * that) of each parameter, the last ranks' tail being padding.

Saved, a fragment is that flat range of the tensor `<fqn>` (the fp32 master weight, fqn
as DeepSpeed's param_names: zero_to_fp32's names) or `optim.state.<fqn>.<key>`; what lies
between fragments (alignment and padding) stays a plain tensor of the file. Loading on
another data-parallel world size reads, for each fragment of the live optimizer, that
range into the live partition (read_ranges, which the engine's own load of a file's
partitions shares).

Threading: DeepSpeed's thread only.
"""

import math

import torch

import strata as _S
from strata._tensor import _TO_STRATA, _nbytes

FP32 = "%s"        # the name of the fp32 master weight of fqn (optim.state.<fqn>.<key>:
                   # its optimizer state key, _moment_fmt)


def _zero_optimizer(engine):
    """(engine's ZeRO optimizer, its stage: 2 for stage 1 and 2, or 3), or (None, 0)."""
    opt = getattr(engine, "optimizer", None)
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    except ImportError:
        return None, 0
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return opt, 2
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return opt, 3
    return None, 0


def _fragments12(opt, g):
    """[(partition offset, numel, fqn, flat start, full shape)] of param group g on this
    rank (stage 1, 2), by offset."""
    out = []
    for lp in opt.bit16_groups[g]:
        m = getattr(lp, "_hp_mapping", None)
        if m is None:
            continue
        hp, lpa = m.hp_fragment_address, m.lp_fragment_address
        out.append((hp.start, hp.numel, opt.param_names[lp], lpa.start, tuple(lp.shape)))
    out.sort()
    return out


def _fragments3(opt, i):
    """The same of sub group i (stage 3): each parameter's partition_numel() elements in
    turn, of which this rank's share of the parameter (none past its end)."""
    out, off = [], 0
    for p in opt.fp16_groups[i]:
        pn = p.partition_numel()
        start = pn * opt._get_param_partition_rank(p)
        cnt = min(pn, p.ds_numel - start)
        if cnt > 0:
            out.append((off, cnt, opt.param_names[p], start, tuple(p.ds_shape)))
        off += pn
    return out


def _partitions(opt, stage):
    """[(flat fp32 partition, its fragments)] of opt."""
    if stage == 3:
        return [(f, _fragments3(opt, i)) for i, f in enumerate(opt.fp32_partitioned_groups_flat)]
    return [(f, _fragments12(opt, g)) for g, f in enumerate(opt.single_partition_of_fp32_groups)]


def _moments(opt, base):
    """{key: tensor} of the base optimizer's per-element states of the flat partition base."""
    st = opt.optimizer.state.get(base, {})
    return {k: v for k, v in st.items() if torch.is_tensor(v) and v.shape == base.shape}


def layout(engine):
    """{data_ptr: (partition numel, dtype, name format, fragments)} of every flat partition
    tensor of engine's ZeRO optimizer (fp32 weights and moments), taken when a save
    begins: a tensor of the saved files that starts there is stored as named ranges. {}
    for any other optimizer."""
    opt, stage = _zero_optimizer(engine)
    if opt is None:
        return {}
    out = {}
    for base, frags in _partitions(opt, stage):
        if base.numel() == 0:
            continue
        out[base.data_ptr()] = (base.numel(), base.dtype, FP32, frags)
        for key, t in _moments(opt, base).items():
            out[t.data_ptr()] = (t.numel(), t.dtype, _moment_fmt(key), frags)
    return out


def shared_params(engine):
    """{alias: name} of the engine module's tied parameters, as DeepSpeed's
    _get_shared_params (shared_params in the model-states file, which zero_to_fp32 adds back)
    gives them - on every rank (DeepSpeed's own runs on rank 0 only): every further name of
    one parameter, in module order, names the first."""
    first, out = {}, {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
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


def tensor_index(index):
    """{name: (strata dtype, shape)} of the tensors of a strata.Loader's index()."""
    return {t[0]: (t[1], tuple(t[2])) for t in index["t"]}


def read_ranges(ld, idx, where, wants):
    """Reads each (name, shape or None, start, count, dst) of wants - elements [start,
    start + count) of the row-major flattening of the checkpoint's tensor name into the
    1-D tensor dst of count elements - through the open strata.Loader ld (idx: its
    tensor_index). A tensor the checkpoint lacks is NotFoundError, a dtype other than
    dst's or a shape other than the one given MismatchError, a range outside the tensor
    FormatError; each names `where` and the tensor."""
    state = _S.State()
    for name, shape, start, cnt, dst in wants:
        t = idx.get(name)
        if t is None:
            raise _S.NotFoundError("%s: no tensor %r in the checkpoint" % (where, name))
        dtype = _TO_STRATA[dst.dtype]
        if t[0] != dtype or (shape is not None and t[1] != tuple(shape)):
            raise _S.MismatchError(
                "%s: %r is %s %s in the checkpoint, %s %s here"
                % (where, name, t[0], t[1], dtype,
                   tuple(shape) if shape is not None else "(flat)"))
        if start + cnt > math.prod(t[1]):
            raise _S.FormatError(
                "%s: elements [%d, %d) of %r, which has %d"
                % (where, start, start + cnt, name, math.prod(t[1])))
        state.add_shard(name, dtype, t[1], flat=(start, start + cnt), data_ptr=dst.data_ptr(),
                        nbytes=_nbytes(dst), device=dst.is_cuda, keep=dst)
    if wants:
        ld.load([state])


def reshard_load(engine, load_dir, tag, load_entry, stub_of):
    """Loads tag (saved through strata.deepspeed on any data-parallel world size) into
    engine's ZeRO optimizer: each fragment of the live partitions is read from its named
    range, the loss scaler and the base optimizer's step and param-group values from the
    saved optimizer state of DP rank 0; the checkpoint is opened once. Returns False if
    engine's optimizer is no ZeRO one (DeepSpeed's own load then runs, and refuses)."""
    opt, stage = _zero_optimizer(engine)
    if opt is None:
        return False
    name = engine._get_rank_zero_ckpt_name(load_dir, tag, engine.checkpoint_mp_rank, 0,
                                           engine.bfloat16_enabled())
    stub = stub_of(name)
    if stub is None:
        raise _S.InvalidArgumentError(
            "%s: not saved through strata.deepspeed; a "
            "checkpoint of DeepSpeed's own engine loads only on the DP world size "
            "that wrote it" % name)
    ckpt, entry = stub
    if stage == 3:
        frozen = [n for p, n in engine.param_names.items()
                  if not p.requires_grad and getattr(p, "ds_numel", p.numel()) > 0]
        if frozen:
            raise _S.UnsupportedError(
                "%s: a ZeRO 3 model with frozen parameters (%s) "
                "resumes only on the DP world size that saved it" % (name, frozen[0]))
    with _S.Loader([ckpt]) as ld:
        sd = load_entry(ckpt, entry, partitions=False, loader=ld)["optimizer_state_dict"]
        (_load3 if stage == 3 else _load12)(opt, sd, name, ld, ckpt)
    return True


def _state_targets(name, g, saved, live, base):
    """Sets live (the base optimizer's state of the flat partition base) from saved (DP
    rank 0's state of its group g, flat partitions unread: None): step and the like as
    saved, each flat partition a zeroed tensor of base's length. Returns [(name format,
    tensor)] to read: base, then those."""
    targets = [(FP32, base)]
    for k, v in saved.items():
        if v is None:             # a flat partition (read into this layout)
            if not (torch.is_tensor(live.get(k)) and live[k].shape == base.shape):
                live[k] = torch.zeros_like(base)
            targets.append((_moment_fmt(k), live[k]))
        elif torch.is_tensor(v) and v.dim() > 0:
            raise _S.MismatchError(
                "%s: optimizer state %r of group %d has shape %s, "
                "not a flat partition's" % (name, k, g, tuple(v.shape)))
        else:                     # step and the like
            live[k] = v.clone() if torch.is_tensor(v) else v
    return targets


def _wants(targets, frags):
    return [(fmt % fqn, shape, ls, cnt, t.narrow(0, hs, cnt))
            for hs, cnt, fqn, ls, shape in frags for fmt, t in targets]


def _load12(opt, sd, name, ld, ckpt):
    """Stage 1, 2: the live partitions and the base optimizer's state, in place."""
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
        raise _S.MismatchError(
            "%s: %d optimizer param groups saved, %d now"
            % (name, len(saved_groups), len(groups)))
    # (as DeepSpeed's own load, what is set before a failing read stays set)
    wants = []
    for g, (base, frags) in enumerate(_partitions(opt, 2)):
        live = opt.optimizer.state.setdefault(base, {})   # empty before the first step
        targets = _state_targets(name, g, saved_states[g], live, base)
        for k, v in saved_groups[g].items():
            if k != "params":
                groups[g][k] = v
        wants += _wants(targets, frags)
    read_ranges(ld, tensor_index(ld.index()), ckpt, wants)
    opt._link_all_hp_params()     # as DeepSpeed's own load; and the fragments' views of
    opt._hp_optimizer_states_linked = False     # the optimizer states (DeepSpeed makes
    opt._lazy_init_hp_params_optimizer_state()  # them at the first step)


def _load3(opt, sd, name, ld, ckpt):
    """Stage 3: DP rank 0's optimizer state with this rank's partitions read into it (new
    tensors of the live layout: padding as the live partitions hold it, zero moments),
    given to DeepSpeed's own load of a rank's state (which restores the weights from the
    fp32 partitions and the base optimizer's state as a torch state dict)."""
    osd = sd["optimizer_state_dict"]
    saved_groups = osd["param_groups"]
    ngroups = len(opt.optimizer.param_groups)
    if len(saved_groups) != ngroups:
        raise _S.MismatchError(
            "%s: %d optimizer param groups saved, %d now"
            % (name, len(saved_groups), ngroups))
    subs = [[i for i in range(len(opt.fp16_groups)) if opt.sub_group_to_group_id[i] == g]
            for g in range(ngroups)]
    index = {i: k for k, i in enumerate(i for s in subs for i in s)}   # torch's numbering
    state, flats, wants = {}, [], []
    for i, (base, frags) in enumerate(_partitions(opt, 3)):
        g = opt.sub_group_to_group_id[i]
        params = saved_groups[g]["params"]
        saved = osd["state"].get(params[0], {}) if params else {}
        w, live = base.detach().clone(), {}
        wants += _wants(_state_targets(name, g, saved, live, w), frags)
        flats.append(w)
        if live:
            state[index[i]] = live
    read_ranges(ld, tensor_index(ld.index()), ckpt, wants)
    groups = [dict(saved_groups[g], params=[index[i] for i in subs[g]]) for g in range(ngroups)]
    mine = dict(sd, optimizer_state_dict={"state": state, "param_groups": groups},
                fp32_flat_groups=flats)
    opt.load_state_dict([mine] * opt.partition_count, load_optimizer_states=True)
