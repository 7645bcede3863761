"""strata as DeepSpeed's checkpoint engine (DeepSpeed 0.19.8's CheckpointEngine interface).

    import strata.deepspeed
    strata.deepspeed.enable()                  # once, before deepspeed.initialize
    engine, *_ = deepspeed.initialize(...)
    engine.save_checkpoint(save_dir, tag)      # returns once planned; copied and written
                                               # in the background
    engine.load_checkpoint(save_dir)           # the newest committed tag ("latest")

    strata.deepspeed.convert(save_dir, out_dir)  # the way back: the tag as DeepSpeed's
                                               # default engine writes it (_ds_convert.py;
                                               # python -m strata.deepspeed convert ...)

Every file that engine.save_checkpoint(save_dir, tag) writes, on every rank, becomes an
entry of one strata checkpoint, save_dir/tag/strata, committed as a whole (one commit
record); in save_dir/tag each file is a stub of a few bytes naming its entry (DeepSpeed's
loader checks that the files exist). The save is lazy: its tensors are copied into the
saver's reused pool while training goes on, and DeepSpeed's next engine.step() waits for
that copy (only if it is unfinished) before the optimizer changes them - the engine is a
"decoupled" one, so DeepSpeed calls commit() there. save_dir/latest is written (by a
thread of rank 0, atomically) only once the tag is committed, and a tag's errors are
raised by the first step, save or engine.destroy() after them. The next save_checkpoint
first waits until the previous tag is committed (one tag in flight: bounded memory). A
kill at any instant leaves the previous tag loadable.

An entry is the file's object as a tree of plain values (the tagged format of
docs/FORMAT.md, "Python values", no pickle) whose tensors are strata tensors
"<file>#<i>" - except ZeRO's flat partitions (stage 1, 2 and 3: fp32 weights, optimizer
moments), which are ranges of named full tensors `<fqn>` and `optim.state.<fqn>.<key>`
(_ds_zero.py), so that a tag is free of its world size: engine.load_checkpoint on another
data-parallel world size reads the ranges its new partitions cover (ZeRO 3: a rank the tag
has no model-states file for takes DP rank 0's), and strata.torch.load or strata export of
save_dir/tag/strata gives the fp32 master weights. Besides dicts, lists, tuples and
scalars the tree holds OrderedDict, torch.Size, torch.dtype, parameters, and DeepSpeed's
own LossScaler, DynamicLossScaler, fragment_address and ZeroStageEnum (rebuilt from their
fields, by an allow-list: nothing named in the file is imported). Any other object (a custom lr scheduler's state, a client
object) needs enable(pickle=True), which pickles it and unpickles it at load (which can run
code); without it the save fails naming the file, the place in it and the type.

This module is the engine and enable(); beside it, _ds_tag.py (a tag directory: its stubs,
strata/, latest), _ds_entry.py (a file's object as an entry, and load_entry), _ds_zero.py
(ZeRO's flat partitions) and _ds_convert.py (convert).

Threading: DeepSpeed's thread calls everything here; strata's threads copy, write and
commit.
"""

import json
import math
import os
import re
import signal
import sys
import threading
import time

import torch

import strata as _S
from strata import _ds_convert, _ds_zero, _values
from strata._ds_convert import convert
from strata._ds_entry import (_Tree, _blob, _flat_nodes,  # noqa: F401  (_flat_nodes:
                              _tensor_name, load_entry)       # the tests use it)
from strata._ds_tag import (STUB_MAGIC, SUBDIR, _read_stub, _stub_or_none,  # noqa: F401
                            _tag_free, _write_atomic)
from strata._group import _exchange, _group
from strata._save import _save_saver
from strata._tensor import _nbytes, _sdtype

__all__ = ["enable", "disable", "convert", "StrataCheckpointEngine"]

_FILES_INLINE = 512      # a rank's file list (JSON) up to this many bytes goes with the
                         # save's one allgather (DeepSpeed's are 2 files, ~80 bytes)

# ---- the engine ------------------------------------------------------------------------

class _TagSave:
    """One tag's strata save in flight: its handle, its info, what the snapshot reads, and
    on rank 0 the thread that writes save_dir/latest as soon as the tag is committed."""

    def __init__(self, handle, info, keep, write_latest):
        self.handle, self.info, self.keep = handle, info, keep
        self.snapshot_done = False
        self.error = None
        self.thread = None
        if write_latest:
            self.thread = threading.Thread(target=self._latest, daemon=True,
                                           name="strata-deepspeed-latest")
            self.thread.start()

    def _latest(self):
        try:
            self.handle.wait_durable()      # the commit (of every rank's files)
            _write_atomic(os.path.join(self.info.save_dir, "latest"), self.info.tag.encode())
        except BaseException as e:          # raised on DeepSpeed's thread by _finish
            self.error = e


class StrataCheckpointEngine:
    """DeepSpeed's CheckpointEngine backed by strata (see the module's doc). Made by
    DeepSpeed once enable() has run; pickle and save options as enable() was given."""

    def __init__(self, config_params=None, *, pickle=False, pool=None, options=None):
        self.name = "StrataCheckpointEngine"
        self.pickle = pickle
        self.pool = pool
        self.options = dict(options or {})
        self._info = None        # the tag whose files save() gathers
        self._files = []         # [(entry, state_dict)]
        self._inflight = None    # _TagSave
        self._layout = {}        # the ZeRO flat partitions when the save began (_ds_zero)
        self._shared = {}        # the engine's shared_params then ({alias: name}: tied)
        self.snapshot_wait_s = 0.0   # how long the last step waited for a snapshot copy

    # -- DeepSpeed's interface

    def create(self, info):
        self._finish(wait=True)
        _tag_free(info)
        self._info, self._files = info, []

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path):
        if self._info is None:
            raise _S.InvalidArgumentError(
                "%s: strata's DeepSpeed engine saves files "
                "only inside engine.save_checkpoint()" % path)
        tagdir = os.path.normpath(os.path.join(self._info.save_dir, self._info.tag))
        entry = os.path.relpath(os.path.normpath(path), tagdir)
        if entry.startswith("..") or os.path.isabs(entry) or entry.split(os.sep)[0] == SUBDIR:
            raise _S.InvalidArgumentError(
                "%s: outside the tag directory %s (or in its "
                "%s/ subdirectory)" % (path, tagdir, SUBDIR))
        entry = entry.replace(os.sep, "/")
        if any(e == entry for e, _ in self._files):
            raise _S.InvalidArgumentError("%s: saved twice in one tag" % path)
        self._files.append((entry, state_dict))
        with open(path, "wb") as f:
            f.write(STUB_MAGIC + entry.encode() + b"\n")
        if os.environ.get("STRATA_DS_TEST_KILL_AT_STUB") == self._info.tag:
            os.kill(os.getpid(), signal.SIGKILL)   # tests: a kill inside save_checkpoint

    def load(self, path, map_location=None):
        stub = _read_stub(path) if os.path.isfile(path) else None
        if stub is None:
            if os.path.isfile(path):
                if not self.pickle:
                    raise _S.InvalidArgumentError(
                        "%s: a torch.save file (not saved through strata): load it "
                        "with strata.deepspeed.enable(pickle=True), which loads it "
                        "with torch.load (unpickling can run code)" % path)
                return torch.load(path, map_location=map_location, weights_only=False)
            raise _S.MissingError("%s: no such file" % path)
        obj = load_entry(stub[0], stub[1], pickle=self.pickle)
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
            obj = _to_device(obj, torch.device(map_location))
        return obj

    def _entry(self, ckpt, entry, partitions=True, loader=None):
        return load_entry(ckpt, entry, pickle=self.pickle, partitions=partitions, loader=loader)

    def commit(self, info):
        """DeepSpeed's step hook (before the optimizer step): waits until the copy of the
        tag's tensors has ended. Writing and committing go on in the background."""
        s = self._inflight
        if s is not None and not s.snapshot_done:
            t = time.perf_counter()
            s.handle.wait_snapshot()
            self.snapshot_wait_s = time.perf_counter() - t
            s.snapshot_done, s.keep = True, None
        return True

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0

    def is_decoupled(self):
        return True

    def set_commit_info(self, info):
        pass

    def get_commit_info(self):
        """At each step: the tag whose snapshot the step must wait for (save_latest off:
        DeepSpeed must not write latest, this engine does once the tag is committed), or
        None; a tag found ended is closed here (its error raised). Every rank returns the
        same (DeepSpeed follows a tag with a barrier): a tag is returned at the first step
        after its save whether or not this rank's part has ended."""
        s = self._inflight
        if s is not None and not s.snapshot_done:
            i = s.info
            return type(i)(tag=i.tag, save_dir=i.save_dir, save_latest=False)
        self._finish(wait=False)     # local: the commit is the saver thread's
        return None

    def cleanup(self):
        self._finish(wait=True)

    def preserves_storage_sharing(self):
        return False    # no clone_tensors_for_torch_save: the snapshot copies lazily

    # -- strata's side

    def start(self):
        """Starts the strata save of the gathered tag (every rank, after the last save()):
        returns once planned."""
        info, files = self._info, self._files
        self._info, self._files = None, []
        if info is None:
            return
        group = _group(None)
        rank = group.rank if group is not None else 0
        state, keep, err = None, [], None
        try:
            state, named = _S.State(), {}
            for entry, sd in files:
                tree = _Tree(entry, self.pickle, self._layout, named, *_model_names(entry, sd))
                blob = _values.encode(tree.node(sd, ""))
                buf = bytearray(blob)
                keep.append(buf)
                _blob(state, entry, buf, rank_local=True)
                for i, t in enumerate(tree.tensors):
                    keep.append(t)
                    state.add_shard(_tensor_name(entry, i), _sdtype(entry, t), tuple(t.shape),
                                    None, None, data_ptr=t.data_ptr(), nbytes=_nbytes(t),
                                    device=t.is_cuda, keep=t)
            for alias, name in self._shared.items():   # tied: zero_to_fp32 gives both
                if name in named and alias not in named:
                    named[alias] = named[name]
            for name, (shape, start, t) in named.items():     # ZeRO flat pieces, wholes
                keep.append(t)
                state.add_shard(name, _sdtype(name, t), shape, None, None,
                                flat=None if start is None else (start, start + t.numel()),
                                data_ptr=t.data_ptr(), nbytes=_nbytes(t), device=t.is_cuda,
                                keep=t)
        except Exception as e:   # every rank must reach the agreement below
            err = e
        _agree_files(group, [e for e, _ in files], err)
        if any(t.is_cuda for t in keep if isinstance(t, torch.Tensor)):
            torch.cuda.synchronize()
        m = re.search(r"(\d+)$", info.tag)
        uri = os.path.join(info.save_dir, info.tag, SUBDIR)
        h = _save_saver(group, self.pool).start([uri], [state], step=int(m.group(1)) if m else 0,
                                                **self.options)
        self._inflight = _TagSave(h, info, (state, keep), rank == 0 and info.save_latest)

    def wait(self):
        """Waits until the tag in flight is committed (and latest written); raises its error."""
        self._finish(wait=True)

    def _finish(self, wait):
        s = self._inflight
        if s is None or not (wait or s.handle.done()):
            return
        self._inflight = None
        try:
            if s.thread is not None:
                s.thread.join()
            s.handle.wait_durable()
        finally:
            s.handle.close()
            s.keep = None
        if s.error is not None:
            raise s.error


def _agree_files(group, entries, err):
    """Every rank learns whether every rank's files were encoded (else all raise, naming
    the failing rank), and no file is saved by two ranks: one allgather when all is well
    (_group._exchange; a rank's file list fits in _FILES_INLINE bytes)."""
    got = _exchange(group, "strata.deepspeed save", err, json.dumps(entries).encode(),
                    inline=_FILES_INLINE)
    owner = {}
    for r, g in enumerate(got):
        for e in json.loads(g):
            if e in owner:
                raise _S.InvalidArgumentError(
                    "%s: saved by ranks %d and %d in one tag"
                    % (e, owner[e], r))
            owner[e] = r


_MODEL12 = re.compile(r"mp_rank_00_model_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")


def _model_names(entry, sd):
    """({id(tensor): name}, {id(tensor): pieces}) of a model-states file's tensors that
    zero_to_fp32 gives and the ZeRO partitions do not hold, so that the tag names them as
    it does (docs/FORMAT.md, "DeepSpeed tags"): of DP rank 0's file, the buffers (module
    entries named in buffer_names) and, stage 1 and 2, each frozen parameter
    (frozen_param_fragments, whole) as the tensor <name>; of stage 3's file of DP rank r,
    each frozen parameter's fragment (ceil(numel / ranks) elements from r x that, the tail
    padding) as a range of the tensor <name>. Nothing for any other file."""
    m3 = _MODEL3.fullmatch(entry)
    if not (m3 or _MODEL12.fullmatch(entry)) or type(sd) is not dict:
        return {}, {}
    whole, frags = {}, {}
    module, frozen = sd.get("module"), sd.get("frozen_param_fragments") or {}
    shapes = sd.get("frozen_param_shapes") or {}
    if (m3 is None or m3.group(1) == "0") and isinstance(module, dict):
        for k in sd.get("buffer_names") or ():
            if isinstance(module.get(k), torch.Tensor):
                whole[id(module[k])] = k
    for k, v in frozen.items():
        shape = shapes.get(k)
        if not isinstance(v, torch.Tensor) or shape is None or v.numel() == 0:
            continue
        if m3 is None:
            if tuple(v.shape) == tuple(shape):
                whole[id(v)] = k
            continue
        if v.dim() != 1:
            continue
        pn, start = v.numel(), v.numel() * int(m3.group(1))
        cnt = min(pn, math.prod(shape) - start)
        if cnt > 0:
            frags[id(v)] = [(0, cnt, k, start, tuple(shape))] + (
                [(cnt, pn - cnt, None, 0, None)] if cnt < pn else [])
    return whole, frags


def _to_device(v, dev):
    if isinstance(v, torch.Tensor):
        return v.to(dev)
    if type(v) in (list, tuple):
        return type(v)(_to_device(x, dev) for x in v)
    if isinstance(v, dict):
        d = type(v)()
        for k, x in v.items():
            d[k] = _to_device(x, dev)
        return d
    return v


# ---- turning it on ----------------------------------------------------------------------

_ORIG = {}


def enable(*, pickle=False, pool=None, **options):
    """Makes strata the checkpoint engine of every DeepSpeedEngine made after this call
    (DeepSpeed 0.19.8 has no config entry for a third-party engine): its save_checkpoint
    starts the tag's strata save once DeepSpeed has handed over the last file. pickle: allow
    objects other than plain values and DeepSpeed's own (see the module's doc); pool: a
    strata.Pool for the snapshots (default: the saver's own, min(1 GiB, the state), kept
    and reused); options: chunk_bytes, io_threads, sync, direct, bg_nice (strata.Saver)."""
    import deepspeed.runtime.engine as ds_engine
    if not _ORIG:
        _ORIG["create"] = ds_engine.create_checkpoint_engine
        _ORIG["save"] = ds_engine.DeepSpeedEngine.save_checkpoint
        _ORIG["load_zero"] = ds_engine.DeepSpeedEngine._load_zero_checkpoint
        _ORIG["names"] = ds_engine.DeepSpeedEngine._get_all_ckpt_names
    orig_save, orig_load_zero, orig_names = _ORIG["save"], _ORIG["load_zero"], _ORIG["names"]

    def create_checkpoint_engine(config_params, *args, **kwargs):
        return StrataCheckpointEngine(config_params, pickle=pickle, pool=pool, options=options)

    def save_checkpoint(self, *args, **kwargs):
        ce = self.checkpoint_engine
        if isinstance(ce, StrataCheckpointEngine):
            ce._finish(wait=True)     # (create() would: the layout is of the new tag)
            ce._layout = _ds_zero.layout(self)
            ce._shared = _ds_zero.shared_params(self)
        try:
            ok = orig_save(self, *args, **kwargs)
            if isinstance(ce, StrataCheckpointEngine):
                ce.start()
        finally:
            if isinstance(ce, StrataCheckpointEngine):
                ce._layout, ce._shared = {}, {}
        return ok

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if (isinstance(self.checkpoint_engine, StrataCheckpointEngine) and load_optimizer_states
                and not self.load_universal_checkpoint()
                and self.seq_dp_world_size != self.loaded_checkpoint_dp_world_size
                and _ds_zero.reshard_load(self, load_dir, tag, self.checkpoint_engine._entry,
                                          _stub_or_none)):
            return True
        return orig_load_zero(self, load_dir, tag, load_optimizer_states)

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        # ZeRO 3 keeps a model-states file per DP rank: a rank the tag has none for (it
        # was saved on fewer ranks) takes DP rank 0's, if that is a strata stub (the same
        # content but frozen parameters' fragments; the optimizer's are resharded)
        names = orig_names(self, checkpoints_path, tag)
        if (not names and isinstance(self.checkpoint_engine, StrataCheckpointEngine)
                and self.zero_optimization_partition_weights()
                and not self.load_universal_checkpoint()):
            zero = self._get_ckpt_name(checkpoints_path, tag, pp_placeholder="0")
            if _stub_or_none(zero) is not None:
                names = [zero]
        return names

    save_checkpoint.__doc__ = orig_save.__doc__
    ds_engine.create_checkpoint_engine = create_checkpoint_engine
    ds_engine.DeepSpeedEngine.save_checkpoint = save_checkpoint
    ds_engine.DeepSpeedEngine._load_zero_checkpoint = _load_zero_checkpoint
    ds_engine.DeepSpeedEngine._get_all_ckpt_names = _get_all_ckpt_names


def disable():
    """Undoes enable(): engines made after it use DeepSpeed's own engine again."""
    if _ORIG:
        import deepspeed.runtime.engine as ds_engine
        ds_engine.create_checkpoint_engine = _ORIG.pop("create")
        ds_engine.DeepSpeedEngine.save_checkpoint = _ORIG.pop("save")
        ds_engine.DeepSpeedEngine._load_zero_checkpoint = _ORIG.pop("load_zero")
        ds_engine.DeepSpeedEngine._get_all_ckpt_names = _ORIG.pop("names")


if __name__ == "__main__":
    sys.exit(_ds_convert.main())
