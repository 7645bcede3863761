/* test_cast.c - loading with STRATA_LOAD_CAST: every pair of floating dtypes over edge
 * values (all f16 and bf16 bit patterns, every rounding midpoint of the narrower formats
 * and its neighbours, subnormals, overflow, infinities, NaNs), checked against a reference
 * written independently of src/core/convert.c (the hardware's double -> float, and for f16
 * / bf16 the nearest value found in a table of the format), loaded resharded and as flat
 * pieces, in one process and by 3 ranks of a thread communicator (through the node's
 * segment, the exchange, and both); exact integer widening; refused pairs' exact codes;
 * a safetensors source read in pieces that are not whole elements. */
#include <math.h>
#include <pthread.h>

#include "testutil.h"
#include "threadcomm.h"

static char dir[512];
TU_TMPDIR_GROUP(dir, "cast")

static const strata_dtype floats[] = {STRATA_F64, STRATA_F32, STRATA_F16, STRATA_BF16};
#define NFLOAT 4
#define COLS 257

/* ---- the reference ---- */

static double p2(int e)
{
    double x = 1;
    for (; e > 0; e--)
        x *= 2;
    for (; e < 0; e++)
        x /= 2;
    return x;
}

static int ebits(strata_dtype t) { return t == STRATA_F16 ? 5 : 8; }     /* f16, bf16 */
static int mbits(strata_dtype t) { return t == STRATA_F16 ? 10 : 7; }

/* A 16-bit float's value (exact in a double); NaN for NaNs. */
static double val16(strata_dtype t, uint16_t b)
{
    int E = ebits(t), M = mbits(t), bias = (1 << (E - 1)) - 1;
    int exp = (b >> M) & ((1 << E) - 1);
    uint32_t man = b & ((1u << M) - 1);
    double sign = (b >> 15) ? -1 : 1, v;
    if (exp == (1 << E) - 1)
        v = man ? NAN : INFINITY;
    else if (exp == 0)
        v = man * p2(1 - bias - M);
    else
        v = (double)((1u << M) | man) * p2(exp - bias - M);
    return sign * v;
}

static double value_of(strata_dtype t, uint64_t bits)
{
    if (t == STRATA_F64) {
        double d;
        memcpy(&d, &bits, 8);
        return d;
    }
    if (t == STRATA_F32) {
        uint32_t u = (uint32_t)bits;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return val16(t, (uint16_t)bits);
}

static uint64_t bits_of(strata_dtype t, double v) /* v exact in t */
{
    if (t == STRATA_F64) {
        uint64_t b;
        memcpy(&b, &v, 8);
        return b;
    }
    if (t == STRATA_F32) {
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        return u;
    }
    uint16_t lo = 0, hi = (uint16_t)(((1u << ebits(t)) - 1) << mbits(t)); /* +inf */
    double a = fabs(v);
    while (lo < hi) { /* the first pattern >= |v| */
        uint16_t mid = (uint16_t)(lo + (hi - lo) / 2);
        if (val16(t, mid) < a)
            lo = (uint16_t)(mid + 1);
        else
            hi = mid;
    }
    return (signbit(v) ? 0x8000u : 0) | lo;
}

/* The nearest 16-bit value to v (ties to the even pattern; beyond the largest finite
 * plus half a step: infinity), by search in the format's values. */
static uint16_t round16(strata_dtype t, double v)
{
    uint16_t sign = signbit(v) ? 0x8000 : 0, inf = (uint16_t)(((1u << ebits(t)) - 1) << mbits(t));
    double a = fabs(v);
    uint16_t lo = 0, hi = inf; /* the last pattern with value <= a */
    while (lo < hi) {
        uint16_t mid = (uint16_t)(lo + (hi - lo + 1) / 2);
        if (val16(t, mid) <= a)
            lo = mid;
        else
            hi = (uint16_t)(mid - 1);
    }
    if (lo == inf)
        return sign | inf;
    double below = val16(t, lo);
    /* the next value up; past the largest finite, where the next binade would begin */
    double above = lo + 1 == inf ? p2((1 << (ebits(t) - 1))) : val16(t, (uint16_t)(lo + 1));
    double mid = below + (above - below) / 2; /* exact: one more bit than the format */
    uint16_t r = a < mid ? lo : a > mid ? (uint16_t)(lo + 1) : (lo & 1) ? (uint16_t)(lo + 1) : lo;
    return sign | r;
}

/* What a cast from `from` to `to` must give for the saved bits b. */
static uint64_t expect_bits(strata_dtype from, strata_dtype to, uint64_t b)
{
    double v = value_of(from, b);
    if (to == STRATA_F64)
        return bits_of(STRATA_F64, v);
    if (to == STRATA_F32)
        return bits_of(STRATA_F32, (float)v); /* the hardware: to nearest even, once */
    return round16(to, v);
}

static int is_nan(strata_dtype t, uint64_t b) { return isnan(value_of(t, b)); }

static int sign_of(strata_dtype t, uint64_t b) { return (int)(b >> (8 * strata_dtype_size(t) - 1)) & 1; }

/* ---- the values saved ---- */

typedef struct {
    uint64_t *b;
    size_t n, cap;
} vec;

static void push(vec *v, uint64_t x)
{
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 1024;
        v->b = realloc(v->b, v->cap * sizeof *v->b);
        assert_non_null(v->b);
    }
    v->b[v->n++] = x;
}

/* A value exact in `in`, with its neighbours (one pattern either side), both signs. */
static void push_around(vec *v, strata_dtype in, double x)
{
    uint64_t b = bits_of(in, x), top = 1ull << (8 * strata_dtype_size(in) - 1);
    for (int s = 0; s < 2; s++) {
        uint64_t c = b | (s ? top : 0);
        push(v, c);
        push(v, c + 1);
        if ((c & (top - 1)) != 0)
            push(v, c - 1);
    }
}

/* The saved values of dtype t: its edges; every 16-bit pattern for f16 / bf16; for wider
 * ones every rounding midpoint of the narrower formats (and f32's, sampled, for f64), each
 * with its neighbours; random patterns. */
static void make_values(vec *v, strata_dtype t)
{
    size_t W = strata_dtype_size(t);
    uint64_t top = 1ull << (8 * W - 1);
    if (W == 2) {
        for (uint64_t b = 0; b < 65536; b++)
            push(v, b);
        return;
    }
    static const uint64_t f32e[] = {0, 1, 2, 0x007fffff, 0x00800000, 0x00800001, 0x3f800000,
                                    0x7f7fffff, 0x7f800000, 0x7f800001, 0x7fbfffff, 0x7fc00000,
                                    0x7fc12345, 0x7fffffff};
    static const uint64_t f64e[] = {0, 1, 2, 0x000fffffffffffffull, 0x0010000000000000ull,
                                    0x3ff0000000000000ull, 0x7fefffffffffffffull,
                                    0x7ff0000000000000ull, 0x7ff0000000000001ull,
                                    0x7ff7ffffffffffffull, 0x7ff8000000000000ull,
                                    0x7ff8123456789abcull, 0x7fffffffffffffffull};
    const uint64_t *e = W == 4 ? f32e : f64e;
    size_t ne = W == 4 ? sizeof f32e / 8 : sizeof f64e / 8;
    for (size_t i = 0; i < ne; i++) {
        push(v, e[i]);
        push(v, e[i] | top);
    }
    for (int k = 0; k < 2; k++) { /* midpoints of f16, then bf16 */
        strata_dtype n = k ? STRATA_BF16 : STRATA_F16;
        uint16_t inf = (uint16_t)(((1u << ebits(n)) - 1) << mbits(n));
        for (uint16_t b = 0; b < inf; b++) {
            double lo = val16(n, b);
            double hi = b + 1 == inf ? p2(1 << (ebits(n) - 1)) : val16(n, (uint16_t)(b + 1));
            push_around(v, t, lo + (hi - lo) / 2);
        }
    }
    if (W == 8) { /* f32 midpoints: the edges, and a sample */
        tu_rng r = {7};
        for (int i = 0; i < 60000; i++) {
            uint32_t b = i < 32 ? (uint32_t)i : i < 64 ? 0x7f7fffe0u + (uint32_t)(i - 32)
                                                      : (uint32_t)tu_below(&r, 0x7f7fffffu);
            float lo, hi;
            uint32_t b1 = b + 1;
            memcpy(&lo, &b, 4);
            memcpy(&hi, &b1, 4);
            double h = b1 == 0x7f800000u ? p2(128) : (double)hi;
            push_around(v, t, (double)lo + (h - (double)lo) / 2);
        }
    }
    tu_rng r = {t + 1};
    for (int i = 0; i < 20000; i++)
        push(v, W == 4 ? (uint32_t)tu_next(&r) : tu_next(&r));
}

/* ---- the checkpoint: for each float dtype S, "v_S" [rows, COLS] saved by 3 ranks in row
 * blocks, and "f_S", the same values, saved as 3 flat pieces of the whole tensor ---- */

static vec vals[NFLOAT];
static uint64_t rows[NFLOAT];
static char ck[600];

static const char *dn(strata_dtype t) { return strata_dtype_name(t); }

static void store(unsigned char *p, size_t W, uint64_t b)
{
    memcpy(p, &b, W); /* little-endian: the low W bytes */
}

static uint64_t fetch(const unsigned char *p, size_t W)
{
    uint64_t b = 0;
    memcpy(&b, p, W);
    return b;
}

/* The saved value at global element i of S's tensor (the values, then padding zeros). */
static uint64_t saved_at(int s, uint64_t i) { return i < vals[s].n ? vals[s].b[i] : 0; }

static int group_setup(void **state)
{
    int rc = tu_group_setup(state);
    if (rc)
        return rc;
    snprintf(ck, sizeof ck, "%s/ck", dir);
    strata_state *st[3];
    void *bufs[64];
    int nb = 0;
    char names[2 * NFLOAT][16];
    for (int r = 0; r < 3; r++)
        assert_ok(strata_state_new(&st[r]));
    for (int s = 0; s < NFLOAT; s++) {
        make_values(&vals[s], floats[s]);
        rows[s] = (vals[s].n + COLS - 1) / COLS;
        size_t W = strata_dtype_size(floats[s]);
        uint64_t shape[2] = {rows[s], COLS}, N = rows[s] * COLS;
        snprintf(names[2 * s], 16, "v_%s", dn(floats[s]));
        snprintf(names[2 * s + 1], 16, "f_%s", dn(floats[s]));
        uint64_t rcut[4] = {0, rows[s] / 7, rows[s] / 2 + 3, rows[s]};
        uint64_t fcut[4] = {0, N / 3 + 11, N - 1000, N};
        for (int r = 0; r < 3; r++) {
            uint64_t off[2] = {rcut[r], 0}, len[2] = {rcut[r + 1] - rcut[r], COLS};
            unsigned char *a = malloc(len[0] * COLS * W), *b = malloc((fcut[r + 1] - fcut[r]) * W);
            for (uint64_t i = 0; i < len[0] * COLS; i++)
                store(a + i * W, W, saved_at(s, rcut[r] * COLS + i));
            for (uint64_t i = fcut[r]; i < fcut[r + 1]; i++)
                store(b + (i - fcut[r]) * W, W, saved_at(s, i));
            strata_shard box = {.name = names[2 * s], .dtype = floats[s], .ndim = 2,
                                .global_shape = shape, .offsets = off, .lengths = len, .data = a};
            strata_shard flat = {.name = names[2 * s + 1], .dtype = floats[s], .ndim = 2,
                                 .global_shape = shape, .flat = 1, .flat_start = fcut[r],
                                 .flat_end = fcut[r + 1], .data = b};
            assert_ok(strata_state_add_shard(st[r], &box));
            assert_ok(strata_state_add_shard(st[r], &flat));
            bufs[nb++] = a;
            bufs[nb++] = b;
        }
    }
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    so.chunk_bytes = 4096;
    const char *uri = ck;
    assert_ok(strata_save(NULL, NULL, &uri, 1, st, 3, &so));
    for (int r = 0; r < 3; r++)
        strata_state_free(st[r]);
    for (int i = 0; i < nb; i++)
        free(bufs[i]);
    return 0;
}

static int group_teardown(void **state)
{
    for (int s = 0; s < NFLOAT; s++)
        free(vals[s].b);
    return tu_group_teardown(state);
}

/* ---- one rank's requests: every other float dtype's tensors, as target dtype T ---- */

typedef struct {
    int s;                 /* source dtype index */
    int flat;
    uint64_t c0, c1;       /* box: columns [c0, c1), all rows; flat: elements [c0, c1) */
    unsigned char *data;
} req;

typedef struct {
    strata_state *st;
    req rq[2 * NFLOAT];
    int n;
} rank_reqs;

/* Rank r of 3 asks for T: of v_S its column block, of f_S a flat range cut elsewhere
 * than saved. */
static void make_reqs(rank_reqs *q, int r, strata_dtype T)
{
    static const uint64_t ccut[4] = {0, 100, 181, COLS};
    memset(q, 0, sizeof *q);
    assert_ok(strata_state_new(&q->st));
    size_t W = strata_dtype_size(T);
    for (int s = 0; s < NFLOAT; s++) {
        if (floats[s] == T)
            continue;
        char name[16];
        uint64_t shape[2] = {rows[s], COLS}, N = rows[s] * COLS;
        uint64_t fcut[4] = {0, N / 5, N * 3 / 5 + 1, N};
        for (int flat = 0; flat < 2; flat++) {
            req *x = &q->rq[q->n++];
            x->s = s;
            x->flat = flat;
            x->c0 = flat ? fcut[r] : ccut[r];
            x->c1 = flat ? fcut[r + 1] : ccut[r + 1];
            uint64_t n = flat ? x->c1 - x->c0 : rows[s] * (x->c1 - x->c0);
            x->data = malloc(n * W);
            assert_non_null(x->data);
            memset(x->data, 0xA5, n * W);
            snprintf(name, sizeof name, "%c_%s", flat ? 'f' : 'v', dn(floats[s]));
            uint64_t off[2] = {0, x->c0}, len[2] = {rows[s], x->c1 - x->c0};
            strata_shard sh = {.name = name, .dtype = T, .ndim = 2, .global_shape = shape,
                               .offsets = flat ? NULL : off, .lengths = flat ? NULL : len,
                               .flat = flat, .flat_start = flat ? x->c0 : 0,
                               .flat_end = flat ? x->c1 : 0, .data = x->data};
            assert_ok(strata_state_add_shard(q->st, &sh));
        }
    }
}

/* Every element of every request against the reference; frees the requests. */
static void check_reqs(rank_reqs *q, strata_dtype T, const char *how)
{
    size_t W = strata_dtype_size(T);
    for (int k = 0; k < q->n; k++) {
        req *x = &q->rq[k];
        strata_dtype S = floats[x->s];
        uint64_t n = x->flat ? x->c1 - x->c0 : rows[x->s] * (x->c1 - x->c0);
        for (uint64_t i = 0; i < n; i++) {
            uint64_t w = x->c1 - x->c0;
            uint64_t g = x->flat ? x->c0 + i : (i / w) * COLS + x->c0 + i % w;
            uint64_t b = saved_at(x->s, g), got = fetch(x->data + i * W, W);
            uint64_t want = expect_bits(S, T, b);
            int ok = is_nan(S, b) ? is_nan(T, got) && sign_of(T, got) == sign_of(S, b)
                                  : got == want;
            if (!ok)
                fail_msg("%s: %s %s -> %s, element %llu: saved 0x%llx, got 0x%llx, want 0x%llx",
                         how, x->flat ? "flat" : "box", dn(S), dn(T), (unsigned long long)g,
                         (unsigned long long)b, (unsigned long long)got,
                         (unsigned long long)want);
        }
        free(x->data);
    }
    strata_state_free(q->st);
}

/* Every float pair, 3 ranks in this process. */
static void test_floats_local(void **state)
{
    (void)state;
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = STRATA_LOAD_CAST;
    const char *uri = ck;
    for (int t = 0; t < NFLOAT; t++) {
        rank_reqs q[3];
        strata_state *st[3];
        for (int r = 0; r < 3; r++) {
            make_reqs(&q[r], r, floats[t]);
            st[r] = q[r].st;
        }
        assert_ok(strata_load(NULL, NULL, &uri, 1, st, 3, &lo));
        for (int r = 0; r < 3; r++)
            check_reqs(&q[r], floats[t], "in process");
    }
}

/* ---- 3 ranks of a thread communicator ---- */

typedef struct {
    hub *h;
    tcomm tc;
    strata_state *st;
    unsigned flags;
    int rc;
    char msg[512];
} dist_job;

static void *dist_run(void *p)
{
    dist_job *j = p;
    strata_comm *c;
    j->rc = strata_comm_host(&c, &tops, &j->tc, j->tc.rank, j->h->size);
    if (!j->rc) {
        strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
        lo.flags = j->flags;
        lo.max_io_bytes = 16384; /* many reads, many rounds */
        const char *uri = ck;
        j->rc = strata_load(NULL, c, &uri, 1, &j->st, 1, &lo);
        strata_comm_free(c);
    }
    snprintf(j->msg, sizeof j->msg, "%s", strata_error_last());
    return NULL;
}

/* Loads st[r] on 3 threads, rank r with flags[r]; results in jobs. */
static void dist_load(strata_state *st[3], const unsigned flags[3], dist_job jobs[3])
{
    hub h = {.size = 3};
    const void *send[3];
    const size_t *sc[3];
    h.send = send;
    h.scounts = sc;
    pthread_barrier_init(&h.bar, NULL, 3);
    pthread_t th[3];
    for (int r = 0; r < 3; r++) {
        jobs[r] = (dist_job){&h, {&h, r}, st[r], flags[r], 0, ""};
        assert_int_equal(pthread_create(&th[r], NULL, dist_run, &jobs[r]), 0);
    }
    for (int r = 0; r < 3; r++)
        pthread_join(th[r], NULL);
    pthread_barrier_destroy(&h.bar);
}

/* Every float pair, 3 ranks of a communicator: each reading its own bytes on one node, bytes
 * sent between nodes (converted by the receiver), and both (two nodes of 2 and 1 ranks). */
static void test_floats_dist(void **state)
{
    (void)state;
    static const char *modes[][2] = {{NULL, NULL}, {"STRATA_LOAD_NODES", "3"},
                                     {"STRATA_LOAD_NODES", "2"}};
    for (size_t m = 0; m < 3; m++) {
        if (modes[m][0])
            setenv(modes[m][0], modes[m][1], 1);
        for (int t = 0; t < NFLOAT; t++) {
            rank_reqs q[3];
            strata_state *st[3];
            for (int r = 0; r < 3; r++) {
                make_reqs(&q[r], r, floats[t]);
                st[r] = q[r].st;
            }
            dist_job jobs[3];
            const unsigned fl[3] = {STRATA_LOAD_CAST, STRATA_LOAD_CAST, STRATA_LOAD_CAST};
            dist_load(st, fl, jobs);
            for (int r = 0; r < 3; r++)
                if (jobs[r].rc)
                    fail_msg("rank %d: %s: %s", r, strata_error_name(jobs[r].rc), jobs[r].msg);
            char how[64];
            snprintf(how, sizeof how, "3 ranks%s%s%s%s", modes[m][0] ? ", " : "",
                     modes[m][0] ? modes[m][0] : "", modes[m][0] ? "=" : "",
                     modes[m][0] ? modes[m][1] : "");
            for (int r = 0; r < 3; r++)
                check_reqs(&q[r], floats[t], how);
        }
        if (modes[m][0])
            unsetenv(modes[m][0]);
    }
}

/* Without the flag a dtype mismatch stays STRATA_EMISMATCH; with it, a pair it does not
 * convert is STRATA_EMISMATCH naming the tensor and both dtypes; with a communicator a
 * rank without the flag fails every rank. */
static void test_refused(void **state)
{
    (void)state;
    const char *uri = ck;
    uint64_t shape[2] = {rows[1], COLS};
    void *buf = malloc(rows[1] * COLS * 8);
    strata_shard sh = {.name = "v_f32", .dtype = STRATA_BF16, .ndim = 2, .global_shape = shape,
                       .data = buf};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    assert_ok(strata_state_add_shard(st, &sh));
    assert_rc(strata_load(NULL, NULL, &uri, 1, &st, 1, NULL), STRATA_EMISMATCH);
    assert_msg_has("'v_f32'");
    assert_msg_has("STRATA_LOAD_CAST would convert it");
    strata_state_free(st);

    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = STRATA_LOAD_CAST;
    static const strata_dtype bad[] = {STRATA_I32, STRATA_I64, STRATA_U8, STRATA_BOOL,
                                       STRATA_FP8_E4M3, STRATA_FP8_E5M2};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        sh.dtype = bad[k];
        assert_ok(strata_state_new(&st));
        assert_ok(strata_state_add_shard(st, &sh));
        assert_rc(strata_load(NULL, NULL, &uri, 1, &st, 1, &lo), STRATA_EMISMATCH);
        char want[64];
        snprintf(want, sizeof want, "not f32 to %s", dn(bad[k]));
        assert_msg_has("'v_f32'");
        assert_msg_has(want);
        strata_state_free(st);
    }

    /* 3 ranks: rank 1 alone has no flag; the plan fails on every rank alike */
    strata_state *sts[3];
    for (int r = 0; r < 3; r++) {
        assert_ok(strata_state_new(&sts[r]));
        sh.dtype = STRATA_BF16;
        assert_ok(strata_state_add_shard(sts[r], &sh));
    }
    dist_job jobs[3];
    const unsigned fl[3] = {STRATA_LOAD_CAST, 0, STRATA_LOAD_CAST};
    dist_load(sts, fl, jobs);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(jobs[r].rc, STRATA_EMISMATCH);
        if (!strstr(jobs[r].msg, "rank 1 requests bf16"))
            fail_msg("rank %d: %s", r, jobs[r].msg);
        strata_state_free(sts[r]);
    }
    free(buf);
}

/* STRATA_LOAD_WIDEN: strata_load_converts answers for every pair of dtypes as a table
 * written here says (equal; with WIDEN the exact pairs; with CAST those and the rounding
 * float pairs); a load with WIDEN converts a float to a wider float value for value and
 * refuses a narrowing one (STRATA_EMISMATCH, saying STRATA_LOAD_CAST would convert it);
 * with a communicator each rank's own level travels with its request. */
static int exact_float_pair(strata_dtype a, strata_dtype b)
{
    return (b == STRATA_F64 && (a == STRATA_F32 || a == STRATA_F16 || a == STRATA_BF16)) ||
           (b == STRATA_F32 && (a == STRATA_F16 || a == STRATA_BF16));
}

static int is_float_dt(strata_dtype t)
{
    return t == STRATA_F64 || t == STRATA_F32 || t == STRATA_F16 || t == STRATA_BF16;
}

/* A state requesting the whole of v_<from> as dtype `to` into *buf (allocated). */
static strata_state *whole(int s, strata_dtype to, unsigned char **buf)
{
    static char name[16];
    snprintf(name, sizeof name, "v_%s", dn(floats[s]));
    uint64_t shape[2] = {rows[s], COLS};
    *buf = malloc(rows[s] * COLS * strata_dtype_size(to));
    assert_non_null(*buf);
    strata_shard sh = {.name = name, .dtype = to, .ndim = 2, .global_shape = shape, .data = *buf};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    assert_ok(strata_state_add_shard(st, &sh));
    return st;
}

static void check_whole(int s, strata_dtype to, const unsigned char *buf, const char *how)
{
    size_t W = strata_dtype_size(to);
    for (uint64_t i = 0; i < rows[s] * COLS; i++) {
        uint64_t b = saved_at(s, i), got = fetch(buf + i * W, W);
        int ok = is_nan(floats[s], b) ? is_nan(to, got) && sign_of(to, got) == sign_of(floats[s], b)
                                      : got == expect_bits(floats[s], to, b) &&
                                            value_of(to, got) == value_of(floats[s], b);
        if (!ok)
            fail_msg("%s: %s -> %s element %llu: saved 0x%llx got 0x%llx", how, dn(floats[s]),
                     dn(to), (unsigned long long)i, (unsigned long long)b, (unsigned long long)got);
    }
}

static void test_widen(void **state)
{
    (void)state;
    for (int a = 0; a <= STRATA_BOOL; a++)
        for (int b = 0; b <= STRATA_BOOL; b++) {
            strata_dtype A = (strata_dtype)a, B = (strata_dtype)b;
            int fa = is_float_dt(A), fb = is_float_dt(B), ints = !fa && !fb &&
                     A != STRATA_FP8_E4M3 && A != STRATA_FP8_E5M2 && B != STRATA_FP8_E4M3 &&
                     B != STRATA_FP8_E5M2;
            /* the integer pairs test_integers loads (bool, u8, i8, i16, i32 widened) */
            int ib = A == STRATA_BOOL ? 1 : A == STRATA_U8 ? 8 : 8 * (int)strata_dtype_size(A) - 1;
            int cap = B == STRATA_F64 ? 53 : B == STRATA_F32 ? 24 : B == STRATA_F16 ? 11
                      : B == STRATA_BF16 ? 8 : B == STRATA_BOOL ? 1 : B == STRATA_U8 ? 8
                      : 8 * (int)strata_dtype_size(B) - 1;
            int int_ok = (ints || (!fa && fb && A != STRATA_FP8_E4M3 && A != STRATA_FP8_E5M2)) &&
                         A != STRATA_I64 && ib <= cap &&
                         (fb || (B != STRATA_BOOL && B != STRATA_U8) ||
                          A == STRATA_BOOL || A == STRATA_U8);
            int same = A == B, exact = same || exact_float_pair(A, B) || int_ok;
            int any = exact || (fa && fb);
            if (strata_load_converts(A, B, 0) != same ||
                strata_load_converts(A, B, STRATA_LOAD_WIDEN) != exact ||
                strata_load_converts(A, B, STRATA_LOAD_CAST) != any ||
                strata_load_converts(A, B, STRATA_LOAD_CAST | STRATA_LOAD_WIDEN) != any)
                fail_msg("strata_load_converts(%s, %s): %d %d %d, want %d %d %d", dn(A), dn(B),
                         strata_load_converts(A, B, 0),
                         strata_load_converts(A, B, STRATA_LOAD_WIDEN),
                         strata_load_converts(A, B, STRATA_LOAD_CAST), same, exact, any);
        }

    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = STRATA_LOAD_WIDEN;
    const char *uri = ck;
    int widened = 0;
    for (int s = 0; s < NFLOAT; s++)
        for (int t = 0; t < NFLOAT; t++) {
            if (s == t)
                continue;
            unsigned char *buf;
            strata_state *st = whole(s, floats[t], &buf);
            int rc = strata_load(NULL, NULL, &uri, 1, &st, 1, &lo);
            if (exact_float_pair(floats[s], floats[t])) {
                if (rc)
                    fail_msg("%s -> %s: %s", dn(floats[s]), dn(floats[t]), strata_error_last());
                check_whole(s, floats[t], buf, "WIDEN");
                widened++;
            } else {
                assert_rc(rc, STRATA_EMISMATCH);
                assert_msg_has("a narrowing conversion");
                assert_msg_has("STRATA_LOAD_CAST would convert it");
            }
            strata_state_free(st);
            free(buf);
        }
    assert_int_equal(widened, 5);

    /* without a flag an exact pair is refused, naming the flag that converts it */
    unsigned char *buf;
    strata_state *st = whole(3, STRATA_F32, &buf); /* bf16 -> f32 */
    assert_rc(strata_load(NULL, NULL, &uri, 1, &st, 1, NULL), STRATA_EMISMATCH);
    assert_msg_has("STRATA_LOAD_WIDEN would convert it");
    strata_state_free(st);
    free(buf);

    /* 3 ranks, levels mixed (WIDEN, CAST, WIDEN): bf16 -> f32 loads on every rank; f32 ->
     * bf16 fails on every rank alike, naming rank 0 (which only widens) */
    const unsigned fl[3] = {STRATA_LOAD_WIDEN, STRATA_LOAD_CAST, STRATA_LOAD_WIDEN};
    for (int k = 0; k < 2; k++) {
        int s = k ? 1 : 3;
        strata_dtype to = k ? STRATA_BF16 : STRATA_F32;
        strata_state *sts[3];
        unsigned char *bufs[3];
        for (int r = 0; r < 3; r++)
            sts[r] = whole(s, to, &bufs[r]);
        dist_job jobs[3];
        dist_load(sts, fl, jobs);
        for (int r = 0; r < 3; r++) {
            if (!k) {
                if (jobs[r].rc)
                    fail_msg("rank %d: %s", r, jobs[r].msg);
                check_whole(s, to, bufs[r], "3 ranks, WIDEN");
            } else {
                assert_int_equal(jobs[r].rc, STRATA_EMISMATCH);
                if (!strstr(jobs[r].msg, "rank 0 requests bf16") ||
                    !strstr(jobs[r].msg, "STRATA_LOAD_CAST would convert it"))
                    fail_msg("rank %d: %s", r, jobs[r].msg);
            }
            strata_state_free(sts[r]);
            free(bufs[r]);
        }
    }
}

/* Integers and bool: the exact widenings load value for value; narrowing, float to
 * integer and i64 to float are refused. */
static void test_integers(void **state)
{
    (void)state;
    char ick[600];
    snprintf(ick, sizeof ick, "%s/ints", dir);
    enum { N = 1000 };
    static const strata_dtype its[] = {STRATA_BOOL, STRATA_U8, STRATA_I8, STRATA_I16,
                                       STRATA_I32, STRATA_I64};
    const int nit = (int)(sizeof its / sizeof its[0]);
    int64_t v[6][N];
    unsigned char *data[6];
    strata_state *st;
    assert_ok(strata_state_new(&st));
    uint64_t shape[1] = {N};
    tu_rng rng = {3};
    for (int i = 0; i < nit; i++) {
        size_t W = strata_dtype_size(its[i]);
        data[i] = malloc(N * W);
        for (int k = 0; k < N; k++) {
            uint64_t x = tu_next(&rng);
            if (k < 4) /* the extremes */
                x = k == 0 ? 0 : k == 1 ? ~0ull : k == 2 ? 1ull << (8 * W - 1) : (1ull << (8 * W - 1)) - 1;
            store(data[i] + k * W, W, its[i] == STRATA_BOOL ? x & 1 : x);
            uint64_t b = fetch(data[i] + k * W, W);
            v[i][k] = its[i] == STRATA_BOOL || its[i] == STRATA_U8 ? (int64_t)b
                      : W == 1                                     ? (int8_t)b
                      : W == 2                                     ? (int16_t)b
                      : W == 4                                     ? (int32_t)b
                                                                   : (int64_t)b;
        }
        strata_shard sh = {.name = dn(its[i]), .dtype = its[i], .ndim = 1, .global_shape = shape,
                           .data = data[i]};
        assert_ok(strata_state_add_shard(st, &sh));
    }
    strata_save_opts so = STRATA_SAVE_OPTS_INIT;
    so.flags = STRATA_SAVE_NO_SYNC;
    const char *uri = ick;
    assert_ok(strata_save(NULL, NULL, &uri, 1, &st, 1, &so));
    strata_state_free(st);
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    static const strata_dtype targets[] = {STRATA_BOOL, STRATA_U8, STRATA_I8, STRATA_I16,
                                           STRATA_I32, STRATA_I64, STRATA_F64, STRATA_F32,
                                           STRATA_F16, STRATA_BF16};
    int loaded = 0;
    /* every conversion of integers is exact: STRATA_LOAD_WIDEN makes each one too */
    for (int pass = 0; pass < 2; pass++) {
        lo.flags = pass ? STRATA_LOAD_WIDEN : STRATA_LOAD_CAST;
        for (int i = 0; i < nit; i++)
            for (size_t t = 0; t < sizeof targets / sizeof targets[0]; t++) {
                strata_dtype T = targets[t];
                if (T == its[i])
                    continue;
                int is_float = T == STRATA_F64 || T == STRATA_F32 || T == STRATA_F16 || T == STRATA_BF16;
                /* the magnitude bits of the source; the target's capacity */
                int sb = its[i] == STRATA_BOOL ? 1 : its[i] == STRATA_U8 ? 8 : 8 * (int)strata_dtype_size(its[i]) - 1;
                int s_signed = its[i] != STRATA_BOOL && its[i] != STRATA_U8;
                int cap = T == STRATA_F64 ? 53 : T == STRATA_F32 ? 24 : T == STRATA_F16 ? 11
                          : T == STRATA_BF16 ? 8 : T == STRATA_BOOL ? 1 : T == STRATA_U8 ? 8
                          : 8 * (int)strata_dtype_size(T) - 1;
                int t_signed = is_float || (T != STRATA_BOOL && T != STRATA_U8);
                int ok = its[i] != STRATA_I64 && sb <= cap && (t_signed || !s_signed);
                size_t W = strata_dtype_size(T);
                unsigned char *out = malloc(N * W);
                strata_shard sh = {.name = dn(its[i]), .dtype = T, .ndim = 1, .global_shape = shape,
                                   .data = out};
                assert_ok(strata_state_new(&st));
                assert_ok(strata_state_add_shard(st, &sh));
                int rc = strata_load(NULL, NULL, &uri, 1, &st, 1, &lo);
                if (!ok) {
                    if (rc != STRATA_EMISMATCH)
                        fail_msg("%s -> %s: %s, want STRATA_EMISMATCH", dn(its[i]), dn(T),
                                 strata_error_name(rc));
                } else {
                    if (rc)
                        fail_msg("%s -> %s: %s: %s", dn(its[i]), dn(T), strata_error_name(rc),
                                 strata_error_last());
                    for (int k = 0; k < N; k++) {
                        uint64_t got = fetch(out + k * W, W), want;
                        if (T == STRATA_F64) {
                            double d = (double)v[i][k];
                            memcpy(&want, &d, 8);
                        } else if (T == STRATA_F32) {
                            float f = (float)v[i][k];
                            uint32_t u;
                            memcpy(&u, &f, 4);
                            want = u;
                        } else if (is_float) {
                            want = round16(T, (double)v[i][k]);
                            assert_true(val16(T, (uint16_t)want) == (double)v[i][k]); /* exact */
                        } else {
                            want = (uint64_t)v[i][k] & (W == 8 ? ~0ull : (1ull << (8 * W)) - 1);
                        }
                        if (got != want)
                            fail_msg("%s -> %s element %d: got 0x%llx want 0x%llx", dn(its[i]),
                                     dn(T), k, (unsigned long long)got, (unsigned long long)want);
                    }
                    loaded++;
                }
                strata_state_free(st);
                free(out);
            }
    }
    assert_int_equal(loaded, 2 * 29); /* the pairs convert.h lists, with either flag */
    for (int i = 0; i < nit; i++)
        free(data[i]);
    tu_rmrf(ick);
}

/* A safetensors source has 1-byte "chunks": reads of an odd max_io_bytes must still never
 * split an element between two pieces of a run. */
static void test_safetensors_pieces(void **state)
{
    (void)state;
    char out[600];
    snprintf(out, sizeof out, "%s/st", dir);
    assert_ok(strata_export_safetensors(NULL, ck, out, NULL));
    int s = 1; /* f32 */
    uint64_t shape[2] = {rows[s], COLS}, N = rows[s] * COLS;
    unsigned char *buf = malloc(N * 2);
    strata_shard sh = {.name = "v_f32", .dtype = STRATA_BF16, .ndim = 2, .global_shape = shape,
                       .data = buf};
    strata_state *st;
    assert_ok(strata_state_new(&st));
    assert_ok(strata_state_add_shard(st, &sh));
    strata_load_opts lo = STRATA_LOAD_OPTS_INIT;
    lo.flags = STRATA_LOAD_CAST;
    lo.max_io_bytes = 4099;
    const char *uri = out;
    assert_ok(strata_load(NULL, NULL, &uri, 1, &st, 1, &lo));
    for (uint64_t i = 0; i < N; i++) {
        uint64_t b = saved_at(s, i), got = fetch(buf + 2 * i, 2);
        int ok = is_nan(STRATA_F32, b) ? is_nan(STRATA_BF16, got)
                                       : got == expect_bits(STRATA_F32, STRATA_BF16, b);
        if (!ok)
            fail_msg("element %llu: saved 0x%llx got 0x%llx", (unsigned long long)i,
                     (unsigned long long)b, (unsigned long long)got);
    }
    strata_state_free(st);
    free(buf);
    tu_rmrf(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_floats_local),
        cmocka_unit_test(test_floats_dist),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_widen),
        cmocka_unit_test(test_integers),
        cmocka_unit_test(test_safetensors_pieces),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
