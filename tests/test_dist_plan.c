/* test_dist_plan.c - the save plan stored with a checkpoint (plan.bin) and a restarted job
 * that reuses it (strata_saver_reuse_plan): no planning collective when every rank's layout
 * is the one saved (the collectives counted through the communicator), a plan made afresh
 * when a layout changed underneath, a corrupt or foreign plan.bin, ranks holding different
 * stored plans; and copies marked STRATA_SHARD_REPLICA sent to the coordinator as refs. The
 * ranks are threads (tests/distutil.h); every checkpoint is loaded back bitwise. */
#include "distutil.h"
#include "meta/planfile.h"

typedef struct {
    unsigned long calls[3];
    unsigned long long moved;
} counts;

static counts count_of(const world *w)
{
    counts c;
    memcpy(c.calls, w->h.calls, sizeof c.calls);
    c.moved = w->h.moved;
    return c;
}

static counts minus(counts a, counts b)
{
    for (int i = 0; i < 3; i++)
        a.calls[i] -= b.calls[i];
    a.moved -= b.moved;
    return a;
}

static unsigned long total(counts c) { return c.calls[0] + c.calls[1] + c.calls[2]; }

/* One synchronous save of set on every rank of w to ck; the collectives it made; every
 * rank's plan_cached must be `cached`. */
static counts save_all(world *w, tu_set *set, const char *ck, int cached)
{
    int n = w->h.size;
    job *jobs = calloc((size_t)n, sizeof *jobs);
    counts before = count_of(w);
    run_all(w, 1, ck, NULL, set, jobs);
    counts c = minus(count_of(w), before);
    expect_all_ok(jobs, n);
    for (int r = 0; r < n; r++)
        if (jobs[r].stats.plan_cached != cached)
            fail_msg("rank %d: plan_cached %d, want %d", r, jobs[r].stats.plan_cached, cached);
    free(jobs);
    print_message("%s: allgather %lu alltoallv %lu bcast %lu, %llu bytes to rank 0\n", ck,
                  c.calls[0], c.calls[1], c.calls[2], c.moved);
    return c;
}

/* A new job of n ranks (new communicators and savers) on every rank of which
 * strata_saver_reuse_plan(ck) returns want (-1: don't call it). */
static void restart(world *w, int n, const char *ck, int want)
{
    world_init(w, n);
    for (int r = 0; want != -1 && r < n; r++)
        assert_rc(strata_saver_reuse_plan(w->sv[r], ck), want);
}

static void path_of(char *out, size_t cap, const char *tag)
{
    snprintf(out, cap, "%s/%s", base, tag);
}

/* The same layout, restarted: the stored plan is used and the save makes the collectives
 * of a save whose plan was cached in memory, fewer than one that plans; then a layout that
 * changed underneath (an extra tensor on one rank, a mark, a flat range): found, planned
 * afresh. Every checkpoint loads bitwise. */
static void test_restart(void **state)
{
    (void)state;
    char a[600], a2[600], b[600], c[600], f[700];
    path_of(a, sizeof a, "plan-a");
    path_of(a2, sizeof a2, "plan-a2");
    path_of(b, sizeof b, "plan-b");
    world w;
    tu_set s;
    world_init(&w, 4);
    layout(&s, 2, 2, 1);
    counts fresh = save_all(&w, &s, a, 0), cached = save_all(&w, &s, a2, 1);
    world_free(&w);
    tu_join(f, a, ST_PLAN_FILE);
    assert_true(tu_exists(f));
    assert_true(total(cached) < total(fresh));

    restart(&w, 4, a, 0);
    counts again = save_all(&w, &s, b, 1);
    assert_memory_equal(again.calls, cached.calls, sizeof again.calls);
    assert_int_equal(again.moved, cached.moved);
    world_free(&w);
    expect_loads(b);
    /* the stored plan under an incremental save (second checksums, metadata version 2) */
    char bi[600];
    path_of(bi, sizeof bi, "plan-b-incr");
    restart(&w, 4, a, 0);
    more_flags = STRATA_SAVE_INCREMENTAL;
    save_all(&w, &s, bi, 1);
    more_flags = 0;
    world_free(&w);
    expect_loads(bi);
    /* and read back from that version 2 checkpoint for a full save */
    path_of(bi, sizeof bi, "plan-b-full");
    restart(&w, 4, b, 0);
    save_all(&w, &s, bi, 1);
    world_free(&w);
    path_of(c, sizeof c, "plan-b-incr");
    restart(&w, 4, c, 0);
    path_of(bi, sizeof bi, "plan-b-full2");
    save_all(&w, &s, bi, 1);
    world_free(&w);
    expect_loads(bi);
    tu_set_free(&s);

    /* changed underneath: rank 2 saves an extra tensor */
    restart(&w, 4, b, 0);
    layout(&s, 2, 2, 1);
    uint64_t xs[] = {5};
    tu_set_shard(&s, 2, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 1);
    path_of(c, sizeof c, "plan-changed");
    counts changed = save_all(&w, &s, c, 0);
    assert_memory_equal(changed.calls, fresh.calls, sizeof changed.calls);
    world_free(&w);
    tu_set d;
    layout(&d, 1, 1, 0);
    tu_set_shard(&d, 0, "extra", STRATA_I32, 1, xs, NULL, NULL, 0, 0, 0, 0);
    const char *u = c;
    assert_ok(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&s);

    /* changed underneath: the same boxes, one of them now marked a copy */
    restart(&w, 4, b, 0);
    tu_set_init(&s, 4);
    static const uint64_t ws[] = {37, 23};
    for (int r = 0; r < 4; r++) {
        uint64_t off[] = {r % 2 ? 18 : 0, 0}, len[] = {r % 2 ? 19 : 18, 23};
        tu_set_shard_flags(&s, r, "w", STRATA_F32, 2, ws, off, len, 0, 0, 0, 1,
                           r >= 2 ? STRATA_SHARD_REPLICA : 0);
    }
    path_of(c, sizeof c, "plan-marked");
    save_all(&w, &s, c, 0);
    world_free(&w);
    tu_set_free(&s);
}

/* A plan.bin that is not to be trusted: one rank's part corrupt (that rank refuses it, the
 * save plans afresh), another save's plan.bin (rank 0 refuses it), ranks holding stored
 * plans of two saves (the agreement finds the ids differ), another world size, none. */
static void test_untrusted(void **state)
{
    (void)state;
    char d[600], e[600], x[600], f[700], g[700];
    path_of(d, sizeof d, "untrusted-d");
    path_of(e, sizeof e, "untrusted-e");
    world w;
    tu_set s;
    world_init(&w, 4);
    layout(&s, 2, 2, 1);
    save_all(&w, &s, d, 0);
    save_all(&w, &s, e, 1);
    world_free(&w);

    /* two stored plans of the same layout: ranks 0, 1 take d's, ranks 2, 3 e's */
    world_init(&w, 4);
    for (int r = 0; r < 4; r++)
        assert_ok(strata_saver_reuse_plan(w.sv[r], r < 2 ? d : e));
    path_of(x, sizeof x, "untrusted-mixed");
    save_all(&w, &s, x, 0);
    world_free(&w);
    expect_loads(x);

    /* rank 3's part corrupt (the last bytes of the file: its checksum): rank 3 refuses it,
     * and so does rank 0, which reads every part */
    tu_join(f, d, ST_PLAN_FILE);
    size_t len;
    unsigned char *keep = tu_read_file(f, &len);
    tu_flip_byte(f, len - 3, 0x10);
    world_init(&w, 4);
    for (int r = 3; r >= 0; r--) {
        assert_rc(strata_saver_reuse_plan(w.sv[r], d), r == 3 || r == 0 ? STRATA_EFORMAT : 0);
        if (r == 3 || r == 0)
            assert_msg_has("rank 3");
    }
    path_of(x, sizeof x, "untrusted-corrupt");
    save_all(&w, &s, x, 0);
    world_free(&w);
    expect_loads(x);
    tu_write_file(f, keep, len);

    /* e's plan.bin in d: every part is good, but not the plan of d's commit */
    tu_join(g, e, ST_PLAN_FILE);
    size_t elen;
    unsigned char *eb = tu_read_file(g, &elen);
    tu_write_file(f, eb, elen);
    world_init(&w, 4);
    for (int r = 0; r < 4; r++)
        assert_rc(strata_saver_reuse_plan(w.sv[r], d), r == 0 ? STRATA_EFORMAT : 0);
    path_of(x, sizeof x, "untrusted-foreign");
    save_all(&w, &s, x, 0);
    world_free(&w);
    expect_loads(x);
    tu_write_file(f, keep, len);
    free(eb);
    free(keep);

    /* another world size; no plan.bin; no communicator */
    world_init(&w, 2);
    for (int r = 0; r < 2; r++)
        assert_rc(strata_saver_reuse_plan(w.sv[r], d), STRATA_EMISMATCH);
    world_free(&w);
    const char *u = x;
    tu_set one;
    layout(&one, 1, 1, 1);
    path_of(x, sizeof x, "untrusted-inproc");
    assert_ok(strata_save(NULL, NULL, &u, 1, one.st, 1, NULL));
    world_init(&w, 1);
    assert_rc(strata_saver_reuse_plan(w.sv[0], x), STRATA_ENOENT);
    world_free(&w);
    strata_saver *sv;
    assert_ok(strata_saver_new(&sv, NULL, NULL));
    assert_rc(strata_saver_reuse_plan(sv, d), STRATA_EINVAL);
    strata_saver_free(sv);
    tu_set_free(&one);
    tu_set_free(&s);
}

/* Copies marked STRATA_SHARD_REPLICA reach the coordinator as refs: the same state, marked,
 * moves fewer bytes to rank 0 when planned, and loads bitwise. */
static void test_marked_copies(void **state)
{
    (void)state;
    enum { TP = 2, DP = 4, P = TP * DP };
    static const char *const names[] = {"model.layers.0.attention.query_key_value.weight",
                                        "model.layers.0.mlp.dense_h_to_4h.weight",
                                        "model.layers.0.input_layernorm.weight"};
    static const uint64_t shape[] = {64, 48};
    counts plain, marked;
    for (int mark = 0; mark < 2; mark++) {
        tu_set s;
        tu_set_init(&s, P);
        for (int r = 0; r < P; r++)
            for (int k = 0; k < 3; k++) {
                int split = k < 2, t = r % TP, dp = r / TP;
                uint64_t off[] = {split ? (uint64_t)t * 32 : 0, 0}, len[] = {split ? 32 : 64, 48};
                unsigned copy = mark && (dp != 0 || (!split && t != 0)) ? STRATA_SHARD_REPLICA : 0;
                tu_set_shard_flags(&s, r, names[k], STRATA_BF16, 2, shape, off, len, 0, 0, 0, 1,
                                   copy);
            }
        world w;
        world_init(&w, P);
        char ck[600];
        path_of(ck, sizeof ck, mark ? "copies-marked" : "copies-plain");
        counts c = save_all(&w, &s, ck, 0);
        if (mark)
            marked = c;
        else
            plain = c;
        world_free(&w);
        tu_set d;
        tu_set_init(&d, 1);
        for (int k = 0; k < 3; k++)
            tu_set_shard(&d, 0, names[k], STRATA_BF16, 2, shape, NULL, NULL, 0, 0, 0, 0);
        const char *u = ck;
        assert_ok(strata_load(NULL, NULL, &u, 1, d.st, 1, NULL));
        assert_int_equal(tu_set_check(&d), 0);
        tu_set_free(&d);
        tu_set_free(&s);
    }
    assert_memory_equal(marked.calls, plain.calls, sizeof plain.calls);
    assert_true(marked.moved < plain.moved);
}

TU_TMPDIR_GROUP(base, "distplan")

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restart),
        cmocka_unit_test(test_untrusted),
        cmocka_unit_test(test_marked_copies),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
