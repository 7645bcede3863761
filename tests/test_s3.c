/* test_s3.c - the s3:// backend against a real S3 server (tests/s3_test.sh starts moto on
 * 127.0.0.1 and sets STRATA_TEST_S3=s3://BUCKET/RUN, the AWS_* variables, and
 * STRATA_TEST_S3_DENIED to an endpoint that refuses every key). Skipped (77) without it.
 * Round trips (sync, async, resharded; data files of many multipart parts), two savers of one
 * prefix (exactly one commits), a collector beside saves, a SIGKILLed save (nothing
 * committed; gc removes it and aborts its uploads once its lease has run out), the fault
 * wrapper around the backend (a failed save leaves no object and no upload), a missing
 * bucket and refused credentials (STRATA_EIO / STRATA_ENOENT naming the bucket). */
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tools/export.h"
#include "io/s3_http.h"
#include "io/vfs.h"
#include "io/vfs_fault.h"
#include "testutil.h"

static char base[512], bucket[256];

static int trials(int def) { return (int)tu_env_u64("STRATA_S3_TRIALS", (uint64_t)def); }

/* How many multipart uploads are open under prefix key "<run>/<sub>/". */
static int uploads_under(const char *uri)
{
    s3_cfg cfg = {.retries = 3, .timeout_s = 30};
    snprintf(cfg.bucket, sizeof cfg.bucket, "%s", bucket);
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "%s", getenv("AWS_ENDPOINT_URL"));
    snprintf(cfg.region, sizeof cfg.region, "us-east-1");
    snprintf(cfg.key_id, sizeof cfg.key_id, "%s", getenv("AWS_ACCESS_KEY_ID"));
    snprintf(cfg.secret, sizeof cfg.secret, "%s", getenv("AWS_SECRET_ACCESS_KEY"));
    s3_conn *c;
    int check;
    assert_int_equal(s3_conn_get(&cfg, &c, &check), 0);
    char q[1200] = "prefix=";
    const char *key = uri + 5 + strlen(bucket) + 1;
    char pre[800];
    snprintf(pre, sizeof pre, "%s/", key);
    assert_int_equal(s3_uri_encode(q, sizeof q, pre, 0), 0);
    strcat(q, "&uploads=");
    s3_req rq = {.method = "GET", .key = "", .query = q};
    s3_resp r;
    assert_int_equal(s3_do(c, &rq, &r), 0);
    assert_int_equal(r.status, 200);
    int n = 0;
    for (const char *p = r.body; (p = strstr(p, "<UploadId>")); p++)
        n++;
    s3_resp_free(&r);
    s3_conn_put(c, 1);
    return n;
}

static int count_entry(void *ctx, const char *name, uint64_t size, int kind)
{
    (void)name, (void)size, (void)kind;
    ++*(int *)ctx;
    return ST_LIST_NEXT;
}

/* How many objects and sub-prefixes are directly under uri. */
static int objects_under(const char *uri)
{
    const st_vfs *v;
    char path[1024];
    assert_int_equal(st_vfs_resolve(uri, &v, path, sizeof path), 0);
    int n = 0, e = v->list(v, path, count_entry, &n);
    st_vfs_release(v);
    assert_int_equal(e, 0);
    return n;
}

/* A state on `ranks` ranks: f32 [rows, 1500] split by rows (unevenly), an i64 vector
 * replicated, a global blob. */
static void state(tu_set *s, int ranks, uint64_t rows, int fill)
{
    uint64_t shape[2] = {rows, 1500}, vshape[1] = {77};
    tu_set_init(s, ranks);
    for (int r = 0; r < ranks; r++) {
        uint64_t lo = rows * (uint64_t)r / (uint64_t)ranks + (r ? 3 : 0),
                 hi = r == ranks - 1 ? rows : rows * (uint64_t)(r + 1) / (uint64_t)ranks + 3;
        uint64_t off[2] = {lo, 0}, len[2] = {hi - lo, 1500};
        tu_set_shard(s, r, "big", STRATA_F32, 2, shape, off, len, 0, 0, 0, fill);
        tu_set_shard(s, r, "vec", STRATA_I64, 1, vshape, NULL, NULL, 0, 0, 0, fill);
    }
    tu_set_blob(s, 0, "cfg", 0, -1, 1000, fill);
}

static int save_state(const char *ck, int ranks, uint64_t rows, int async, unsigned flags)
{
    tu_set s;
    state(&s, ranks, rows, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = flags;
    int rc;
    if (async) {
        strata_handle *h;
        rc = strata_save_start(&h, NULL, &ck, 1, s.st, ranks, &o);
        if (!rc) {
            strata_wait_snapshot(h);
            rc = strata_wait_durable(NULL, h);
            strata_handle_free(h);
        }
    } else {
        rc = strata_save(NULL, NULL, &ck, 1, s.st, ranks, &o);
    }
    tu_set_free(&s);
    return rc;
}

/* Loads ck into `ranks` ranks and checks every element: 0, or the load's code. */
static int load_check(const char *ck, int ranks, uint64_t rows)
{
    tu_set d;
    state(&d, ranks, rows, 0);
    int rc = strata_load(NULL, NULL, &ck, 1, d.st, ranks, NULL);
    if (rc == 0 && tu_set_check(&d))
        fail_msg("%s: loaded into %d ranks, but the data differs", ck, ranks);
    tu_set_free(&d);
    return rc;
}

static void test_roundtrip(void **st)
{
    (void)st;
    const uint64_t rows = 6000; /* 36 MB: 8 parts of 5 MiB */
    for (int async = 0; async < 2; async++) {
        char ck[700];
        snprintf(ck, sizeof ck, "%s/round-%d", base, async);
        int rc = save_state(ck, 2, rows, async, 0);
        if (rc)
            fail_msg("save to %s: %s: %s", ck, strata_error_name(rc), strata_error_last());
        for (int ranks = 1; ranks <= 3; ranks++) /* resharded: 1 and 3 ranks */
            if ((rc = load_check(ck, ranks, rows)))
                fail_msg("load of %s: %s: %s", ck, strata_error_name(rc), strata_error_last());
        strata_ckpt *c;
        assert_int_equal(strata_ckpt_open(&c, ck, 0), 0);
        assert_int_equal(strata_ckpt_verify(c, NULL, NULL), 0);
        strata_ckpt_free(c);
        assert_int_equal(uploads_under(ck), 0);
        /* metadata.bin, COMMIT, two data files; no LOCK, nothing temporary */
        assert_int_equal(objects_under(ck), 4);
        /* committed: never written again */
        assert_int_equal(save_state(ck, 2, 10, 0, 0), STRATA_EEXIST);
    }
}

typedef struct {
    const char *ck;
    int rc;
    pthread_barrier_t *go;
    char msg[1024];
} racer;

static void *race(void *p)
{
    racer *r = p;
    pthread_barrier_wait(r->go);
    r->rc = save_state(r->ck, 1, 20, 0, STRATA_SAVE_NO_SYNC);
    snprintf(r->msg, sizeof r->msg, "%s", strata_error_last());
    return NULL;
}

/* Two savers of ck at once (released together by a barrier); their outcomes into r. */
static void run_race(const char *ck, racer r[2])
{
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, 2);
    pthread_t th[2];
    for (int w = 0; w < 2; w++) {
        r[w] = (racer){ck, 0, &go, ""};
        assert_int_equal(pthread_create(&th[w], NULL, race, &r[w]), 0);
    }
    for (int w = 0; w < 2; w++)
        pthread_join(th[w], NULL);
    pthread_barrier_destroy(&go);
}

static void test_two_savers(void **st)
{
    (void)st;
    int n = trials(100), busy = 0, exists = 0;
    for (int i = 0; i < n; i++) {
        char ck[700];
        snprintf(ck, sizeof ck, "%s/race-%d", base, i);
        racer r[2];
        run_race(ck, r);
        int wins = 0;
        for (int w = 0; w < 2; w++) {
            if (r[w].rc == 0)
                wins++;
            else if (r[w].rc == STRATA_EBUSY)
                busy++;
            else if (r[w].rc == STRATA_EEXIST)
                exists++;
            else
                fail_msg("%s: saver %d: %s: %s", ck, w, strata_error_name(r[w].rc), r[w].msg);
        }
        if (wins != 1)
            fail_msg("%s: %d savers succeeded, want exactly 1", ck, wins);
        assert_int_equal(load_check(ck, 1, 20), 0);
    }
    print_message("two savers on one prefix: %d trials, each exactly one commit (%d refused "
                  "busy, %d refused as committed)\n", n, busy, exists);
}

/* Where the leases do not exclude (emulated: the fault wrapper's lock=local, one "client"
 * per saver) both savers reach the commit; the commit record's If-None-Match: * lets one
 * through. Never two successes (nor a commit record without one); the loser fails with
 * STRATA_EEXIST, STRATA_EBUSY or STRATA_ENOENT (the other's cleanup removed its files). */
static void test_commit_race(void **st)
{
    (void)st;
    assert_int_equal(st_vfs_fault_register(), 0);
    int n = trials(100), raced = 0, wins_total = 0, broken = 0;
    for (int i = 0; i < n; i++) {
        char ck[800], plain[700];
        snprintf(plain, sizeof plain, "%s/commit-race-%d", base, i);
        snprintf(ck, sizeof ck, "fault+%s?lock=local", plain);
        racer r[2];
        run_race(ck, r);
        int wins = 0;
        for (int w = 0; w < 2; w++) {
            if (r[w].rc == 0)
                wins++;
            else if (r[w].rc != STRATA_EBUSY && r[w].rc != STRATA_EEXIST &&
                     r[w].rc != STRATA_ENOENT) /* its metadata.bin.tmp removed by the other */
                fail_msg("%s: saver %d: %s: %s", ck, w, strata_error_name(r[w].rc), r[w].msg);
            raced += r[w].rc == STRATA_EEXIST && strstr(r[w].msg, "appeared meanwhile");
        }
        if (wins > 1)
            fail_msg("%s: both savers committed", ck);
        wins_total += wins;
        strata_ckpt *c;
        int orc = strata_ckpt_open(&c, plain, 0);
        if (orc == 0)
            strata_ckpt_free(c);
        if (!wins && orc == 0)
            fail_msg("%s: committed, though no saver succeeded", plain);
        /* without exclusion the loser's cleanup may remove the winner's files before its
         * commit, as on a file system whose locks do not exclude (FORMAT.md, Ownership) */
        broken += wins && orc != 0;
    }
    print_message("commits racing without exclusion: %d trials, %d committed, %d decided by "
                  "the conditional PUT of metadata.bin / COMMIT, %d committed but broken by "
                  "the loser's cleanup\n", n, wins_total, raced, broken);
}

static void test_gc_beside_saves(void **st)
{
    (void)st;
    char dir[700];
    snprintf(dir, sizeof dir, "%s/gc", base);
    pid_t gc = fork();
    assert_true(gc >= 0);
    if (gc == 0) { /* a collector in a loop: it must never break a save */
        for (;;) {
            strata_retain(NULL, dir, 100);
            usleep(1000);
        }
    }
    int n = trials(20) / 2 + 1;
    for (int i = 0; i < n; i++) {
        char ck[800];
        snprintf(ck, sizeof ck, "%s/step-%d", dir, i);
        int rc = save_state(ck, 2, 400, i % 2, 0);
        if (rc)
            fail_msg("save %s beside gc: %s: %s", ck, strata_error_name(rc), strata_error_last());
        assert_int_equal(load_check(ck, 2, 400), 0);
    }
    kill(gc, SIGKILL);
    waitpid(gc, NULL, 0);
    print_message("saves beside gc: %d committed and loaded\n", n);
}

static void test_killed_save(void **st)
{
    (void)st;
    char dir[700], ck[800];
    snprintf(dir, sizeof dir, "%s/killed", base);
    snprintf(ck, sizeof ck, "%s/step-1", dir);
    int left = 0, n = trials(4) / 2 + 1;
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        assert_true(p >= 0);
        if (p == 0)
            _exit(save_state(ck, 2, 20000, i % 2, 0) ? 1 : 0); /* 120 MB */
        for (int k = 0; k < 2000 && objects_under(ck) <= 0; k++) /* its LOCK is there */
            usleep(5000);
        usleep(100000 * (useconds_t)i);
        kill(p, SIGKILL);
        int ws;
        waitpid(p, &ws, 0);
        if (WIFEXITED(ws)) /* finished before the kill: start again */
            fail_msg("the save finished before it was killed (exit %d)", WEXITSTATUS(ws));
        strata_ckpt *c;
        int rc = strata_ckpt_open(&c, ck, 0);
        assert_true(rc == STRATA_EINCOMPLETE || rc == STRATA_ENOENT);
        left += uploads_under(ck);
        /* its lease holds the prefix for a while: gc leaves it, then takes it */
        assert_int_equal(strata_remove_incomplete(ck), STRATA_EBUSY);
        sleep(3);
        int removed = -1;
        assert_int_equal(strata_retain(&removed, dir, 1), 0);
        assert_int_equal(objects_under(ck), 0);
        assert_int_equal(uploads_under(ck), 0);
    }
    print_message("killed saves: %d, %d multipart uploads left by them aborted by gc\n", n, left);
}

static void test_fault_wrapper(void **st)
{
    (void)st;
    assert_int_equal(st_vfs_fault_register(), 0);
    static const char *const faults[] = {"op=write&n=4&errno=EIO", "op=fsync&n=2&errno=EIO",
                                         "op=rename&n=2&errno=EIO", "op=open&n=2&errno=EIO"};
    for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) {
        char ck[900], plain[800];
        snprintf(plain, sizeof plain, "%s/fault-%zu", base, i);
        snprintf(ck, sizeof ck, "fault+%s?%s", plain, faults[i]);
        int rc = save_state(ck, 2, 3000, 0, 0);
        if (rc != STRATA_EIO)
            fail_msg("%s: %s, want STRATA_EIO: %s", ck, strata_error_name(rc), strata_error_last());
        assert_int_equal(objects_under(plain), 0); /* nothing left, not even its LOCK */
        assert_int_equal(uploads_under(plain), 0);
        assert_int_equal(save_state(plain, 2, 3000, 0, 0), 0); /* the prefix is free again */
        assert_int_equal(load_check(plain, 2, 3000), 0);
    }
}

static void test_bad_bucket_and_credentials(void **st)
{
    (void)st;
    const char *ck = "s3://no-such-bucket-strata/x";
    int rc = strata_probe(&(strata_probe_info){0}, ck);
    assert_int_equal(rc, STRATA_ENOENT);
    assert_non_null(strstr(strata_error_last(), "no-such-bucket-strata"));
    const char *denied = getenv("STRATA_TEST_S3_DENIED");
    if (!denied)
        return;
    char *was = strdup(getenv("AWS_ENDPOINT_URL"));
    setenv("AWS_ENDPOINT_URL", denied, 1);
    char ck2[700];
    snprintf(ck2, sizeof ck2, "%s/denied", base);
    rc = save_state(ck2, 1, 10, 0, 0);
    setenv("AWS_ENDPOINT_URL", was, 1);
    free(was);
    assert_int_equal(rc, STRATA_EIO);
    print_message("wrong credentials: %s\n", strata_error_last());
    assert_non_null(strstr(strata_error_last(), bucket));
    assert_non_null(strstr(strata_error_last(), "access denied"));
}

/* strata_copy from disk to S3 and to disk, in blocks smaller and larger than the checksum
 * chunks, several threads a file: loads bitwise; a committed destination refused; an
 * incomplete source refused; a corrupt byte refused naming the tensor, leaving no object
 * and no upload at the destination. */
static void test_copy(void **st)
{
    (void)st;
    char dir[600], src[700], disk[700], s3[700], bad[700], p[800];
    tu_tmpdir(dir, sizeof dir, "s3copy");
    snprintf(src, sizeof src, "%s/src", dir);
    snprintf(disk, sizeof disk, "%s/copy", dir);
    snprintf(s3, sizeof s3, "%s/copied", base);
    snprintf(bad, sizeof bad, "%s/copied-bad", base);
    assert_int_equal(save_state(src, 3, 3001, 0, 0), 0);
    uint64_t was = st_copy_block;
    st_copy_block = 3u << 20; /* 4 MiB chunks: blocks end before a chunk, or at its end */
    strata_stats stats = STRATA_STATS_INIT;
    assert_int_equal(strata_copy(&stats, src, s3, 0), 0);
    assert_true(stats.bytes > 3001ull * 1500 * 4);
    assert_int_equal(load_check(s3, 2, 3001), 0);
    assert_int_equal(strata_copy(NULL, src, disk, 0), 0);
    assert_int_equal(load_check(disk, 1, 3001), 0);
    assert_int_equal(strata_copy(NULL, src, s3, 0), STRATA_EEXIST);
    snprintf(p, sizeof p, "%s/COMMIT", disk);
    assert_int_equal(unlink(p), 0);
    assert_int_equal(strata_copy(NULL, disk, bad, 0), STRATA_EINCOMPLETE);
    snprintf(p, sizeof p, "%s/data-000001.bin", src);
    FILE *f = fopen(p, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, 5 << 20, SEEK_SET), 0);
    int c = fgetc(f);
    assert_int_equal(fseek(f, 5 << 20, SEEK_SET), 0);
    fputc(c ^ 0x10, f);
    fclose(f);
    assert_int_equal(strata_copy(NULL, src, bad, 0), STRATA_ECHECKSUM);
    print_message("corrupt source: %s\n", strata_error_last());
    assert_non_null(strstr(strata_error_last(), "'big'"));
    assert_non_null(strstr(strata_error_last(), "data-000001.bin"));
    assert_int_equal(objects_under(bad), 0);
    assert_int_equal(uploads_under(bad), 0);
    st_copy_block = was;
    tu_rmrf(dir);
}

static void *conn_churn(void *arg)
{
    const s3_cfg *cfg = arg;
    for (int i = 0; i < 200; i++) {
        s3_conn *c;
        int check;
        if (s3_conn_get(cfg, &c, &check))
            return (void *)1;
        if (check)
            s3_conn_checked(c);
        s3_resp r;
        s3_req q = {.method = "HEAD", .key = ""};
        int bad = i % 50 == 0 && (s3_do(c, &q, &r) || (s3_resp_free(&r), r.status != 200));
        s3_conn_put(c, 1);
        if (bad)
            return (void *)1;
    }
    return NULL;
}

/* One connection per configuration, shared by every resolve (reference-counted, kept a
 * while once unreferenced, so that probe after probe reuses it; its bucket HEADed once),
 * another for other credentials, none shared with a forked child; and many threads
 * taking and letting go of it at once (TSan). */
static void test_shared_connection(void **st)
{
    (void)st;
    s3_cfg cfg = {.retries = 3, .timeout_s = 30}, other;
    snprintf(cfg.bucket, sizeof cfg.bucket, "%s", bucket);
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "%s", getenv("AWS_ENDPOINT_URL"));
    snprintf(cfg.region, sizeof cfg.region, "us-east-1");
    snprintf(cfg.key_id, sizeof cfg.key_id, "%s", getenv("AWS_ACCESS_KEY_ID"));
    snprintf(cfg.secret, sizeof cfg.secret, "%s", getenv("AWS_SECRET_ACCESS_KEY"));
    other = cfg;
    snprintf(other.secret, sizeof other.secret, "another-secret");
    s3_conn *a, *b, *c, *d;
    int ca, cb, cc, cd;
    assert_int_equal(s3_conn_get(&cfg, &a, &ca), 0);
    assert_int_equal(s3_conn_get(&cfg, &b, &cb), 0);
    assert_ptr_equal(a, b);
    s3_conn_checked(a);
    assert_int_equal(s3_conn_get(&other, &c, &cc), 0);
    assert_ptr_not_equal(a, c);
    assert_int_equal(cc, 1);
    s3_conn_put(c, 0);
    s3_conn_put(b, 1);
    s3_conn_put(a, 1);
    assert_int_equal(s3_conn_get(&cfg, &d, &cd), 0); /* kept: no new handshake, no HEAD */
    assert_ptr_equal(d, a);
    assert_int_equal(cd, 0);
    pid_t pid = fork();
    if (pid == 0) {
        s3_conn *e;
        int ce;
        _exit(s3_conn_get(&cfg, &e, &ce) || e == d || ce != 1 ? 1 : 0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pthread_t th[8];
    for (int i = 0; i < 8; i++)
        assert_int_equal(pthread_create(&th[i], NULL, conn_churn, i % 2 ? &cfg : &other), 0);
    for (int i = 0; i < 8; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        assert_null(ret);
    }
    s3_conn_put(d, 1);
    /* through the backend: two resolves of one bucket share the connection, and the
     * second sends no HEAD; a probe after a probe works on the kept one */
    char ck[700];
    snprintf(ck, sizeof ck, "%s/shared", base);
    assert_int_equal(save_state(ck, 1, 10, 0, 0), 0);
    for (int i = 0; i < 3; i++) {
        strata_probe_info pi;
        assert_int_equal(strata_probe(&pi, ck), 0);
        assert_true(pi.committed);
    }
}

/* s3:// keys with dot or empty segments: S3 keeps "x/.." as a key of its own while HTTP
 * clients remove dot segments from a URL's path, so a save to ".../run/x/.." once wrote
 * its objects under "run" itself. Every such URI is refused (STRATA_EINVAL, saying why)
 * by save, probe, retention and copy, writing nothing; below the resolver the request
 * layer refuses such a key (-EINVAL, never sent). gc of the run keeps its checkpoint. */
static void test_dot_segments(void **st)
{
    (void)st;
    char run[700], good[800], bad[900];
    snprintf(run, sizeof run, "%s/dots", base);
    snprintf(good, sizeof good, "%s/step-1", run);
    assert_int_equal(save_state(good, 1, 10, 0, 0), 0);
    static const char *const tails[] = {"/x/..", "/x/../y", "/.", "/./y", "/x/.", "//y",
                                        "/x//y", "/..", "/../dots"};
    for (size_t i = 0; i < sizeof tails / sizeof tails[0]; i++) {
        snprintf(bad, sizeof bad, "%s%s", run, tails[i]);
        for (int async = 0; async < 2; async++) {
            int rc = save_state(bad, 1, 10, async, 0);
            if (rc != STRATA_EINVAL)
                fail_msg("save to %s: %s (%s), want STRATA_EINVAL", bad, strata_error_name(rc),
                         strata_error_last());
            assert_non_null(strstr(strata_error_last(), "segments"));
        }
        strata_probe_info pi;
        assert_int_equal(strata_probe(&pi, bad), STRATA_EINVAL);
        assert_int_equal(strata_copy(NULL, good, bad, 0), STRATA_EINVAL);
        int removed = -1;
        assert_int_equal(strata_retain(&removed, bad, 0), STRATA_EINVAL);
    }
    assert_int_equal(objects_under(run), 1); /* step-1 alone */
    int removed = -1;
    assert_int_equal(strata_retain(&removed, run, 1), 0);
    assert_int_equal(removed, 0);
    assert_int_equal(load_check(good, 1, 10), 0);
    /* the request layer: a key with a dot segment is never sent */
    s3_conn *c;
    int check;
    s3_cfg cfg = {.retries = 0, .timeout_s = 30};
    snprintf(cfg.bucket, sizeof cfg.bucket, "%s", bucket);
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "%s", getenv("AWS_ENDPOINT_URL"));
    snprintf(cfg.region, sizeof cfg.region, "us-east-1");
    snprintf(cfg.key_id, sizeof cfg.key_id, "%s", getenv("AWS_ACCESS_KEY_ID"));
    snprintf(cfg.secret, sizeof cfg.secret, "%s", getenv("AWS_SECRET_ACCESS_KEY"));
    assert_int_equal(s3_conn_get(&cfg, &c, &check), 0);
    const char *key = run + 5 + strlen(bucket) + 1; /* "<run>/dots" */
    static const char *const keys[] = {"%s/x/../step-1/COMMIT", "%s/./step-1/COMMIT",
                                       "%s//step-1/COMMIT", "%s/step-1/", "%s/step-1/.."};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        char k[900];
        snprintf(k, sizeof k, keys[i], key);
        s3_req rq = {.method = "HEAD", .key = k};
        s3_resp r;
        assert_int_equal(s3_do(c, &rq, &r), -EINVAL);
        s3_resp_free(&r);
    }
    char k[900];
    snprintf(k, sizeof k, "%s/step-1/COMMIT", key);
    s3_req rq = {.method = "HEAD", .key = k};
    s3_resp r;
    assert_int_equal(s3_do(c, &rq, &r), 0); /* the key itself: sent */
    assert_int_equal(r.status, 200);
    s3_resp_free(&r);
    s3_conn_put(c, 1);
}

int main(void)
{
    const char *b = getenv("STRATA_TEST_S3");
    if (!b || strncmp(b, "s3://", 5) != 0 || !getenv("AWS_ENDPOINT_URL")) {
        printf("test_s3: skipped (no STRATA_TEST_S3 server: run tests/s3_test.sh)\n");
        return 77;
    }
    snprintf(base, sizeof base, "%s", b);
    snprintf(bucket, sizeof bucket, "%.*s", (int)strcspn(b + 5, "/"), b + 5);
    setenv("STRATA_S3_PART_MB", "5", 0);
    setenv("STRATA_S3_LEASE_S", "2", 0);
    if (getenv("STRATA_S3_TEST_FILTER")) /* one test by name, e.g. test_killed_save */
        cmocka_set_test_filter(getenv("STRATA_S3_TEST_FILTER"));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_two_savers),
        cmocka_unit_test(test_commit_race),
        cmocka_unit_test(test_gc_beside_saves),
        cmocka_unit_test(test_killed_save),
        cmocka_unit_test(test_fault_wrapper),
        cmocka_unit_test(test_bad_bucket_and_credentials),
        cmocka_unit_test(test_shared_connection),
        cmocka_unit_test(test_copy),
        cmocka_unit_test(test_dot_segments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
