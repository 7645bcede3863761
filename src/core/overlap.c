/* overlap.c - do any two of a tensor's regions share an element (overlap.h)? */
#include "overlap.h"

#include <stdlib.h>

#include "util.h"

/* The search (overlap.h). Exact, and near-linear on every input. Two stages:
 * 1. Shards can only share an element if their spans (the indices each touches) intersect
 *    along every dim. So the shards are split recursively, dim by dim, into clusters whose
 *    spans along that dim connect (different clusters cannot overlap): n log n per dim.
 * 2. A cluster that no dim splits is checked exactly: shards with one box by their flat
 *    ranges (sorted). If it holds several boxes, every shard is cut into at most
 *    2 ndim - 1 whole boxes (the partial rows at both ends of its flat range, and the whole
 *    rows between), and these are searched for two that intersect by a segment-tree divide
 *    and conquer over the dims that vary (Zomorodian and Edelsbrunner's box intersection,
 *    stopped at the first pair): O(m log^D m) for m boxes varying in D dims, without ever
 *    comparing box against box pairwise or enumerating the rows of a box. */

static _Thread_local uint64_t ov_work; /* work units of this thread's last check */

uint64_t st_overlap_work(void)
{
    return ov_work;
}

typedef struct {
    uint64_t lo, hi;
    size_t idx;
} span0;

static int cmp_span0(const void *a, const void *b)
{
    const span0 *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : (x->idx < y->idx ? -1 : x->idx > y->idx);
}

/* The indices [lo, hi) of dim d that region r touches: tight for dim 0, the box's for the
 * others (a superset for flat ranges). An empty region gets [0, 0). */
static void span_of(const st_region *r, int d, uint64_t *lo, uint64_t *hi)
{
    if (r->fe <= r->fs) {
        *lo = *hi = 0;
    } else if (d == 0) {
        if (!st_region_dim0(r, lo, hi))
            *lo = *hi = 0;
    } else {
        *lo = r->off[d];
        *hi = r->off[d] + r->len[d];
    }
}

/* The regions of one check, and the pair it found. */
typedef struct {
    const st_region *r;
    int nd;
    size_t a, b;
} ov_set;

static int overlap_pair(ov_set *t, size_t a, size_t b)
{
    t->a = ST_MIN(a, b);
    t->b = ST_MAX(a, b);
    return 1;
}

static int same_box(const ov_set *t, const st_region *a, const st_region *b)
{
    for (int d = 0; d < t->nd; d++)
        if (a->off[d] != b->off[d] || a->len[d] != b->len[d])
            return 0;
    return 1;
}

static int cmp_box_fs(const void *pa, const void *pb, void *ctx)
{
    const ov_set *t = ctx;
    const st_region *a = &t->r[*(const size_t *)pa], *b = &t->r[*(const size_t *)pb];
    for (int d = 0; d < t->nd; d++) {
        if (a->off[d] != b->off[d])
            return a->off[d] < b->off[d] ? -1 : 1;
        if (a->len[d] != b->len[d])
            return a->len[d] < b->len[d] ? -1 : 1;
    }
    return a->fs < b->fs ? -1 : a->fs > b->fs;
}

/* A group of shards with one box: idx[start, end), their flat ranges within [fs, fe). */
typedef struct {
    size_t start, end;
    uint64_t fs, fe;
} box_group;

/* -- whole boxes of a cluster --
 * A shard's flat range [fs, fe) of its box runs, in row-major order, from multi-index p to
 * multi-index q. With j0 the first dim where p and q differ (ndim - 1 if none), it is the
 * union of disjoint whole boxes, each a point in dims < level, a range in dim `level` and
 * the whole box in dims > level:
 *   middle (level j0):         p[j0] + !hf .. q[j0] + tf, the prefix p[0..j0) (= q's)
 *   head   (level j0 < j <= ha): p[j] + (j < ha) .. len[j], the prefix p[0..j)
 *   tail   (level j0 < j <= tb): 0 .. q[j] + (j == tb), the prefix q[0..j)
 * where ha is the last dim after j0 with p[j] != 0 and tb the last with q[j] != len[j] - 1
 * (the head and tail are empty, hf and tf set, when there is none: the middle takes in the
 * whole first or last slice). Empty ones are left out; a single element is one middle. */
enum { OV_MID, OV_HEAD, OV_TAIL };

typedef struct {
    const uint64_t *off, *len;
    const uint64_t *p, *q; /* multi-indices in the box of the first and last element */
    size_t shard;
    int ha, tb;
    int hf, tf;
} ov_reg;

typedef struct {
    uint32_t reg;
    uint8_t level, kind;
} ov_box;

typedef struct {
    const ov_reg *reg;
    const ov_box *box;
    const uint64_t *kv; /* if not NULL: box i's range along dims[k] at kv[2 (i nd + k)] */
    int kslot[STRATA_MAX_DIMS]; /* dim -> k */
    uint64_t *mark, stamp;
    int dims[STRATA_MAX_DIMS], nd; /* the dims in which boxes differ; dims[nd - 1] first */
    uint64_t rng, work;
    uint32_t a, b; /* the pair found */
} ov_ctx;

/* Box i's range [*lo, *hi) of global indices along dim d. */
static inline void box_iv(const ov_ctx *c, uint32_t i, int d, uint64_t *lo, uint64_t *hi)
{
    if (c->kv) {
        const uint64_t *v = c->kv + 2 * ((size_t)i * (size_t)c->nd + (size_t)c->kslot[d]);
        *lo = v[0];
        *hi = v[1];
        return;
    }
    const ov_box *b = &c->box[i];
    const ov_reg *r = &c->reg[b->reg];
    uint64_t a, e;
    if (d < b->level) {
        a = (b->kind == OV_TAIL ? r->q : r->p)[d];
        e = a + 1;
    } else if (d > b->level) {
        a = 0;
        e = r->len[d];
    } else if (b->kind == OV_MID) {
        a = r->p[d] + !r->hf;
        e = r->q[d] + r->tf;
    } else if (b->kind == OV_HEAD) {
        a = r->p[d] + (d < r->ha);
        e = r->len[d];
    } else {
        a = 0;
        e = r->q[d] + (d == r->tb);
    }
    *lo = r->off[d] + a;
    *hi = r->off[d] + e;
}

static inline uint64_t box_lo(const ov_ctx *c, uint32_t i, int d)
{
    uint64_t lo, hi;
    box_iv(c, i, d, &lo, &hi);
    return lo;
}

/* Fills r for shard s (fs < fe) and appends its boxes to box[*m]. pq: 2 ndim scratch. */
static void ov_cut(ov_reg *r, uint32_t ri, const st_region *s, size_t shard, int nd,
                   uint64_t *pq, ov_box *box, size_t *m)
{
    uint64_t *p = pq, *q = pq + nd, a = s->fs, z = s->fe - 1;
    for (int d = nd - 1; d >= 0; d--) {
        p[d] = a % s->len[d];
        a /= s->len[d];
        q[d] = z % s->len[d];
        z /= s->len[d];
    }
    *r = (ov_reg){s->off, s->len, p, q, shard, -1, -1, 0, 0};
    int j0 = 0;
    while (j0 < nd - 1 && p[j0] == q[j0])
        j0++;
    for (int d = j0 + 1; d < nd; d++) {
        if (p[d] != 0)
            r->ha = d;
        if (q[d] != s->len[d] - 1)
            r->tb = d;
    }
    r->hf = r->ha < 0;
    r->tf = r->tb < 0;
    if (p[j0] + !r->hf < q[j0] + r->tf)
        box[(*m)++] = (ov_box){ri, (uint8_t)j0, OV_MID};
    for (int d = j0 + 1; d <= r->ha; d++)
        if (p[d] + (d < r->ha) < s->len[d])
            box[(*m)++] = (ov_box){ri, (uint8_t)d, OV_HEAD};
    for (int d = j0 + 1; d <= r->tb; d++)
        if (q[d] + (d == r->tb) > 0)
            box[(*m)++] = (ov_box){ri, (uint8_t)d, OV_TAIL};
}

/* Do boxes a and b (a != b) share an element? Only the dims that vary can differ. */
static int ov_meet(const ov_ctx *c, uint32_t a, uint32_t b)
{
    if (a == b)
        return 0;
    for (int k = 0; k < c->nd; k++) {
        uint64_t al, ah, bl, bh;
        box_iv(c, a, c->dims[k], &al, &ah);
        box_iv(c, b, c->dims[k], &bl, &bh);
        if (al >= bh || bl >= ah)
            return 0;
    }
    return 1;
}

static int ov_found(ov_ctx *c, uint32_t a, uint32_t b)
{
    c->a = a;
    c->b = b;
    return 1;
}

/* Some i of I and p of P that meet (the small case: every pair). */
static int ov_brute(ov_ctx *c, const uint32_t *I, size_t ni, const uint32_t *P, size_t np)
{
    c->work += ni * np;
    for (size_t i = 0; i < ni; i++)
        for (size_t j = 0; j < np; j++)
            if (ov_meet(c, I[i], P[j]))
                return ov_found(c, I[i], P[j]);
    return 0;
}

static inline void ov_swap(uint32_t *v, size_t i, size_t j)
{
    uint32_t x = v[i];
    v[i] = v[j];
    v[j] = x;
}

typedef struct {
    const ov_ctx *c;
    int d;
} ov_key;

static int cmp_lo(const void *x, const void *y, void *ctx)
{
    const ov_key *k = ctx;
    uint64_t a = box_lo(k->c, *(const uint32_t *)x, k->d);
    uint64_t b = box_lo(k->c, *(const uint32_t *)y, k->d);
    return (a > b) - (a < b);
}

/* The value of rank `want` among the lower ends along dim d of P (reordered):
 * quickselect with random pivots, sorting instead if it takes too many rounds. */
static uint64_t ov_select(ov_ctx *c, uint32_t *P, size_t n, int d, size_t want)
{
    size_t lo = 0, hi = n;
    for (int round = 0; hi - lo > 1; round++) {
        c->work += hi - lo;
        if (round == 64) {
            ov_key key = {c, d};
            qsort_r(P + lo, hi - lo, sizeof *P, cmp_lo, &key);
            break;
        }
        c->rng = c->rng * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t piv = box_lo(c, P[lo + (size_t)((c->rng >> 33) % (hi - lo))], d);
        size_t lt = lo, i = lo, gt = hi; /* [lo, lt) < piv, [lt, i) == piv, [gt, hi) > piv */
        while (i < gt) {
            uint64_t x = box_lo(c, P[i], d);
            if (x < piv)
                ov_swap(P, lt++, i++);
            else if (x > piv)
                ov_swap(P, i, --gt);
            else
                i++;
        }
        if (want < lt)
            hi = lt;
        else if (want >= gt)
            lo = gt;
        else
            return piv;
    }
    return box_lo(c, P[want], d);
}

/* A split point mi along dim d with points of P on both sides (lower end < mi, >= mi), near
 * the median; 0 if all of P have one lower end. */
static int ov_split(ov_ctx *c, uint32_t *P, size_t np, int d, uint64_t *mi)
{
    uint64_t v = ov_select(c, P, np, d, np / 2), above = UINT64_MAX;
    int less = 0;
    c->work += np;
    for (size_t i = 0; i < np; i++) {
        uint64_t x = box_lo(c, P[i], d);
        if (x < v)
            less = 1;
        else if (x > v && x < above)
            above = x;
    }
    *mi = less ? v : above;
    return less || above != UINT64_MAX;
}

static int ov_full(ov_ctx *c, uint32_t *A, size_t na, uint32_t *B, size_t nb, int k);

/* Some i of I and p of P, i != p, that meet, where the lower end of p along dims[k] lies in
 * i's range there; all of P's lower ends lie in [lo, hi), I's ranges all meet [lo, hi), and
 * the caller knows that every pair meets along dims[k + 1 ..]. I and P are reordered. */
static int ov_detect(ov_ctx *c, uint32_t *I, size_t ni, uint32_t *P, size_t np, int k,
                     uint64_t lo, uint64_t hi)
{
    for (;;) {
        if (!ni || !np)
            return 0;
        if (ni <= 4 || np <= 4)
            return ov_brute(c, I, ni, P, np);
        int d = c->dims[k];
        c->work += ni + np;
        size_t nm = 0; /* ranges that span [lo, hi) meet all of P along d */
        for (size_t i = 0; i < ni; i++) {
            uint64_t a, e;
            box_iv(c, I[i], d, &a, &e);
            if (a <= lo && e >= hi)
                ov_swap(I, i, nm++);
        }
        if (nm && ov_full(c, I, nm, P, np, k - 1))
            return 1;
        I += nm;
        ni -= nm;
        if (!ni)
            return 0;
        uint64_t mi;
        if (!ov_split(c, P, np, d, &mi)) { /* all of P at x: the ranges holding x meet them */
            uint64_t x = box_lo(c, P[0], d);
            size_t nx = 0;
            for (size_t i = 0; i < ni; i++) {
                uint64_t a, e;
                box_iv(c, I[i], d, &a, &e);
                if (a <= x && x < e)
                    ov_swap(I, i, nx++);
            }
            return ov_full(c, I, nx, P, np, k - 1);
        }
        size_t npl = 0, nil = 0, nir = 0;
        for (size_t i = 0; i < np; i++)
            if (box_lo(c, P[i], d) < mi)
                ov_swap(P, i, npl++);
        for (size_t i = 0; i < ni; i++)
            if (box_lo(c, I[i], d) < mi)
                ov_swap(I, i, nil++);
        if (ov_detect(c, I, nil, P, npl, k, lo, mi))
            return 1;
        for (size_t i = 0; i < ni; i++) {
            uint64_t a, e;
            box_iv(c, I[i], d, &a, &e);
            if (e > mi)
                ov_swap(I, i, nir++);
        }
        ni = nir;
        P += npl;
        np -= npl;
        lo = mi;
    }
}

/* Some a of A and b of B, a != b, that meet, where every pair is known to meet along
 * dims[k + 1 ..]. A and B may hold the same boxes (and are reordered). */
static int ov_full(ov_ctx *c, uint32_t *A, size_t na, uint32_t *B, size_t nb, int k)
{
    if (!na || !nb)
        return 0;
    if (k < 0) { /* they meet in every dim: any two distinct boxes */
        for (size_t i = 0; i < na && i < 2; i++)
            for (size_t j = 0; j < nb && j < 2; j++)
                if (A[i] != B[j])
                    return ov_found(c, A[i], B[j]);
        return 0;
    }
    /* a pair meets along dims[k] iff one's lower end lies in the other's range: A's
     * ranges with B's lower ends, then B's ranges with A's lower ends, leaving out the
     * pairs already seen (both boxes in A and in B) */
    if (ov_detect(c, A, na, B, nb, k, 0, UINT64_MAX))
        return 1;
    c->work += 2 * (na + nb);
    uint64_t s = ++c->stamp;
    for (size_t i = 0; i < na; i++)
        c->mark[A[i]] = s;
    size_t nba = 0; /* B[0, nba): also in A */
    for (size_t j = 0; j < nb; j++)
        if (c->mark[B[j]] == s)
            ov_swap(B, j, nba++);
    if (ov_detect(c, B + nba, nb - nba, A, na, k, 0, UINT64_MAX))
        return 1;
    if (!nba)
        return 0;
    s = ++c->stamp;
    for (size_t j = 0; j < nb; j++)
        c->mark[B[j]] = s;
    size_t nab = 0; /* A[0, nab): also in B */
    for (size_t i = 0; i < na; i++)
        if (c->mark[A[i]] == s)
            ov_swap(A, i, nab++);
    return ov_detect(c, A, nab, A + nab, na - nab, k, 0, UINT64_MAX);
}

/* Shards idx[0..n) (non-empty, in several boxes) as whole boxes, searched for a pair that
 * meets. */
static int check_boxes(ov_set *t, const size_t *idx, size_t n, uint64_t *work)
{
    int nd = t->nd;
    if (nd < 1) /* (not reached: a scalar's shards all have one box) */
        return n > 1 ? overlap_pair(t, idx[0], idx[1]) : 0;
    size_t cap = n * (size_t)(2 * nd - 1);
    if (cap / (size_t)(2 * nd - 1) != n || cap > UINT32_MAX)
        return -1; /* too many to check */
    ov_reg *reg = malloc(n * sizeof *reg);
    uint64_t *pq = malloc(n * 2 * (size_t)nd * sizeof *pq);
    ov_box *box = malloc(cap * sizeof *box);
    uint32_t *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y);
    uint64_t *mark = calloc(cap, sizeof *mark);
    int rc = 0;
    if (!reg || !pq || !box || !x || !y || !mark) {
        rc = -1;
        goto out;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        ov_cut(&reg[i], (uint32_t)i, &t->r[idx[i]], idx[i], nd, pq + i * 2 * (size_t)nd,
               box, &m);
    ov_ctx c = {.reg = reg, .box = box, .mark = mark, .rng = 0x9e3779b97f4a7c15ull ^ m};
    for (int d = 0; d < nd; d++) /* dims where some box differs from box 0 */
        for (size_t i = 1; i < m; i++) {
            uint64_t a, e, a0, e0;
            box_iv(&c, (uint32_t)i, d, &a, &e);
            box_iv(&c, 0, d, &a0, &e0);
            if (a != a0 || e != e0) {
                c.dims[c.nd++] = d;
                break;
            }
        }
    c.work = m * (size_t)nd;
    for (size_t i = 0; i < m; i++)
        x[i] = y[i] = (uint32_t)i;
    /* the ranges, laid out for the search, when that takes no more than four times the
     * memory of the shards' own boxes (else they are computed on every use) */
    uint64_t *kv = NULL;
    if (c.nd && m * (size_t)c.nd <= 4 * n * (size_t)nd &&
        (kv = malloc(m * (size_t)c.nd * 2 * sizeof *kv)) != NULL) {
        for (int k = 0; k < c.nd; k++)
            c.kslot[c.dims[k]] = k;
        for (size_t i = 0; i < m; i++)
            for (int k = 0; k < c.nd; k++)
                box_iv(&c, (uint32_t)i, c.dims[k], &kv[2 * (i * c.nd + k)],
                       &kv[2 * (i * c.nd + k) + 1]);
        c.kv = kv;
    }
    int hit = c.nd ? ov_detect(&c, x, m, y, m, c.nd - 1, 0, UINT64_MAX)
                   : (m > 1 && ov_found(&c, 0, 1));
    *work += c.work;
    if (hit)
        rc = overlap_pair(t, reg[box[c.a].reg].shard, reg[box[c.b].reg].shard);
    free(kv);
out:
    free(reg);
    free(pq);
    free(box);
    free(x);
    free(y);
    free(mark);
    return rc;
}

/* Shards idx[0..n) that no dim separates. g: scratch of n. */
static int check_leaf(ov_set *t, size_t *idx, size_t n, box_group *g)
{
    qsort_r(idx, n, sizeof *idx, cmp_box_fs, (void *)t);
    ov_work += n * (64 - (uint64_t)__builtin_clzll(n));
    size_t ng = 0, ne = 0;
    for (size_t i = 0; i < n; i++) {
        const st_region *s = &t->r[idx[i]];
        if (s->fe <= s->fs)
            continue; /* empty: overlaps nothing */
        if (ng && same_box(t, &t->r[idx[g[ng - 1].start]], s)) {
            box_group *c = &g[ng - 1];
            if (s->fs < c->fe) /* sorted by fs: it starts inside an earlier range */
                for (size_t k = c->start; k < i; k++) {
                    const st_region *o = &t->r[idx[k]];
                    if (o->fe > s->fs && o->fe > o->fs)
                        return overlap_pair(t, idx[k], idx[i]);
                }
            c->end = i + 1;
            c->fe = ST_MAX(c->fe, s->fe);
        } else {
            g[ng++] = (box_group){i, i + 1, s->fs, s->fe};
        }
    }
    if (ng < 2)
        return 0;
    for (size_t i = 0; i < n; i++) /* the non-empty ones */
        if (t->r[idx[i]].fe > t->r[idx[i]].fs)
            idx[ne++] = idx[i];
    return check_boxes(t, idx, ne, &ov_work);
}

/* Splits idx[0..n) into clusters along dim d and checks each (idx is reordered). */
static int check_split(ov_set *t, size_t *idx, size_t n, int d, span0 *v,
                       box_group *g)
{
    if (n < 2)
        return 0;
    if (d >= t->nd)
        return check_leaf(t, idx, n, g);
    ov_work += n * (64 - (uint64_t)__builtin_clzll(n));
    for (size_t i = 0; i < n; i++) {
        v[i].idx = idx[i];
        span_of(&t->r[idx[i]], d, &v[i].lo, &v[i].hi);
    }
    qsort(v, n, sizeof *v, cmp_span0);
    for (size_t i = 0; i < n; i++)
        idx[i] = v[i].idx;
    /* clusters: runs of connected spans, each checked along the next dims (the recursion
     * overwrites only its own slice of v) */
    for (size_t start = 0; start < n;) {
        size_t end = start + 1;
        uint64_t hi = v[start].hi;
        while (end < n && v[end].lo < hi) {
            hi = ST_MAX(hi, v[end].hi);
            end++;
        }
        int rc = check_split(t, idx + start, end - start, d + 1, v + start, g + start);
        if (rc)
            return rc;
        start = end;
    }
    return 0;
}

int st_overlap_find(const st_region *r, size_t n, size_t *a, size_t *b)
{
    ov_work = 0;
    if (n < 2)
        return 0;
    size_t *idx = malloc(n * sizeof *idx);
    span0 *v = malloc(n * sizeof *v);
    box_group *g = malloc(n * sizeof *g);
    ov_set t = {r, r[0].ndim, 0, 0};
    int rc = !idx || !v || !g ? -1 : 0;
    for (size_t i = 0; !rc && i < n; i++)
        idx[i] = i;
    if (!rc && (rc = check_split(&t, idx, n, 0, v, g)) == 1) {
        *a = t.a;
        *b = t.b;
    }
    free(idx);
    free(v);
    free(g);
    return rc;
}
