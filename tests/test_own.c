/* test_own.c - one owner per checkpoint directory: two saves racing for one path (threads
 * and processes, synchronous and asynchronous), a collector (gc, retention) running beside
 * saves, a save in progress that retention must leave alone, and writes that must not go
 * through hard links into another checkpoint. Every save that returns success must load
 * bitwise afterwards; the loser must fail with STRATA_EBUSY or STRATA_EEXIST and touch
 * nothing. STRATA_OWN_TRIALS scales the trial counts (make stress raises it). */
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "meta/meta.h"
#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "own")

static int trials(int def) { return (int)tu_env_u64("STRATA_OWN_TRIALS", (uint64_t)def); }

/* Writer w's state on 2 ranks: tensor "w<w>" (odd shape, uneven rows) and a global blob. */
static void writer_set(tu_set *s, int w, int fill)
{
    char name[16];
    snprintf(name, sizeof name, "w%d", w);
    uint64_t shape[2] = {301, 77}, top[2] = {0, 0}, tl[2] = {123, 77}, bot[2] = {123, 0},
             bl[2] = {178, 77};
    tu_set_init(s, fill ? 2 : 1);
    tu_set_shard(s, 0, name, STRATA_F32, 2, shape, fill ? top : NULL, fill ? tl : NULL, 0, 0, 0,
                 fill);
    if (fill)
        tu_set_shard(s, 1, name, STRATA_F32, 2, shape, bot, bl, 0, 0, 0, fill);
    tu_set_blob(s, 0, "who", 0, -1, 64, fill);
}

/* The writer whose state the checkpoint at ck holds (-1 if none loads): its tensor and
 * blob load bitwise, and the other writer's tensor is not there. */
static int winner(const char *ck, int nwriters)
{
    int found = -1;
    for (int w = 0; w < nwriters; w++) {
        tu_set d;
        writer_set(&d, w, 0);
        int rc = strata_load(NULL, NULL, &ck, 1, d.st, 1, NULL);
        if (rc == 0) {
            if (tu_set_check(&d))
                fail_msg("%s: writer %d's data loads but differs", ck, w);
            if (found >= 0)
                fail_msg("%s holds both writers' tensors", ck);
            found = w;
        } else if (rc != STRATA_ENOTFOUND) {
            fail_msg("%s: loading writer %d's state: %s: %s", ck, w, strata_error_name(rc),
                     strata_error_last());
        }
        tu_set_free(&d);
    }
    strata_ckpt *c;
    if (found >= 0) {
        assert_ok(strata_ckpt_open(&c, ck, 0));
        assert_ok(strata_ckpt_verify(c, NULL, NULL));
        strata_ckpt_free(c);
    }
    return found;
}

static int save_as(const char *ck, int w, int async)
{
    tu_set s;
    writer_set(&s, w, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC;
    o.chunk_bytes = 8192;
    int rc;
    if (async) {
        strata_handle *h;
        rc = strata_save_start(&h, NULL, &ck, 1, s.st, 2, &o);
        if (!rc) {
            strata_wait_snapshot(h);
            rc = strata_wait_durable(NULL, h);
            strata_handle_free(h);
        }
    } else {
        rc = strata_save(NULL, NULL, &ck, 1, s.st, 2, &o);
    }
    tu_set_free(&s);
    return rc;
}

typedef struct {
    const char *ck;
    int w, async, rc;
    pthread_barrier_t *go;
    char msg[1024];
} racer;

static void *race_one(void *p)
{
    racer *r = p;
    pthread_barrier_wait(r->go);
    r->rc = save_as(r->ck, r->w, r->async);
    snprintf(r->msg, sizeof r->msg, "%s", strata_error_last());
    return NULL;
}

typedef struct {
    int trials, ok, refused, busy, losses;
} tally;

/* One trial's outcome: exactly one save committed and it loads; the other was refused. */
static void judge(tally *t, const char *ck, const int *rc, const char (*msg)[1024])
{
    t->trials++;
    int wins = 0;
    for (int w = 0; w < 2; w++) {
        if (rc[w] == 0) {
            wins++;
        } else if (rc[w] == STRATA_EBUSY || rc[w] == STRATA_EEXIST) {
            t->refused++;
            t->busy += rc[w] == STRATA_EBUSY;
        } else {
            fail_msg("%s: writer %d failed with %s: %s", ck, w, strata_error_name(rc[w]),
                     msg[w]);
        }
    }
    if (wins != 1)
        fail_msg("%s: %d saves returned success, want exactly 1", ck, wins);
    int who = winner(ck, 2);
    if (who < 0 || rc[who] != 0) {
        t->losses++;
        fail_msg("%s: the successful save's data is not what the checkpoint holds (%d)", ck, who);
    }
    t->ok++;
}

static void test_two_savers_threads(void **state)
{
    (void)state;
    tally t = {0};
    int n = trials(60);
    for (int i = 0; i < n; i++) {
        char ck[600];
        snprintf(ck, sizeof ck, "%s/race-%d", base_dir, i);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        racer r[2];
        pthread_t th[2];
        for (int w = 0; w < 2; w++) {
            r[w] = (racer){ck, w, (i + w) % 3 == 0, 0, &go, ""};
            assert_int_equal(pthread_create(&th[w], NULL, race_one, &r[w]), 0);
        }
        for (int w = 0; w < 2; w++)
            pthread_join(th[w], NULL);
        pthread_barrier_destroy(&go);
        int rc[2] = {r[0].rc, r[1].rc};
        char msg[2][1024];
        memcpy(msg[0], r[0].msg, sizeof msg[0]);
        memcpy(msg[1], r[1].msg, sizeof msg[1]);
        judge(&t, ck, rc, (const char (*)[1024])msg);
        tu_rmrf(ck);
    }
    print_message("two savers, threads: %d trials, %d committed, %d refused (%d busy, %d "
                  "already committed), %d losses\n",
                  t.trials, t.ok, t.refused, t.busy, t.refused - t.busy, t.losses);
}

/* The same with two processes (fork: each child saves and exits with its code). */
static void test_two_savers_processes(void **state)
{
    (void)state;
    tally t = {0};
    int n = trials(40);
    for (int i = 0; i < n; i++) {
        char ck[600];
        snprintf(ck, sizeof ck, "%s/prace-%d", base_dir, i);
        int pipefd[2];
        assert_int_equal(pipe(pipefd), 0);
        pid_t pid[2];
        for (int w = 0; w < 2; w++) {
            pid[w] = fork();
            assert_true(pid[w] >= 0);
            if (pid[w] == 0) {
                char c;
                close(pipefd[1]);
                if (read(pipefd[0], &c, 1) < 0) /* start together */
                    _exit(100);
                int rc = save_as(ck, w, (i + w) % 2);
                _exit(rc == 0 ? 0 : rc == STRATA_EBUSY ? 1 : rc == STRATA_EEXIST ? 2 : 3);
            }
        }
        close(pipefd[0]);
        close(pipefd[1]); /* both children read EOF: go */
        int rc[2];
        char msg[2][1024] = {"", ""};
        for (int w = 0; w < 2; w++) {
            int status;
            assert_int_equal(waitpid(pid[w], &status, 0), pid[w]);
            assert_true(WIFEXITED(status));
            int code = WEXITSTATUS(status);
            rc[w] = code == 0 ? 0 : code == 1 ? STRATA_EBUSY : code == 2 ? STRATA_EEXIST : STRATA_EIO;
            if (code == 3)
                snprintf(msg[w], sizeof msg[w], "child failed with another error");
        }
        judge(&t, ck, rc, (const char (*)[1024])msg);
        tu_rmrf(ck);
    }
    print_message("two savers, processes: %d trials, %d committed, %d refused (%d busy, %d "
                  "already committed), %d losses\n",
                  t.trials, t.ok, t.refused, t.busy, t.refused - t.busy, t.losses);
}

/* A collector (retention keeping 2, and removal of incomplete checkpoints) loops in a
 * child process while this process saves step after step; every save that returns success
 * loads bitwise right away (it is the newest: retention keeps it). */
static void run_beside_gc(int async, int keep)
{
    char dir[600];
    snprintf(dir, sizeof dir, "%s/gc-%d-%d", base_dir, async, keep);
    assert_int_equal(mkdir(dir, 0755), 0);
    pid_t gc = fork();
    assert_true(gc >= 0);
    if (gc == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives a failed test */
        for (;;) {
            int removed;
            if (keep) {
                strata_retain(&removed, dir, keep);
            } else { /* strata gc DIR: every incomplete checkpoint no live save owns */
                strata_retain(&removed, dir, 1 << 30);
            }
        }
    }
    int n = trials(60), ok = 0, refused = 0;
    for (int i = 0; i < n; i++) {
        char ck[700];
        snprintf(ck, sizeof ck, "%s/step-%d", dir, i);
        int rc = save_as(ck, i % 2, async);
        if (rc == STRATA_EBUSY) { /* the collector held it: a clean refusal */
            refused++;
            continue;
        }
        if (rc)
            fail_msg("%s: %s: %s", ck, strata_error_name(rc), strata_error_last());
        if (winner(ck, 2) != i % 2)
            fail_msg("%s returned success but does not load", ck);
        ok++;
    }
    kill(gc, SIGKILL);
    waitpid(gc, NULL, 0);
    print_message("saves beside gc (%s, keep %d): %d trials, %d committed and loaded, %d "
                  "refused, 0 losses\n", async ? "async" : "sync", keep, n, ok, refused);
    tu_rmrf(dir);
}

static void test_gc_beside_saves(void **state)
{
    (void)state;
    run_beside_gc(0, 0);
    run_beside_gc(1, 0);
    run_beside_gc(0, 2);
    run_beside_gc(1, 2);
}

/* Retention never removes a save in progress, whatever is committed around it: step100
 * started first, step200 committed meanwhile. */
static void test_retain_spares_live_save(void **state)
{
    (void)state;
    char dir[600], s100[700], s200[700];
    snprintf(dir, sizeof dir, "%s/live", base_dir);
    snprintf(s100, sizeof s100, "%s/step100", dir);
    snprintf(s200, sizeof s200, "%s/step200", dir);
    tu_set big;
    tu_set_init(&big, 1);
    uint64_t shape[1] = {48u << 20};
    tu_set_shard(&big, 0, "big", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 1u << 20)); /* a small pool: the save takes a while */
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *h;
    const char *u100 = s100;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 65536;
    assert_ok(strata_save_start(&h, sv, &u100, 1, big.st, 1, &o));
    assert_int_equal(save_as(s200, 0, 0), 0);
    /* wait until the save writes in its directory, then sweep (if the save is already done
     * by then, the sweep still must keep it: it is the newest) */
    char d100[800];
    tu_join(d100, s100, "data-000000.bin");
    for (int i = 0; i < 2000 && !tu_exists(d100); i++)
        usleep(1000);
    int removed = -1;
    assert_ok(strata_retain(&removed, dir, 1));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "big", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, &u100, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&big);
    strata_saver_free(sv);
    strata_pool_free(pool);
    /* with step100 committed too, retention keeps the newest (step100) and removes
     * step200 */
    assert_ok(strata_retain(&removed, dir, 1));
    assert_int_equal(removed, 1);
    assert_false(tu_exists(s200));
    tu_rmrf(dir);
}

/* A directory held by a live owner: strata_remove_incomplete is STRATA_EBUSY and touches
 * nothing; a save there is STRATA_EBUSY too. */
static void test_owned_directory(void **state)
{
    (void)state;
    char ck[600], lock[700], data[700];
    snprintf(ck, sizeof ck, "%s/held", base_dir);
    assert_int_equal(save_as(ck, 0, 0), 0);
    /* make it incomplete, as a killed save would leave it, and hold its lock */
    tu_join(lock, ck, ST_COMMIT_FILE);
    assert_int_equal(unlink(lock), 0);
    const st_vfs *v = &st_vfs_posix;
    st_file *held;
    tu_join(lock, ck, ST_LOCK_FILE);
    assert_int_equal(v->lock(v, lock, &held), 0);
    assert_rc(strata_remove_incomplete(ck), STRATA_EBUSY);
    tu_join(data, ck, "data-000000.bin");
    assert_true(tu_exists(data));
    assert_rc(save_as(ck, 1, 0), STRATA_EBUSY);
    assert_rc(save_as(ck, 1, 1), STRATA_EBUSY);
    assert_true(tu_exists(data));
    v->close(held);
    /* let go: the collector may remove it, and a save may replace it */
    assert_ok(strata_remove_incomplete(ck));
    assert_false(tu_exists(data));
    assert_int_equal(save_as(ck, 1, 1), 0);
    assert_int_equal(winner(ck, 2), 1);
    tu_rmrf(ck);
}

/* An incomplete directory whose data file is a hard link to a committed checkpoint's
 * (cp -al, rsync --link-dest): saving there must not write through the link. */
static void test_no_write_through_links(void **state)
{
    (void)state;
    for (int async = 0; async < 2; async++) {
        char a[600], b[600], fa[700], fb[700];
        snprintf(a, sizeof a, "%s/linked-a-%d", base_dir, async);
        snprintf(b, sizeof b, "%s/linked-b-%d", base_dir, async);
        assert_int_equal(save_as(a, 0, 0), 0);
        assert_int_equal(mkdir(b, 0755), 0);
        const char *names[] = {"data-000000.bin", "data-000001.bin", ST_META_FILE};
        for (int k = 0; k < 3; k++) {
            tu_join(fa, a, names[k]);
            tu_join(fb, b, names[k]);
            assert_int_equal(link(fa, fb), 0);
        }
        assert_int_equal(save_as(b, 1, async), 0);
        assert_int_equal(winner(b, 2), 1);
        assert_int_equal(winner(a, 2), 0); /* the committed one still verifies and loads */
        tu_rmrf(a);
        tu_rmrf(b);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_savers_threads),
        cmocka_unit_test(test_two_savers_processes),
        cmocka_unit_test(test_owned_directory),
        cmocka_unit_test(test_no_write_through_links),
        cmocka_unit_test(test_retain_spares_live_save),
        cmocka_unit_test(test_gc_beside_saves),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
