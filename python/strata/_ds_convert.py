"""The way back from strata.deepspeed: a tag saved through strata written as DeepSpeed's
DEFAULT checkpoint engine writes it (torch.save files), so that DeepSpeed without strata and
zero_to_fp32.py read it. strata.deepspeed.convert and `python -m strata.deepspeed convert`
(docs/FORMAT.md, "DeepSpeed tags (strata.deepspeed)").

Threading: the caller's thread only.
"""

import os
import shutil
import sys

import torch

import strata as _S
from strata._ds_entry import load_entry
from strata._ds_tag import SUBDIR, _write_atomic


def _tag_of(save_dir, tag, subdir):
    """(the tag directory, the tag) of save_dir: save_dir/tag, or the tag `latest` names,
    or save_dir itself when it is a tag (it holds strata/)."""
    if tag is None and os.path.isdir(os.path.join(save_dir, subdir)):
        save_dir = os.path.normpath(save_dir)
        return save_dir, os.path.basename(save_dir)
    if tag is None:
        try:
            with open(os.path.join(save_dir, "latest")) as f:
                tag = f.read().strip()
        except FileNotFoundError:
            raise _S.MissingError(
                "%s: neither a tag saved through strata.deepspeed "
                "(no %s/) nor a save_dir with a `latest` file; name the tag (--tag)"
                % (save_dir, subdir)) from None
    if not tag or "/" in tag or tag in (".", ".."):
        raise _S.FormatError("%s: %r is not a tag (a plain directory name)" % (save_dir, tag))
    return os.path.join(save_dir, tag), tag


def _safe_entry(ckpt, e, subdir):
    parts = e.split("/")
    if (not e or e.startswith("/") or any(p in ("", ".", "..") for p in parts)
            or parts[0] == subdir):
        raise _S.FormatError(
            "%s: entry %r is not a file's place in a tag directory"
            % (ckpt, e))
    return os.path.join(*parts)


def convert(save_dir, out_dir, tag=None, pickle=False):
    """Writes a tag saved through strata.deepspeed as DeepSpeed's DEFAULT checkpoint engine
    writes it, so that DeepSpeed without strata (engine.load_checkpoint(out_dir)) and
    zero_to_fp32.py read it: out_dir/<tag>/<file> for every file of the tag (torch.save of
    the object DeepSpeed saved, rebuilt as load_entry does: bitwise the same tensors), then
    out_dir/latest naming the tag and out_dir/zero_to_fp32.py (DeepSpeed's, as its save
    puts it beside its tags). save_dir: the save_dir (tag: the tag, default the one its
    `latest` names) or the tag directory itself. The tag is written into a directory beside
    its place and renamed there once complete; a tag already at out_dir/<tag> is
    strata.ExistsError. pickle: as enable()'s (objects saved pickled). Returns the written
    tag directory. Also: python -m strata.deepspeed convert SAVE_DIR OUT_DIR [--tag TAG]."""
    tagdir, tag = _tag_of(save_dir, tag, SUBDIR)
    ckpt = os.path.join(tagdir, SUBDIR)
    dst = os.path.join(out_dir, tag)
    if os.path.lexists(dst):
        raise _S.ExistsError("%s: already there (a tag is never overwritten)" % dst)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ".%s.strata-convert-%d" % (tag, os.getpid()))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _S.Loader([ckpt]) as ld:
            for e in dict.fromkeys(b[0] for b in ld.index()["b"]):
                path = os.path.join(tmp, _safe_entry(ckpt, e, SUBDIR))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    torch.save(load_entry(ckpt, e, pickle=pickle, loader=ld), f)
                    f.flush()
                    os.fsync(f.fileno())
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(os.path.join(out_dir, "latest"), tag.encode())
    script = os.path.join(os.path.dirname(os.path.normpath(tagdir)), "zero_to_fp32.py")
    if not os.path.isfile(script):
        from deepspeed.utils import zero_to_fp32
        script = zero_to_fp32.__file__
    shutil.copyfile(script, os.path.join(out_dir, "zero_to_fp32.py"))
    return dst


_USAGE = """usage: python -m strata.deepspeed convert SAVE_DIR OUT_DIR [--tag TAG] [--pickle]

Writes a tag saved through strata.deepspeed (SAVE_DIR's `latest`, or --tag, or SAVE_DIR
itself when it is a tag directory) as DeepSpeed's default checkpoint engine writes it:
OUT_DIR/TAG/*.pt (torch.save files), OUT_DIR/latest and OUT_DIR/zero_to_fp32.py. Then
DeepSpeed without strata.deepspeed.enable() resumes from OUT_DIR, and zero_to_fp32.py
reads it. (strata export SAVE_DIR OUT gives zero_to_fp32's tensors directly, as
safetensors, without converting.)
"""


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m strata.deepspeed", usage=_USAGE,
                                 description=None)
    ap.add_argument("command", choices=["convert"])
    ap.add_argument("save_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--tag")
    ap.add_argument("--pickle", action="store_true",
                    help="unpickle objects saved pickled (enable(pickle=True)): can run code")
    a = ap.parse_args(argv)
    try:
        dst = convert(a.save_dir, a.out_dir, tag=a.tag, pickle=a.pickle)
    except _S.Error as e:
        print("strata.deepspeed convert: %s (%s)" % (e, type(e).__name__), file=sys.stderr)
        return 1
    print("wrote %s (DeepSpeed's default engine format) and %s"
          % (dst, os.path.join(a.out_dir, "latest")))
    return 0
