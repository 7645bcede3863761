/* reader.c - executes a load plan's reads on double-buffered I/O lanes (st_pipeline): one
 * thread of a lane preads into one of its two buffers while the other verifies each
 * checksum chunk of the other buffer and scatters the runs it holds. Threading: one read per
 * task; tasks write disjoint destination bytes (or the same bytes with the same values, for
 * overlapping requests). */
#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/convert.h"
#include "../core/error.h"
#include "../io/cuda.h"
#include "../io/pool.h"
#include "engine.h"

typedef struct {
    const st_dir *d;
    const st_io_plan *p;
    st_file **files;    /* st_open_data_files': per metadata file, private then shared */
    const size_t *list; /* reads to do (NULL: all) */
    char **bufs;        /* per listed read (NULL: the pipeline's buffers) */
    int only_rank;      /* scatter only this rank's runs (-1: all) */
    strata_verify_cb report;
    void *ctx;
    st_crc_run *crc;    /* the format's CRC-32 checks (NULL: none) */
    pthread_mutex_t mu; /* serialises report calls */
    int bad;
} exec_ctx;

static void bad_chunk(exec_ctx *x, const char *object, const char *file, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void bad_chunk(exec_ctx *x, const char *object, const char *file, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&x->mu);
    x->bad++;
    x->report(x->ctx, object, file, msg);
    pthread_mutex_unlock(&x->mu);
}

void st_walk_read(const st_io_plan *p, size_t i, st_walk_fn fn, void *ctx)
{
    const st_io *rd = &p->ios[i];
    const uint64_t C = p->meta->chunk;
    for (size_t si = rd->seg0; si < rd->seg1; si++) {
        const st_seg *s = &p->segs[si];
        const st_extent *e = p->ext[s->piece];
        uint64_t lo = s->c0 * C, hi = ST_MIN(s->c1 * C, e->bytes);
        for (size_t r = st_io_first_run(p, s->piece, lo); r < p->run0[s->piece + 1] && p->runs[r].src < hi; r++) {
            const st_run *run = &p->runs[r];
            uint64_t x0 = ST_MAX(run->src, lo), x1 = ST_MIN(run->src + run->n, hi);
            if (x0 < x1)
                fn(ctx, run, x0, x1, e->offset + x0 - rd->off);
        }
    }
}

typedef struct {
    const st_io_plan *p;
    const char *buf;
    int only_rank;
    int rc;
} scatter_ctx;

/* The most host memory a conversion into device memory stages at a time. */
#define CAST_STAGE ((size_t)1 << 20)

int st_deliver(const st_io_plan *p, const st_run *run, uint64_t x0, uint64_t x1,
               const void *src)
{
    strata_dtype from = p->dtype[run->piece], to = st_run_dtype(run, p->ranks);
    int device = st_run_device(run, p->ranks);
    if (from == to) {
        char *dst = st_run_dst(run, p->ranks) + (x0 - run->src);
        if (device)
            return st_cuda_copy(dst, src, x1 - x0, 0);
        memcpy(dst, src, x1 - x0);
        return 0;
    }
    size_t ss = strata_dtype_size(from), ds = strata_dtype_size(to);
    assert((x0 - run->src) % ss == 0 && (x1 - x0) % ss == 0);
    char *dst = st_run_dst(run, p->ranks) + (x0 - run->src) / ss * ds;
    uint64_t n = (x1 - x0) / ss;
    if (!device) {
        st_convert(dst, to, src, from, n);
        return 0;
    }
    /* device memory: convert in host memory, a bounded piece at a time */
    uint64_t per = CAST_STAGE / ds, k = ST_MIN(n, per);
    void *stage = malloc(k * ds);
    if (!stage)
        return st_fail(STRATA_ENOMEM, "out of memory for a conversion buffer");
    int rc = 0;
    for (uint64_t i = 0; i < n && !rc; i += k) {
        k = ST_MIN(n - i, per);
        st_convert(stage, to, (const char *)src + i * ss, from, k);
        rc = st_cuda_copy(dst + i * ds, stage, k * ds, 0);
    }
    free(stage);
    return rc;
}

static void scatter_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    scatter_ctx *c = ctx;
    if (run->rank < 0 || (c->only_rank >= 0 && run->rank != c->only_rank))
        return;
    int rc = st_deliver(c->p, run, x0, x1, c->buf + at);
    if (rc && !c->rc)
        c->rc = rc;
}

static const st_io *task_read(const exec_ctx *x, size_t task)
{
    return &x->p->ios[x->list ? x->list[task] : task];
}

/* The first stage: the read, from the ST_ALIGN boundary before rd->off to the one after its
 * end (O_DIRECT-able); *got: the bytes from rd->off on. */
static int read_stage(void *arg, size_t task, void *raw, int64_t *got)
{
    exec_ctx *x = arg;
    const st_io *rd = task_read(x, task);
    const st_meta *m = x->p->meta;
    st_file *f = x->files[rd->file + (rd->flags & ST_IO_SHARED ? m->nfiles : 0)];
    uint64_t shift = st_read_shift(rd);
    int64_t n = st_vfs_read_full(x->d->vfs, f, raw, ST_ALIGN_UP(shift + rd->len, ST_ALIGN),
                                 rd->off - shift);
    if (n < 0)
        return st_fail(st_from_errno((int)-n), "reading '%s' at byte %llu: %s",
                       m->files[rd->file].name, (unsigned long long)rd->off, strerror((int)-n));
    *got = n < (int64_t)shift ? 0 : n - (int64_t)shift;
    return 0;
}

/* The second stage: every chunk of the read verified, then its runs scattered. */
static int check_stage(void *arg, size_t task, void *raw, int64_t *pgot)
{
    exec_ctx *x = arg;
    const st_io_plan *p = x->p;
    const st_io *rd = task_read(x, task);
    const st_meta *m = p->meta;
    const char *fname = m->files[rd->file].name;
    const uint64_t C = m->chunk;
    const int64_t got = *pgot;
    const char *buf = (const char *)raw + st_read_shift(rd);
    for (size_t si = rd->seg0; si < rd->seg1; si++) {
        const st_seg *s = &p->segs[si];
        const st_extent *e = p->ext[s->piece];
        const char *obj = p->object[s->piece];
        if (!e->sums) { /* a foreign source: no checksums; only a short file shows */
            uint64_t end = e->offset + ST_MIN(s->c1 * C, e->bytes) - rd->off;
            if (end <= (uint64_t)got)
                continue;
            if (x->report) {
                bad_chunk(x, obj, fname, "bytes %llu..%llu: the file is truncated",
                          (unsigned long long)(e->offset + s->c0 * C),
                          (unsigned long long)(rd->off + end));
                continue;
            }
            return st_fail(STRATA_EFORMAT,
                           "tensor '%s': file '%s' is truncated (it ends at byte %llu, the "
                           "tensor's data at %llu)",
                           obj, fname, (unsigned long long)(rd->off + (uint64_t)got),
                           (unsigned long long)(rd->off + end));
        }
        for (uint64_t c = s->c0; c < s->c1; c++) {
            uint64_t lo = c * C, n = ST_MIN(C, e->bytes - lo);
            uint64_t at = e->offset + lo - rd->off;
            if (at + n > (uint64_t)got) {
                if (x->report) {
                    bad_chunk(x, obj, fname, "chunk %llu at byte %llu: data file is truncated",
                              (unsigned long long)c, (unsigned long long)(e->offset + lo));
                    continue;
                }
                return st_fail(STRATA_ECHECKSUM,
                               "tensor '%s': data file '%s' is truncated (chunk %llu at byte "
                               "%llu is missing)",
                               obj, fname, (unsigned long long)c,
                               (unsigned long long)(e->offset + lo));
            }
            if (st_hash(buf + at, n) != e->sums[c]) {
                if (x->report) {
                    bad_chunk(x, obj, fname, "chunk %llu at byte %llu: checksum mismatch",
                              (unsigned long long)c, (unsigned long long)(e->offset + lo));
                    continue;
                }
                return st_fail(STRATA_ECHECKSUM,
                               "tensor '%s': checksum mismatch in data file '%s' (chunk %llu, "
                               "bytes %llu..%llu)",
                               obj, fname, (unsigned long long)c,
                               (unsigned long long)(e->offset + lo),
                               (unsigned long long)(e->offset + lo + n));
            }
        }
    }
    /* a zip entry's CRC-32: taken here, compared before the scatter where this read
     * completes it */
    if (x->crc) {
        int rc = st_crc_take(x->crc, x->d, (size_t)(rd - p->ios), buf, (uint64_t)got);
        if (rc)
            return rc;
    }
    /* verify-only plans have no destinations */
    if (p->ranks) {
        scatter_ctx sc = {p, buf, x->only_rank, 0};
        st_walk_read(p, (size_t)(rd - p->ios), scatter_run, &sc);
        if (sc.rc)
            return sc.rc;
    }
    return 0;
}

/* Both stages on the caller's thread, into the read's own buffer (x->bufs). */
static int run_read(void *arg, size_t task, int worker)
{
    (void)worker;
    exec_ctx *x = arg;
    int64_t got = 0;
    int rc = read_stage(x, task, x->bufs[task], &got);
    return rc ? rc : check_stage(x, task, x->bufs[task], &got);
}

/* Opens file f of d for reading into *out (how: ST_O_DIRECT where the filesystem takes it,
 * ST_O_EXACT for shared reads, or 0), checking a foreign file's identity. */
static int open_data_file(const st_dir *d, uint32_t f, int how, st_file **out)
{
    const st_meta *m = d->meta;
    const st_vfs *v = d->vfs;
    char path[PATH_MAX];
    int rc = st_path_join(path, d->path, m->files[f].name);
    if (rc)
        return rc;
    int e = v->open(v, path, ST_O_READ | how | (m->foreign ? ST_O_FOLLOW : 0), out);
    if (e) {
        *out = NULL;
        return st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e),
                       "data file '%s' of checkpoint '%s'%s%s", m->files[f].name, d->path,
                       e == -ENOENT || e == -ST_ENOTREG ? " " : ": ",
                       e == -ENOENT      ? "is missing"
                       : e == -ST_ENOTREG ? "is not a regular file (a FIFO, a device or a "
                                            "directory in its place)"
                                          : strerror(-e));
    }
    return m->idents ? st_check_same_file(d, &m->files[f], &m->idents[f], *out) : 0;
}

int st_open_data_files(const st_dir *d, const st_io_plan *p, int no_direct, st_file ***out)
{
    const uint32_t nf = p->meta->nfiles;
    st_file **files = calloc(2 * (size_t)nf + 1, sizeof *files);
    if (!files)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < p->nios && !rc; i++) {
        int shared = (p->ios[i].flags & ST_IO_SHARED) != 0;
        uint32_t f = p->ios[i].file;
        if (!files[f + (shared ? nf : 0)])
            rc = open_data_file(d, f, shared ? ST_O_EXACT : no_direct ? 0 : ST_O_DIRECT,
                                &files[f + (shared ? nf : 0)]);
    }
    if (rc) {
        st_close_data_files(d, p, files);
        return rc;
    }
    *out = files;
    return 0;
}

void st_close_data_files(const st_dir *d, const st_io_plan *p, st_file **files)
{
    for (size_t f = 0; files && f < 2 * (size_t)p->meta->nfiles; f++)
        if (files[f])
            d->vfs->close(files[f]);
    free(files);
}

int st_read_some(const st_dir *d, const st_io_plan *p, st_file **files, const size_t *list,
                 size_t n, char **bufs, int threads, int only_rank, uint64_t max_io,
                 st_crc_run *crc)
{
    int nt = st_io_threads(threads);
    exec_ctx x = {.d = d, .p = p, .files = files, .list = list, .bufs = bufs,
                  .only_rank = only_rank, .crc = crc};
    if (bufs) /* the bytes stay in the caller's buffers after the call */
        return st_parallel(nt, n, run_read, &x);
    return st_pipeline(nt, n, st_read_buf_bytes(p->meta, max_io), read_stage, check_stage, &x);
}

int st_exec_reads(const st_dir *d, const st_io_plan *p, int threads, int no_direct,
                  uint64_t max_io, strata_verify_cb report, void *ctx, st_crc_run *crc,
                  uint64_t *bytes_read)
{
    exec_ctx x = {.d = d, .p = p, .report = report, .ctx = ctx, .only_rank = -1, .crc = crc};
    int rc = st_open_data_files(d, p, no_direct, &x.files);
    if (rc)
        return rc;
    pthread_mutex_init(&x.mu, NULL);
    rc = st_pipeline(st_io_threads(threads), p->nios, st_read_buf_bytes(p->meta, max_io),
                     read_stage, check_stage, &x);
    if (!rc && x.bad)
        rc = st_fail(STRATA_ECHECKSUM, "%d corrupt chunk(s)", x.bad);
    st_close_data_files(d, p, x.files);
    pthread_mutex_destroy(&x.mu);
    if (!rc && bytes_read)
        *bytes_read = p->payload_bytes;
    return rc;
}
