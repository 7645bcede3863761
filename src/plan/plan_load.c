/* plan_load.c - the load plan: requests intersected with saved shards through a per-tensor
 * interval index (along the dim that best tells its shards apart), then the byte runs to
 * scatter, the checksum chunks they need, and those chunks coalesced into large reads.
 * Pure; single-threaded. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/convert.h"
#include "../core/error.h"
#include "../core/geom.h"
#include "../core/util.h"
#include "plan.h"

typedef struct {
    int dim;             /* the dim indexed: the one whose spans start at most places */
    size_t *ord;         /* shard indices sorted by span start along dim */
    uint64_t *lo, *hi;   /* span of ord[i] along dim */
    uint64_t *pmax;      /* max of hi[0..i] */
} tindex;

static _Thread_local uint64_t load_work; /* st_plan_load_work */

uint64_t st_plan_load_work(void)
{
    return load_work;
}

typedef struct {
    st_io_plan *p;
    size_t cap;
    uint32_t piece;
    size_t esz, dsz; /* element sizes: saved, requested */
    int32_t rank;
    uint32_t local;
    int oom;
} runs_out;

static int add_run(void *ctx, uint64_t a, uint64_t b, uint64_t n)
{
    runs_out *o = ctx;
    if (st_grow(&o->p->runs, &o->cap, o->p->nruns + 1, sizeof *o->p->runs)) {
        o->oom = 1;
        return 1;
    }
    o->p->runs[o->p->nruns++] =
        (st_run){o->piece, o->rank, o->local, a * o->esz, n * o->esz, b * o->dsz};
    return 0;
}

static int cmp_u64_pair(const void *pa, const void *pb, void *ctx)
{
    const uint64_t *lo = ctx;
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    if (lo[a] != lo[b])
        return lo[a] < lo[b] ? -1 : 1;
    return (a > b) - (a < b);
}

/* The indices [lo, hi) of dim d that region r touches: tight for dim 0, the box's for the
 * others (a superset for a flat range); [0, 0) for an empty region. */
static void span_along(const st_region *r, int d, uint64_t *lo, uint64_t *hi)
{
    if (r->fe <= r->fs || (d == 0 && !st_region_dim0(r, lo, hi))) {
        *lo = *hi = 0;
    } else if (d > 0) {
        *lo = r->off[d];
        *hi = r->off[d] + r->len[d];
    }
}

/* The dim along which t's shards are narrowest for the tensor's extent (their spans' summed
 * lengths over the dim's size; dim 0 on a tie): the one that tells them apart, so that a
 * request visits about the shards it meets - not all of them, as dim 0 would for shards
 * cut along another dim only. */
static int best_dim(const st_mtensor *t)
{
    int best = 0;
    double least = 0;
    for (int d = 0; d < (t->ndim ? t->ndim : 1); d++) {
        uint64_t extent = t->ndim ? t->shape[d] : 1;
        if (!extent)
            continue;
        double sum = 0;
        for (size_t i = 0; i < t->nshards; i++) {
            const st_mshard *s = &t->shards[i];
            st_region r = {t->ndim, s->off, s->len, s->fs, s->fe};
            uint64_t lo, hi;
            span_along(&r, d, &lo, &hi);
            sum += (double)(hi - lo);
        }
        load_work += t->nshards;
        if (d == 0 || sum / (double)extent < least) {
            least = sum / (double)extent;
            best = d;
        }
    }
    return best;
}

static int build_index(tindex *x, const st_mtensor *t)
{
    size_t n = t->nshards ? t->nshards : 1;
    x->ord = malloc(n * sizeof *x->ord);
    uint64_t *lo = malloc(n * 8), *hi = malloc(n * 8);
    x->lo = malloc(n * 8);
    x->hi = malloc(n * 8);
    x->pmax = malloc(n * 8);
    if (!x->ord || !lo || !hi || !x->lo || !x->hi || !x->pmax) {
        free(lo);
        free(hi);
        return -1;
    }
    x->dim = t->nshards > 1 ? best_dim(t) : 0;
    for (size_t i = 0; i < t->nshards; i++) {
        const st_mshard *s = &t->shards[i];
        st_region r = {t->ndim, s->off, s->len, s->fs, s->fe};
        span_along(&r, x->dim, &lo[i], &hi[i]);
        x->ord[i] = i;
    }
    qsort_r(x->ord, t->nshards, sizeof *x->ord, cmp_u64_pair, lo);
    uint64_t mx = 0;
    for (size_t i = 0; i < t->nshards; i++) {
        x->lo[i] = lo[x->ord[i]];
        x->hi[i] = hi[x->ord[i]];
        mx = ST_MAX(mx, x->hi[i]);
        x->pmax[i] = mx;
    }
    free(lo);
    free(hi);
    return 0;
}

static void describe(char *out, size_t cap, strata_dtype dt, int ndim, const uint64_t *shape)
{
    int n = snprintf(out, cap, "%s[", strata_dtype_name(dt) ? strata_dtype_name(dt) : "?");
    for (int d = 0; d < ndim && n > 0 && (size_t)n < cap; d++)
        n += snprintf(out + n, cap - (size_t)n, d ? ",%llu" : "%llu",
                      (unsigned long long)shape[d]);
    if (n > 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, "]");
}

/* Why a request of dtype `to` cannot be filled from a tensor saved as `from` at cast level
 * `cast` (the hint after a dtype mismatch; cast -1: the shapes differ, no hint). */
static void mismatch_why(char *out, size_t cap, int cast, strata_dtype from, strata_dtype to)
{
    const char *f = strata_dtype_name(from), *t = strata_dtype_name(to);
    out[0] = 0;
    if (cast < 0 || from == to)
        return;
    if (!st_convert_ok(from, to))
        snprintf(out, cap, " (strata converts floats to floats and integers only where "
                 "exact, not %s to %s)", f ? f : "?", t ? t : "?");
    else if (st_convert_exact(from, to))
        snprintf(out, cap, " (STRATA_LOAD_WIDEN would convert it, exactly)");
    else
        snprintf(out, cap, " (a narrowing conversion%s: STRATA_LOAD_CAST would convert it, "
                 "rounding to nearest even)", cast == ST_CAST_EXACT ? ", which STRATA_LOAD_WIDEN "
                 "does not make" : "");
}

static int cmp_runs(const void *pa, const void *pb)
{
    const st_run *a = pa, *b = pb;
    if (a->piece != b->piece)
        return a->piece < b->piece ? -1 : 1;
    return (a->src > b->src) - (a->src < b->src);
}

/* The runs in order of (piece, source offset), run0 and maxrun filled: a counting sort by
 * piece (pieces are numbered densely: linear in the runs and pieces), then the runs of a
 * piece that are not in order already by source offset. */
static int sort_runs(st_io_plan *out)
{
    const size_t np = out->npieces, n = out->nruns;
    for (size_t i = 0; i < n; i++) {
        const st_run *x = &out->runs[i];
        out->run0[x->piece + 1]++;
        out->maxrun[x->piece] = ST_MAX(out->maxrun[x->piece], x->n);
    }
    for (size_t p = 0; p < np; p++)
        out->run0[p + 1] += out->run0[p];
    if (n < 2)
        return 0;
    st_run *to = malloc(n * sizeof *to);
    size_t *at = malloc((np + 1) * sizeof *at);
    if (!to || !at) {
        free(to);
        free(at);
        return st_fail(STRATA_ENOMEM, "out of memory planning the load");
    }
    memcpy(at, out->run0, (np + 1) * sizeof *at);
    for (size_t i = 0; i < n; i++)
        to[at[out->runs[i].piece]++] = out->runs[i];
    free(at);
    free(out->runs);
    out->runs = to;
    for (size_t p = 0; p < np; p++) { /* one request's runs of a piece come in order */
        size_t a = out->run0[p], b = out->run0[p + 1], i = a + 1;
        while (i < b && to[i - 1].src <= to[i].src)
            i++;
        if (i < b)
            qsort(to + a, b - a, sizeof *to, cmp_runs);
    }
    return 0;
}

static uint64_t seg_off(const st_io_plan *p, const st_seg *s)
{
    return p->ext[s->piece]->offset + s->c0 * p->meta->chunk;
}

static int cmp_segs(const void *pa, const void *pb, void *ctx)
{
    const st_io_plan *p = ctx;
    const st_seg *a = pa, *b = pb;
    uint32_t fa = p->ext[a->piece]->file, fb = p->ext[b->piece]->file;
    if (fa != fb)
        return fa < fb ? -1 : 1;
    uint64_t oa = seg_off(p, a), ob = seg_off(p, b);
    return (oa > ob) - (oa < ob);
}

void st_io_plan_free(st_io_plan *p)
{
    free((void *)p->ranks);
    free(p->ext);
    free(p->object);
    free(p->dtype);
    free(p->maxrun);
    free(p->run0);
    free(p->runs);
    free(p->segs);
    free(p->ios);
    free(p->cparts);
    memset(p, 0, sizeof *p);
}

/* Pieces are numbered tensor by tensor, shard by shard, then blobs. */
static int number_pieces(st_io_plan *out, const st_meta *m)
{
    size_t np = m->nblobs;
    for (size_t t = 0; t < m->ntensors; t++)
        np += m->tensors[t].nshards;
    if (np > UINT32_MAX)
        return st_fail(STRATA_EINVAL, "too many saved shards (%zu) for one load plan", np);
    out->npieces = np;
    out->ext = malloc((np + 1) * sizeof *out->ext);
    out->object = malloc((np + 1) * sizeof *out->object);
    out->dtype = malloc((np + 1) * sizeof *out->dtype);
    out->maxrun = calloc(np + 1, sizeof *out->maxrun);
    out->run0 = calloc(np + 2, sizeof *out->run0);
    if (!out->ext || !out->object || !out->dtype || !out->maxrun || !out->run0)
        return st_fail(STRATA_ENOMEM, "out of memory planning the load");
    size_t k = 0;
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++, k++) {
            out->ext[k] = &m->tensors[t].shards[s].ext;
            out->object[k] = m->tensors[t].name;
            out->dtype[k] = m->tensors[t].dtype;
        }
    for (size_t b = 0; b < m->nblobs; b++, k++) {
        out->ext[k] = &m->blobs[b].ext;
        out->object[k] = m->blobs[b].name;
        out->dtype[k] = STRATA_U8;
    }
    return 0;
}

int st_plan_verify_all(st_io_plan *out, const st_meta *m, uint64_t max_io)
{
    memset(out, 0, sizeof *out);
    out->meta = m;
    int rc = number_pieces(out, m);
    size_t cap = 0;
    for (size_t p = 0; p < out->npieces && !rc; p++) {
        if (out->ext[p]->bytes == 0)
            continue;
        if (st_grow(&out->runs, &cap, out->nruns + 1, sizeof *out->runs))
            rc = st_fail(STRATA_ENOMEM, "out of memory planning the verify");
        else
            out->runs[out->nruns++] = (st_run){(uint32_t)p, -1, 0, 0, out->ext[p]->bytes, 0};
    }
    if (!rc)
        rc = st_plan_reads(out, max_io);
    if (rc)
        st_io_plan_free(out);
    return rc;
}

int st_plan_reads(st_io_plan *out, uint64_t max_io)
{
    const st_meta *m = out->meta;
    const uint64_t C = m->chunk;
    int rc = 0;
    max_io = st_plan_max_io(m, max_io); /* a foreign chunk is a byte: no element split */
    /* runs by piece; the chunks they need, as segments (runs and segs are NULL when
     * empty, which qsort must not be given) */
    if ((rc = sort_runs(out)))
        return rc;
    size_t scap = 0;
    for (size_t i = 0; i < out->nruns;) {
        uint32_t piece = out->runs[i].piece;
        const st_extent *ext = out->ext[piece];
        uint64_t c0 = out->runs[i].src / C, c1 = (out->runs[i].src + out->runs[i].n - 1) / C + 1;
        size_t j = i + 1;
        for (;; j++) {
            int more = j < out->nruns && out->runs[j].piece == piece;
            uint64_t a = more ? out->runs[j].src / C : 0;
            if (more && a <= c1) {
                c1 = ST_MAX(c1, (out->runs[j].src + out->runs[j].n - 1) / C + 1);
                continue;
            }
            /* emit [c0, c1) split so that no segment exceeds max_io */
            for (uint64_t c = c0; c < c1;) {
                uint64_t e = ST_MIN(c1, c + max_io / C);
                if (st_grow(&out->segs, &scap, out->nsegs + 1, sizeof *out->segs)) {
                    rc = st_fail(STRATA_ENOMEM, "out of memory planning the load");
                    return rc;
                }
                out->segs[out->nsegs++] = (st_seg){piece, c, e};
                out->payload_bytes += ST_MIN(e * C, ext->bytes) - c * C;
                c = e;
            }
            if (!more)
                break;
            c0 = a;
            c1 = (out->runs[j].src + out->runs[j].n - 1) / C + 1;
        }
        i = j;
    }

    /* coalesce segments into reads: same file, separated by alignment padding only (none
     * for a foreign source) */
    if (out->nsegs > 1)
        qsort_r(out->segs, out->nsegs, sizeof *out->segs, cmp_segs, out);
    size_t rcap = 0;
    const uint64_t A = st_meta_align(m);
    for (size_t i = 0; i < out->nsegs;) {
        const st_seg *s = &out->segs[i];
        const st_extent *ext = out->ext[s->piece];
        uint64_t off = seg_off(out, s);
        uint64_t end = ST_ALIGN_UP(ext->offset + ST_MIN(s->c1 * C, ext->bytes), A);
        size_t j = i + 1;
        while (j < out->nsegs) {
            const st_seg *n = &out->segs[j];
            const st_extent *ne = out->ext[n->piece];
            uint64_t noff = seg_off(out, n);
            uint64_t nend = ST_ALIGN_UP(ne->offset + ST_MIN(n->c1 * C, ne->bytes), A);
            if (ne->file != ext->file || noff != end || nend - off > max_io)
                break;
            end = nend;
            j++;
        }
        if (st_grow(&out->ios, &rcap, out->nios + 1, sizeof *out->ios)) {
            rc = st_fail(STRATA_ENOMEM, "out of memory planning the load");
            return rc;
        }
        out->ios[out->nios++] = (st_io){ext->file, off, end - off, i, j, 0, 0, 0};
        i = j;
    }

    return 0;
}

/* ---- the load plan, step by step ---- */

/* One load plan in the making: the metadata's names indexed, each tensor's span index
 * (built on first use), and the runs being emitted. */
typedef struct {
    st_io_plan *out;
    const st_meta *m;
    const st_rank_view *ranks;
    size_t *base;      /* per tensor: its first piece */
    size_t blob_base;  /* the first blob's piece */
    tindex *idx;       /* per tensor */
    size_t *tmap, tcap; /* tensors by name: open addressing, SIZE_MAX empty */
    size_t *bmap, bcap; /* blobs by name and owner */
    runs_out ro;
} load_ctx;

static int load_oom(void) { return st_fail(STRATA_ENOMEM, "out of memory planning the load"); }

static size_t pow2_above(size_t n)
{
    size_t cap = 16;
    while (cap < 2 * n + 2)
        cap *= 2;
    return cap;
}

static int load_ctx_init(load_ctx *c, st_io_plan *out, const st_meta *m,
                         const st_rank_view *ranks, int nranks)
{
    memset(c, 0, sizeof *c);
    memset(out, 0, sizeof *out);
    c->out = out;
    c->m = m;
    c->ranks = ranks;
    c->ro.p = out;
    out->meta = m;
    st_rank_view *rv = malloc(((size_t)nranks + 1) * sizeof *rv);
    if (!rv)
        return load_oom();
    memcpy(rv, ranks, (size_t)nranks * sizeof *rv);
    out->ranks = rv;
    out->nranks = nranks;
    c->base = malloc((m->ntensors + 1) * sizeof *c->base);
    c->idx = calloc(m->ntensors + 1, sizeof *c->idx);
    c->tcap = pow2_above(m->ntensors);
    c->bcap = pow2_above(m->nblobs);
    c->tmap = malloc(c->tcap * sizeof *c->tmap);
    c->bmap = malloc(c->bcap * sizeof *c->bmap);
    if (!c->base || !c->idx || !c->tmap || !c->bmap)
        return load_oom();
    return 0;
}

static int load_ctx_free(load_ctx *c, int rc)
{
    if (c->idx)
        for (size_t t = 0; t < c->m->ntensors; t++) {
            free(c->idx[t].ord);
            free(c->idx[t].lo);
            free(c->idx[t].hi);
            free(c->idx[t].pmax);
        }
    free(c->idx);
    free(c->base);
    free(c->tmap);
    free(c->bmap);
    if (rc)
        st_io_plan_free(c->out);
    return rc;
}

/* Step 1: the pieces numbered, and the metadata's tensors and blobs indexed by name. */
static int index_names(load_ctx *c)
{
    const st_meta *m = c->m;
    size_t np = 0;
    for (size_t t = 0; t < m->ntensors; t++) {
        c->base[t] = np;
        np += m->tensors[t].nshards;
    }
    c->blob_base = np;
    int rc = number_pieces(c->out, m);
    if (rc)
        return rc;
    for (size_t i = 0; i < c->tcap; i++)
        c->tmap[i] = SIZE_MAX;
    for (size_t i = 0; i < c->bcap; i++)
        c->bmap[i] = SIZE_MAX;
    for (size_t t = 0; t < m->ntensors; t++) {
        size_t h = (size_t)st_strhash(m->tensors[t].name) & (c->tcap - 1);
        while (c->tmap[h] != SIZE_MAX)
            h = (h + 1) & (c->tcap - 1);
        c->tmap[h] = t;
    }
    for (size_t b = 0; b < m->nblobs; b++) {
        size_t h = (size_t)(st_strhash(m->blobs[b].name) ^ st_mix64((uint64_t)m->blobs[b].owner)) &
                   (c->bcap - 1);
        while (c->bmap[h] != SIZE_MAX)
            h = (h + 1) & (c->bcap - 1);
        c->bmap[h] = b;
    }
    return 0;
}

/* The saved tensor a request names, of the same shape and of a dtype its rank's cast
 * level allows: STRATA_ENOTFOUND or STRATA_EMISMATCH otherwise. */
static int find_saved(const load_ctx *c, const st_entry *e, int r, size_t *out)
{
    const st_meta *m = c->m;
    size_t h = (size_t)st_strhash(e->name) & (c->tcap - 1), t;
    while ((t = c->tmap[h]) != SIZE_MAX && strcmp(m->tensors[t].name, e->name) != 0)
        h = (h + 1) & (c->tcap - 1);
    if (t == SIZE_MAX)
        return st_fail(STRATA_ENOTFOUND,
                       "tensor '%s' (requested by rank %d) is not in the checkpoint", e->name, r);
    const st_mtensor *mt = &m->tensors[t];
    int same = mt->ndim == e->ndim;
    for (int d = 0; same && d < e->ndim; d++)
        same = mt->shape[d] == e->shape[d];
    if (!same || !st_cast_allows(c->ranks[r].cast, mt->dtype, e->dtype)) {
        char a[256], b[256], why[192] = "";
        describe(a, sizeof a, e->dtype, e->ndim, e->shape);
        describe(b, sizeof b, mt->dtype, mt->ndim, mt->shape);
        mismatch_why(why, sizeof why, same ? c->ranks[r].cast : -1, mt->dtype, e->dtype);
        return st_fail(STRATA_EMISMATCH, "tensor '%s': rank %d requests %s but %s was saved%s",
                       e->name, r, a, b, why);
    }
    *out = t;
    return 0;
}

/* Step 2a: the runs of shard request i of rank r, from the saved shards whose span
 * meets it; STRATA_EUNFILLED unless they fill it. */
static int plan_shard(load_ctx *c, int r, size_t i)
{
    const st_entry *e = &c->ranks[r].sh[i];
    size_t t = 0;
    int rc = find_saved(c, e, r, &t);
    if (rc || e->fe == e->fs)
        return rc;
    const st_mtensor *mt = &c->m->tensors[t];
    tindex *x = &c->idx[t];
    if (!x->ord && build_index(x, mt))
        return load_oom();
    st_region q = {e->ndim, e->off, e->len, e->fs, e->fe};
    uint64_t qlo, qhi, got = 0;
    span_along(&q, x->dim, &qlo, &qhi);
    size_t lo = 0, hi = mt->nshards; /* first index with x->lo >= qhi */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (x->lo[mid] < qhi)
            lo = mid + 1;
        else
            hi = mid;
    }
    runs_out *ro = &c->ro;
    ro->esz = strata_dtype_size(mt->dtype);
    ro->dsz = strata_dtype_size(e->dtype);
    ro->rank = r;
    ro->local = (uint32_t)i;
    c->out->request_bytes += e->bytes;
    for (size_t j = lo; j-- > 0 && x->pmax[j] > qlo;) {
        load_work++;
        if (x->hi[j] <= qlo)
            continue;
        const st_mshard *s = &mt->shards[x->ord[j]];
        st_region sr = {mt->ndim, s->off, s->len, s->fs, s->fe};
        ro->piece = (uint32_t)(c->base[t] + x->ord[j]);
        got += st_region_runs(&sr, &q, add_run, ro);
        if (ro->oom)
            return load_oom();
    }
    if (got != e->fe - e->fs)
        return st_fail(STRATA_EUNFILLED,
                       "tensor '%s' on rank %d: %llu of the %llu requested elements are "
                       "not in the checkpoint",
                       e->name, r, (unsigned long long)(e->fe - e->fs - got),
                       (unsigned long long)(e->fe - e->fs));
    return 0;
}

/* Step 2b: the run of blob request i of rank r (its whole saved bytes). */
static int plan_blob(load_ctx *c, int r, size_t i)
{
    const st_meta *m = c->m;
    const st_blobent *e = &c->ranks[r].bl[i];
    int64_t owner = e->owner;
    size_t h = (size_t)(st_strhash(e->name) ^ st_mix64((uint64_t)owner)) & (c->bcap - 1), b;
    while ((b = c->bmap[h]) != SIZE_MAX &&
           (m->blobs[b].owner != owner || strcmp(m->blobs[b].name, e->name) != 0))
        h = (h + 1) & (c->bcap - 1);
    if (b == SIZE_MAX)
        return st_fail(STRATA_ENOTFOUND,
                       "blob '%s' of owner %d (requested by rank %d) is not in the checkpoint",
                       e->name, e->owner, r);
    if (m->blobs[b].ext.bytes != e->size)
        return st_fail(STRATA_EMISMATCH, "blob '%s': rank %d asks for %llu bytes but %llu were saved",
                       e->name, r, (unsigned long long)e->size,
                       (unsigned long long)m->blobs[b].ext.bytes);
    c->out->request_bytes += e->size;
    if (!e->size)
        return 0;
    runs_out *ro = &c->ro;
    ro->piece = (uint32_t)(c->blob_base + b);
    ro->esz = ro->dsz = 1;
    ro->rank = r;
    ro->local = (uint32_t)(c->ranks[r].nsh + i);
    add_run(ro, 0, 0, e->size);
    return ro->oom ? load_oom() : 0;
}

int st_plan_load(st_io_plan *out, const st_meta *m, const st_rank_view *ranks, int nranks,
                 uint64_t max_io)
{
    load_ctx c;
    load_work = 0;
    int rc = load_ctx_init(&c, out, m, ranks, nranks);
    if (!rc)
        rc = index_names(&c);
    for (int r = 0; r < nranks && !rc; r++) {
        for (size_t i = 0; i < ranks[r].nsh && !rc; i++)
            rc = plan_shard(&c, r, i);
        for (size_t i = 0; i < ranks[r].nbl && !rc; i++)
            rc = plan_blob(&c, r, i);
    }
    if (!rc)
        rc = st_plan_reads(out, max_io);
    return load_ctx_free(&c, rc);
}

size_t st_io_first_run(const st_io_plan *p, uint32_t piece, uint64_t lo)
{
    size_t a = p->run0[piece], b = p->run0[piece + 1];
    uint64_t from = lo > p->maxrun[piece] ? lo - p->maxrun[piece] : 0;
    while (a < b) {
        size_t mid = a + (b - a) / 2;
        if (p->runs[mid].src < from)
            a = mid + 1;
        else
            b = mid;
    }
    return a;
}
