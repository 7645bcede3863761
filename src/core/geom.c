/* geom.c - box intersection and run enumeration between two shard regions. */
#include "geom.h"

#include <assert.h>

uint64_t st_box_numel(int ndim, const uint64_t *len, int *overflow)
{
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++)
        if (!st_mul_ok(n, len[i], &n)) {
            if (overflow)
                *overflow = 1;
            return 0;
        }
    return n;
}

int st_box_intersect(int ndim, const uint64_t *ao, const uint64_t *al, const uint64_t *bo,
                     const uint64_t *bl, uint64_t *io, uint64_t *il)
{
    for (int i = 0; i < ndim; i++) {
        uint64_t lo = ao[i] > bo[i] ? ao[i] : bo[i];
        uint64_t ae = ao[i] + al[i], be = bo[i] + bl[i];
        uint64_t hi = ae < be ? ae : be;
        if (hi <= lo)
            return 0;
        io[i] = lo;
        il[i] = hi - lo;
    }
    return 1;
}

/* Shared state of one enumeration: the intersection box I, split into k outer dims that
 * are iterated and an inner contiguous run of L elements. */
typedef struct {
    int k;
    uint64_t L;
    uint64_t io[STRATA_MAX_DIMS], il[STRATA_MAX_DIMS];
    uint64_t as[STRATA_MAX_DIMS], bs[STRATA_MAX_DIMS]; /* strides of a's and b's boxes */
    const st_region *a, *b;
} runs_ctx;

/* Flat positions in a's and b's boxes of the first element of outer run t. */
static void run_pos(const runs_ctx *c, uint64_t t, uint64_t *pa, uint64_t *pb)
{
    uint64_t xa = 0, xb = 0;
    for (int j = c->k - 1; j >= 0; j--) {
        uint64_t m = t % c->il[j];
        t /= c->il[j];
        uint64_t g = c->io[j] + m;
        xa += (g - c->a->off[j]) * c->as[j];
        xb += (g - c->b->off[j]) * c->bs[j];
    }
    int k = c->k;
    if (k < c->a->ndim) {
        xa += (c->io[k] - c->a->off[k]) * c->as[k];
        xb += (c->io[k] - c->b->off[k]) * c->bs[k];
        for (int j = k + 1; j < c->a->ndim; j++) { /* full dims: offset equals box offset */
            assert(c->io[j] == c->a->off[j] && c->io[j] == c->b->off[j]);
        }
    }
    *pa = xa;
    *pb = xb;
}

/* First t in [0, K) for which run t ends after flat position f in a (which=0) or b. */
static uint64_t first_ending_after(const runs_ctx *c, uint64_t K, int which, uint64_t f)
{
    uint64_t lo = 0, hi = K;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2, pa, pb;
        run_pos(c, mid, &pa, &pb);
        uint64_t p = which ? pb : pa;
        if (p + c->L > f)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* First t in [0, K) whose run starts at or after flat position f. */
static uint64_t first_starting_at(const runs_ctx *c, uint64_t K, int which, uint64_t f)
{
    uint64_t lo = 0, hi = K;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2, pa, pb;
        run_pos(c, mid, &pa, &pb);
        uint64_t p = which ? pb : pa;
        if (p >= f)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

uint64_t st_region_runs(const st_region *a, const st_region *b, st_run_fn fn, void *ctx)
{
    assert(a->ndim == b->ndim);
    int nd = a->ndim;
    runs_ctx c = {.a = a, .b = b};
    if (a->fs >= a->fe || b->fs >= b->fe)
        return 0;
    if (!st_box_intersect(nd, a->off, a->len, b->off, b->len, c.io, c.il))
        return 0;
    uint64_t sa = 1, sb = 1;
    for (int j = nd - 1; j >= 0; j--) {
        c.as[j] = sa;
        c.bs[j] = sb;
        sa *= a->len[j];
        sb *= b->len[j];
    }
    /* Merge trailing dims that are full in I, a and b into one contiguous run. */
    int k = nd;
    uint64_t L = 1;
    if (nd > 0) {
        k = nd - 1;
        L = c.il[k];
        while (k > 0 && c.il[k] == a->len[k] && c.il[k] == b->len[k]) {
            k--;
            L *= c.il[k];
        }
    }
    c.k = k;
    c.L = L;
    uint64_t K = 1;
    for (int j = 0; j < k; j++)
        K *= c.il[j];

    uint64_t t0 = first_ending_after(&c, K, 0, a->fs);
    uint64_t t1 = first_ending_after(&c, K, 1, b->fs);
    uint64_t tlo = t0 > t1 ? t0 : t1;
    uint64_t e0 = first_starting_at(&c, K, 0, a->fe);
    uint64_t e1 = first_starting_at(&c, K, 1, b->fe);
    uint64_t thi = e0 < e1 ? e0 : e1;

    uint64_t total = 0;
    for (uint64_t t = tlo; t < thi; t++) {
        uint64_t pa, pb;
        run_pos(&c, t, &pa, &pb);
        uint64_t lo = 0, hi = L;
        if (a->fs > pa && a->fs - pa > lo)
            lo = a->fs - pa;
        if (b->fs > pb && b->fs - pb > lo)
            lo = b->fs - pb;
        if (a->fe - pa < hi)
            hi = a->fe - pa;
        if (b->fe - pb < hi)
            hi = b->fe - pb;
        if (hi <= lo)
            continue;
        total += hi - lo;
        if (fn && fn(ctx, pa + lo - a->fs, pb + lo - b->fs, hi - lo))
            break;
    }
    return total;
}

int st_region_dim0(const st_region *r, uint64_t *lo, uint64_t *hi)
{
    if (r->fs >= r->fe)
        return 0;
    if (r->ndim == 0) {
        *lo = 0;
        *hi = 1;
        return 1;
    }
    uint64_t row = st_box_numel(r->ndim - 1, r->len + 1, NULL);
    if (row == 0)
        return 0;
    *lo = r->off[0] + r->fs / row;
    *hi = r->off[0] + (r->fe - 1) / row + 1;
    return 1;
}
