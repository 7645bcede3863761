/* dist_save.c - one rank's part of a save by every rank of a communicator (each process
 * holds one rank's state). Every function here is a collective: all ranks make the same
 * calls in the same order. Rank 0 coordinates.
 *
 * [all: cached?] -> [gather local plans to 0; 0 plans] -> [bcast status] -> [scatter each
 * rank's pieces] -> all write their own data file -> [gather status + checksums to 0] ->
 * 0 writes metadata + commit -> [bcast final status]. A cached plan (every local plan
 * hash unchanged) skips the gather and scatter. The synchronous save writes on the
 * caller's thread; the asynchronous one through async.c, with this file's commit hooks,
 * whose commit (steps 6-7) runs on the saver's commit thread over its own communicator
 * where the saver has one (committer.c), else in strata_wait_durable. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "../meta/planfile.h"
#include "dist.h"

/* The first collective's bytes per rank: its plan is still good, rank 0's ownership code
 * and tier, its incremental mode, the id of the plan it holds. */
#define AGREE 12

/* A distributed save between its planning and its commit (the async handle keeps it). */
typedef struct st_async_dist {
    strata_comm *comm;  /* the caller's: the save's start */
    strata_comm *ccomm; /* the commit's: comm, or the saver's commit thread's */
    int timeout_ms;     /* comm's when the save started, for ccomm */
    int ntiers;
    st_dests dst;
    int wrote[ST_MAX_TIERS];
    strata_save_opts o;
    double t0;
    int all_cached;
    uint64_t save_id; /* rank 0's, in the commit records it writes */
    st_file *lock[ST_MAX_TIERS]; /* rank 0: ownership of each destination, to the end */
    st_plan_cache *cache;  /* the plan (referenced) */
    st_plan_cache **slot;  /* where the saver keeps its last plan (NULL once started
                              asynchronously: the saver may be gone before the commit) */
    st_dist_incr incr;     /* an incremental save's (incr.on) */
    atomic_int level;      /* STRATA_LEVEL_* reached (strata_handle_level) */
    char peer_msg[ST_ERR_BYTES]; /* why the replication failed: read once PEER_ENDED */
} st_async_dist;

#define PEER_ENDED 0x100 /* in st_async_dist.level: the replication has ended */

/* Replaces the saver's plan (dropping its reference to the old one). */
static void set_cached(st_async_dist *d, st_plan_cache *c)
{
    if (!d->slot)
        return;
    st_plan_cache_release(*d->slot);
    *d->slot = c;
}

static void dist_free(void *ctx)
{
    st_async_dist *d = ctx;
    if (d) {
        for (int t = 0; t < d->dst.n; t++)
            st_own_release(d->dst.vfs[t], d->lock[t]);
        st_dests_close(&d->dst);
        st_plan_cache_release(d->cache);
        st_dist_incr_free(&d->incr);
    }
    free(d);
}

/* A save's incremental mode, which every rank must share: 2 with a base, 1 with
 * STRATA_SAVE_INCREMENTAL alone, 0 neither. */
static int incr_mode(const strata_save_opts *o)
{
    return o->base ? 2 : (o->flags & STRATA_SAVE_INCREMENTAL) != 0;
}

static const char *incr_what(int mode)
{
    return mode == 2 ? "names a base" : mode ? "saves incrementally without a base"
                                             : "saves in full";
}

/* Steps 1-3: every rank learns its part (*mine) of the save. With prepare_root, rank 0
 * prepares the directory first (st_prepare_dir, owning it) and every rank learns the
 * outcome; without, rank 0 takes ownership of every destination (st_own) and a cached
 * plan needs no more than the one collective that finds it cached and owned. A local
 * failure is returned in *local_rc (message in local_msg): the rank must still take part
 * in dist_finish. */
static int dist_begin(st_async_dist *d, const char *const *uris, strata_state *local,
                      int prepare_root, st_save_plan *mine, int *local_rc, char *local_msg)
{
    strata_comm *comm = d->comm;
    const strata_save_opts *o = &d->o;
    const int P = comm->size, me = comm->rank;
    uint32_t chunk = o->chunk_bytes;
    st_rank_view view = st_state_view(local);
    memset(mine, 0, sizeof *mine);
    st_buf lp = {0};
    st_encode_local_plan(&lp, &view);
    int rc = lp.oom ? st_fail(STRATA_ENOMEM, "out of memory") : st_check_chunk(chunk);
    /* a local error must still take part in the collectives: it travels as a status */
    int lrc = rc;
    if (!lrc)
        lrc = st_dests_resolve(&d->dst, uris, d->ntiers, o->flags);
    if (!lrc && o->base) /* before rank 0 makes anything */
        lrc = st_incr_check_name(o->base, &d->dst);
    st_err_keep(local_msg, lrc);
    uint64_t h = st_plan_hash(lp.p, lp.n, P, chunk);
    st_plan_cache *cache = *d->slot;
    unsigned char *all = NULL, *parts = NULL, *mypart = NULL;
    size_t *counts = calloc((size_t)P, sizeof *counts), mylen = 0;
    st_arena arena = {0};
    st_rank_view *views = NULL;
    st_status st = {0};
    st_plan_cache *fresh = NULL;
    if (!counts) {
        free(lp.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    /* 0. an asynchronous save: rank 0 owns every destination before any rank may write
     * there (the synchronous one prepares in step 3, before the ranks write) */
    int own_rc = 0, own_t = 0;
    for (int t = 0; me == ST_ROOT && !prepare_root && !lrc && !own_rc && t < d->ntiers; t++)
        if ((own_rc = st_dest_own(&d->dst, t, 0, &d->lock[t])))
            own_t = t;
    /* 1. one collective: is every rank's layout what it was when the plan every rank holds
     * (the same: its id) was made? (and does rank 0 own the destinations? if not, which
     * one it could not own) */
    signed char flags[AGREE] = {!lrc && cache && cache->hash == h && cache->size == P,
                                (signed char)own_rc, (signed char)own_t,
                                (signed char)incr_mode(o)},
                *every = malloc((size_t)P * AGREE);
    uint64_t id = cache ? cache->id : 0;
    memcpy(flags + 4, &id, 8);
    if (!every)
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    else
        rc = st_allgather(comm, flags, AGREE, every);
    d->all_cached = !rc;
    for (int r = 0; !rc && r < P; r++)
        d->all_cached &= every[AGREE * r] != 0 && memcmp(every + AGREE * r + 4, every + 4, 8) == 0;
    for (int r = 0; !rc && !every[1] && r < P; r++)
        if (every[AGREE * r + 3] != flags[3]) /* every rank takes the same steps */
            rc = st_fail(STRATA_EINVAL, "rank %d %s, rank %d %s: every rank must give a base, "
                         "or none", me, incr_what(flags[3]), r, incr_what(every[AGREE * r + 3]));
    if (!rc && every[1]) { /* rank 0's code: nothing was written, every rank fails */
        int t = every[2];
        rc = me == ST_ROOT ? own_rc
                           : st_fail(every[1], "rank 0: cannot take ownership of '%s': %s",
                                     t < d->dst.n ? d->dst.dir[t] : "the destination",
                                     strata_error_str(every[1]));
        if (d->ntiers > 1)
            rc = st_wrap(rc, "destination %d (%s)", t, d->dst.uri[t]);
    }
    free(every);
    if (rc)
        goto out;
    if (!d->all_cached) {
        /* 2. the coordinator gathers the local plans and plans */
        if ((rc = st_gatherv(comm, lp.p, lp.n, ST_ROOT, &all, counts)))
            goto out;
        if (me == ST_ROOT) {
            if ((fresh = calloc(1, sizeof *fresh)))
                atomic_init(&fresh->refs, 1);
            views = calloc((size_t)P, sizeof *views);
            int prc = !fresh || !views ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
            if (!prc)
                prc = st_cache_hashes(fresh, all, counts, P, chunk);
            if (!prc)
                prc = st_decode_all(&arena, all, counts, P, -1, NULL, views);
            if (!prc)
                prc = st_plan_save(&fresh->sp, views, P, chunk, o->step);
            if (!prc) {
                fresh->id = d->save_id;
                prc = st_cache_encode(fresh, P, &parts, counts);
            }
            if (prc)
                st_status_set(&st, prc, ST_ROOT);
        }
    }
    /* 3. the coordinator prepares the directory; everyone learns the outcome */
    if (me == ST_ROOT && !st.rc && prepare_root) {
        int prc = lrc ? st_err_restore(lrc, local_msg)
                      : st_dest_own(&d->dst, 0, 1, &d->lock[0]);
        if (prc)
            st_status_set(&st, prc, ST_ROOT);
    }
    if (prepare_root || !d->all_cached) {
        if ((rc = st_bcast(comm, &st, sizeof st, ST_ROOT)))
            goto out;
        if (st.rc) {
            rc = st_status_raise(&st, me);
            goto out;
        }
    }
    if (!d->all_cached) {
        if ((rc = st_scatterv(comm, parts, counts, ST_ROOT, &mypart, &mylen)))
            goto out;
        if (!fresh && !(fresh = calloc(1, sizeof *fresh))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out;
        }
        atomic_init(&fresh->refs, 1);
        fresh->hash = h;
        fresh->size = P;
        fresh->chunk = chunk;
        set_cached(d, NULL); /* the old plan is stale whatever happens now */
        cache = NULL;
        if ((lrc = st_cache_decode(fresh, mypart, mylen))) {
            st_err_keep(local_msg, lrc);
        } else {
            set_cached(d, cache = fresh);
            fresh = NULL;
        }
    }
    if (!lrc && cache && (lrc = st_cache_mine(cache, &view, me, mine)))
        st_err_keep(local_msg, lrc);
    if (cache) { /* this save's reference: the plan stays while it is in flight */
        atomic_fetch_add(&cache->refs, 1);
        d->cache = cache;
    }
out:
    /* no rank writes before this returns 0: rank 0 leaves what it owned as it found it */
    for (int t = 0; rc && !comm->broken && t < d->dst.n; t++)
        if (d->lock[t]) {
            const st_vfs *v = d->dst.vfs[t];
            char p[PATH_MAX];
            if (!d->dst.replace && st_path_join(p, d->dst.dir[t], ST_LOCK_FILE) == 0 &&
                v->unlink(v, p) == 0)
                v->rmdir(v, d->dst.dir[t]); /* only if that leaves it empty */
            st_dest_abandon(&d->dst, t, &d->lock[t]);
        }
    *local_rc = lrc;
    st_plan_cache_release(fresh);
    if (rc && comm->broken)
        set_cached(d, NULL); /* the layout is unknown after a failure */
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
    char p[PATH_MAX], name[ST_DATA_FILE_BYTES];
    const st_vfs *v = d->dst.vfs[t];
    const char *dir = d->dst.dir[t];
    if (st_path_join(p, dir, ST_COMMIT_FILE) || v->stat(v, p, NULL, NULL) == 0)
        return; /* committed after all, or by another save: never touched */
    st_data_file_name(name, d->ccomm->rank);
    if (st_path_join(p, dir, name) == 0)
        v->unlink(v, p);
    st_dist_incr_unlink(&d->incr, v, dir);
    if (d->ccomm->rank == ST_ROOT) {
        if (st_path_join(p, dir, ST_META_FILE) == 0)
            v->unlink(v, p);
        if (st_path_join(p, dir, ST_PLAN_FILE) == 0)
            v->unlink(v, p);
        if (st_path_join(p, dir, ST_COMMIT_FILE ".tmp") == 0)
            v->unlink(v, p);
    }
}

/* Rank 0: each rank's report - its status in each tier (the first failure of a tier into
 * st[t]), then the checksums of what it wrote into the cached plan, or for an incremental
 * save its matches and checksums into im, a copy of the plan. */
static void take_reports(st_async_dist *d, const unsigned char *reports, const size_t *counts,
                         st_status *st, st_incr_meta *im)
{
    const int P = d->ccomm->size, T = d->ntiers;
    st_plan_cache *cache = d->cache; /* rank 0 has the plan */
    size_t off = 0;
    int irc = d->incr.on ? st_incr_meta_new(im, cache) : 0;
    for (int t = 0; irc && t < T; t++)
        st_status_set(&st[t], irc, ST_ROOT);
    for (int r = 0; r < P; r++) {
        st_rd rd = {.p = reports + off, .end = reports + off + counts[r]};
        off += counts[r];
        int rank_ok = 0;
        for (int t = 0; t < T; t++) {
            int32_t prc = (int32_t)st_rd_u32(&rd);
            st_arena tmp = {0};
            char *msg = st_rd_str(&rd, &tmp, ST_ERR_BYTES);
            if (prc && !st[t].rc) {
                st[t].rc = prc;
                st[t].rank = r;
                snprintf(st[t].msg, sizeof st[t].msg, "%s", msg ? msg : "failed");
            }
            rank_ok |= prc == 0;
            st_arena_free(&tmp);
        }
        if (d->incr.on) { /* its matches and checksums, into the copy of the plan */
            if (rank_ok && !irc && (irc = st_incr_meta_take(im, &d->incr, cache, r, &rd)))
                for (int t = 0; t < T; t++)
                    st_status_set(&st[t], irc, ST_ROOT);
            continue;
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
    if (!irc && d->incr.on && (irc = st_incr_meta_end(im, &d->incr)))
        for (int t = 0; t < T; t++)
            st_status_set(&st[t], irc, ST_ROOT);
}

static int dist_finish(void *ctx, const int *local_rc, const char *const *local_msg,
                       const st_save_plan *mine, uint64_t io_calls, strata_stats *stats)
{
    st_async_dist *d = ctx;
    strata_comm *comm = d->ccomm;
    if (comm != d->comm) /* the commit thread's: the time limit the caller's had */
        strata_comm_set_timeout(comm, d->timeout_ms);
    const int P = comm->size, me = comm->rank, T = d->ntiers;
    st_plan_cache *cache = d->cache;
    size_t nsums = 0, *counts = calloc((size_t)P, sizeof *counts);
    int any_ok = 0;
    for (int t = 0; t < T; t++)
        any_ok |= local_rc[t] == 0;
    const uint64_t *sums = any_ok ? st_mine_sums(mine, &nsums) : NULL;
    unsigned char *reports = NULL;
    st_status st[ST_MAX_TIERS];
    memset(st, 0, sizeof st);
    st_incr_meta im = {0};
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
    if (d->incr.on) {
        st_dist_incr_report(&d->incr, &rep, mine, any_ok);
    } else {
        st_buf_var(&rep, nsums);
        for (size_t i = 0; i < nsums; i++)
            st_buf_u64(&rep, sums[i]);
    }
    rc = rep.oom ? st_fail(STRATA_ENOMEM, "out of memory")
                 : st_gatherv(comm, rep.p, rep.n, ST_ROOT, &reports, counts);
    free(rep.p);
    if (rc)
        goto out;

    /* 6. the coordinator commits each tier in which every rank succeeded */
    if (me == ST_ROOT) {
        take_reports(d, reports, counts, st, &im);
        const st_save_plan *plan = d->incr.on ? &im.sp : &cache->sp;
        if (plan->meta)
            plan->meta->step = d->o.step;
        for (int t = 0; t < T; t++) {
            if (st[t].rc)
                continue;
            /* without a prepared directory (an asynchronous save), check it now */
            const st_vfs *v = d->dst.vfs[t];
            const char *dir = d->dst.dir[t];
            int crc = st_clear_stale(v, dir, plan);
            if (!crc) /* the plan, for a restart with this layout (before the commit record) */
                crc = st_plan_store(cache, v, dir, d->save_id, ST_SYNC(&d->o));
            if (!crc && (crc = st_dest_commit(&d->dst, t, plan->meta, ST_SYNC(&d->o),
                                              d->save_id, &d->lock[t])) && d->lock[t])
                st_uncommit(v, dir, d->save_id); /* this save's record, if it got that far */
            if (crc)
                st_status_set(&st[t], crc, ST_ROOT);
        }
    }
    if ((rc = st_bcast(comm, st, (size_t)T * sizeof st[0], ST_ROOT)))
        goto out;
    /* nothing committed in a failed tier: each rank removes what it wrote there (only if
     * it wrote for this save: never a committed checkpoint's files) */
    int failed = 0;
    for (int t = 0; t < T; t++)
        if (st[t].rc && !comm->broken) {
            failed = 1;
            if (d->wrote[t])
                dist_cleanup(d, t);
        }
    /* rank 0 owns the failed destinations until every rank has cleaned up (a barrier),
     * then lets them go, empty */
    int ignored;
    if (failed && st_all_true(comm, 1, &ignored) == 0 && me == ST_ROOT)
        for (int t = 0; t < T; t++)
            if (st[t].rc)
                st_dest_abandon(&d->dst, t, &d->lock[t]);
    /* the levels reached, then the peer replicas of destination 0 (after its commit, on
     * the commit's communicator: in the background where the saver has a commit thread) */
    int level = 0;
    for (int t = 0; t < T; t++)
        if (!st[t].rc)
            level |= (t == 0 ? STRATA_LEVEL_LOCAL : 0) |
                     (strncmp(d->dst.uri[t], "mem://", 6) ? STRATA_LEVEL_DURABLE : 0);
    atomic_store(&d->level, level);
    if (!st[0].rc && (d->o.peer_replicas > 0 || d->o.peer_k > 0)) {
        int prc = d->o.peer_k ? strata_peer_encode(NULL, comm, d->dst.uri[0], d->o.peer_k,
                                                   d->o.peer_m)
                              : strata_peer_replicate(NULL, comm, d->dst.uri[0],
                                                      d->o.peer_replicas);
        st_err_keep(d->peer_msg, prc);
        atomic_store(&d->level, level | PEER_ENDED | (prc ? 0 : STRATA_LEVEL_REPLICATED));
        st_clear_error();
    }
    for (int t = 0; t < T && !rc; t++)
        if (st[t].rc)
            rc = T > 1 ? st_wrap(st_status_raise(&st[t], me), "destination %d (%s)", t,
                                 d->dst.uri[t])
                       : st_status_raise(&st[t], me);
    if (rc)
        goto out;
    if (stats) {
        uint64_t mine_b = mine->meta ? mine->meta->data_bytes : 0;
        *stats = (strata_stats){.bytes = mine_b, .io_calls = io_calls,
                                .plan_cached = d->all_cached};
        st_over_ranks(comm, mine_b, &stats->all_bytes, &stats->max_writer_bytes, &stats->writers);
        stats->data_bytes = stats->all_bytes;
        if (d->incr.on) { /* the checkpoint's bytes: written, and referred to the base */
            stats->data_bytes = 0;
            st_over_ranks(comm, mine_b + d->incr.matched_bytes, &stats->data_bytes, NULL, NULL);
        }
        stats->seconds = st_now() - d->t0;
    }
out:
    /* after a failed collective rank 0 may have committed: nothing is removed, and the
     * layout is unknown */
    if (rc && comm->broken)
        set_cached(d, NULL);
    st_incr_meta_free(&im);
    free(reports);
    free(counts);
    return rc;
}

static int dist_new(st_async_dist **out, strata_comm *comm, st_plan_cache **slot, int ntiers,
                    const strata_save_opts *o)
{
    *out = NULL;
    st_async_dist *d = calloc(1, sizeof *d);
    if (!d)
        return st_fail(STRATA_ENOMEM, "out of memory");
    d->comm = d->ccomm = comm;
    d->slot = slot;
    d->o = *o;
    d->t0 = st_now();
    d->ntiers = ntiers;
    d->save_id = st_save_id_new();
    *out = d;
    return 0;
}

/* dist_new + dist_begin. 0: *d and *mine are this save's (a local failure in *local_rc,
 * message in local_msg); else the collective's error, and nothing to free. */
static int dist_start(st_async_dist **d, strata_comm *comm, st_plan_cache **slot,
                      const char *const *uris, int ntiers, strata_state *local,
                      const strata_save_opts *o, int prepare_root, st_save_plan *mine,
                      int *local_rc, char *local_msg)
{
    int rc = dist_new(d, comm, slot, ntiers, o);
    if (rc)
        return rc;
    rc = dist_begin(*d, uris, local, prepare_root, mine, local_rc, local_msg);
    if (!rc && incr_mode(o)) {
        st_async_dist *x = *d;
        rc = st_dist_incr_begin(&x->incr, comm, &x->dst, &x->o,
                                comm->rank == ST_ROOT ? x->cache : NULL, mine, local_rc,
                                local_msg);
        for (int t = 0; t < x->ntiers; t++) /* its links go with a failed save */
            x->wrote[t] |= x->incr.nmade > 0;
    }
    if (rc) {
        st_save_plan_free(mine);
        dist_free(*d);
        *d = NULL;
    }
    return rc;
}

/* The hooks of one rank's part of an asynchronous distributed save: each rank writes its
 * data file into the shared directory, and the commit is dist_finish's collective. */
static const st_dests *dist_dests(void *ctx) { return &((st_async_dist *)ctx)->dst; }

static int dist_prepare(void *ctx, int t)
{
    st_async_dist *d = ctx;
    /* rank 0 made the directory when it took ownership */
    int rc = d->lock[t] ? 0 : st_prepare_shared(d->dst.vfs[t], d->dst.dir[t]);
    if (!rc) /* this rank may write its data file there: a failure removes it */
        d->wrote[t] = 1;
    return rc;
}

static int dist_tier_done(void *ctx, int t, int rc, const st_save_plan *sp)
{
    (void)ctx, (void)t, (void)sp;
    return rc; /* committed, or removed, in dist_finish */
}

static int dist_level(void *ctx, const char **msg)
{
    st_async_dist *d = ctx;
    int level = atomic_load(&d->level);
    if (msg) /* written before PEER_ENDED, never after */
        *msg = level & PEER_ENDED ? d->peer_msg : "";
    return level & ~PEER_ENDED;
}

static const st_commit_ops dist_commit = {1,           dist_dests, dist_prepare, dist_tier_done,
                                          dist_finish, dist_free,  dist_level};

int st_save_dist(strata_comm *comm, st_plan_cache **cache, const char *uri,
                 strata_state *local, const strata_save_opts *o, strata_stats *stats)
{
    st_async_dist *d;
    st_save_plan mine;
    int local_rc;
    char local_msg[ST_ERR_BYTES];
    uint64_t io_calls = 0;
    int rc = dist_start(&d, comm, cache, &uri, 1, local, o, 1, &mine, &local_rc, local_msg);
    if (rc)
        return rc;
    /* 4. every rank writes its own data file */
    d->wrote[0] = 1;
    if (!local_rc &&
        (local_rc = st_write_data(d->dst.vfs[0], d->dst.dir[0], &mine, &d->o, &io_calls)))
        st_err_keep(local_msg, local_rc);
    const char *msg = local_msg;
    rc = dist_finish(d, &local_rc, &msg, &mine, io_calls, stats);
    st_save_plan_free(&mine);
    dist_free(d);
    return rc;
}

int st_save_dist_start(strata_handle **out, strata_comm *comm, st_plan_cache **cache,
                       const char *const *uris, int ntiers, strata_state *local,
                       const strata_save_opts *o, strata_pool **pool, st_committer *q, int bg)
{
    *out = NULL;
    st_async_dist *d;
    st_save_plan mine;
    int local_rc;
    char local_msg[ST_ERR_BYTES];
    int rc = dist_start(&d, comm, cache, uris, ntiers, local, o, 0, &mine, &local_rc, local_msg);
    if (rc)
        return rc;
    if (local_rc) { /* a local failure: the handle carries it into dist_finish */
        st_save_plan_free(&mine);
        st_err_restore(local_rc, local_msg);
    }
    d->slot = NULL; /* the commit leaves the saver's plan alone */
    if (bg && st_committer_comm(q)) {
        d->ccomm = st_committer_comm(q);
        d->timeout_ms = comm->timeout_ms;
    }
    return st_async_start(out, &mine, &d->o, pool, &dist_commit, d, local_rc, q,
                          d->ccomm != comm);
}
