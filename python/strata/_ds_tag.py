"""strata.deepspeed's tag directories: save_dir/tag holds, for every file DeepSpeed saves,
a stub of a few bytes naming its entry (DeepSpeed's loader checks that the files exist),
and strata/, the tag's strata checkpoint; save_dir/latest names the newest committed tag.
Threading: the caller's thread only."""

import os

import strata as _S

STUB_MAGIC = b"STRATA-DEEPSPEED 1\n"
SUBDIR = "strata"        # the strata checkpoint of a tag: save_dir/tag/strata
_S_MAX_NAME = 1024       # STRATA_MAX_NAME: the longest entry name a stub may hold

def _write_atomic(path, data):
    """path holds data or its old content, whatever stops this (temp, fsync, rename)."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_stub(path):
    """(the strata checkpoint, the entry) a stub at path names; None if path is no stub."""
    with open(path, "rb") as f:
        head = f.read(len(STUB_MAGIC) + _S_MAX_NAME + 2)
    if not head.startswith(STUB_MAGIC):
        return None
    entry = head[len(STUB_MAGIC):].rstrip(b"\n").decode("utf-8", "replace")
    norm = os.path.normpath(path)
    if (not entry or entry.startswith("/") or ".." in entry.split("/")
            or not norm.endswith(os.sep + os.path.normpath(entry))):
        raise _S.FormatError(
            "%s: a strata stub naming the entry %r, which is not this "
            "file's place in its tag directory" % (path, entry))
    return os.path.join(norm[:-len(os.path.normpath(entry))], SUBDIR), entry


def _stub_or_none(path):
    return _read_stub(path) if os.path.isfile(path) else None


def _tag_free(info):
    """Refuses (ExistsError, before anything is written) a tag that must not be saved over:
    one committed already (save_dir/tag/strata), or a directory holding files that are not
    this engine's stubs (another engine's checkpoint). A tag whose save was interrupted (a
    kill: stubs, and no or an incomplete strata/) is saved again; its strata/ is replaced."""
    tagdir = os.path.join(info.save_dir, str(info.tag))
    if not os.path.isdir(tagdir):
        return
    ck = os.path.join(tagdir, SUBDIR)
    if os.path.lexists(ck) and _S.probe(ck)["committed"]:
        raise _S.ExistsError(
            "%s: tag %r is committed already; a committed tag is never "
            "overwritten: save under a new tag (DeepSpeed's default is "
            "global_step<N>) or remove this one first" % (tagdir, str(info.tag)))
    for name in sorted(os.listdir(tagdir)):
        p = os.path.join(tagdir, name)
        if (name != SUBDIR and os.path.isfile(p) and not os.path.islink(p)
                and _stub_or_none(p) is None):
            raise _S.ExistsError(
                "%s: tag %r holds %s, a file this engine did not "
                "write (another checkpoint engine's): it is never overwritten; save "
                "under a new tag" % (tagdir, str(info.tag), name))
