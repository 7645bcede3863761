/* test_errors.c - every failure has its exact code and a message naming the culprit:
 * layout mismatches, missing pieces, URI schemes, existing checkpoints, full disks and
 * symlinks, invalid registrations, arguments and options versions. Damage to a checkpoint
 * on disk (data, metadata, commit record): test_corrupt.c. */
#include <signal.h>
#include <sys/resource.h>

#include "meta/meta.h" /* ST_META_FILE, ST_COMMIT_FILE */
#include "stdckpt.h"

/* ---- requests that do not fit the checkpoint ---- */

static void test_requests(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "requests");
    uint64_t other[] = {64, 65}, three[] = {64, 64, 1};
    struct {
        const char *name;
        strata_dtype dt;
        int ndim;
        const uint64_t *shape;
        int want;
    } cases[] = {
        {W, STRATA_BF16, 2, wshape, STRATA_EMISMATCH},
        {W, STRATA_I32, 2, wshape, STRATA_EMISMATCH}, /* same size, other type */
        {W, STRATA_F32, 2, other, STRATA_EMISMATCH},
        {W, STRATA_F32, 3, three, STRATA_EMISMATCH},
        {"layer9.weight", STRATA_F32, 2, wshape, STRATA_ENOTFOUND},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tu_set d;
        tu_set_init(&d, 2);
        tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
        tu_set_shard(&d, 1, cases[i].name, cases[i].dt, cases[i].ndim, cases[i].shape, NULL,
                     NULL, 0, 0, 0, 0);
        assert_rc(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 2, NULL), cases[i].want);
        assert_msg_has(cases[i].name);
        tu_set_free(&d);
    }
    struct {
        const char *name;
        int owner;
        uint64_t size;
        int want;
    } blobs[] = {
        {"nope", -1, 100, STRATA_ENOTFOUND},
        {"cfg", 0, 100, STRATA_ENOTFOUND},   /* only a global one */
        {"rng", 2, 40, STRATA_ENOTFOUND},    /* no rank 2 saved */
        {"rng", -1, 40, STRATA_ENOTFOUND},   /* no global one */
        {"cfg", -1, 99, STRATA_EMISMATCH},
        {"rng", 1, 41, STRATA_EMISMATCH},
        {"rng", 0, 40, 0},
    };
    for (size_t i = 0; i < sizeof blobs / sizeof blobs[0]; i++) {
        tu_set d;
        tu_set_init(&d, 1);
        tu_set_blob(&d, 0, blobs[i].name, blobs[i].owner >= 0, blobs[i].owner, blobs[i].size, 0);
        assert_rc(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 1, NULL), blobs[i].want);
        if (blobs[i].want)
            assert_msg_has(blobs[i].name);
        else
            assert_int_equal(tu_set_check(&d), 0);
        tu_set_free(&d);
    }
    drop_ckpt(&f);
}

static void test_unfilled(void **state)
{
    (void)state;
    char ck[600];
    snprintf(ck, sizeof ck, "%s/unfilled", base_dir);
    tu_set s;
    tu_set_init(&s, 1);
    uint64_t off[] = {0, 0}, len[] = {32, 64};
    tu_set_shard(&s, 0, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1); /* half of W */
    tu_set_shard(&s, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 0, 63, 1); /* all but one */
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, NULL));
    tu_set_free(&s);

    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, W, STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL), STRATA_EUNFILLED);
    assert_msg_has(W);
    assert_msg_has("2048 of the 4096");
    tu_set_free(&d);
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 60, 64, 0);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL), STRATA_EUNFILLED);
    assert_msg_has(B);
    tu_set_free(&d);
    /* what was saved loads */
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 0);
    tu_set_shard(&d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 1, 60, 63, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_rmrf(ck);
}

/* ---- URIs and existing directories ---- */

static void test_scheme(void **state)
{
    (void)state;
    tu_set s;
    tu_set_init(&s, 1);
    tu_set_blob(&s, 0, "x", 0, 0, 8, 1);
    const char *uris[] = {"gcs://bucket/x", "gs://b/ckpt", "hdfs://nn/a"};
    for (size_t i = 0; i < 3; i++) {
        assert_rc(strata_save(NULL, NULL, &uris[i], 1, s.st, 1, NULL), STRATA_ESCHEME);
        assert_msg_has(uris[i]);
        assert_rc(strata_load(NULL, NULL, &uris[i], 1, s.st, 1, NULL), STRATA_ESCHEME);
        assert_msg_has(uris[i]);
        assert_rc(open_rc(uris[i], STRATA_OPEN_INCOMPLETE), STRATA_ESCHEME);
        strata_probe_info pi;
        assert_rc(strata_probe(&pi, uris[i]), STRATA_ESCHEME);
        assert_rc(strata_remove_incomplete(uris[i]), STRATA_ESCHEME);
    }
    /* a file:// URI must be absolute; an empty one is invalid */
    assert_rc(strata_save(NULL, NULL, (const char *[]){"file://relative/x"}, 1, s.st, 1, NULL),
              STRATA_EINVAL);
    assert_rc(strata_save(NULL, NULL, (const char *[]){""}, 1, s.st, 1, NULL), STRATA_EINVAL);
    /* a missing checkpoint */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/never-saved", base_dir);
    assert_rc(strata_load(NULL, NULL, (const char *[]){ck}, 1, s.st, 1, NULL), STRATA_ENOENT);
    assert_msg_has(ck);
    assert_rc(open_rc(ck, STRATA_OPEN_INCOMPLETE), STRATA_ENOENT);
    tu_set_free(&s);
}

static void test_existing(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "existing");
    char mp[700];
    tu_join(mp, f.ck, ST_META_FILE);
    size_t len0;
    unsigned char *meta0 = tu_read_file(mp, &len0);

    /* another save onto the committed checkpoint is refused; nothing changes */
    tu_set s;
    tu_set_init(&s, 1);
    uint64_t shape[] = {10};
    tu_set_shard(&s, 0, "new", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    assert_rc(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL), STRATA_EEXIST);
    assert_msg_has(f.ck);
    size_t len1;
    unsigned char *meta1 = tu_read_file(mp, &len1);
    assert_int_equal(len0, len1);
    assert_memory_equal(meta0, meta1, len0);
    free(meta0);
    free(meta1);
    assert_ok(load_all(f.ck));

    /* without its commit record it is incomplete: a save replaces it entirely */
    char cp[700], d1[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(d1, f.ck, "data-000001.bin");
    assert_true(tu_exists(d1));
    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL));
    assert_false(tu_exists(d1)); /* the old save's files are gone */
    assert_rc(load_all(f.ck), STRATA_ENOTFOUND);
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "new", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){f.ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);

    /* an incomplete directory holding someone else's file is not cleared */
    char other[700];
    tu_join(other, f.ck, "notes.txt");
    assert_int_equal(unlink(cp), 0);
    tu_write_file(other, "mine", 4);
    assert_rc(strata_save(NULL, NULL, (const char *[]){f.ck}, 1, s.st, 1, NULL), STRATA_EEXIST);
    assert_true(tu_exists(other));
    tu_set_free(&s);
    drop_ckpt(&f);
}

/* A directory of the user's files is refused as a destination by a save (sync and async)
 * and by strata_copy (STRATA_EEXIST), and keeps nothing of the refused one: no LOCK. */
static void test_user_dir_refused_leaves_nothing(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "copysrc");
    char user[700], notes[800], lock[800];
    snprintf(user, sizeof user, "%s/user", base_dir);
    tu_join(notes, user, "notes.txt");
    tu_join(lock, user, ST_LOCK_FILE);
    assert_int_equal(mkdir(user, 0755), 0);
    tu_write_file(notes, "mine", 4);
    tu_set s;
    tu_set_init(&s, 1);
    uint64_t shape[] = {10};
    tu_set_shard(&s, 0, "new", STRATA_U8, 1, shape, NULL, NULL, 0, 0, 0, 1);
    const char *u = user;
    for (int k = 0; k < 3; k++) {
        int rc;
        if (k == 0) {
            rc = strata_save(NULL, NULL, &u, 1, s.st, 1, NULL);
        } else if (k == 1) {
            strata_handle *h;
            rc = strata_save_start(&h, NULL, &u, 1, s.st, 1, NULL);
            if (!rc) {
                rc = strata_wait_durable(NULL, h);
                strata_handle_free(h);
            }
        } else {
            rc = strata_copy(NULL, f.ck, user, 0);
        }
        if (rc != STRATA_EEXIST)
            fail_msg("%d: %s (%s), want STRATA_EEXIST", k, strata_error_name(rc),
                     strata_error_last());
        assert_msg_has("not strata's");
        if (tu_exists(lock))
            fail_msg("%d: '%s' is left in the user's directory", k, lock);
        assert_true(tu_exists(notes));
    }
    tu_set_free(&s);
    tu_rmrf(user);
    drop_ckpt(&f);
}

/* A full disk (simulated with RLIMIT_FSIZE: writes past the limit fail with EFBIG) is
 * STRATA_ENOSPC; nothing is committed, the failed save leaves no files, the previous
 * checkpoint still loads, and a retry with space succeeds. */
static void test_full_disk(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "full_prev");
    char ck[700];
    snprintf(ck, sizeof ck, "%s/full_new", base_dir);
    tu_rmrf(ck);
    tu_set s;
    tu_set_init(&s, 2);
    uint64_t shape[] = {1 << 20}; /* 4 MiB of f32 per rank half */
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r << 19}, len[] = {1 << 19};
        tu_set_shard(&s, r, "big", STRATA_F32, 1, shape, off, len, 0, 0, 0, 1);
    }
    struct rlimit old, lim;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 1 << 20;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int rc = strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 2, NULL);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    assert_rc(rc, STRATA_ENOSPC);
    assert_msg_has("data-00000");
    char cp[800];
    tu_join(cp, ck, ST_COMMIT_FILE);
    assert_false(tu_exists(cp));
    assert_false(tu_exists(ck)); /* the failed save removed what it created */
    assert_ok(load_all(f.ck));   /* the committed one is untouched */
    assert_ok(strata_save(NULL, NULL, (const char *[]){ck}, 1, s.st, 2, NULL));
    tu_set d;
    tu_set_init(&d, 1);
    tu_set_shard(&d, 0, "big", STRATA_F32, 1, shape, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 1, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_set_free(&d);
    tu_set_free(&s);
    tu_rmrf(ck);
    drop_ckpt(&f);
}

static void test_remove_incomplete(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "remove");
    char cp[700], mp[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(mp, f.ck, ST_META_FILE);
    assert_rc(strata_remove_incomplete(f.ck), STRATA_EEXIST);
    assert_msg_has(f.ck);
    assert_ok(load_all(f.ck)); /* untouched */

    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_remove_incomplete(f.ck));
    assert_false(tu_exists(f.ck));
    assert_rc(strata_remove_incomplete(f.ck), STRATA_ENOENT);
    drop_ckpt(&f);

    /* foreign files stay (and so does the directory); a symlink with a strata name is
     * not followed: its target survives */
    make_ckpt(&f, "remove2");
    char other[700], link[700], target[700];
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    tu_join(mp, f.ck, ST_META_FILE);
    tu_join(other, f.ck, "notes.txt");
    tu_join(link, f.ck, "data-000009.bin");
    tu_join(target, base_dir, "target.bin");
    tu_write_file(other, "mine", 4);
    tu_write_file(target, "keep", 4);
    assert_int_equal(symlink(target, link), 0);
    assert_int_equal(unlink(cp), 0);
    assert_ok(strata_remove_incomplete(f.ck));
    assert_true(tu_exists(other));
    assert_true(tu_exists(target));
    assert_false(tu_exists(mp));
    unlink(target);
    drop_ckpt(&f);
}

static void test_symlinks(void **state)
{
    (void)state;
    /* a "latest" symlink to a checkpoint is read through; nothing is written or removed
     * through one; a dangling one, or one to a file, is no checkpoint */
    fixture f;
    make_ckpt(&f, "step-10");
    char latest[700], dangling[700], tofile[700], cp[700];
    tu_join(latest, base_dir, "latest");
    tu_join(dangling, base_dir, "dangling");
    tu_join(tofile, base_dir, "tofile");
    tu_join(cp, f.ck, ST_COMMIT_FILE);
    assert_int_equal(symlink("step-10", latest), 0);
    assert_int_equal(symlink("no-such-dir", dangling), 0);
    assert_int_equal(symlink("step-10/COMMIT", tofile), 0);
    assert_ok(load_all(latest));
    assert_ok(open_rc(latest, 0));
    assert_rc(strata_save(NULL, NULL, (const char *[]){latest}, 1, f.src.st, 2, NULL),
              STRATA_EEXIST);
    assert_rc(strata_remove_incomplete(latest), STRATA_EINVAL);
    assert_rc(load_all(dangling), STRATA_ENOENT);
    assert_rc(load_all(tofile), STRATA_ENOENT);
    assert_int_equal(unlink(cp), 0); /* incomplete: still not removed through the link */
    assert_rc(strata_remove_incomplete(latest), STRATA_EINVAL);
    assert_true(tu_exists(f.ck));
    assert_rc(load_all(latest), STRATA_EINCOMPLETE);
    unlink(latest);
    unlink(dangling);
    unlink(tofile);
    drop_ckpt(&f);
}

/* ---- invalid registrations and arguments ---- */

static void test_invalid_args(void **state)
{
    (void)state;
    strata_state *st;
    assert_ok(strata_state_new(&st));
    uint64_t shape[] = {10, 20}, off[] = {5, 0}, len[] = {6, 20}, big[] = {1ull << 40, 1ull << 40};
    uint64_t okoff[] = {5, 0}, oklen[] = {5, 20};
    char data[8192], longname[STRATA_MAX_NAME + 2];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    strata_shard good = {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
                         .offsets = okoff, .lengths = oklen, .data = data};
    assert_ok(strata_state_add_shard(st, &good));
    assert_int_equal(strata_shard_numel(&good), 100);
    struct {
        const char *why, *msg;
        strata_shard s;
    } bad[] = {
        {"offset + length beyond the shape", "exceeds",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .offsets = off,
          .lengths = len, .data = data}},
        {"offset beyond the shape", "exceeds",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
          .offsets = (uint64_t[]){11, 0}, .lengths = (uint64_t[]){0, 20}, .data = data}},
        {"flat end beyond the box", "flat range",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .offsets = okoff,
          .lengths = oklen, .flat = 1, .flat_start = 0, .flat_end = 101, .data = data}},
        {"flat start after end", "flat range",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape, .flat = 1,
          .flat_start = 7, .flat_end = 6, .data = data}},
        {"ndim 9", "ndim 9",
         {.name = "t", .dtype = STRATA_U8, .ndim = 9, .global_shape = shape, .data = data}},
        {"ndim -1", "ndim -1",
         {.name = "t", .dtype = STRATA_U8, .ndim = -1, .global_shape = shape, .data = data}},
        {"NULL data", "data is NULL",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape}},
        {"NULL shape", "global_shape",
         {.name = "t", .dtype = STRATA_U8, .ndim = 2, .data = data}},
        {"unknown dtype", "dtype",
         {.name = "t", .dtype = STRATA_DTYPE_COUNT, .ndim = 0, .data = data}},
        {"empty name", "name",
         {.name = "", .dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"NULL name", "name", {.dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"long name", "longer",
         {.name = longname, .dtype = STRATA_U8, .ndim = 0, .data = data}},
        {"overflowing size", "overflows",
         {.name = "t", .dtype = STRATA_F64, .ndim = 2, .global_shape = big, .data = data}},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = strata_state_add_shard(st, &bad[i].s);
        if (rc != STRATA_EINVAL)
            fail_msg("%s: %s, want STRATA_EINVAL", bad[i].why, strata_error_name(rc));
        assert_msg_has(bad[i].msg);
        assert_int_equal(strata_shard_numel(&bad[i].s), 0);
    }
    /* a shard of no elements needs no data */
    strata_shard empty = {.name = "t", .dtype = STRATA_U8, .ndim = 2, .global_shape = shape,
                          .flat = 1, .flat_start = 3, .flat_end = 3};
    assert_ok(strata_state_add_shard(st, &empty));

    assert_rc(strata_state_add_blob(st, "", 0, 0, data, 1), STRATA_EINVAL);
    assert_rc(strata_state_add_blob(st, NULL, 0, 0, data, 1), STRATA_EINVAL);
    assert_rc(strata_state_add_blob(st, "b", 0, 0, NULL, 1), STRATA_EINVAL);
    assert_msg_has("'b'");
    assert_rc(strata_state_add_blob(st, "b", 0, -2, data, 1), STRATA_EINVAL);
    assert_ok(strata_state_add_blob(st, "b", 0, 0, NULL, 0));

    /* save and load arguments */
    char ck[600];
    snprintf(ck, sizeof ck, "%s/args", base_dir);
    const char *u = ck;
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 0, NULL), STRATA_EINVAL);
    assert_rc(strata_save(NULL, NULL, &u, 1, NULL, 1, NULL), STRATA_EINVAL);
    strata_state *none[] = {NULL};
    assert_rc(strata_save(NULL, NULL, &u, 1, none, 1, NULL), STRATA_EINVAL);
    so.chunk_bytes = 1000;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    assert_msg_has("1000");
    so.chunk_bytes = 2048;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    so.chunk_bytes = 128u << 20;
    assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    so.chunk_bytes = 0;
    /* options versions: 1..current are accepted (test_versions), 0 and newer ones not */
    const int bad_versions[] = {0, -1, STRATA_SAVE_OPTS_VERSION + 1, 99};
    for (size_t i = 0; i < sizeof bad_versions / sizeof bad_versions[0]; i++) {
        so.version = bad_versions[i];
        assert_rc(strata_save(NULL, NULL, &u, 1, &st, 1, &so), STRATA_EINVAL);
    }
    assert_false(tu_exists(ck)); /* nothing was created */
    assert_rc(strata_load(NULL, NULL, &u, 1, &st, 0, NULL), STRATA_EINVAL);
    const int bad_lversions[] = {0, -1, STRATA_LOAD_OPTS_VERSION + 1, 99};
    for (size_t i = 0; i < sizeof bad_lversions / sizeof bad_lversions[0]; i++) {
        lo.version = bad_lversions[i];
        assert_rc(strata_load(NULL, NULL, &u, 1, &st, 1, &lo), STRATA_EINVAL);
    }
    strata_state_free(st);

    /* error names and strings cover the table */
    assert_string_equal(strata_error_name(STRATA_ECHECKSUM), "STRATA_ECHECKSUM");
    assert_string_equal(strata_error_name(-99), "STRATA_E?");
    assert_non_null(strata_error_str(-99));
    strata_dtype dt;
    assert_ok(strata_dtype_parse(&dt, "fp8_e5m2"));
    assert_int_equal(dt, STRATA_FP8_E5M2);
    assert_rc(strata_dtype_parse(&dt, "f128"), STRATA_EINVAL);
}

/* Options structs of an older version are accepted (the fields added later take their
 * defaults); version 0 and versions newer than this header's are refused. */
static void test_versions(void **state)
{
    (void)state;
    tu_set s;
    std_state(&s);
    char ck[600];
    snprintf(ck, sizeof ck, "%s/v1", base_dir);
    const char *u = ck;

    /* a version-1 save options struct: the layout before bg_nice, exactly its size on the
     * heap (under ASan a read past it, of bg_nice, fails) */
    typedef struct {
        int version;
        unsigned flags;
        uint64_t step;
        uint32_t chunk_bytes;
        int io_threads;
    } save_opts_v1;
    save_opts_v1 *v1 = malloc(sizeof *v1);
    assert_non_null(v1);
    *v1 = (save_opts_v1){.version = 1, .flags = STRATA_SAVE_NO_SYNC, .step = 7,
                         .chunk_bytes = 8192, .io_threads = 2};
    assert_ok(strata_save(NULL, NULL, &u, 1, s.st, 2, (const strata_save_opts *)(void *)v1));
    free(v1);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_int_equal(strata_ckpt_committed(c), 1);
    assert_int_equal(strata_ckpt_step(c), 7);
    assert_int_equal(strata_ckpt_chunk_bytes(c), 8192);
    strata_ckpt_free(c);
    assert_ok(load_all(ck)); /* bitwise: load_all checks every value */

    /* version 1 in a current struct is accepted too */
    tu_rmrf(ck);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.version = 1;
    so.flags = STRATA_SAVE_NO_SYNC;
    so.step = 8;
    so.chunk_bytes = 16384;
    assert_ok(strata_save(NULL, NULL, &u, 1, s.st, 2, &so));
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_int_equal(strata_ckpt_step(c), 8);
    assert_int_equal(strata_ckpt_chunk_bytes(c), 16384);
    strata_ckpt_free(c);

    /* load options: version 1 is the current one; 0 and 2 are refused */
    tu_set_free(&last_req);
    request_all(&last_req);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    assert_int_equal(lo.version, 1);
    lo.version = 0;
    assert_rc(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo), STRATA_EINVAL);
    lo.version = 2;
    assert_rc(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo), STRATA_EINVAL);
    lo.version = 1;
    assert_ok(strata_load(NULL, NULL, &u, 1, last_req.st, 1, &lo));
    assert_int_equal(tu_set_check(&last_req), 0);

    /* a stats struct of version 0 (zero-initialised, not STRATA_STATS_INIT) is refused,
     * before anything is created */
    char ck2[700];
    tu_join(ck2, base_dir, "stats0");
    const char *u2 = ck2;
    strata_stats zero;
    memset(&zero, 0, sizeof zero);
    assert_rc(strata_save(&zero, NULL, &u2, 1, s.st, 2, NULL), STRATA_EINVAL);
    assert_msg_has("version");
    assert_false(tu_exists(ck2));
    strata_stats ok = STRATA_STATS_INIT;
    assert_ok(strata_save(&ok, NULL, &u2, 1, s.st, 2, NULL));
    assert_true(ok.data_bytes > 0);
    tu_rmrf(ck2);
    tu_rmrf(ck);
    tu_set_free(&s);
}

/* Argument errors of the save and load calls: the destinations / sources and the ranks.
 * Each is STRATA_EINVAL, and nothing is created on disk. */
static void test_call_args(void **state)
{
    (void)state;
    fixture f;
    make_ckpt(&f, "callargs"); /* a committed source, so a load fails only on arguments */
    char paths[STRATA_MAX_TIERS + 1][700];
    const char *uris[STRATA_MAX_TIERS + 1];
    for (int i = 0; i <= STRATA_MAX_TIERS; i++) {
        snprintf(paths[i], sizeof paths[i], "%s/tier-%d", base_dir, i);
        uris[i] = paths[i];
    }
    const int bad_n[] = {0, -1, STRATA_MAX_TIERS + 1};
    for (size_t i = 0; i < sizeof bad_n / sizeof bad_n[0]; i++) {
        assert_rc(strata_save(NULL, NULL, uris, bad_n[i], f.src.st, 2, NULL), STRATA_EINVAL);
        for (int k = 0; k <= STRATA_MAX_TIERS; k++)
            assert_false(tu_exists(paths[k]));
    }
    /* NULL uris; a NULL uri inside the array (the first one valid) */
    assert_rc(strata_save(NULL, NULL, NULL, 1, f.src.st, 2, NULL), STRATA_EINVAL);
    const char *with_null[] = {paths[0], NULL, paths[2]};
    assert_rc(strata_save(NULL, NULL, with_null, 3, f.src.st, 2, NULL), STRATA_EINVAL);
    /* no states */
    assert_rc(strata_save(NULL, NULL, uris, 1, f.src.st, 0, NULL), STRATA_EINVAL);
    for (int k = 0; k <= STRATA_MAX_TIERS; k++)
        assert_false(tu_exists(paths[k]));

    /* the same for a load from the committed checkpoint */
    tu_set_free(&last_req);
    request_all(&last_req);
    const char *src[STRATA_MAX_TIERS + 1];
    for (int i = 0; i <= STRATA_MAX_TIERS; i++)
        src[i] = f.ck;
    for (size_t i = 0; i < sizeof bad_n / sizeof bad_n[0]; i++)
        assert_rc(strata_load(NULL, NULL, src, bad_n[i], last_req.st, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_load(NULL, NULL, NULL, 1, last_req.st, 1, NULL), STRATA_EINVAL);
    const char *lnull[] = {f.ck, NULL};
    assert_rc(strata_load(NULL, NULL, lnull, 2, last_req.st, 1, NULL), STRATA_EINVAL);
    assert_rc(strata_load(NULL, NULL, src, 1, last_req.st, 0, NULL), STRATA_EINVAL);
    for (int k = 0; k <= STRATA_MAX_TIERS; k++)
        assert_false(tu_exists(paths[k]));
    /* and the arguments fixed, both work: every tier allowed */
    assert_ok(strata_load(NULL, NULL, src, STRATA_MAX_TIERS, last_req.st, 1, NULL));
    assert_int_equal(tu_set_check(&last_req), 0);
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    assert_ok(strata_save(NULL, NULL, uris, STRATA_MAX_TIERS, f.src.st, 2, &so));
    for (int k = 0; k < STRATA_MAX_TIERS; k++) {
        assert_ok(load_all(paths[k]));
        tu_rmrf(paths[k]);
    }
    assert_false(tu_exists(paths[STRATA_MAX_TIERS]));
    drop_ckpt(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests),
        cmocka_unit_test(test_unfilled),
        cmocka_unit_test(test_scheme),
        cmocka_unit_test(test_existing),
        cmocka_unit_test(test_user_dir_refused_leaves_nothing),
        cmocka_unit_test(test_full_disk),
        cmocka_unit_test(test_remove_incomplete),
        cmocka_unit_test(test_symlinks),
        cmocka_unit_test(test_invalid_args),
        cmocka_unit_test(test_versions),
        cmocka_unit_test(test_call_args),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
