/* index.c - an opened checkpoint's index (source.h) and what the readers share to build one
 * (readers.h): the one encoding of the metadata a reader built, which is also the
 * description other ranks adopt; opening a format's files; the check that a file is still
 * the one opened. */
#include "readers.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"

void st_index_close(st_index *ix)
{
    st_meta_free(ix->meta);
    ix->meta = NULL;
    st_vfs_release(ix->vfs);
    ix->vfs = NULL;
}

int st_index_take(st_index *ix, const st_meta *built, const char *what, unsigned char **desc,
                  size_t *desclen)
{
    unsigned char *enc = NULL;
    size_t elen = 0;
    int rc = st_meta_encode(built, &enc, &elen);
    if (rc)
        return rc;
    if ((rc = st_meta_decode_foreign(&ix->meta, enc, elen))) {
        free(enc);
        return st_wrap(rc, "%s '%s'", what, ix->path);
    }
    ix->committed = 1;
    if (desc) {
        *desc = enc;
        *desclen = elen;
    } else {
        free(enc);
    }
    return 0;
}

int st_index_adopt_meta(st_index *ix, const unsigned char *desc, size_t len)
{
    int rc = st_meta_decode_foreign(&ix->meta, desc, len);
    if (rc)
        return st_wrap(rc, "checkpoint '%s': the index another rank read", ix->path);
    ix->committed = 1;
    return 0;
}

int st_desc_add(unsigned char **desc, size_t *len, const void *p, size_t n)
{
    unsigned char *b = n <= UINT32_MAX ? realloc(*desc, *len + n + 4) : NULL;
    if (!b)
        return st_fail(STRATA_ENOMEM, "out of memory");
    memcpy(b + *len, p, n);
    for (int i = 0; i < 4; i++) /* little-endian, as st_get_u32 reads it */
        b[*len + n + i] = (unsigned char)(n >> (8 * i));
    *desc = b;
    *len += n + 4;
    return 0;
}

int st_desc_take(const unsigned char *desc, size_t *len, const unsigned char **p, size_t *n)
{
    if (*len < 4)
        return -1;
    uint32_t k = st_get_u32(desc + *len - 4);
    if (k > *len - 4)
        return -1;
    *n = k;
    *len -= 4 + (size_t)k;
    *p = desc + *len;
    return 0;
}

/* path's directory into dir (PATH_MAX; "." if none), returning its name. */
static const char *split(const char *path, char *dir)
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

int st_index_to_dir(st_index *ix, char *name)
{
    int kind;
    const st_vfs *v = ix->vfs;
    if (v->stat(v, ix->path, NULL, &kind) == 0 && (kind == 0 || kind == 2)) {
        char dir[PATH_MAX];
        snprintf(name, PATH_MAX, "%s", split(ix->path, dir));
        memcpy(ix->path, dir, strlen(dir) + 1);
        return 1;
    }
    return 0;
}

int st_source_has_file(const st_vfs *v, const char *dir, const char *name)
{
    char p[PATH_MAX];
    int kind;
    return st_path_join(p, dir, name) == 0 && v->stat(v, p, NULL, &kind) == 0 &&
           (kind == 0 || kind == 2);
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
int st_check_same_file(const st_index *ix, const st_mfile *mf, const st_mident *was,
                       st_file *f)
{
    st_file_id id;
    const char *kind = ix->src ? ix->src->name : "foreign";
    int e = ix->vfs->ident(f, &id);
    if (e)
        return st_fail(st_from_errno(-e), "%s file '%s' of '%s': %s", kind, mf->name, ix->path,
                       strerror(-e));
    if (id.ino == was->ino && id.size == mf->bytes && id.mtime_ns == was->mtime_ns &&
        id.ctime_ns == was->ctime_ns)
        return 0;
    return st_fail(STRATA_ECHANGED,
                   "%s file '%s' of '%s' changed after its header was read (%s): load it again",
                   kind, mf->name, ix->path,
                   id.ino != was->ino     ? "another file is in its place"
                   : id.size != mf->bytes ? "its size differs"
                                          : "it was modified");
}
