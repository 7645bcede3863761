/* source.c - the table of load sources (source.h) and what they share. */
#include "source.h"

#include <errno.h>
#include <stdio.h>

#include "../core/error.h"

const st_source *const st_sources[] = {&st_source_safetensors, &st_source_megatron,
                                       &st_source_dcp, &st_source_torchsave,
                                       &st_source_zero, &st_source_dstag};
const size_t st_nsources = sizeof st_sources / sizeof st_sources[0];

const st_source *st_source_find(const st_vfs *v, const char *path, int kind)
{
    for (size_t i = 0; i < st_nsources; i++)
        if (st_sources[i]->here(v, path, kind))
            return st_sources[i];
    return NULL;
}

uint32_t st_source_id(const st_source *s)
{
    for (size_t i = 0; s && i < st_nsources; i++)
        if (st_sources[i] == s)
            return (uint32_t)i + 1;
    return 0;
}

const st_source *st_source_by_id(uint32_t id)
{
    return id >= 1 && id <= st_nsources ? st_sources[id - 1] : NULL;
}

int st_source_describe(const st_dir *d, unsigned char **desc, size_t *desclen)
{
    return st_meta_encode(d->meta, desc, desclen);
}

int st_source_adopt_meta(st_dir *d, const unsigned char *desc, size_t len)
{
    int rc = st_meta_decode_foreign(&d->meta, desc, len);
    if (rc)
        return st_wrap(rc, "checkpoint '%s': the index another rank read", d->path);
    d->committed = 1;
    return 0;
}

/* ---- helpers of the sources' open ---- */

int st_source_has_file(const st_vfs *v, const char *dir, const char *name)
{
    char p[PATH_MAX];
    int kind;
    return st_path_join(p, dir, name) == 0 && v->stat(v, p, NULL, &kind) == 0 &&
           (kind == 0 || kind == 2);
}

const char *st_source_split(const char *path, char *dir)
{
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(dir, ".");
        return path;
    }
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    memcpy(dir, path, n);
    dir[n] = 0;
    return slash + 1;
}

int st_source_open_file(const st_vfs *v, const char *dir, const char *name, const char *what,
                        st_file **f, st_file_id *id)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, dir, name);
    if (rc)
        return rc;
    int e = v->open(v, p, ST_O_READ | ST_O_FOLLOW, f);
    if (!e && (e = v->ident(*f, id)) != 0)
        v->close(*f);
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e), "%s '%s': %s", what, p,
                       e == -ENOENT        ? "is missing"
                       : e == -ST_ENOTREG ? "is not a regular file"
                                          : strerror(-e));
    return 0;
}

/* A foreign file opened for its data must be the one its header was read from, unchanged
 * (nothing else could tell: safetensors data has no checksum, and a file rewritten whole
 * carries CRC-32s of its own). The device is not compared: a network file has another on
 * each node. */
int st_check_same_file(const st_dir *d, const st_mfile *mf, const st_mident *was, st_file *f)
{
    st_file_id id;
    const char *kind = d->src ? d->src->name : "foreign";
    int e = d->vfs->ident(f, &id);
    if (e)
        return st_fail(st_from_errno(-e), "%s file '%s' of '%s': %s", kind, mf->name, d->path,
                       strerror(-e));
    if (id.ino == was->ino && id.size == mf->bytes && id.mtime_ns == was->mtime_ns &&
        id.ctime_ns == was->ctime_ns)
        return 0;
    return st_fail(STRATA_ECHANGED,
                   "%s file '%s' of '%s' changed after its header was read (%s): load it again",
                   kind, mf->name, d->path,
                   id.ino != was->ino     ? "another file is in its place"
                   : id.size != mf->bytes ? "its size differs"
                                          : "it was modified");
}
