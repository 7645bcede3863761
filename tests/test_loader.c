/* test_loader.c - strata_loader: a checkpoint opened once and loaded many times. Repeated
 * loads with other requests (bitwise, the plan kept for a request that repeats), the index
 * read once (the loads go on after metadata.bin and COMMIT are gone), the index queried
 * through strata_ckpt accessors, tier fallback at open and at load, the distributed loader
 * (ranks as threads, every broadcast counted by the communicator), export's one open, and
 * the errors with their codes. */
#include <stdatomic.h>

#include "distutil.h"

static void save_model(const char *ck, int tp, int dp)
{
    tu_set src;
    layout(&src, tp, dp, 1);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags |= STRATA_SAVE_NO_SYNC;
    so.chunk_bytes = 4096;
    so.step = 9;
    assert_ok(strata_save(NULL, NULL, &ck, 1, src.st, tp * dp, &so));
    tu_set_free(&src);
}

/* Moves the index of checkpoint ck away (COMMIT and metadata.bin), or back. */
static void hide_index(const char *ck, int hide)
{
    static const char *const names[] = {"COMMIT", "metadata.bin"};
    for (int i = 0; i < 2; i++) {
        char a[700], b[700];
        snprintf(a, sizeof a, "%s/%s", ck, names[i]);
        snprintf(b, sizeof b, "%s/%s.away", ck, names[i]);
        assert_int_equal(hide ? rename(a, b) : rename(b, a), 0);
    }
}

static void test_index(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/index", base);
    save_model(ck, 2, 1);
    const char *u = ck;
    strata_loader *ld;
    assert_ok(strata_loader_open(&ld, NULL, &u, 1, NULL));
    const strata_ckpt *ix = strata_loader_index(ld);
    assert_int_equal(strata_loader_tier(ld), 0);
    assert_int_equal(strata_ckpt_format(ix), STRATA_FORMAT_STRATA);
    assert_int_equal(strata_ckpt_committed(ix), 1);
    assert_int_equal(strata_ckpt_step(ix), 9);
    assert_int_equal(strata_ckpt_chunk_bytes(ix), 4096);
    assert_int_equal(strata_ckpt_ntensors(ix), 3);
    assert_int_equal(strata_ckpt_nblobs(ix), 1);
    int seen = 0;
    for (size_t i = 0; i < strata_ckpt_ntensors(ix); i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ix, i);
        if (strcmp(ti.name, "w") == 0) {
            assert_int_equal(ti.dtype, STRATA_F32);
            assert_int_equal(ti.ndim, 2);
            assert_int_equal(ti.shape[0], 37);
            assert_int_equal(ti.shape[1], 23);
            assert_int_equal(ti.nshards, 2);
            seen |= 1;
        } else if (strcmp(ti.name, "z") == 0) {
            assert_int_equal(ti.dtype, STRATA_BF16);
            assert_int_equal(ti.shape[0], 101);
            seen |= 2;
        }
    }
    assert_int_equal(seen, 3);
    expect_loads(ck); /* the loader holds no lock: others open the checkpoint meanwhile */
    strata_blob_info bi;
    strata_ckpt_blob(&bi, ix, 0);
    assert_string_equal(bi.name, "cfg");
    assert_int_equal(bi.bytes, 33);
    strata_loader_free(ld);
    tu_rmrf(ck);
}

/* One open, several loads with other requests: each bitwise, the index never read again
 * (it is gone from the disk after the open), the plan reused only for a repeated request. */
static void test_repeated_loads(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/repeat", base);
    save_model(ck, 2, 2);
    const char *u = ck;
    strata_loader *ld;
    assert_ok(strata_loader_open(&ld, NULL, &u, 1, NULL));
    hide_index(ck, 1);
    static const int shapes[][2] = {{1, 1}, {3, 1}, {3, 1}, {1, 2}, {1, 1}};
    static const int cached[] = {0, 0, 1, 0, 0};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        tu_set d;
        int tp = shapes[k][0], dp = shapes[k][1];
        layout(&d, tp, dp, 0);
        strata_stats s = STRATA_STATS_INIT;
        assert_ok(strata_loader_load(&s, ld, d.st, tp * dp, NULL));
        assert_int_equal(tu_set_check(&d), 0);
        assert_int_equal(s.tier, 0);
        assert_int_equal(s.meta_reads, 1);
        assert_int_equal(s.meta_bcasts, 0);
        if (s.plan_cached != cached[k])
            fail_msg("load %zu (tp %d dp %d): plan_cached %d, expected %d", k, tp, dp,
                     s.plan_cached, cached[k]);
        tu_set_free(&d);
    }
    /* the same request with the cast flag is another request */
    tu_set d;
    layout(&d, 1, 1, 0);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags |= STRATA_LOAD_CAST;
    strata_stats s = STRATA_STATS_INIT;
    assert_ok(strata_loader_load(&s, ld, d.st, 1, &lo));
    assert_int_equal(s.plan_cached, 0);
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    /* a request the checkpoint cannot fill fails, and the loader still loads after it */
    tu_set bad;
    tu_set_init(&bad, 1);
    tu_set_shard(&bad, 0, "nope", STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
    assert_rc(strata_loader_load(NULL, ld, bad.st, 1, NULL), STRATA_ENOTFOUND);
    tu_set_free(&bad);
    layout(&d, 2, 1, 0);
    assert_ok(strata_loader_load(NULL, ld, d.st, 2, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    strata_loader_free(ld);
    /* strata_load reads the index itself: without it, the checkpoint does not open */
    layout(&d, 1, 1, 0);
    assert_rc(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL), STRATA_EINCOMPLETE);
    hide_index(ck, 0);
    s = (strata_stats)STRATA_STATS_INIT;
    assert_ok(strata_load(&s, NULL, &u, 1, d.st, 1, NULL));
    assert_int_equal(s.meta_reads, 1);
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_rmrf(ck);
}

/* Tiers: the first tier that opens is taken at open; a load that fails on it (a bad
 * checksum) goes on to the next tier, which is read then. */
static void test_tiers(void **state)
{
    (void)state;
    char missing[600], good[600], bad[600], f[700];
    snprintf(missing, sizeof missing, "%s/tier-missing", base);
    snprintf(good, sizeof good, "%s/tier-good", base);
    snprintf(bad, sizeof bad, "%s/tier-bad", base);
    save_model(good, 1, 1);
    save_model(bad, 1, 1);
    tu_join(f, bad, "data-000000.bin");
    tu_flip_byte(f, 10, 0x20);

    const char *open2[] = {missing, good};
    strata_loader *ld;
    assert_ok(strata_loader_open(&ld, NULL, open2, 2, NULL));
    assert_int_equal(strata_loader_tier(ld), 1);
    tu_set d;
    layout(&d, 1, 1, 0);
    strata_stats s = STRATA_STATS_INIT;
    assert_ok(strata_loader_load(&s, ld, d.st, 1, NULL));
    assert_int_equal(s.tier, 1);
    assert_int_equal(s.meta_reads, 2); /* the missing one tried, the good one read */
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    strata_loader_free(ld);

    const char *load2[] = {bad, good};
    assert_ok(strata_loader_open(&ld, NULL, load2, 2, NULL));
    assert_int_equal(strata_loader_tier(ld), 0);
    layout(&d, 1, 1, 0);
    s = (strata_stats)STRATA_STATS_INIT;
    assert_ok(strata_loader_load(&s, ld, d.st, 1, NULL));
    assert_int_equal(s.tier, 1);
    assert_int_equal(strata_loader_tier(ld), 1);
    assert_int_equal(s.meta_reads, 2);
    assert_int_equal(tu_set_check(&d), 0);
    /* the index is now the good tier's, and loads stay there */
    assert_int_equal(strata_ckpt_ntensors(strata_loader_index(ld)), 3);
    s = (strata_stats)STRATA_STATS_INIT;
    assert_ok(strata_loader_load(&s, ld, d.st, 1, NULL));
    assert_int_equal(s.tier, 1);
    assert_int_equal(s.meta_reads, 2);
    tu_set_free(&d);
    strata_loader_free(ld);

    /* every tier bad: the message names each */
    const char *none[] = {missing, bad};
    assert_ok(strata_loader_open(&ld, NULL, none, 2, NULL));
    layout(&d, 1, 1, 0);
    assert_rc(strata_loader_load(NULL, ld, d.st, 1, NULL), STRATA_ECHECKSUM);
    assert_msg_has("no copy could be loaded");
    assert_msg_has("tier-missing");
    assert_msg_has("tier-bad");
    /* no tier left: further loads say so */
    assert_rc(strata_loader_load(NULL, ld, d.st, 1, NULL), STRATA_EINVAL);
    assert_msg_has("no tier left");
    assert_null(strata_loader_index(ld));
    assert_int_equal(strata_loader_tier(ld), -1);
    tu_set_free(&d);
    strata_loader_free(ld);
    tu_rmrf(good);
    tu_rmrf(bad);
}

static void test_errors(void **state)
{
    (void)state;
    char ck[600], inc[600], f[700];
    snprintf(ck, sizeof ck, "%s/errs", base);
    snprintf(inc, sizeof inc, "%s/incomplete", base);
    save_model(ck, 1, 1);
    save_model(inc, 1, 1);
    tu_join(f, inc, "COMMIT");
    assert_int_equal(unlink(f), 0);
    const char *u = ck, *ui = inc, *empty = "", *nul[] = {NULL};
    char missing[700];
    snprintf(missing, sizeof missing, "%s/not-there", base);
    const char *um = missing;
    strata_loader *ld = (strata_loader *)&ld; /* set to NULL on every failure */

    assert_rc(strata_loader_open(&ld, NULL, NULL, 1, NULL), STRATA_EINVAL);
    assert_null(ld);
    assert_rc(strata_loader_open(&ld, NULL, &u, 0, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_open(&ld, NULL, &u, STRATA_MAX_TIERS + 1, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_open(&ld, NULL, &empty, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_open(&ld, NULL, nul, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_open(NULL, NULL, &u, 1, NULL), STRATA_EINVAL);
    strata_loader_opts lo0 = STRATA_LOADER_OPTS_INIT;
    lo0.version = 0;
    assert_rc(strata_loader_open(&ld, NULL, &u, 1, &lo0), STRATA_EINVAL);
    assert_msg_has("strata_loader_opts.version 0");
    lo0.version = STRATA_LOADER_OPTS_VERSION + 1;
    assert_rc(strata_loader_open(&ld, NULL, &u, 1, &lo0), STRATA_EINVAL);
    lo0 = (strata_loader_opts)STRATA_LOADER_OPTS_INIT;
    lo0.flags = 4;
    assert_rc(strata_loader_open(&ld, NULL, &u, 1, &lo0), STRATA_EINVAL);
    assert_msg_has("flags 0x4");
    assert_rc(strata_loader_open(&ld, NULL, &um, 1, NULL), STRATA_ENOENT);
    assert_msg_has("not-there");
    assert_rc(strata_loader_open(&ld, NULL, &ui, 1, NULL), STRATA_EINCOMPLETE);
    assert_msg_has("incomplete");
    const char *both[] = {missing, inc};
    assert_rc(strata_loader_open(&ld, NULL, both, 2, NULL), STRATA_EINCOMPLETE);
    assert_msg_has("no copy could be loaded");
    assert_msg_has("not-there");
    assert_null(ld);

    lo0 = (strata_loader_opts)STRATA_LOADER_OPTS_INIT;
    assert_ok(strata_loader_open(&ld, NULL, &u, 1, &lo0));
    tu_set d;
    layout(&d, 1, 1, 0);
    strata_load_opts o = STRATA_LOAD_OPTS_INIT;
    o.version = 99;
    assert_rc(strata_loader_load(NULL, ld, d.st, 1, &o), STRATA_EINVAL);
    assert_msg_has("strata_load_opts.version 99");
    strata_stats s = STRATA_STATS_INIT;
    s.version = 0;
    assert_rc(strata_loader_load(&s, ld, d.st, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_load(NULL, ld, NULL, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_load(NULL, ld, d.st, 0, NULL), STRATA_EINVAL);
    assert_rc(strata_loader_load(NULL, NULL, d.st, 1, NULL), STRATA_EINVAL);
    /* a version-2 stats struct gets no counters, and nothing past its end */
    struct {
        strata_stats s;
    } v2;
    memset(&v2, 0x77, sizeof v2);
    v2.s.version = 2;
    assert_ok(strata_loader_load(&v2.s, ld, d.st, 1, NULL));
    assert_int_equal(v2.s.version, 2);
    assert_int_equal(v2.s.meta_reads, 0x7777777777777777ull);
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    strata_loader_free(ld);
    strata_loader_free(NULL);
    tu_rmrf(ck);
    tu_rmrf(inc);
}

/* ---- the distributed loader: ranks as threads, broadcasts counted ---- */

static atomic_int nbcast, ncoll;

static int counting_bcast(void *ctx, void *buf, size_t n, int root)
{
    atomic_fetch_add(&nbcast, 1);
    return tops.bcast(ctx, buf, n, root);
}

static int counting_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    atomic_fetch_add(&ncoll, 1);
    return tops.allgather(ctx, send, n, recv);
}

static int counting_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                              const size_t *rc)
{
    atomic_fetch_add(&ncoll, 1);
    return tops.alltoallv(ctx, send, sc, recv, rc);
}

/* P host communicators on hub h whose every collective is counted. */
static void counting_comms(hub *h, tcomm *tc, strata_comm **comm, int P)
{
    static strata_comm_ops ops;
    ops = tops;
    ops.bcast = counting_bcast;
    ops.allgather = counting_allgather;
    ops.alltoallv = counting_alltoallv;
    ops.dup = NULL;
    hub_init(h, P);
    for (int r = 0; r < P; r++) {
        tc[r] = (tcomm){h, r};
        assert_ok(strata_comm_host(&comm[r], &ops, &tc[r], r, P));
    }
}

typedef struct {
    strata_comm *comm;
    const char **uris;
    int nuris, rank, rc, tier, ntensors, cached[3];
    tu_set *set[3];
    strata_stats stats[3];
    char msg[1024];
} dist_job;

static void *dist_run(void *p)
{
    dist_job *j = p;
    strata_loader *ld;
    j->rc = strata_loader_open(&ld, j->comm, j->uris, j->nuris, NULL);
    if (!j->rc) {
        j->tier = strata_loader_tier(ld);
        j->ntensors = (int)strata_ckpt_ntensors(strata_loader_index(ld));
        for (int k = 0; k < 3 && !j->rc; k++) {
            j->stats[k] = (strata_stats)STRATA_STATS_INIT;
            j->rc = strata_loader_load(&j->stats[k], ld, &j->set[k]->st[j->rank], 1, NULL);
        }
        strata_loader_free(ld);
    }
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* 3 ranks load a checkpoint saved by 4, three times (two layouts, the second twice): one
 * broadcast per rank for the whole loader, the index read by rank 0 only, the plan reused
 * for the repeated request, every load bitwise. */
static void test_dist(void **state)
{
    (void)state;
    char ck[600], missing[600];
    snprintf(ck, sizeof ck, "%s/dist", base);
    snprintf(missing, sizeof missing, "%s/dist-missing", base);
    { /* saved by 4 ranks of a communicator */
        world w;
        world_init(&w, 4);
        tu_set src;
        job sj[4];
        layout(&src, 2, 2, 1);
        run_all(&w, 1, ck, NULL, &src, sj);
        expect_all_ok(sj, 4);
        world_free(&w);
        tu_set_free(&src);
    }
    const int P = 3;
    hub h;
    tcomm tc[3];
    strata_comm *comm[3];
    counting_comms(&h, tc, comm, P);
    tu_set a, b, c;
    layout(&a, 3, 1, 0);
    layout(&b, 1, 3, 0);
    layout(&c, 1, 3, 0);
    const char *uris[] = {missing, ck};
    dist_job jobs[3];
    pthread_t th[3];
    atomic_store(&nbcast, 0);
    for (int r = 0; r < P; r++) {
        jobs[r] = (dist_job){comm[r], uris, 2, r, 0, -1, 0, {0}, {&a, &b, &c}, {{0}}, ""};
        assert_int_equal(pthread_create(&th[r], NULL, dist_run, &jobs[r]), 0);
    }
    for (int r = 0; r < P; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < P; r++) {
        if (jobs[r].rc)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
        assert_int_equal(jobs[r].tier, 1);
        assert_int_equal(jobs[r].ntensors, 3);
        for (int k = 0; k < 3; k++) {
            assert_int_equal(jobs[r].stats[k].tier, 1);
            assert_int_equal(jobs[r].stats[k].meta_reads, r == 0 ? 2 : 0);
            assert_int_equal(jobs[r].stats[k].meta_bcasts, 1);
            assert_int_equal(jobs[r].stats[k].plan_cached, k == 2);
        }
    }
    assert_int_equal(atomic_load(&nbcast), P); /* one broadcast, seen by each rank */
    assert_int_equal(tu_set_check(&a), 0);
    assert_int_equal(tu_set_check(&b), 0);
    assert_int_equal(tu_set_check(&c), 0);

    /* no tier opens: every rank fails alike, naming both */
    const char *none[] = {missing, missing};
    for (int r = 0; r < P; r++) {
        jobs[r] = (dist_job){comm[r], none, 2, r, 0, -1, 0, {0}, {&a, &b, &c}, {{0}}, ""};
        assert_int_equal(pthread_create(&th[r], NULL, dist_run, &jobs[r]), 0);
    }
    for (int r = 0; r < P; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < P; r++) {
        if (jobs[r].rc != STRATA_ENOENT || !strstr(jobs[r].msg, "no copy could be loaded") ||
            !strstr(jobs[r].msg, "dist-missing"))
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
    }
    tu_set_free(&a);
    tu_set_free(&b);
    tu_set_free(&c);
    for (int r = 0; r < P; r++)
        strata_comm_free(comm[r]);
    hub_free(&h);
    tu_rmrf(ck);
}

typedef struct {
    strata_loader *ld;
    strata_state *st;
    strata_load_opts lo;
    int rc;
    char msg[1024];
} load_job;

static void *load_run(void *p)
{
    load_job *j = p;
    j->rc = strata_loader_load(NULL, j->ld, &j->st, 1, &j->lo);
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

typedef struct {
    strata_comm *comm;
    const char *uri;
    strata_loader *ld;
    int rc;
} open_job;

static void *open_run(void *p)
{
    open_job *j = p;
    j->rc = strata_loader_open(&j->ld, j->comm, &j->uri, 1, NULL);
    return NULL;
}

/* A resharded load whose reads each belong to one rank (row blocks of one tensor, in many
 * small reads): the ranks read them on their own, without a collective per round of reads
 * (there used to be three per round of io_threads reads on each rank: status, exchange,
 * done); only the few reads that two ranks share (the blocks' boundaries) go in rounds. */
static void test_dist_private_reads(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/private", base);
    static const uint64_t shape[] = {3000, 64};
    tu_set src;
    tu_set_init(&src, 1);
    tu_set_shard(&src, 0, "t", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 1);
    const char *u = ck;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags |= STRATA_SAVE_NO_SYNC;
    so.chunk_bytes = 4096;
    assert_ok(strata_save(NULL, NULL, &u, 1, src.st, 1, &so));
    tu_set_free(&src);

    const int P = 3;
    hub h;
    tcomm tc[3];
    strata_comm *comm[3];
    counting_comms(&h, tc, comm, P);
    open_job oj[3];
    pthread_t th[3];
    for (int r = 0; r < P; r++) {
        oj[r] = (open_job){comm[r], ck, NULL, 0};
        assert_int_equal(pthread_create(&th[r], NULL, open_run, &oj[r]), 0);
    }
    for (int r = 0; r < P; r++) {
        pthread_join(th[r], NULL);
        assert_ok(oj[r].rc);
    }
    tu_set d;
    tu_set_init(&d, P);
    for (int r = 0; r < P; r++) {
        uint64_t off[] = {1000 * (uint64_t)r, 0}, len[] = {1000, 64};
        tu_set_shard(&d, r, "t", STRATA_F32, 2, shape, off, len, 0, 0, 0, 0);
    }
    load_job lj[3];
    atomic_store(&ncoll, 0);
    for (int r = 0; r < P; r++) {
        lj[r] = (load_job){oj[r].ld, d.st[r], STRATA_LOAD_OPTS_INIT, 0, ""};
        lj[r].lo.max_io_bytes = 8192; /* 2 chunks a read: ~31 reads per rank */
        lj[r].lo.io_threads = 2;
        assert_int_equal(pthread_create(&th[r], NULL, load_run, &lj[r]), 0);
    }
    for (int r = 0; r < P; r++) {
        pthread_join(th[r], NULL);
        if (lj[r].rc)
            fail_msg("rank %d: %s: %s", r, strata_error_name(lj[r].rc), lj[r].msg);
    }
    assert_int_equal(tu_set_check(&d), 0);
    /* per rank: the requests (2), the node and its segment (a few), one round of the
     * shared boundary reads (status, done), the outcome and the stats (2) */
    int per_rank = atomic_load(&ncoll) / P;
    if (per_rank > 12)
        fail_msg("%d collectives per rank for one load", per_rank);
    for (int r = 0; r < P; r++)
        strata_loader_free(oj[r].ld);
    tu_set_free(&d);
    for (int r = 0; r < P; r++)
        strata_comm_free(comm[r]);
    hub_free(&h);
    tu_rmrf(ck);
}

/* ---- export opens the checkpoint once ---- */

static int hide_at_start(void *ctx, uint64_t done, uint64_t total)
{
    (void)total;
    if (done == 0)
        hide_index(ctx, 1);
    return 0;
}

/* An export of several windows: the index is moved away before the first window is
 * loaded, and every window still loads (each used to open the checkpoint again). */
static void test_export_one_open(void **state)
{
    (void)state;
    char ck[600], out[600];
    snprintf(ck, sizeof ck, "%s/export", base);
    snprintf(out, sizeof out, "%s/export-out", base);
    static const uint64_t big[] = {5, 4u << 20}; /* 80 MiB of f32: two windows */
    tu_set src;
    tu_set_init(&src, 1);
    tu_set_shard(&src, 0, "big", STRATA_F32, 2, big, NULL, NULL, 0, 0, 0, 1);
    const char *u = ck;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags |= STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, &u, 1, src.st, 1, &so));
    tu_set_free(&src);
    strata_export_opts eo = STRATA_EXPORT_OPTS_INIT;
    eo.progress = hide_at_start;
    eo.progress_ctx = ck;
    eo.flags |= STRATA_EXPORT_NO_DIRECT;
    strata_stats s = STRATA_STATS_INIT;
    assert_ok(strata_export_safetensors(&s, ck, out, &eo));
    assert_int_equal(s.meta_reads, 1);
    assert_int_equal(s.bytes, 5ull * (4u << 20) * 4);
    hide_index(ck, 0);
    /* the export holds the tensor, bitwise */
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "big", STRATA_F32, 2, big, NULL, NULL, 0, 0, 0, 0);
    const char *o = out;
    assert_ok(strata_load(NULL, NULL, &o, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_rmrf(ck);
    tu_rmrf(out);
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base, sizeof base, "loader");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_rmrf(base);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_index),
        cmocka_unit_test(test_repeated_loads),
        cmocka_unit_test(test_tiers),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_dist),
        cmocka_unit_test(test_dist_private_reads),
        cmocka_unit_test(test_export_one_open),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
