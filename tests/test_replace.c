/* test_replace.c - STRATA_SAVE_REPLACE: a committed checkpoint at a fixed path ("latest")
 * replaced atomically. The new one is written beside it and the two are exchanged after
 * its commit, so the path always holds a complete committed checkpoint: after every save
 * (synchronous, asynchronous, file:// and mem://), under SIGKILL at any instant (the
 * previous or the new one, never neither; what the killed save left beside it is removed
 * by retention), for a reader loading while saves replace it (a version whole, or an
 * error, never a mix), and on a file system that cannot exchange directories (refused
 * before anything is written). STRATA_REPLACE_TRIALS scales the kill trials. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "meta/meta.h"
#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "replace")

#define NEL 300007u /* odd: uneven chunks; 1.2 MB, several write tasks */

/* Version v's state: tensor "w" (u32, NEL elements, each a function of v and its index)
 * and a blob "version" holding v. */
typedef struct {
    strata_state *st;
    uint32_t *data;
    uint64_t shape[1], version;
} vstate;

static uint32_t elem(uint64_t v, uint64_t i) { return (uint32_t)st_mix64(v * 1000003u + i); }

static void vstate_make(vstate *s, uint64_t v, int fill)
{
    s->shape[0] = NEL;
    s->version = fill ? v : UINT64_MAX;
    s->data = malloc(NEL * sizeof *s->data);
    assert_non_null(s->data);
    for (uint64_t i = 0; i < NEL; i++)
        s->data[i] = fill ? elem(v, i) : 0xdeadbeef;
    assert_ok(strata_state_new(&s->st));
    strata_shard sh = {.name = "w", .dtype = STRATA_I32, .ndim = 1, .global_shape = s->shape,
                       .data = s->data};
    assert_ok(strata_state_add_shard(s->st, &sh));
    assert_ok(strata_state_add_blob(s->st, "version", 0, -1, &s->version, sizeof s->version));
}

static void vstate_free(vstate *s)
{
    strata_state_free(s->st);
    free(s->data);
}

static int save_v(const char *uri, uint64_t v, int async, unsigned flags)
{
    vstate s;
    vstate_make(&s, v, 1);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = flags;
    o.step = v;
    o.chunk_bytes = 65536;
    int rc;
    if (async) {
        strata_handle *h;
        rc = strata_save_start(&h, NULL, &uri, 1, &s.st, 1, &o);
        if (!rc) {
            strata_wait_snapshot(h);
            rc = strata_wait_durable(NULL, h);
            strata_handle_free(h);
        }
    } else {
        rc = strata_save(NULL, NULL, &uri, 1, &s.st, 1, &o);
    }
    vstate_free(&s);
    return rc;
}

/* Loads uri: 0 and *v the version it holds (checked element by element: one version
 * whole), or the load's error. */
static int load_v(const char *uri, uint64_t *v)
{
    vstate s;
    vstate_make(&s, 0, 0);
    int rc = strata_load(NULL, NULL, &uri, 1, &s.st, 1, NULL);
    if (rc == 0) {
        *v = s.version;
        for (uint64_t i = 0; i < NEL; i++)
            if (s.data[i] != elem(*v, i))
                fail_msg("%s: version %llu loaded, but element %llu is not its own", uri,
                         (unsigned long long)*v, (unsigned long long)i);
    }
    vstate_free(&s);
    return rc;
}

static uint64_t version_at(const char *uri)
{
    uint64_t v = 0;
    int rc = load_v(uri, &v);
    if (rc)
        fail_msg("%s does not load: %s: %s", uri, strata_error_name(rc), strata_error_last());
    return v;
}

static void sibling_of(char *out, size_t cap, const char *dir, const char *name)
{
    snprintf(out, cap, "%s/.%s%s", dir, name, STRATA_REPLACE_SUFFIX);
}

/* Nothing is left of the replace: no directory beside ck, no LOCK in it. */
static void expect_clean(const char *dir, const char *name)
{
    char sib[800], lock[800];
    sibling_of(sib, sizeof sib, dir, name);
    if (tu_exists(sib))
        fail_msg("'%s' is left", sib);
    snprintf(lock, sizeof lock, "%s/%s/%s", dir, name, ST_LOCK_FILE);
    if (tu_exists(lock))
        fail_msg("'%s' is left", lock);
}

static void test_replace_basic(void **state)
{
    (void)state;
    for (int mem = 0; mem < 2; mem++)
        for (int async = 0; async < 2; async++) {
            char dir[600], ck[700], uri[800], cp[800];
            if (mem) { /* the host-memory tier, in a private root of this test */
                snprintf(dir, sizeof dir, "%s/memroot/run", base_dir);
                snprintf(uri, sizeof uri, "mem://run/latest");
                char root[600];
                snprintf(root, sizeof root, "%s/memroot", base_dir);
                mkdir(root, 0700);
                setenv("STRATA_MEM_ROOT", root, 1);
            } else {
                snprintf(dir, sizeof dir, "%s/file-%d", base_dir, async);
                snprintf(uri, sizeof uri, "%s/latest", dir);
            }
            snprintf(ck, sizeof ck, "%s/latest", dir);
            unsigned R = STRATA_SAVE_REPLACE;
            /* a missing path: the new checkpoint arrives the same way */
            assert_ok(save_v(uri, 1, async, R));
            assert_int_equal(version_at(uri), 1);
            expect_clean(dir, "latest");
            /* without the flag a committed checkpoint is still never overwritten */
            assert_rc(save_v(uri, 2, async, 0), STRATA_EEXIST);
            assert_msg_has("STRATA_SAVE_REPLACE");
            assert_int_equal(version_at(uri), 1);
            for (uint64_t v = 2; v <= 4; v++) {
                assert_ok(save_v(uri, v, async, R | (v == 3 ? STRATA_SAVE_NO_SYNC : 0)));
                assert_int_equal(version_at(uri), v);
                expect_clean(dir, "latest");
            }
            /* an incomplete checkpoint at the path is replaced too */
            tu_join(cp, ck, ST_COMMIT_FILE);
            assert_int_equal(unlink(cp), 0);
            assert_ok(save_v(uri, 5, async, R));
            assert_int_equal(version_at(uri), 5);
            expect_clean(dir, "latest");
            strata_probe_info pi;
            assert_ok(strata_probe(&pi, uri));
            assert_int_equal(pi.committed, 1);
            assert_int_equal(pi.step, 5);
            tu_rmrf(dir);
            if (mem)
                unsetenv("STRATA_MEM_ROOT");
        }
}

/* A reader that opened the previous checkpoint's files keeps reading them. */
static void test_replace_open_files_stay(void **state)
{
    (void)state;
    char dir[600], ck[700], df[800];
    snprintf(dir, sizeof dir, "%s/open", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    assert_ok(save_v(ck, 1, 0, STRATA_SAVE_REPLACE));
    tu_join(df, ck, "data-000000.bin");
    size_t len;
    unsigned char *before = tu_read_file(df, &len);
    int fd = open(df, O_RDONLY);
    assert_true(fd >= 0);
    assert_ok(save_v(ck, 2, 0, STRATA_SAVE_REPLACE));
    assert_int_equal(version_at(ck), 2);
    unsigned char *after = malloc(len);
    assert_int_equal(pread(fd, after, len, 0), (ssize_t)len);
    assert_memory_equal(before, after, len);
    close(fd);
    free(before);
    free(after);
    tu_rmrf(dir);
}

/* A file system without RENAME_EXCHANGE (the fault wrapper fails it with EINVAL): refused
 * with STRATA_ENOTSUP before any data is written; the path keeps its checkpoint. */
static void test_replace_no_exchange(void **state)
{
    (void)state;
    char dir[600], ck[700], uri[900];
    snprintf(dir, sizeof dir, "%s/noexch", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    assert_ok(save_v(ck, 1, 0, 0));
    for (int async = 0; async < 2; async++) {
        snprintf(uri, sizeof uri, "fault+file://%s?op=exchange&n=1&errno=EINVAL&sticky=1", ck);
        assert_rc(save_v(uri, 2, async, STRATA_SAVE_REPLACE), STRATA_ENOTSUP);
        assert_msg_has("RENAME_EXCHANGE");
        assert_int_equal(version_at(ck), 1);
        expect_clean(dir, "latest");
        /* an exchange that fails later (EIO at the swap itself): the previous one stays */
        snprintf(uri, sizeof uri, "fault+file://%s?op=exchange&n=2&errno=EIO", ck);
        assert_rc(save_v(uri, 2, async, STRATA_SAVE_REPLACE), STRATA_EIO);
        assert_int_equal(version_at(ck), 1);
        expect_clean(dir, "latest");
    }
    tu_rmrf(dir);
}

/* The target and the directory beside it are owned: a live owner of either refuses the
 * replace (STRATA_EBUSY) and nothing changes. */
static void test_replace_owned(void **state)
{
    (void)state;
    char dir[600], ck[700], sib[800], lock[900];
    snprintf(dir, sizeof dir, "%s/owned", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    sibling_of(sib, sizeof sib, dir, "latest");
    assert_ok(save_v(ck, 1, 0, 0));
    assert_int_equal(mkdir(sib, 0755), 0);
    const char *held_dirs[2] = {ck, sib};
    for (int k = 0; k < 2; k++) {
        const st_vfs *v = &st_vfs_posix;
        st_file *held;
        tu_join(lock, held_dirs[k], ST_LOCK_FILE);
        assert_int_equal(v->lock(v, lock, &held), 0);
        for (int async = 0; async < 2; async++)
            assert_rc(save_v(ck, 2, async, STRATA_SAVE_REPLACE), STRATA_EBUSY);
        v->close(held);
        unlink(lock);
        assert_int_equal(version_at(ck), 1);
    }
    assert_ok(save_v(ck, 2, 1, STRATA_SAVE_REPLACE));
    assert_int_equal(version_at(ck), 2);
    expect_clean(dir, "latest");
    tu_rmrf(dir);
}

/* What a replace killed after its commit leaves beside the target - a committed
 * checkpoint - is never kept as one: retention and strata_remove_incomplete remove it,
 * and the next replace reclaims it. */
static void test_replace_leftovers(void **state)
{
    (void)state;
    char dir[600], ck[700], sib[800];
    snprintf(dir, sizeof dir, "%s/left", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    sibling_of(sib, sizeof sib, dir, "latest");
    assert_ok(save_v(ck, 1, 0, 0));
    assert_ok(save_v(sib, 9, 0, 0)); /* as a replace dead before its exchange leaves it */
    int removed = -1;
    assert_ok(strata_retain(&removed, dir, 1)); /* keeps 1: latest, not the leftover */
    assert_int_equal(removed, 1);
    assert_false(tu_exists(sib));
    assert_int_equal(version_at(ck), 1);
    assert_ok(save_v(sib, 9, 0, 0));
    assert_ok(strata_remove_incomplete(sib));
    assert_false(tu_exists(sib));
    assert_ok(save_v(sib, 9, 0, 0));
    assert_ok(save_v(ck, 2, 0, STRATA_SAVE_REPLACE));
    assert_int_equal(version_at(ck), 2);
    expect_clean(dir, "latest");
    tu_rmrf(dir);
}

/* SIGKILL at a random instant of a replacing save, over and over: the path always loads,
 * holding the last version acknowledged or the one being saved. */
static void test_replace_kill(void **state)
{
    (void)state;
    char dir[600], ck[700];
    snprintf(dir, sizeof dir, "%s/kill", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    assert_ok(save_v(ck, 1, 0, 0));
    uint64_t acked = 1;
    int trials = (int)tu_env_u64("STRATA_REPLACE_TRIALS", 12), newer = 0;
    tu_rng rng = {(uint64_t)getpid()};
    for (int i = 0; i < trials; i++) {
        int pfd[2];
        assert_int_equal(pipe(pfd), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(pfd[0]);
            for (uint64_t v = acked + 1;; v++) {
                if (save_v(ck, v, (int)(v % 2), STRATA_SAVE_REPLACE))
                    _exit(3);
                if (write(pfd[1], &v, sizeof v) != (ssize_t)sizeof v)
                    _exit(4);
            }
        }
        close(pfd[1]);
        usleep((useconds_t)tu_range(&rng, 0, 60000));
        kill(pid, SIGKILL);
        int status;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFSIGNALED(status))
            fail_msg("the saving child exited with %d", WEXITSTATUS(status));
        uint64_t v;
        while (read(pfd[0], &v, sizeof v) == (ssize_t)sizeof v)
            acked = v;
        close(pfd[0]);
        uint64_t at = version_at(ck);
        if (at != acked && at != acked + 1)
            fail_msg("trial %d: the path holds version %llu, the last acknowledged is %llu", i,
                     (unsigned long long)at, (unsigned long long)acked);
        newer += at == acked + 1; /* committed and swapped, killed before it said so */
        acked = at;
        strata_ckpt *c;
        assert_ok(strata_ckpt_open(&c, ck, 0));
        assert_ok(strata_ckpt_verify(c, NULL, NULL));
        strata_ckpt_free(c);
        int removed;
        assert_ok(strata_retain(&removed, dir, 1)); /* collects what the kill left */
        assert_int_equal(version_at(ck), at);
        char sib[800]; /* (a LOCK a dead owner left in the target is ignored by all) */
        sibling_of(sib, sizeof sib, dir, "latest");
        if (tu_exists(sib))
            fail_msg("trial %d: retention left '%s'", i, sib);
    }
    print_message("replace under SIGKILL: %d trials, the path always loaded (%d times the "
                  "version being saved), last version %llu\n", trials, newer,
                  (unsigned long long)acked);
    tu_rmrf(dir);
}

/* A reader loading in a loop while saves replace the checkpoint: every load gets one
 * version whole, or fails with an error (it read metadata of one and data of the next),
 * never a mix. */
typedef struct {
    const char *ck;
    atomic_int stop;
    int ok, failed;
} reader_ctx;

static void *reader(void *p)
{
    reader_ctx *r = p;
    while (!atomic_load(&r->stop)) {
        uint64_t v;
        int rc = load_v(r->ck, &v); /* a mix fails the test inside */
        if (rc == 0)
            r->ok++;
        else if (rc == STRATA_ECHECKSUM || rc == STRATA_EFORMAT || rc == STRATA_ENOENT ||
                 rc == STRATA_EINCOMPLETE || rc == STRATA_EIO)
            r->failed++;
        else
            fail_msg("load during replaces: %s: %s", strata_error_name(rc), strata_error_last());
    }
    return NULL;
}

static void test_replace_beside_reader(void **state)
{
    (void)state;
    char dir[600], ck[700];
    snprintf(dir, sizeof dir, "%s/reader", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    assert_ok(save_v(ck, 1, 0, 0));
    reader_ctx r = {.ck = ck};
    atomic_init(&r.stop, 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, reader, &r), 0);
    for (uint64_t v = 2; v < 22; v++)
        assert_ok(save_v(ck, v, (int)(v % 2), STRATA_SAVE_REPLACE | STRATA_SAVE_NO_SYNC));
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    assert_int_equal(version_at(ck), 21);
    print_message("loads beside 20 replaces: %d whole, %d refused, none mixed\n", r.ok, r.failed);
    tu_rmrf(dir);
}


/* A collector (retention keeping 1) loops beside replacing saves: each save commits or is
 * refused (STRATA_EBUSY: the collector held a directory), and the path always loads the
 * last committed version; the collector never takes what a live replace owns. */
static void test_replace_beside_gc(void **state)
{
    (void)state;
    char dir[600], ck[700];
    snprintf(dir, sizeof dir, "%s/gc", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    assert_ok(save_v(ck, 1, 0, 0));
    pid_t gc = tu_collector(dir, 1);
    uint64_t last = 1;
    int ok = 0, busy = 0;
    for (uint64_t v = 2; v < 32; v++) {
        int rc = save_v(ck, v, (int)(v % 2), STRATA_SAVE_REPLACE | STRATA_SAVE_NO_SYNC);
        if (rc == STRATA_EBUSY) {
            busy++;
        } else if (rc) {
            fail_msg("replace %llu beside gc: %s: %s", (unsigned long long)v,
                     strata_error_name(rc), strata_error_last());
        } else {
            ok++;
            last = v;
        }
        assert_int_equal(version_at(ck), last);
    }
    tu_collector_stop(gc);
    print_message("replaces beside gc: %d committed, %d refused (busy), the path always "
                  "loaded\n", ok, busy);
    tu_rmrf(dir);
}

/* A link planted at the name a replace writes beside its target (".latest.strata-replace"
 * pointing at another committed checkpoint K) is never followed: the replace is refused
 * (STRATA_EINVAL, naming the link), K keeps its commit record and gets no LOCK, the link
 * stays for a person to see, and retention afterwards keeps K. */
static void test_replace_planted_link(void **state)
{
    (void)state;
    char dir[600], ck[700], k[700], sib[800], lock[900];
    snprintf(dir, sizeof dir, "%s/planted", base_dir);
    snprintf(ck, sizeof ck, "%s/latest", dir);
    snprintf(k, sizeof k, "%s/K", dir);
    sibling_of(sib, sizeof sib, dir, "latest");
    assert_ok(save_v(k, 7, 0, 0));
    assert_ok(save_v(ck, 1, 0, 0));
    const char *targets[2] = {"K", k}; /* relative and absolute */
    for (int t = 0; t < 2; t++)
        for (int async = 0; async < 2; async++) {
            assert_int_equal(symlink(targets[t], sib), 0);
            assert_rc(save_v(ck, 2, async, STRATA_SAVE_REPLACE), STRATA_EINVAL);
            assert_msg_has("symlink");
            assert_msg_has(sib);
            struct stat sb;
            assert_int_equal(lstat(sib, &sb), 0);
            assert_true(S_ISLNK(sb.st_mode));
            strata_probe_info pi;
            assert_ok(strata_probe(&pi, k));
            assert_int_equal(pi.committed, 1);
            assert_int_equal(version_at(k), 7);
            tu_join(lock, k, ST_LOCK_FILE);
            assert_false(tu_exists(lock));
            assert_int_equal(version_at(ck), 1);
            tu_join(lock, ck, ST_LOCK_FILE);
            assert_false(tu_exists(lock));
            unlink(sib);
        }
    /* a link to a directory that is not a checkpoint: the same */
    char other[700];
    snprintf(other, sizeof other, "%s/other", dir);
    assert_int_equal(mkdir(other, 0755), 0);
    assert_int_equal(symlink(other, sib), 0);
    assert_rc(save_v(ck, 2, 0, STRATA_SAVE_REPLACE), STRATA_EINVAL);
    tu_join(lock, other, ST_LOCK_FILE);
    assert_false(tu_exists(lock));
    int removed = -1;
    assert_ok(strata_retain(&removed, dir, 2)); /* keeps latest and K */
    assert_int_equal(version_at(k), 7);
    unlink(sib);
    assert_ok(save_v(ck, 2, 0, STRATA_SAVE_REPLACE)); /* the link gone: replaced */
    assert_int_equal(version_at(ck), 2);
    assert_int_equal(version_at(k), 7);
    expect_clean(dir, "latest");
    tu_rmrf(dir);
}

/* Refuses a replace of path (STRATA_ENOTCKPT with want in the message), touching nothing:
 * no directory beside it, no LOCK in it. */
static void refused_not_ckpt(const char *dir, const char *name, const char *want)
{
    char p[700], lock[800], sib[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    for (int async = 0; async < 2; async++) {
        assert_rc(save_v(p, 2, async, STRATA_SAVE_REPLACE), STRATA_ENOTCKPT);
        assert_msg_has(p);
        assert_msg_has(want);
        tu_join(lock, p, ST_LOCK_FILE);
        assert_false(tu_exists(lock));
        sibling_of(sib, sizeof sib, dir, name);
        assert_false(tu_exists(sib));
    }
}

/* A replace takes only what a plain save refuses for being a committed checkpoint (and
 * what it accepts: nothing, an empty directory, an incomplete checkpoint): a directory of
 * user files, a run directory of step-N checkpoints, a checkpoint with a file of the
 * user's in it, a file and a symlink are refused with STRATA_ENOTCKPT naming what is
 * there, and stay as they were. */
static void test_replace_not_ckpt(void **state)
{
    (void)state;
    char dir[600], p[800], q[900];
    snprintf(dir, sizeof dir, "%s/notckpt", base_dir);
    assert_int_equal(mkdir(dir, 0755), 0);
    /* user files */
    snprintf(p, sizeof p, "%s/user", dir);
    assert_int_equal(mkdir(p, 0755), 0);
    tu_join(q, p, "notes.txt");
    tu_write_file(q, "mine", 4);
    refused_not_ckpt(dir, "user", "not a checkpoint");
    assert_true(tu_exists(q));
    /* a run directory of checkpoints */
    snprintf(p, sizeof p, "%s/run", dir);
    for (int s = 1; s <= 2; s++) {
        snprintf(q, sizeof q, "%s/step-%d", p, s);
        assert_ok(save_v(q, (uint64_t)s, 0, 0));
    }
    refused_not_ckpt(dir, "run", "directory of checkpoints");
    for (int s = 1; s <= 2; s++) {
        snprintf(q, sizeof q, "%s/step-%d", p, s);
        assert_int_equal(version_at(q), (uint64_t)s);
    }
    /* a committed checkpoint holding a file of the user's */
    snprintf(p, sizeof p, "%s/mixed", dir);
    assert_ok(save_v(p, 1, 0, 0));
    tu_join(q, p, "README");
    tu_write_file(q, "mine", 4);
    refused_not_ckpt(dir, "mixed", "README");
    assert_int_equal(version_at(p), 1);
    /* a file, a symlink to a checkpoint */
    snprintf(p, sizeof p, "%s/file", dir);
    tu_write_file(p, "mine", 4);
    refused_not_ckpt(dir, "file", "not a directory");
    snprintf(p, sizeof p, "%s/link", dir);
    assert_int_equal(symlink("mixed", p), 0);
    refused_not_ckpt(dir, "link", "symlink");
    /* what a plain save accepts is replaced: an empty directory */
    snprintf(p, sizeof p, "%s/empty", dir);
    assert_int_equal(mkdir(p, 0755), 0);
    assert_ok(save_v(p, 3, 0, STRATA_SAVE_REPLACE));
    assert_int_equal(version_at(p), 3);
    expect_clean(dir, "empty");
    tu_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_replace_basic),
        cmocka_unit_test(test_replace_open_files_stay),
        cmocka_unit_test(test_replace_no_exchange),
        cmocka_unit_test(test_replace_owned),
        cmocka_unit_test(test_replace_leftovers),
        cmocka_unit_test(test_replace_kill),
        cmocka_unit_test(test_replace_beside_reader),
        cmocka_unit_test(test_replace_beside_gc),
        cmocka_unit_test(test_replace_planted_link),
        cmocka_unit_test(test_replace_not_ckpt),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
