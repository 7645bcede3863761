/* distutil.h - the ranks of a distributed call as threads of one test process: a world
 * (each rank's host communicator on a pthread barrier, with a duplicate for the savers'
 * commit threads, and its saver, where the plan cache lives), run_all (one save or load on
 * every rank at once, each rank's outcome in its job), and the model the tests save: a
 * weight split by rows over tp, a replicated bias, a ZeRO flat-sharded vector and blobs.
 * Used by test_dist.c and test_dist_commit.c. */
#ifndef STRATA_TESTS_DISTUTIL_H
#define STRATA_TESTS_DISTUTIL_H

#include <pthread.h>

#include "testutil.h"
#include "threadcomm.h"

typedef struct {
    hub h, twin; /* twin: the communicators' duplicates (the savers' commit threads) */
    tcomm *tc, *twin_tc;
    strata_comm **comm;
    strata_saver **sv; /* per rank, on its communicator: the plan cache lives here */
} world;

/* 1: the worlds' communicators cannot be duplicated, so that their asynchronous saves
 * commit on the caller's thread (strata_wait_durable), as before background commits */
static int plain_comms;

static void world_init(world *w, int n)
{
    hub_init(&w->h, n);
    hub_init(&w->twin, n);
    w->twin_tc = calloc((size_t)n, sizeof *w->twin_tc);
    for (int r = 0; r < n; r++)
        w->twin_tc[r] = (tcomm){&w->twin, r};
    if (!plain_comms)
        tc_set_twin(&w->h, w->twin_tc);
    w->tc = calloc((size_t)n, sizeof *w->tc);
    w->comm = calloc((size_t)n, sizeof *w->comm);
    w->sv = calloc((size_t)n, sizeof *w->sv);
    for (int r = 0; r < n; r++) {
        w->tc[r] = (tcomm){&w->h, r};
        assert_ok(strata_comm_host(&w->comm[r], &tops, &w->tc[r], r, n));
        assert_ok(strata_saver_new(&w->sv[r], w->comm[r], NULL));
    }
}

static void world_free(world *w)
{
    for (int r = 0; r < w->h.size; r++) {
        strata_saver_free(w->sv[r]);
        strata_comm_free(w->comm[r]);
    }
    tc_set_twin(&w->h, NULL);
    hub_free(&w->h);
    hub_free(&w->twin);
    free(w->twin_tc);
    free(w->tc);
    free(w->comm);
    free(w->sv);
}

/* ---- running a distributed call on every rank ---- */

typedef struct {
    world *w;
    int rank, save; /* save: 0 load, 1 save, 2 asynchronous save (SAVE_ASYNC) */
    const char *uri; /* per rank: normally the same */
    const char *uri2; /* SAVE_TIERS: the second destination */
    tu_set *set;
    strata_save_opts so;
    strata_load_opts lo; /* loads: this rank's own options */
    int rc;
    char msg[1024];
    strata_stats stats;
} job;

enum { SAVE_ASYNC = 2, SAVE_OVERLAP = 3, SAVE_TIERS = 4, SAVE_DONE = 5, SAVE_ORDER = 6 };

/* The lazy save of one rank: start, wait for the snapshot, poison the sources, wait until
 * committed. The checkpoint must hold the values from before the poison. SAVE_TIERS: to
 * two destinations, j->uri (tier 0) and j->uri2 (tier 1). */
static int async_save(job *j)
{
    strata_handle *h;
    const char *uris[2] = {j->uri, j->uri2};
    int rc = strata_save_start(&h, j->w->sv[j->rank], uris, j->save == SAVE_TIERS ? 2 : 1,
                               &j->set->st[j->rank], 1, &j->so);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    tu_set_poison(j->set, j->rank);
    int drc = strata_wait_durable(&j->stats, h); /* a collective: always called */
    strata_handle_free(h);
    return drc ? drc : rc;
}

/* Two saves in flight at once: the second (to uri-b, another chunk size, so another plan
 * that replaces the cached one) starts before the first is durable. */
static int overlap_save(job *j)
{
    strata_handle *h[2] = {NULL, NULL};
    char uri_b[700];
    snprintf(uri_b, sizeof uri_b, "%s-b", j->uri);
    const char *ub = uri_b;
    strata_save_opts ob = j->so;
    ob.chunk_bytes = 8192;
    strata_saver *sv = j->w->sv[j->rank];
    strata_state *const *st = &j->set->st[j->rank];
    int rc = strata_save_start(&h[0], sv, &j->uri, 1, st, 1, &j->so);
    if (!rc)
        rc = strata_save_start(&h[1], sv, &ub, 1, st, 1, &ob);
    for (int i = 0; i < 2 && h[i]; i++) {
        int src = strata_wait_snapshot(h[i]);
        rc = rc ? rc : src;
    }
    tu_set_poison(j->set, j->rank);
    for (int i = 0; i < 2 && h[i]; i++) {
        int drc = strata_wait_durable(&j->stats, h[i]);
        rc = rc ? rc : drc;
        strata_handle_free(h[i]);
    }
    return rc;
}

static int sync_saves; /* run_all's saves fsync (for the fault walk) */
static unsigned more_flags; /* run_all's saves: these flags too */
static uint64_t save_step = 9; /* run_all's saves: the step */

/* Start, snapshot, then no call at all until strata_handle_done says the save is over:
 * with background commits it is then committed (probe), with no strata_wait_durable. The
 * commit thread of the twin communicator did it. stats.tier gets 1 if the probe found it
 * committed before strata_wait_durable (which must then return at once, with 0). */
static int done_save(job *j)
{
    strata_handle *h;
    int rc = strata_save_start(&h, j->w->sv[j->rank], &j->uri, 1, &j->set->st[j->rank], 1,
                               &j->so);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    for (int i = 0; i < 30000 && !strata_handle_done(h); i++) /* a hang guard: 30 s */
        usleep(1000);
    strata_probe_info pi = {0};
    int prc = strata_probe(&pi, j->uri);
    int done = strata_handle_done(h);
    int drc = strata_wait_durable(&j->stats, h);
    j->stats.tier = done && prc == 0 && pi.committed;
    strata_handle_free(h);
    return drc ? drc : rc;
}

/* Three saves in flight on one saver (to uri-0, uri-1, uri-2), all started before any is
 * waited for, and waited for last first; the first one's writes are held back on one rank
 * (commit_gate) so that the later ones are written first. */
static int order_save(job *j)
{
    strata_handle *h[3] = {NULL, NULL, NULL};
    int rc = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        char u[700];
        snprintf(u, sizeof u, "%s-%d", j->uri, i);
        const char *up = u;
        rc = strata_save_start(&h[i], j->w->sv[j->rank], &up, 1, &j->set->st[j->rank], 1,
                               &j->so);
    }
    for (int i = 2; i >= 0; i--) {
        if (!h[i])
            continue;
        int drc = strata_wait_durable(NULL, h[i]);
        rc = rc ? rc : drc;
        strata_handle_free(h[i]);
    }
    return rc;
}

static void *run_job(void *p)
{
    job *j = p;
    if (j->save == SAVE_DONE)
        j->rc = done_save(j);
    else if (j->save == SAVE_ORDER)
        j->rc = order_save(j);
    else if (j->save == SAVE_OVERLAP)
        j->rc = overlap_save(j);
    else if (j->save == SAVE_ASYNC || j->save == SAVE_TIERS)
        j->rc = async_save(j);
    else if (j->save)
        j->rc = strata_save(&j->stats, j->w->sv[j->rank], &j->uri, 1, &j->set->st[j->rank], 1,
                            &j->so);
    else
        j->rc = strata_load(&j->stats, j->w->comm[j->rank], &j->uri, 1, &j->set->st[j->rank],
                            1, &j->lo);
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* Runs save (or load) on every rank of w, each with uris[r] (or uri); results in jobs. */
static const char **tier2; /* SAVE_TIERS: each rank's second destination */

static const strata_load_opts *load_opts; /* per rank, for run_all's loads (NULL: defaults) */

static void run_all(world *w, int save, const char *uri, const char **uris, tu_set *set,
                    job *jobs)
{
    int n = w->h.size;
    pthread_t *th = calloc((size_t)n, sizeof *th);
    for (int r = 0; r < n; r++) {
        jobs[r] = (job){w, r, save, uris ? uris[r] : uri, tier2 ? tier2[r] : NULL, set,
                        STRATA_SAVE_OPTS_INIT, STRATA_LOAD_OPTS_INIT, 0, "",
                        STRATA_STATS_INIT};
        if (load_opts)
            jobs[r].lo = load_opts[r];
        if (!sync_saves)
            jobs[r].so.flags |= STRATA_SAVE_NO_SYNC;
        jobs[r].so.chunk_bytes = 4096;
        jobs[r].so.step = save_step;
        jobs[r].so.flags |= more_flags;
        assert_int_equal(pthread_create(&th[r], NULL, run_job, &jobs[r]), 0);
    }
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
    free(th);
}

static void expect_all_ok(const job *jobs, int n)
{
    for (int r = 0; r < n; r++)
        if (jobs[r].rc)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
}

static char base[512];

static void layout(tu_set *s, int tp, int dp, int fill);

/* ck loads on one rank and holds the pattern, bitwise. */
static void expect_loads(const char *ck)
{
    tu_set d;
    layout(&d, 1, 1, 0);
    assert_ok(strata_load(NULL, NULL, &ck, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
}

/* The model: a [37, 23] f32 weight split by rows over tp, a [23] bias replicated, a
 * [101] bf16 vector flat-sharded (ZeRO) over the dp ranks, a global and a per-rank blob. */
static const uint64_t wshape[] = {37, 23}, bshape[] = {23}, zshape[] = {101};

static void layout(tu_set *s, int tp, int dp, int fill)
{
    tu_set_init(s, tp * dp);
    for (int r = 0; r < tp * dp; r++) {
        int t = r % tp, d = r / tp;
        uint64_t off[] = {37 * (uint64_t)t / (uint64_t)tp, 0};
        uint64_t len[] = {37 * (uint64_t)(t + 1) / (uint64_t)tp - off[0], 23};
        tu_set_shard(s, r, "w", STRATA_F32, 2, wshape, off, len, 0, 0, 0, fill);
        tu_set_shard(s, r, "b", STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, fill);
        uint64_t zs = 101 * (uint64_t)r / (uint64_t)(tp * dp);
        uint64_t ze = 101 * (uint64_t)(r + 1) / (uint64_t)(tp * dp);
        tu_set_shard(s, r, "z", STRATA_BF16, 1, zshape, NULL, NULL, 1, zs, ze, fill);
        (void)d;
        tu_set_blob(s, r, "cfg", 0, -1, 33, fill);
    }
}

#endif
