/* dist.c - strata_save_dist and strata_load_dist: the save and load of every rank of a
 * communicator, each process holding one rank's state. Every function here is a
 * collective: all ranks make the same calls in the same order. Rank 0 coordinates.
 *
 * Save: [all: cached?] -> [gather local plans to 0; 0 plans] -> [bcast status] ->
 *       [scatter each rank's pieces] -> all write their own data file -> [gather status +
 *       checksums to 0] -> 0 writes metadata + commit -> [bcast final status].
 *       A cached plan (every local plan hash unchanged) skips the gather and scatter.
 * Load: 0 reads commit + metadata -> [bcast] -> [allgather requests] -> every rank makes
 *       the same global plan and assigns each read to one rank that needs it -> rounds of
 *       (read + verify my reads, [allgather status], [alltoallv the bytes others need]). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "../comm/comm.h"
#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "engine.h"

#define ROOT 0
#define MSG_BYTES 768

/* A status every rank learns: the code and message of the first failure. */
typedef struct {
    int32_t rc, rank;
    char msg[MSG_BYTES];
} status_block;

static void status_set(status_block *s, int rc, int rank)
{
    s->rc = rc;
    s->rank = rank;
    snprintf(s->msg, sizeof s->msg, "%s", rc ? strata_error_last() : "");
}

/* Makes a status received from another rank this thread's error. */
static int status_raise(const status_block *s, int me)
{
    if (s->rank == me)
        return st_fail(s->rc, "%s", s->msg);
    return st_fail(s->rc, "rank %d: %s", s->rank, s->msg);
}

/* For the stats: the sum, maximum (may be NULL) and count of nonzero (may be NULL) of v
 * over all ranks (an allgather); left 0 if that fails. */
static void over_ranks(strata_comm *comm, uint64_t v, uint64_t *sum, uint64_t *max,
                       uint64_t *nonzero)
{
    uint64_t *every = malloc((size_t)comm->size * 8);
    if (every && st_allgather(comm, &v, 8, every) == 0)
        for (int r = 0; r < comm->size; r++) {
            *sum += every[r];
            if (max)
                *max = ST_MAX(*max, every[r]);
            if (nonzero)
                *nonzero += every[r] > 0;
        }
    free(every);
}

/* ---- local plans on the wire ---- */

static void encode_state(st_buf *b, const st_rank_view *v)
{
    st_buf_var(b, v->nsh);
    for (size_t i = 0; i < v->nsh; i++) {
        const st_entry *e = &v->sh[i];
        st_buf_str(b, e->name);
        st_buf_u8(b, (uint8_t)e->dtype);
        st_buf_u8(b, (uint8_t)e->ndim);
        for (int d = 0; d < e->ndim; d++) {
            st_buf_var(b, e->shape[d]);
            st_buf_var(b, e->off[d]);
            st_buf_var(b, e->len[d]);
        }
        st_buf_var(b, e->fs);
        st_buf_var(b, e->fe);
    }
    st_buf_var(b, v->nbl);
    for (size_t i = 0; i < v->nbl; i++) {
        st_buf_str(b, v->bl[i].name);
        st_buf_u8(b, (uint8_t)v->bl[i].local);
        st_buf_var(b, (uint64_t)(v->bl[i].owner + 1));
        st_buf_var(b, v->bl[i].size);
    }
}

/* Decodes a peer's state (data pointers NULL) into arena memory. */
static int decode_state(st_arena *a, const unsigned char *p, size_t n, st_rank_view *v)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    memset(v, 0, sizeof *v);
    uint64_t ns = st_rd_count(&r, 4, "shard count");
    st_entry *sh = st_arena_alloc(a, (ns + 1) * sizeof *sh);
    for (uint64_t i = 0; sh && i < ns && !r.err; i++) {
        st_entry *e = &sh[i];
        memset(e, 0, sizeof *e);
        e->name = st_rd_str(&r, a, STRATA_MAX_NAME);
        e->dtype = (strata_dtype)st_rd_u8(&r);
        e->ndim = st_rd_u8(&r);
        if (e->ndim > STRATA_MAX_DIMS || !strata_dtype_size(e->dtype)) {
            st_rd_fail(&r, "bad shard");
            break;
        }
        for (int d = 0; d < e->ndim; d++) {
            e->shape[d] = st_rd_var(&r);
            e->off[d] = st_rd_var(&r);
            e->len[d] = st_rd_var(&r);
        }
        e->fs = st_rd_var(&r);
        e->fe = st_rd_var(&r);
        e->bytes = (e->fe - e->fs) * strata_dtype_size(e->dtype);
    }
    uint64_t nb = st_rd_count(&r, 3, "blob count");
    st_blobent *bl = st_arena_alloc(a, (nb + 1) * sizeof *bl);
    for (uint64_t i = 0; bl && i < nb && !r.err; i++) {
        bl[i].name = st_rd_str(&r, a, STRATA_MAX_NAME);
        bl[i].local = st_rd_u8(&r);
        bl[i].owner = (int)st_rd_var(&r) - 1;
        bl[i].size = st_rd_var(&r);
        bl[i].data = NULL;
    }
    if (!sh || !bl)
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "a peer's plan is malformed: %s", r.what);
    *v = (st_rank_view){sh, (size_t)ns, bl, (size_t)nb};
    return 0;
}

/* Every rank's state: this rank's own view, the others decoded from the gathered bytes. */
static int decode_all(st_arena *a, const unsigned char *all, const size_t *counts, int P,
                      int me, const st_rank_view *mine, st_rank_view *out)
{
    size_t off = 0;
    for (int r = 0; r < P; r++) {
        int rc = r == me && mine ? (out[r] = *mine, 0) : decode_state(a, all + off, counts[r], &out[r]);
        if (rc)
            return rc;
        off += counts[r];
    }
    return 0;
}

/* ---- save ---- */

/* One piece this rank writes, as sent by the coordinator. */
typedef struct {
    uint32_t local;
    uint64_t src_off, offset, bytes;
} my_piece;

/* The last save plan, cached on the communicator. Referenced by the communicator and by
 * each distributed save in flight (so that a new plan can replace it meanwhile). */
typedef struct {
    atomic_int refs;
    uint64_t hash;
    int size;
    uint32_t chunk;
    /* every rank: its part */
    my_piece *mine;
    size_t nmine;
    uint64_t file_bytes;
    /* coordinator: the plan, and per rank the indices of its pieces in plan order */
    st_save_plan sp;
    size_t *by_rank, *rank0; /* pieces of rank r: by_rank[rank0[r] .. rank0[r+1]) */
} save_cache;

static void save_cache_free(void *p)
{
    save_cache *c = p;
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1)
        return;
    free(c->mine);
    st_save_plan_free(&c->sp);
    free(c->by_rank);
    free(c->rank0);
    free(c);
}

/* Coordinator: groups the plan's pieces by writer and encodes each rank's part. */
static int encode_parts(save_cache *c, int P, unsigned char **out, size_t *counts)
{
    const st_save_plan *sp = &c->sp;
    c->rank0 = calloc((size_t)P + 1, sizeof *c->rank0);
    c->by_rank = malloc((sp->npieces + 1) * sizeof *c->by_rank);
    if (!c->rank0 || !c->by_rank)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++)
        c->rank0[sp->pieces[i].writer + 1]++;
    for (int r = 0; r < P; r++)
        c->rank0[r + 1] += c->rank0[r];
    size_t *fill = calloc((size_t)P, sizeof *fill);
    if (!fill)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++) {
        int w = sp->pieces[i].writer;
        c->by_rank[c->rank0[w] + fill[w]++] = i;
    }
    free(fill);
    st_buf b = {0};
    for (int r = 0; r < P; r++) {
        size_t start = b.n;
        int f = sp->writer_file[r];
        st_buf_var(&b, f < 0 ? 0 : sp->meta->files[f].bytes);
        st_buf_var(&b, c->rank0[r + 1] - c->rank0[r]);
        for (size_t k = c->rank0[r]; k < c->rank0[r + 1]; k++) {
            const st_piece *pc = &sp->pieces[c->by_rank[k]];
            st_buf_var(&b, pc->local);
            st_buf_var(&b, pc->src_off);
            st_buf_var(&b, pc->offset);
            st_buf_var(&b, pc->bytes);
        }
        counts[r] = b.n - start;
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    *out = b.p;
    return 0;
}

static int decode_part(save_cache *c, const unsigned char *p, size_t n)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    c->file_bytes = st_rd_var(&r);
    uint64_t k = st_rd_count(&r, 4, "piece count");
    c->mine = malloc((k + 1) * sizeof *c->mine);
    if (!c->mine)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < k && !r.err; i++) {
        c->mine[i].local = (uint32_t)st_rd_var(&r);
        c->mine[i].src_off = st_rd_var(&r);
        c->mine[i].offset = st_rd_var(&r);
        c->mine[i].bytes = st_rd_var(&r);
    }
    c->nmine = (size_t)k;
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "the coordinator's plan is malformed: %s", r.what);
    return 0;
}

/* This rank's part of the save as a one-file plan: its data file, its pieces, their
 * extents, and one array of checksums in piece order (ext[0].sums). Owns its memory. */
static int mine_plan(const save_cache *c, const st_rank_view *v, int me, st_save_plan *out)
{
    memset(out, 0, sizeof *out);
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory");
    out->meta = m;
    out->nranks = 1;
    m->chunk = c->chunk;
    size_t total = 0;
    for (size_t i = 0; i < c->nmine; i++)
        total += (size_t)st_nchunks(c->mine[i].bytes, c->chunk);
    char name[32];
    snprintf(name, sizeof name, "data-%06d.bin", me);
    st_extent *ext = st_arena_alloc(&m->arena, (c->nmine + 1) * sizeof *ext);
    uint64_t *sums = st_arena_alloc(&m->arena, (total + 1) * 8);
    m->files = st_arena_alloc(&m->arena, sizeof *m->files);
    char *fname = st_arena_strndup(&m->arena, name, strlen(name));
    out->pieces = calloc(c->nmine + 1, sizeof *out->pieces);
    if (!ext || !sums || !m->files || !fname || !out->pieces) {
        st_save_plan_free(out);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    if (c->nmine) {
        m->nfiles = 1;
        m->files[0] = (st_mfile){fname, c->file_bytes};
    }
    size_t at = 0;
    for (size_t i = 0; i < c->nmine; i++) {
        const my_piece *q = &c->mine[i];
        if (q->local >= v->nsh + v->nbl) {
            st_save_plan_free(out);
            return st_fail(STRATA_EINVAL, "the coordinator assigned an unknown registration");
        }
        int shard = q->local < v->nsh;
        const void *data = shard ? v->sh[q->local].data : v->bl[q->local - v->nsh].data;
        ext[i] = (st_extent){0, q->offset, q->bytes, sums + at};
        at += (size_t)st_nchunks(q->bytes, c->chunk);
        out->pieces[i] = (st_piece){0, q->local, q->src_off, q->offset, q->bytes,
                                    (const char *)data + q->src_off, &ext[i],
                                    shard ? v->sh[q->local].name : v->bl[q->local - v->nsh].name,
                                    shard && v->sh[q->local].device};
        m->data_bytes += q->bytes;
    }
    out->npieces = c->nmine;
    return 0;
}

/* The checksums of a rank's part, in piece order. */
static const uint64_t *mine_sums(const st_save_plan *mine, size_t *n)
{
    *n = 0;
    for (size_t i = 0; i < mine->npieces; i++)
        *n += (size_t)st_nchunks(mine->pieces[i].bytes, mine->meta->chunk);
    return mine->npieces ? mine->pieces[0].ext->sums : NULL;
}

static uint64_t plan_hash(const unsigned char *p, size_t n, int P, uint32_t chunk)
{
    return st_hash(p, n) ^ st_mix64((uint64_t)P * 0x100000001b3ULL + chunk);
}

/* A distributed save between its planning and its commit (the async handle keeps it). */
struct st_async_dist {
    strata_comm *comm;
    int ntiers;
    char uri[ST_MAX_TIERS][PATH_MAX], dir[ST_MAX_TIERS][PATH_MAX];
    const st_vfs *vfs[ST_MAX_TIERS];
    int wrote[ST_MAX_TIERS];
    strata_save_opts o;
    double t0;
    int all_cached;
    save_cache *cache; /* the plan (referenced) */
};

void st_dist_free(st_async_dist *d)
{
    if (d) {
        for (int t = 0; t < d->ntiers; t++)
            st_vfs_release(d->vfs[t]);
        save_cache_free(d->cache);
    }
    free(d);
}

/* Steps 1-3: every rank learns its part (*mine) of the save. With prepare_root, rank 0
 * prepares the directory first (st_prepare_dir) and every rank learns the outcome; without,
 * a cached plan needs no more than the one collective that finds it cached. A local
 * failure is returned in *local_rc (message in local_msg): the rank must still take part
 * in st_dist_finish. */
static int dist_begin(st_async_dist *d, strata_state *local, int prepare_root,
                      st_save_plan *mine, int *local_rc, char *local_msg)
{
    strata_comm *comm = d->comm;
    const strata_save_opts *o = &d->o;
    const int P = comm->size, me = comm->rank;
    uint32_t chunk = o->chunk_bytes ? o->chunk_bytes : ST_DEFAULT_CHUNK;
    st_rank_view view = st_state_view(local);
    memset(mine, 0, sizeof *mine);
    st_buf lp = {0};
    encode_state(&lp, &view);
    int rc = lp.oom ? st_fail(STRATA_ENOMEM, "out of memory") : st_check_chunk(chunk);
    /* a local error must still take part in the collectives: it travels as a status */
    int lrc = rc;
    for (int t = 0; t < d->ntiers && !lrc; t++)
        lrc = st_vfs_resolve(d->uri[t], &d->vfs[t], d->dir[t], sizeof d->dir[t]);
    snprintf(local_msg, MSG_BYTES, "%s", lrc ? strata_error_last() : "");
    uint64_t h = plan_hash(lp.p, lp.n, P, chunk);
    save_cache *cache = comm->cache_free == save_cache_free ? comm->cache : NULL;
    unsigned char *all = NULL, *parts = NULL, *mypart = NULL;
    size_t *counts = calloc((size_t)P, sizeof *counts), mylen = 0;
    st_arena arena = {0};
    st_rank_view *views = NULL;
    status_block st = {0};
    save_cache *fresh = NULL;
    if (!counts) {
        free(lp.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    /* 1. one collective: is every rank's layout what it was at the last save? */
    if ((rc = st_all_true(comm, !lrc && cache && cache->hash == h && cache->size == P,
                          &d->all_cached)))
        goto out;
    if (!d->all_cached) {
        /* 2. the coordinator gathers the local plans and plans */
        if ((rc = st_gatherv(comm, lp.p, lp.n, ROOT, &all, counts)))
            goto out;
        if (me == ROOT) {
            if ((fresh = calloc(1, sizeof *fresh)))
                atomic_init(&fresh->refs, 1);
            views = calloc((size_t)P, sizeof *views);
            int prc = !fresh || !views ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
            if (!prc)
                prc = decode_all(&arena, all, counts, P, -1, NULL, views);
            if (!prc)
                prc = st_plan_save(&fresh->sp, views, P, chunk, o->step);
            if (!prc)
                prc = encode_parts(fresh, P, &parts, counts);
            if (prc)
                status_set(&st, prc, ROOT);
        }
    }
    /* 3. the coordinator prepares the directory; everyone learns the outcome */
    if (me == ROOT && !st.rc && prepare_root) {
        int prc = lrc ? (st_fail(lrc, "%s", local_msg), lrc) : st_prepare_dir(d->vfs[0], d->dir[0]);
        if (prc)
            status_set(&st, prc, ROOT);
    }
    if (prepare_root || !d->all_cached) {
        if ((rc = st_bcast(comm, &st, sizeof st, ROOT)))
            goto out;
        if (st.rc) {
            rc = status_raise(&st, me);
            goto out;
        }
    }
    if (!d->all_cached) {
        if ((rc = st_scatterv(comm, parts, counts, ROOT, &mypart, &mylen)))
            goto out;
        if (!fresh && !(fresh = calloc(1, sizeof *fresh))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out;
        }
        atomic_init(&fresh->refs, 1);
        fresh->hash = h;
        fresh->size = P;
        fresh->chunk = chunk;
        if (comm->cache_free) /* the old plan is stale whatever happens now */
            comm->cache_free(comm->cache);
        comm->cache = NULL;
        comm->cache_free = NULL;
        cache = NULL;
        if ((lrc = decode_part(fresh, mypart, mylen))) {
            snprintf(local_msg, MSG_BYTES, "%s", strata_error_last());
        } else {
            comm->cache = cache = fresh;
            comm->cache_free = save_cache_free;
            fresh = NULL;
        }
    }
    if (!lrc && cache && (lrc = mine_plan(cache, &view, me, mine)))
        snprintf(local_msg, MSG_BYTES, "%s", strata_error_last());
    if (cache) { /* this save's reference: the plan stays while it is in flight */
        atomic_fetch_add(&cache->refs, 1);
        d->cache = cache;
    }
out:
    *local_rc = lrc;
    save_cache_free(fresh);
    if (rc && comm->cache_free == save_cache_free && comm->broken) {
        save_cache_free(comm->cache); /* the layout is unknown after a failure */
        comm->cache = NULL;
        comm->cache_free = NULL;
    }
    st_arena_free(&arena);
    free(views);
    free(lp.p);
    free(all);
    free(parts);
    free(mypart);
    free(counts);
    return rc;
}

/* Removes this rank's data file (and on rank 0 the metadata) of a failed save in tier t. */
static void dist_cleanup(const st_async_dist *d, int t)
{
    char p[PATH_MAX], name[32];
    const st_vfs *v = d->vfs[t];
    const char *dir = d->dir[t];
    if (st_path_join(p, dir, ST_COMMIT_FILE) || v->stat(v, p, NULL, NULL) == 0)
        return; /* committed after all, or by another save: never touched */
    snprintf(name, sizeof name, "data-%06d.bin", d->comm->rank);
    if (st_path_join(p, dir, name) == 0)
        v->unlink(v, p);
    if (d->comm->rank == ROOT) {
        if (st_path_join(p, dir, ST_META_FILE) == 0)
            v->unlink(v, p);
        if (st_path_join(p, dir, ST_COMMIT_FILE ".tmp") == 0)
            v->unlink(v, p);
    }
}

int st_dist_finish(st_async_dist *d, const int *local_rc, const char *const *local_msg,
                   const st_save_plan *mine, uint64_t io_calls, strata_stats *stats)
{
    strata_comm *comm = d->comm;
    const int P = comm->size, me = comm->rank, T = d->ntiers;
    save_cache *cache = d->cache;
    size_t nsums = 0, *counts = calloc((size_t)P, sizeof *counts);
    int any_ok = 0;
    for (int t = 0; t < T; t++)
        any_ok |= local_rc[t] == 0;
    const uint64_t *sums = any_ok ? mine_sums(mine, &nsums) : NULL;
    unsigned char *reports = NULL;
    status_block st[ST_MAX_TIERS];
    memset(st, 0, sizeof st);
    int rc;
    if (!counts)
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (!any_ok)
        nsums = 0;
    /* 5. each tier's status, and the checksums (the same bytes went to every tier) */
    st_buf rep = {0};
    for (int t = 0; t < T; t++) {
        st_buf_u32(&rep, (uint32_t)local_rc[t]);
        st_buf_str(&rep, local_rc[t] ? local_msg[t] : "-");
    }
    st_buf_var(&rep, nsums);
    for (size_t i = 0; i < nsums; i++)
        st_buf_u64(&rep, sums[i]);
    rc = rep.oom ? st_fail(STRATA_ENOMEM, "out of memory")
                 : st_gatherv(comm, rep.p, rep.n, ROOT, &reports, counts);
    free(rep.p);
    if (rc)
        goto out;

    /* 6. the coordinator commits each tier in which every rank succeeded */
    if (me == ROOT) {
        size_t off = 0;
        for (int r = 0; r < P; r++) {
            st_rd rd = {.p = reports + off, .end = reports + off + counts[r]};
            off += counts[r];
            int rank_ok = 0;
            for (int t = 0; t < T; t++) {
                int32_t prc = (int32_t)st_rd_u32(&rd);
                st_arena tmp = {0};
                char *msg = st_rd_str(&rd, &tmp, MSG_BYTES);
                if (prc && !st[t].rc) {
                    st[t].rc = prc;
                    st[t].rank = r;
                    snprintf(st[t].msg, sizeof st[t].msg, "%s", msg ? msg : "failed");
                }
                rank_ok |= prc == 0;
                st_arena_free(&tmp);
            }
            uint64_t k = st_rd_var(&rd), at = 0;
            for (size_t q = cache->rank0[r]; rank_ok && q < cache->rank0[r + 1] && !rd.err; q++) {
                st_extent *e = cache->sp.pieces[cache->by_rank[q]].ext;
                uint64_t nc = st_nchunks(e->bytes, cache->sp.meta->chunk);
                for (uint64_t c = 0; c < nc && at < k; c++, at++)
                    e->sums[c] = st_rd_u64(&rd);
            }
            if (rank_ok && (rd.err || at != k))
                for (int t = 0; t < T; t++)
                    if (!st[t].rc) {
                        st[t].rc = STRATA_EINVAL;
                        st[t].rank = r;
                        snprintf(st[t].msg, sizeof st[t].msg,
                                 "rank %d sent %llu checksums, not the plan's", r,
                                 (unsigned long long)k);
                    }
        }
        cache->sp.meta->step = d->o.step;
        for (int t = 0; t < T; t++) {
            if (st[t].rc)
                continue;
            /* without a prepared directory (an asynchronous save), check it now */
            int crc = st_clear_stale(d->vfs[t], d->dir[t], &cache->sp);
            if (!crc && (crc = st_commit_dir(d->vfs[t], d->dir[t], cache->sp.meta, !d->o.no_sync)))
                st_uncommit(d->vfs[t], d->dir[t]); /* this save's record, if it got that far */
            if (crc)
                status_set(&st[t], crc, ROOT);
        }
    }
    if ((rc = st_bcast(comm, st, (size_t)T * sizeof st[0], ROOT)))
        goto out;
    /* nothing committed in a failed tier: each rank removes what it wrote there (only if
     * it wrote for this save: never a committed checkpoint's files) */
    for (int t = 0; t < T; t++)
        if (st[t].rc && d->wrote[t] && !comm->broken)
            dist_cleanup(d, t);
    for (int t = 0; t < T && !rc; t++)
        if (st[t].rc)
            rc = T > 1 ? st_wrap(status_raise(&st[t], me), "destination %d (%s)", t, d->uri[t])
                       : status_raise(&st[t], me);
    if (rc)
        goto out;
    if (stats) {
        uint64_t mine_b = mine->meta ? mine->meta->data_bytes : 0;
        *stats = (strata_stats){.bytes = mine_b, .io_calls = io_calls,
                                .plan_cached = d->all_cached};
        over_ranks(comm, mine_b, &stats->all_bytes, &stats->max_writer_bytes, &stats->writers);
        stats->data_bytes = stats->all_bytes;
        stats->seconds = st_now() - d->t0;
    }
out:
    /* after a failed collective rank 0 may have committed: nothing is removed, and the
     * layout is unknown */
    if (rc && comm->broken && comm->cache_free == save_cache_free) {
        save_cache_free(comm->cache);
        comm->cache = NULL;
        comm->cache_free = NULL;
    }
    free(reports);
    free(counts);
    return rc;
}

static int dist_new(st_async_dist **out, strata_comm *comm, const char *const *uris,
                    int ntiers, strata_state *local, const strata_save_opts *opts)
{
    *out = NULL;
    strata_save_opts def = STRATA_SAVE_OPTS_INIT;
    const strata_save_opts *o = opts ? opts : &def;
    if (!comm || !local || !uris)
        return st_fail(STRATA_EINVAL, "a distributed save needs a communicator, a URI and a "
                                      "state");
    if (ntiers < 1 || ntiers > ST_MAX_TIERS)
        return st_fail(STRATA_EINVAL, "a save needs 1 to %d destinations", ST_MAX_TIERS);
    if (o->version != STRATA_SAVE_OPTS_VERSION)
        return st_fail(STRATA_EINVAL, "strata_save_opts.version %d is not %d", o->version,
                       STRATA_SAVE_OPTS_VERSION);
    for (int t = 0; t < ntiers; t++)
        if (!uris[t] || strlen(uris[t]) >= PATH_MAX)
            return st_fail(STRATA_EINVAL, "destination %d: no URI, or one too long", t);
    st_async_dist *d = calloc(1, sizeof *d);
    if (!d)
        return st_fail(STRATA_ENOMEM, "out of memory");
    d->comm = comm;
    d->o = *o;
    d->t0 = st_now();
    d->ntiers = ntiers;
    for (int t = 0; t < ntiers; t++)
        strcpy(d->uri[t], uris[t]);
    *out = d;
    return 0;
}

/* dist_new + dist_begin. 0: *d and *mine are this save's (a local failure in *local_rc,
 * message in local_msg); else the collective's error, and nothing to free. */
static int dist_start(st_async_dist **d, strata_comm *comm, const char *const *uris,
                      int ntiers, strata_state *local, const strata_save_opts *opts,
                      int prepare_root, st_save_plan *mine, int *local_rc, char *local_msg)
{
    int rc = dist_new(d, comm, uris, ntiers, local, opts);
    if (rc)
        return rc;
    st_clear_error();
    if ((rc = dist_begin(*d, local, prepare_root, mine, local_rc, local_msg))) {
        st_save_plan_free(mine);
        st_dist_free(*d);
        *d = NULL;
    }
    return rc;
}

int strata_save_dist(strata_comm *comm, const char *uri, strata_state *local,
                     const strata_save_opts *opts, strata_stats *stats)
{
    st_async_dist *d;
    st_save_plan mine;
    int local_rc;
    char local_msg[MSG_BYTES];
    uint64_t io_calls = 0;
    int rc = dist_start(&d, comm, &uri, 1, local, opts, 1, &mine, &local_rc, local_msg);
    if (rc)
        return rc;
    /* 4. every rank writes its own data file */
    d->wrote[0] = 1;
    if (!local_rc && (local_rc = st_write_data(d->vfs[0], d->dir[0], &mine, &d->o, &io_calls)))
        snprintf(local_msg, sizeof local_msg, "%s", strata_error_last());
    const char *msg = local_msg;
    rc = st_dist_finish(d, &local_rc, &msg, &mine, io_calls, stats);
    st_save_plan_free(&mine);
    st_dist_free(d);
    return rc;
}

int strata_save_dist_async_tiers(strata_handle **out, strata_comm *comm,
                                 const char *const *uris, int ntiers, strata_state *local,
                                 const strata_save_opts *opts, strata_pool *pool)
{
    *out = NULL;
    st_async_dist *d;
    st_save_plan mine;
    int local_rc;
    char local_msg[MSG_BYTES];
    int rc = dist_start(&d, comm, uris, ntiers, local, opts, 0, &mine, &local_rc, local_msg);
    if (rc)
        return rc;
    if (local_rc) { /* a local failure: the handle carries it into st_dist_finish */
        st_save_plan_free(&mine);
        st_fail(local_rc, "%s", local_msg);
    }
    return st_async_start(out, &mine, uris, ntiers, &d->o, pool, d, local_rc);
}

int strata_save_dist_async(strata_handle **out, strata_comm *comm, const char *uri,
                           strata_state *local, const strata_save_opts *opts,
                           strata_pool *pool)
{
    return strata_save_dist_async_tiers(out, comm, &uri, 1, local, opts, pool);
}

int st_dist_tiers(const st_async_dist *d) { return d->ntiers; }

const st_vfs *st_dist_vfs(st_async_dist *d, int t, char *dir)
{
    strcpy(dir, d->dir[t]);
    return d->vfs[t];
}

void st_dist_wrote(st_async_dist *d, int t) { d->wrote[t] = 1; }

/* ---- load ---- */

typedef struct {
    st_commit commit;
    uint64_t meta_len;
    status_block st;
} open_block;

/* st_walk_read callbacks that count: the bytes of a read for each destination rank
 * (ctx: uint64_t[P]); for one rank only; and the ranks that need a read. */
static void count_per_rank(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    ((uint64_t *)ctx)[run->rank] += x1 - x0;
}

typedef struct {
    int rank;
    uint64_t bytes;
} one_rank;

static void count_one_rank(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    one_rank *c = ctx;
    if (run->rank == c->rank)
        c->bytes += x1 - x0;
}

typedef struct {
    unsigned char *need; /* per rank, all 0 between reads */
    int *who, n;         /* the ranks marked in need */
} needers;

static void mark_needer(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)x0, (void)x1, (void)at;
    needers *c = ctx;
    if (!c->need[run->rank]) {
        c->need[run->rank] = 1;
        c->who[c->n++] = run->rank;
    }
}

typedef struct {
    const st_load_plan *p;
    int me;
    const char *buf;      /* the read's buffer (sender) */
    unsigned char **out;  /* per destination: write cursor (sender) */
    const unsigned char *in; /* receive cursor (receiver) */
    int rc;                  /* a device copy failed */
} move_ctx;

static void pack_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    move_ctx *m = ctx;
    if (run->rank == m->me)
        return; /* scattered locally by the read itself */
    memcpy(m->out[run->rank], m->buf + at, x1 - x0);
    m->out[run->rank] += x1 - x0;
}

static void unpack_run(void *ctx, const st_run *run, uint64_t x0, uint64_t x1, uint64_t at)
{
    (void)at;
    move_ctx *m = ctx;
    if (run->rank != m->me)
        return;
    int rc = st_deliver(m->p, run, x0, x1, m->in);
    if (rc && !m->rc)
        m->rc = rc;
    m->in += x1 - x0;
}

/* Payload bytes of read i (its chunks, without alignment padding). */
static uint64_t read_payload(const st_load_plan *p, size_t i)
{
    uint64_t n = 0, C = p->meta->chunk;
    for (size_t si = p->reads[i].seg0; si < p->reads[i].seg1; si++) {
        const st_seg *s = &p->segs[si];
        n += ST_MIN(s->c1 * C, p->ext[s->piece]->bytes) - s->c0 * C;
    }
    return n;
}

/* Assigns each read to one of the ranks that need its bytes, the least loaded so far. */
static int assign_readers(const st_load_plan *p, int P, int *reader)
{
    uint64_t *load = calloc((size_t)P, sizeof *load);
    needers c = {calloc((size_t)P, 1), malloc((size_t)P * sizeof *c.who), 0};
    int rc = !load || !c.need || !c.who ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
    for (size_t i = 0; !rc && i < p->nreads; i++) {
        c.n = 0;
        st_walk_read(p, i, mark_needer, &c);
        int best = -1;
        for (int k = 0; k < c.n; k++) { /* the lowest rank wins ties */
            int r = c.who[k];
            if (best < 0 || load[r] < load[best] || (load[r] == load[best] && r < best))
                best = r;
            c.need[r] = 0;
        }
        reader[i] = best < 0 ? 0 : best;
        load[reader[i]] += p->reads[i].len;
    }
    free(load);
    free(c.need);
    free(c.who);
    return rc;
}

typedef struct {
    const size_t *round_of;
    const int *reader;
} order_ctx;

/* Reads by (round, reader, index): the order in which receivers unpack. */
static int cmp_order(const void *a, const void *b, void *ctx)
{
    const order_ctx *c = ctx;
    size_t i = *(const size_t *)a, j = *(const size_t *)b;
    if (c->round_of[i] != c->round_of[j])
        return c->round_of[i] < c->round_of[j] ? -1 : 1;
    if (c->reader[i] != c->reader[j])
        return c->reader[i] < c->reader[j] ? -1 : 1;
    return (i > j) - (i < j);
}

/* A scratch buffer of at least n bytes in place of buf (capacity *cap); NULL if out of
 * memory (buf is given back either way). */
static unsigned char *grow(unsigned char *buf, size_t *cap, size_t n)
{
    if (buf)
        st_scratch_put(buf, *cap);
    *cap = (size_t)1 << 20; /* powers of two: sizes that repeat, for the scratch cache */
    while (*cap < n)
        *cap *= 2;
    buf = st_scratch_get(*cap);
    if (!buf)
        *cap = 0;
    return buf;
}

/* The reads and exchanges, in rounds of up to `per_round` reads per rank. */
static int exchange_rounds(strata_comm *comm, const st_dir *d, const st_load_plan *p,
                           const strata_load_opts *o, uint64_t max_io, uint64_t *my_bytes)
{
    const int P = comm->size, me = comm->rank;
    int per_round = st_io_threads(o->io_threads);
    int *reader = malloc((p->nreads + 1) * sizeof *reader);
    size_t *mine = malloc((p->nreads + 1) * sizeof *mine), nmine = 0;
    size_t *round_of = malloc((p->nreads + 1) * sizeof *round_of);
    size_t *order = malloc((p->nreads + 1) * sizeof *order);
    size_t *count = calloc((size_t)P, sizeof *count);
    size_t *sc = calloc((size_t)P, sizeof *sc), *rc_ = calloc((size_t)P, sizeof *rc_);
    uint64_t *bytes = calloc((size_t)P, sizeof *bytes);
    unsigned char **cur = calloc((size_t)P, sizeof *cur);
    char **bufs = calloc((size_t)per_round, sizeof *bufs);
    st_file **files = NULL;
    int32_t *sts = malloc((size_t)P * sizeof *sts);
    size_t bufsize = st_read_buf_bytes(p->meta, max_io), rounds = 0, scap = 0, rcap = 0;
    unsigned char *sbuf = NULL, *rbuf = NULL;
    int rc = 0;
    if (!reader || !mine || !round_of || !order || !count || !sc || !rc_ || !bytes || !cur || !bufs || !sts) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = assign_readers(p, P, reader)))
        goto out;
    for (size_t i = 0; i < p->nreads; i++) {
        round_of[i] = count[reader[i]]++ / (size_t)per_round;
        rounds = ST_MAX(rounds, round_of[i] + 1);
        order[i] = i;
        if (reader[i] == me) {
            mine[nmine++] = i;
            *my_bytes += read_payload(p, i);
        }
    }
    order_ctx oc = {round_of, reader};
    qsort_r(order, p->nreads, sizeof *order, cmp_order, &oc);
    size_t next = 0; /* reads of earlier rounds in `order` */
    /* a local failure (opening the files) still takes part in every round */
    int local_rc = nmine ? st_open_data_files(d, p, o->no_direct, &files) : 0;
    for (int k = 0; k < per_round && !local_rc; k++)
        if (!(bufs[k] = st_scratch_get(bufsize)))
            local_rc = st_fail(STRATA_ENOMEM, "out of memory for read buffers");
    for (size_t round = 0; round < rounds; round++) {
        /* my reads this round: read, verify, scatter my own runs */
        size_t first = 0;
        while (first < nmine && round_of[mine[first]] < round)
            first++;
        size_t n = 0;
        while (first + n < nmine && round_of[mine[first + n]] == round)
            n++;
        if (!local_rc && n)
            local_rc = st_read_some(d, p, files, mine + first, n, bufs, o->io_threads, me);
        int32_t my_st = local_rc;
        if ((rc = st_allgather(comm, &my_st, sizeof my_st, sts)))
            goto out;
        int bad = -1;
        for (int r = 0; r < P && bad < 0; r++)
            if (sts[r])
                bad = r;
        if (bad >= 0) { /* every rank learns the first failure, with its message */
            status_block s;
            status_set(&s, sts[bad], bad);
            if ((rc = st_bcast(comm, &s, sizeof s, bad)))
                goto out;
            rc = status_raise(&s, me);
            goto out;
        }
        /* what I send: the bytes of my reads that other ranks need */
        memset(bytes, 0, (size_t)P * sizeof *bytes);
        for (size_t j = 0; j < n; j++)
            st_walk_read(p, mine[first + j], count_per_rank, bytes);
        size_t stot = 0, rtot = 0;
        for (int r = 0; r < P; r++) {
            sc[r] = r == me ? 0 : (size_t)bytes[r];
            stot += sc[r];
        }
        /* what I receive: from each reader, the bytes of its reads this round that I need;
         * this round's reads are order[next .. end), by reader rank */
        size_t end = next;
        while (end < p->nreads && round_of[order[end]] == round)
            end++;
        memset(rc_, 0, (size_t)P * sizeof *rc_);
        for (size_t k = next; k < end; k++) {
            size_t i = order[k];
            if (reader[i] == me)
                continue;
            one_rank c = {me, 0};
            st_walk_read(p, i, count_one_rank, &c);
            rc_[reader[i]] += (size_t)c.bytes;
        }
        for (int r = 0; r < P; r++)
            rtot += rc_[r];
        /* the exchange buffers are reused across rounds: fresh pages cost a first touch */
        if ((stot > scap && !(sbuf = grow(sbuf, &scap, stot))) ||
            (rtot > rcap && !(rbuf = grow(rbuf, &rcap, rtot)))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out; /* the others then time out: memory is gone anyway */
        }
        size_t at = 0;
        for (int r = 0; r < P; r++) {
            cur[r] = sbuf + at;
            at += sc[r];
        }
        for (size_t j = 0; j < n; j++) {
            move_ctx m = {p, me, bufs[j], cur, NULL, 0};
            st_walk_read(p, mine[first + j], pack_run, &m);
        }
        rc = st_alltoallv(comm, sbuf, sc, rbuf, rc_);
        if (!rc) {
            const unsigned char *in = rbuf; /* readers in rank order, their reads in order */
            for (size_t k = next; k < end; k++)
                if (reader[order[k]] != me) {
                    move_ctx m = {p, me, NULL, NULL, in, 0};
                    st_walk_read(p, order[k], unpack_run, &m);
                    in = m.in;
                    if (m.rc && !local_rc)
                        local_rc = m.rc; /* reported with the next round's status */
                }
        }
        next = end;
        if (rc)
            goto out;
    }
    if (local_rc) /* failed after the last round's status exchange (a device copy) */
        rc = local_rc;
out:
    for (int k = 0; bufs && k < per_round; k++)
        st_scratch_put(bufs[k], bufsize);
    if (sbuf)
        st_scratch_put(sbuf, scap);
    if (rbuf)
        st_scratch_put(rbuf, rcap);
    if (files)
        st_close_data_files(d, p, files);
    free(reader);
    free(mine);
    free(round_of);
    free(order);
    free(count);
    free(sc);
    free(rc_);
    free(bytes);
    free(cur);
    free(bufs);
    free(sts);
    return rc;
}

int strata_load_dist(strata_comm *comm, const char *uri, strata_state *local,
                     const strata_load_opts *opts, strata_stats *stats)
{
    strata_load_opts def = STRATA_LOAD_OPTS_INIT;
    const strata_load_opts *o = opts ? opts : &def;
    if (!comm || !local)
        return st_fail(STRATA_EINVAL, "strata_load_dist needs a communicator and a state");
    if (o->version != STRATA_LOAD_OPTS_VERSION)
        return st_fail(STRATA_EINVAL, "strata_load_opts.version %d is not %d", o->version,
                       STRATA_LOAD_OPTS_VERSION);
    st_clear_error();
    double t0 = st_now();
    const int P = comm->size, me = comm->rank;
    uint64_t max_io = o->max_io_bytes ? o->max_io_bytes : (16u << 20);
    open_block ob = {0};
    unsigned char *meta = NULL, *all = NULL;
    size_t mlen = 0, *counts = calloc((size_t)P, sizeof *counts);
    st_dir d = {0};
    int have_dir = 0, rc = 0;
    st_arena arena = {0};
    st_rank_view *views = calloc((size_t)P, sizeof *views);
    st_load_plan plan;
    int have_plan = 0;
    st_buf req = {0};
    if (!counts || !views) {
        free(counts);
        free(views);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    /* 1. the coordinator reads the commit record and metadata; everyone gets them */
    if (me == ROOT) {
        int orc = st_dir_open_raw(&d, uri, 0, &meta, &mlen);
        if (orc) {
            status_set(&ob.st, orc, ROOT);
        } else {
            have_dir = 1;
            ob.commit = d.commit;
            ob.meta_len = mlen;
        }
    }
    if ((rc = st_bcast(comm, &ob, sizeof ob, ROOT)))
        goto out;
    if (ob.st.rc) {
        rc = status_raise(&ob.st, me);
        goto out;
    }
    if (me != ROOT && !(meta = malloc(ob.meta_len + 1))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    if ((rc = st_bcast(comm, meta, ob.meta_len, ROOT)))
        goto out;
    if (me != ROOT) {
        if ((rc = st_dir_adopt(&d, uri, &ob.commit, meta, ob.meta_len)))
            goto out; /* the same bytes fail the same way everywhere */
        have_dir = 1;
    }
    /* 2. every rank's requests, to every rank */
    st_rank_view my = st_state_view(local);
    encode_state(&req, &my);
    if (req.oom) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = st_allgatherv(comm, req.p, req.n, &all, counts)))
        goto out;
    if ((rc = decode_all(&arena, all, counts, P, me, &my, views)))
        goto out;
    /* 3. the same global plan everywhere: its errors are everyone's */
    if ((rc = st_plan_load(&plan, d.meta, views, P, max_io)))
        goto out;
    have_plan = 1;
    uint64_t got = 0;
    if ((rc = exchange_rounds(comm, &d, &plan, o, max_io, &got)))
        goto out;
    if (stats) { /* payload bytes read, not alignment padding, as strata_load counts */
        *stats = (strata_stats){.data_bytes = d.meta->data_bytes, .bytes = got};
        over_ranks(comm, got, &stats->all_bytes, NULL, NULL);
        stats->seconds = st_now() - t0;
    }
out:
    if (have_plan)
        st_load_plan_free(&plan);
    if (have_dir)
        st_dir_close(&d);
    free(req.p);
    free(meta);
    free(all);
    free(counts);
    free(views);
    st_arena_free(&arena);
    return rc;
}
