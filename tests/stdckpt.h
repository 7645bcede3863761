/* stdckpt.h - the small standard checkpoint of test_corrupt.c and test_errors.c: a f32
 * [64, 64] weight split by rows over 2 ranks, a replicated bias, a global and a per-rank
 * blob, saved under the group's temporary directory (base_dir); loads of all of it, checked
 * bitwise on success; strata_ckpt_open's code. The tests of both files share the group
 * setup and teardown below. */
#ifndef STRATA_TESTS_STDCKPT_H
#define STRATA_TESTS_STDCKPT_H

#include "testutil.h"

static char base_dir[512];

/* ---- a small standard checkpoint ---- */

#define W "layer0.weight" /* f32 [64, 64], rows split over 2 ranks: 2 chunks per shard */
#define B "layer0.bias"   /* f32 [64], replicated */
static const uint64_t wshape[] = {64, 64}, bshape[] = {64};

typedef struct {
    char ck[600];
    tu_set src;
} fixture;

/* The standard layout, on 2 ranks of s (not saved). */
static void std_state(tu_set *s)
{
    tu_set_init(s, 2);
    for (int r = 0; r < 2; r++) {
        uint64_t off[] = {(uint64_t)r * 32, 0}, len[] = {32, 64};
        tu_set_shard(s, r, W, STRATA_F32, 2, wshape, off, len, 0, 0, 0, 1);
        tu_set_shard(s, r, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 1);
        tu_set_blob(s, r, "cfg", 0, 0, 100, 1);
        tu_set_blob(s, r, "rng", 1, 0, 40, 1);
    }
}

/* Saves the standard checkpoint to base_dir/<sub> (synced: default options). */
static void make_ckpt(fixture *f, const char *sub)
{
    snprintf(f->ck, sizeof f->ck, "%s/%s", base_dir, sub);
    tu_rmrf(f->ck);
    std_state(&f->src);
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = 4096;
    o.step = 42;
    assert_ok(strata_save(NULL, NULL, (const char *[]){f->ck}, 1, f->src.st, 2, &o));
}

static void drop_ckpt(fixture *f)
{
    tu_rmrf(f->ck);
    tu_set_free(&f->src);
}

/* A request for everything in the standard checkpoint, on one rank. */
static void request_all(tu_set *d)
{
    tu_set_init(d, 1);
    tu_set_shard(d, 0, W, STRATA_F32, 2, wshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(d, 0, B, STRATA_F32, 1, bshape, NULL, NULL, 0, 0, 0, 0);
    tu_set_blob(d, 0, "cfg", 0, -1, 100, 0);
    tu_set_blob(d, 0, "rng", 1, 1, 40, 0);
}

/* The error message is only valid until the next strata call, so the request of a load
 * helper is freed at the next helper call (or at teardown), not right after the load. */
static tu_set last_req;

static int load_req(const char *ck, tu_set *d)
{
    int rc = strata_load(NULL, NULL, &ck, 1, d->st, d->n, NULL);
    if (rc == 0)
        assert_int_equal(tu_set_check(d), 0);
    return rc;
}

/* strata_load of everything; on success the values are checked. */
static int load_all(const char *ck)
{
    tu_set_free(&last_req);
    request_all(&last_req);
    return load_req(ck, &last_req);
}

static int open_rc(const char *ck, unsigned flags)
{
    strata_ckpt *c = NULL;
    int rc = strata_ckpt_open(&c, ck, flags);
    if (c) /* not on failure: keep the message */
        strata_ckpt_free(c);
    return rc;
}

static int setup(void **state)
{
    (void)state;
    tu_tmpdir(base_dir, sizeof base_dir, "err");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tu_set_free(&last_req);
    tu_rmrf(base_dir);
    return 0;
}

#endif
