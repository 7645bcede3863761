/* test_dist_commit.c - the commits of distributed saves, the ranks as threads of this
 * process (tests/distutil.h): background commits on the communicators' duplicates, saves in
 * flight committed in the order they were started, a saver freed with saves in flight, two
 * tiers, and STRATA_SAVE_REPLACE with a communicator. */
#include "engine/engine.h" /* st_async_test_hook */
#include "distutil.h"

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

/* Two tiers, the second holding a committed checkpoint (the README's MPI examples run in
 * order): every rank fails with STRATA_EEXIST naming that destination, not the first; the
 * first tier, which rank 0 had owned already, is left as it was (gone, no LOCK); the
 * committed one is untouched. */
static void test_async_tier_committed(void **state)
{
    (void)state;
    world w;
    world_init(&w, 4);
    job jobs[4];
    char fast[600], slow[600];
    snprintf(fast, sizeof fast, "%s/own-fast", base);
    snprintf(slow, sizeof slow, "%s/own-slow", base);
    tu_set a;
    layout(&a, 2, 2, 1);
    run_all(&w, 1, slow, NULL, &a, jobs);
    expect_all_ok(jobs, 4);
    tu_set_free(&a);
    const char *second[4] = {slow, slow, slow, slow};
    tier2 = second;
    layout(&a, 2, 2, 1);
    run_all(&w, SAVE_TIERS, fast, NULL, &a, jobs);
    tu_set_free(&a);
    tier2 = NULL;
    for (int r = 0; r < 4; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EEXIST);
        if (!strstr(jobs[r].msg, slow) || strstr(jobs[r].msg, fast))
            fail_msg("rank %d's message does not blame %s alone: %s", r, slow, jobs[r].msg);
    }
    if (tu_exists(fast))
        fail_msg("the first tier %s was left behind (its LOCK)", fast);
    expect_loads(slow);
    world_free(&w);
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

TU_TMPDIR_GROUP(base, "dist-commit")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_tiers),
        cmocka_unit_test(test_async_tier_committed),
        cmocka_unit_test(test_replace),
        cmocka_unit_test(test_background_commit),
        cmocka_unit_test(test_commit_order),
        cmocka_unit_test(test_saver_freed_in_flight),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
