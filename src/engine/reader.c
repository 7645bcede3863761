/* reader.c - executes a load plan's reads on the I/O threads: pread into a scratch buffer,
 * verify each checksum chunk, scatter the runs it holds. Threading: one read per task;
 * tasks write disjoint destination bytes (or the same bytes with the same values, for
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
    st_file **files;    /* per metadata file, NULL if not needed */
    const size_t *list; /* reads to do (NULL: all) */
    char **bufs;        /* per listed read (NULL: per worker scratch in buf) */
    void **buf;         /* per worker */
    size_t bufsize;
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
        /* runs are sorted by src and none is longer than maxrun: the first that can reach
         * lo starts at or after lo - maxrun */
        size_t a = p->run0[s->piece], b = p->run0[s->piece + 1];
        uint64_t from = lo > p->maxrun[s->piece] ? lo - p->maxrun[s->piece] : 0;
        while (a < b) {
            size_t mid = a + (b - a) / 2;
            if (p->runs[mid].src < from)
                a = mid + 1;
            else
                b = mid;
        }
        for (size_t r = a; r < p->run0[s->piece + 1] && p->runs[r].src < hi; r++) {
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

static int run_read(void *arg, size_t task, int worker)
{
    exec_ctx *x = arg;
    const st_io_plan *p = x->p;
    const st_io *rd = &p->ios[x->list ? x->list[task] : task];
    const st_meta *m = p->meta;
    const char *fname = m->files[rd->file].name;
    const uint64_t C = m->chunk;
    if (!x->bufs && !x->buf[worker] && !(x->buf[worker] = st_scratch_get(x->bufsize)))
        return st_fail(STRATA_ENOMEM, "out of memory for a read buffer");
    char *raw = x->bufs ? x->bufs[task] : x->buf[worker];
    /* from the aligned start before rd->off to the aligned end after it: O_DIRECT-able */
    uint64_t shift = st_read_shift(rd);
    int64_t got = st_vfs_read_full(x->d->vfs, x->files[rd->file], raw,
                                   ST_ALIGN_UP(shift + rd->len, ST_ALIGN), rd->off - shift);
    if (got < 0)
        return st_fail(st_from_errno((int)-got), "reading '%s' at byte %llu: %s", fname,
                       (unsigned long long)rd->off, strerror((int)-got));
    got = got < (int64_t)shift ? 0 : got - (int64_t)shift; /* bytes from rd->off on */
    char *buf = raw + shift;
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

int st_open_data_files(const st_dir *d, const st_io_plan *p, int no_direct, st_file ***out)
{
    const st_meta *m = p->meta;
    const st_vfs *v = d->vfs;
    st_file **files = calloc(m->nfiles + 1, sizeof *files);
    if (!files)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < p->nios && !rc; i++) {
        uint32_t f = p->ios[i].file;
        if (files[f])
            continue;
        char path[PATH_MAX];
        if ((rc = st_path_join(path, d->path, m->files[f].name)))
            break;
        int direct = !no_direct;
        int e = v->open(v, path,
                        ST_O_READ | (direct ? ST_O_DIRECT : 0) | (m->foreign ? ST_O_FOLLOW : 0),
                        &files[f]);
        if (e) {
            files[f] = NULL;
            rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e),
                         "data file '%s' of checkpoint '%s'%s%s", m->files[f].name, d->path,
                         e == -ENOENT || e == -ST_ENOTREG ? " " : ": ",
                         e == -ENOENT      ? "is missing"
                         : e == -ST_ENOTREG ? "is not a regular file (a FIFO, a device or a "
                                              "directory in its place)"
                                            : strerror(-e));
        } else if (m->idents) {
            rc = st_check_same_file(d, &m->files[f], &m->idents[f], files[f]);
        }
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
    for (size_t f = 0; files && f < p->meta->nfiles; f++)
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
    if (!bufs) { /* a scratch buffer per worker, as st_exec_reads */
        x.bufsize = st_read_buf_bytes(p->meta, max_io);
        if (!(x.buf = calloc((size_t)nt, sizeof *x.buf)))
            return st_fail(STRATA_ENOMEM, "out of memory");
    }
    int rc = st_parallel(nt, n, run_read, &x);
    for (int i = 0; x.buf && i < nt; i++)
        st_scratch_put(x.buf[i], x.bufsize);
    free(x.buf);
    return rc;
}

int st_exec_reads(const st_dir *d, const st_io_plan *p, int threads, int no_direct,
                  uint64_t max_io, strata_verify_cb report, void *ctx, st_crc_run *crc,
                  uint64_t *bytes_read)
{
    const st_meta *m = p->meta;
    int nt = st_io_threads(threads);
    exec_ctx x = {.d = d, .p = p, .report = report, .ctx = ctx, .only_rank = -1, .crc = crc};
    x.bufsize = st_read_buf_bytes(m, max_io);
    x.buf = calloc((size_t)nt, sizeof *x.buf);
    if (!x.buf)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = st_open_data_files(d, p, no_direct, &x.files);
    if (rc) {
        free(x.buf);
        return rc;
    }
    pthread_mutex_init(&x.mu, NULL);
    rc = st_parallel(nt, p->nios, run_read, &x);
    if (!rc && x.bad)
        rc = st_fail(STRATA_ECHECKSUM, "%d corrupt chunk(s)", x.bad);
    for (int i = 0; i < nt; i++)
        st_scratch_put(x.buf[i], x.bufsize);
    st_close_data_files(d, p, x.files);
    pthread_mutex_destroy(&x.mu);
    free(x.buf);
    if (!rc && bytes_read)
        *bytes_read = p->payload_bytes;
    return rc;
}
