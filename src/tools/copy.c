/* copy.c - strata_copy: a committed checkpoint copied to a new directory on any backend (a
 * tier flushed behind a faster one: disk or memory to s3://), every chunk's checksum
 * verified as its bytes pass, the commit record written last under the destination's
 * ownership, as a save does. Threading: the blocks of one data file are read, verified and
 * written by a few threads at once (each its own block and buffer); files go one after
 * another. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/util.h"
#include "../io/pool.h"
#include "../io/vfs.h"
#include "../engine/engine.h"
#include "export.h"

#define COPY_THREADS 4

uint64_t st_copy_block = 64u << 20; /* a whole number of S3 parts of the default size */

/* The progress of a copy over all its files (opts->progress, called under mu). */
typedef struct {
    const strata_copy_opts *o;
    pthread_mutex_t mu;
    uint64_t done, total;
} cprogress;

/* Tells the caller's callback that n more bytes are written: nonzero from it stops the copy
 * (STRATA_EABORTED, its message kept if it set one). */
static int progress(cprogress *pr, uint64_t n)
{
    if (!pr->o->progress)
        return 0;
    pthread_mutex_lock(&pr->mu);
    pr->done += n;
    st_clear_error();
    int stop = pr->o->progress(pr->o->progress_ctx, pr->done, pr->total);
    pthread_mutex_unlock(&pr->mu);
    if (!stop)
        return 0;
    if (!strata_error_last()[0])
        st_fail(STRATA_EABORTED, "copy stopped by the progress callback");
    return STRATA_EABORTED;
}

/* A checksummed chunk of a data file: [start, start + len) must hash to sum. */
typedef struct {
    uint64_t start, len, sum;
    const char *what; /* the tensor's or blob's name */
} cchunk;

/* A block of a data file copied in one read and one write: chunks [c0, c1) lie in it. */
typedef struct {
    uint64_t start, len;
    size_t c0, c1;
} cblock;

typedef struct {
    const st_dir *src;
    const st_vfs *dv;
    cprogress *pr;
    const char *sname, *dname; /* the file's full paths */
    st_file *in, *out;
    cchunk *ck;
    cblock *bl;
    size_t nbl;
    size_t bufcap;
    atomic_size_t next;
    atomic_uint_fast64_t calls;
    pthread_mutex_t mu;
    atomic_int rc;  /* the first failure (the others stop at their next block) */
    char msg[ST_ERR_BYTES]; /* its message (thread-local where it happened), under mu */
} cfile;

static int cmp_chunk(const void *a, const void *b)
{
    const cchunk *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

static void add_extent(cchunk *ck, size_t *n, const st_extent *e, uint32_t chunk,
                       const char *what)
{
    uint64_t nc = st_nchunks(e->bytes, chunk);
    for (uint64_t i = 0; i < nc; i++) {
        uint64_t a = (uint64_t)i * chunk, len = e->bytes - a < chunk ? e->bytes - a : chunk;
        ck[(*n)++] = (cchunk){e->offset + a, len, e->sums[i], what};
    }
}

/* The chunks of file f, sorted (*out, *n). */
static int file_chunks(const st_meta *m, uint32_t f, cchunk **out, size_t *n)
{
    size_t cap = 0;
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++)
            if (m->tensors[t].shards[s].ext.file == f)
                cap += st_nchunks(m->tensors[t].shards[s].ext.bytes, m->chunk);
    for (size_t b = 0; b < m->nblobs; b++)
        if (m->blobs[b].ext.file == f)
            cap += st_nchunks(m->blobs[b].ext.bytes, m->chunk);
    cchunk *ck = malloc((cap ? cap : 1) * sizeof *ck);
    if (!ck)
        return st_fail(STRATA_ENOMEM, "out of memory");
    *n = 0;
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++)
            if (m->tensors[t].shards[s].ext.file == f)
                add_extent(ck, n, &m->tensors[t].shards[s].ext, m->chunk, m->tensors[t].name);
    for (size_t b = 0; b < m->nblobs; b++)
        if (m->blobs[b].ext.file == f)
            add_extent(ck, n, &m->blobs[b].ext, m->chunk, m->blobs[b].name);
    qsort(ck, *n, sizeof *ck, cmp_chunk);
    *out = ck;
    return 0;
}

/* Cuts [0, size) into blocks of about st_copy_block bytes, none cutting through a chunk. */
static int file_blocks(cfile *c, const cchunk *ck, size_t n, uint64_t size)
{
    uint64_t block = st_copy_block;
    size_t cap = (size_t)(size / block) + n / 2 + 2, ci = 0;
    if (!(c->bl = malloc(cap * sizeof *c->bl)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    c->nbl = 0;
    for (uint64_t pos = 0; pos < size;) {
        uint64_t end = size - pos < block ? size : pos + block;
        size_t c1 = ci;
        while (c1 < n && ck[c1].start + ck[c1].len <= end)
            c1++;
        if (c1 < n && ck[c1].start < end) { /* a chunk crosses end */
            if (ck[c1].start > pos)
                end = ck[c1].start;
            else
                end = ck[c1].start + ck[c1].len, c1++;
        }
        if (c->nbl == cap) {
            cblock *nb = realloc(c->bl, 2 * cap * sizeof *nb);
            if (!nb)
                return st_fail(STRATA_ENOMEM, "out of memory");
            c->bl = nb;
            cap *= 2;
        }
        c->bl[c->nbl++] = (cblock){pos, end - pos, ci, c1};
        if (end - pos > c->bufcap)
            c->bufcap = end - pos;
        ci = c1;
        pos = end;
    }
    return 0;
}

static void set_rc(cfile *c, int rc)
{
    pthread_mutex_lock(&c->mu);
    if (!atomic_load(&c->rc)) {
        st_err_keep(c->msg, rc);
        atomic_store(&c->rc, rc);
    }
    pthread_mutex_unlock(&c->mu);
}

static int copy_block(cfile *c, const cblock *b, char *buf)
{
    const st_vfs *sv = c->src->vfs;
    int64_t got = 0;
    for (uint64_t at = 0; at < b->len; at += (uint64_t)got) {
        got = sv->pread(c->in, buf + at, (size_t)(b->len - at), b->start + at);
        atomic_fetch_add(&c->calls, 1);
        if (got <= 0)
            return st_fail(got == 0 ? STRATA_EFORMAT : st_from_errno((int)-got),
                           "copying '%s': reading %llu bytes at %llu: %s", c->sname,
                           (unsigned long long)(b->len - at),
                           (unsigned long long)(b->start + at),
                           got == 0 ? "the file is shorter than its metadata says"
                                    : strerror((int)-got));
    }
    for (size_t i = b->c0; i < b->c1; i++) {
        const cchunk *k = &c->ck[i];
        if (st_hash(buf + (k->start - b->start), (size_t)k->len) != k->sum)
            return st_fail(STRATA_ECHECKSUM, "copying '%s': checksum mismatch in '%s' at byte "
                           "%llu (%llu bytes): the source is corrupt; nothing is committed "
                           "at the destination", c->sname, k->what,
                           (unsigned long long)k->start, (unsigned long long)k->len);
    }
    int e = st_vfs_write_full(c->dv, c->out, buf, (size_t)b->len, b->start);
    atomic_fetch_add(&c->calls, 1);
    if (e)
        return st_fail(st_from_errno(-e), "copying to '%s': %s", c->dname, strerror(-e));
    return progress(c->pr, b->len);
}

static void *copy_main(void *arg)
{
    cfile *c = arg;
    char *buf = NULL;
    for (size_t i; !atomic_load(&c->rc) && (i = atomic_fetch_add(&c->next, 1)) < c->nbl;) {
        if (!buf && !(buf = st_io_alloc(c->bufcap))) {
            set_rc(c, st_fail(STRATA_ENOMEM, "out of memory for a copy buffer of %zu bytes",
                              c->bufcap));
            break;
        }
        int rc = copy_block(c, &c->bl[i], buf);
        if (rc)
            set_rc(c, rc);
    }
    st_io_free(buf, c->bufcap);
    return NULL;
}

/* Copies data file f of d into directory dst of dv (open, blocks, sync, close). */
static int copy_file(const st_dir *d, uint32_t f, const st_vfs *dv, const char *dst,
                     cprogress *pr, uint64_t *calls)
{
    const st_meta *m = d->meta;
    char sname[PATH_MAX], dname[PATH_MAX];
    int rc = st_path_join(sname, d->path, m->files[f].name);
    if (!rc)
        rc = st_path_join(dname, dst, m->files[f].name);
    if (rc)
        return rc;
    cfile c = {.src = d, .dv = dv, .pr = pr, .sname = sname, .dname = dname};
    size_t n = 0;
    pthread_mutex_init(&c.mu, NULL);
    if ((rc = file_chunks(m, f, &c.ck, &n)) || (rc = file_blocks(&c, c.ck, n, m->files[f].bytes)))
        goto done;
    int e = d->vfs->open(d->vfs, sname, ST_O_READ, &c.in);
    if (e) {
        c.in = NULL;
        rc = st_fail(st_from_errno(-e), "copying '%s': %s", sname, strerror(-e));
        goto done;
    }
    if ((e = dv->open(dv, dname, ST_O_WRITE, &c.out))) {
        c.out = NULL;
        rc = st_fail(st_from_errno(-e), "copying to '%s': %s", dname, strerror(-e));
        goto done;
    }
    pthread_t th[COPY_THREADS];
    int nth = 0;
    for (; nth < COPY_THREADS && (size_t)nth < c.nbl; nth++)
        if (pthread_create(&th[nth], NULL, copy_main, &c))
            break;
    if (nth == 0 && c.nbl)
        copy_main(&c);
    for (int i = 0; i < nth; i++)
        pthread_join(th[i], NULL);
    rc = atomic_load(&c.rc) ? st_fail(atomic_load(&c.rc), "%s", c.msg) : 0;
    if (!rc && (e = dv->sync(c.out)))
        rc = st_fail(st_from_errno(-e), "copying to '%s': %s", dname, strerror(-e));
done:
    if (c.out) {
        e = dv->close(c.out); /* a multipart upload completes here (aborted after a failure) */
        if (!rc && e)
            rc = st_fail(st_from_errno(-e), "copying to '%s': %s", dname, strerror(-e));
    }
    if (c.in)
        d->vfs->close(c.in);
    *calls += atomic_load(&c.calls);
    pthread_mutex_destroy(&c.mu);
    free(c.ck);
    free(c.bl);
    return rc;
}

int strata_copy(strata_stats *stats, const char *src_uri, const char *dst_uri, unsigned flags)
{
    strata_copy_opts o = STRATA_COPY_OPTS_INIT;
    o.flags = flags;
    return strata_copy_ext(stats, src_uri, dst_uri, &o);
}

int strata_copy_ext(strata_stats *stats, const char *src_uri, const char *dst_uri,
                    const strata_copy_opts *opts)
{
    st_clear_error();
    double t0 = st_now();
    strata_copy_opts o = STRATA_COPY_OPTS_INIT;
    int rc = st_stats_check(stats);
    if (rc)
        return rc;
    if (opts && opts->version != STRATA_COPY_OPTS_VERSION)
        return st_fail(STRATA_EINVAL, "strata_copy_opts.version %d is not %d", opts->version,
                       STRATA_COPY_OPTS_VERSION);
    if (opts)
        o = *opts;
    if (!src_uri || !dst_uri)
        return st_fail(STRATA_EINVAL, "strata_copy: %s is NULL", src_uri ? "dst_uri" : "src_uri");
    if (o.flags)
        return st_fail(STRATA_EINVAL, "strata_copy: unknown flags 0x%x", o.flags);
    st_dir d;
    if ((rc = st_dir_open(&d, src_uri, 0)))
        return rc;
    if (d.src != &st_source_strata || d.meta->foreign) {
        rc = st_fail(STRATA_ENOTSUP, "strata_copy: '%s' is a %s checkpoint: only strata's own "
                     "are copied (export or load it instead)", src_uri, d.src->name);
        st_dir_close(&d);
        return rc;
    }
    const st_vfs *dv = NULL;
    char dst[PATH_MAX];
    st_file *lock = NULL;
    uint64_t save_id = st_save_id_new(), calls = 0, bytes = 0;
    if ((rc = st_vfs_resolve(dst_uri, &dv, dst, sizeof dst))) {
        st_dir_close(&d);
        return rc;
    }
    cprogress pr = {.o = &o};
    pthread_mutex_init(&pr.mu, NULL);
    for (uint32_t f = 0; f < d.meta->nfiles; f++)
        pr.total += d.meta->files[f].bytes;
    if (!(rc = st_prepare_dir(dv, dst, &lock))) {
        rc = progress(&pr, 0);
        for (uint32_t f = 0; f < d.meta->nfiles && !rc; f++) {
            rc = copy_file(&d, f, dv, dst, &pr, &calls);
            bytes += d.meta->files[f].bytes;
        }
        if (!rc)
            rc = st_commit_dir(dv, dst, d.meta, 1, save_id);
        if (rc) {
            st_remove_failed(dv, dst, 1, save_id);
            st_own_release(dv, lock);
        } else {
            st_own_committed(dv, dst, lock);
        }
    }
    if (!rc && stats) {
        strata_stats full = STRATA_STATS_INIT;
        full.data_bytes = d.meta->data_bytes;
        full.bytes = full.max_writer_bytes = bytes;
        full.io_calls = calls;
        full.writers = 1;
        full.seconds = st_now() - t0;
        st_stats_put(stats, &full);
    }
    pthread_mutex_destroy(&pr.mu);
    st_dir_close(&d);
    st_vfs_release(dv);
    return rc;
}
