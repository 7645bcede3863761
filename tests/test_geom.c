/* test_geom.c - box intersection, run enumeration between two regions, and dim-0 spans:
 * hand-written cases, then random regions checked against brute-force enumeration. */
#include "core/geom.h"
#include "testutil.h"

/* ---- collecting runs ---- */

typedef struct {
    uint64_t a, b, n;
} run3;

typedef struct {
    run3 r[4096];
    size_t n;
    size_t stop_after; /* 0: never stop */
} runs;

static int collect(void *ctx, uint64_t a, uint64_t b, uint64_t n)
{
    runs *c = ctx;
    if (c->n < sizeof c->r / sizeof c->r[0])
        c->r[c->n] = (run3){a, b, n};
    c->n++;
    return c->stop_after && c->n >= c->stop_after;
}

static st_region reg(int nd, const uint64_t *off, const uint64_t *len, uint64_t fs, uint64_t fe)
{
    return (st_region){nd, off, len, fs, fe};
}

/* Asserts that st_region_runs(a, b) yields exactly the runs `want` (n of them). */
static void expect_runs(const st_region *a, const st_region *b, const run3 *want, size_t n)
{
    static runs got;
    got.n = 0;
    got.stop_after = 0;
    uint64_t total = st_region_runs(a, b, collect, &got), sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += want[i].n;
    assert_int_equal(total, sum);
    assert_int_equal(got.n, n);
    for (size_t i = 0; i < n; i++) {
        if (got.r[i].a != want[i].a || got.r[i].b != want[i].b || got.r[i].n != want[i].n)
            fail_msg("run %zu: got (a %" PRIu64 ", b %" PRIu64 ", n %" PRIu64 "), want (%" PRIu64
                     ", %" PRIu64 ", %" PRIu64 ")",
                     i, got.r[i].a, got.r[i].b, got.r[i].n, want[i].a, want[i].b, want[i].n);
    }
    /* counting without a callback gives the same total */
    assert_int_equal(st_region_runs(a, b, NULL, NULL), sum);
}

/* ---- hand-written cases ---- */

static void test_intersect(void **state)
{
    (void)state;
    uint64_t io[3], il[3];
    /* 1-D disjoint, touching, nested, partial */
    uint64_t a0[] = {0}, a5[] = {5}, b0[] = {5}, b5[] = {5};
    assert_int_equal(st_box_intersect(1, a0, a5, b0, b5, io, il), 0); /* [0,5) vs [5,10) */
    uint64_t c0[] = {1}, c3[] = {3};
    assert_int_equal(st_box_intersect(1, a0, a5, c0, c3, io, il), 1); /* nested */
    assert_int_equal(io[0], 1);
    assert_int_equal(il[0], 3);
    uint64_t d0[] = {3}, d9[] = {9};
    assert_int_equal(st_box_intersect(1, a0, a5, d0, d9, io, il), 1); /* partial */
    assert_int_equal(io[0], 3);
    assert_int_equal(il[0], 2);
    /* 2-D: overlapping in one dim only is disjoint */
    uint64_t p0[] = {0, 0}, pl[] = {4, 4}, q0[] = {2, 4}, ql[] = {4, 4};
    assert_int_equal(st_box_intersect(2, p0, pl, q0, ql, io, il), 0);
    uint64_t r0[] = {2, 3}, rl[] = {5, 5};
    assert_int_equal(st_box_intersect(2, p0, pl, r0, rl, io, il), 1);
    assert_int_equal(io[0], 2);
    assert_int_equal(io[1], 3);
    assert_int_equal(il[0], 2);
    assert_int_equal(il[1], 1);
    /* 3-D with dims of size 1 */
    uint64_t s0[] = {0, 7, 0}, sl[] = {1, 1, 1}, t0[] = {0, 7, 0}, tl[] = {1, 3, 1};
    assert_int_equal(st_box_intersect(3, s0, sl, t0, tl, io, il), 1);
    assert_int_equal(il[0] * il[1] * il[2], 1);
    uint64_t u0[] = {0, 8, 0};
    assert_int_equal(st_box_intersect(3, s0, sl, u0, tl, io, il), 0);
    /* 0-D: two scalars always share their one element */
    assert_int_equal(st_box_intersect(0, NULL, NULL, NULL, NULL, io, il), 1);
}

static void test_runs_boxes(void **state)
{
    (void)state;
    /* identical whole 3x4 boxes: one merged run */
    uint64_t z2[] = {0, 0}, l34[] = {3, 4};
    st_region a = reg(2, z2, l34, 0, 12), b = reg(2, z2, l34, 0, 12);
    expect_runs(&a, &b, (run3[]){{0, 0, 12}}, 1);

    /* whole 4x6 against the sub-box rows [1,3) x cols [2,5): a row run each */
    uint64_t l46[] = {4, 6}, o12[] = {1, 2}, l23[] = {2, 3};
    a = reg(2, z2, l46, 0, 24);
    b = reg(2, o12, l23, 0, 6);
    expect_runs(&a, &b, (run3[]){{8, 0, 3}, {14, 3, 3}}, 2);
    expect_runs(&b, &a, (run3[]){{0, 8, 3}, {3, 14, 3}}, 2);

    /* row blocks: rows [1,3) full width merge into one run */
    uint64_t o10[] = {1, 0}, l26[] = {2, 6};
    b = reg(2, o10, l26, 0, 12);
    expect_runs(&a, &b, (run3[]){{6, 0, 12}}, 1);

    /* disjoint boxes */
    uint64_t o30[] = {3, 0}, l16[] = {1, 6}, l36[] = {3, 6};
    a = reg(2, z2, l36, 0, 18);
    b = reg(2, o30, l16, 0, 6);
    expect_runs(&a, &b, NULL, 0);

    /* scalar */
    a = reg(0, NULL, NULL, 0, 1);
    b = reg(0, NULL, NULL, 0, 1);
    expect_runs(&a, &b, (run3[]){{0, 0, 1}}, 1);

    /* dims of size 1: shape 1x5x1, whole vs [0,1)x[2,4)x[0,1) */
    uint64_t z3[] = {0, 0, 0}, l151[] = {1, 5, 1}, o020[] = {0, 2, 0}, l121[] = {1, 2, 1};
    a = reg(3, z3, l151, 0, 5);
    b = reg(3, o020, l121, 0, 2);
    expect_runs(&a, &b, (run3[]){{2, 0, 2}}, 1);

    /* column split: 3x4 whole vs cols [1,3): one run per row */
    uint64_t o01[] = {0, 1}, l32[] = {3, 2};
    a = reg(2, z2, l34, 0, 12);
    b = reg(2, o01, l32, 0, 6);
    expect_runs(&a, &b, (run3[]){{1, 0, 2}, {5, 2, 2}, {9, 4, 2}}, 3);
}

static void test_runs_flat(void **state)
{
    (void)state;
    uint64_t z2[] = {0, 0}, l46[] = {4, 6};
    /* flat [5, 15) of a 4x6 box (cuts rows 0 and 2 in the middle) vs the whole box */
    st_region a = reg(2, z2, l46, 5, 15), b = reg(2, z2, l46, 0, 24);
    expect_runs(&a, &b, (run3[]){{0, 5, 10}}, 1);
    expect_runs(&b, &a, (run3[]){{5, 0, 10}}, 1);
    /* two flat ranges of the same box: overlap [10, 15) */
    b = reg(2, z2, l46, 10, 20);
    expect_runs(&a, &b, (run3[]){{5, 0, 5}}, 1);
    /* adjacent flat ranges share nothing */
    b = reg(2, z2, l46, 15, 24);
    expect_runs(&a, &b, NULL, 0);
    /* an empty flat range shares nothing */
    b = reg(2, z2, l46, 7, 7);
    expect_runs(&a, &b, NULL, 0);
    expect_runs(&b, &a, NULL, 0);
    /* flat [5, 15) vs the column box cols [2, 5): rows 0..2 clipped by the range */
    uint64_t o02[] = {0, 2}, l43[] = {4, 3};
    b = reg(2, o02, l43, 0, 12);
    /* row 0: cols 5 only in a? a holds flat 5..14 = (0,5),(1,0..5),(2,0..2);
     * b cols 2..4: (1,2..4) -> a idx 3..5, b idx 3..5; (2,2) -> a idx 9, b idx 6 */
    expect_runs(&a, &b, (run3[]){{3, 3, 3}, {9, 6, 1}}, 2);
    /* a flat piece of a sub-box vs a flat piece of the whole tensor */
    uint64_t o11[] = {1, 1}, l34[] = {3, 4};
    a = reg(2, o11, l34, 2, 9); /* box rows 1..3, cols 1..4; elements 2..8 */
    b = reg(2, z2, l46, 8, 20); /* global flat 8..19 = (1,2)..(3,1) */
    /* a elements: 2=(1,3) 3=(1,4) 4=(2,1) 5=(2,2) 6=(2,3) 7=(2,4) 8=(3,1)
     * global flats: 9, 10, 13, 14, 15, 16, 19 -> b idx 1, 2, 5..8, 11 */
    expect_runs(&a, &b, (run3[]){{0, 1, 2}, {2, 5, 4}, {6, 11, 1}}, 3);
    /* scalar with an empty range */
    a = reg(0, NULL, NULL, 0, 0);
    b = reg(0, NULL, NULL, 0, 1);
    expect_runs(&a, &b, NULL, 0);
}

static void test_runs_stop(void **state)
{
    (void)state;
    uint64_t z2[] = {0, 0}, l46[] = {4, 6}, o01[] = {0, 1}, l45[] = {4, 5};
    st_region a = reg(2, z2, l46, 0, 24), b = reg(2, o01, l45, 0, 20);
    static runs got;
    got.n = 0;
    got.stop_after = 2;
    /* stops after the second run: 2 runs of 5 elements visited */
    assert_int_equal(st_region_runs(&a, &b, collect, &got), 10);
    assert_int_equal(got.n, 2);
}

static void test_dim0(void **state)
{
    (void)state;
    uint64_t lo = 99, hi = 99;
    uint64_t o20[] = {2, 0}, l46[] = {4, 6};
    st_region r = reg(2, o20, l46, 0, 24);
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 2);
    assert_int_equal(hi, 6);
    r = reg(2, o20, l46, 5, 15); /* rows 0..2 of the box */
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 2);
    assert_int_equal(hi, 5);
    r = reg(2, o20, l46, 6, 12); /* exactly box row 1 */
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 3);
    assert_int_equal(hi, 4);
    r = reg(2, o20, l46, 11, 13); /* straddles rows 1 and 2 */
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 3);
    assert_int_equal(hi, 5);
    uint64_t o3[] = {3}, l5[] = {5};
    r = reg(1, o3, l5, 1, 3);
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 4);
    assert_int_equal(hi, 6);
    r = reg(0, NULL, NULL, 0, 1);
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 1);
    assert_int_equal(lo, 0);
    assert_int_equal(hi, 1);
    r = reg(2, o20, l46, 7, 7);
    assert_int_equal(st_region_dim0(&r, &lo, &hi), 0);
}

/* ---- random regions against brute force ---- */

typedef struct {
    int nd;
    uint64_t shape[STRATA_MAX_DIMS], off[STRATA_MAX_DIMS], len[STRATA_MAX_DIMS], fs, fe;
} rreg;

static void rand_region(tu_rng *g, int nd, const uint64_t *shape, rreg *x)
{
    x->nd = nd;
    uint64_t n = 1;
    for (int d = 0; d < nd; d++) {
        x->shape[d] = shape[d];
        x->off[d] = tu_below(g, shape[d]);
        x->len[d] = tu_range(g, 1, shape[d] - x->off[d]);
        if (tu_chance(g, 25)) { /* often the full dim, so that runs merge */
            x->off[d] = 0;
            x->len[d] = shape[d];
        }
        n *= x->len[d];
    }
    x->fs = 0;
    x->fe = n;
    if (tu_chance(g, 50)) {
        uint64_t p = tu_range(g, 0, n), q = tu_range(g, 0, n);
        x->fs = p < q ? p : q;
        x->fe = p < q ? q : p;
    }
}

/* Index in x's data of global element (multi-index gi), or -1 if x does not hold it. */
static int64_t index_in(const rreg *x, const uint64_t *gi)
{
    uint64_t f = 0;
    for (int d = 0; d < x->nd; d++) {
        if (gi[d] < x->off[d] || gi[d] >= x->off[d] + x->len[d])
            return -1;
        f = f * x->len[d] + (gi[d] - x->off[d]);
    }
    return f >= x->fs && f < x->fe ? (int64_t)(f - x->fs) : -1;
}

static void test_runs_random(void **state)
{
    (void)state;
    uint64_t seed = tu_env_u64("STRATA_SEED", 0x6e0d5eed);
    size_t cases = (size_t)tu_env_u64("STRATA_GEOM_CASES", 20000);
    print_message("geom: %zu random cases, seed %" PRIu64 "\n", cases, seed);
    static runs got;
    static int64_t ea[4096], eb[4096];
    for (size_t c = 0; c < cases; c++) {
        tu_rng g = {tu_mix(seed + c)};
        int nd = (int)tu_below(&g, 5); /* 0..4 dims of up to 7, or 5..8 dims of up to 2..3 */
        if (tu_chance(&g, 10))
            nd = (int)tu_range(&g, 5, STRATA_MAX_DIMS);
        uint64_t shape[STRATA_MAX_DIMS];
        for (int d = 0; d < nd; d++)
            shape[d] = tu_chance(&g, 20) ? 1 : tu_range(&g, 1, nd <= 4 ? 7 : nd <= 6 ? 3 : 2);
        rreg A, B;
        rand_region(&g, nd, shape, &A);
        rand_region(&g, nd, shape, &B);
        /* brute force: common elements in global row-major order */
        size_t ne = 0;
        uint64_t total = 1, gi[STRATA_MAX_DIMS];
        for (int d = 0; d < nd; d++)
            total *= shape[d];
        for (uint64_t f = 0; f < total; f++) {
            uint64_t t = f;
            for (int d = nd - 1; d >= 0; d--) {
                gi[d] = t % shape[d];
                t /= shape[d];
            }
            int64_t ia = index_in(&A, gi), ib = index_in(&B, gi);
            if (ia >= 0 && ib >= 0) {
                ea[ne] = ia;
                eb[ne] = ib;
                ne++;
            }
        }
        st_region ra = reg(nd, A.off, A.len, A.fs, A.fe), rb = reg(nd, B.off, B.len, B.fs, B.fe);
        got.n = 0;
        got.stop_after = 0;
        uint64_t n = st_region_runs(&ra, &rb, collect, &got);
        /* expand the runs: they must list exactly the brute-force elements, in order */
        size_t k = 0;
        int ok = n == ne;
        for (size_t i = 0; ok && i < got.n; i++) {
            ok = got.r[i].n > 0;
            /* maximal: a run never continues the previous one in both regions */
            if (ok && i > 0 && got.r[i - 1].a + got.r[i - 1].n == got.r[i].a &&
                got.r[i - 1].b + got.r[i - 1].n == got.r[i].b)
                ok = 0;
            for (uint64_t j = 0; ok && j < got.r[i].n; j++, k++)
                ok = k < ne && (int64_t)(got.r[i].a + j) == ea[k] &&
                     (int64_t)(got.r[i].b + j) == eb[k];
        }
        ok = ok && k == ne;
        /* st_region_dim0 is the tight dim-0 span of each region */
        for (int w = 0; ok && w < 2; w++) {
            const rreg *x = w ? &B : &A;
            const st_region *r = w ? &rb : &ra;
            uint64_t lo, hi, blo = UINT64_MAX, bhi = 0;
            for (uint64_t f = x->fs; f < x->fe; f++) {
                uint64_t row = 1;
                for (int d = 1; d < nd; d++)
                    row *= x->len[d];
                uint64_t r0 = nd ? x->off[0] + f / row : 0;
                blo = r0 < blo ? r0 : blo;
                bhi = r0 + 1 > bhi ? r0 + 1 : bhi;
            }
            int has = st_region_dim0(r, &lo, &hi);
            ok = x->fs < x->fe ? has == 1 && lo == blo && hi == bhi : has == 0;
        }
        if (!ok) {
            print_error("case %zu (STRATA_SEED=%" PRIu64 "): ndim %d, %zu common elements, "
                        "runs counted %" PRIu64 " in %zu runs\n",
                        c, seed, nd, ne, n, got.n);
            for (int w = 0; w < 2; w++) {
                const rreg *x = w ? &B : &A;
                print_error("  %c: fs %" PRIu64 " fe %" PRIu64 ":", w ? 'b' : 'a', x->fs, x->fe);
                for (int d = 0; d < nd; d++)
                    print_error(" [%" PRIu64 "+%" PRIu64 " of %" PRIu64 "]", x->off[d], x->len[d],
                                x->shape[d]);
                print_error("\n");
            }
            fail();
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_intersect),  cmocka_unit_test(test_runs_boxes),
        cmocka_unit_test(test_runs_flat),  cmocka_unit_test(test_runs_stop),
        cmocka_unit_test(test_dim0),       cmocka_unit_test(test_runs_random),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
