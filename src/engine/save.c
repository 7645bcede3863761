/* save.c - strata_save: plan, write data files on double-buffered I/O lanes (copy into a
 * huge-page staging buffer and checksum each chunk, while the lane's other buffer is
 * written), then metadata, then the commit record.
 * Threading: tasks write disjoint, aligned byte ranges of the data files. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/cuda.h"
#include "../io/pool.h"
#include "engine.h"


typedef struct {
    const st_vfs *v;
    const st_save_plan *sp;
    st_io_plan lay;  /* the writes, expressed as segments and coalesced file ranges */
    st_file **files;
    const char *dir;
} save_ctx;

/* The checksum of chunk c of piece pc, whose n bytes are at p; with the metadata's second
 * checksums (an incremental save's) both in one pass. */
static void hash_chunk(const st_save_plan *sp, const st_piece *pc, uint64_t c,
                       const unsigned char *p, uint64_t n)
{
    if (sp->meta->write2)
        st_hash_both(p, n, &pc->ext->sums[c],
                     &pc->ext->sums[st_nchunks(pc->bytes, sp->meta->chunk) + c]);
    else
        pc->ext->sums[c] = st_hash(p, n);
}

void st_hash_write(const st_io_plan *lay, const st_save_plan *sp, size_t task,
                   const unsigned char *buf)
{
    const st_io *w = &lay->ios[task];
    const uint64_t C = sp->meta->chunk;
    for (size_t si = w->seg0; si < w->seg1; si++) {
        const st_seg *s = &lay->segs[si];
        const st_piece *pc = &sp->pieces[s->piece];
        for (uint64_t c = s->c0; c < s->c1; c++) {
            uint64_t lo = c * C;
            hash_chunk(sp, pc, c, buf + pc->offset + lo - w->off, ST_MIN(C, pc->bytes - lo));
        }
    }
}

int st_fill_write(const st_io_plan *lay, const st_save_plan *sp, size_t task,
                  unsigned char *buf, int hash)
{
    const st_io *w = &lay->ios[task];
    const uint64_t C = sp->meta->chunk;
    uint64_t pos = 0; /* bytes of buf filled */
    int device = 0, rc = 0;
    /* host chunks are copied and hashed in one pass; device chunks are enqueued on this
     * thread's stream and hashed once they have all arrived */
    for (size_t si = w->seg0; si < w->seg1 && !rc; si++) {
        const st_seg *s = &lay->segs[si];
        const st_piece *pc = &sp->pieces[s->piece];
        uint64_t at = pc->offset + s->c0 * C - w->off;
        memset(buf + pos, 0, at - pos); /* alignment padding between extents */
        if (pc->device) { /* the segment's chunks are contiguous: one copy */
            uint64_t lo = s->c0 * C, hi = ST_MIN(s->c1 * C, pc->bytes);
            device = 1;
            if ((rc = st_cuda_copy_async(buf + at, (const unsigned char *)pc->src + lo, hi - lo)))
                rc = st_wrap(rc, "tensor '%s'", pc->object);
            pos = at + hi - lo;
            continue;
        }
        for (uint64_t c = s->c0; c < s->c1; c++) {
            uint64_t lo = c * C, n = ST_MIN(C, pc->bytes - lo);
            unsigned char *dst = buf + pc->offset + lo - w->off;
            memcpy(dst, (const unsigned char *)pc->src + lo, n);
            if (hash)
                hash_chunk(sp, pc, c, dst, n);
            pos = pc->offset + lo + n - w->off;
        }
    }
    if (device) {
        int wrc = st_cuda_wait(); /* also after a failure: no copy may still land in buf */
        rc = rc ? rc : wrc;
    }
    for (size_t si = w->seg0; hash && device && !rc && si < w->seg1; si++) {
        const st_seg *s = &lay->segs[si];
        const st_piece *pc = &sp->pieces[s->piece];
        for (uint64_t c = s->c0; pc->device && c < s->c1; c++) {
            uint64_t lo = c * C;
            hash_chunk(sp, pc, c, buf + pc->offset + lo - w->off, ST_MIN(C, pc->bytes - lo));
        }
    }
    if (!rc)
        memset(buf + pos, 0, w->len - pos);
    return rc;
}

int st_write_task(const st_vfs *v, st_file *f, const char *dir, const char *name,
                  const st_io *w, const void *buf)
{
    int e = st_vfs_write_full(v, f, buf, w->len, w->off);
    if (e)
        return st_fail(st_from_errno(-e), "writing '%s/%s' at byte %llu: %s", dir, name,
                       (unsigned long long)w->off, strerror(-e));
    return 0;
}

/* The write tasks on double-buffered lanes: one thread copies a task's bytes into a buffer
 * and checksums them while the other writes the lane's other buffer. */
static int fill_stage(void *arg, size_t task, void *buf, int64_t *aux)
{
    (void)aux;
    save_ctx *x = arg;
    return st_fill_write(&x->lay, x->sp, task, buf, 1);
}

static int write_stage(void *arg, size_t task, void *buf, int64_t *aux)
{
    (void)aux;
    save_ctx *x = arg;
    const st_io *w = &x->lay.ios[task];
    return st_write_task(x->v, x->files[w->file], x->dir, x->sp->meta->files[w->file].name, w,
                         buf);
}

/* Lays the plan's pieces out as write tasks: whole chunks, file order, at most
 * ST_SAVE_TASK_BYTES each, reusing the load planner's segment/coalescing code. */
int st_layout_writes(st_io_plan *lay, const st_save_plan *sp, uint64_t task_bytes)
{
    memset(lay, 0, sizeof *lay);
    st_meta *m = sp->meta;
    lay->meta = m;
    lay->npieces = sp->npieces;
    lay->ext = malloc((sp->npieces + 1) * sizeof *lay->ext);
    lay->object = malloc((sp->npieces + 1) * sizeof *lay->object);
    lay->maxrun = calloc(sp->npieces + 1, sizeof *lay->maxrun);
    lay->run0 = calloc(sp->npieces + 2, sizeof *lay->run0);
    lay->runs = malloc((sp->npieces + 1) * sizeof *lay->runs);
    if (!lay->ext || !lay->object || !lay->maxrun || !lay->run0 || !lay->runs) {
        st_io_plan_free(lay);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < sp->npieces; i++) {
        lay->ext[i] = sp->pieces[i].ext;
        lay->object[i] = sp->pieces[i].object;
        if (sp->pieces[i].bytes)
            lay->runs[lay->nruns++] = (st_run){(uint32_t)i, -1, 0, 0, sp->pieces[i].bytes, 0};
    }
    int rc = st_plan_reads(lay, task_bytes);
    if (rc) {
        st_io_plan_free(lay);
        return rc;
    }
    /* Interleave the files (round robin) so that concurrent threads write different
     * files: filesystems serialise allocating direct writes to one inode. */
    st_io *r = malloc((lay->nios + 1) * sizeof *r);
    size_t *next = calloc(m->nfiles + 1, sizeof *next), *end = calloc(m->nfiles + 1, sizeof *end);
    if (!r || !next || !end) {
        free(r);
        free(next);
        free(end);
        st_io_plan_free(lay);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < lay->nios; i++) /* reads are sorted by file */
        end[lay->ios[i].file] = i + 1;
    for (size_t i = lay->nios; i-- > 0;)
        next[lay->ios[i].file] = i;
    for (size_t k = 0; k < lay->nios;)
        for (uint32_t f = 0; f < m->nfiles; f++)
            if (next[f] < end[f])
                r[k++] = lay->ios[next[f]++];
    free(lay->ios);
    lay->ios = r;
    free(next);
    free(end);
    return 0;
}

int st_create_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp, int direct,
                         st_file **files)
{
    int rc = 0;
    for (uint32_t f = 0; f < sp->meta->nfiles && !rc; f++) {
        char p[PATH_MAX];
        if (st_file_linked(sp->meta, f)) /* a base's file, linked by st_incr_link */
            continue;
        if ((rc = st_path_join(p, dir, sp->meta->files[f].name)))
            break;
        int e = v->open(v, p, ST_O_WRITE | (direct ? ST_O_DIRECT : 0), &files[f]);
        if (e) {
            files[f] = NULL;
            int kind;
            if (e == -ENOENT && v->stat(v, dir, NULL, &kind) != 0)
                rc = st_fail(STRATA_EIO, "the checkpoint directory '%s' was removed while the "
                             "save was writing it (by another process)", dir);
            else
                rc = st_fail(st_from_errno(-e), "creating '%s': %s", p, strerror(-e));
            break;
        }
        /* reserve the space first: a full disk fails here, before any data is written */
        e = v->allocate(files[f], sp->meta->files[f].bytes);
        if (e && e != -EOPNOTSUPP)
            rc = st_fail(st_from_errno(-e), "allocating %llu bytes for '%s': %s",
                         (unsigned long long)sp->meta->files[f].bytes, p, strerror(-e));
    }
    return rc;
}

int st_finish_data_files(const st_vfs *v, const char *dir, const st_save_plan *sp,
                         st_file **files, int sync, int rc)
{
    for (uint32_t f = 0; files && f < sp->meta->nfiles; f++) {
        if (!files[f])
            continue;
        int e = !rc && sync ? v->sync(files[f]) : 0;
        int ce = v->close(files[f]);
        files[f] = NULL;
        if (!rc && (e || ce))
            rc = st_fail(st_from_errno(e ? -e : -ce), "syncing '%s/%s': %s", dir,
                         sp->meta->files[f].name, strerror(e ? -e : -ce));
    }
    return rc;
}

int st_write_data(const st_vfs *v, const char *dir, const st_save_plan *sp,
                  const strata_save_opts *o, uint64_t *io_calls)
{
    save_ctx x = {.v = v, .sp = sp, .dir = dir};
    int rc = st_layout_writes(&x.lay, sp, ST_SAVE_TASK_BYTES);
    if (rc)
        return rc;
    /* a write task spans up to ST_SAVE_TASK_BYTES, or one whole chunk if chunks are larger */
    size_t bufsize = ST_MAX(ST_SAVE_TASK_BYTES, sp->meta->chunk);
    if (!(x.files = calloc(sp->meta->nfiles + 1, sizeof *x.files)))
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    if (!rc)
        rc = st_create_data_files(v, dir, sp, ST_DIRECT(o), x.files);
    if (!rc)
        rc = st_pipeline(st_io_threads(o->io_threads), x.lay.nios, bufsize, fill_stage,
                         write_stage, &x);
    rc = st_finish_data_files(v, dir, sp, x.files, ST_SYNC(o), rc);
    if (!rc && io_calls)
        *io_calls = x.lay.nios;
    free(x.files);
    st_io_plan_free(&x.lay);
    return rc;
}

int st_plan_states(st_save_plan *sp, strata_state *const *ranks, int nranks,
                   const strata_save_opts *o)
{
    st_rank_view *rv = calloc((size_t)nranks, sizeof *rv);
    if (!rv)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < nranks; r++)
        rv[r] = st_state_view(ranks[r]);
    int rc = st_plan_save(sp, rv, nranks, o->chunk_bytes, o->step);
    free(rv);
    return rc;
}

void st_save_stats(strata_stats *stats, const st_save_plan *sp, uint64_t io_calls, double t0)
{
    uint64_t written = 0; /* without what an incremental save referred to its base */
    for (size_t i = 0; i < sp->npieces; i++)
        written += sp->pieces[i].bytes;
    *stats = (strata_stats){.data_bytes = sp->meta->data_bytes,
                            .bytes = written,
                            .all_bytes = written,
                            .io_calls = io_calls,
                            .max_writer_bytes = sp->max_writer_bytes,
                            .balance_bound = sp->writer_bytes_bound,
                            .writers = (uint64_t)sp->nwriters};
    stats->seconds = st_now() - t0;
}

int st_save_local(const char *uri, strata_state *const *ranks, int nranks,
                  const strata_save_opts *o, strata_stats *stats)
{
    double t0 = st_now();
    st_save_plan sp;
    int rc = st_plan_states(&sp, ranks, nranks, o);
    if (rc)
        return rc;
    st_dests *d = calloc(1, sizeof *d); /* 8 tiers' paths: not on the caller's stack */
    uint64_t calls = 0, id = st_save_id_new();
    st_file *lock = NULL;
    st_incr *incr = NULL;
    if (!d)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    else if ((rc = st_dests_resolve(d, &uri, 1, o->flags)) == 0 &&
             (rc = st_incr_plan(&incr, &sp, d, o)) == 0 &&
             (rc = st_dest_own(d, 0, 1, &lock)) == 0) {
        rc = st_incr_link(incr, sp.meta, d, 0);
        if (!rc)
            rc = st_write_data(d->vfs[0], d->dir[0], &sp, o, &calls);
        if (!rc)
            rc = st_dest_commit(d, 0, sp.meta, ST_SYNC(o), id, &lock);
        if (rc && lock) /* a failed save leaves no half-written files behind */
            st_remove_failed(d->vfs[0], d->dir[0], 1, id);
        st_dest_abandon(d, 0, &lock);
    }
    if (!rc)
        st_save_stats(stats, &sp, calls, t0);
    st_incr_free(incr);
    st_save_plan_free(&sp);
    if (d)
        st_dests_close(d);
    free(d);
    return rc;
}

/* ---- destinations, and the commit of a save in this process ---- */

int st_dests_resolve(st_dests *d, const char *const *uris, int n, unsigned flags)
{
    memset(d, 0, sizeof *d);
    d->replace = (flags & STRATA_SAVE_REPLACE) != 0;
    for (int t = 0; t < n; t++)
        snprintf(d->uri[t], sizeof d->uri[t], "%s", uris[t]);
    for (d->n = 0; d->n < n; d->n++) {
        int t = d->n;
        int rc = st_vfs_resolve(d->uri[t], &d->vfs[t], d->final[t], sizeof d->final[0]);
        if (!rc && d->replace)
            rc = st_replace_sibling(d->dir[t], d->final[t]);
        else if (!rc)
            memcpy(d->dir[t], d->final[t], sizeof d->dir[t]);
        if (rc) {
            d->n += d->vfs[t] != NULL; /* resolved: released by st_dests_close */
            return rc;
        }
    }
    return 0;
}

void st_dests_close(st_dests *d)
{
    st_dests_release_final(d);
    for (int t = 0; t < d->n; t++)
        st_vfs_release(d->vfs[t]);
    d->n = 0;
}

typedef struct {
    st_dests dst;
    int sync;
    uint64_t save_id;
    st_file *lock[ST_MAX_TIERS]; /* held from prepare to the end of tier_done */
    st_incr *incr;               /* the links to the base, or NULL */
    const st_meta *meta;         /* the save's (with incr) */
} local_commit;

static const st_dests *lc_dests(void *ctx) { return &((local_commit *)ctx)->dst; }

static int lc_prepare(void *ctx, int t)
{
    local_commit *c = ctx;
    int rc = st_dest_own(&c->dst, t, 1, &c->lock[t]);
    return rc ? rc : st_incr_link(c->incr, c->meta, &c->dst, t);
}

static int lc_tier_done(void *ctx, int t, int rc, const st_save_plan *sp)
{
    local_commit *c = ctx;
    if (!rc)
        rc = st_dest_commit(&c->dst, t, sp->meta, c->sync, c->save_id, &c->lock[t]);
    if (rc && c->lock[t]) /* nothing half-written stays behind */
        st_remove_failed(c->dst.vfs[t], c->dst.dir[t], 1, c->save_id);
    st_dest_abandon(&c->dst, t, &c->lock[t]);
    return rc;
}

static void lc_release(void *ctx)
{
    local_commit *c = ctx;
    for (int t = 0; c && t < c->dst.n; t++)
        st_own_release(c->dst.vfs[t], c->lock[t]);
    if (c) {
        st_dests_close(&c->dst);
        st_incr_free(c->incr);
    }
    free(c);
}

const st_commit_ops st_local_commit = {0, lc_dests, lc_prepare, lc_tier_done, NULL, lc_release,
                                       NULL};

int st_local_commit_incr(void *ctx, st_save_plan *sp, const strata_save_opts *o)
{
    local_commit *c = ctx;
    c->meta = sp->meta;
    return st_incr_plan(&c->incr, sp, &c->dst, o);
}

int st_local_commit_new(void **ctx, const char *const *uris, int n, const strata_save_opts *o)
{
    *ctx = NULL;
    local_commit *c = calloc(1, sizeof *c);
    if (!c)
        return st_fail(STRATA_ENOMEM, "out of memory");
    c->sync = ST_SYNC(o);
    c->save_id = st_save_id_new();
    int rc = st_dests_resolve(&c->dst, uris, n, o->flags);
    if (rc) {
        lc_release(c);
        return rc;
    }
    *ctx = c;
    return 0;
}
