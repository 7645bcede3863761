/* saver.c - the front door of saves: strata_saver, strata_save_start and strata_save (loads:
 * loader.c).
 * Each call checks its arguments and options once, then picks the way it runs: ranks in
 * this process or one rank of a communicator, one destination or tiers, on the caller's
 * thread or through the pool in the background. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/comm.h"
#include "../core/error.h"
#include "../io/bufpool.h"
#include "dist.h"
#include "engine.h"

struct strata_saver {
    strata_comm *comm;    /* borrowed; NULL: ranks in this process */
    strata_pool *pool;    /* the caller's, or made at the first save that needs one */
    int own_pool;
    st_plan_cache *cache; /* with a communicator: the last plan */
    st_committer *bg;     /* saves in flight; the commit thread */
    int background;       /* strata_saver_background: 1, 0, or -1 before it is known */
    char why[ST_ERR_BYTES];      /* why not in the background */
};

int strata_saver_new(strata_saver **out, strata_comm *comm, strata_pool *pool)
{
    *out = NULL;
    strata_saver *sv = calloc(1, sizeof *sv);
    if (!sv || st_committer_new(&sv->bg)) {
        free(sv);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    sv->comm = comm;
    sv->pool = pool;
    sv->background = comm ? -1 : 1; /* in this process, each save commits on its own thread */
    *out = sv;
    return 0;
}

void strata_saver_free(strata_saver *sv)
{
    if (!sv)
        return;
    st_committer_drain(sv->bg); /* the saves in flight end first (their handles stay) */
    st_committer_unref(sv->bg);
    st_plan_cache_release(sv->cache);
    if (sv->own_pool)
        strata_pool_free(sv->pool);
    free(sv);
}

int strata_saver_reuse_plan(strata_saver *sv, const char *uri)
{
    if (!sv || !uri)
        return st_fail(STRATA_EINVAL, "strata_saver_reuse_plan: saver and uri are required");
    if (!sv->comm)
        return st_fail(STRATA_EINVAL, "strata_saver_reuse_plan: a saver without a "
                       "communicator plans in this process, with no collective to save");
    st_plan_cache *c = NULL;
    st_plan_cache_release(sv->cache); /* whatever happens, the last plan is not this one */
    sv->cache = NULL;
    int rc = st_plan_adopt(&c, uri, sv->comm->rank, sv->comm->size);
    if (!rc)
        sv->cache = c;
    return rc;
}

int strata_saver_background(const char **why, const strata_saver *sv)
{
    if (why)
        *why = sv->background == 1 ? "" : sv->background == 0 ? sv->why
                                                               : "no asynchronous save yet";
    return sv->background;
}

/* At the first asynchronous save of a saver with a communicator (every rank, on the
 * caller's thread): a duplicate of the communicator for the saver's commit thread, if
 * every rank got one; else the commits stay on the caller's thread. A failed collective
 * fails the save. */
static int choose_background(strata_saver *sv)
{
    strata_comm *dup = NULL;
    int rc = st_comm_dup(sv->comm, &dup);
    if (!rc)
        rc = st_committer_start(sv->bg, dup); /* takes dup */
    if (rc)
        st_err_keep(sv->why, rc);
    int all = 0, crc = st_all_true(sv->comm, rc == 0, &all);
    if (crc || !all)
        st_committer_stop(sv->bg);
    if (crc)
        return crc;
    if (!rc && !all)
        snprintf(sv->why, sizeof sv->why, "another rank's communicator could not be "
                 "duplicated (its message says why)");
    sv->background = all;
    st_clear_error();
    return 0;
}

int strata_save_start(strata_handle **out, strata_saver *sv, const char *const *uris, int nuris,
                      strata_state *const *states, int nstates, const strata_save_opts *opts)
{
    *out = NULL;
    st_clear_error();
    strata_comm *comm = sv ? sv->comm : NULL;
    strata_save_opts o;
    int rc = st_save_opts_get(&o, opts);
    if (!rc)
        rc = st_check_where("save", comm, uris, nuris, states, nstates);
    if (!rc)
        rc = st_check_peer(&o, comm);
    if (rc)
        return rc;
    /* the saver's pool; a pool of the saver's own with buffers too small for this save's
     * chunks is made again (allocated in the background like the first) if no save uses
     * it, else this save gets one of its own, as it does without a saver */
    strata_pool **pool = sv ? &sv->pool : NULL;
    if (sv && sv->own_pool && st_pool_buffer_bytes(sv->pool) < o.chunk_bytes) {
        if (st_pool_busy(sv->pool)) {
            pool = NULL;
        } else {
            strata_pool_free(sv->pool);
            sv->pool = NULL;
            sv->own_pool = 0;
        }
    }
    int had_pool = sv && sv->pool;
    if (comm && sv->background < 0 && (rc = choose_background(sv)))
        return rc;
    if (comm) {
        rc = st_save_dist_start(out, comm, &sv->cache, uris, nuris, states[0], &o, pool, sv->bg,
                                sv->background == 1);
    } else {
        st_save_plan sp;
        void *ctx;
        if (!(rc = st_plan_states(&sp, states, nstates, &o))) {
            if ((rc = st_local_commit_new(&ctx, uris, nuris, &o))) {
                st_save_plan_free(&sp);
            } else if ((rc = st_local_commit_incr(ctx, &sp, &o))) {
                st_save_plan_free(&sp);
                st_local_commit.release(ctx);
            } else
                rc = st_async_start(out, &sp, &o, pool, &st_local_commit, ctx, 0,
                                    sv ? sv->bg : NULL, 0);
        }
    }
    if (sv && !had_pool && sv->pool)
        sv->own_pool = 1; /* made for this saver, kept for its next saves */
    return rc;
}

int strata_save(strata_stats *stats, strata_saver *sv, const char *const *uris, int nuris,
                strata_state *const *states, int nstates, const strata_save_opts *opts)
{
    st_clear_error();
    strata_comm *comm = sv ? sv->comm : NULL;
    strata_save_opts o;
    strata_stats full = STRATA_STATS_INIT;
    int rc = st_stats_check(stats);
    if (!rc)
        rc = st_save_opts_get(&o, opts);
    if (!rc)
        rc = st_check_where("save", comm, uris, nuris, states, nstates);
    if (!rc)
        rc = st_check_peer(&o, comm);
    if (rc)
        return rc;
    if (nuris == 1 && !o.peer_replicas && !o.peer_k) { /* straight from the caller's buffers, no copy */
        rc = comm ? st_save_dist(comm, &sv->cache, uris[0], states[0], &o, &full)
                  : st_save_local(uris[0], states, nstates, &o, &full);
    } else {
        strata_handle *h;
        if (!(rc = strata_save_start(&h, sv, uris, nuris, states, nstates, &o))) {
            rc = strata_wait_durable(&full, h);
            char msg[ST_ERR_BYTES]; /* the free may run strata calls: the message stays */
            st_err_keep(msg, rc);
            strata_handle_free(h);
            if (rc)
                rc = st_err_restore(rc, msg);
        }
    }
    if (!rc)
        st_stats_put(stats, &full);
    return rc;
}
