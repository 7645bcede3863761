/* ckpt.c - opening a checkpoint: two calls into src/source/ (find the source that reads
 * what is at the path, open it; or adopt what another rank opened) - and the read-only
 * strata_ckpt accessors. Nothing here writes or removes: ownership is own.c's, probing and
 * collection retain.c's. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "engine.h"

static int dir_open(st_dir *d, const char *uri, int allow_incomplete, unsigned char **raw,
                    size_t *rawlen)
{
    int rc = st_vfs_resolve(uri, &d->vfs, d->path, sizeof d->path);
    if (rc)
        return rc;
    const st_vfs *v = d->vfs;
    int kind;
    int e = v->stat(v, d->path, NULL, &kind);
    if (e)
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e),
                       "checkpoint '%s': %s", d->path, strerror(-e));
    char p[PATH_MAX];
    if (kind == 2 && st_path_join(p, d->path, ".") == 0 && v->stat(v, p, NULL, &kind) != 0)
        kind = 3; /* a symlink ("latest") is read through if it names a directory */
    if (!(d->src = st_source_find(v, d->path, kind)))
        return st_survey(v, d->path, kind); /* not a checkpoint: says what it is */
    return d->src->open(d, allow_incomplete, raw, rawlen);
}

int st_dir_open(st_dir *d, const char *uri, int allow_incomplete)
{
    return st_dir_open_raw(d, uri, allow_incomplete, NULL, NULL);
}

int st_dir_open_raw(st_dir *d, const char *uri, int allow_incomplete, unsigned char **raw,
                    size_t *rawlen)
{
    memset(d, 0, sizeof *d);
    int rc = dir_open(d, uri, allow_incomplete, raw, rawlen);
    if (rc)
        st_dir_close(d);
    return rc;
}

int st_dir_adopt(st_dir *d, const char *uri, const unsigned char *desc, size_t len,
                 uint32_t source)
{
    memset(d, 0, sizeof *d);
    int rc = st_vfs_resolve(uri, &d->vfs, d->path, sizeof d->path);
    if (rc == 0 && !(d->src = st_source_by_id(source)))
        rc = st_fail(STRATA_EFORMAT, "checkpoint '%s': unknown source %u from another rank",
                     d->path, source);
    else if (rc == 0)
        rc = d->src->adopt(d, desc, len);
    if (rc)
        st_dir_close(d);
    return rc;
}

void st_dir_close(st_dir *d)
{
    st_index_close(d);
}

/* ---- public read-only view ---- */

int strata_ckpt_open(strata_ckpt **out, const char *uri, unsigned flags)
{
    *out = NULL;
    if (flags & ~(unsigned)STRATA_OPEN_INCOMPLETE)
        return st_fail(STRATA_EINVAL, "strata_ckpt_open: unknown flags 0x%x", flags);
    strata_ckpt *ck = calloc(1, sizeof *ck);
    if (!ck)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = st_dir_open(&ck->d, uri, (flags & STRATA_OPEN_INCOMPLETE) != 0);
    if (rc) {
        free(ck);
        return rc;
    }
    *out = ck;
    return 0;
}

void strata_ckpt_free(strata_ckpt *ck)
{
    if (!ck)
        return;
    st_dir_close(&ck->d);
    free(ck);
}

const st_dir *st_ckpt_dir(const strata_ckpt *ck) { return &ck->d; }
int strata_ckpt_committed(const strata_ckpt *ck) { return ck->d.committed; }
uint64_t strata_ckpt_step(const strata_ckpt *ck) { return ck->d.meta->step; }
size_t strata_ckpt_ntensors(const strata_ckpt *ck) { return ck->d.meta->ntensors; }
size_t strata_ckpt_nblobs(const strata_ckpt *ck) { return ck->d.meta->nblobs; }
size_t strata_ckpt_nfiles(const strata_ckpt *ck) { return ck->d.meta->nfiles; }
uint64_t strata_ckpt_data_bytes(const strata_ckpt *ck) { return ck->d.meta->data_bytes; }
uint32_t strata_ckpt_chunk_bytes(const strata_ckpt *ck)
{
    return ck->d.meta->foreign ? 0 : ck->d.meta->chunk;
}
const char *strata_ckpt_base(const strata_ckpt *ck, uint64_t *own_bytes)
{
    const st_meta *m = ck->d.meta;
    if (own_bytes) {
        *own_bytes = 0;
        for (size_t t = 0; t < m->ntensors; t++)
            for (size_t s = 0; s < m->tensors[t].nshards; s++) {
                const st_extent *e = &m->tensors[t].shards[s].ext;
                *own_bytes += st_file_linked(m, e->file) ? 0 : e->bytes;
            }
        for (size_t b = 0; b < m->nblobs; b++)
            *own_bytes += st_file_linked(m, m->blobs[b].ext.file) ? 0 : m->blobs[b].ext.bytes;
    }
    return m->foreign ? NULL : m->base;
}

int strata_ckpt_format(const strata_ckpt *ck) { return ck->d.src->format; }
const char *strata_ckpt_format_name(const strata_ckpt *ck) { return ck->d.src->name; }
const char *strata_ckpt_tag(const strata_ckpt *ck) { return ck->d.tag[0] ? ck->d.tag : NULL; }

void strata_ckpt_tensor(strata_tensor_info *out, const strata_ckpt *ck, size_t i)
{
    const st_mtensor *t = &ck->d.meta->tensors[i];
    *out = (strata_tensor_info){t->name, t->dtype, t->ndim, t->shape, t->nshards, t->bytes};
}

void strata_ckpt_shard(strata_shard_info *out, const strata_ckpt *ck, size_t tensor, size_t shard)
{
    const st_mtensor *t = &ck->d.meta->tensors[tensor];
    const st_mshard *s = &t->shards[shard];
    *out = (strata_shard_info){s->off, s->len, s->flat, s->fs, s->fe,
                               ck->d.meta->files[s->ext.file].name, s->ext.offset, s->ext.bytes};
}

void strata_ckpt_blob(strata_blob_info *out, const strata_ckpt *ck, size_t i)
{
    const st_mblob *b = &ck->d.meta->blobs[i];
    *out = (strata_blob_info){b->name, (int)b->owner, ck->d.meta->files[b->ext.file].name,
                              b->ext.offset, b->ext.bytes};
}

void strata_ckpt_file(strata_file_info *out, const strata_ckpt *ck, size_t i)
{
    *out = (strata_file_info){ck->d.meta->files[i].name, ck->d.meta->files[i].bytes};
}
