/* test_plan.c - the save planner (dedup of replicas, balance of writers, layout errors)
 * and the load planner (exact coverage, empty requests, shared chunks read once, partial
 * reads), on states registered through the public API. */
#include "core/geom.h"
#include "core/overlap.h"
#include "engine/engine.h"
#include "plan/plan.h"
#include "testutil.h"

#define CHUNK 4096u

/* The planners' view of a rank set (free with free()). */
static st_rank_view *views(const tu_set *s)
{
    st_rank_view *v = calloc((size_t)s->n, sizeof *v);
    assert_non_null(v);
    for (int r = 0; r < s->n; r++)
        v[r] = (st_rank_view){.sh = s->st[r]->sh, .nsh = s->st[r]->nsh, .bl = s->st[r]->bl, .nbl = s->st[r]->nbl};
    return v;
}

static int plan_save(st_save_plan *p, const tu_set *s)
{
    st_rank_view *v = views(s);
    int rc = st_plan_save(p, v, s->n, CHUNK, 7);
    free(v);
    return rc;
}

static int plan_load(st_io_plan *p, const st_meta *m, const tu_set *s)
{
    st_rank_view *v = views(s);
    int rc = st_plan_load(p, m, v, s->n, 16u << 20);
    free(v);
    return rc;
}

static uint64_t sum_writer_bytes(const st_save_plan *p)
{
    uint64_t t = 0;
    for (int r = 0; r < p->nranks; r++)
        t += p->writer_bytes[r];
    return t;
}

/* ---- save planner ---- */

static void test_dedup_replicas(void **state)
{
    (void)state;
    /* tp = 2 halves of w, each replicated on 4 data-parallel ranks; b on all 8 */
    tu_set s;
    tu_set_init(&s, 8);
    uint64_t shape[] = {64, 100}, bshape[] = {100};
    for (int r = 0; r < 8; r++) {
        uint64_t off[] = {(uint64_t)(r % 2) * 32, 0}, len[] = {32, 100};
        tu_set_shard(&s, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 1);
        tu_set_shard(&s, r, "b", STRATA_BF16, 1, bshape, NULL, NULL, 0, 0, 0, 1);
        tu_set_blob(&s, r, "step", 0, 0, 8, 1);  /* global: saved once */
        tu_set_blob(&s, r, "rng", 1, 0, 24, 1);  /* per rank: saved 8 times */
    }
    st_save_plan p;
    assert_ok(plan_save(&p, &s));
    const st_meta *m = p.meta;
    assert_int_equal(m->ntensors, 2);
    assert_string_equal(m->tensors[0].name, "b"); /* name order */
    assert_int_equal(m->tensors[0].nshards, 1);
    assert_int_equal(m->tensors[1].nshards, 2);
    assert_int_equal(m->tensors[1].bytes, 64 * 100 * 4);
    assert_int_equal(m->nblobs, 1 + 8);
    uint64_t distinct = 64 * 100 * 4 + 100 * 2 + 8 + 8 * 24;
    assert_int_equal(m->data_bytes, distinct);
    assert_int_equal(sum_writer_bytes(&p), distinct);
    assert_int_equal(p.npieces, 2 + 1 + 9);
    for (size_t i = 0; i < m->nblobs; i++) /* per-rank blobs are written by their owner */
        if (m->blobs[i].owner >= 0)
            assert_int_equal(p.pieces[2 + 1 + i].writer, m->blobs[i].owner);
    st_save_plan_free(&p);

    /* the same through strata_save: stats and the checkpoint agree */
    char dir[512], ck[600];
    tu_tmpdir(dir, sizeof dir, "plan");
    tu_join(ck, dir, "ck");
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_save(&st, NULL, (const char *[]){ck}, 1, s.st, 8, NULL));
    assert_int_equal(st.data_bytes, distinct);
    assert_int_equal(st.bytes, distinct);
    strata_ckpt *c;
    assert_ok(strata_ckpt_open(&c, ck, 0));
    assert_int_equal(strata_ckpt_data_bytes(c), distinct);
    strata_tensor_info ti;
    strata_ckpt_tensor(&ti, c, 1);
    assert_string_equal(ti.name, "w");
    assert_int_equal(ti.nshards, 2);
    strata_ckpt_free(c);
    tu_rmrf(dir);
    tu_set_free(&s);
}

static void test_balance_equal(void **state)
{
    (void)state;
    /* 64 equal tensors, each on all 8 ranks: 8 per writer */
    tu_set s;
    tu_set_init(&s, 8);
    uint64_t shape[] = {1000};
    char name[32];
    for (int t = 0; t < 64; t++) {
        snprintf(name, sizeof name, "layer%02d.w", t);
        for (int r = 0; r < 8; r++)
            tu_set_shard(&s, r, name, STRATA_F32, 1, shape, NULL, NULL, 0, 0, 0, 1);
    }
    st_save_plan p;
    assert_ok(plan_save(&p, &s));
    uint64_t total = 64 * 1000 * 4;
    assert_int_equal(p.meta->data_bytes, total);
    assert_int_equal(p.nwriters, 8);
    assert_true(p.max_writer_bytes * 8 <= total * 110 / 100);
    for (int r = 0; r < 8; r++)
        assert_int_equal(p.writer_bytes[r], total / 8);
    st_save_plan_free(&p);
    tu_set_free(&s);
}

static void test_balance_dp(void **state)
{
    (void)state;
    /* data parallel only: 20 odd-sized tensors replicated on 4 ranks */
    tu_set s;
    tu_set_init(&s, 4);
    uint64_t total = 0;
    char name[32];
    for (int t = 0; t < 20; t++) {
        uint64_t shape[] = {(uint64_t)(1009 + 211 * t + 37 * (t % 3)), 3};
        snprintf(name, sizeof name, "p%d", t);
        total += shape[0] * shape[1] * 2;
        for (int r = 0; r < 4; r++)
            tu_set_shard(&s, r, name, STRATA_BF16, 2, shape, NULL, NULL, 0, 0, 0, 1);
    }
    st_save_plan p;
    assert_ok(plan_save(&p, &s));
    assert_int_equal(p.meta->data_bytes, total);
    assert_int_equal(sum_writer_bytes(&p), total);
    assert_int_equal(p.nwriters, 4);
    if (p.max_writer_bytes * 4 > total * 110 / 100)
        fail_msg("max writer %" PRIu64 " bytes > 1.10 x mean %" PRIu64, p.max_writer_bytes,
                 total / 4);
    st_save_plan_free(&p);

    /* the same through strata_save's stats */
    char dir[512], ck[600];
    tu_tmpdir(dir, sizeof dir, "plan");
    tu_join(ck, dir, "ck");
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags |= STRATA_SAVE_NO_SYNC;
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_save(&st, NULL, (const char *[]){ck}, 1, s.st, 4, &o));
    assert_int_equal(st.writers, 4);
    assert_true(st.max_writer_bytes * 4 <= total * 110 / 100);
    tu_rmrf(dir);
    tu_set_free(&s);
}

static void test_balance_fixed_first(void **state)
{
    (void)state;
    /* rank 0 alone holds a big shard; the replicated ones go to the others */
    tu_set s;
    tu_set_init(&s, 3);
    uint64_t big[] = {3000}, small[] = {1000};
    tu_set_shard(&s, 0, "big", STRATA_U8, 1, big, NULL, NULL, 0, 0, 0, 1);
    for (int r = 0; r < 3; r++) {
        tu_set_shard(&s, r, "a", STRATA_U8, 1, small, NULL, NULL, 0, 0, 0, 1);
        tu_set_shard(&s, r, "b", STRATA_U8, 1, small, NULL, NULL, 0, 0, 0, 1);
    }
    st_save_plan p;
    assert_ok(plan_save(&p, &s));
    assert_int_equal(p.writer_bytes[0], 3000);
    assert_int_equal(p.writer_bytes[1], 1000);
    assert_int_equal(p.writer_bytes[2], 1000);
    assert_int_equal(p.max_writer_bytes, 3000);
    st_save_plan_free(&p);
    tu_set_free(&s);
}

static void test_balance_split(void **state)
{
    (void)state;
    /* one 1 MiB tensor held by 4 ranks: written once, in pieces shared by the holders;
     * the pieces tile the tensor and load back in another layout */
    tu_set s, d;
    tu_set_init(&s, 4);
    tu_set_init(&d, 3);
    uint64_t shape[] = {512, 512}, total = 512 * 512 * 4;
    for (int r = 0; r < 4; r++)
        tu_set_shard(&s, r, "emb", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 1);
    for (int r = 0; r < 3; r++) {
        uint64_t off[] = {0, (uint64_t)r * 170}, len[] = {512, r == 2 ? 172u : 170u};
        tu_set_shard(&d, r, "emb", STRATA_F32, 2, shape, off, len, 0, 0, 0, 0);
    }
    st_save_plan p;
    assert_ok(plan_save(&p, &s));
    assert_int_equal(p.meta->data_bytes, total);
    assert_int_equal(sum_writer_bytes(&p), total);
    assert_true(p.max_writer_bytes * 4 <= total * 110 / 100);
    assert_true(p.writer_bytes_bound <= p.max_writer_bytes);
    assert_true(p.writer_bytes_bound >= total / 4);
    st_save_plan_free(&p); /* the planner's own overlap check passed; now the bytes */

    char dir[512], ck[600];
    tu_tmpdir(dir, sizeof dir, "plan");
    tu_join(ck, dir, "ck");
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_save(&st, NULL, (const char *[]){ck}, 1, s.st, 4, NULL));
    assert_int_equal(st.data_bytes, total);
    assert_true(st.balance_bound <= st.max_writer_bytes);
    assert_ok(strata_load(NULL, NULL, (const char *[]){ck}, 1, d.st, 3, NULL));
    assert_int_equal(tu_set_check(&d), 0);
    tu_rmrf(dir);
    tu_set_free(&s);
    tu_set_free(&d);
}

static void test_save_errors(void **state)
{
    (void)state;
    uint64_t s10[] = {10}, s11[] = {11}, o0[] = {0}, o4[] = {4}, l6[] = {6}, l4[] = {4};
    st_save_plan p;
    tu_set s;

    /* one name, two dtypes */
    tu_set_init(&s, 2);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F16, 1, s10, NULL, NULL, 0, 0, 0, 1);
    assert_rc(plan_save(&p, &s), STRATA_EMISMATCH);
    assert_msg_has("enc.w");
    tu_set_free(&s);

    /* one name, two shapes */
    tu_set_init(&s, 2);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F32, 1, s11, NULL, NULL, 0, 0, 0, 1);
    assert_rc(plan_save(&p, &s), STRATA_EMISMATCH);
    assert_msg_has("enc.w");
    tu_set_free(&s);

    /* overlapping boxes [0,6) and [4,10) */
    tu_set_init(&s, 2);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, o0, l6, 0, 0, 0, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F32, 1, s10, o4, l6, 0, 0, 0, 1);
    assert_rc(plan_save(&p, &s), STRATA_EOVERLAP);
    assert_msg_has("enc.w");
    tu_set_free(&s);

    /* overlapping flat ranges of one box */
    tu_set_init(&s, 2);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 0, 6, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 5, 10, 1);
    assert_rc(plan_save(&p, &s), STRATA_EOVERLAP);
    tu_set_free(&s);

    /* a flat range overlapping a box */
    tu_set_init(&s, 2);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 3, 5, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F32, 1, s10, o4, l4, 0, 0, 0, 1);
    assert_rc(plan_save(&p, &s), STRATA_EOVERLAP);
    tu_set_free(&s);

    /* adjacent pieces are fine, and so is an empty piece */
    tu_set_init(&s, 3);
    tu_set_shard(&s, 0, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 0, 5, 1);
    tu_set_shard(&s, 1, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 5, 10, 1);
    tu_set_shard(&s, 2, "enc.w", STRATA_F32, 1, s10, NULL, NULL, 1, 5, 5, 1);
    assert_ok(plan_save(&p, &s));
    assert_int_equal(p.meta->tensors[0].nshards, 2);
    st_save_plan_free(&p);
    tu_set_free(&s);

    /* a global blob of two sizes */
    tu_set_init(&s, 2);
    tu_set_blob(&s, 0, "cfg", 0, 0, 10, 1);
    tu_set_blob(&s, 1, "cfg", 0, 0, 11, 1);
    assert_rc(plan_save(&p, &s), STRATA_EMISMATCH);
    assert_msg_has("cfg");
    tu_set_free(&s);

    /* a per-rank blob registered twice on one rank */
    tu_set_init(&s, 1);
    tu_set_blob(&s, 0, "rng", 1, 0, 10, 1);
    tu_set_blob(&s, 0, "rng", 1, 0, 10, 1);
    assert_rc(plan_save(&p, &s), STRATA_EINVAL);
    assert_msg_has("rng");
    tu_set_free(&s);
}

/* ---- load planner ---- */

/* Saves (plans) `src` and plans loading `dst` from its metadata. */
typedef struct {
    st_save_plan sp;
    st_io_plan lp;
} plans;

static int plan_both(plans *x, const tu_set *src, const tu_set *dst)
{
    assert_ok(plan_save(&x->sp, src));
    int rc = plan_load(&x->lp, x->sp.meta, dst);
    if (rc)
        st_save_plan_free(&x->sp);
    return rc;
}

static void plans_free(plans *x)
{
    st_io_plan_free(&x->lp);
    st_save_plan_free(&x->sp);
}

/* Every destination byte of dst is written by exactly one run, and nothing else is. */
static void assert_exact_cover(const st_io_plan *lp, const tu_set *dst)
{
    uint64_t req = 0, run_bytes = 0;
    for (size_t i = 0; i < dst->nsh; i++)
        req += tu_shard_numel(&dst->sh[i].sh) * strata_dtype_size(dst->sh[i].sh.dtype);
    for (size_t i = 0; i < dst->nbl; i++)
        req += dst->bl[i].size;
    assert_int_equal(lp->request_bytes, req);
    for (size_t i = 0; i < dst->nsh; i++) {
        const strata_shard *sh = &dst->sh[i].sh;
        uint64_t n = tu_shard_numel(sh) * strata_dtype_size(sh->dtype);
        unsigned char *hits = calloc(n + 1, 1);
        for (size_t k = 0; k < lp->nruns; k++) {
            const st_run *r = &lp->runs[k];
            char *d = st_run_dst(r, lp->ranks);
            if (n && d >= (char *)sh->data && d < (char *)sh->data + n) {
                assert_true(d + r->n <= (char *)sh->data + n);
                assert_true(r->src + r->n <= lp->ext[r->piece]->bytes);
                for (uint64_t j = 0; j < r->n; j++)
                    hits[d - (char *)sh->data + j]++;
                run_bytes += r->n;
            }
        }
        for (uint64_t j = 0; j < n; j++)
            if (hits[j] != 1)
                fail_msg("rank %d '%s': byte %" PRIu64 " written %d times", dst->sh[i].rank,
                         sh->name, j, hits[j]);
        free(hits);
    }
    for (size_t i = 0; i < dst->nbl; i++)
        run_bytes += dst->bl[i].size;
    assert_int_equal(run_bytes, req);
}

static void test_load_cover(void **state)
{
    (void)state;
    /* saved: 8 row blocks of 64x100 f32 plus a flat split of v; requested: 3 column
     * blocks of w, 5 uneven flat pieces of v, and a blob */
    tu_set src, dst;
    tu_set_init(&src, 8);
    tu_set_init(&dst, 3);
    uint64_t shape[] = {64, 100}, vs[] = {7, 9, 11};
    for (int r = 0; r < 8; r++) {
        uint64_t off[] = {(uint64_t)r * 8, 0}, len[] = {8, 100};
        tu_set_shard(&src, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 1);
        tu_set_shard(&src, r, "v", STRATA_I16, 3, vs, NULL, NULL, 1, 693 * r / 8,
                     693 * (r + 1) / 8, 1);
        tu_set_blob(&src, r, "rng", 1, 0, 100 + (uint64_t)r, 1);
    }
    uint64_t cut[] = {0, 33, 34, 100}, vcut[] = {0, 1, 300, 301, 650, 693};
    for (int r = 0; r < 3; r++) {
        uint64_t off[] = {0, cut[r]}, len[] = {64, cut[r + 1] - cut[r]};
        tu_set_shard(&dst, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 0);
    }
    for (int k = 0; k < 5; k++)
        tu_set_shard(&dst, k % 3, "v", STRATA_I16, 3, vs, NULL, NULL, 1, vcut[k], vcut[k + 1], 0);
    tu_set_blob(&dst, 2, "rng", 1, 5, 105, 0);
    plans x;
    assert_ok(plan_both(&x, &src, &dst));
    assert_exact_cover(&x.lp, &dst);
    /* everything is requested once: every chunk is read once */
    assert_int_equal(x.lp.payload_bytes, 64 * 100 * 4 + 693 * 2 + 105);
    plans_free(&x);
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_load_empty(void **state)
{
    (void)state;
    tu_set src, dst;
    tu_set_init(&src, 1);
    tu_set_init(&dst, 2);
    uint64_t shape[] = {16, 16}, zshape[] = {0, 4}, off[] = {3, 3}, len0[] = {0, 5};
    tu_set_shard(&src, 0, "w", STRATA_F64, 2, shape, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&src, 0, "z", STRATA_F64, 2, zshape, NULL, NULL, 0, 0, 0, 1);
    /* empty requests: a flat range [5, 5), a box with a 0 length, a tensor of 0 elements */
    tu_set_shard(&dst, 0, "w", STRATA_F64, 2, shape, NULL, NULL, 1, 5, 5, 0);
    tu_set_shard(&dst, 1, "w", STRATA_F64, 2, shape, off, len0, 0, 0, 0, 0);
    tu_set_shard(&dst, 1, "z", STRATA_F64, 2, zshape, NULL, NULL, 0, 0, 0, 0);
    plans x;
    assert_ok(plan_both(&x, &src, &dst));
    assert_int_equal(x.sp.meta->tensors[1].nshards, 0);
    assert_int_equal(x.lp.request_bytes, 0);
    assert_int_equal(x.lp.nruns, 0);
    assert_int_equal(x.lp.nios, 0);
    assert_int_equal(x.lp.payload_bytes, 0);
    plans_free(&x);
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_load_shared_chunks(void **state)
{
    (void)state;
    /* two ranks want the same 64 KiB; a third wants half of it: each chunk read once */
    tu_set src, dst;
    tu_set_init(&src, 2);
    tu_set_init(&dst, 3);
    uint64_t shape[] = {128, 128}, off[] = {64, 0}, len[] = {64, 128};
    for (int r = 0; r < 2; r++)
        tu_set_shard(&src, r, "w", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 1);
    tu_set_shard(&dst, 0, "w", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&dst, 1, "w", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&dst, 2, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 0);
    plans x;
    assert_ok(plan_both(&x, &src, &dst));
    assert_int_equal(x.sp.meta->tensors[0].nshards, 1);
    assert_int_equal(x.lp.request_bytes, 2 * 65536 + 32768);
    assert_int_equal(x.lp.payload_bytes, 65536);
    assert_int_equal(x.lp.nsegs, 1);
    plans_free(&x);
    tu_set_free(&src);
    tu_set_free(&dst);
}

/* Bytes of the chunks of one extent that hold any byte of the given runs (brute force). */
static uint64_t needed_chunk_bytes(const st_io_plan *lp, uint32_t piece)
{
    const st_extent *e = lp->ext[piece];
    uint64_t nc = st_nchunks(e->bytes, CHUNK), total = 0;
    for (uint64_t c = 0; c < nc; c++) {
        uint64_t lo = c * CHUNK, hi = lo + CHUNK < e->bytes ? lo + CHUNK : e->bytes;
        for (size_t k = 0; k < lp->nruns; k++)
            if (lp->runs[k].piece == piece && lp->runs[k].src < hi &&
                lp->runs[k].src + lp->runs[k].n > lo) {
                total += hi - lo;
                break;
            }
    }
    return total;
}

static void test_load_partial(void **state)
{
    (void)state;
    /* one 256 KiB shard; requests for small sub-boxes read only the chunks they touch */
    tu_set src, dst;
    tu_set_init(&src, 1);
    tu_set_init(&dst, 2);
    uint64_t shape[] = {256, 256};
    tu_set_shard(&src, 0, "w", STRATA_F32, 2, shape, NULL, NULL, 0, 0, 0, 1);
    uint64_t o1[] = {10, 0}, l1[] = {2, 256};  /* rows 10..11: 2 KiB, inside chunk 2 */
    uint64_t o2[] = {100, 5}, l2[] = {10, 4}; /* rows 100..109, 16 bytes each */
    tu_set_shard(&dst, 0, "w", STRATA_F32, 2, shape, o1, l1, 0, 0, 0, 0);
    tu_set_shard(&dst, 1, "w", STRATA_F32, 2, shape, o2, l2, 0, 0, 0, 0);
    plans x;
    assert_ok(plan_both(&x, &src, &dst));
    assert_exact_cover(&x.lp, &dst);
    /* rows 10-11 are bytes [10240, 12288): chunk 2; rows 100-109, cols 5..8 are bytes
     * 102420 (chunk 25) to 111652 (chunk 27): 4 chunks in all */
    assert_int_equal(needed_chunk_bytes(&x.lp, 0), x.lp.payload_bytes);
    assert_int_equal(x.lp.payload_bytes, 4 * CHUNK);
    assert_true(x.lp.payload_bytes < 256 * 256 * 4);
    plans_free(&x);

    /* and through strata_load: only those chunks are read */
    char dir[512], ck[600];
    tu_tmpdir(dir, sizeof dir, "plan");
    tu_join(ck, dir, "ck");
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.chunk_bytes = CHUNK;
    strata_stats st = STRATA_STATS_INIT;
    assert_ok(strata_save(&st, NULL, (const char *[]){ck}, 1, src.st, 1, &so));
    assert_ok(strata_load(&st, NULL, (const char *[]){ck}, 1, dst.st, 2, NULL));
    assert_int_equal(st.bytes, 4 * CHUNK);
    assert_int_equal(tu_set_check(&dst), 0);
    tu_rmrf(dir);
    tu_set_free(&src);
    tu_set_free(&dst);
}

/* ---- one rank's reads in a load by several ranks (plan_rank.c) ---- */

/* The chunks of every piece, numbered: first[piece] + chunk. */
static size_t *chunk_index(const st_io_plan *g, size_t *total)
{
    size_t *first = calloc(g->npieces + 1, sizeof *first);
    for (size_t p = 0; p < g->npieces; p++)
        first[p + 1] = first[p] + st_nchunks(g->ext[p]->bytes, g->meta->chunk);
    *total = first[g->npieces];
    return first;
}

/* For every rank: which chunks it needs (from the global plan's runs), which it reads (its
 * own plan: local reads, and the whole reads it sends) and with which flags; then checks
 * that each rank reads exactly what it needs on its node - the chunks of a read with a reader
 * on another node it gets sent instead - that a chunk read by several ranks of a node is
 * shared on each and counted (not shared, or first) on exactly one, that a reader reads its
 * reads whole, and that every read is within max_io, whole segments of one file in order. */
static void check_rank_reads(const st_io_plan *g, const int *node, const int *reader,
                             uint64_t max_io)
{
    const int P = g->nranks;
    const uint64_t C = g->meta->chunk;
    size_t total, *first = chunk_index(g, &total);
    unsigned char *need = calloc(total * (size_t)P + 1, 1); /* [chunk * P + r] */
    int *readby = calloc(total * (size_t)P + 1, sizeof(int)); /* 1 + flags, 0: not read */
    int *io_of = malloc((total + 1) * sizeof(int));           /* the global read holding it */
    for (size_t ch = 0; ch < total; ch++)
        io_of[ch] = -1; /* needed by no one */
    for (size_t i = 0; i < g->nios; i++)
        for (size_t si = g->ios[i].seg0; si < g->ios[i].seg1; si++)
            for (uint64_t c = g->segs[si].c0; c < g->segs[si].c1; c++)
                io_of[first[g->segs[si].piece] + c] = (int)i;
    for (size_t k = 0; k < g->nruns; k++) {
        const st_run *r = &g->runs[k];
        for (uint64_t c = r->src / C; c * C < r->src + r->n; c++)
            need[(first[r->piece] + c) * (size_t)P + (size_t)r->rank] = 1;
    }
    for (int me = 0; me < P; me++) {
        st_io_plan rp;
        assert_ok(st_plan_rank_reads(&rp, g, me, node, reader, max_io));
        int cls = 0;
        for (size_t i = 0; i < rp.nios; i++) {
            const st_io *io = &rp.ios[i];
            int c = io->flags & ST_IO_SEND ? 3 : !(io->flags & ST_IO_SHARED) ? 1
                    : io->flags & ST_IO_FIRST                               ? 0
                                                                            : 2;
            assert_true(c >= cls); /* shared and first, private, shared, sent */
            cls = c;
            assert_true(io->len <= ST_ALIGN_UP(max_io, 4096));
            uint64_t at = io->off;
            for (size_t si = io->seg0; si < io->seg1; si++) {
                const st_seg *sg = &rp.segs[si];
                const st_extent *e = rp.ext[sg->piece];
                assert_int_equal(e->file, io->file);
                assert_int_equal(e->offset + sg->c0 * C, at); /* back to back, aligned */
                at = ST_ALIGN_UP(e->offset + ST_MIN(sg->c1 * C, e->bytes), 4096);
                for (uint64_t ch = sg->c0; ch < sg->c1; ch++) {
                    size_t x = (first[sg->piece] + ch) * (size_t)P + (size_t)me;
                    assert_int_equal(readby[x], 0); /* once */
                    readby[x] = 1 + (int)io->flags;
                }
            }
            assert_int_equal(at, io->off + io->len);
        }
        st_rank_reads_free(&rp);
    }
    for (size_t ch = 0; ch < total; ch++) {
        int rd = io_of[ch] < 0 ? -1 : reader[io_of[ch]];
        for (int r = 0; r < P; r++) {
            int got = readby[ch * (size_t)P + (size_t)r];
            if (r == rd) /* the reader reads its read whole */
                assert_true(got && ((got - 1) & ST_IO_SEND));
            else if (rd >= 0 && node[rd] != node[r]) /* sent to it */
                assert_int_equal(got, 0);
            else if (need[ch * (size_t)P + (size_t)r] != (got != 0))
                fail_msg("chunk %zu: rank %d needs it %d, reads it %d", ch, r,
                         need[ch * (size_t)P + (size_t)r], got);
        }
        for (int n = 0; n < P; n++) { /* per node: read by k ranks, counted by one */
            int k = 0, counted = 0, shared = 0;
            for (int r = 0; r < P; r++) {
                int got = readby[ch * (size_t)P + (size_t)r];
                if (node[r] != n || !got)
                    continue;
                k++;
                shared += ((got - 1) & ST_IO_SHARED) != 0;
                counted += !((got - 1) & ST_IO_SHARED) || ((got - 1) & ST_IO_FIRST);
            }
            if (k == 0)
                continue;
            assert_int_equal(counted, 1);
            if (k > 1)
                assert_int_equal(shared, k);
        }
    }
    free(first);
    free(need);
    free(readby);
    free(io_of);
}

static void test_rank_reads(void **state)
{
    (void)state;
    /* saved: 8 row blocks of 64x100 f32, v flat-split, a blob per rank; requested by 6 ranks:
     * uneven row blocks, two of them the same (replicas), column blocks, v pieces, blobs */
    tu_set src, dst;
    tu_set_init(&src, 8);
    tu_set_init(&dst, 6);
    uint64_t shape[] = {64, 100}, vs[] = {7, 9, 11};
    for (int r = 0; r < 8; r++) {
        uint64_t off[] = {(uint64_t)r * 8, 0}, len[] = {8, 100};
        tu_set_shard(&src, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 1);
        tu_set_shard(&src, r, "v", STRATA_I16, 3, vs, NULL, NULL, 1, 693 * r / 8,
                     693 * (r + 1) / 8, 1);
        tu_set_blob(&src, r, "rng", 1, 0, 3000 + (uint64_t)r, 1);
    }
    uint64_t rows[] = {0, 10, 11, 40, 64};
    for (int r = 0; r < 4; r++) {
        uint64_t off[] = {rows[r], 0}, len[] = {rows[r + 1] - rows[r], 100};
        tu_set_shard(&dst, r, "w", STRATA_F32, 2, shape, off, len, 0, 0, 0, 0);
    }
    uint64_t off4[] = {11, 0}, len4[] = {29, 100}, off5[] = {0, 50}, len5[] = {64, 50};
    tu_set_shard(&dst, 4, "w", STRATA_F32, 2, shape, off4, len4, 0, 0, 0, 0); /* rank 2's */
    tu_set_shard(&dst, 5, "w", STRATA_F32, 2, shape, off5, len5, 0, 0, 0, 0);
    uint64_t vcut[] = {0, 1, 300, 301, 650, 693};
    for (int k = 0; k < 5; k++)
        tu_set_shard(&dst, k, "v", STRATA_I16, 3, vs, NULL, NULL, 1, vcut[k], vcut[k + 1], 0);
    tu_set_blob(&dst, 5, "rng", 1, 5, 3005, 0);
    tu_set_blob(&dst, 1, "rng", 1, 5, 3005, 0);
    st_save_plan sp;
    assert_ok(plan_save(&sp, &src));
    st_rank_view *v = views(&dst);
    static const int nodes[][6] = {{0, 0, 0, 0, 0, 0}, {0, 1, 2, 3, 4, 5},
                                   {0, 0, 0, 3, 3, 3}, {0, 1, 0, 1, 0, 1}};
    for (uint64_t max_io = CHUNK; max_io <= 64 * CHUNK; max_io *= 4) {
        st_io_plan g;
        assert_ok(st_plan_load(&g, sp.meta, v, 6, max_io));
        for (size_t k = 0; k < sizeof nodes / sizeof nodes[0]; k++) {
            const int *node = nodes[k];
            int *reader = malloc((g.nios + 1) * sizeof *reader);
            for (size_t i = 0; i < g.nios; i++) { /* the last needer, where nodes differ */
                int last = -1, many = 0;
                for (size_t r = 0; r < g.nruns; r++) {
                    const st_run *run = &g.runs[r];
                    for (size_t si = g.ios[i].seg0; si < g.ios[i].seg1; si++)
                        if (run->piece == g.segs[si].piece && run->src < g.segs[si].c1 * CHUNK &&
                            run->src + run->n > g.segs[si].c0 * CHUNK) {
                            many |= last >= 0 && node[last] != node[run->rank];
                            last = ST_MAX(last, run->rank);
                        }
                }
                reader[i] = many ? last : -1;
            }
            check_rank_reads(&g, node, reader, max_io);
            free(reader);
        }
        st_io_plan_free(&g);
    }
    free(v);
    st_save_plan_free(&sp);
    tu_set_free(&src);
    tu_set_free(&dst);
}

static void test_load_errors(void **state)
{
    (void)state;
    tu_set src, dst;
    tu_set_init(&src, 1);
    uint64_t shape[] = {8, 8}, other[] = {8, 9}, off[] = {0, 0}, half[] = {4, 8};
    tu_set_shard(&src, 0, "w", STRATA_F32, 2, shape, off, half, 0, 0, 0, 1);
    tu_set_blob(&src, 0, "cfg", 0, 0, 10, 1);
    st_save_plan sp;
    st_io_plan lp;
    assert_ok(plan_save(&sp, &src));
    struct {
        const char *name;
        strata_dtype dt;
        const uint64_t *shape, *len;
        int want;
    } cases[] = {
        {"nope", STRATA_F32, shape, half, STRATA_ENOTFOUND},
        {"w", STRATA_I32, shape, half, STRATA_EMISMATCH},
        {"w", STRATA_F32, other, half, STRATA_EMISMATCH},
        {"w", STRATA_F32, shape, NULL, STRATA_EUNFILLED}, /* only half was saved */
        {"w", STRATA_F32, shape, half, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tu_set_init(&dst, 2);
        tu_set_shard(&dst, 1, cases[i].name, cases[i].dt, 2, cases[i].shape, off, cases[i].len,
                     0, 0, 0, 0);
        assert_rc(plan_load(&lp, sp.meta, &dst), cases[i].want);
        if (cases[i].want) {
            assert_msg_has(cases[i].name);
            assert_msg_has("rank 1");
        } else {
            st_io_plan_free(&lp);
        }
        tu_set_free(&dst);
    }
    tu_set_init(&dst, 1);
    tu_set_blob(&dst, 0, "cfg", 0, 0, 10, 0); /* owner 0: only a global one was saved */
    assert_rc(plan_load(&lp, sp.meta, &dst), STRATA_ENOTFOUND);
    assert_msg_has("cfg");
    tu_set_free(&dst);
    tu_set_init(&dst, 1);
    tu_set_blob(&dst, 0, "cfg", 0, -1, 9, 0);
    assert_rc(plan_load(&lp, sp.meta, &dst), STRATA_EMISMATCH);
    assert_msg_has("cfg");
    tu_set_free(&dst);
    st_save_plan_free(&sp);
    tu_set_free(&src);
}

/* ---- the overlap check against the pairwise definition ---- */

#define OV_MAX 96

typedef struct {
    st_mtensor t;
    st_mshard sh[OV_MAX];
    uint64_t off[OV_MAX][STRATA_MAX_DIMS], len[OV_MAX][STRATA_MAX_DIMS];
} ov_case;

static void ov_add(ov_case *c, const uint64_t *off, const uint64_t *len, uint64_t fs,
                   uint64_t fe)
{
    size_t i = c->t.nshards++;
    memcpy(c->off[i], off, sizeof c->off[i]);
    memcpy(c->len[i], len, sizeof c->len[i]);
    c->sh[i] = (st_mshard){c->off[i], c->len[i], fs, fe, 1, {0}, 0};
}

/* A random set of regions: a grid of boxes (each whole, or cut into flat pieces), or random
 * boxes and flat ranges; then perhaps one shard made to reach into others. */
static void ov_random(ov_case *c, tu_rng *r)
{
    memset(c, 0, sizeof *c);
    c->t.name = "t";
    c->t.ndim = (int)tu_below(r, 5);
    c->t.shards = c->sh;
    for (int d = 0; d < c->t.ndim; d++)
        c->t.shape[d] = tu_range(r, 1, 6);
    if (tu_below(r, 3)) { /* a grid: disjoint by construction */
        uint64_t cuts[STRATA_MAX_DIMS][8], ncut[STRATA_MAX_DIMS], at[STRATA_MAX_DIMS] = {0};
        for (int d = 0; d < c->t.ndim; d++) {
            ncut[d] = 0;
            cuts[d][ncut[d]++] = 0;
            for (uint64_t x = 1; x < c->t.shape[d]; x++)
                if (tu_below(r, 2))
                    cuts[d][ncut[d]++] = x;
            cuts[d][ncut[d]] = c->t.shape[d];
        }
        for (;;) {
            uint64_t off[STRATA_MAX_DIMS] = {0}, len[STRATA_MAX_DIMS] = {0}, numel = 1;
            for (int d = 0; d < c->t.ndim; d++) {
                off[d] = cuts[d][at[d]];
                len[d] = cuts[d][at[d] + 1] - off[d];
                numel *= len[d];
            }
            for (uint64_t fs = 0; fs < numel && c->t.nshards < OV_MAX - 1;) {
                uint64_t fe = tu_below(r, 3) ? numel : tu_range(r, fs + 1, numel);
                ov_add(c, off, len, fs, fe);
                fs = fe;
            }
            int d = c->t.ndim - 1;
            while (d >= 0 && ++at[d] == ncut[d])
                at[d--] = 0;
            if (d < 0)
                break;
        }
    } else { /* random regions: mostly overlapping */
        size_t n = tu_range(r, 2, 12);
        for (size_t i = 0; i < n; i++) {
            uint64_t off[STRATA_MAX_DIMS] = {0}, len[STRATA_MAX_DIMS] = {0}, numel = 1;
            for (int d = 0; d < c->t.ndim; d++) {
                off[d] = tu_below(r, c->t.shape[d]);
                len[d] = tu_range(r, 1, c->t.shape[d] - off[d]);
                numel *= len[d];
            }
            uint64_t fs = tu_below(r, numel), fe = tu_range(r, fs, numel);
            ov_add(c, off, len, fs, fe);
        }
    }
    if (c->t.nshards && tu_below(r, 2)) { /* one shard grows: its whole box, or a duplicate */
        size_t i = tu_below(r, c->t.nshards);
        if (tu_below(r, 2) || c->t.nshards >= OV_MAX) {
            c->sh[i].fs = 0;
            c->sh[i].fe = st_box_numel(c->t.ndim, c->len[i], NULL);
        } else {
            ov_add(c, c->off[i], c->len[i], c->sh[i].fs, c->sh[i].fe);
        }
    }
    for (size_t i = c->t.nshards; i > 1; i--) { /* any order */
        size_t j = tu_below(r, i);
        ov_case tmp;
        tmp.sh[0] = c->sh[i - 1];
        memcpy(tmp.off[0], c->off[i - 1], sizeof tmp.off[0]);
        memcpy(tmp.len[0], c->len[i - 1], sizeof tmp.len[0]);
        c->sh[i - 1] = c->sh[j];
        memcpy(c->off[i - 1], c->off[j], sizeof tmp.off[0]);
        memcpy(c->len[i - 1], c->len[j], sizeof tmp.len[0]);
        c->sh[j] = tmp.sh[0];
        memcpy(c->off[j], tmp.off[0], sizeof tmp.off[0]);
        memcpy(c->len[j], tmp.len[0], sizeof tmp.len[0]);
        c->sh[i - 1].off = c->off[i - 1], c->sh[i - 1].len = c->len[i - 1];
        c->sh[j].off = c->off[j], c->sh[j].len = c->len[j];
    }
}

static void test_overlap_check(void **state)
{
    (void)state;
    tu_rng r = {2026};
    static ov_case c;
    int found = 0, clean = 0;
    for (int k = 0; k < 20000; k++) {
        ov_random(&c, &r);
        int want = 0;
        for (size_t i = 0; i < c.t.nshards && !want; i++)
            for (size_t j = i + 1; j < c.t.nshards && !want; j++) {
                st_region a = {c.t.ndim, c.sh[i].off, c.sh[i].len, c.sh[i].fs, c.sh[i].fe};
                st_region b = {c.t.ndim, c.sh[j].off, c.sh[j].len, c.sh[j].fs, c.sh[j].fe};
                want = st_region_runs(&a, &b, NULL, NULL) > 0;
            }
        int rc = st_meta_check_overlap(&c.t);
        if (rc != (want ? STRATA_EOVERLAP : 0))
            fail_msg("case %d (ndim %d, %zu shards): check says %s, pairs say %s", k, c.t.ndim,
                     c.t.nshards, strata_error_name(rc), want ? "overlap" : "disjoint");
        found += want;
        clean += !want;
    }
    print_message("overlap check: %d overlapping and %d disjoint sets agree\n", found, clean);
    assert_true(found > 1000 && clean > 1000);
}

/* ---- crafted sets: where the check used to be slow, against the pairwise definition ---- */

/* The pairwise definition: do two non-empty shards of c share an element? */
static int ov_pairwise(const ov_case *c)
{
    for (size_t i = 0; i < c->t.nshards; i++)
        for (size_t j = i + 1; j < c->t.nshards; j++) {
            st_region a = {c->t.ndim, c->sh[i].off, c->sh[i].len, c->sh[i].fs, c->sh[i].fe};
            st_region b = {c->t.ndim, c->sh[j].off, c->sh[j].len, c->sh[j].fs, c->sh[j].fe};
            if (st_region_runs(&a, &b, NULL, NULL) > 0)
                return 1;
        }
    return 0;
}

/* Does region (off, len, fs, fe) of c's tensor share an element with shard j? */
static int ov_meets(const ov_case *c, const uint64_t *off, const uint64_t *len, uint64_t fs,
                    uint64_t fe, size_t j)
{
    st_region a = {c->t.ndim, off, len, fs, fe};
    st_region b = {c->t.ndim, c->sh[j].off, c->sh[j].len, c->sh[j].fs, c->sh[j].fe};
    return st_region_runs(&a, &b, NULL, NULL) > 0;
}

/* A random box of c's tensor that holds the element at global multi-index g (g NULL: any),
 * and in its row-major flattening a random range of a few elements (holding g's). */
static void ov_random_piece(ov_case *c, tu_rng *r, const uint64_t *g, uint64_t *off,
                            uint64_t *len, uint64_t *fs, uint64_t *fe)
{
    uint64_t numel = 1, at = 0;
    for (int d = 0; d < c->t.ndim; d++) {
        uint64_t x = g ? g[d] : tu_below(r, c->t.shape[d]);
        off[d] = tu_range(r, 0, x);
        len[d] = tu_range(r, x - off[d] + 1, c->t.shape[d] - off[d]);
        numel *= len[d];
        at = at * len[d] + (x - off[d]);
    }
    if (tu_chance(r, 10) && !g) {
        *fs = 0;
        *fe = numel;
        return;
    }
    uint64_t n = tu_range(r, 1, ST_MIN(numel, tu_chance(r, 50) ? 1 : 4));
    *fs = at - ST_MIN(at, tu_below(r, n));
    *fe = ST_MIN(numel, *fs + n);
}

/* Crafted sets in the regions the dim-wise split cannot separate: (0) flat pieces of
 * random, mostly intersecting boxes, kept only if disjoint from the earlier ones (greedy);
 * (1) issue 10's family: one-element pieces of distinct boxes that all hold the origin;
 * (2) sticks along each of 3 dims, woven so that none meet; (3) a pinwheel whose arms are
 * sliced into columns and rows. Then perhaps one more shard that meets another: a random
 * piece through one of its elements, or a copy. */
static void ov_crafted(ov_case *c, tu_rng *r)
{
    memset(c, 0, sizeof *c);
    c->t.name = "t";
    c->t.shards = c->sh;
    int kind = (int)tu_below(r, 4);
    uint64_t off[STRATA_MAX_DIMS] = {0}, len[STRATA_MAX_DIMS] = {0}, fs, fe;
    if (kind == 0) {
        c->t.ndim = (int)tu_range(r, 1, 5);
        for (int d = 0; d < c->t.ndim; d++)
            c->t.shape[d] = tu_range(r, 1, 7);
        for (int tries = 0; tries < 200 && c->t.nshards < OV_MAX - 1; tries++) {
            ov_random_piece(c, r, NULL, off, len, &fs, &fe);
            size_t j = 0;
            while (j < c->t.nshards && !ov_meets(c, off, len, fs, fe, j))
                j++;
            if (j == c->t.nshards)
                ov_add(c, off, len, fs, fe);
        }
    } else if (kind == 1) {
        c->t.ndim = (int)tu_range(r, 1, 4);
        uint64_t numel = 1;
        for (int d = 0; d < c->t.ndim; d++) {
            c->t.shape[d] = tu_range(r, 1, 6);
            numel *= c->t.shape[d];
        }
        for (uint64_t e = 0; e < numel && c->t.nshards < OV_MAX - 1; e++) {
            uint64_t x = e, n = 1; /* the box from the origin to element e: e is its last */
            for (int d = c->t.ndim - 1; d >= 0; d--) {
                len[d] = x % c->t.shape[d] + 1;
                x /= c->t.shape[d];
            }
            for (int d = 0; d < c->t.ndim; d++)
                n *= len[d];
            ov_add(c, off, len, n - 1, n);
        }
    } else if (kind == 2) {
        uint64_t k = tu_range(r, 1, 3);
        c->t.ndim = 3;
        for (int d = 0; d < 3; d++)
            c->t.shape[d] = 3 * k;
        for (int j = 0; j < 3; j++) /* a stick along j: residue j in the other dims */
            for (uint64_t a = 0; a < k; a++)
                for (uint64_t b = 0; b < k; b++) {
                    uint64_t v[2] = {a, b};
                    for (int d = 0, u = 0; d < 3; d++) {
                        off[d] = d == j ? 0 : 3 * v[u++] + (uint64_t)j;
                        len[d] = d == j ? 3 * k : 1;
                    }
                    uint64_t n = len[0] * len[1] * len[2], f0 = tu_below(r, n);
                    if (tu_chance(r, 50)) /* a stick, whole or in pieces */
                        ov_add(c, off, len, 0, n);
                    else {
                        ov_add(c, off, len, 0, f0);
                        ov_add(c, off, len, f0, n);
                    }
                }
    } else {
        uint64_t k = tu_range(r, 2, 8), h = 2 * k, w = 2 * k;
        c->t.ndim = 2;
        c->t.shape[0] = h;
        c->t.shape[1] = w;
        for (uint64_t x = 0; x < k; x++) { /* top arm in columns */
            uint64_t o[STRATA_MAX_DIMS] = {0, x}, l[STRATA_MAX_DIMS] = {k, 1};
            ov_add(c, o, l, 0, k);
        }
        for (uint64_t y = 0; y <= k; y++) { /* right arm in rows */
            uint64_t o[STRATA_MAX_DIMS] = {y, k}, l[STRATA_MAX_DIMS] = {1, w - k};
            ov_add(c, o, l, 0, w - k);
        }
        uint64_t arms[3][4] = {{k + 1, 1, h - k - 1, w - 1}, {k, 0, h - k, 1}, {k, 1, 1, k - 1}};
        for (int a = 0; a < 3; a++) {
            uint64_t o[STRATA_MAX_DIMS] = {arms[a][0], arms[a][1]};
            uint64_t l[STRATA_MAX_DIMS] = {arms[a][2], arms[a][3]};
            ov_add(c, o, l, 0, l[0] * l[1]);
        }
    }
    if (c->t.nshards && c->t.nshards < OV_MAX && tu_chance(r, 50)) {
        size_t j = tu_below(r, c->t.nshards);
        const st_mshard *s = &c->sh[j];
        if (s->fe > s->fs && tu_chance(r, 80)) { /* through an element of shard j */
            uint64_t e = tu_range(r, s->fs, s->fe - 1), g[STRATA_MAX_DIMS];
            for (int d = c->t.ndim - 1; d >= 0; d--) {
                g[d] = s->off[d] + e % s->len[d];
                e /= s->len[d];
            }
            ov_random_piece(c, r, g, off, len, &fs, &fe);
            ov_add(c, off, len, fs, fe);
        } else {
            ov_add(c, c->off[j], c->len[j], s->fs, s->fe);
        }
    }
    for (size_t i = c->t.nshards; i > 1; i--) { /* any order */
        size_t j = tu_below(r, i);
        st_mshard x = c->sh[i - 1];
        uint64_t xo[STRATA_MAX_DIMS], xl[STRATA_MAX_DIMS];
        memcpy(xo, c->off[i - 1], sizeof xo);
        memcpy(xl, c->len[i - 1], sizeof xl);
        c->sh[i - 1] = c->sh[j];
        memcpy(c->off[i - 1], c->off[j], sizeof xo);
        memcpy(c->len[i - 1], c->len[j], sizeof xl);
        c->sh[j] = x;
        memcpy(c->off[j], xo, sizeof xo);
        memcpy(c->len[j], xl, sizeof xl);
        c->sh[i - 1].off = c->off[i - 1], c->sh[i - 1].len = c->len[i - 1];
        c->sh[j].off = c->off[j], c->sh[j].len = c->len[j];
    }
}

static void test_overlap_crafted(void **state)
{
    (void)state;
    tu_rng r = {1010};
    static ov_case c;
    int found[4] = {0}, clean[4] = {0};
    for (int k = 0; k < 8000; k++) {
        tu_rng before = r;
        ov_crafted(&c, &r);
        int want = ov_pairwise(&c), rc = st_meta_check_overlap(&c.t);
        if (rc != (want ? STRATA_EOVERLAP : 0))
            fail_msg("crafted case %d (ndim %d, %zu shards): check says %s, pairs say %s", k,
                     c.t.ndim, c.t.nshards, strata_error_name(rc),
                     want ? "overlap" : "disjoint");
        int kind = (int)tu_below(&before, 4);
        found[kind] += want;
        clean[kind] += !want;
    }
    print_message("overlap check, crafted: %d/%d, %d/%d, %d/%d, %d/%d overlapping/disjoint sets "
                  "of greedy pieces, issue 10, sticks, pinwheels agree\n",
                  found[0], clean[0], found[1], clean[1], found[2], clean[2], found[3], clean[3]);
    for (int k = 0; k < 4; k++)
        assert_true(found[k] > 300 && clean[k] > 300);
}

/* ---- crafted sets at scale: the work of the check stays near n log n ---- */

typedef struct {
    st_mtensor t;
    st_mshard *sh;
    uint64_t *dims;
} ov_big;

static void ov_big_init(ov_big *b, int ndim, const uint64_t *shape, size_t cap)
{
    memset(b, 0, sizeof *b);
    b->sh = calloc(cap, sizeof *b->sh);
    b->dims = calloc(cap * 2 * STRATA_MAX_DIMS, sizeof *b->dims);
    assert_non_null(b->sh);
    assert_non_null(b->dims);
    b->t.name = "big";
    b->t.ndim = ndim;
    b->t.shards = b->sh;
    memcpy(b->t.shape, shape, (size_t)ndim * sizeof *shape);
}

/* Adds the box (off, len) narrowed to [fs, fe); fe 0: the whole box. */
static void ov_big_add(ov_big *b, const uint64_t *off, const uint64_t *len, uint64_t fs,
                       uint64_t fe)
{
    size_t i = b->t.nshards++;
    uint64_t *o = b->dims + i * 2 * STRATA_MAX_DIMS, *l = o + STRATA_MAX_DIMS;
    memcpy(o, off, (size_t)b->t.ndim * sizeof *off);
    memcpy(l, len, (size_t)b->t.ndim * sizeof *len);
    uint64_t n = st_box_numel(b->t.ndim, len, NULL);
    b->sh[i] = (st_mshard){o, l, fs, fe ? fe : n, !(fs == 0 && (fe == 0 || fe == n)), {0}, 0};
}

/* Checks b: the answer must be want, and the work at most 64 n log2 n. */
static void ov_big_check(ov_big *b, const char *what, int want)
{
    size_t n = b->t.nshards;
    double lg = 64 - __builtin_clzll(n);
    assert_rc(st_meta_check_overlap(&b->t), want);
    uint64_t work = st_overlap_work();
    print_message("overlap check, %s: %zu shards, %s, work %.1f n log2 n\n", what, n,
                  strata_error_name(want), (double)work / ((double)n * lg));
    assert_true((double)work <= 64.0 * (double)n * lg);
}

static void test_overlap_work(void **state)
{
    (void)state;
    ov_big b;
    /* sticks along each of 3 dims, woven so that none meet (residue j mod 3 for a stick
     * along dim j); then one stick moved onto another's line */
    const uint64_t k = 40, side = 3 * k, cube[] = {side, side, side};
    for (int bad = 0; bad < 2; bad++) {
        ov_big_init(&b, 3, cube, 3 * k * k);
        for (int j = 0; j < 3; j++)
            for (uint64_t x = 0; x < k; x++)
                for (uint64_t y = 0; y < k; y++) {
                    uint64_t off[3], len[3], v[2] = {x, y};
                    for (int d = 0, u = 0; d < 3; d++) {
                        off[d] = d == j ? 0 : 3 * v[u++] + (uint64_t)j;
                        len[d] = d == j ? side : 1;
                    }
                    if (bad && j == 2 && x == k / 2 && y == k / 3)
                        off[0] = 3 * (k / 3) + 1; /* at y's residue of a stick along dim 1 */
                    ov_big_add(&b, off, len, 0, 0);
                }
        ov_big_check(&b, "woven sticks", bad ? STRATA_EOVERLAP : 0);
        free(b.sh);
        free(b.dims);
    }
    /* an 8-dim grid, each point the last element of the box from the origin to it */
    const uint64_t four[8] = {4, 4, 4, 4, 4, 4, 4, 4};
    ov_big_init(&b, 8, four, 65536);
    for (uint64_t i = 0; i < 65536; i++) {
        uint64_t off[8] = {0}, len[8], n = 1;
        for (int d = 0; d < 8; d++) {
            len[d] = ((i >> (2 * (7 - d))) & 3) + 1;
            n *= len[d];
        }
        ov_big_add(&b, off, len, n - 1, n);
    }
    ov_big_check(&b, "8-dim grid as last elements of boxes", 0);
    free(b.sh);
    free(b.dims);
    /* a pinwheel (no cut splits it) whose top arm is cut in columns, right arm in rows */
    const uint64_t q = 30000, pin[] = {2 * q, 2 * q};
    ov_big_init(&b, 2, pin, 2 * q + 8);
    for (uint64_t x = 0; x < q; x++)
        ov_big_add(&b, (uint64_t[]){0, x}, (uint64_t[]){q, 1}, 0, 0);
    for (uint64_t y = 0; y <= q; y++)
        ov_big_add(&b, (uint64_t[]){y, q}, (uint64_t[]){1, q}, 0, 0);
    ov_big_add(&b, (uint64_t[]){q + 1, 1}, (uint64_t[]){q - 1, 2 * q - 1}, 0, 0);
    ov_big_add(&b, (uint64_t[]){q, 0}, (uint64_t[]){q, 1}, 0, 0);
    ov_big_add(&b, (uint64_t[]){q, 1}, (uint64_t[]){1, q - 1}, 0, 0);
    ov_big_check(&b, "pinwheel with sliced arms", 0);
    ov_big_add(&b, (uint64_t[]){q - 1, q - 1}, (uint64_t[]){1, 2}, 0, 0); /* across an arm */
    ov_big_check(&b, "pinwheel with sliced arms", STRATA_EOVERLAP);
    free(b.sh);
    free(b.dims);
    /* columns of 2^40 rows side by side, tied together by a one-element piece of a box
     * across all of them (no cut separates them; their rows interleave 2^40 times) */
    const uint64_t cols = 60000, rows = 1ull << 40, tall[] = {rows, cols + 2};
    ov_big_init(&b, 2, tall, cols + 4);
    ov_big_add(&b, (uint64_t[]){0, 0}, (uint64_t[]){rows, 2}, 3, 0);
    for (uint64_t c = 0; c < cols; c++)
        ov_big_add(&b, (uint64_t[]){1, 2 + c}, (uint64_t[]){rows - 1, 1}, 0, 0);
    ov_big_add(&b, (uint64_t[]){0, 0}, (uint64_t[]){2, cols + 2}, cols + 2, cols + 3);
    ov_big_check(&b, "interleaved columns of 2^40 rows", 0);
    ov_big_add(&b, (uint64_t[]){rows - 2, 0}, (uint64_t[]){2, 3}, 5, 6); /* (rows-1, 2) */
    ov_big_check(&b, "interleaved columns of 2^40 rows", STRATA_EOVERLAP);
    free(b.sh);
    free(b.dims);
}

/* Issue 10's family at scale (tensor [2, n], shard i the box [0, 2) x [0, i + 1) narrowed
 * to its element i, (0, i)), on one rank: the save plans; its metadata encodes and decodes;
 * with one more shard through element (0, n / 2) in another box, or one shard moved onto
 * its neighbour's element, both refuse it. The checks take work near n log n (no time is
 * asserted; bench_plan times them). */
static void issue10_add(tu_set *s, uint64_t n, uint64_t lo, uint64_t w, uint64_t fs)
{
    uint64_t shape[] = {2, n}, off[] = {0, lo}, len[] = {lo ? 1 : 2, w};
    tu_set_shard(s, 0, "issue10", STRATA_F32, 2, shape, off, len, 1, fs, fs + 1, 1);
}

static void test_overlap_issue10(void **state)
{
    (void)state;
    const uint64_t n = 64000;
    double lg = 64 - __builtin_clzll(n);
    uint64_t bound = (uint64_t)(64.0 * (double)n * lg); /* n log n, a generous constant */
    tu_set s;
    tu_set_init(&s, 1);
    for (uint64_t i = 0; i < n; i++)
        issue10_add(&s, n, 0, i + 1, i);
    st_save_plan p;
    double t0 = st_now();
    assert_ok(plan_save(&p, &s));
    double t1 = st_now();
    st_mtensor *t = &p.meta->tensors[0];
    assert_int_equal(t->nshards, n);
    assert_ok(st_meta_check_overlap(t));
    uint64_t work = st_overlap_work();
    assert_true(work <= bound);
    for (size_t i = 0; i < t->nshards; i++) { /* checksums: any values */
        st_extent *x = &t->shards[i].ext;
        memset(x->sums, 0x5c, st_nchunks(x->bytes, p.meta->chunk) * 8);
    }
    unsigned char *buf;
    size_t blen;
    assert_ok(st_meta_encode(p.meta, &buf, &blen));
    st_meta *back;
    double t2 = st_now();
    assert_ok(st_meta_decode(&back, buf, blen));
    double t3 = st_now();
    assert_int_equal(back->tensors[0].nshards, n);
    st_meta_free(back);
    free(buf);
    print_message("issue 10 family, %llu shards (%zu metadata bytes): plan %.3f s, decode %.3f "
                  "s, overlap check work %llu (%.1f n log2 n)\n",
                  (unsigned long long)n, blen, t1 - t0, t3 - t2, (unsigned long long)work,
                  (double)work / ((double)n * lg));

    /* shard j moved onto element j - 1 (its box holds it): the decoder refuses it */
    size_t j = 0;
    while (t->shards[j].fs != n / 3)
        j++;
    t->shards[j].fs--;
    t->shards[j].fe--;
    assert_rc(st_meta_check_overlap(t), STRATA_EOVERLAP);
    assert_msg_has("overlap");
    assert_true(st_overlap_work() <= bound);
    assert_ok(st_meta_encode(p.meta, &buf, &blen));
    back = (st_meta *)1;
    assert_rc(st_meta_decode(&back, buf, blen), STRATA_EFORMAT);
    assert_msg_has("overlap");
    assert_null(back);
    free(buf);
    st_save_plan_free(&p);

    /* one more shard: the box [0, 1) x [3, n / 2 + 1), its element n / 2 - 3 = (0, n / 2) */
    issue10_add(&s, n, 3, n / 2 - 2, n / 2 - 3);
    assert_rc(plan_save(&p, &s), STRATA_EOVERLAP);
    assert_msg_has("issue10");
    assert_true(st_overlap_work() <= bound);
    tu_set_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dedup_replicas),  cmocka_unit_test(test_balance_equal),
        cmocka_unit_test(test_balance_dp),      cmocka_unit_test(test_balance_fixed_first),
        cmocka_unit_test(test_balance_split),
        cmocka_unit_test(test_save_errors),     cmocka_unit_test(test_load_cover),
        cmocka_unit_test(test_load_empty),      cmocka_unit_test(test_load_shared_chunks),
        cmocka_unit_test(test_load_partial),    cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_rank_reads),
        cmocka_unit_test(test_overlap_check),   cmocka_unit_test(test_overlap_crafted),
        cmocka_unit_test(test_overlap_work),    cmocka_unit_test(test_overlap_issue10),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
