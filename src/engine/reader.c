/* reader.c - executes a load plan's reads on the I/O threads: pread into a scratch buffer,
 * verify each checksum chunk, scatter the runs it holds. Threading: one read per task;
 * tasks write disjoint destination bytes (or the same bytes with the same values, for
 * overlapping requests). */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "engine.h"

typedef struct {
    const st_dir *d;
    const st_load_plan *p;
    st_file **files;    /* per metadata file, NULL if not needed */
    void **buf;         /* per worker */
    size_t bufsize;
    strata_verify_cb report;
    void *ctx;
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

static int run_read(void *arg, size_t task, int worker)
{
    exec_ctx *x = arg;
    const st_load_plan *p = x->p;
    const st_read *rd = &p->reads[task];
    const st_meta *m = p->meta;
    const char *fname = m->files[rd->file].name;
    const uint64_t C = m->chunk;
    if (!x->buf[worker] && !(x->buf[worker] = st_scratch_get(x->bufsize)))
        return st_fail(STRATA_ENOMEM, "out of memory for a read buffer");
    char *buf = x->buf[worker];
    int64_t got = st_vfs_read_full(x->d->vfs, x->files[rd->file], buf, rd->len, rd->off);
    if (got < 0)
        return st_fail(st_from_errno((int)-got), "reading '%s' at byte %llu: %s", fname,
                       (unsigned long long)rd->off, strerror((int)-got));
    for (size_t si = rd->seg0; si < rd->seg1; si++) {
        const st_seg *s = &p->segs[si];
        const st_extent *e = p->ext[s->piece];
        const char *obj = p->object[s->piece];
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
        /* scatter the runs that overlap [lo, hi) of this extent */
        uint64_t lo = s->c0 * C, hi = ST_MIN(s->c1 * C, e->bytes);
        size_t a = p->run0[s->piece], b = p->run0[s->piece + 1];
        uint64_t from = lo > p->maxrun[s->piece] ? lo - p->maxrun[s->piece] : 0;
        while (a < b) { /* first run with src >= from */
            size_t mid = a + (b - a) / 2;
            if (p->runs[mid].src < from)
                a = mid + 1;
            else
                b = mid;
        }
        for (size_t r = a; r < p->run0[s->piece + 1] && p->runs[r].src < hi; r++) {
            const st_run *run = &p->runs[r];
            if (run->rank < 0)
                continue;
            uint64_t x0 = ST_MAX(run->src, lo), x1 = ST_MIN(run->src + run->n, hi);
            if (x0 < x1)
                memcpy(st_run_dst(run, p->ranks) + (x0 - run->src),
                       buf + (e->offset + x0 - rd->off), x1 - x0);
        }
    }
    return 0;
}

int st_exec_reads(const st_dir *d, const st_load_plan *p, int threads, int no_direct,
                  uint64_t max_io, strata_verify_cb report, void *ctx, uint64_t *bytes_read)
{
    const st_meta *m = p->meta;
    const st_vfs *v = d->vfs;
    int nt = st_io_threads(threads);
    exec_ctx x = {.d = d, .p = p, .report = report, .ctx = ctx};
    x.bufsize = (size_t)ST_ALIGN_UP(ST_MAX(max_io, m->chunk) + ST_ALIGN, ST_ALIGN);
    x.files = calloc(m->nfiles + 1, sizeof *x.files);
    x.buf = calloc((size_t)nt, sizeof *x.buf);
    int rc = 0;
    if (!x.files || !x.buf) {
        free(x.files);
        free(x.buf);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&x.mu, NULL);
    for (size_t i = 0; i < p->nreads && !rc; i++) {
        uint32_t f = p->reads[i].file;
        if (x.files[f])
            continue;
        char path[PATH_MAX];
        if ((rc = st_path_join(path, d->path, m->files[f].name)))
            break;
        int e = v->open(v, path, ST_O_READ | (no_direct ? 0 : ST_O_DIRECT), &x.files[f]);
        if (e) {
            x.files[f] = NULL;
            rc = st_fail(e == -ENOENT ? STRATA_ENOENT : st_from_errno(-e),
                         "data file '%s' of checkpoint '%s' %s", m->files[f].name, d->path,
                         e == -ENOENT ? "is missing" : strerror(-e));
        }
    }
    if (!rc)
        rc = st_parallel(nt, p->nreads, run_read, &x);
    if (!rc && x.bad)
        rc = st_fail(STRATA_ECHECKSUM, "%d corrupt chunk(s)", x.bad);
    for (int i = 0; i < nt; i++)
        st_scratch_put(x.buf[i], x.bufsize);
    for (size_t f = 0; f < m->nfiles; f++)
        if (x.files[f])
            v->close(x.files[f]);
    pthread_mutex_destroy(&x.mu);
    free(x.files);
    free(x.buf);
    if (!rc && bytes_read)
        *bytes_read = p->payload_bytes;
    return rc;
}
