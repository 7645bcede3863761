/* test_async.c - strata_save_start on a saver in this process (ranks in process, a pool of
 * the caller's or the saver's own): the snapshot is taken before wait_snapshot returns
 * (poisoning the sources afterwards changes nothing), saves overlap on one pool, a pool
 * smaller than a shard works, errors travel on the handle. */
#include <dirent.h>
#include <sys/resource.h>
#include <sys/syscall.h>

#include "testutil.h"

static char base_dir[512];
TU_TMPDIR_GROUP(base_dir, "async")

static const uint64_t wshape[] = {301, 257}, zshape[] = {100003};

/* Two ranks: rows of an f32 matrix split, a bf16 vector flat-sharded, a global blob. */
static void state2(tu_set *s, int fill)
{
    tu_set_init(s, 2);
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r * 150, 0}, len[] = {r ? 151 : 150, 257};
        tu_set_shard(s, r, "w", STRATA_F32, 2, wshape, off, len, 0, 0, 0, fill);
        tu_set_shard(s, r, "z", STRATA_BF16, 1, zshape, NULL, NULL, 1, r ? 50001 : 0,
                     r ? 100003 : 50001, fill);
        tu_set_blob(s, r, "cfg", 0, -1, 77, fill);
    }
}

static void poison(tu_set *s)
{
    for (size_t i = 0; i < s->nsh; i++)
        if (s->sh[i].sh.data)
            memset(s->sh[i].sh.data, 0xff,
                   tu_shard_numel(&s->sh[i].sh) * strata_dtype_size(s->sh[i].sh.dtype));
    for (size_t i = 0; i < s->nbl; i++)
        memset(s->bl[i].data, 0xff, s->bl[i].size);
}

static void check_loads(const char *ck)
{
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&d, 0, "z", STRATA_BF16, 1, zshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_blob(&d, 0, "cfg", 0, -1, 77, 0);
    assert_ok(strata_load(NULL, NULL, &ck, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
}

static strata_save_opts opts(void)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.flags |= STRATA_SAVE_NO_SYNC;
    return o;
}

static void test_lazy_consistency(void **state)
{
    (void)state;
    for (int own_pool = 0; own_pool <= 1; own_pool++) {
        char ck[600];
        snprintf(ck, sizeof ck, "%s/lazy%d", base_dir, own_pool);
        tu_set s;
        state2(&s, 1);
        strata_pool *pool = NULL;
        if (!own_pool) /* far smaller than the state: back-pressure all the way */
            assert_ok(strata_pool_new(&pool, 64 << 10));
        strata_save_opts o = opts();
        strata_saver *sv; /* own_pool: NULL, the saver makes its own */
        assert_ok(strata_saver_new(&sv, NULL, pool));
        strata_handle *h;
        const char *u = ck;
        assert_ok(strata_save_start(&h, sv, &u, 1, s.st, 2, &o));
        assert_ok(strata_wait_snapshot(h));
        poison(&s); /* the optimizer step: the checkpoint must not see it */
        strata_stats st = STRATA_STATS_INIT;
        assert_ok(strata_wait_durable(&st, h));
        assert_int_equal(strata_handle_status(NULL, h), 0);
        assert_true(st.bytes > 0);
        strata_handle_free(h);
        strata_saver_free(sv);
        check_loads(ck);
        strata_pool_free(pool);
        tu_set_free(&s);
    }
}

static void test_overlapping_saves(void **state)
{
    (void)state;
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 96 << 10));
    tu_set a, b;
    state2(&a, 1);
    state2(&b, 1);
    char ca[600], cb[600];
    snprintf(ca, sizeof ca, "%s/overlap-a", base_dir);
    snprintf(cb, sizeof cb, "%s/overlap-b", base_dir);
    strata_save_opts o = opts();
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *ha, *hb;
    const char *ua = ca, *ub = cb;
    assert_ok(strata_save_start(&ha, sv, &ua, 1, a.st, 2, &o));
    assert_ok(strata_save_start(&hb, sv, &ub, 1, b.st, 2, &o)); /* while the first flushes */
    assert_ok(strata_wait_snapshot(ha));
    poison(&a);
    assert_ok(strata_wait_snapshot(hb));
    poison(&b);
    assert_ok(strata_wait_durable(NULL, hb));
    assert_ok(strata_wait_durable(NULL, ha));
    strata_handle_free(ha);
    strata_handle_free(hb);
    strata_saver_free(sv);
    check_loads(ca);
    check_loads(cb);
    assert_int_equal(strata_pool_bytes(pool), 96 << 10); /* never grown */
    strata_pool_free(pool);
    tu_set_free(&a);
    tu_set_free(&b);
}

static void test_errors(void **state)
{
    (void)state;
    tu_set s;
    state2(&s, 1);
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 8192)); /* two 4 KiB buffers */
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_save_opts o = opts();
    o.chunk_bytes = 1 << 16; /* larger than a pool buffer */
    strata_handle *h = NULL;
    char ck[700];
    snprintf(ck, sizeof ck, "%s/err", base_dir);
    const char *u = ck;
    assert_rc(strata_save_start(&h, sv, &u, 1, s.st, 2, &o), STRATA_EINVAL);
    assert_null(h);
    /* a write error is reported by the handle; nothing is committed */
    o = opts();
    char uri[900];
    snprintf(uri, sizeof uri, "fault+file://%s?op=write&n=3&errno=ENOSPC", ck);
    const char *fu = uri;
    assert_ok(strata_save_start(&h, sv, &fu, 1, s.st, 2, &o));
    strata_wait_snapshot(h);
    assert_rc(strata_wait_durable(NULL, h), STRATA_ENOSPC);
    assert_msg_has("data-00000");
    const char *msg;
    assert_int_equal(strata_handle_status(&msg, h), STRATA_ENOSPC);
    assert_non_null(strstr(msg, "No space"));
    strata_handle_free(h);
    strata_probe_info pi;
    if (strata_probe(&pi, ck) == 0)
        assert_false(pi.committed);
    /* the same save without the fault, through the same saver and pool */
    assert_ok(strata_save_start(&h, sv, &u, 1, s.st, 2, &o));
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    check_loads(ck);
    strata_saver_free(sv);
    strata_pool_free(pool);
    tu_set_free(&s);
}

static int load_tiers(const char *const *uris, int n, int *used)
{
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "w", STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&d, 0, "z", STRATA_BF16, 1, zshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_blob(&d, 0, "cfg", 0, -1, 77, 0);
    strata_stats st = STRATA_STATS_INIT;
    st.tier = -1;
    int rc = strata_load(&st, NULL, uris, n, d.st, 1, NULL);
    *used = st.tier;
    if (rc == 0 && tu_set_check(&d) != 0)
        rc = -1000;
    tu_set_free(&d);
    return rc;
}

static void test_tiers(void **state)
{
    (void)state;
    char memroot[600], local[600], shared[600], memdir[700], uri0[64], f[800];
    snprintf(memroot, sizeof memroot, "%s/shm", base_dir);
    setenv("STRATA_MEM_ROOT", memroot, 1); /* keep the test's memory tier in its tmp dir */
    snprintf(uri0, sizeof uri0, "mem://step-5");
    snprintf(local, sizeof local, "%s/local/step-5", base_dir);
    snprintf(shared, sizeof shared, "%s/shared/step-5", base_dir);
    snprintf(memdir, sizeof memdir, "%s/step-5", memroot);
    const char *uris[3] = {uri0, local, shared};
    tu_set s;
    state2(&s, 1);
    strata_save_opts o = opts();
    strata_saver *sv; /* its own pool, kept for the second save */
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    strata_handle *h;
    assert_ok(strata_save_start(&h, sv, uris, 3, s.st, 2, &o));
    assert_ok(strata_wait_snapshot(h));
    poison(&s);
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    for (int t = 0; t < 3; t++) { /* a commit record in every tier */
        strata_probe_info pi;
        assert_ok(strata_probe(&pi, uris[t]));
        assert_true(pi.committed);
    }
    int used = -1;
    assert_ok(load_tiers(uris, 3, &used));
    assert_int_equal(used, 0); /* the fastest tier */
    /* a bit flip in the memory copy: the load falls back to the local disk */
    tu_join(f, memdir, "data-000000.bin");
    tu_flip_byte(f, 100, 0x40);
    assert_ok(load_tiers(uris, 3, &used));
    assert_int_equal(used, 1);
    /* the memory copy gone and the local one incomplete: the shared copy */
    tu_rmrf(memdir);
    tu_join(f, local, "COMMIT");
    assert_int_equal(unlink(f), 0);
    assert_ok(load_tiers(uris, 3, &used));
    assert_int_equal(used, 2);
    /* none left: the error says why for each */
    tu_rmrf(shared);
    assert_rc(load_tiers(uris, 3, &used), STRATA_ENOENT);
    assert_msg_has("no copy could be loaded");
    assert_msg_has("mem://step-5");
    tu_set_free(&s);
    /* a failing tier is abandoned; the others still commit */
    state2(&s, 1);
    char bad[900];
    snprintf(bad, sizeof bad, "fault+file://%s/local/step-6?op=write&n=2&errno=EIO", base_dir);
    snprintf(local, sizeof local, "%s/local/step-6", base_dir);
    snprintf(shared, sizeof shared, "%s/shared/step-6", base_dir);
    const char *uris6[3] = {"mem://step-6", bad, shared};
    assert_ok(strata_save_start(&h, sv, uris6, 3, s.st, 2, &o));
    assert_rc(strata_wait_durable(NULL, h), STRATA_EIO);
    strata_handle_free(h);
    strata_saver_free(sv);
    strata_probe_info pi;
    assert_ok(strata_probe(&pi, "mem://step-6"));
    assert_true(pi.committed);
    assert_ok(strata_probe(&pi, shared));
    assert_true(pi.committed);
    assert_false(tu_exists(local)); /* the failed tier left nothing */
    const char *back[2] = {local, shared};
    assert_ok(load_tiers(back, 2, &used));
    assert_int_equal(used, 1);
    tu_set_free(&s);
    unsetenv("STRATA_MEM_ROOT");
}

/* The nice values of this process's threads other than the caller's (Linux /proc), into
 * seen[]; returns how many. */
static int thread_nices(long *seen, int cap)
{
    char self[32];
    snprintf(self, sizeof self, "%ld", (long)syscall(SYS_gettid));
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) && n < cap;) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, self) == 0)
            continue;
        char p[300], buf[1024];
        snprintf(p, sizeof p, "/proc/self/task/%s/stat", e->d_name);
        FILE *f = fopen(p, "r");
        if (!f)
            continue; /* the thread ended */
        size_t len = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[len] = 0;
        char *q = strrchr(buf, ')'); /* then state (field 3) ... nice (field 19) */
        int field = 2;
        for (char *t = q ? strtok(q + 1, " ") : NULL; t; t = strtok(NULL, " "))
            if (++field == 19) {
                seen[n++] = atol(t);
                break;
            }
    }
    if (d)
        closedir(d);
    return n;
}

/* The save's coordinator (and the snapshot's other copier) runs at the caller's nice +
 * bg_nice (7 here), its flushers at 19; the caller's own thread is untouched. */
static void test_background_nice(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/nice", base_dir);
    size_t n = (size_t)64 << 20;
    unsigned char *x = malloc(n);
    memset(x, 3, n);
    uint64_t shape[1] = {n};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    strata_shard sh = {.name = "x", .dtype = STRATA_U8, .ndim = 1, .global_shape = shape, .data = x};
    assert_ok(strata_state_add_shard(st, &sh));
    strata_pool *pool;
    assert_ok(strata_pool_new(&pool, 1 << 20)); /* a slow snapshot: back-pressure */
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.bg_nice = 7;
    o.chunk_bytes = 64 << 10;
    o.flags |= STRATA_SAVE_NO_SYNC;
    errno = 0;
    int base = getpriority(PRIO_PROCESS, 0);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, pool));
    strata_handle *h;
    const char *u = ck;
    assert_ok(strata_save_start(&h, sv, &u, 1, &st, 1, &o));
    int coord = 0, flushers = 0, bad = 0;
    long seen[64];
    /* every 1 ms for 200 ms (the save takes longer): nothing at any other value but base
     * (a thread not yet reniced; a flusher starts at the coordinator's value) */
    for (int sample = 0; sample < 200 && !bad; sample++) {
        int k = thread_nices(seen, 64), c = 0, f = 0;
        for (int i = 0; i < k; i++) {
            c += seen[i] == base + 7;
            f += seen[i] == 19;
            bad += seen[i] != base + 7 && seen[i] != 19 && seen[i] != base;
        }
        coord = ST_MAX(coord, c);
        flushers = ST_MAX(flushers, f);
        usleep(1000);
    }
    assert_ok(strata_wait_durable(NULL, h));
    strata_handle_free(h);
    strata_saver_free(sv);
    assert_int_equal(bad, 0);
    assert_true(coord >= 1); /* flushers too, for an instant: they inherit it, then drop */
    assert_true(flushers >= 1);
    assert_int_equal(getpriority(PRIO_PROCESS, 0), base);
    strata_pool_free(pool);
    strata_state_free(st);
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lazy_consistency),
        cmocka_unit_test(test_overlapping_saves),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_tiers),
        cmocka_unit_test(test_background_nice),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
