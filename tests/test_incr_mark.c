/* test_incr_mark.c - STRATA_SHARD_UNCHANGED, the caller's mark that a shard equals its
 * base's: where the base holds the shard its bytes are not read at all (PROT_NONE pages
 * saved by reference, sync and async), and a broken promise is saved as the base's bytes;
 * where the base holds no matching shard (six kinds) the mark is ignored and the changed
 * bytes written; replicas marked on one rank only are written; a base shard without
 * second checksums is referred by mark alone. */
#include <sys/mman.h>

#include "meta/meta.h"
#include "testutil.h"

static char tmp[512];
TU_TMPDIR_GROUP(tmp, "incrmark")

#include "incr_lora.h"

/* STRATA_SHARD_UNCHANGED where the base holds the shard: its bytes are not read at all. The
 * frozen weight lives in pages made PROT_NONE after the first save (a read would be a
 * SIGSEGV); sync and async saves on top refer to the base, write only the rest, and load
 * bitwise. Then a broken promise: the marked bytes change, and the save holds the base's
 * (the mark is trusted, never checked - which is what it is for). */
static void mark_unread(void **state)
{
    (void)state;
    char dir[600], p[3][700];
    snprintf(dir, sizeof dir, "%s/mark", tmp);
    tu_rmrf(dir);
    size_t len = ST_ALIGN_UP(tbytes(0), 4096);
    float *w = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(w != MAP_FAILED);
    lora s;
    lora_init_ex(&s, 21, STRATA_SHARD_UNCHANGED, w);
    for (int k = 0; k < 3; k++)
        snprintf(p[k], sizeof p[k], "%s/s%d", dir, k);
    assert_ok(save(p[0], &s, 0, NULL, 0, NULL)); /* no base: the mark is ignored, read */
    snap base;
    snap_take(&base, &s);
    assert_int_equal(mprotect(w, len, PROT_NONE), 0);
    for (int k = 1; k < 3; k++) {
        lora_step(&s, k, 1);
        strata_stats st = STRATA_STATS_INIT;
        char b[8];
        snprintf(b, sizeof b, "s%d", k - 1);
        assert_ok(save(p[k], &s, k, b, k == 2, &st)); /* s1 sync, s2 async */
        assert_int_equal(st.bytes, st.data_bytes - tbytes(0));
        snap want;
        assert_int_equal(mprotect(w, len, PROT_READ), 0); /* for the test's own reads */
        snap_take(&want, &s);
        load_same(p[k], &want);
        assert_int_equal(mprotect(w, len, PROT_NONE), 0);
        verify_ok(p[k]);
        snap_free(&want);
    }
    /* the promise broken: marked bytes changed since the base, saved as the base's */
    assert_int_equal(mprotect(w, len, PROT_READ | PROT_WRITE), 0);
    w[7] += 1.0f;
    tu_rmrf(p[0]);
    assert_ok(save(p[0], &s, 3, "s2", 0, NULL));
    snap got;
    snap_take(&got, &s);
    memcpy(got.t[0], base.t[0], tbytes(0));
    load_same(p[0], &got);
    snap_free(&got);
    snap_free(&base);
    lora_free(&s);
    munmap(w, len);
    tu_rmrf(dir);
}

/* A save of s to path (chunk as given, flags as given: 0 = a version 1 checkpoint). */
static void save_as(const char *path, strata_state *st, uint32_t chunk, unsigned flags,
                    const char *base)
{
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = chunk;
    o.flags = flags | STRATA_SAVE_NO_SYNC;
    o.base = base;
    assert_ok(strata_save(NULL, NULL, (const char *[]){path}, 1, &st, 1, &o));
}

/* The mark where the base holds no matching shard: another chunk size, a base saved
 * without STRATA_SAVE_INCREMENTAL, another dtype, another shape, no such tensor, no base.
 * Every time the marked tensor's bytes differ from the base's, so trusting the mark would
 * load the base's values: each save must read and write them, and load the new ones. */
static void mark_falls_back(void **state)
{
    (void)state;
    char dir[600], b[700], p[700];
    snprintf(dir, sizeof dir, "%s/markfb", tmp);
    for (int c = 0; c < 6; c++) {
        tu_rmrf(dir);
        snprintf(b, sizeof b, "%s/base", dir);
        snprintf(p, sizeof p, "%s/new", dir);
        lora s;
        lora_init_ex(&s, 30 + (uint64_t)c, STRATA_SHARD_UNCHANGED, NULL);
        strata_state *other; /* the base's tensor 0 as another dtype / shape / name */
        assert_ok(strata_state_new(&other));
        uint64_t shape[2] = {rows[0], COLS}, shape2[2] = {rows[0] - 1, COLS};
        strata_shard sh = {.name = names[0], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = s.t[0]};
        if (c == 2)
            sh.dtype = STRATA_I32;
        else if (c == 3)
            sh.global_shape = shape2;
        else if (c == 4)
            sh.name = "base.other";
        assert_ok(strata_state_add_shard(other, &sh));
        for (int i = 1; i < NT; i++) {
            uint64_t sh2[2] = {rows[i], COLS};
            strata_shard a = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                              .global_shape = sh2, .data = s.t[i]};
            assert_ok(strata_state_add_shard(other, &a));
        }
        const char *base = c == 5 ? NULL : "base";
        if (c == 0)
            save_as(b, s.st, 2 * CHUNK, STRATA_SAVE_INCREMENTAL, NULL);
        else if (c == 1)
            save_as(b, s.st, CHUNK, 0, NULL);
        else if (c == 5)
            save_as(b, s.st, CHUNK, STRATA_SAVE_INCREMENTAL, NULL);
        else
            save_as(b, other, CHUNK, STRATA_SAVE_INCREMENTAL, NULL);
        for (uint64_t k = 0; k < rows[0] * COLS; k += 97) /* broken promise: changed */
            s.t[0][k] += 3.0f;
        lora_step(&s, 1, 1);
        strata_stats st = STRATA_STATS_INIT;
        assert_ok(save(p, &s, 1, base, c % 2, &st));
        if (c != 0 && c != 1) /* those match nothing at all; the others the adapters' none */
            assert_true(st.bytes >= tbytes(0));
        assert_int_equal(st.bytes, st.data_bytes);
        snap want;
        snap_take(&want, &s);
        load_same(p, &want);
        verify_ok(p);
        snap_free(&want);
        strata_state_free(other);
        lora_free(&s);
    }
    tu_rmrf(dir);
}

/* Replicas in one process: a shard is taken as marked only if every rank marked it. Two
 * ranks hold the frozen weight; with one mark its changed bytes are written (and load),
 * with both marks the base's are referred to. Unknown flag bits are refused. */
static void mark_replicas(void **state)
{
    (void)state;
    char dir[600], b[700], p[700];
    snprintf(dir, sizeof dir, "%s/markrep", tmp);
    tu_rmrf(dir);
    snprintf(b, sizeof b, "%s/base", dir);
    float *w = malloc(tbytes(0)), *orig = malloc(tbytes(0));
    for (uint64_t k = 0; k < rows[0] * COLS; k++)
        w[k] = (float)k;
    memcpy(orig, w, tbytes(0));
    uint64_t shape[2] = {rows[0], COLS};
    strata_state *st[2];
    for (int both = 0; both < 2; both++) {
        for (int r = 0; r < 2; r++) {
            assert_ok(strata_state_new(&st[r]));
            strata_shard sh = {.name = "w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                               .data = w, .flags = r == 0 || both ? STRATA_SHARD_UNCHANGED : 0};
            assert_ok(strata_state_add_shard(st[r], &sh));
        }
        strata_save_opts o = STRATA_SAVE_OPTS_INIT;
        o.flags = STRATA_SAVE_INCREMENTAL | STRATA_SAVE_NO_SYNC;
        memcpy(w, orig, tbytes(0));
        if (!both)
            assert_ok(strata_save(NULL, NULL, (const char *[]){b}, 1, st, 2, &o));
        w[3] = w[rows[0] * COLS - 3] = -1.0f; /* changed since the base (both halves: the
                                                 planner splits a replica between ranks) */
        o.base = "base";
        snprintf(p, sizeof p, "%s/new%d", dir, both);
        strata_stats s = STRATA_STATS_INIT;
        assert_ok(strata_save(&s, NULL, (const char *[]){p}, 1, st, 2, &o));
        assert_int_equal(s.bytes, both ? 0 : tbytes(0));
        float *got = calloc(1, tbytes(0));
        strata_state *ld;
        assert_ok(strata_state_new(&ld));
        strata_shard sh = {.name = "w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                           .data = got};
        assert_ok(strata_state_add_shard(ld, &sh));
        assert_ok(strata_load(NULL, NULL, (const char *[]){p}, 1, &ld, 1, NULL));
        assert_memory_equal(got, both ? orig : w, tbytes(0));
        strata_state_free(ld);
        free(got);
        for (int r = 0; r < 2; r++)
            strata_state_free(st[r]);
    }
    assert_ok(strata_state_new(&st[0]));
    strata_shard bad = {.name = "w", .dtype = STRATA_F32, .ndim = 2, .global_shape = shape,
                        .data = w, .flags = 1u << 2};
    assert_rc(strata_state_add_shard(st[0], &bad), STRATA_EINVAL);
    assert_msg_has("flags");
    strata_state_free(st[0]);
    free(w);
    free(orig);
    tu_rmrf(dir);
}

/* The mark against a base shard without second checksums (one an incremental save wrote):
 * referred to with its XXH3s alone (has2 off), again on top of that by mark, and written
 * by an unmarked save, which has nothing to compare with. Every step loads and verifies. */
static void mark_without_check2(void **state)
{
    (void)state;
    char dir[600], p[5][700];
    snprintf(dir, sizeof dir, "%s/mark2", tmp);
    tu_rmrf(dir);
    uint64_t shape[1] = {4 * CHUNK / 4};
    float *w = malloc(4 * CHUNK), *got = malloc(4 * CHUNK);
    for (uint64_t k = 0; k < shape[0]; k++)
        w[k] = (float)k;
    strata_state *st[2]; /* [1] marked */
    for (int m = 0; m < 2; m++) {
        assert_ok(strata_state_new(&st[m]));
        strata_shard sh = {.name = "w", .dtype = STRATA_F32, .ndim = 1, .global_shape = shape,
                           .data = w, .flags = m ? STRATA_SHARD_UNCHANGED : 0};
        assert_ok(strata_state_add_shard(st[m], &sh));
    }
    /* s0 full; s1 (unmarked, w changed) writes w without XXH64s; s2, s3 marked refer to
     * it; s4 unmarked writes it (no XXH64 to compare with) */
    const int marked[5] = {0, 0, 1, 1, 0};
    const uint64_t written[5] = {4 * CHUNK, 4 * CHUNK, 0, 0, 4 * CHUNK};
    for (int k = 0; k < 5; k++) {
        snprintf(p[k], sizeof p[k], "%s/s%d", dir, k);
        if (k == 1)
            w[9] = -1.0f;
        strata_save_opts o = STRATA_SAVE_OPTS_INIT;
        o.chunk_bytes = CHUNK;
        o.flags = STRATA_SAVE_INCREMENTAL | STRATA_SAVE_NO_SYNC;
        char b[8];
        snprintf(b, sizeof b, "s%d", k - 1);
        o.base = k ? b : NULL;
        strata_stats stats = STRATA_STATS_INIT;
        assert_ok(strata_save(&stats, NULL, (const char *[]){p[k]}, 1, &st[marked[k]], 1, &o));
        assert_int_equal(stats.bytes, written[k]);
        strata_state *ld;
        assert_ok(strata_state_new(&ld));
        strata_shard sh = {.name = "w", .dtype = STRATA_F32, .ndim = 1, .global_shape = shape,
                           .data = got};
        assert_ok(strata_state_add_shard(ld, &sh));
        assert_ok(strata_load(NULL, NULL, (const char *[]){p[k]}, 1, &ld, 1, NULL));
        assert_memory_equal(got, w, 4 * CHUNK);
        strata_state_free(ld);
        verify_ok(p[k]);
    }
    for (int m = 0; m < 2; m++)
        strata_state_free(st[m]);
    free(w);
    free(got);
    tu_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mark_unread),
        cmocka_unit_test(mark_falls_back),
        cmocka_unit_test(mark_replicas),
        cmocka_unit_test(mark_without_check2),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
