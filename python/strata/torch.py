"""strata for PyTorch: save and load state dicts where torch.distributed.checkpoint is used.

    import strata.torch as st
    st.save({"model": model, "optim": optimizer, "rng": st.rng_state(), "step": step}, path)
    st.load(state, path)                         # in place, into tensors already allocated
    h = st.async_save(state, path); h.wait_snapshot(); optimizer.step(); ...; h.wait()
    mgr = st.CheckpointManager(["/dev/shm/ckpt", "/data/ckpt"], keep=3)
    st.export_safetensors(path, "hf-model/", prefix="model.", dtype=torch.bfloat16)

DCP's calls work as written (import strata.torch as dcp): dcp.save(state, checkpoint_id=p),
dcp.load(state, checkpoint_id=p), f = dcp.async_save(...); f.result() (_dcpcalls).

State dicts hold (nested in dicts, lists and tuples; flattened to dotted keys such as
"optim.state.layers.0.w.exp_avg"):
  - plain tensors: replicated - every rank holds the same bytes (checked at save: a key
    whose bytes differ across ranks is an error naming it, and nothing is written);
  - DTensors (Shard, Replicate, _StridedShard placements: tensor parallel, FSDP2, FSDP2 x
    TP), each rank describing its boxes of the global tensor, several where its rows are not
    contiguous. Load reshards: any saved layout into any target layout;
  - Stateful objects (state_dict() / load_state_dict(): modules, optimizers, your own),
    expanded at save and restored through load_state_dict at load;
  - values (None, bool, int, float, str, bytes, io.BytesIO, lists, tuples and dicts of
    them) in the tagged format of docs/FORMAT.md ("Python values"), which loads without
    running code; anything else only with pickle=True on both save and load;
  - per_rank(x): a value (or tensor, or nested state) each rank saves for itself and gets
    back for itself (RNG states, data-loader positions): rng_state() / set_rng_state().

With an initialised process group (or the one given) every rank calls together; strata's
collectives run on a dedicated gloo group. Without one, everything runs in this process.

This module is the facade: every name users import from strata.torch, and export. Each
concept lives in a module of its own beside it (docs/DESIGN.md, "strata.torch"): _group
(the process group adapter and the agreement before each save and load), _save (save,
async_save, AsyncSave), _load (load), _statedict (per-rank values, flattening, what a rank
registers to save), _loadprep (what it registers to load into), _keys, _tensor, _dtensor,
_values, _torchsave, _dcpcalls, and _manager (CheckpointManager, over _tiers, _retention,
_incremental and _flush).
"""

import os

import torch

import strata as _S
from strata._group import _group  # noqa: F401  (tests and benches use it)
from strata._load import load
from strata._manager import CheckpointManager
from strata._save import AsyncSave, async_save, save
from strata._statedict import PerRank, per_rank, rng_state, set_rng_state
from strata._tensor import _FROM_STRATA, _TO_STRATA  # noqa: F401

__all__ = ["save", "load", "async_save", "AsyncSave", "per_rank", "PerRank", "rng_state",
           "set_rng_state", "CheckpointManager", "export_safetensors"]


# ---- export -----------------------------------------------------------------------------

def export_safetensors(path, out, *, prefix=None, max_file_bytes=None, dtype=None,
                       progress=None, io_threads=None, direct=True, include=None, exclude=None,
                       model_only=None, skip_crc=False):
    """Writes the tensors of the checkpoint at path, merged to their full global shapes
    whatever layout they were saved in (DTensor shards, FSDP flat pieces, replicas), as
    Hugging Face safetensors files in the directory out (made if missing):
    model-0000i-of-0000N.safetensors and model.safetensors.index.json (one file:
    model.safetensors alone, as Hugging Face writes it), readable by
    safetensors.torch.load_file and transformers' from_pretrained. Values and per-rank
    entries (non-tensor state) are not exported. Memory stays bounded (windows of at most
    64 MiB; every checksum is verified, a zip entry's CRC-32 included, before any file is
    in place: skip_crc=True leaves those unchecked); files are renamed into place only once
    all are complete, and a failure leaves none.

    prefix: stripped from the start of names ("model." turns "model.layers.0.w" into
    "layers.0.w"; other names are kept). max_file_bytes: the most tensor bytes per file
    (default 5e9; a larger tensor gets a file of its own). dtype: None keeps every saved
    dtype; torch.bfloat16 (or "bf16") converts float64/32/16 tensors to bfloat16 (round to
    nearest even), other dtypes as saved. progress: called as progress(done, total) in
    tensor bytes after each window; if it raises, the export stops with strata.AbortedError
    (the exception as its __cause__). Not collective: call it in one process (the
    checkpoint must be committed). io_threads: the reads' threads; direct=False: never
    O_DIRECT (by default the files are written with it where the file system allows, leaving
    the page cache alone). Returns {data_bytes, bytes, io_calls, seconds, meta_reads,
    crc_checked, crc_bytes, crc_skipped} (meta_reads: the reads of the checkpoint's index:
    one, the export opens it once).

    Which tensors (all by default): include / exclude, a glob or a list of them (fnmatch on
    the checkpoint's names, "*" crossing dots; exclude wins); model_only="model" (or True)
    keeps what the model's state_dict holds in a save of {"model": model, "optim": opt, ...}:
    the tensors named "model.<name>", written as "<name>", never a per_rank one
    ("<key>@rank<r>") nor the optimizer's state (under "optim."); not with prefix. A
    selection that keeps nothing raises strata.NotFoundError, nothing written.
    """
    if isinstance(dtype, torch.dtype):
        if dtype != torch.bfloat16:
            raise _S.InvalidArgumentError(
                "export dtype %s: only torch.bfloat16 (or None: "
                "as saved)" % dtype)
        dtype = "bf16"
    return _S.export_safetensors(os.fspath(path), os.fspath(out), prefix=prefix,
                                 max_file_bytes=max_file_bytes, dtype=dtype, progress=progress,
                                 io_threads=io_threads, direct=direct, include=include,
                                 exclude=exclude, model_only=model_only, skip_crc=skip_crc)
