/* ckpt.c - opening a checkpoint directory (commit record, then metadata), the read-only
 * strata_ckpt accessors, probing and removing incomplete checkpoints. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "source.h"

int st_path_join(char *out, const char *dir, const char *name)
{
    int n = snprintf(out, PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= PATH_MAX)
        return st_fail(STRATA_EINVAL, "path too long: %s/%s", dir, name);
    return 0;
}

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
    if ((d->src = st_source_find(v, d->path, kind)))
        return d->src->open(d, raw, rawlen);
    if (kind != 1)
        return st_survey(v, d->path, kind); /* a torch.save file, or not a checkpoint */

    unsigned char *cbuf = NULL, *mbuf = NULL;
    size_t clen = 0, mlen = 0;
    char why[256] = "";
    if ((rc = st_path_join(p, d->path, ST_COMMIT_FILE)))
        return rc;
    e = st_vfs_read_all(v, p, 4096, 0, &cbuf, &clen);
    if (e == 0) {
        if (st_commit_decode(&d->commit, cbuf, clen) == 0)
            d->committed = 1;
        else
            snprintf(why, sizeof why, "its commit record is invalid (%s)", strata_error_last());
    } else if (e == -ENOENT || e == -EFBIG) {
        if (e == -ENOENT && (rc = st_survey(v, d->path, kind))) /* not strata's at all */
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
        d->commit = *c;
        d->committed = 1;
        rc = dir_parse(d, meta, mlen);
    }
    if (rc)
        st_dir_close(d);
    return rc;
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
int strata_ckpt_format(const strata_ckpt *ck)
{
    return ck->d.src ? ck->d.src->format : STRATA_FORMAT_STRATA;
}
const char *strata_ckpt_format_name(const strata_ckpt *ck)
{
    return ck->d.src ? ck->d.src->name : "strata";
}

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

/* ---- probing and removal ---- */

/* Is name one of the files strata writes into a checkpoint directory? */
int st_is_strata_file(const char *name)
{
    if (strcmp(name, ST_COMMIT_FILE) == 0 || strcmp(name, ST_META_FILE) == 0 ||
        strcmp(name, ST_COMMIT_FILE ".tmp") == 0 || strcmp(name, ST_META_FILE ".tmp") == 0 ||
        strcmp(name, ST_LOCK_FILE) == 0)
        return 1;
    return st_data_file_rank(name) >= 0;
}

typedef struct {
    int strata, foreign, unlink;
    uint64_t bytes;
    const st_save_plan *keep; /* with unlink: the data files of this plan stay */
} scan_ctx;

/* Is name a data file of sp (data-<writer rank>.bin)? */
static int in_plan(const st_save_plan *sp, const char *name)
{
    long r = st_data_file_rank(name);
    if (r < 0 || r >= sp->nranks || sp->writer_file[r] < 0)
        return 0;
    return strcmp(sp->meta->files[sp->writer_file[r]].name, name) == 0;
}

static int scan_one(void *p, const char *name, uint64_t size, int kind)
{
    scan_ctx *c = p;
    if (!st_is_strata_file(name) || kind != 0) {
        c->foreign++; /* symlinks and directories with our names are not ours */
        return ST_LIST_NEXT;
    }
    c->strata++;
    c->bytes += size;
    /* the lock file is the owner's: removed only by st_remove_failed and the collector,
     * after everything else */
    int keep = strcmp(name, ST_LOCK_FILE) == 0 || (c->keep && in_plan(c->keep, name));
    return c->unlink && !keep ? ST_LIST_REMOVE : ST_LIST_NEXT;
}

int st_scan_dir(const st_vfs *v, const char *dir, int unlink, int *strata, int *foreign,
                uint64_t *bytes)
{
    scan_ctx c = {.unlink = unlink};
    int e = v->list(v, dir, scan_one, &c);
    if (e)
        return st_fail(st_from_errno(-e), "cannot %s '%s': %s",
                       unlink ? "remove the files in" : "list", dir, strerror(-e));
    if (strata)
        *strata = c.strata;
    if (foreign)
        *foreign = c.foreign;
    if (bytes)
        *bytes = c.bytes;
    return 0;
}

int st_clear_stale(const st_vfs *v, const char *dir, const st_save_plan *sp)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, dir, ST_COMMIT_FILE);
    if (!rc && v->stat(v, p, NULL, NULL) == 0)
        rc = st_fail(STRATA_EEXIST,
                     "'%s' already holds a committed checkpoint; it is never overwritten", dir);
    int foreign = 0;
    if (!rc && !(rc = st_scan_dir(v, dir, 0, NULL, &foreign, NULL)) && foreign)
        rc = st_fail(STRATA_EEXIST,
                     "'%s' holds files that are not strata's; refusing to commit there", dir);
    if (rc)
        return rc;
    scan_ctx c = {.unlink = 1, .keep = sp};
    int e = v->list(v, dir, scan_one, &c);
    return e ? st_fail(st_from_errno(-e), "cannot clear stale files in '%s': %s", dir,
                       strerror(-e))
             : 0;
}

static int probe(const st_vfs *v, const char *uri, const char *path, strata_probe_info *out,
                 st_commit *commit);

/* strata_probe, and the commit record of a committed checkpoint (commit may be NULL;
 * zeroed if not committed). */
static int probe_uri(const char *uri, strata_probe_info *out, st_commit *commit)
{
    memset(out, 0, sizeof *out);
    if (commit)
        memset(commit, 0, sizeof *commit);
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    rc = probe(v, uri, path, out, commit);
    st_vfs_release(v);
    return rc;
}

int strata_probe(strata_probe_info *out, const char *uri) { return probe_uri(uri, out, NULL); }

int strata_uri_path(char *out, size_t cap, const char *uri)
{
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    st_vfs_release(v);
    size_t n = strlen(path);
    if (!out || n >= cap)
        return st_fail(STRATA_EINVAL, "%s: its path (%zu bytes) does not fit in %zu", uri, n, cap);
    memcpy(out, path, n + 1);
    return 0;
}

static int probe(const st_vfs *v, const char *uri, const char *path, strata_probe_info *out,
                 st_commit *commit)
{
    int rc;
    int kind;
    int e = v->stat(v, path, NULL, &kind);
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", path, strerror(-e));
    if (kind != 1)
        return 0;
    int ns = 0;
    if ((rc = st_scan_dir(v, path, 0, &ns, NULL, &out->disk_bytes)))
        return rc;
    out->is_ckpt = ns > 0;
    if (!ns)
        return 0;
    char p[PATH_MAX];
    if ((rc = st_path_join(p, path, ST_COMMIT_FILE)))
        return rc;
    out->has_commit = v->stat(v, p, NULL, NULL) == 0;
    st_dir d;
    if (st_dir_open(&d, uri, 1) == 0) {
        out->committed = d.committed;
        out->has_metadata = 1;
        out->step = d.meta->step;
        if (commit && d.committed)
            *commit = d.commit;
        st_dir_close(&d);
    }
    st_clear_error();
    return 0;
}

/* How remove_ckpt treats a commit record: */
enum {
    RM_INCOMPLETE, /* only without one */
    RM_SEEN,       /* only the very one probed (seen), still there under the lock */
    RM_ANY,        /* whatever is there: what a replacing save left beside its target */
};

static int remove_ckpt(const st_vfs *v, const char *path, int how, const st_commit *seen);

int strata_remove_incomplete(const char *uri)
{
    const st_vfs *v;
    char path[PATH_MAX];
    int rc = st_vfs_resolve(uri, &v, path, sizeof path);
    if (rc)
        return rc;
    const char *slash = strrchr(path, '/');
    rc = remove_ckpt(v, path, st_is_replace_sibling(slash ? slash + 1 : path) ? RM_ANY
                                                                               : RM_INCOMPLETE,
                     NULL);
    st_vfs_release(v);
    return rc;
}

int st_remove_owned(const st_vfs *v, const char *path, int committed)
{
    char p[PATH_MAX];
    int rc = st_path_join(p, path, ST_COMMIT_FILE), e;
    if (rc)
        return rc;
    if (committed) {
        if ((e = v->unlink(v, p)) != 0)
            return st_fail(st_from_errno(-e), "cannot remove '%s': %s", p, strerror(-e));
        v->sync_dir(v, path);
    } else if (v->stat(v, p, NULL, NULL) == 0) {
        return st_fail(STRATA_EEXIST,
                       "'%s' has a commit record: it is not removed as incomplete", path);
    }
    int foreign = 0;
    if ((rc = st_scan_dir(v, path, 1, NULL, &foreign, NULL)))
        return rc;
    if ((rc = st_path_join(p, path, ST_LOCK_FILE)))
        return rc;
    v->unlink(v, p); /* still locked by us: a save that opened it meanwhile retries */
    if (!foreign && (e = v->rmdir(v, path)) != 0 && e != -ENOENT)
        return st_fail(st_from_errno(-e), "cannot remove '%s': %s", path, strerror(-e));
    return 0;
}

/* Is the commit record at dir the one seen (every field)? */
static int same_commit(const st_vfs *v, const char *dir, const st_commit *seen)
{
    char p[PATH_MAX];
    unsigned char *buf = NULL;
    size_t len = 0;
    st_commit now;
    int same = st_path_join(p, dir, ST_COMMIT_FILE) == 0 &&
               st_vfs_read_all(v, p, 4096, 0, &buf, &len) == 0 &&
               st_commit_decode(&now, buf, len) == 0 && st_commit_same(&now, seen);
    free(buf);
    return same;
}

/* Takes ownership of the checkpoint at path (never one a live save owns: STRATA_EBUSY)
 * and removes it, as `how` allows. */
static int remove_ckpt(const st_vfs *v, const char *path, int how, const st_commit *seen)
{
    int kind, strata = 0;
    int e = v->stat(v, path, NULL, &kind), rc;
    if (e)
        return st_fail(st_from_errno(-e), "'%s': %s", path, strerror(-e));
    if (kind != 1)
        return st_fail(STRATA_EINVAL, "'%s' is not a directory (symlinks are not followed)", path);
    if ((rc = st_scan_dir(v, path, 0, &strata, NULL, NULL)))
        return rc;
    if (!strata) { /* nothing of strata's: nothing to remove (but an empty replace leftover) */
        if (how == RM_ANY)
            v->rmdir(v, path);
        return 0;
    }
    st_file *lock;
    if ((rc = st_own(v, path, 0, &lock)))
        return rc;
    char p[PATH_MAX];
    int committed = st_path_join(p, path, ST_COMMIT_FILE) == 0 && v->stat(v, p, NULL, NULL) == 0;
    /* under the lock, still the checkpoint that was probed? (another collector may have
     * removed it and a save committed a new one under the same name meanwhile) */
    if (how == RM_SEEN && !same_commit(v, path, seen))
        rc = st_fail(STRATA_ENOENT, "'%s' is not the checkpoint probed any more (removed or "
                     "replaced meanwhile); left alone", path);
    if (!rc)
        rc = st_remove_owned(v, path, how == RM_INCOMPLETE ? 0 : committed);
    st_own_release(v, lock);
    return rc;
}

/* ---- retention ---- */

void (*st_retain_test_hook)(const char *dir);

typedef struct {
    char name[256];
    int committed, has_commit, sibling;
    uint64_t time;
    st_commit seen; /* the commit record probed */
} entry_t;

typedef struct {
    entry_t *e;
    size_t n, cap;
} entries;

static int collect_dir(void *p, const char *name, uint64_t size, int kind)
{
    (void)size;
    entries *es = p;
    if (kind != 1 || strlen(name) >= sizeof es->e[0].name)
        return ST_LIST_NEXT;
    if (st_grow(&es->e, &es->cap, es->n + 1, sizeof *es->e))
        return ST_LIST_STOP;
    memset(&es->e[es->n], 0, sizeof es->e[es->n]);
    snprintf(es->e[es->n].name, sizeof es->e[0].name, "%s", name);
    es->e[es->n++].sibling = st_is_replace_sibling(name);
    return ST_LIST_NEXT;
}

static int cmp_newest_first(const void *a, const void *b)
{
    const entry_t *x = a, *y = b;
    return (x->time < y->time) - (x->time > y->time);
}

int strata_retain(int *removed, const char *dir_uri, int keep)
{
    return strata_retain_report(removed, dir_uri, keep, NULL, NULL);
}

int strata_retain_report(int *removed, const char *dir_uri, int keep, strata_skip_cb skipped,
                         void *ctx)
{
    if (removed)
        *removed = 0;
    if (keep < 0)
        return st_fail(STRATA_EINVAL, "keep must be 0 or more, not %d", keep);
    const st_vfs *v;
    char dir[PATH_MAX];
    int rc = st_vfs_resolve(dir_uri, &v, dir, sizeof dir);
    if (rc)
        return rc;
    entries es = {0};
    int e = v->list(v, dir, collect_dir, &es);
    if (e)
        rc = st_fail(st_from_errno(-e), "cannot list '%s': %s", dir, strerror(-e));
    for (size_t i = 0; i < es.n && !rc; i++) {
        char p[PATH_MAX];
        if (es.e[i].sibling || st_path_join(p, dir, es.e[i].name))
            continue;
        strata_probe_info pi;
        if (probe_uri(p, &pi, &es.e[i].seen) || !pi.is_ckpt) {
            es.e[i].has_commit = 1; /* not ours: never touched */
            continue;
        }
        es.e[i].has_commit = pi.has_commit;
        es.e[i].committed = pi.committed;
        if (pi.committed) {
            es.e[i].time = es.e[i].seen.time_ns;
        } else if (v->mtime(v, p, &es.e[i].time)) {
            es.e[i].time = UINT64_MAX; /* unknown: treat as new, keep */
        }
    }
    if (es.n) /* qsort of NULL is undefined, even of 0 entries */
        qsort(es.e, es.n, sizeof *es.e, cmp_newest_first);
    if (st_retain_test_hook && !rc)
        st_retain_test_hook(dir);
    int kept = 0, count = 0;
    for (size_t i = 0; i < es.n && !rc; i++) {
        char p[PATH_MAX];
        if (st_path_join(p, dir, es.e[i].name))
            continue;
        if (es.e[i].sibling) {
            rc = remove_ckpt(v, p, RM_ANY, NULL); /* left by a replace that died */
        } else if (es.e[i].committed) {
            if (kept++ < keep)
                continue;
            rc = remove_ckpt(v, p, RM_SEEN, &es.e[i].seen);
        } else if (!es.e[i].has_commit) {
            rc = remove_ckpt(v, p, RM_INCOMPLETE, NULL); /* unless a live save owns it */
        } else {
            continue; /* corrupt: kept for a person to look at */
        }
        if (rc == STRATA_EBUSY || rc == STRATA_EEXIST || rc == STRATA_ENOENT ||
            rc == STRATA_EINVAL) {
            /* owned by a live save, committed, removed or changed meanwhile, or its LOCK is
             * not a lock file: that one is left, the others are collected */
            if (skipped)
                skipped(ctx, p, rc, strata_error_last());
            rc = 0;
            continue;
        }
        count += rc == 0;
    }
    free(es.e);
    st_vfs_release(v);
    if (removed)
        *removed = count;
    return rc;
}
