/* test_dist_incr.c - incremental saves by the ranks of a communicator (2 and 3 ranks as
 * threads on host communicators, one saver each, whose plan stays cached): a LoRA-style
 * state (a frozen weight, adapters and moments, split by rows over the ranks) saved in a
 * chain, synchronously and asynchronously; bytes written per save counted from the files
 * on disk (each rank's base file linked, only the adapters written), every step loaded
 * bitwise and verified, retention removing bases that newer steps refer to, an export of a
 * step whose bases are gone; a full save on the same cached plan afterwards (the plan is
 * not changed by incremental saves); one rank whose links fail (EXDEV) writing its part in
 * full; ranks that disagree on the base, a base that is not a plain name, a missing base
 * (a full save). */
#include <dirent.h>
#include <pthread.h>

#include "testutil.h"
#include "threadcomm.h"

static char tmp[512];
TU_TMPDIR_GROUP(tmp, "dincr")

#define CHUNK 16384u
#define NT 5
#define COLS 512
#define MAXR 3
static const char *names[NT] = {"base.w", "lora.a", "lora.b", "opt.a.exp_avg", "opt.a.exp_avg_sq"};
static const uint64_t rows[NT] = {96, 8, 8, 8, 8}; /* frozen: 192 KiB (12 chunks) */

static uint64_t tbytes(int i) { return rows[i] * COLS * 4; }
static uint64_t lo(int i, int r, int P) { return rows[i] * (uint64_t)r / (uint64_t)P; }

/* The global values; each rank's shards point into them (rows lo..hi of each tensor). */
typedef struct {
    float *t[NT];
    unsigned char blob[100];
} vals;

static void vals_init(vals *v, uint64_t seed)
{
    tu_rng r = {seed};
    for (int i = 0; i < NT; i++) {
        v->t[i] = malloc(tbytes(i));
        for (uint64_t k = 0; k < rows[i] * COLS; k++)
            v->t[i][k] = (float)(tu_next(&r) % 1000) / 7.0f;
    }
    memset(v->blob, 0, sizeof v->blob);
}

static void vals_copy(vals *d, const vals *s)
{
    for (int i = 0; i < NT; i++) {
        d->t[i] = malloc(tbytes(i));
        memcpy(d->t[i], s->t[i], tbytes(i));
    }
    memcpy(d->blob, s->blob, sizeof d->blob);
}

static void vals_free(vals *v)
{
    for (int i = 0; i < NT; i++)
        free(v->t[i]);
}

/* A training step: every tensor but the frozen one changes. */
static void vals_step(vals *v, int step)
{
    tu_rng r = {(uint64_t)step * 7919};
    for (int i = 1; i < NT; i++)
        for (uint64_t k = 0; k < rows[i] * COLS; k += 1 + tu_below(&r, 64))
            v->t[i][k] += 1.0f;
    memset(v->blob, step, sizeof v->blob);
}

/* P ranks: a hub (and its twin, for the savers' commit threads), a saver and a state each. */
typedef struct {
    int P;
    hub h, twin;
    tcomm tc[MAXR], twin_tc[MAXR];
    strata_comm *comm[MAXR];
    strata_saver *sv[MAXR];
    strata_state *st[MAXR];
} world;

static void world_init(world *w, int P, vals *v)
{
    memset(w, 0, sizeof *w);
    w->P = P;
    hub_init(&w->h, P);
    hub_init(&w->twin, P);
    for (int r = 0; r < P; r++)
        w->twin_tc[r] = (tcomm){&w->twin, r};
    tc_set_twin(&w->h, w->twin_tc);
    for (int r = 0; r < P; r++) {
        w->tc[r] = (tcomm){&w->h, r};
        assert_ok(strata_comm_host(&w->comm[r], &tops, &w->tc[r], r, P));
        assert_ok(strata_saver_new(&w->sv[r], w->comm[r], NULL));
        assert_ok(strata_state_new(&w->st[r]));
        for (int i = 0; i < NT; i++) {
            uint64_t shape[2] = {rows[i], COLS}, off[2] = {lo(i, r, P), 0},
                     len[2] = {lo(i, r + 1, P) - lo(i, r, P), COLS};
            strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                               .global_shape = shape, .offsets = off, .lengths = len,
                               .data = v->t[i] + off[0] * COLS};
            assert_ok(strata_state_add_shard(w->st[r], &sh));
        }
        assert_ok(strata_state_add_blob(w->st[r], "step", 0, -1, v->blob, sizeof v->blob));
    }
}

static void world_free(world *w)
{
    for (int r = 0; r < w->P; r++) {
        strata_saver_free(w->sv[r]);
        strata_comm_free(w->comm[r]);
        strata_state_free(w->st[r]);
    }
    tc_set_twin(&w->h, NULL);
    hub_free(&w->h);
    hub_free(&w->twin);
}

typedef struct {
    world *w;
    int rank, async;
    const char *uri, *base;
    unsigned flags;
    int rc;
    char msg[1024];
    strata_stats stats;
} job;

static void *run_job(void *p)
{
    job *j = p;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.chunk_bytes = CHUNK;
    o.flags = STRATA_SAVE_NO_SYNC | j->flags;
    o.base = j->base;
    j->stats = (strata_stats)STRATA_STATS_INIT;
    strata_saver *sv = j->w->sv[j->rank];
    if (!j->async) {
        j->rc = strata_save(&j->stats, sv, &j->uri, 1, &j->w->st[j->rank], 1, &o);
    } else {
        strata_handle *h;
        if (!(j->rc = strata_save_start(&h, sv, &j->uri, 1, &j->w->st[j->rank], 1, &o))) {
            j->rc = strata_wait_durable(&j->stats, h);
            strata_handle_free(h);
        }
    }
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* One save on every rank (uris[r], or uri); each rank's outcome in jobs. */
static void save_all(world *w, const char *uri, const char *const *uris, const char *base,
                     unsigned flags, int async, job *jobs)
{
    pthread_t th[MAXR];
    for (int r = 0; r < w->P; r++) {
        jobs[r] = (job){w, r, async, uris ? uris[r] : uri, base, flags, 0, "", {0}};
        assert_int_equal(pthread_create(&th[r], NULL, run_job, &jobs[r]), 0);
    }
    for (int r = 0; r < w->P; r++)
        pthread_join(th[r], NULL);
}

static void expect_ok(const job *jobs, int P)
{
    for (int r = 0; r < P; r++)
        if (jobs[r].rc)
            fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
}

/* Loads path on one rank (whole tensors) and compares every byte with v; verifies. */
static void expect_loads(const char *path, const vals *v)
{
    vals d;
    vals_init(&d, 999);
    strata_state *st;
    assert_ok(strata_state_new(&st));
    for (int i = 0; i < NT; i++) {
        uint64_t shape[2] = {rows[i], COLS};
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = d.t[i]};
        assert_ok(strata_state_add_shard(st, &sh));
    }
    assert_ok(strata_state_add_blob(st, "step", 0, -1, d.blob, sizeof d.blob));
    assert_ok(strata_load(NULL, NULL, &path, 1, &st, 1, NULL));
    for (int i = 0; i < NT; i++)
        if (memcmp(d.t[i], v->t[i], tbytes(i)) != 0)
            fail_msg("%s: tensor %s differs after load", path, names[i]);
    assert_memory_equal(d.blob, v->blob, sizeof d.blob);
    strata_state_free(st);
    vals_free(&d);
    strata_ckpt *ck;
    assert_ok(strata_ckpt_open(&ck, path, 0));
    assert_ok(strata_ckpt_verify(ck, NULL, NULL));
    strata_ckpt_free(ck);
}

/* From the disk: bytes of the data files the save wrote (data-*.bin), the number of linked
 * files (ref-*.bin, each checked to be a hard link: more than one name) and whether rank
 * r's base file is among them. */
typedef struct {
    uint64_t written, file[MAXR];
    int nref, ref_of[MAXR];
} disk;

static disk on_disk(const char *path, int P)
{
    disk k = {0};
    DIR *d = opendir(path);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));) {
        char p[1200];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", path, e->d_name);
        assert_int_equal(stat(p, &st), 0);
        int r;
        if (sscanf(e->d_name, "data-%d.bin", &r) == 1 && r >= 0 && r < P) {
            k.written += (uint64_t)st.st_size;
            k.file[r] = (uint64_t)st.st_size;
        } else if (strncmp(e->d_name, "ref-", 4) == 0) {
            k.nref++;
            if (st.st_nlink < 2)
                fail_msg("%s has %lu names: not a link", p, (unsigned long)st.st_nlink);
            const char *dash = strrchr(e->d_name, '-');
            if (sscanf(dash, "-%d.bin", &r) == 1 && r >= 0 && r < P)
                k.ref_of[r] = 1;
        }
    }
    closedir(d);
    return k;
}

/* Exports path to safetensors (the frozen rows read from the linked files) and loads the
 * tensors of the export on one rank, bitwise. */
static void expect_export(const char *path, const char *out, const vals *v)
{
    assert_ok(strata_export_safetensors(NULL, path, out, NULL));
    vals d;
    vals_init(&d, 998);
    strata_state *st;
    assert_ok(strata_state_new(&st));
    for (int i = 0; i < NT; i++) {
        uint64_t shape[2] = {rows[i], COLS};
        strata_shard sh = {.name = names[i], .dtype = STRATA_F32, .ndim = 2,
                           .global_shape = shape, .data = d.t[i]};
        assert_ok(strata_state_add_shard(st, &sh));
    }
    assert_ok(strata_load(NULL, NULL, &out, 1, &st, 1, NULL));
    for (int i = 0; i < NT; i++)
        if (memcmp(d.t[i], v->t[i], tbytes(i)) != 0)
            fail_msg("%s: tensor %s differs in the export", path, names[i]);
    strata_state_free(st);
    vals_free(&d);
}

static void path_of(char *out, size_t n, const char *dir, int step)
{
    snprintf(out, n, "%s/step-%02d", dir, step);
}

/* A chain of 7 saves on P ranks: step 0 full (STRATA_SAVE_INCREMENTAL: it can be a base),
 * then each naming the one before as its base, odd steps asynchronous. */
static void chain(int P)
{
    char dir[600], p[700], name[32];
    snprintf(dir, sizeof dir, "%s/chain%d", tmp, P);
    tu_rmrf(dir);
    vals v, keep[7];
    vals_init(&v, 7);
    world w;
    world_init(&w, P, &v);
    job jobs[MAXR];
    uint64_t total = 0;
    for (int i = 0; i < NT; i++)
        total += tbytes(i);
    total += sizeof v.blob;
    for (int s = 0; s < 7; s++) {
        if (s)
            vals_step(&v, s);
        vals_copy(&keep[s], &v);
        path_of(p, sizeof p, dir, s);
        snprintf(name, sizeof name, "step-%02d", s - 1);
        save_all(&w, p, NULL, s ? name : NULL, STRATA_SAVE_INCREMENTAL, s % 2, jobs);
        expect_ok(jobs, P);
        disk k = on_disk(p, P);
        for (int r = 0; r < P; r++) {
            /* every rank: the checkpoint's bytes, and what all ranks wrote */
            assert_int_equal(jobs[r].stats.data_bytes, total);
            assert_int_equal(jobs[r].stats.all_bytes, s ? total - tbytes(0) : total);
        }
        if (s == 0) {
            assert_int_equal(k.nref, 0);
            assert_true(k.written >= total);
        } else {
            /* each rank's rows of the frozen weight: its base file, linked; the disk holds
             * only the adapters, moments and blob (each extent 4 KiB aligned) */
            assert_int_equal(k.nref, P);
            for (int r = 0; r < P; r++)
                assert_true(k.ref_of[r]);
            assert_true(k.written <= total - tbytes(0) + (uint64_t)(NT + 1) * P * 4096);
            assert_true(k.written < tbytes(0) / 2);
        }
        expect_loads(p, &v);
    }
    /* retention keeps 3: the bases of steps 4..6 (and their bases) go, the rest loads */
    int removed = 0;
    assert_ok(strata_retain(&removed, dir, 3));
    assert_int_equal(removed, 4);
    for (int s = 0; s < 7; s++) {
        path_of(p, sizeof p, dir, s);
        if (s < 4)
            assert_false(tu_exists(p));
        else
            expect_loads(p, &keep[s]);
    }
    snprintf(name, sizeof name, "/export");
    char out[800];
    snprintf(out, sizeof out, "%s%s", dir, name);
    path_of(p, sizeof p, dir, 6);
    expect_export(p, out, &keep[6]); /* its bases are gone */
    /* a full save on the same cached plan: nothing linked, everything written */
    path_of(p, sizeof p, dir, 7);
    vals_step(&v, 7);
    save_all(&w, p, NULL, NULL, 0, 0, jobs);
    expect_ok(jobs, P);
    assert_int_equal(jobs[0].stats.plan_cached, 1);
    disk k = on_disk(p, P);
    assert_int_equal(k.nref, 0);
    assert_true(k.written >= total);
    expect_loads(p, &v);
    /* and an incremental one after it, on the last incremental step */
    path_of(p, sizeof p, dir, 8);
    vals_step(&v, 8);
    save_all(&w, p, NULL, "step-06", STRATA_SAVE_INCREMENTAL, 1, jobs);
    expect_ok(jobs, P);
    assert_int_equal(on_disk(p, P).nref, P);
    expect_loads(p, &v);
    for (int s = 0; s < 7; s++)
        vals_free(&keep[s]);
    world_free(&w);
    vals_free(&v);
    tu_rmrf(dir);
}

static void chain_2_ranks(void **state)
{
    (void)state;
    chain(2);
}

static void chain_3_ranks(void **state)
{
    (void)state;
    chain(3);
}

/* Rank 1 cannot link (every link it tries fails with EXDEV, as across file systems): it
 * writes its part in full, rank 0 still links its own, and nothing is lost - also once
 * the base is removed. Both synchronously and asynchronously. */
static void one_rank_cannot_link(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700], f1[800];
    snprintf(dir, sizeof dir, "%s/nolink", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    vals v;
    vals_init(&v, 8);
    world w;
    world_init(&w, 2, &v);
    job jobs[2];
    save_all(&w, p0, NULL, NULL, STRATA_SAVE_INCREMENTAL, 0, jobs);
    expect_ok(jobs, 2);
    vals keep[2];
    for (int async = 0; async < 2; async++) {
        vals_step(&v, 1 + async);
        vals_copy(&keep[async], &v);
        snprintf(p1, sizeof p1, "%s/s%d", dir, 1 + async);
        snprintf(f1, sizeof f1, "fault+file://%s?op=rename&n=1&sticky=1&errno=EXDEV", p1);
        const char *uris[2] = {p1, f1};
        save_all(&w, NULL, uris, "s0", STRATA_SAVE_INCREMENTAL, async, jobs);
        expect_ok(jobs, 2);
        disk k = on_disk(p1, 2);
        assert_int_equal(k.nref, 1); /* rank 0's base file only */
        assert_true(k.ref_of[0]);
        assert_false(k.ref_of[1]);
        /* rank 1's rows of the frozen weight are in its own file, rank 0's are not */
        assert_true(k.file[1] >= (lo(0, 2, 2) - lo(0, 1, 2)) * COLS * 4);
        assert_true(k.file[0] < (lo(0, 1, 2) - lo(0, 0, 2)) * COLS * 4);
        assert_int_equal(jobs[0].stats.all_bytes,
                         jobs[0].stats.data_bytes - (lo(0, 1, 2) - lo(0, 0, 2)) * COLS * 4);
        expect_loads(p1, &v);
    }
    tu_rmrf(p0); /* the base goes: both still load */
    for (int i = 0; i < 2; i++) {
        snprintf(p1, sizeof p1, "%s/s%d", dir, 1 + i);
        expect_loads(p1, &keep[i]);
        vals_free(&keep[i]);
    }
    world_free(&w);
    vals_free(&v);
    tu_rmrf(dir);
}

/* Every rank must name a base, or none: a save where they disagree fails on every rank
 * with STRATA_EINVAL before anything is written. A base that is missing at rank 0 gives
 * a full save. */
static void ranks_disagree(void **state)
{
    (void)state;
    char dir[600], p0[700], p1[700];
    snprintf(dir, sizeof dir, "%s/disagree", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    snprintf(p1, sizeof p1, "%s/s1", dir);
    vals v;
    vals_init(&v, 9);
    world w;
    world_init(&w, 2, &v);
    job jobs[2];
    save_all(&w, p0, NULL, NULL, STRATA_SAVE_INCREMENTAL, 0, jobs);
    expect_ok(jobs, 2);
    pthread_t th[2];
    for (int r = 0; r < 2; r++) {
        jobs[r] = (job){&w, r, 0, p1, r ? NULL : "s0", STRATA_SAVE_INCREMENTAL, 0, "", {0}};
        assert_int_equal(pthread_create(&th[r], NULL, run_job, &jobs[r]), 0);
    }
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EINVAL);
        if (!strstr(jobs[r].msg, "base"))
            fail_msg("rank %d: %s", r, jobs[r].msg);
    }
    assert_false(tu_exists(p1));
    /* a base that is not a plain name: rank 0's STRATA_EINVAL, on every rank */
    save_all(&w, p1, NULL, "../s0", STRATA_SAVE_INCREMENTAL, 0, jobs);
    for (int r = 0; r < 2; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EINVAL);
        if (!strstr(jobs[r].msg, "plain name"))
            fail_msg("rank %d: %s", r, jobs[r].msg);
    }
    assert_false(tu_exists(p1));
    /* a missing base: a full save, every byte written */
    save_all(&w, p1, NULL, "nope", STRATA_SAVE_INCREMENTAL, 1, jobs);
    expect_ok(jobs, 2);
    assert_int_equal(jobs[0].stats.all_bytes, jobs[0].stats.data_bytes);
    assert_int_equal(on_disk(p1, 2).nref, 0);
    expect_loads(p1, &v);
    world_free(&w);
    vals_free(&v);
    tu_rmrf(dir);
}

/* A base whose rank-1 rows of the frozen weight rotted after its commit (a flipped byte
 * in its data-000001.bin): rank 1 reads its base bytes before linking them, finds the
 * chunk that fails, and writes its rows itself; rank 0 links its own. The save verifies
 * and loads bitwise (sync and async), and the next save on top of it links rank 1's rows
 * again (written with the base's second checksums). A base named by a symlink is refused
 * on every rank. */
static void rotted_base(void **state)
{
    (void)state;
    char dir[600], p0[700], p[700], f[800], name[32];
    snprintf(dir, sizeof dir, "%s/rot", tmp);
    tu_rmrf(dir);
    snprintf(p0, sizeof p0, "%s/s0", dir);
    vals v;
    vals_init(&v, 10);
    world w;
    world_init(&w, 2, &v);
    job jobs[2];
    save_all(&w, p0, NULL, NULL, STRATA_SAVE_INCREMENTAL, 0, jobs);
    expect_ok(jobs, 2);
    tu_join(f, p0, "data-000001.bin");
    tu_flip_byte(f, 3 * CHUNK + 5, 0x08); /* base.w's rows of rank 1 lead its file */
    for (int s = 1; s <= 3; s++) {
        vals_step(&v, s);
        snprintf(p, sizeof p, "%s/s%d", dir, s);
        snprintf(name, sizeof name, "s%d", s - 1);
        save_all(&w, p, NULL, name, STRATA_SAVE_INCREMENTAL, s == 2, jobs);
        expect_ok(jobs, 2);
        expect_loads(p, &v);
        disk k = on_disk(p, 2);
        assert_true(k.ref_of[0]);
        if (s == 1) { /* rank 1 wrote its rows of the frozen weight itself */
            assert_false(k.ref_of[1]);
            assert_true(k.file[1] >= (lo(0, 2, 2) - lo(0, 1, 2)) * COLS * 4);
        } else {
            assert_true(k.ref_of[1]);
        }
    }
    /* a base named by a symlink: refused on every rank, nothing written */
    char lnk[700];
    snprintf(lnk, sizeof lnk, "%s/lnk", dir);
    assert_int_equal(symlink("s3", lnk), 0);
    snprintf(p, sizeof p, "%s/s4", dir);
    for (int async = 0; async < 2; async++) {
        save_all(&w, p, NULL, "lnk", STRATA_SAVE_INCREMENTAL, async, jobs);
        for (int r = 0; r < 2; r++) {
            assert_int_equal(jobs[r].rc, STRATA_EINVAL);
            if (!strstr(jobs[r].msg, "symlink"))
                fail_msg("rank %d: %s", r, jobs[r].msg);
        }
        assert_false(tu_exists(p));
    }
    world_free(&w);
    vals_free(&v);
    tu_rmrf(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(chain_2_ranks),
        cmocka_unit_test(chain_3_ranks),
        cmocka_unit_test(one_rank_cannot_link),
        cmocka_unit_test(ranks_disagree),
        cmocka_unit_test(rotted_base),
    };
    return cmocka_run_group_tests(tests, tu_group_setup, tu_group_teardown);
}
