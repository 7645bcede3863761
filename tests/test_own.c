/* test_own.c - one owner per checkpoint directory: two saves racing for one path (threads
 * and processes, synchronous and asynchronous), a collector (gc, retention) running beside
 * saves, a save in progress that retention must leave alone, and writes that must not go
 * through hard links into another checkpoint. Every save that returns success must load
 * bitwise afterwards; the loser must fail with STRATA_EBUSY or STRATA_EEXIST and touch
 * nothing. Where locks do not exclude (emulated by the fault wrapper's lock=none / local),
 * a save never removes a commit record it did not write, and refuses where it can see it;
 * retention removes only the very checkpoint it probed; a LOCK that is not a lock file
 * spares that checkpoint only; directories a save makes are fsynced into their parents.
 * STRATA_OWN_TRIALS scales the trial counts (make stress raises it). */
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/engine.h"
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

static int save_flags(const char *ck, int w, int async, unsigned flags)
{
    tu_set s;
    writer_set(&s, w, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = flags;
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

static int save_as(const char *ck, int w, int async)
{
    return save_flags(ck, w, async, STRATA_SAVE_NO_SYNC);
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
    pid_t gc = tu_collector(dir, keep ? keep : 1 << 30); /* 0: strata gc DIR */
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
    tu_collector_stop(gc);
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

/* Incremental saves beside a collector: step i names step i-1 (or the newest step it
 * knows committed) as its base; a frozen tensor "f" never changes, "c" holds i. The
 * collector (retention keeping `keep`) removes bases while saves link their files. Every
 * save either commits and loads bitwise at once, or is refused cleanly (the collector held
 * it: STRATA_EBUSY; its base went meanwhile: STRATA_ECHANGED, STRATA_ENOENT,
 * STRATA_EINCOMPLETE); at the end every committed checkpoint left loads bitwise and
 * verifies. STRATA_OWN_TRIALS scales the 500 trials. */
static int incr_save(const char *ck, int i, const char *base, int async)
{
    static const uint64_t fshape[2] = {301, 77}, cshape[1] = {1000};
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_shard(&s, 0, "f", STRATA_F32, 2, fshape, NULL, NULL, 0, 0, 0, 1);
    tu_shard_rec *c = tu_set_shard(&s, 0, "c", STRATA_I32, 1, cshape, NULL, NULL, 0, 0, 0, 1);
    for (int k = 0; k < 1000; k++)
        ((int32_t *)c->sh.data)[k] = i;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC | STRATA_SAVE_INCREMENTAL;
    o.chunk_bytes = 8192;
    o.base = base;
    int rc;
    if (async) {
        strata_handle *h;
        rc = strata_save_start(&h, NULL, &ck, 1, s.st, 1, &o);
        if (!rc) {
            rc = strata_wait_durable(NULL, h);
            strata_handle_free(h);
        }
    } else {
        rc = strata_save(NULL, NULL, &ck, 1, s.st, 1, &o);
    }
    tu_set_free(&s);
    return rc;
}

/* Loads ck: 0 and *i = the step it holds if its "f" is the pattern and "c" one value. */
static int incr_load(const char *ck, int *i)
{
    static const uint64_t fshape[2] = {301, 77}, cshape[1] = {1000};
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "f", STRATA_F32, 2, fshape, NULL, NULL, 0, 0, 0, 0);
    tu_shard_rec *c = tu_set_shard(&d, 0, "c", STRATA_I32, 1, cshape, NULL, NULL, 0, 0, 0, 0);
    int rc = strata_load(NULL, NULL, &ck, 1, d.st, 1, NULL);
    if (!rc) {
        if (tu_check_shard(&d.sh[0].sh) >= 0)
            fail_msg("%s: the frozen tensor loads but differs", ck);
        *i = ((int32_t *)c->sh.data)[0];
        for (int k = 0; k < 1000; k++)
            if (((int32_t *)c->sh.data)[k] != *i)
                fail_msg("%s: tensor c is not one step's", ck);
        strata_ckpt *ck2;
        assert_ok(strata_ckpt_open(&ck2, ck, 0));
        assert_ok(strata_ckpt_verify(ck2, NULL, NULL));
        strata_ckpt_free(ck2);
    }
    tu_set_free(&d);
    return rc;
}

static void run_incr_beside_gc(int async, int keep, int n)
{
    char dir[600];
    snprintf(dir, sizeof dir, "%s/incr-gc-%d-%d", base_dir, async, keep);
    assert_int_equal(mkdir(dir, 0755), 0);
    pid_t gc = tu_collector(dir, keep);
    int ok = 0, refused = 0, last = -1, prev = -1, linked = 0, gone = 0, changed = 0;
    for (int i = 0; i < n; i++) {
        char ck[700], base[32];
        /* every other save names the step before the newest: the collector (keeping 1 or
         * 2) is removing that one while the save links it */
        int b = i % 2 && prev >= 0 ? prev : last;
        snprintf(ck, sizeof ck, "%s/step-%04d", dir, i);
        snprintf(base, sizeof base, "step-%04d", b);
        int rc = incr_save(ck, i, b >= 0 ? base : NULL, async);
        if (rc == STRATA_EBUSY || rc == STRATA_ECHANGED || rc == STRATA_ENOENT ||
            rc == STRATA_EINCOMPLETE) {
            refused++;
            gone += rc != STRATA_EBUSY;
            changed += rc == STRATA_ECHANGED; /* removed between the match and the links */
            if (rc != STRATA_EBUSY && b == last)
                last = -1; /* the base is gone: a full save next */
            prev = -1;
            continue;
        }
        if (rc)
            fail_msg("%s: %s: %s", ck, strata_error_name(rc), strata_error_last());
        int got = -1;
        if (incr_load(ck, &got) || got != i)
            fail_msg("%s returned success but does not load (%s)", ck, strata_error_last());
        strata_ckpt *c;
        assert_ok(strata_ckpt_open(&c, ck, 0));
        linked += strata_ckpt_base(c, NULL) != NULL;
        strata_ckpt_free(c);
        prev = last;
        last = i;
        ok++;
    }
    tu_collector_stop(gc);
    /* what the collector left: every committed checkpoint loads bitwise */
    int left = 0;
    for (int i = 0; i < n; i++) {
        char ck[700];
        snprintf(ck, sizeof ck, "%s/step-%04d", dir, i);
        strata_probe_info pi;
        if (strata_probe(&pi, ck) || !pi.committed)
            continue;
        int got = -1;
        if (incr_load(ck, &got) || got != i)
            fail_msg("%s is committed but does not load: %s", ck, strata_error_last());
        left++;
    }
    print_message("incremental saves beside gc (%s, keep %d): %d trials, %d committed and "
                  "loaded (%d referring to a base), %d refused (%d: base removed meanwhile, %d of them "
                  "while linked), %d left loading, 0 losses\n",
                  async ? "async" : "sync", keep, n, ok, linked, refused, gone, changed, left);
    assert_true(linked > 0);
    tu_rmrf(dir);
}

static void test_incr_beside_gc(void **state)
{
    (void)state;
    int n = trials(500) / 2;
    run_incr_beside_gc(0, 1, n);
    run_incr_beside_gc(1, 1, n);
}

/* A gating wrapper: the first rename of a save through it (its metadata, before its
 * commit record) waits until the test opens the gate, so the save is held in progress,
 * owned and uncommitted, for as long as the test needs. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int gate_reached, gate_open;
typedef struct {
    st_vfs base;
    const st_vfs *inner;
} gate_vfs;

static int gate_rename(const st_vfs *v, const char *from, const char *to)
{
    const st_vfs *in = ((const gate_vfs *)v)->inner;
    pthread_mutex_lock(&gate_mu);
    gate_reached = 1;
    pthread_cond_broadcast(&gate_cv);
    while (!gate_open)
        pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    return in->rename(in, from, to);
}

static void gate_release(const st_vfs *v)
{
    st_vfs_release(((const gate_vfs *)v)->inner);
    free((void *)v);
}

static int gate_make(const st_vfs **out, const st_vfs *inner, const char *query)
{
    (void)query;
    gate_vfs *g = calloc(1, sizeof *g);
    assert_non_null(g);
    g->base = *inner;
    g->base.rename = gate_rename;
    g->base.release = gate_release;
    g->inner = inner;
    *out = &g->base;
    return 0;
}

/* Retention never removes a save in progress, whatever is committed around it: step100
 * started first and is held (gated) before its commit while step200 commits; retention
 * keeping 1 sweeps then and must leave step100 alone. (Before, the test only hoped that
 * step100 was still running when the sweep came: on a loaded machine it could commit
 * before step200 did, be the older of the two, and be removed by retention, rightly.) */
static void test_retain_spares_live_save(void **state)
{
    (void)state;
    char dir[600], s100[700], s200[700], g100[800];
    snprintf(dir, sizeof dir, "%s/live", base_dir);
    snprintf(s100, sizeof s100, "%s/step100", dir);
    snprintf(s200, sizeof s200, "%s/step200", dir);
    snprintf(g100, sizeof g100, "gate+file://%s", s100);
    assert_ok(st_vfs_register_wrapper("gate", gate_make));
    gate_reached = gate_open = 0;
    tu_set big;
    tu_set_init(&big, 1);
    uint64_t shape[1] = {48u << 20};
    tu_set_shard(&big, 0, "big", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 1u << 20)); /* a small pool: the save takes a while */
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *h;
    const char *u100 = g100;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 65536;
    assert_ok(strata_save_start(&h, sv, &u100, 1, big.st, 1, &o));
    /* step100 has written its data and waits at the gate, uncommitted */
    pthread_mutex_lock(&gate_mu);
    while (!gate_reached)
        pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    assert_int_equal(save_as(s200, 0, 0), 0);
    int removed = -1;
    assert_ok(strata_retain(&removed, dir, 1));
    assert_int_equal(removed, 0);
    assert_true(tu_exists(s100));
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, s100));
    assert_false(pi.has_commit); /* it was still in progress when the sweep ran */
    pthread_mutex_lock(&gate_mu);
    gate_open = 1;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "big", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
    const char *p100 = s100;
    assert_ok(strata_load(NULL, NULL, &p100, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&big);
    strata_saver_free(sv);
    strata_pool_free(pool);
    /* with step100 committed too (after step200), retention keeps the newest (step100)
     * and removes step200 */
    assert_ok(strata_retain(&removed, dir, 1));
    assert_int_equal(removed, 1);
    assert_false(tu_exists(s200));
    assert_true(tu_exists(s100));
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


/* Locks that do not exclude (NFS mounted nolock, seen from two clients: lock=local makes
 * each resolved URI a client). Save B owns the directory and writes its data; save A, on
 * the other "client", takes it too, clears B's files as an abandoned save's and commits.
 * B's commit then finds A's files in place: it must fail and leave A's checkpoint whole
 * (before: B's metadata replaced A's, and B's cleanup unlinked A's commit record and
 * every file). The steps are the engine's own (st_save_local's), run in this order. */
static void test_nolock_loser_keeps_winner(void **state)
{
    (void)state;
    char ck[600], ua[700], ub[700];
    snprintf(ck, sizeof ck, "%s/nolock", base_dir);
    snprintf(ua, sizeof ua, "fault+file://%s?lock=local", ck);
    snprintf(ub, sizeof ub, "fault+file://%s?lock=local", ck);
    const st_vfs *vb;
    char dir[PATH_MAX];
    assert_ok(st_vfs_resolve(ub, &vb, dir, sizeof dir));
    st_file *lock_b;
    assert_ok(st_prepare_dir(vb, dir, &lock_b));
    tu_set sb;
    writer_set(&sb, 1, 1);
    strata_save_opts o;
    strata_save_opts in = STRATA_SAVE_OPTS_INIT;
    in.flags = STRATA_SAVE_NO_SYNC;
    in.chunk_bytes = 8192;
    assert_ok(st_save_opts_get(&o, &in));
    st_save_plan sp;
    assert_ok(st_plan_states(&sp, sb.st, 2, &o));
    assert_ok(st_write_data(vb, dir, &sp, &o, NULL));
    /* A, with a lock B's "client" does not see: it wins */
    assert_int_equal(save_as(ua, 0, 0), 0);
    assert_int_equal(winner(ck, 2), 0);
    uint64_t id = st_save_id_new();
    assert_rc(st_commit_dir(vb, dir, sp.meta, 0, id), STRATA_EEXIST);
    assert_msg_has("locks did not keep it out");
    st_remove_failed(vb, dir, 1, id);
    st_own_release(vb, lock_b);
    assert_int_equal(winner(ck, 2), 0); /* whole: commit record, metadata, data */
    /* a save that failed for any reason never removes a commit record it did not write */
    st_remove_failed(vb, dir, 1, id);
    assert_int_equal(winner(ck, 2), 0);
    st_save_plan_free(&sp);
    tu_set_free(&sb);
    st_vfs_release(vb);
    tu_rmrf(ck);
}

/* A second lock granted while one is held (lock=none: the lock call succeeds for both):
 * saves and collectors refuse with STRATA_ENOTSUP and touch nothing. */
static void test_nolock_refused(void **state)
{
    (void)state;
    char dir[600], ck[700], old[700], u[800];
    snprintf(dir, sizeof dir, "%s/nolock-none", base_dir);
    snprintf(ck, sizeof ck, "%s/step-2", dir);
    snprintf(old, sizeof old, "%s/step-1", dir);
    assert_int_equal(save_as(old, 0, 0), 0);
    for (int async = 0; async < 2; async++) {
        snprintf(u, sizeof u, "fault+file://%s?lock=none", ck);
        assert_rc(save_as(u, 1, async), STRATA_ENOTSUP);
        assert_msg_has("do not exclude");
        strata_probe_info pi;
        assert_ok(strata_probe(&pi, ck));
        assert_false(pi.has_commit);
        char data[800];
        tu_join(data, ck, "data-000000.bin");
        assert_false(tu_exists(data));
    }
    /* retention keeping nothing removes nothing there */
    int removed = -1;
    snprintf(u, sizeof u, "fault+file://%s?lock=none", dir);
    assert_rc(strata_retain(&removed, u, 0), STRATA_ENOTSUP);
    assert_int_equal(removed, 0);
    assert_int_equal(winner(old, 2), 0);
    tu_rmrf(dir);
}

/* Retention's time of check: it probes step-1 (committed, older than step-2); meanwhile
 * another collector removes step-1 and a save commits a new step-1, now the newest. The
 * first collector must leave the new one (before: it checked only that a commit record
 * existed, and removed the newest checkpoint). */
static char toctou_dir[700];
static void toctou_hook(const char *dir)
{
    (void)dir;
    st_retain_test_hook = NULL;
    char s1[800];
    snprintf(s1, sizeof s1, "%s/step-1", toctou_dir);
    int removed = -1;
    assert_ok(strata_retain(&removed, toctou_dir, 1)); /* the other collector */
    assert_int_equal(removed, 1);
    assert_false(tu_exists(s1));
    assert_int_equal(save_as(s1, 1, 0), 0); /* a new step-1, the newest now */
}

typedef struct {
    int n, code[8];
    char path[8][800], msg[8][1024];
} skips;

static void note_skip(void *ctx, const char *path, int code, const char *message)
{
    skips *k = ctx;
    if (k->n < 8) {
        k->code[k->n] = code;
        snprintf(k->path[k->n], sizeof k->path[0], "%s", path);
        snprintf(k->msg[k->n], sizeof k->msg[0], "%s", message);
    }
    k->n++;
}

static void test_retain_rechecks_under_lock(void **state)
{
    (void)state;
    char s1[800], s2[800];
    snprintf(toctou_dir, sizeof toctou_dir, "%s/toctou", base_dir);
    snprintf(s1, sizeof s1, "%s/step-1", toctou_dir);
    snprintf(s2, sizeof s2, "%s/step-2", toctou_dir);
    assert_int_equal(save_as(s1, 0, 0), 0);
    assert_int_equal(save_as(s2, 0, 0), 0);
    st_retain_test_hook = toctou_hook;
    int removed = -1;
    skips k = {0};
    assert_ok(strata_retain_report(&removed, toctou_dir, 1, note_skip, &k));
    assert_null(st_retain_test_hook); /* the hook ran */
    assert_int_equal(removed, 0);
    assert_int_equal(k.n, 1);
    assert_int_equal(k.code[0], STRATA_ENOENT);
    assert_string_equal(k.path[0], s1);
    assert_int_equal(winner(s1, 2), 1); /* the new step-1 */
    assert_int_equal(winner(s2, 2), 0);
    tu_rmrf(toctou_dir);
}

/* A LOCK that is a symlink, FIFO, directory or socket spares that checkpoint only: the
 * collector reports it (STRATA_EINVAL, naming it) and collects the others (before: the
 * sweep stopped at the first with "Wrong medium type" or "No such device or address"). */
static void test_bad_lock_kinds(void **state)
{
    (void)state;
    char dir[600], ck[5][700], lk[4096];
    snprintf(dir, sizeof dir, "%s/badlock", base_dir);
    static const char *const kinds[5] = {"a-symlink", "b-fifo", "c-dir", "d-socket", "e-plain"};
    for (int i = 0; i < 5; i++) {
        snprintf(ck[i], sizeof ck[i], "%s/%s", dir, kinds[i]);
        assert_int_equal(save_as(ck[i], 0, 0), 0);
        tu_join(lk, ck[i], ST_COMMIT_FILE);
        assert_int_equal(unlink(lk), 0); /* incomplete, as a killed save leaves it */
        tu_join(lk, ck[i], ST_LOCK_FILE);
        if (i == 0)
            assert_int_equal(symlink("/dev/null", lk), 0);
        else if (i == 1)
            assert_int_equal(mkfifo(lk, 0644), 0);
        else if (i == 2)
            assert_int_equal(mkdir(lk, 0755), 0);
        else if (i == 3) {
            int fd = socket(AF_UNIX, SOCK_STREAM, 0);
            struct sockaddr_un a = {.sun_family = AF_UNIX};
            assert_true(strlen(lk) < sizeof a.sun_path);
            memcpy(a.sun_path, lk, strlen(lk) + 1);
            assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
            close(fd);
        }
    }
    for (int i = 0; i < 4; i++) {
        assert_rc(strata_remove_incomplete(ck[i]), STRATA_EINVAL);
        assert_msg_has("not a lock file strata made");
        assert_rc(save_as(ck[i], 1, i % 2), STRATA_EINVAL);
    }
    int removed = -1;
    skips k = {0};
    assert_ok(strata_retain_report(&removed, dir, 1 << 30, note_skip, &k));
    assert_int_equal(removed, 1);
    assert_false(tu_exists(ck[4]));
    assert_int_equal(k.n, 4);
    for (int i = 0; i < 4; i++) { /* each reported once, naming its LOCK */
        tu_join(lk, ck[i], ST_LOCK_FILE);
        int seen = 0;
        for (int j = 0; j < 4; j++)
            if (strcmp(k.path[j], ck[i]) == 0) {
                seen++;
                assert_int_equal(k.code[j], STRATA_EINVAL);
                assert_non_null(strstr(k.msg[j], lk));
            }
        assert_int_equal(seen, 1);
        assert_true(tu_exists(ck[i]));
    }
    tu_rmrf(dir);
}

/* A recording wrapper: logs mkdir and directory fsync calls in order. */
typedef struct {
    st_vfs base;
    const st_vfs *inner;
} rec_vfs;
static pthread_mutex_t rec_mu = PTHREAD_MUTEX_INITIALIZER;
static char rec_log[64][PATH_MAX + 8];
static int rec_n;

static void rec_note(const char *what, const char *path)
{
    pthread_mutex_lock(&rec_mu);
    if (rec_n < 64)
        snprintf(rec_log[rec_n++], sizeof rec_log[0], "%s %s", what, path);
    pthread_mutex_unlock(&rec_mu);
}

static int rec_mkdir(const st_vfs *v, const char *path)
{
    const st_vfs *in = ((const rec_vfs *)v)->inner;
    int e = in->mkdir(in, path);
    if (e == 0)
        rec_note("mkdir", path);
    return e;
}

static int rec_sync_dir(const st_vfs *v, const char *path)
{
    const st_vfs *in = ((const rec_vfs *)v)->inner;
    rec_note("sync", path);
    return in->sync_dir(in, path);
}

static void rec_release(const st_vfs *v)
{
    st_vfs_release(((const rec_vfs *)v)->inner);
    free((void *)v);
}

static int rec_make(const st_vfs **out, const st_vfs *inner, const char *query)
{
    (void)query;
    rec_vfs *r = calloc(1, sizeof *r);
    r->base = *inner;
    r->base.mkdir = rec_mkdir;
    r->base.sync_dir = rec_sync_dir;
    r->base.release = rec_release;
    r->inner = inner;
    *out = &r->base;
    return 0;
}

/* Index of the first log line equal to "what path" at or after from, or -1. */
static int rec_find(const char *what, const char *path, int from)
{
    char want[PATH_MAX + 8];
    snprintf(want, sizeof want, "%s %s", what, path);
    for (int i = from; i < rec_n; i++)
        if (strcmp(rec_log[i], want) == 0)
            return i;
    return -1;
}

/* Every directory a save creates is fsynced into its parent after it is made (before: the
 * parents made by mkdir -p never were, so a power loss could take them and the checkpoint
 * committed below them); the checkpoint directory's entry at its commit. */
static void test_created_dirs_synced(void **state)
{
    (void)state;
    assert_ok(st_vfs_register_wrapper("rec", rec_make));
    for (int async = 0; async < 2; async++) {
        char top[600], x[700], y[800], ck[900], u[1000];
        snprintf(top, sizeof top, "%s/synced-%d", base_dir, async);
        snprintf(x, sizeof x, "%s/x", top);
        snprintf(y, sizeof y, "%s/y", x);
        snprintf(ck, sizeof ck, "%s/ck", y);
        snprintf(u, sizeof u, "rec+file://%s", ck);
        assert_int_equal(mkdir(top, 0755), 0);
        rec_n = 0;
        assert_int_equal(save_flags(u, 0, async, 0), 0);
        const char *made[3][2] = {{x, top}, {y, x}, {ck, y}};
        for (int i = 0; i < 3; i++) {
            int m = rec_find("mkdir", made[i][0], 0);
            if (m < 0 || rec_find("sync", made[i][1], m + 1) < 0)
                fail_msg("'%s' was made (log line %d) but '%s' was not fsynced after it", made[i][0],
                         m, made[i][1]);
        }
        assert_int_equal(winner(ck, 2), 0);
        tu_rmrf(top);
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
        cmocka_unit_test(test_incr_beside_gc),
        cmocka_unit_test(test_nolock_loser_keeps_winner),
        cmocka_unit_test(test_nolock_refused),
        cmocka_unit_test(test_retain_rechecks_under_lock),
        cmocka_unit_test(test_bad_lock_kinds),
        cmocka_unit_test(test_created_dirs_synced),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
