/* test_dist.c - saves through a saver with a communicator (strata_save, strata_save_start)
 * and strata_load with a communicator, the ranks as threads of this process joined by a
 * host communicator (strata_comm_host) built on a pthread barrier: resharding across world
 * sizes, read-once loading, plan caching (one saver per rank, kept across saves), and
 * failure on one rank. */
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "engine/engine.h" /* st_async_test_hook */
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

static void hub_init(hub *h, int n)
{
    h->size = n;
    pthread_barrier_init(&h->bar, NULL, (unsigned)n);
    h->send = calloc((size_t)n, sizeof *h->send);
    h->scounts = calloc((size_t)n, sizeof *h->scounts);
}

static void hub_free(hub *h)
{
    pthread_barrier_destroy(&h->bar);
    free(h->send);
    free(h->scounts);
}

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

/* Overwrites rank r's buffers (the optimizer step after the snapshot). */
static void poison_rank(tu_set *s, int r)
{
    for (size_t i = 0; i < s->nsh; i++)
        if (s->sh[i].rank == r && s->sh[i].sh.data)
            memset(s->sh[i].sh.data, 0xff,
                   tu_shard_numel(&s->sh[i].sh) * strata_dtype_size(s->sh[i].sh.dtype));
    for (size_t i = 0; i < s->nbl; i++)
        if (s->bl[i].rank == r)
            memset(s->bl[i].data, 0xff, s->bl[i].size);
}

/* The lazy save of one rank: start, wait for the snapshot, poison the sources, wait until
 * committed. The checkpoint must hold the values from before the poison. */
static int async_save(job *j)
{
    strata_handle *h;
    int rc = strata_save_start(&h, j->w->sv[j->rank], &j->uri, 1, &j->set->st[j->rank], 1,
                               &j->so);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    poison_rank(j->set, j->rank);
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
    poison_rank(j->set, j->rank);
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

/* The first coordinator to start (a save's first, on one rank) waits for the gate. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int gate_calls, gate_open;

static void commit_gate(strata_pool *pool)
{
    (void)pool;
    pthread_mutex_lock(&gate_mu);
    if (gate_calls++ == 0)
        while (!gate_open)
            pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
}

static void *open_gate_later(void *arg)
{
    (void)arg;
    usleep(300000); /* the later saves' writes end meanwhile */
    pthread_mutex_lock(&gate_mu);
    gate_open = 1;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    return NULL;
}

/* A lazy save to two destinations: j->uri (tier 0) and j->uri2 (tier 1). */
static int tiers_save(job *j)
{
    strata_handle *h;
    const char *uris[2] = {j->uri, j->uri2};
    int rc = strata_save_start(&h, j->w->sv[j->rank], uris, 2, &j->set->st[j->rank], 1,
                               &j->so);
    if (rc)
        return rc;
    rc = strata_wait_snapshot(h);
    poison_rank(j->set, j->rank);
    int drc = strata_wait_durable(&j->stats, h);
    strata_handle_free(h);
    return drc ? drc : rc;
}

static void *run_job(void *p)
{
    job *j = p;
    if (j->save == SAVE_DONE)
        j->rc = done_save(j);
    else if (j->save == SAVE_ORDER)
        j->rc = order_save(j);
    else if (j->save == SAVE_TIERS)
        j->rc = tiers_save(j);
    else if (j->save == SAVE_OVERLAP)
        j->rc = overlap_save(j);
    else if (j->save == SAVE_ASYNC)
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
static const uint64_t xs_one[] = {1};

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

static void save_world(const char *ck, int tp, int dp, tu_set *src, job *jobs)
{
    world w;
    world_init(&w, tp * dp);
    layout(src, tp, dp, 1);
    for (int r = 0; r < tp * dp; r++)
        tu_set_blob(src, r, "rng", 1, 0, 17 + (uint64_t)r, 1);
    run_all(&w, 1, ck, NULL, src, jobs);
    world_free(&w);
}

/* A corrupt chunk read by one rank fails the load on every rank, and every rank's message
 * names the tensor and the file (the message outlives the collectives that spread it). */
static void test_corrupt_load(void **state)
{
    (void)state;
    char ck[600], f[700];
    snprintf(ck, sizeof ck, "%s/corrupt", base);
    tu_set src, dst;
    job jobs[4];
    save_world(ck, 2, 2, &src, jobs);
    expect_all_ok(jobs, 4);
    tu_join(f, ck, "data-000001.bin");
    tu_flip_byte(f, 100, 0x40);
    world w;
    world_init(&w, 2);
    layout(&dst, 2, 1, 0);
    run_all(&w, 0, ck, NULL, &dst, jobs);
    for (int r = 0; r < 2; r++) {
        if (jobs[r].rc != STRATA_ECHECKSUM && jobs[r].rc != STRATA_EABORTED)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
        if (!strstr(jobs[r].msg, "tensor '") || !strstr(jobs[r].msg, "data-000001.bin"))
            fail_msg("rank %d's message names no tensor and file: %s", r, jobs[r].msg);
    }
    world_free(&w);
    tu_set_free(&src);
    tu_set_free(&dst);
    tu_rmrf(ck);
}

/* Ranks of one load asking for different I/O threads and read sizes (options, or
 * $STRATA_IO_THREADS on some ranks only): each sized its rounds, its reads and its slot in
 * the node's segment from its own, and the collectives went out of step (a hang here, or
 * wrong bytes). Every rank now uses rank 0's values, loads bitwise, and reports them. */
static void test_load_opts_differ(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/opts", base);
    /* a [300, 257] f32 weight over 2 ranks: 75 chunks of 4 KiB, so small reads make many
     * rounds */
    static const uint64_t big[] = {300, 257};
    tu_set src;
    tu_set_init(&src, 2);
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {150 * (uint64_t)r, 0}, len[] = {150, 257};
        tu_set_shard(&src, r, "big", STRATA_F32, 2, big, off, len, 0, 0, 0, 1);
    }
    job jobs[3];
    world w2;
    world_init(&w2, 2);
    run_all(&w2, 1, ck, NULL, &src, jobs);
    expect_all_ok(jobs, 2);
    world_free(&w2);
    /* per case: each rank's io_threads and max_io_bytes */
    static const int cases[][3][2] = {
        {{1, 0}, {4, 0}, {2, 0}},                /* threads differ */
        {{0, 8192}, {0, 0}, {0, 12288}},         /* read sizes differ */
        {{3, 4096}, {1, 65536}, {8, 0}},         /* both */
        {{0, 0}, {2, 4096}, {2, 4096}},          /* rank 0 alone differs */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        strata_load_opts lo[3];
        for (int r = 0; r < 3; r++) {
            lo[r] = (strata_load_opts)STRATA_LOAD_OPTS_INIT;
            lo[r].io_threads = cases[k][r][0];
            lo[r].max_io_bytes = (uint32_t)cases[k][r][1];
        }
        /* every rank wants the whole tensor: the ranks share its reads */
        tu_set d;
        tu_set_init(&d, 3);
        for (int r = 0; r < 3; r++)
            tu_set_shard(&d, r, "big", STRATA_F32, 2, big, NULL, NULL, 0, 0, 0, 0);
        world w;
        world_init(&w, 3);
        load_opts = lo;
        run_all(&w, 0, ck, NULL, &d, jobs);
        load_opts = NULL;
        for (int r = 0; r < 3; r++) {
            if (jobs[r].rc)
                fail_msg("case %zu, rank %d: %s: %s", k, r, strata_error_name(jobs[r].rc),
                         jobs[r].msg);
            /* rank 0's effective values, on every rank */
            const char *env = getenv("STRATA_IO_THREADS");
            int want_threads = cases[k][0][0]   ? cases[k][0][0]
                               : env && atoi(env) > 0 ? ST_MIN(atoi(env), 64)
                                                     : 4;
            uint32_t want_io = cases[k][0][1] ? (uint32_t)cases[k][0][1] : 4u << 20;
            assert_int_equal(jobs[r].stats.io_threads, want_threads);
            assert_int_equal(jobs[r].stats.max_io_bytes, want_io);
        }
        assert_int_equal(tu_set_check(&d), 0);
        world_free(&w);
        tu_set_free(&d);
    }
    tu_set_free(&src);
    tu_rmrf(ck);
}

/* ---- a load killed while it sets up its node's segment ---- */

/* A communicator of two ranks in one thread: rank 1 is rank 0's twin (it sends what rank 0
 * sends). The process kills itself when the segment's name is sent: the segment is made,
 * and no other rank has mapped it yet. */
static int twin_allgather(void *ctx, const void *send, size_t n, void *recv)
{
    (void)ctx;
    if (n >= 13 && memcmp(send, "/strata-load-", 13) == 0)
        raise(SIGKILL);
    memcpy(recv, send, n);
    memcpy((char *)recv + n, send, n);
    return 0;
}

static int twin_alltoallv(void *ctx, const void *send, const size_t *sc, void *recv,
                          const size_t *rc)
{
    (void)ctx;
    for (int s = 0, at = 0; s < 2; at += (int)rc[s], s++)
        if (rc[s] != sc[0])
            return STRATA_EINVAL;
        else
            memcpy((char *)recv + at, send, rc[s]);
    return 0;
}

static int twin_bcast(void *ctx, void *buf, size_t n, int root)
{
    (void)ctx, (void)buf, (void)n, (void)root;
    return 0;
}

static const strata_comm_ops twin_ops = {STRATA_COMM_OPS_VERSION, twin_allgather,
                                         twin_alltoallv, twin_bcast, NULL, NULL};

/* The name under /dev/shm of a segment whose name holds "-<pid>-", into out (NAME_MAX + 1):
 * 1 if there is one. */
static int shm_of(pid_t pid, char *out)
{
    char pat[32];
    snprintf(pat, sizeof pat, "-%d-", (int)pid);
    DIR *d = opendir("/dev/shm");
    struct dirent *e;
    int found = 0;
    while (d && !found && (e = readdir(d)))
        if (strncmp(e->d_name, "strata-load-", 12) == 0 && strstr(e->d_name, pat))
            found = snprintf(out, NAME_MAX + 1, "%s", e->d_name) > 0;
    if (d)
        closedir(d);
    return found;
}

static void make_shm(const char *name, uid_t owner)
{
    char n[NAME_MAX + 2];
    snprintf(n, sizeof n, "/%s", name);
    int fd = shm_open(n, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        fail_msg("shm_open %s: %s", n, strerror(errno));
    assert_int_equal(ftruncate(fd, 4096), 0);
    if (owner != geteuid())
        assert_int_equal(fchown(fd, owner, (gid_t)-1), 0);
    close(fd);
}

static int shm_exists(const char *name)
{
    char p[NAME_MAX + 16];
    snprintf(p, sizeof p, "/dev/shm/%s", name);
    return tu_exists(p);
}

/* A load killed after making its node's segment, before the other ranks mapped it, left the
 * segment in /dev/shm for good. Its name now says whose it is, and the next load on the
 * node removes it; never a live process's segment, nor another user's. */
static void test_load_segment_reclaim(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/segment", base);
    tu_set src;
    job jobs[2];
    save_world(ck, 2, 1, &src, jobs);
    expect_all_ok(jobs, 2);
    char *shm_env = getenv("STRATA_LOAD_SHM"), *nodes_env = getenv("STRATA_LOAD_NODES");
    char saved_shm[32] = "", saved_nodes[32] = "";
    snprintf(saved_shm, sizeof saved_shm, "%s", shm_env ? shm_env : "");
    snprintf(saved_nodes, sizeof saved_nodes, "%s", nodes_env ? nodes_env : "");
    unsetenv("STRATA_LOAD_SHM"); /* both ranks on one node, with a segment */
    unsetenv("STRATA_LOAD_NODES");
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tu_set d;
        layout(&d, 2, 1, 0);
        strata_comm *c;
        if (strata_comm_host(&c, &twin_ops, NULL, 0, 2))
            _exit(2);
        const char *u = ck;
        strata_load(NULL, c, &u, 1, &d.st[0], 1, NULL);
        _exit(3); /* not killed: no segment was made */
    }
    int ws;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    assert_true(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
    char left[NAME_MAX + 1];
    if (!shm_of(pid, left))
        fail_msg("the killed load left no segment named with its pid %d", (int)pid);
    /* the name says whose it is: "strata-load-<uid>-<boot>-<pidns>-<pid>-<random>" */
    char want[64];
    snprintf(want, sizeof want, "strata-load-%u-", (unsigned)geteuid());
    if (strncmp(left, want, strlen(want)) != 0) {
        char n[NAME_MAX + 2];
        snprintf(n, sizeof n, "/%s", left);
        shm_unlink(n);
        fail_msg("segment '%s' does not name its user (%s...)", left, want);
    }
    char pidpart[32], prefix[160], live[NAME_MAX + 1], other_uid[NAME_MAX + 1],
        other_owner[NAME_MAX + 1];
    snprintf(pidpart, sizeof pidpart, "-%d-", (int)pid);
    size_t plen = (size_t)(strstr(left, pidpart) - left) + 1; /* up to the pid */
    assert_true(plen < 100);
    snprintf(prefix, sizeof prefix, "%.*s", (int)plen, left);
    /* decoys: a live process's (this one's), another user's name, another user's file */
    snprintf(live, sizeof live, "%s%d-0000000000000001", prefix, (int)getpid());
    snprintf(other_uid, sizeof other_uid, "strata-load-%u-%s%d-0000000000000002",
             (unsigned)geteuid() + 1, prefix + strlen(want), (int)pid);
    snprintf(other_owner, sizeof other_owner, "%s%d-0000000000000003", prefix, (int)pid);
    make_shm(live, geteuid());
    make_shm(other_uid, geteuid());
    int root = geteuid() == 0; /* only root can give a file to another user */
    if (root)
        make_shm(other_owner, 4242);
    /* the next load on this node reclaims the dead load's segment, and only it */
    world w;
    world_init(&w, 2);
    tu_set d;
    layout(&d, 2, 1, 0);
    run_all(&w, 0, ck, NULL, &d, jobs);
    expect_all_ok(jobs, 2);
    assert_int_equal(tu_set_check(&d), 0);
    int gone = !shm_exists(left), live_kept = shm_exists(live),
        uid_kept = shm_exists(other_uid), owner_kept = !root || shm_exists(other_owner);
    const char *decoys[] = {live, other_uid, other_owner};
    for (int i = 0; i < 3; i++) {
        char n[NAME_MAX + 2];
        snprintf(n, sizeof n, "/%s", decoys[i]);
        shm_unlink(n);
    }
    if (!gone) {
        snprintf(want, sizeof want, "/%.60s", left);
        shm_unlink(want);
        fail_msg("the dead load's segment %s is still there after a load", left);
    }
    assert_true(live_kept);
    assert_true(uid_kept);
    assert_true(owner_kept);
    world_free(&w);
    tu_set_free(&d);
    tu_set_free(&src);
    if (saved_shm[0])
        setenv("STRATA_LOAD_SHM", saved_shm, 1);
    if (saved_nodes[0])
        setenv("STRATA_LOAD_NODES", saved_nodes, 1);
    tu_rmrf(ck);
}

static void test_reshard(void **state)
{
    (void)state;
    static const int pairs[][4] = {{2, 2, 1, 3}, {2, 2, 3, 1}, {4, 1, 1, 1}, {1, 3, 2, 2},
                                   {3, 1, 1, 4}, {1, 1, 2, 3}};
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
        char ck[600];
        snprintf(ck, sizeof ck, "%s/reshard%zu", base, k);
        int tp = pairs[k][0], dp = pairs[k][1], tp2 = pairs[k][2], dp2 = pairs[k][3];
        tu_set src, dst;
        job jobs[16];
        save_world(ck, tp, dp, &src, jobs);
        expect_all_ok(jobs, tp * dp);
        uint64_t data = jobs[0].stats.all_bytes;
        /* load on another world size; every rank also asks for the rng of the old ranks
         * r, r + n2, ... so that every saved byte is requested */
        world w;
        world_init(&w, tp2 * dp2);
        layout(&dst, tp2, dp2, 0);
        for (int o = 0; o < tp * dp; o++)
            tu_set_blob(&dst, o % (tp2 * dp2), "rng", 1, o, 17 + (uint64_t)o, 0);
        run_all(&w, 0, ck, NULL, &dst, jobs);
        expect_all_ok(jobs, tp2 * dp2);
        assert_int_equal(tu_set_check(&dst), 0);
        /* read once: the bytes read over all ranks are the saved bytes, whatever dp */
        assert_int_equal(jobs[0].stats.all_bytes, data);
        world_free(&w);
        tu_set_free(&src);
        tu_set_free(&dst);
        tu_rmrf(ck);
    }
}

static void test_plan_cache(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    tu_set a;
    layout(&a, 2, 2, 1);
    job jobs[4];
    char ck[600];
    for (int i = 0; i < 3; i++) {
        snprintf(ck, sizeof ck, "%s/cache%d", base, i);
        run_all(&w, 1, ck, NULL, &a, jobs);
        expect_all_ok(jobs, 4);
        for (int r = 0; r < 4; r++)
            assert_int_equal(jobs[r].stats.plan_cached, i > 0); /* miss, then hits */
    }
    /* a cached save still saves the current values */
    expect_loads(ck);
    /* one rank's layout changes (rank 2 also saves an extra tensor): the cache misses */
    uint64_t xs[] = {5};
    tu_set_shard(&a, 2, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 1);
    snprintf(ck, sizeof ck, "%s/cache-changed", base);
    run_all(&w, 1, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    for (int r = 0; r < 4; r++)
        assert_int_equal(jobs[r].stats.plan_cached, 0);
    tu_set d;
    layout(&d, 1, 1, 0);
    tu_set_shard(&d, 0, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 0);
    const char *u = ck;
    assert_ok(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&a);
    world_free(&w);
}

static void test_rank_failure(void **state)
{
    (void)state;
    char prev[600], ck[600], bad[700];
    snprintf(prev, sizeof prev, "%s/fail-prev", base);
    snprintf(ck, sizeof ck, "%s/fail-new", base);
    tu_set src;
    job jobs[4];
    save_world(prev, 2, 2, &src, jobs);
    expect_all_ok(jobs, 4);
    /* rank 1's writes fail: every rank learns it, nothing is committed */
    snprintf(bad, sizeof bad, "fault+file://%s?op=write&n=1&errno=EIO", ck);
    const char *uris[4] = {ck, bad, ck, ck};
    world w;
    world_init(&w, 4);
    run_all(&w, 1, NULL, uris, &src, jobs);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EIO);
        if (r != 1 && !strstr(jobs[r].msg, "rank 1"))
            fail_msg("rank %d's message does not name rank 1: %s", r, jobs[r].msg);
    }
    char c[700];
    tu_join(c, ck, "COMMIT");
    assert_false(tu_exists(c));
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_false(pi.committed);
    /* the previous checkpoint is intact; a retry succeeds */
    expect_loads(prev);
    run_all(&w, 1, ck, NULL, &src, jobs);
    expect_all_ok(jobs, 4);
    /* a request for a missing tensor on one rank fails the load on every rank */
    world w3;
    world_init(&w3, 3);
    tu_set d;
    layout(&d, 3, 1, 0);
    tu_set_shard(&d, 2, "nope", STRATA_U8, 1, xs_one, NULL, NULL, 0, 0, 0, 0);
    run_all(&w3, 0, ck, NULL, &d, jobs);
    for (int r = 0; r < 3; r++)
        assert_int_equal(jobs[r].rc, STRATA_ENOTFOUND);
    tu_set_free(&d);
    world_free(&w3);
    world_free(&w);
    tu_set_free(&src);
}

/* Asynchronous distributed saves: the poison after the snapshot does not reach the
 * checkpoint; the second save reuses the plan; a failing rank fails every rank at
 * wait_durable (the start returned 0: its I/O came after) and nothing is committed. */
static void test_async(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    job jobs[4];
    char ck[600];
    for (int i = 0; i < 2; i++) {
        tu_set a;
        layout(&a, 2, 2, 1); /* fresh values: the last save poisoned them */
        snprintf(ck, sizeof ck, "%s/async%d", base, i);
        run_all(&w, SAVE_ASYNC, ck, NULL, &a, jobs);
        expect_all_ok(jobs, 4);
        for (int r = 0; r < 4; r++)
            assert_int_equal(jobs[r].stats.plan_cached, i > 0);
        assert_true(jobs[0].stats.all_bytes > 0);
        expect_loads(ck);
        tu_set_free(&a);
    }
    /* two saves overlap, the second with a new plan: both load bitwise */
    tu_set a;
    layout(&a, 2, 2, 1);
    snprintf(ck, sizeof ck, "%s/overlap", base);
    run_all(&w, SAVE_OVERLAP, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    for (int i = 0; i < 2; i++) {
        char p[700];
        snprintf(p, sizeof p, "%s%s", ck, i ? "-b" : "");
        expect_loads(p);
    }
    tu_set_free(&a);
    /* rank 2 cannot write: every rank fails with its error at wait_durable */
    layout(&a, 2, 2, 1);
    char bad[700], prev[600];
    snprintf(prev, sizeof prev, "%s", ck);
    snprintf(ck, sizeof ck, "%s/async-fail", base);
    snprintf(bad, sizeof bad, "fault+file://%s?op=write&n=1&errno=ENOSPC", ck);
    const char *uris[4] = {ck, ck, bad, ck};
    run_all(&w, SAVE_ASYNC, NULL, uris, &a, jobs);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_ENOSPC);
        if (r != 2 && !strstr(jobs[r].msg, "rank 2"))
            fail_msg("rank %d's message does not name rank 2: %s", r, jobs[r].msg);
    }
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, ck));
    assert_false(pi.committed);
    assert_false(pi.is_ckpt); /* every rank removed what it wrote */
    /* a save onto a committed checkpoint is refused, and the checkpoint is untouched */
    tu_set_free(&a);
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_ASYNC, prev, NULL, &a, jobs);
    for (int r = 0; r < 4; r++)
        assert_int_equal(jobs[r].rc, STRATA_EEXIST);
    expect_loads(prev);
    /* and a retry of the failed one works */
    tu_set_free(&a);
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_ASYNC, ck, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    expect_loads(ck);
    /* an incomplete directory whose data files are hard links to that committed
     * checkpoint's (cp -al, rsync --link-dest): a save there in another layout (so other
     * bytes) writes new files, never through the links */
    char linked[700];
    snprintf(linked, sizeof linked, "%s/async-linked", base);
    assert_int_equal(mkdir(linked, 0755), 0);
    for (int r = 0; r < 4; r++) {
        char fa[800], fb[800], nm[32];
        snprintf(nm, sizeof nm, "data-%06d.bin", r);
        tu_join(fa, ck, nm);
        tu_join(fb, linked, nm);
        if (tu_exists(fa))
            assert_int_equal(link(fa, fb), 0);
    }
    tu_set_free(&a);
    layout(&a, 4, 1, 1);
    run_all(&w, SAVE_ASYNC, linked, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    expect_loads(linked);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_ok(strata_ckpt_verify(c, NULL, NULL)); /* the committed one is untouched */
    strata_ckpt_free(c);
    expect_loads(ck);
    tu_set_free(&a);
    world_free(&w);
}

/* Two tiers: both commit and load; a tier that fails on one rank fails every rank with its
 * error (naming the destination), is removed, and the other tier is committed. */
static void test_async_tiers(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    job jobs[4];
    char fast[600], slow[600], bad[700];
    snprintf(fast, sizeof fast, "%s/tier-fast", base);
    snprintf(slow, sizeof slow, "%s/tier-slow", base);
    const char *second[4] = {slow, slow, slow, slow};
    tier2 = second;
    tu_set a;
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_TIERS, fast, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    tu_set_free(&a);
    expect_loads(fast);
    expect_loads(slow);
    tu_rmrf(fast);
    tu_rmrf(slow);
    /* rank 1 cannot write the second tier */
    snprintf(bad, sizeof bad, "fault+file://%s?op=write&n=1&errno=EIO", slow);
    second[1] = bad;
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_TIERS, fast, NULL, &a, jobs);
    tu_set_free(&a);
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EIO);
        if (!strstr(jobs[r].msg, "destination 1") || (r != 1 && !strstr(jobs[r].msg, "rank 1")))
            fail_msg("rank %d's message names neither the tier nor rank 1: %s", r, jobs[r].msg);
    }
    print_message("a failed tier, as rank 0 reports it: %s\n", jobs[0].msg);
    expect_loads(fast);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, slow));
    assert_false(pi.committed);
    assert_false(pi.is_ckpt);
    tier2 = NULL;
    world_free(&w);
}

/* The fault walk of the distributed save (synchronous, or asynchronous): call n of op
 * fails on rank 0 (which also commits) or rank 1, for n = 1, 2, ... until the save
 * succeeds. Every rank must return the same error, nothing may be committed or left
 * behind, and the counts must be the protocol's: a rank opens, reserves and fsyncs its
 * data file and writes its tasks; rank 0 also writes metadata.bin.tmp and COMMIT.tmp,
 * renames both, and fsyncs the directory and its parent. */
static void fault_walk(int mode)
{
    world w;
    world_init(&w, 4);
    job jobs[4];
    char ck[600], bad[700];
    snprintf(ck, sizeof ck, "%s/afault", base);
    sync_saves = 1;
    tu_set a;
    layout(&a, 2, 2, 1);
    run_all(&w, mode, ck, NULL, &a, jobs); /* a clean save: the write counts */
    expect_all_ok(jobs, 4);
    tu_set_free(&a);
    int tasks[2] = {(int)jobs[0].stats.io_calls, (int)jobs[1].stats.io_calls};
    tu_rmrf(ck);
    static const char *const ops[] = {"open", "write", "allocate", "fsync", "rename", "mkdir"};
    int points = 0;
    for (int who = 0; who < 2; who++)
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
            /* the synchronous save: rank 0 alone prepares the directory */
            int mkdirs = mode == SAVE_ASYNC || who == 0;
            int want[] = {who ? 1 : 3, tasks[who] + (who ? 0 : 2), 1, who ? 1 : 5, who ? 0 : 2,
                          mkdirs};
            for (int n = 1;; n++) {
                snprintf(bad, sizeof bad, "fault+file://%s?op=%s&n=%d&errno=EIO", ck, ops[k], n);
                const char *uris[4] = {ck, ck, ck, ck};
                uris[who] = bad;
                layout(&a, 2, 2, 1);
                run_all(&w, mode, NULL, uris, &a, jobs);
                tu_set_free(&a);
                if (jobs[0].rc == 0) {
                    expect_all_ok(jobs, 4);
                    expect_loads(ck);
                    tu_rmrf(ck);
                    if (n - 1 != want[k])
                        fail_msg("rank %d makes %d %s calls, want %d", who, n - 1, ops[k],
                                 want[k]);
                    break;
                }
                points++;
                for (int r = 0; r < 4; r++)
                    if (jobs[r].rc != STRATA_EIO)
                        fail_msg("%s on rank %d: rank %d returned %s (%s)", bad, who, r,
                                 strata_error_name(jobs[r].rc), jobs[r].msg);
                strata_probe_info pi;
                int prc = strata_probe(&pi, ck);
                if (prc == 0 && (pi.committed || pi.has_commit || pi.is_ckpt))
                    fail_msg("%s on rank %d: committed %d, strata files left %d", bad, who,
                             pi.committed, pi.is_ckpt);
                tu_rmrf(ck);
                assert_true(n < 1000);
            }
        }
    print_message("%s distributed save: %d fault points, each failed every rank\n",
                  mode == SAVE_ASYNC ? "async" : "sync", points);
    sync_saves = 0;
    world_free(&w);
}

static void test_save_faults(void **state)
{
    (void)state;
    fault_walk(1);
    fault_walk(SAVE_ASYNC);
}

/* Background commits (issue 17): with a communicator that has a duplicate, a save is
 * committed with no call from the caller once every rank has written it - strata_handle_done
 * turns 1 and the checkpoint probes committed before strata_wait_durable, which then
 * returns at once; without one (plain_comms), the commit waits for strata_wait_durable,
 * and strata_saver_background says so. */
static void test_background_commit(void **state)
{
    (void)state;
    for (int plain = 0; plain < 2; plain++) {
        plain_comms = plain;
        world w;
        world_init(&w, 4);
        const char *why = NULL;
        assert_int_equal(strata_saver_background(&why, w.sv[0]), -1); /* not known yet */
        job jobs[4];
        for (int i = 0; i < 2; i++) {
            tu_set a;
            layout(&a, 2, 2, 1);
            char ck[600];
            snprintf(ck, sizeof ck, "%s/bg%d-%d", base, plain, i);
            run_all(&w, SAVE_DONE, ck, NULL, &a, jobs);
            expect_all_ok(jobs, 4);
            for (int r = 0; r < 4; r++) {
                assert_int_equal(strata_saver_background(&why, w.sv[r]), !plain);
                if (jobs[r].stats.tier != !plain)
                    fail_msg("%s commits, rank %d: committed before strata_wait_durable: %d",
                             plain ? "caller's thread" : "background", r, jobs[r].stats.tier);
                assert_int_equal(jobs[r].stats.plan_cached, i > 0);
            }
            if (plain)
                if (!strstr(why, "no twin"))
                    fail_msg("strata_saver_background gives no reason: %s", why);
            expect_loads(ck);
            tu_set_free(&a);
        }
        world_free(&w);
    }
    plain_comms = 0;
}

/* Saves in flight on one saver commit in the order they were started, on every rank,
 * whatever order they are waited for in (the commits on the caller's thread followed the
 * waits): the first save's writes are held back on one rank, the two after it are written
 * first and waited for first, and still each commit record is no older than the one
 * before. */
static void test_commit_order(void **state)
{
    (void)state;
    world w;
    world_init(&w, 3);
    tu_set a;
    layout(&a, 3, 1, 1);
    job jobs[3];
    char ck[600];
    snprintf(ck, sizeof ck, "%s/order", base);
    gate_calls = gate_open = 0;
    st_async_test_hook = commit_gate;
    pthread_t opener;
    assert_int_equal(pthread_create(&opener, NULL, open_gate_later, NULL), 0);
    run_all(&w, SAVE_ORDER, ck, NULL, &a, jobs);
    pthread_join(opener, NULL);
    st_async_test_hook = NULL;
    expect_all_ok(jobs, 3);
    struct timespec prev = {0, 0};
    for (int i = 0; i < 3; i++) {
        char p[700], c[800];
        snprintf(p, sizeof p, "%s-%d", ck, i);
        expect_loads(p);
        tu_join(c, p, "COMMIT");
        struct stat sb;
        assert_int_equal(stat(c, &sb), 0);
        if (sb.st_mtim.tv_sec < prev.tv_sec ||
            (sb.st_mtim.tv_sec == prev.tv_sec && sb.st_mtim.tv_nsec < prev.tv_nsec))
            fail_msg("save %d was committed before save %d, which started first", i, i - 1);
        prev = sb.st_mtim;
    }
    tu_set_free(&a);
    world_free(&w);
}

/* A saver freed with saves in flight: the free waits for their commits (on the commit
 * thread), and their handles still give the outcome afterwards. */
typedef struct {
    world *w;
    int rank;
    const char *uri;
    tu_set *set;
    int rc, committed;
} free_job;

static void *free_saver_first(void *p)
{
    free_job *j = p;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC;
    o.chunk_bytes = 4096;
    strata_handle *h;
    j->rc = strata_save_start(&h, j->w->sv[j->rank], &j->uri, 1, &j->set->st[j->rank], 1, &o);
    if (j->rc)
        return NULL;
    strata_saver_free(j->w->sv[j->rank]);
    j->w->sv[j->rank] = NULL;
    strata_probe_info pi = {0};
    j->committed = strata_probe(&pi, j->uri) == 0 && pi.committed && strata_handle_done(h);
    j->rc = strata_wait_durable(NULL, h);
    strata_handle_free(h);
    return NULL;
}

static void test_saver_freed_in_flight(void **state)
{
    (void)state;
    world w;
    world_init(&w, 3);
    tu_set a;
    layout(&a, 3, 1, 1);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/freed", base);
    free_job jobs[3];
    pthread_t th[3];
    for (int r = 0; r < 3; r++) {
        jobs[r] = (free_job){&w, r, ck, &a, 0, 0};
        assert_int_equal(pthread_create(&th[r], NULL, free_saver_first, &jobs[r]), 0);
    }
    for (int r = 0; r < 3; r++) {
        pthread_join(th[r], NULL);
        assert_int_equal(jobs[r].rc, 0);
        assert_true(jobs[r].committed);
    }
    expect_loads(ck);
    tu_set_free(&a);
    world_free(&w);
}

TU_TMPDIR_GROUP(base, "dist")


/* STRATA_SAVE_REPLACE with a communicator, synchronous and asynchronous: every rank writes
 * into the directory beside the checkpoint, rank 0 swaps it in after the commit; the path
 * holds each new step in turn and nothing is left beside it. A rank that fails leaves the
 * previous checkpoint in place. */
static void test_replace(void **state)
{
    (void)state;
    world w;
    world_init(&w, 3);
    job jobs[3];
    char ck[600], sib[700], bad[800];
    snprintf(ck, sizeof ck, "%s/latest", base);
    snprintf(sib, sizeof sib, "%s/.latest%s", base, STRATA_REPLACE_SUFFIX);
    tu_set a;
    for (int i = 0; i < 5; i++) {
        more_flags = i ? STRATA_SAVE_REPLACE : 0;
        save_step = 100 + (uint64_t)i;
        layout(&a, 3, 1, 1);
        run_all(&w, i % 2 ? SAVE_ASYNC : 1, ck, NULL, &a, jobs);
        tu_set_free(&a);
        expect_all_ok(jobs, 3);
        expect_loads(ck);
        strata_probe_info pi;
        assert_ok(strata_probe(&pi, ck));
        assert_int_equal(pi.step, 100 + i);
        assert_false(tu_exists(sib));
    }
    /* rank 1 cannot write (its data file's open fails): every rank fails, step 104 stays */
    snprintf(bad, sizeof bad, "fault+file://%s?op=open&n=1&errno=EIO", ck);
    for (int async = 0; async < 2; async++) {
        const char *uris[3] = {ck, bad, ck};
        more_flags = STRATA_SAVE_REPLACE;
        save_step = 200;
        layout(&a, 3, 1, 1);
        run_all(&w, async ? SAVE_ASYNC : 1, NULL, uris, &a, jobs);
        tu_set_free(&a);
        for (int r = 0; r < 3; r++)
            assert_int_equal(jobs[r].rc, STRATA_EIO);
        strata_probe_info pi;
        assert_ok(strata_probe(&pi, ck));
        assert_int_equal(pi.committed, 1);
        assert_int_equal(pi.step, 104);
        assert_false(tu_exists(sib));
    }
    more_flags = 0;
    save_step = 9;
    tu_rmrf(ck);
    world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reshard),
        cmocka_unit_test(test_corrupt_load),
        cmocka_unit_test(test_plan_cache),
        cmocka_unit_test(test_rank_failure),
        cmocka_unit_test(test_async),
        cmocka_unit_test(test_save_faults),
        cmocka_unit_test(test_async_tiers),
        cmocka_unit_test(test_load_opts_differ),
        cmocka_unit_test(test_load_segment_reclaim),
        cmocka_unit_test(test_replace),
        cmocka_unit_test(test_background_commit),
        cmocka_unit_test(test_commit_order),
        cmocka_unit_test(test_saver_freed_in_flight),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
