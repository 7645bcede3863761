/* test_plan_scale.c - the save planner at scale: the replica rule (main copies and copies
 * marked STRATA_SHARD_REPLICA; two overlapping main copies named by rank), the same plan
 * from a coordinator's summaries (refs) as from full descriptions, and layouts prone to
 * quadratic work (thousands of pieces of one tensor, thousands of holders of one piece),
 * held to near-linear bounds on the planners' work counters, not on time. */
#include "core/geom.h"
#include "engine/dist.h"
#include "plan/plan.h"
#include "testutil.h"

#define CHUNK 4096u

/* ---- views built by hand (no data: the planner never reads it) ---- */

typedef struct {
    st_entry *e;
    size_t n, cap;
    int *rank;
} entries;

static st_entry *add(entries *s, int rank, const char *name, strata_dtype dt, int ndim,
                     const uint64_t *shape, const uint64_t *off, const uint64_t *len,
                     uint64_t fs, uint64_t fe, int replica)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->e = realloc(s->e, s->cap * sizeof *s->e);
        s->rank = realloc(s->rank, s->cap * sizeof *s->rank);
        assert_non_null(s->e);
        assert_non_null(s->rank);
    }
    st_entry *x = &s->e[s->n];
    *x = (st_entry){.name = name, .dtype = dt, .ndim = ndim, .replica = replica};
    for (int d = 0; d < ndim; d++) {
        x->shape[d] = shape[d];
        x->off[d] = off ? off[d] : 0;
        x->len[d] = len ? len[d] : shape[d];
    }
    uint64_t n = st_box_numel(ndim, x->len, NULL);
    x->fs = fe ? fs : 0;
    x->fe = fe ? fe : n;
    x->bytes = (x->fe - x->fs) * strata_dtype_size(dt);
    s->rank[s->n++] = rank;
    return x;
}

/* Views of nranks ranks over s (entries added in rank order), with every shard in sh (as
 * in one process). */
static st_rank_view *full_views(const entries *s, int nranks)
{
    st_rank_view *v = calloc((size_t)nranks, sizeof *v);
    assert_non_null(v);
    for (size_t i = 0; i < s->n; i++) {
        st_rank_view *w = &v[s->rank[i]];
        if (!w->sh)
            w->sh = &s->e[i];
        assert_ptr_equal(w->sh + w->nsh, &s->e[i]); /* in rank order */
        w->nsh++;
    }
    return v;
}

static void entries_free(entries *s)
{
    free(s->e);
    free(s->rank);
}

static void one_1d(entries *s, int rank, const char *name, uint64_t n, uint64_t fs, uint64_t fe,
                   int replica)
{
    uint64_t shape[] = {n};
    add(s, rank, name, STRATA_F32, 1, shape, NULL, NULL, fs, fe, replica);
}

static int plan_of(st_save_plan *p, const entries *s, int nranks)
{
    st_rank_view *v = full_views(s, nranks);
    int rc = st_plan_save(p, v, nranks, CHUNK, 3);
    free(v);
    return rc;
}

/* ---- the replica rule ---- */

/* A marked copy identical to a main copy is one more holder of that piece: saved once,
 * by whichever balances the writes. */
static void test_replica_identical(void **state)
{
    (void)state;
    entries s = {0};
    one_1d(&s, 0, "a", 4096, 0, 0, 0);
    one_1d(&s, 0, "b", 4096, 0, 0, 0);
    one_1d(&s, 1, "a", 4096, 0, 0, 1);
    one_1d(&s, 1, "b", 4096, 0, 0, 1);
    st_save_plan p;
    assert_ok(plan_of(&p, &s, 2));
    assert_int_equal(p.npieces, 2);
    assert_int_equal(p.meta->ntensors, 2);
    /* one piece each: the copies let rank 1 take one */
    assert_int_equal(p.writer_bytes[0], 4096 * 4);
    assert_int_equal(p.writer_bytes[1], 4096 * 4);
    st_save_plan_free(&p);
    entries_free(&s);
}

/* Megatron's tensor-parallel copy of a replicated tensor, cut elsewhere by ZeRO: marked,
 * identical to no main piece, not saved; the main pieces hold the whole tensor. */
static void test_replica_cut_elsewhere(void **state)
{
    (void)state;
    entries s = {0};
    one_1d(&s, 0, "b", 12, 0, 6, 0);
    one_1d(&s, 1, "b", 12, 6, 12, 0);
    one_1d(&s, 2, "b", 12, 0, 4, 1);
    one_1d(&s, 3, "b", 12, 4, 12, 1);
    st_save_plan p;
    assert_ok(plan_of(&p, &s, 4));
    assert_int_equal(p.meta->tensors[0].nshards, 2);
    assert_int_equal(p.writer_bytes[0], 6 * 4);
    assert_int_equal(p.writer_bytes[1], 6 * 4);
    assert_int_equal(p.writer_bytes[2] + p.writer_bytes[3], 0);
    st_save_plan_free(&p);
    entries_free(&s);
}

/* A copy that no main copy holds: STRATA_EUNFILLED naming the tensor and the copy's rank;
 * the same with every rank marked. */
static void test_replica_without_main(void **state)
{
    (void)state;
    entries s = {0};
    one_1d(&s, 0, "b", 12, 0, 6, 0);
    one_1d(&s, 1, "b", 12, 0, 6, 1); /* identical: fine */
    one_1d(&s, 2, "b", 12, 0, 4, 1); /* inside the main piece, but the tensor is not whole */
    st_save_plan p;
    assert_rc(plan_of(&p, &s, 3), STRATA_EUNFILLED);
    assert_msg_has("'b'");
    assert_msg_has("rank 2");
    assert_msg_has("6 of the tensor's 12");
    entries_free(&s);

    memset(&s, 0, sizeof s);
    one_1d(&s, 0, "c", 8, 0, 0, 1);
    one_1d(&s, 1, "c", 8, 0, 0, 1);
    assert_rc(plan_of(&p, &s, 2), STRATA_EUNFILLED);
    assert_msg_has("'c'");
    assert_msg_has("rank 0");
    entries_free(&s);
}

/* Two main copies that overlap without being identical: STRATA_EOVERLAP naming both
 * ranks (not their places in the metadata); marking one as a copy is the fix. */
static void test_overlapping_mains(void **state)
{
    (void)state;
    entries s = {0};
    one_1d(&s, 3, "w", 10, 0, 6, 0);
    one_1d(&s, 4, "w", 10, 6, 10, 0);
    one_1d(&s, 5, "w", 10, 4, 10, 0);
    st_save_plan p;
    assert_rc(plan_of(&p, &s, 6), STRATA_EOVERLAP);
    assert_msg_has("'w'");
    assert_msg_has("rank 5");
    assert_msg_has("elements [4, 10)");
    assert_true(strstr(strata_error_last(), "rank 3") || strstr(strata_error_last(), "rank 4"));
    s.e[2].replica = 1;
    assert_ok(plan_of(&p, &s, 6));
    assert_int_equal(p.meta->tensors[0].nshards, 2);
    st_save_plan_free(&p);
    entries_free(&s);
}

/* The public API: the flag is accepted (another bit is not), and a save in one process of
 * a layout with marked copies loads back bitwise into another layout. */
static void test_replica_api(void **state)
{
    (void)state;
    strata_state *st;
    assert_ok(strata_state_new(&st));
    uint64_t shape[] = {4};
    float x[4] = {0};
    strata_shard d = {.name = "v", .dtype = STRATA_F32, .ndim = 1, .global_shape = shape,
                      .data = x, .flags = STRATA_SHARD_REPLICA | STRATA_SHARD_UNCHANGED};
    assert_ok(strata_state_add_shard(st, &d));
    d.flags = 1u << 2;
    assert_rc(strata_state_add_shard(st, &d), STRATA_EINVAL);
    strata_state_free(st);

    char dir[512];
    tu_tmpdir(dir, sizeof dir, "replica");
    tu_set s;
    tu_set_init(&s, 6); /* tp 2 (rows of w; b replicated) x dp 3, ZeRO pieces of the f32 copy */
    static const uint64_t ws[] = {5, 7}, bs[] = {9};
    for (int r = 0; r < 6; r++) {
        int t = r % 2, dp = r / 2;
        uint64_t off[] = {t ? 2 : 0, 0}, len[] = {t ? 3 : 2, 7};
        unsigned copy = dp ? STRATA_SHARD_REPLICA : 0;
        tu_set_shard_flags(&s, r, "w", STRATA_BF16, 2, ws, off, len, 0, 0, 0, 1, copy);
        tu_set_shard_flags(&s, r, "b", STRATA_BF16, 1, bs, NULL, NULL, 0, 0, 0, 1,
                           copy | (t ? STRATA_SHARD_REPLICA : 0));
        /* ZeRO: the f32 state of (w box, b) concatenated, cut over dp: on tp rank 1 the
         * uneven rows move b's cut, so its pieces there are copies of no main piece */
        uint64_t wn = len[0] * 7, total = wn + 9, lo = total * (uint64_t)dp / 3,
                 hi = total * (uint64_t)(dp + 1) / 3;
        if (lo < wn)
            tu_set_shard(&s, r, "ow", STRATA_F32, 2, ws, off, len, 1, lo, hi < wn ? hi : wn, 1);
        if (hi > wn)
            tu_set_shard_flags(&s, r, "ob", STRATA_F32, 1, bs, NULL, NULL, 1,
                               lo > wn ? lo - wn : 0, hi - wn, 1, t ? STRATA_SHARD_REPLICA : 0);
    }
    const char *uri = dir;
    strata_save_opts o = STRATA_SAVE_OPTS_INIT;
    o.flags = STRATA_SAVE_NO_SYNC;
    o.chunk_bytes = CHUNK;
    strata_stats stats = STRATA_STATS_INIT;
    assert_ok(strata_save(&stats, NULL, &uri, 1, s.st, 6, &o));
    /* every distinct element once: w 35 bf16, b 9 bf16, ow 35 f32, ob 9 f32 */
    assert_int_equal(stats.data_bytes, 35 * 2 + 9 * 2 + 35 * 4 + 9 * 4);
    tu_set l;
    tu_set_init(&l, 1);
    tu_set_shard(&l, 0, "w", STRATA_BF16, 2, ws, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&l, 0, "b", STRATA_BF16, 1, bs, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&l, 0, "ow", STRATA_F32, 2, ws, NULL, NULL, 0, 0, 0, 0);
    tu_set_shard(&l, 0, "ob", STRATA_F32, 1, bs, NULL, NULL, 0, 0, 0, 0);
    assert_ok(strata_load(NULL, NULL, &uri, 1, l.st, 1, NULL));
    assert_int_equal(tu_set_check(&l), 0);
    tu_set_free(&l);
    tu_set_free(&s);
    tu_rmrf(dir);
}

/* ---- refs: the coordinator's summaries plan the same as full descriptions ---- */

/* A small Megatron layout: tp ranks (rows of w uneven; b replicated over tp), dp copies of
 * the bf16 params marked, ZeRO pieces of their f32 state (b's cut elsewhere on tp rank 1:
 * copies of no main piece). */
static void megatron(entries *s, int tp, int dp)
{
    static const uint64_t ws[] = {37, 16}, bs[] = {23};
    for (int r = 0; r < tp * dp; r++) {
        int t = r % tp, d = r / tp;
        uint64_t off[] = {37 * (uint64_t)t / (uint64_t)tp, 0};
        uint64_t len[] = {37 * (uint64_t)(t + 1) / (uint64_t)tp - off[0], 16};
        add(s, r, "w", STRATA_BF16, 2, ws, off, len, 0, 0, d != 0);
        add(s, r, "b", STRATA_BF16, 1, bs, NULL, NULL, 0, 0, d != 0 || t != 0);
        uint64_t wn = len[0] * 16, total = wn + 23;
        uint64_t lo = total * (uint64_t)d / (uint64_t)dp, hi = total * (uint64_t)(d + 1) / (uint64_t)dp;
        if (lo < wn)
            add(s, r, "opt.w", STRATA_F32, 2, ws, off, len, lo, hi < wn ? hi : wn, 0);
        if (hi > wn)
            add(s, r, "opt.b", STRATA_F32, 1, bs, NULL, NULL, lo > wn ? lo - wn : 0, hi - wn, t != 0);
    }
}

static void encode_meta(const st_meta *m, unsigned char **buf, size_t *len)
{
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t i = 0; i < m->tensors[t].nshards; i++) {
            const st_extent *x = &m->tensors[t].shards[i].ext;
            memset(x->sums, 0, st_nchunks(x->bytes, m->chunk) * 8);
        }
    assert_ok(st_meta_encode(m, buf, len));
}

static void same_plans(const st_save_plan *a, const st_save_plan *b)
{
    unsigned char *ba, *bb;
    size_t la, lb;
    encode_meta(a->meta, &ba, &la);
    encode_meta(b->meta, &bb, &lb);
    assert_int_equal(la, lb);
    assert_memory_equal(ba, bb, la);
    free(ba);
    free(bb);
    assert_int_equal(a->npieces, b->npieces);
    for (size_t i = 0; i < a->npieces; i++) {
        assert_int_equal(a->pieces[i].writer, b->pieces[i].writer);
        assert_int_equal(a->pieces[i].local, b->pieces[i].local);
        assert_int_equal(a->pieces[i].src_off, b->pieces[i].src_off);
    }
}

static void test_refs_same_plan(void **state)
{
    (void)state;
    enum { TP = 4, DP = 6, P = TP * DP };
    entries s = {0};
    megatron(&s, TP, DP);
    st_rank_view *full = full_views(&s, P);
    st_save_plan a, b, c;
    assert_ok(st_plan_save(&a, full, P, CHUNK, 3));
    /* the coordinator's view: each rank's local plan encoded and decoded, copies as refs */
    st_buf wire = {0};
    size_t counts[P];
    for (int r = 0; r < P; r++) {
        size_t at = wire.n;
        st_encode_local_plan(&wire, &full[r]);
        counts[r] = wire.n - at;
    }
    assert_false(wire.oom);
    st_arena arena = {0};
    st_rank_view coord[P];
    assert_ok(st_decode_all(&arena, wire.p, counts, P, -1, NULL, coord));
    size_t nref = 0;
    for (int r = 0; r < P; r++)
        nref += coord[r].nref;
    assert_true(nref > (size_t)P); /* the dp copies travel as refs */
    assert_ok(st_plan_save(&b, coord, P, CHUNK, 3));
    same_plans(&a, &b);
    /* and by hand: mains with their registration indices, copies as st_ref_of */
    st_rank_view hand[P];
    st_ref *refs = calloc(s.n, sizeof *refs);
    st_entry *mains = calloc(s.n, sizeof *mains);
    uint32_t *reg = calloc(s.n, sizeof *reg);
    size_t nm = 0, nr = 0;
    for (int r = 0; r < P; r++) {
        hand[r] = (st_rank_view){.sh = mains + nm, .ref = refs + nr, .reg = reg + nm};
        for (size_t i = 0; i < full[r].nsh; i++) {
            const st_entry *e = &full[r].sh[i];
            if (e->replica) {
                refs[nr++] = st_ref_of(e, (uint32_t)i);
                hand[r].nref++;
            } else {
                reg[nm] = (uint32_t)i;
                mains[nm++] = *e;
                hand[r].nsh++;
            }
        }
    }
    assert_ok(st_plan_save(&c, hand, P, CHUNK, 3));
    same_plans(&a, &c);
    /* a ref whose tensor no main registers (another shape): named by rank and index */
    st_entry odd = s.e[1];
    odd.shape[0] = 24;
    refs[0] = st_ref_of(&odd, refs[0].local);
    st_save_plan d;
    assert_rc(st_plan_save(&d, hand, P, CHUNK, 3), STRATA_EUNFILLED);
    assert_msg_has("STRATA_SHARD_REPLICA");
    free(refs);
    free(mains);
    free(reg);
    st_save_plan_free(&a);
    st_save_plan_free(&b);
    st_save_plan_free(&c);
    st_arena_free(&arena);
    free(wire.p);
    free(full);
    entries_free(&s);
}

/* ---- layouts prone to quadratic work ---- */

/* One 1 GiB tensor held whole by 4,096 ranks (one main, the others marked): split into
 * 4,096 pieces, one per holder. Balancing them costs holders + pieces x log(holders), not
 * pieces x holders (16.7M). */
static void test_many_holders(void **state)
{
    (void)state;
    enum { P = 4096 };
    entries s = {0};
    uint64_t shape[] = {65536, 4096};
    for (int r = 0; r < P; r++)
        add(&s, r, "big", STRATA_F32, 2, shape, NULL, NULL, 0, 0, r != 0);
    st_save_plan p;
    assert_ok(plan_of(&p, &s, P));
    assert_int_equal(p.npieces, P);
    for (int r = 0; r < P; r++)
        assert_int_equal(p.writer_bytes[r], (uint64_t)65536 * 4096 * 4 / P);
    uint64_t work = st_plan_save_work();
    print_message("save work %llu for %d registrations\n", (unsigned long long)work, P);
    assert_true(work < 64 * (uint64_t)P);
    st_save_plan_free(&p);
    entries_free(&s);
}

/* Megatron's mixture of experts: [512 experts, 4096] router-like weights cut by columns
 * into 4,096 pieces (one per rank), with 4 data-parallel copies of each (marked); loaded
 * by 4,096 ranks each a column shifted by one. Every piece spans all of dim 0, so an
 * index on dim 0 alone would visit every piece for every request (16.7M pairs). */
static void test_many_pieces(void **state)
{
    (void)state;
    enum { E = 512, C = 4096, DP = 4, P = C * DP };
    entries s = {0};
    uint64_t shape[] = {E, C};
    for (int r = 0; r < P; r++) {
        uint64_t off[] = {0, (uint64_t)(r % C)}, len[] = {E, 1};
        add(&s, r, "experts.router", STRATA_BF16, 2, shape, off, len, 0, 0, r >= C);
    }
    st_save_plan p;
    assert_ok(plan_of(&p, &s, P));
    assert_int_equal(p.npieces, C);
    uint64_t work = st_plan_save_work();
    print_message("save work %llu for %d registrations\n", (unsigned long long)work, P);
    assert_true(work < 64 * (uint64_t)P);
    entries l = {0};
    for (int r = 0; r < C; r++) {
        uint64_t off[] = {0, (uint64_t)((r + 1) % C)}, len[] = {E, 1};
        add(&l, r, "experts.router", STRATA_BF16, 2, shape, off, len, 0, 0, 0);
    }
    st_rank_view *v = full_views(&l, C);
    st_io_plan lp;
    assert_ok(st_plan_load(&lp, p.meta, v, C, 1u << 20));
    assert_int_equal(lp.request_bytes, (uint64_t)E * C * 2);
    uint64_t lw = st_plan_load_work();
    print_message("load work %llu for %d requests of %d pieces\n", (unsigned long long)lw, C, C);
    assert_true(lw < 8 * (uint64_t)C);
    st_io_plan_free(&lp);
    free(v);
    entries_free(&l);
    st_save_plan_free(&p);
    entries_free(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_replica_identical),  cmocka_unit_test(test_replica_cut_elsewhere),
        cmocka_unit_test(test_replica_without_main), cmocka_unit_test(test_overlapping_mains),
        cmocka_unit_test(test_replica_api),        cmocka_unit_test(test_refs_same_plan),
        cmocka_unit_test(test_many_holders),       cmocka_unit_test(test_many_pieces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
