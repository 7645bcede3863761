"""strata.torch's load: one strata.Loader opened on the group's Comm, the state dict
matched against its index (_loadprep's _Meta and _LoadPrep) and agreed on by every rank,
then loaded through the same loader."""

import logging

import strata as _S
from strata import _dcpcalls
from strata._group import _agree, _dcp_group
from strata._loadprep import _LoadPrep, _Meta
from strata._tensor import _sync_cuda, _sync_loaded

_log = logging.getLogger("strata.torch")


def load(state_dict, path=None, process_group=None, *, checkpoint_id=None, storage_reader=None,
         planner=None, no_dist=False, pickle=False, cast=False, partial=False, **options):
    """Loads the checkpoint at path (or the first of several tiers, fastest first, that is
    committed and reads back intact) into state_dict, in place: tensors (and DTensors, in
    whatever layout they have now) are filled, values replaced, Stateful objects restored
    with load_state_dict. Keys of the checkpoint that the state dict lacks are ignored; a
    key of the state dict the checkpoint lacks is NotFoundError naming it - unless
    partial=True (or DCP's DefaultLoadPlanner(allow_partial_load=True)): such keys are left
    as they are, and listed, sorted, in the returned stats' "missing" (and logged at INFO
    on the logger "strata.torch"). A shape that differs is MismatchError; a tensor saved in
    another dtype is converted as it is read where every value is exact in the target's
    (a widening, as DCP does: f16 and bf16 to f32 or f64, f32 to f64, integers to wider
    ones or to floats that hold them) and else MismatchError - unless cast=True, which also
    converts floats to narrower floats (rounded once to nearest even, as Tensor.to does
    from float32; any other pair is MismatchError). As DCP's load: keys are taken in
    sorted order on every rank (Stateful objects may run collectives), every top-level
    entry that is not Stateful is set again after the load, tensors on the meta device are
    replaced by new loaded ones (CPU; a DTensor's on its mesh's device), and an empty dict
    (outside a Stateful) is filled with what the checkpoint holds under its key. Returns
    the load's stats. options: io_threads, max_io_bytes, direct, skip_crc. A DCP checkpoint,
    a torch.save file (or Hugging Face pytorch_model.bin), a DeepSpeed ZeRO tag and a
    Megatron checkpoint carry a zip CRC-32 per entry: every entry the load reads a byte of
    is read whole and checked before its bytes reach the tensors (a mismatch is
    ChecksumError naming the tensor, the entry and the file; stats crc_checked, crc_bytes:
    the bytes read only for that). skip_crc=True reads only the bytes needed and checks
    none (stats crc_skipped). safetensors carries no checksum; strata's own checksums are
    always verified.

    DCP's call (torch.distributed.checkpoint.load) works as written: the path as
    checkpoint_id=, or DCP's FileSystemReader(path) as storage_reader=; planner= DCP's
    DefaultLoadPlanner (allow_partial_load=True is partial=True); no_dist=True loads in
    this process alone. A planner or reader of another kind is InvalidArgumentError."""
    uris, partial = _dcpcalls.load_args("strata.torch.load", path, checkpoint_id,
                                        storage_reader, planner, partial)
    group = _dcp_group(process_group, no_dist)
    # one open: the loader reads the index once (with a group, rank 0 reads it and one
    # broadcast agrees on it), the state dict is matched against that index, and the load
    # runs on the same loader - never a second read of the metadata
    with _S.Loader(uris, group.comm if group is not None else None) as ld:
        meta = _Meta(_Meta.of_loader(ld))
        rank = group.rank if group is not None else 0
        prep, err = None, None
        try:
            prep = _LoadPrep(state_dict, meta, rank, pickle, cast, partial)
        except Exception as e:
            err = e
        _agree(group, "strata.torch.load", err)
        _sync_cuda(prep.cuda)
        try:
            stats = ld.load([prep.state], cast=cast, widen=True, **options)
        finally:
            prep.touched()
    _sync_loaded(prep.cuda)
    prep.finish()
    if partial:
        stats["missing"] = sorted(prep.missing)
        if prep.missing:
            _log.info("strata.torch.load: %d key(s) not in %s left as they were: %s",
                      len(prep.missing), meta.uri, ", ".join(stats["missing"][:20]))
    return stats
