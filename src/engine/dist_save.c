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

/* dist_begin's work between its steps: this rank's local plan, what the coordinator
 * gathers, plans and scatters, and this rank's own failure (lrc, its message local_msg),
 * which must still take part in every collective. */
typedef struct {
    st_async_dist *d;
    strata_comm *comm;
    int P, me, prepare_root, lrc;
    uint32_t chunk;
    char *local_msg;
    st_rank_view view;
    st_buf lp;                  /* this rank's local plan, encoded */
    uint64_t h;                 /* its hash */
    st_plan_cache *cache;       /* the saver's plan, while it may still serve */
    st_plan_cache *fresh;       /* a new plan being made */
    unsigned char *all, *parts, *mypart;
    size_t *counts, mylen;
    st_arena arena;
    st_rank_view *views;
    st_status st;               /* rank 0's outcome of planning and preparing */
} begin_ctx;

/* This rank alone: its local plan and hash, the chunk size, the destinations resolved and
 * an incremental save's base name checked. A failure here is kept in b->lrc (it travels
 * in the collectives); only running out of memory for the counts returns. */
static int begin_local(begin_ctx *b, const char *const *uris, strata_state *local)
{
    st_async_dist *d = b->d;
    b->view = st_state_view(local);
    st_encode_local_plan(&b->lp, &b->view);
    int lrc = b->lp.oom ? st_fail(STRATA_ENOMEM, "out of memory") : st_check_chunk(b->chunk);
    if (!lrc)
        lrc = st_dests_resolve(&d->dst, uris, d->ntiers, d->o.flags);
    if (!lrc && d->o.base) /* before rank 0 makes anything */
        lrc = st_incr_check_name(d->o.base, &d->dst);
    b->lrc = st_err_keep(b->local_msg, lrc);
    b->h = st_plan_hash(b->lp.p, b->lp.n, b->P, b->chunk);
    b->cache = *d->slot;
    if (!(b->counts = calloc((size_t)b->P, sizeof *b->counts)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    return 0;
}

/* Steps 0-1. An asynchronous save's rank 0 owns every destination before any rank may
 * write there (the synchronous one prepares in step 3). Then one collective: is every
 * rank's layout what it was when the plan every rank holds (the same: its id) was made?
 * do all save incrementally alike? does rank 0 own the destinations (if not, which one it
 * could not own)? Sets d->all_cached. */
static int agree_start(begin_ctx *b)
{
    st_async_dist *d = b->d;
    int own_rc = 0, own_t = 0, rc;
    for (int t = 0; b->me == ST_ROOT && !b->prepare_root && !b->lrc && !own_rc &&
                    t < d->ntiers; t++)
        if ((own_rc = st_dest_own(&d->dst, t, 0, &d->lock[t])))
            own_t = t;
    const st_plan_cache *c = b->cache;
    signed char flags[AGREE] = {!b->lrc && c && c->hash == b->h && c->size == b->P,
                                (signed char)own_rc, (signed char)own_t,
                                (signed char)incr_mode(&d->o)},
                *every = malloc((size_t)b->P * AGREE);
    uint64_t id = c ? c->id : 0;
    memcpy(flags + 4, &id, 8);
    if (!every)
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    else
        rc = st_allgather(b->comm, flags, AGREE, every);
    d->all_cached = !rc;
    for (int r = 0; !rc && r < b->P; r++)
        d->all_cached &= every[AGREE * r] != 0 && memcmp(every + AGREE * r + 4, every + 4, 8) == 0;
    for (int r = 0; !rc && !every[1] && r < b->P; r++)
        if (every[AGREE * r + 3] != flags[3]) /* every rank takes the same steps */
            rc = st_fail(STRATA_EINVAL, "rank %d %s, rank %d %s: every rank must give a base, "
                         "or none", b->me, incr_what(flags[3]), r,
                         incr_what(every[AGREE * r + 3]));
    if (!rc && every[1]) { /* rank 0's code: nothing was written, every rank fails */
        int t = every[2];
        rc = b->me == ST_ROOT ? own_rc
                              : st_fail(every[1], "rank 0: cannot take ownership of '%s': %s",
                                        t < d->dst.n ? d->dst.dir[t] : "the destination",
                                        strata_error_str(every[1]));
        if (d->ntiers > 1)
            rc = st_wrap(rc, "destination %d (%s)", t, d->dst.uri[t]);
    }
    free(every);
    return rc;
}

/* Step 2 (no plan cached on every rank): the coordinator gathers the local plans and
 * plans; its failure goes into b->st for step 3 to tell. */
static int plan_at_root(begin_ctx *b)
{
    int rc = st_gatherv(b->comm, b->lp.p, b->lp.n, ST_ROOT, &b->all, b->counts);
    if (rc || b->me != ST_ROOT)
        return rc;
    if ((b->fresh = calloc(1, sizeof *b->fresh)))
        atomic_init(&b->fresh->refs, 1);
    b->views = calloc((size_t)b->P, sizeof *b->views);
    int prc = !b->fresh || !b->views ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
    if (!prc)
        prc = st_cache_hashes(b->fresh, b->all, b->counts, b->P, b->chunk);
    if (!prc)
        prc = st_decode_all(&b->arena, b->all, b->counts, b->P, -1, NULL, b->views);
    if (!prc)
        prc = st_plan_save(&b->fresh->sp, b->views, b->P, b->chunk, b->d->o.step);
    if (!prc) {
        b->fresh->id = b->d->save_id;
        prc = st_cache_encode(b->fresh, b->P, &b->parts, b->counts);
    }
    if (prc)
        st_status_set(&b->st, prc, ST_ROOT);
    return 0;
}

/* Step 3: the coordinator prepares the directory (a synchronous save); every rank learns
 * the outcome of planning and preparing, when there was either. */
static int tell_outcome(begin_ctx *b)
{
    st_async_dist *d = b->d;
    if (b->me == ST_ROOT && !b->st.rc && b->prepare_root) {
        int prc = b->lrc ? st_err_restore(b->lrc, b->local_msg)
                         : st_dest_own(&d->dst, 0, 1, &d->lock[0]);
        if (prc)
            st_status_set(&b->st, prc, ST_ROOT);
    }
    if (!b->prepare_root && d->all_cached)
        return 0;
    int rc = st_bcast(b->comm, &b->st, sizeof b->st, ST_ROOT);
    return rc ? rc : b->st.rc ? st_status_raise(&b->st, b->me) : 0;
}

/* Each rank's part of a new plan, scattered and kept as the saver's plan; then this
 * rank's pieces (*mine) from the plan in use, which this save references to its end. */
static int take_part(begin_ctx *b, st_save_plan *mine)
{
    st_async_dist *d = b->d;
    if (!d->all_cached) {
        int rc = st_scatterv(b->comm, b->parts, b->counts, ST_ROOT, &b->mypart, &b->mylen);
        if (rc)
            return rc;
        if (!b->fresh && !(b->fresh = calloc(1, sizeof *b->fresh)))
            return st_fail(STRATA_ENOMEM, "out of memory");
        atomic_init(&b->fresh->refs, 1);
        b->fresh->hash = b->h;
        b->fresh->size = b->P;
        b->fresh->chunk = b->chunk;
        set_cached(d, NULL); /* the old plan is stale whatever happens now */
        b->cache = NULL;
        /* the plan is kept even by a rank that failed alone before (the commit needs it),
         * and that failure is kept too (it was once overwritten by this one's outcome) */
        int drc = st_cache_decode(b->fresh, b->mypart, b->mylen);
        if (!b->lrc)
            b->lrc = st_err_keep(b->local_msg, drc);
        if (!drc) {
            set_cached(d, b->cache = b->fresh);
            b->fresh = NULL;
        }
    }
    if (!b->lrc && b->cache)
        b->lrc = st_err_keep(b->local_msg, st_cache_mine(b->cache, &b->view, b->me, mine));
    if (b->cache) { /* this save's reference: the plan stays while it is in flight */
        atomic_fetch_add(&b->cache->refs, 1);
        d->cache = b->cache;
    }
    return 0;
}

/* After dist_begin failed (rc): no rank writes, so rank 0 leaves what it owned as it found
 * it; after a broken collective the layout is unknown and the saver's plan goes. */
static void begin_undo(begin_ctx *b, int rc)
{
    st_async_dist *d = b->d;
    for (int t = 0; rc && !b->comm->broken && t < d->dst.n; t++)
        if (d->lock[t]) {
            const st_vfs *v = d->dst.vfs[t];
            char p[PATH_MAX];
            if (!d->dst.replace && st_path_join(p, d->dst.dir[t], ST_LOCK_FILE) == 0 &&
                v->unlink(v, p) == 0)
                v->rmdir(v, d->dst.dir[t]); /* only if that leaves it empty */
            st_dest_abandon(&d->dst, t, &d->lock[t]);
        }
    if (rc && b->comm->broken)
        set_cached(d, NULL);
}

static void begin_free(begin_ctx *b)
{
    st_plan_cache_release(b->fresh);
    st_arena_free(&b->arena);
    free(b->views);
    free(b->lp.p);
    free(b->all);
    free(b->parts);
    free(b->mypart);
    free(b->counts);
}

/* Steps 0-3: every rank learns its part (*mine) of the save. With prepare_root, rank 0
 * prepares the directory first (st_prepare_dir, owning it) and every rank learns the
 * outcome; without, rank 0 takes ownership of every destination (st_own) and a cached
 * plan needs no more than the one collective that finds it cached and owned. A local
 * failure is returned in *local_rc (message in local_msg): the rank must still take part
 * in dist_finish. */
static int dist_begin(st_async_dist *d, const char *const *uris, strata_state *local,
                      int prepare_root, st_save_plan *mine, int *local_rc, char *local_msg)
{
    begin_ctx b = {.d = d, .comm = d->comm, .P = d->comm->size, .me = d->comm->rank,
                   .prepare_root = prepare_root, .chunk = d->o.chunk_bytes,
                   .local_msg = local_msg};
    memset(mine, 0, sizeof *mine);
    int rc = begin_local(&b, uris, local);
    if (!rc)
        rc = agree_start(&b);
    if (!rc && !d->all_cached)
        rc = plan_at_root(&b);
    if (!rc)
        rc = tell_outcome(&b);
    if (!rc)
        rc = take_part(&b, mine);
    begin_undo(&b, rc);
    *local_rc = b.lrc;
    begin_free(&b);
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

/* Step 5: each tier's status on this rank, and its checksums (the same bytes went to every
 * tier) or an incremental save's report, gathered at the coordinator. */
static int send_reports(st_async_dist *d, strata_comm *comm, const int *local_rc,
                        const char *const *local_msg, const st_save_plan *mine,
                        unsigned char **reports, size_t *counts)
{
    size_t nsums = 0;
    int any_ok = 0;
    for (int t = 0; t < d->ntiers; t++)
        any_ok |= local_rc[t] == 0;
    const uint64_t *sums = any_ok ? st_mine_sums(mine, &nsums) : NULL;
    if (!any_ok)
        nsums = 0;
    st_buf rep = {0};
    for (int t = 0; t < d->ntiers; t++) {
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
    int rc = rep.oom ? st_fail(STRATA_ENOMEM, "out of memory")
                     : st_gatherv(comm, rep.p, rep.n, ST_ROOT, reports, counts);
    free(rep.p);
    return rc;
}

/* Step 6, on the coordinator: each tier in which every rank succeeded is checked (an
 * asynchronous save's directory was not prepared), given the plan (for a restart with
 * this layout) and committed; st[t] says how each went. */
static void commit_at_root(st_async_dist *d, const unsigned char *reports, const size_t *counts,
                           st_status *st, st_incr_meta *im)
{
    take_reports(d, reports, counts, st, im);
    const st_save_plan *plan = d->incr.on ? &im->sp : &d->cache->sp;
    if (plan->meta)
        plan->meta->step = d->o.step;
    for (int t = 0; t < d->ntiers; t++) {
        if (st[t].rc)
            continue;
        const st_vfs *v = d->dst.vfs[t];
        const char *dir = d->dst.dir[t];
        int crc = st_clear_stale(v, dir, plan);
        if (!crc) /* before the commit record */
            crc = st_plan_store(d->cache, v, dir, d->save_id, ST_SYNC(&d->o));
        if (!crc && (crc = st_dest_commit(&d->dst, t, plan->meta, ST_SYNC(&d->o), d->save_id,
                                          &d->lock[t])) && d->lock[t])
            st_uncommit(v, dir, d->save_id); /* this save's record, if it got that far */
        if (crc)
            st_status_set(&st[t], crc, ST_ROOT);
    }
}

/* Every rank, once it knows each tier's outcome: nothing is committed in a failed tier,
 * so each rank removes what it wrote there (only if it wrote for this save: never a
 * committed checkpoint's files), and rank 0 owns those destinations until every rank has
 * cleaned up (a barrier), then lets them go, empty. */
static void clean_failed(st_async_dist *d, strata_comm *comm, const st_status *st)
{
    int failed = 0, ignored;
    for (int t = 0; t < d->ntiers; t++)
        if (st[t].rc && !comm->broken) {
            failed = 1;
            if (d->wrote[t])
                dist_cleanup(d, t);
        }
    if (failed && st_all_true(comm, 1, &ignored) == 0 && comm->rank == ST_ROOT)
        for (int t = 0; t < d->ntiers; t++)
            if (st[t].rc)
                st_dest_abandon(&d->dst, t, &d->lock[t]);
}

/* The levels reached, then the peer replicas of destination 0 (after its commit, on the
 * commit's communicator: in the background where the saver has a commit thread). */
static void replicate(st_async_dist *d, strata_comm *comm, const st_status *st)
{
    int level = 0;
    for (int t = 0; t < d->ntiers; t++)
        if (!st[t].rc)
            level |= (t == 0 ? STRATA_LEVEL_LOCAL : 0) |
                     (strncmp(d->dst.uri[t], "mem://", 6) ? STRATA_LEVEL_DURABLE : 0);
    atomic_store(&d->level, level);
    if (st[0].rc || (d->o.peer_replicas <= 0 && d->o.peer_k <= 0))
        return;
    int prc = d->o.peer_k ? strata_peer_encode(NULL, comm, d->dst.uri[0], d->o.peer_k,
                                               d->o.peer_m)
                          : strata_peer_replicate(NULL, comm, d->dst.uri[0], d->o.peer_replicas);
    st_err_keep(d->peer_msg, prc);
    atomic_store(&d->level, level | PEER_ENDED | (prc ? 0 : STRATA_LEVEL_REPLICATED));
    st_clear_error();
}

/* A committed save's stats, summed over the ranks (collectives). */
static void finish_stats(st_async_dist *d, strata_comm *comm, const st_save_plan *mine,
                         uint64_t io_calls, strata_stats *stats)
{
    uint64_t mine_b = mine->meta ? mine->meta->data_bytes : 0;
    *stats = (strata_stats){.bytes = mine_b, .io_calls = io_calls, .plan_cached = d->all_cached};
    st_over_ranks(comm, mine_b, &stats->all_bytes, &stats->max_writer_bytes, &stats->writers);
    stats->data_bytes = stats->all_bytes;
    if (d->incr.on) { /* the checkpoint's bytes: written, and referred to the base */
        stats->data_bytes = 0;
        st_over_ranks(comm, mine_b + d->incr.matched_bytes, &stats->data_bytes, NULL, NULL);
    }
    stats->seconds = st_now() - d->t0;
}

static int dist_finish(void *ctx, const int *local_rc, const char *const *local_msg,
                       const st_save_plan *mine, uint64_t io_calls, strata_stats *stats)
{
    st_async_dist *d = ctx;
    strata_comm *comm = d->ccomm;
    if (comm != d->comm) /* the commit thread's: the time limit the caller's had */
        strata_comm_set_timeout(comm, d->timeout_ms);
    const int P = comm->size, me = comm->rank, T = d->ntiers;
    size_t *counts = calloc((size_t)P, sizeof *counts);
    unsigned char *reports = NULL;
    st_status st[ST_MAX_TIERS];
    memset(st, 0, sizeof st);
    st_incr_meta im = {0};
    if (!counts)
        return st_fail(STRATA_ENOMEM, "out of memory");
    int rc = send_reports(d, comm, local_rc, local_msg, mine, &reports, counts);
    if (!rc && me == ST_ROOT)
        commit_at_root(d, reports, counts, st, &im);
    if (!rc)
        rc = st_bcast(comm, st, (size_t)T * sizeof st[0], ST_ROOT);
    if (!rc) {
        clean_failed(d, comm, st);
        replicate(d, comm, st);
    }
    for (int t = 0; t < T && !rc; t++)
        if (st[t].rc)
            rc = T > 1 ? st_wrap(st_status_raise(&st[t], me), "destination %d (%s)", t,
                                 d->dst.uri[t])
                       : st_status_raise(&st[t], me);
    if (!rc && stats)
        finish_stats(d, comm, mine, io_calls, stats);
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
