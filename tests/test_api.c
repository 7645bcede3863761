/* test_api.c - the front door: one way to save (strata_saver_new, strata_save_start,
 * strata_wait_snapshot, strata_wait_durable, strata_handle_free, and strata_save for all of
 * them) and one way to load (strata_load). Every combination of ranks (2 logical ranks in
 * this process, or 3 ranks as threads joined by a host communicator), destinations (one,
 * or two tiers) and save kind (synchronous, asynchronous) saves a layout of odd sizes split
 * unevenly, and every destination loads bitwise in process and across a communicator, in
 * another layout. Then: tiered loads falling back past a corrupt or missing first tier
 * (every rank agreeing on the tier), the saver's plan cache, distributed handles freed
 * without strata_wait_durable, and a saver's own pool reused across saves. */
#include <pthread.h>
#include <time.h>

#include "testutil.h"
#include "threadcomm.h"

static char base[512], memroot[600];
static int seq; /* makes every checkpoint name unique */

#define NCOMM 3 /* ranks of the communicator */
#define NPROC 2 /* logical ranks in this process */

typedef struct {
    hub h;
    tcomm tc[NCOMM];
    strata_comm *comm[NCOMM];
    strata_saver *sv[NCOMM]; /* one per rank, kept across saves: the plan cache */
} world;

static void world_init(world *w)
{
    memset(w, 0, sizeof *w);
    w->h.size = NCOMM;
    pthread_barrier_init(&w->h.bar, NULL, NCOMM);
    w->h.send = calloc(NCOMM, sizeof *w->h.send);
    w->h.scounts = calloc(NCOMM, sizeof *w->h.scounts);
    for (int r = 0; r < NCOMM; r++) {
        w->tc[r] = (tcomm){&w->h, r};
        assert_ok(strata_comm_host(&w->comm[r], &tops, &w->tc[r], r, NCOMM));
        assert_int_equal(strata_comm_rank(w->comm[r]), r);
        assert_int_equal(strata_comm_size(w->comm[r]), NCOMM);
        assert_ok(strata_saver_new(&w->sv[r], w->comm[r], NULL));
    }
}

static void world_free(world *w)
{
    for (int r = 0; r < NCOMM; r++) {
        strata_saver_free(w->sv[r]);
        strata_comm_free(w->comm[r]);
    }
    pthread_barrier_destroy(&w->h.bar);
    free(w->h.send);
    free(w->h.scounts);
}

/* ---- the layouts: odd sizes, uneven splits ---- */

static const uint64_t wshape[] = {23, 63}, bshape[] = {63}, zshape[] = {101};

/* Cut point r of n uneven pieces of len: len * r^2 / n^2. */
static uint64_t cut(uint64_t len, int r, int n)
{
    return len * (uint64_t)(r * r) / (uint64_t)(n * n);
}

/* n ranks save: rows of a [23, 63] f32 split unevenly, a [63] f32 replicated, a [101] bf16
 * flat-sharded unevenly, a global blob and a blob per rank. */
static void save_layout(tu_set *s, int n)
{
    tu_set_init(s, n);
    for (int r = 0; r < n; r++) {
        uint64_t off[] = {cut(23, r, n), 0}, len[] = {cut(23, r + 1, n) - cut(23, r, n), 63};
        tu_set_shard(s, r, "w", STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1);
        tu_set_shard(s, r, "b", STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 1);
        tu_set_shard(s, r, "z", STRATA_BF16, 1, zshape, NULL, NULL, 1, cut(101, r, n),
                     cut(101, r + 1, n), 1);
        tu_set_blob(s, r, "cfg", 0, -1, 33, 1);
        tu_set_blob(s, r, "rng", STRATA_BLOB_RANK_LOCAL, 0, 17 + (uint64_t)r, 1);
    }
}

/* n ranks load what `saved` ranks saved, in another layout: columns of w, b on every
 * rank, other flat pieces of z, the global blob, and every saved rank's blob (that of rank
 * o on rank o % n). */
static void load_layout(tu_set *s, int n, int saved)
{
    tu_set_init(s, n);
    for (int r = 0; r < n; r++) {
        uint64_t off[] = {0, cut(63, r, n)}, len[] = {23, cut(63, r + 1, n) - cut(63, r, n)};
        tu_set_shard(s, r, "w", STRATA_F32, 2, wshape, off, len, 0, 0, 0, 0);
        tu_set_shard(s, r, "b", STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_shard(s, r, "z", STRATA_BF16, 1, zshape, NULL, NULL, 1,
                     101 - cut(101, n - r, n), 101 - cut(101, n - r - 1, n), 0);
        tu_set_blob(s, r, "cfg", 0, -1, 33, 0);
    }
    for (int o = 0; o < saved; o++)
        tu_set_blob(s, o % n, "rng", STRATA_BLOB_RANK_LOCAL, o, 17 + (uint64_t)o, 0);
}

static strata_save_opts save_opts(void)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC;
    o.chunk_bytes = 4096; /* w spans two chunks */
    o.step = 11;
    return o;
}

/* ---- running every rank of a world ---- */

enum {
    K_LOAD,
    K_SYNC0, /* strata_save without a saver (in process only) */
    K_SYNC,  /* strata_save with a saver */
    K_ASYNC, /* strata_save_start, wait_snapshot, poison, wait_durable, free */
};
static const char *const kind_names[] = {"load", "sync (no saver)", "sync", "async"};

/* How a rank ends an asynchronous save (test_free_without_wait). */
enum { END_DURABLE, END_SNAPSHOT_FREE, END_FREE };

typedef struct {
    world *w;
    int rank, kind, end;
    const char *const *uris;
    int nuris;
    tu_set *set;
    strata_save_opts so;
    int rc;
    char msg[1024];
    strata_stats stats;
} job;

static int async_one(job *j)
{
    strata_handle *h = NULL;
    strata_state *const *st = &j->set->st[j->rank];
    int rc = strata_save_start(&h, j->w->sv[j->rank], j->uris, j->nuris, st, 1, &j->so);
    if (rc)
        return rc;
    if (j->end == END_FREE) { /* no wait at all: free ends the save, collective included */
        strata_handle_free(h);
        return 0;
    }
    rc = strata_wait_snapshot(h);
    tu_set_poison(j->set, j->rank);
    if (j->end == END_SNAPSHOT_FREE) {
        strata_handle_free(h);
        return rc;
    }
    int drc = strata_wait_durable(&j->stats, h); /* the collective: always called */
    strata_handle_free(h);
    return drc ? drc : rc;
}

static void *run_job(void *p)
{
    job *j = p;
    strata_state *const *st = &j->set->st[j->rank];
    switch (j->kind) {
    case K_LOAD:
        j->rc = strata_load(&j->stats, j->w->comm[j->rank], j->uris, j->nuris, st, 1, NULL);
        break;
    case K_SYNC:
        j->rc = strata_save(&j->stats, j->w->sv[j->rank], j->uris, j->nuris, st, 1, &j->so);
        break;
    default:
        j->rc = async_one(j);
        break;
    }
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* Runs kind on every rank of w; each thread must return within two minutes (a rank left
 * waiting in a collective would hang the test: that is a failure, reported as such). */
static void run_all(world *w, int kind, const char *const *uris, int nuris, tu_set *set,
                    const int *ends, job *jobs)
{
    pthread_t th[NCOMM];
    for (int r = 0; r < NCOMM; r++) {
        jobs[r] = (job){w, r, kind, ends ? ends[r] : END_DURABLE, uris, nuris, set,
                        save_opts(), 0, "", STRATA_STATS_INIT};
        jobs[r].stats.tier = -1;
        assert_int_equal(pthread_create(&th[r], NULL, run_job, &jobs[r]), 0);
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 120;
    for (int r = 0; r < NCOMM; r++)
        if (pthread_timedjoin_np(th[r], NULL, &dl) != 0) {
            print_error("%s on %s: rank %d did not return within 120 s (left waiting)\n",
                        kind_names[kind], uris[0], r);
            fflush(NULL);
            _exit(1); /* its threads are stuck on this stack's world: no way to go on */
        }
}

static void expect_all_ok(const job *jobs, const char *what)
{
    for (int r = 0; r < NCOMM; r++)
        if (jobs[r].rc)
            fail_msg("%s: rank %d: %s: %s", what, r, strata_error_name(jobs[r].rc),
                     jobs[r].msg);
}

/* ---- loading ---- */

/* Loads uris[0..nuris) on NPROC logical ranks in this process; on success the data must
 * be right. Returns the code; *tier gets stats.tier. */
static int load_inproc(const char *const *uris, int nuris, int saved, int *tier, char *msg,
                       size_t cap)
{
    tu_set d;
    load_layout(&d, NPROC, saved);
    strata_stats st = STRATA_STATS_INIT;
    st.tier = -1;
    int rc = strata_load(&st, NULL, uris, nuris, d.st, NPROC, NULL);
    snprintf(msg, cap, "%s", strata_error_last());
    if (rc == 0 && tu_set_check(&d) != 0)
        fail_msg("in-process load of %s (%d sources) succeeded with wrong data", uris[0], nuris);
    if (rc == 0 && st.bytes == 0)
        fail_msg("in-process load of %s: stats.bytes is 0", uris[0]);
    *tier = st.tier;
    tu_set_free(&d);
    return rc;
}

/* The same across a communicator of NCOMM thread ranks: every rank must return the same
 * code and, on success, name the same tier and hold the right data. */
static int load_comm(const char *const *uris, int nuris, int saved, int *tier, char *msg,
                     size_t cap)
{
    world w;
    world_init(&w);
    tu_set d;
    load_layout(&d, NCOMM, saved);
    job jobs[NCOMM];
    run_all(&w, K_LOAD, uris, nuris, &d, NULL, jobs);
    for (int r = 1; r < NCOMM; r++) {
        if (jobs[r].rc != jobs[0].rc)
            fail_msg("load of %s: rank 0 returned %s (%s), rank %d %s (%s)", uris[0],
                     strata_error_name(jobs[0].rc), jobs[0].msg, r,
                     strata_error_name(jobs[r].rc), jobs[r].msg);
        if (jobs[0].rc == 0 && jobs[r].stats.tier != jobs[0].stats.tier)
            fail_msg("load of %s: rank 0 loaded tier %d, rank %d tier %d", uris[0],
                     jobs[0].stats.tier, r, jobs[r].stats.tier);
    }
    if (jobs[0].rc == 0 && tu_set_check(&d) != 0)
        fail_msg("load of %s (%d sources) across %d ranks succeeded with wrong data", uris[0],
                 nuris, NCOMM);
    snprintf(msg, cap, "%s", jobs[0].msg);
    *tier = jobs[0].stats.tier;
    tu_set_free(&d);
    world_free(&w);
    return jobs[0].rc;
}

/* uris[0..nuris) loads, in process and across the communicator, from source want_tier. */
static void expect_loads(const char *const *uris, int nuris, int saved, int want_tier)
{
    char msg[1024];
    int tier = -1, rc = load_inproc(uris, nuris, saved, &tier, msg, sizeof msg);
    if (rc)
        fail_msg("in-process load of %s (%d sources): %s (%s)", uris[0], nuris,
                 strata_error_name(rc), msg);
    if (tier != want_tier)
        fail_msg("in-process load of %s (%d sources): stats.tier %d, want %d", uris[0], nuris,
                 tier, want_tier);
    rc = load_comm(uris, nuris, saved, &tier, msg, sizeof msg);
    if (rc)
        fail_msg("load of %s (%d sources) across %d ranks: %s (%s)", uris[0], nuris, NCOMM,
                 strata_error_name(rc), msg);
    if (tier != want_tier)
        fail_msg("load of %s (%d sources) across %d ranks: stats.tier %d, want %d", uris[0],
                 nuris, NCOMM, tier, want_tier);
}

/* ---- saving ---- */

/* Saves a fresh NPROC-rank state in this process with kind (K_SYNC0, K_SYNC, K_ASYNC) through
 * sv (NULL: a saver made here for K_SYNC / K_ASYNC). */
static void save_inproc(int kind, strata_saver *sv, const char *const *uris, int nuris)
{
    tu_set s;
    save_layout(&s, NPROC);
    strata_save_opts o = save_opts();
    strata_stats st = STRATA_STATS_INIT;
    strata_saver *own = NULL;
    if (kind != K_SYNC0 && !sv) {
        assert_ok(strata_saver_new(&own, NULL, NULL));
        sv = own;
    }
    if (kind == K_ASYNC) {
        strata_handle *h = NULL;
        assert_ok(strata_save_start(&h, sv, uris, nuris, s.st, NPROC, &o));
        assert_non_null(h);
        assert_ok(strata_wait_snapshot(h));
        for (int r = 0; r < NPROC; r++)
            tu_set_poison(&s, r); /* the checkpoint must hold the values from before */
        assert_ok(strata_wait_durable(&st, h));
        assert_int_equal(strata_handle_status(NULL, h), 0);
        assert_ok(strata_wait_durable(NULL, h)); /* again: the same result */
        strata_handle_free(h);
    } else {
        assert_ok(strata_save(&st, kind == K_SYNC0 ? NULL : sv, uris, nuris, s.st, NPROC, &o));
    }
    assert_true(st.bytes > 0);
    assert_true(st.data_bytes > 0);
    strata_saver_free(own);
    tu_set_free(&s);
}

/* Saves a fresh NCOMM-rank state across w with kind (K_SYNC, K_ASYNC); jobs get the
 * results. */
static void save_comm(world *w, int kind, const char *const *uris, int nuris, job *jobs)
{
    tu_set s;
    save_layout(&s, NCOMM);
    run_all(w, kind, uris, nuris, &s, NULL, jobs);
    expect_all_ok(jobs, kind_names[kind]);
    for (int r = 0; r < NCOMM; r++) {
        assert_true(jobs[r].stats.all_bytes > 0);
        assert_int_equal(jobs[r].stats.all_bytes, jobs[0].stats.all_bytes);
    }
    tu_set_free(&s);
}

/* Destination names for one save: one file path, or a memory tier and a file path. */
typedef struct {
    char mem[64], memdir[700], path[600], path2[600];
    const char *uris[2];
} dests;

static void make_dests(dests *d, int nuris, int two_files)
{
    int k = ++seq;
    snprintf(d->mem, sizeof d->mem, "mem://api-%d", k);
    snprintf(d->memdir, sizeof d->memdir, "%s/api-%d", memroot, k);
    snprintf(d->path, sizeof d->path, "%s/ck-%d", base, k);
    snprintf(d->path2, sizeof d->path2, "%s/ck-%d-slow", base, k);
    if (nuris == 1) {
        d->uris[0] = d->path;
        d->uris[1] = NULL;
    } else if (two_files) {
        d->uris[0] = d->path;
        d->uris[1] = d->path2;
    } else {
        d->uris[0] = d->mem;
        d->uris[1] = d->path;
    }
}

/* ---- the tests ---- */

/* {in process, communicator} x {one destination, two tiers} x {sync, async}: every
 * destination is committed and loads bitwise on its own (tier 0), in process and across a
 * communicator; the tiers together load from the first. */
static void test_matrix(void **state)
{
    (void)state;
    int combos = 0;
    for (int comm = 0; comm <= 1; comm++)
        for (int nuris = 1; nuris <= 2; nuris++)
            for (int kind = comm ? K_SYNC : K_SYNC0; kind <= K_ASYNC; kind++) {
                dests d;
                make_dests(&d, nuris, 0);
                int saved = comm ? NCOMM : NPROC;
                if (comm) {
                    world w;
                    world_init(&w);
                    job jobs[NCOMM];
                    save_comm(&w, kind, d.uris, nuris, jobs);
                    world_free(&w);
                } else {
                    save_inproc(kind, NULL, d.uris, nuris);
                }
                for (int t = 0; t < nuris; t++) {
                    strata_probe_info pi;
                    assert_ok(strata_probe(&pi, d.uris[t]));
                    if (!pi.committed || pi.step != 11)
                        fail_msg("%s: committed %d, step %" PRIu64, d.uris[t], pi.committed,
                                 pi.step);
                    expect_loads(&d.uris[t], 1, saved, 0);
                }
                if (nuris == 2)
                    expect_loads(d.uris, 2, saved, 0);
                print_message("%-13s %d destination%s %-16s: saved, every copy loads\n",
                              comm ? "communicator" : "in process", nuris,
                              nuris > 1 ? "s" : " ", kind_names[kind]);
                combos++;
            }
    assert_int_equal(combos, 2 * 3 + 2 * 2);
}

/* The data file and offset of a byte of tensor w in checkpoint uri. */
static void w_byte(const char *uri, const char *dir, char *file, size_t cap, uint64_t *off)
{
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, uri, 0));
    for (size_t i = 0; i < strata_ckpt_ntensors(ck); i++) {
        strata_tensor_info ti;
        strata_ckpt_tensor(&ti, ck, i);
        if (strcmp(ti.name, "w") != 0)
            continue;
        assert_true(ti.nshards > 0);
        strata_shard_info si;
        strata_ckpt_shard(&si, ck, i, ti.nshards - 1);
        assert_true(si.bytes > 8);
        snprintf(file, cap, "%s/%s", dir, si.file);
        *off = si.file_offset + si.bytes / 2;
        strata_ckpt_free(ck);
        return;
    }
    strata_ckpt_free(ck);
    fail_msg("%s has no tensor w", uri);
}

/* Tier 0 corrupt (a flipped byte in w's data) or gone: the load falls back to tier 1, in
 * process and across a communicator (every rank on tier 1), with the right data; tier 0
 * alone fails the same way on every rank. */
static void fallback(int comm, int two_files)
{
    for (int how = 0; how <= 1; how++) {
        dests d;
        make_dests(&d, 2, two_files);
        int saved = comm ? NCOMM : NPROC;
        if (comm) {
            world w;
            world_init(&w);
            job jobs[NCOMM];
            save_comm(&w, K_ASYNC, d.uris, 2, jobs);
            world_free(&w);
        } else {
            save_inproc(K_SYNC, NULL, d.uris, 2);
        }
        expect_loads(d.uris, 2, saved, 0);
        const char *dir0 = two_files ? d.path : d.memdir;
        int want;
        if (how == 0) {
            char f[1400];
            uint64_t off = 0;
            w_byte(d.uris[0], dir0, f, sizeof f, &off);
            tu_flip_byte(f, off, 0x10);
            want = STRATA_ECHECKSUM;
        } else {
            assert_true(tu_exists(dir0));
            tu_rmrf(dir0);
            want = STRATA_ENOENT;
        }
        char msg[1024];
        int tier = -1;
        int rc = comm ? load_comm(d.uris, 1, saved, &tier, msg, sizeof msg)
                      : load_inproc(d.uris, 1, saved, &tier, msg, sizeof msg);
        if (rc != want)
            fail_msg("%s load of tier 0 alone (%s): %s (%s), want %s",
                     comm ? "distributed" : "in-process", how ? "removed" : "corrupt",
                     strata_error_name(rc), msg, strata_error_name(want));
        expect_loads(d.uris, 2, saved, 1);
        print_message("%s, tier 0 %s: every rank loaded tier 1 (tier 0 alone: %s)\n",
                      comm ? "communicator" : "in process", how ? "removed" : "corrupt",
                      strata_error_name(rc));
    }
}

static void test_fallback_inproc(void **state)
{
    (void)state;
    fallback(0, 0); /* a memory tier, then a file */
    fallback(0, 1); /* two files */
}

static void test_fallback_comm(void **state)
{
    (void)state;
    fallback(1, 1);
    fallback(1, 0);
}

/* One saver per rank, three saves of an unchanged layout (sync, async, sync): a plan is
 * made, then reused; every checkpoint loads. */
static void test_plan_cached(void **state)
{
    (void)state;
    world w;
    world_init(&w);
    static const int kinds[] = {K_SYNC, K_ASYNC, K_SYNC};
    for (int i = 0; i < 3; i++) {
        dests d;
        make_dests(&d, 1, 0);
        job jobs[NCOMM];
        save_comm(&w, kinds[i], d.uris, 1, jobs);
        for (int r = 0; r < NCOMM; r++)
            if (jobs[r].stats.plan_cached != (i > 0))
                fail_msg("save %d (%s), rank %d: plan_cached %d, want %d", i, kind_names[kinds[i]],
                         r, jobs[r].stats.plan_cached, i > 0);
        expect_loads(d.uris, 1, NCOMM, 0);
    }
    world_free(&w);
}

/* Asynchronous distributed saves where ranks end differently: one calls wait_snapshot and
 * wait_durable then frees, one waits for the snapshot and frees, one frees at once. Every
 * rank returns (strata_handle_free takes part in the commit), the checkpoint is committed
 * and loads. Each role goes round every rank (rank 0 commits). */
static void test_free_without_wait(void **state)
{
    (void)state;
    world w;
    world_init(&w);
    for (int round = 0; round < NCOMM; round++) {
        int ends[NCOMM];
        for (int r = 0; r < NCOMM; r++)
            ends[r] = (r + round) % NCOMM; /* END_DURABLE, END_SNAPSHOT_FREE, END_FREE */
        dests d;
        make_dests(&d, round == 1 ? 2 : 1, 0);
        int nuris = round == 1 ? 2 : 1;
        tu_set s;
        save_layout(&s, NCOMM);
        job jobs[NCOMM];
        run_all(&w, K_ASYNC, d.uris, nuris, &s, ends, jobs);
        expect_all_ok(jobs, "async save ended by strata_handle_free");
        tu_set_free(&s);
        for (int t = 0; t < nuris; t++) {
            strata_probe_info pi;
            assert_ok(strata_probe(&pi, d.uris[t]));
            if (!pi.committed)
                fail_msg("round %d: %s is not committed after every rank freed its handle",
                         round, d.uris[t]);
            expect_loads(&d.uris[t], 1, NCOMM, 0);
        }
    }
    world_free(&w);
}

/* A saver without a pool makes its own at its first save and keeps it: two consecutive
 * asynchronous saves, then two at once, all load. */
static void test_own_pool(void **state)
{
    (void)state;
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    for (int i = 0; i < 2; i++) {
        dests d;
        make_dests(&d, 1, 0);
        save_inproc(K_ASYNC, sv, d.uris, 1);
        expect_loads(d.uris, 1, NPROC, 0);
    }
    /* two in flight at once, through the one saver and its pool */
    dests da, db;
    make_dests(&da, 1, 0);
    make_dests(&db, 2, 0);
    tu_set a, b;
    save_layout(&a, NPROC);
    save_layout(&b, NPROC);
    strata_save_opts o = save_opts();
    strata_handle *ha, *hb;
    assert_ok(strata_save_start(&ha, sv, da.uris, 1, a.st, NPROC, &o));
    assert_ok(strata_save_start(&hb, sv, db.uris, 2, b.st, NPROC, &o));
    assert_ok(strata_wait_snapshot(ha));
    for (int r = 0; r < NPROC; r++)
        tu_set_poison(&a, r);
    assert_ok(strata_wait_snapshot(hb));
    for (int r = 0; r < NPROC; r++)
        tu_set_poison(&b, r);
    assert_ok(strata_wait_durable(NULL, hb));
    assert_ok(strata_wait_durable(NULL, ha));
    strata_handle_free(ha);
    strata_handle_free(hb);
    tu_set_free(&a);
    tu_set_free(&b);
    expect_loads(da.uris, 1, NPROC, 0);
    expect_loads(db.uris, 2, NPROC, 0);
    expect_loads(&db.uris[1], 1, NPROC, 0);
    strata_saver_free(sv);
}

/* A synchronous save to two tiers whose second fails: the first is committed and loads,
 * and strata_save returns the failed tier's error with its message (naming it). */
static void test_sync_tier_fails(void **state)
{
    (void)state;
    char good[700], bad[800];
    snprintf(good, sizeof good, "%s/tiers-ok-%d", base, seq);
    snprintf(bad, sizeof bad, "fault+file://%s/tiers-bad-%d?op=write&n=1&errno=EIO", base, seq++);
    const char *uris[2] = {good, bad};
    tu_set s;
    save_layout(&s, NPROC);
    strata_save_opts o = save_opts();
    assert_rc(strata_save(NULL, NULL, uris, 2, s.st, NPROC, &o), STRATA_EIO);
    assert_msg_has("destination 1");
    assert_msg_has("Input/output error");
    tu_set_free(&s);
    expect_loads(uris, 1, NPROC, 0);
}

/* strata_uri_path: the path a save of that URI writes (mem:// under $STRATA_MEM_ROOT). */
static void test_uri_path(void **state)
{
    (void)state;
    char p[4096], want[4096 + 32];
    assert_ok(strata_uri_path(p, sizeof p, "mem://run/step-00000004"));
    snprintf(want, sizeof want, "%s/run/step-00000004", memroot);
    assert_string_equal(p, want);
    const char *uris[1] = {"mem://run/step-00000004"};
    tu_set s;
    save_layout(&s, NPROC);
    strata_save_opts o = save_opts();
    assert_ok(strata_save(NULL, NULL, uris, 1, s.st, NPROC, &o));
    tu_set_free(&s);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, p)); /* the same checkpoint, by its path */
    assert_true(pi.committed);
    assert_ok(strata_uri_path(p, sizeof p, "file:///a/b//"));
    assert_string_equal(p, "/a/b");
    assert_ok(strata_uri_path(p, sizeof p, "rel/dir/"));
    assert_string_equal(p, "rel/dir");
    assert_rc(strata_uri_path(p, sizeof p, "s4://x"), STRATA_ESCHEME);
    assert_msg_has("s4://x");
    assert_rc(strata_uri_path(p, sizeof p, "mem://../x"), STRATA_EINVAL);
    assert_rc(strata_uri_path(p, 8, "/a/long/path"), STRATA_EINVAL);
    assert_msg_has("does not fit in 8");
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base, sizeof base, "api");
    if (st_vfs_fault_register())
        return -1;
    snprintf(memroot, sizeof memroot, "%s/shm", base);
    setenv("STRATA_MEM_ROOT", memroot, 1); /* before the first mem:// use */
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_rmrf(base);
    unsetenv("STRATA_MEM_ROOT");
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matrix),
        cmocka_unit_test(test_fallback_inproc),
        cmocka_unit_test(test_fallback_comm),
        cmocka_unit_test(test_plan_cached),
        cmocka_unit_test(test_free_without_wait),
        cmocka_unit_test(test_own_pool),
        cmocka_unit_test(test_sync_tier_fails),
        cmocka_unit_test(test_uri_path),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
