/* ckpt.c - opening a checkpoint directory (commit record, then metadata; or a source's
 * index) and the read-only strata_ckpt accessors. Nothing here writes or removes:
 * ownership is own.c's, probing and collection retain.c's. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../source/source.h"

/* metadata.bin is read only up to the size its commit record states (and never beyond
 * 16 GiB); without a valid commit record (an incomplete checkpoint opened to look at,
 * probe, ls, gc) up to 256 MiB. The size is checked before anything is allocated, so a
 * sparse file of any length costs nothing. docs/FORMAT.md. */
#define MAX_META_BYTES ((uint64_t)1 << 34)
#define MAX_UNCOMMITTED_META_MIB 256

/* Decodes metadata and checks it against the commit record (if committed). */
static int dir_parse(st_dir *d, const unsigned char *mbuf, size_t mlen)
{
    int rc = st_meta_decode(&d->meta, mbuf, mlen);
    if (rc)
        return st_wrap(rc, "checkpoint '%s': %s", d->path, ST_META_FILE);
    if (d->committed &&
        (d->commit.meta_size != mlen || d->commit.meta_hash != st_hash(mbuf, mlen)))
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': %s does not match its commit record (truncated, "
                       "replaced or corrupt)",
                       d->path, ST_META_FILE);
    return 0;
}

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
    d->incomplete_ok = allow_incomplete;
    if ((d->src = st_source_find(v, d->path, kind)))
        return d->src->open(d, raw, rawlen);
    if (kind != 1)
        return st_survey(v, d->path, kind); /* a torch.save file, or not a checkpoint */
    return st_dir_read_own(d, allow_incomplete, 1, raw, rawlen);
}

int st_dir_read_own(st_dir *d, int allow_incomplete, int survey, unsigned char **raw,
                    size_t *rawlen)
{
    const st_vfs *v = d->vfs;
    unsigned char *cbuf = NULL, *mbuf = NULL;
    size_t clen = 0, mlen = 0;
    char why[256] = "", p[PATH_MAX];
    int rc, e;
    if ((rc = st_path_join(p, d->path, ST_COMMIT_FILE)))
        return rc;
    e = st_vfs_read_all(v, p, 4096, 0, &cbuf, &clen);
    if (e == 0) {
        if (st_commit_decode(&d->commit, cbuf, clen) == 0)
            d->committed = 1;
        else
            snprintf(why, sizeof why, "its commit record is invalid (%s)", strata_error_last());
    } else if (e == -ENOENT || e == -EFBIG) {
        if (e == -ENOENT && survey && (rc = st_survey(v, d->path, 1))) /* not strata's */
            return rc;
        snprintf(why, sizeof why, "it has no commit record (an interrupted or failed save)");
    } else if (e == -ST_ENOTREG) { /* a FIFO, a device: no commit record strata wrote */
        snprintf(why, sizeof why, "its commit record %s is not a regular file", ST_COMMIT_FILE);
    } else {
        return st_fail(st_from_errno(-e), "checkpoint '%s': reading %s: %s", d->path,
                       ST_COMMIT_FILE, strerror(-e));
    }
    free(cbuf);
    if (!d->committed && !allow_incomplete)
        return st_fail(STRATA_EINCOMPLETE, "checkpoint '%s' is incomplete: %s", d->path, why);

    if ((rc = st_path_join(p, d->path, ST_META_FILE)))
        return rc;
    if (d->committed && d->commit.meta_size > MAX_META_BYTES)
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': its commit record states %llu bytes of %s, more than "
                       "a reader accepts (%llu)",
                       d->path, (unsigned long long)d->commit.meta_size, ST_META_FILE,
                       (unsigned long long)MAX_META_BYTES);
    size_t max = d->committed ? (size_t)d->commit.meta_size
                              : (size_t)MAX_UNCOMMITTED_META_MIB << 20;
    e = st_vfs_read_all(v, p, max, 0, &mbuf, &mlen);
    /* missing, oversized or not a file: a broken checkpoint (or, without a commit record,
     * an incomplete one); EIO is an EIO */
    int broken = d->committed ? STRATA_EFORMAT : STRATA_EINCOMPLETE;
    if (e == -EFBIG && d->committed)
        return st_fail(STRATA_EFORMAT,
                       "checkpoint '%s': %s is larger than the %llu bytes its commit record "
                       "states (replaced or corrupt)",
                       d->path, ST_META_FILE, (unsigned long long)d->commit.meta_size);
    if (e == -EFBIG)
        return st_fail(STRATA_EINCOMPLETE,
                       "checkpoint '%s' is incomplete and its %s is larger than %d MiB, the "
                       "most read without a valid commit record",
                       d->path, ST_META_FILE, MAX_UNCOMMITTED_META_MIB);
    if (e == -ST_ENOTREG)
        return st_fail(broken,
                       "checkpoint '%s': %s is not a regular file (a FIFO, a device or a "
                       "directory in its place)",
                       d->path, ST_META_FILE);
    if (e)
        return st_fail(e == -ENOENT ? broken : st_from_errno(-e),
                       "checkpoint '%s': cannot read %s: %s", d->path, ST_META_FILE,
                       strerror(-e));
    rc = dir_parse(d, mbuf, mlen);
    if (rc == 0 && raw) {
        *raw = mbuf;
        *rawlen = mlen;
    } else {
        free(mbuf);
    }
    return rc;
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

int st_dir_adopt(st_dir *d, const char *uri, const st_commit *c, const unsigned char *meta,
                 size_t mlen, uint32_t source)
{
    memset(d, 0, sizeof *d);
    int rc = st_vfs_resolve(uri, &d->vfs, d->path, sizeof d->path);
    if (rc == 0 && source) {
        if (!(d->src = st_source_by_id(source)))
            rc = st_fail(STRATA_EFORMAT, "checkpoint '%s': unknown source %u from another rank",
                         d->path, source);
        else
            rc = d->src->adopt ? d->src->adopt(d, meta, mlen)
                               : st_source_adopt_meta(d, meta, mlen);
    } else if (rc == 0) {
        rc = st_dir_parse_own(d, c, meta, mlen);
    }
    if (rc)
        st_dir_close(d);
    return rc;
}

int st_dir_parse_own(st_dir *d, const st_commit *c, const unsigned char *meta, size_t mlen)
{
    d->commit = *c;
    d->committed = 1;
    return dir_parse(d, meta, mlen);
}

void st_dir_close(st_dir *d)
{
    st_meta_free(d->meta);
    d->meta = NULL;
    st_vfs_release(d->vfs);
    d->vfs = NULL;
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

int strata_ckpt_format(const strata_ckpt *ck)
{
    return ck->d.src ? ck->d.src->format : STRATA_FORMAT_STRATA;
}
const char *strata_ckpt_format_name(const strata_ckpt *ck)
{
    return ck->d.src ? ck->d.src->name : "strata";
}
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
