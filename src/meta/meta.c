/* meta.c - encoder and validating decoder of the metadata file and the commit record. */
#include "meta.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/geom.h"

/* ---- encoding ---- */

static void put_extent(st_buf *b, const st_extent *e, uint32_t chunk, int with_bytes)
{
    st_buf_var(b, e->file);
    st_buf_var(b, e->offset / ST_ALIGN);
    if (with_bytes)
        st_buf_var(b, e->bytes);
    uint64_t n = st_nchunks(e->bytes, chunk);
    for (uint64_t i = 0; i < n; i++)
        st_buf_u64(b, e->sums[i]);
}

int st_meta_encode(const st_meta *m, unsigned char **out, size_t *len)
{
    st_buf b = {0};
    st_buf_put(&b, ST_META_MAGIC, 8);
    st_buf_u32(&b, ST_META_VERSION);
    st_buf_u32(&b, 0);
    st_buf_u64(&b, 0); /* body length, patched below */
    st_buf_u64(&b, m->step);
    st_buf_var(&b, m->chunk);
    st_buf_var(&b, m->nfiles);
    for (uint32_t i = 0; i < m->nfiles; i++) {
        st_buf_str(&b, m->files[i].name);
        st_buf_var(&b, m->files[i].bytes);
    }
    st_buf_var(&b, m->ntensors);
    for (size_t i = 0; i < m->ntensors; i++) {
        const st_mtensor *t = &m->tensors[i];
        st_buf_str(&b, t->name);
        st_buf_u8(&b, (uint8_t)t->dtype);
        st_buf_u8(&b, (uint8_t)t->ndim);
        for (int d = 0; d < t->ndim; d++)
            st_buf_var(&b, t->shape[d]);
        st_buf_var(&b, t->nshards);
        for (size_t s = 0; s < t->nshards; s++) {
            const st_mshard *sh = &t->shards[s];
            st_buf_u8(&b, (uint8_t)(sh->flat ? 1 : 0));
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->off[d]);
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->len[d]);
            if (sh->flat) {
                st_buf_var(&b, sh->fs);
                st_buf_var(&b, sh->fe - sh->fs);
            }
            put_extent(&b, &sh->ext, m->chunk, 0);
        }
    }
    st_buf_var(&b, m->nblobs);
    for (size_t i = 0; i < m->nblobs; i++) {
        st_buf_str(&b, m->blobs[i].name);
        st_buf_var(&b, (uint64_t)(m->blobs[i].owner + 1));
        put_extent(&b, &m->blobs[i].ext, m->chunk, 1);
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory encoding metadata");
    }
    uint64_t body = b.n - ST_META_HEADER;
    for (int i = 0; i < 8; i++)
        b.p[16 + i] = (unsigned char)(body >> (8 * i));
    st_buf_u64(&b, st_hash(b.p, b.n));
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory encoding metadata");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

/* ---- decoding ---- */

static char *rd_str(st_rd *r, st_arena *a, int plain)
{
    char *s = st_rd_str(r, a, STRATA_MAX_NAME);
    if (s && plain && !st_plain_name(s, strlen(s))) {
        st_rd_fail(r, "file name is not a plain name inside the checkpoint directory");
        return NULL;
    }
    return s;
}

int st_plain_name(const char *name, size_t len)
{
    if (len == 0 || (len == 1 && name[0] == '.') || (len == 2 && name[0] == '.' && name[1] == '.'))
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        if (c == '/' || c == '\\' || c < 0x20 || c == 0x7f)
            return 0;
    }
    return 1;
}

static void rd_extent(st_rd *r, st_meta *m, st_extent *e, uint64_t bytes, int with_bytes)
{
    uint64_t file = st_rd_var(r); /* checked before narrowing: 2^32 must not alias file 0 */
    uint64_t blk = st_rd_var(r);
    if (with_bytes)
        bytes = st_rd_var(r);
    if (r->err)
        return;
    if (file >= m->nfiles) {
        st_rd_fail(r, "extent names a file index out of range");
        return;
    }
    e->file = (uint32_t)file;
    if (blk > UINT64_MAX / ST_ALIGN) {
        st_rd_fail(r, "extent offset overflows");
        return;
    }
    e->offset = blk * ST_ALIGN;
    e->bytes = bytes;
    /* shards always hold bytes (their boxes and ranges are non-empty); a blob may be empty */
    if ((bytes == 0 && !with_bytes) || e->offset > m->files[e->file].bytes ||
        bytes > m->files[e->file].bytes - e->offset) {
        st_rd_fail(r, "extent lies outside its data file");
        return;
    }
    uint64_t n = st_nchunks(bytes, m->chunk);
    if (n > st_rd_left(r) / 8) {
        st_rd_fail(r, "truncated checksum list");
        return;
    }
    e->sums = st_arena_alloc(&m->arena, n * 8);
    if (!e->sums) {
        st_rd_fail(r, "out of memory");
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        e->sums[i] = st_rd_u64(r);
}

static int decode_body(st_rd *r, st_meta *m)
{
    uint64_t chunk = st_rd_var(r);
    if (r->err || chunk < 4096 || chunk > (64u << 20) || (chunk & (chunk - 1)))
        return st_rd_fail(r, "bad checksum chunk size"), -1;
    m->chunk = (uint32_t)chunk;

    uint64_t nf = st_rd_count(r, 2, "file count exceeds the metadata size");
    if (r->err || nf > UINT32_MAX)
        return st_rd_fail(r, "bad file count"), -1;
    m->nfiles = (uint32_t)nf;
    m->files = st_arena_alloc(&m->arena, (nf ? nf : 1) * sizeof *m->files);
    if (!m->files)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nf && !r->err; i++) {
        m->files[i].name = rd_str(r, &m->arena, 1);
        m->files[i].bytes = st_rd_var(r);
    }

    uint64_t nt = st_rd_count(r, 4, "tensor count exceeds the metadata size");
    if (r->err)
        return -1;
    m->ntensors = nt;
    m->tensors = st_arena_alloc(&m->arena, (nt ? nt : 1) * sizeof *m->tensors);
    if (!m->tensors)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nt && !r->err; i++) {
        st_mtensor *t = &m->tensors[i];
        memset(t, 0, sizeof *t);
        t->name = rd_str(r, &m->arena, 0);
        t->dtype = (strata_dtype)st_rd_u8(r);
        t->ndim = st_rd_u8(r);
        if (r->err)
            break;
        if ((unsigned)t->dtype >= STRATA_DTYPE_COUNT) {
            st_rd_fail(r, "unknown dtype");
            break;
        }
        if (t->ndim > STRATA_MAX_DIMS) {
            st_rd_fail(r, "too many dims");
            break;
        }
        int of = 0;
        for (int d = 0; d < t->ndim; d++)
            t->shape[d] = st_rd_var(r);
        uint64_t numel = st_box_numel(t->ndim, t->shape, &of), tb;
        if (!r->err && (of || !st_mul_ok(numel, strata_dtype_size(t->dtype), &tb) ||
                        tb > (UINT64_MAX >> 2))) {
            st_rd_fail(r, "tensor size overflows");
            break;
        }
        size_t min_shard = 1 + 2 * (size_t)t->ndim + 2 + 8;
        t->nshards = st_rd_count(r, min_shard, "shard count exceeds the metadata size");
        if (r->err)
            break;
        t->shards = st_arena_alloc(&m->arena, (t->nshards ? t->nshards : 1) * sizeof *t->shards);
        uint64_t *dims = st_arena_alloc(&m->arena, (t->nshards * 2 * (size_t)t->ndim + 1) * 8);
        if (!t->shards || !dims) {
            st_rd_fail(r, "out of memory");
            break;
        }
        size_t esz = strata_dtype_size(t->dtype);
        for (size_t s = 0; s < t->nshards && !r->err; s++) {
            st_mshard *sh = &t->shards[s];
            sh->off = dims + s * 2 * (size_t)t->ndim;
            sh->len = sh->off + t->ndim;
            uint8_t fl = st_rd_u8(r);
            if (fl > 1) {
                st_rd_fail(r, "unknown shard flags");
                break;
            }
            sh->flat = fl;
            for (int d = 0; d < t->ndim; d++)
                sh->off[d] = st_rd_var(r);
            for (int d = 0; d < t->ndim; d++)
                sh->len[d] = st_rd_var(r);
            if (r->err)
                break;
            for (int d = 0; d < t->ndim; d++)
                if (sh->len[d] == 0 || sh->off[d] > t->shape[d] ||
                    sh->len[d] > t->shape[d] - sh->off[d]) {
                    st_rd_fail(r, "shard box outside the tensor");
                    break;
                }
            if (r->err)
                break;
            uint64_t bn = st_box_numel(t->ndim, sh->len, NULL);
            sh->fs = 0;
            sh->fe = bn;
            if (sh->flat) {
                uint64_t fs = st_rd_var(r), n = st_rd_var(r);
                if (r->err || n == 0 || fs > bn || n > bn - fs) {
                    st_rd_fail(r, "flat range outside the shard box");
                    break;
                }
                sh->fs = fs;
                sh->fe = fs + n;
            }
            rd_extent(r, m, &sh->ext, (sh->fe - sh->fs) * esz, 0);
            t->bytes += sh->ext.bytes;
        }
        m->data_bytes += t->bytes;
    }

    uint64_t nb = st_rd_count(r, 4, "blob count exceeds the metadata size");
    if (r->err)
        return -1;
    m->nblobs = nb;
    m->blobs = st_arena_alloc(&m->arena, (nb ? nb : 1) * sizeof *m->blobs);
    if (!m->blobs)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nb && !r->err; i++) {
        st_mblob *b = &m->blobs[i];
        b->name = rd_str(r, &m->arena, 0);
        uint64_t o = st_rd_var(r);
        if (!r->err && o > INT32_MAX)
            st_rd_fail(r, "bad blob owner");
        b->owner = (int64_t)o - 1;
        rd_extent(r, m, &b->ext, 0, 1);
        m->data_bytes += b->ext.bytes;
    }
    if (!r->err && r->p != r->end)
        st_rd_fail(r, "trailing bytes after the blob table");
    return r->err ? -1 : 0;
}

/* Names must be unique: tensors by name, blobs by (name, owner). Sort-free check with an
 * open-addressing table of indices. */
/* Item i of the names that must be unique: tensors (kind -2), blobs (kind = owner, so
 * unique per owner), files (kind -3). */
static const char *unique_item(const st_meta *m, size_t i, int64_t *kind)
{
    if (i < m->ntensors) {
        *kind = -2;
        return m->tensors[i].name;
    }
    i -= m->ntensors;
    if (i < m->nblobs) {
        *kind = m->blobs[i].owner;
        return m->blobs[i].name;
    }
    *kind = -3;
    return m->files[i - m->nblobs].name;
}

/* Names must be unique: one hash set over all of them (linear time). */
static int check_unique(st_meta *m, char *why, size_t whylen)
{
    size_t n = m->ntensors + m->nblobs + m->nfiles, cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    size_t *tab = malloc(cap * sizeof *tab);
    if (!tab)
        return STRATA_ENOMEM;
    for (size_t i = 0; i < cap; i++)
        tab[i] = SIZE_MAX;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        int64_t kind, jk;
        const char *name = unique_item(m, i, &kind);
        size_t h = (size_t)(st_strhash(name) ^ st_mix64((uint64_t)kind)) & (cap - 1);
        while (tab[h] != SIZE_MAX) {
            const char *jn = unique_item(m, tab[h], &jk);
            if (jk == kind && strcmp(jn, name) == 0) {
                snprintf(why, whylen, "duplicate %s name '%s'",
                         kind == -2 ? "tensor" : kind == -3 ? "file" : "blob", name);
                rc = STRATA_EFORMAT;
                break;
            }
            h = (h + 1) & (cap - 1);
        }
        tab[h] = i;
    }
    free(tab);
    return rc;
}

/* ---- the overlap check ----
 * Shards can only share an element if their spans (the indices each touches) intersect
 * along every dim. So the shards are split recursively, dim by dim, into clusters whose
 * spans along that dim connect (different clusters cannot overlap), and only the shards
 * that no dim separates are compared: those with one box by their flat ranges (sorted), the
 * rest box group against box group, along the dim where their spans intersect least. A
 * grid of one-element shards in 8 dims costs n log n per dim, not n^2. */

typedef struct {
    uint64_t lo, hi;
    size_t idx;
} span0;

static int cmp_span0(const void *a, const void *b)
{
    const span0 *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo ? 1 : (x->idx < y->idx ? -1 : x->idx > y->idx);
}

static int stop_at_first(void *ctx, uint64_t a, uint64_t b, uint64_t n)
{
    (void)ctx, (void)a, (void)b, (void)n;
    return 1;
}

static st_region region_of(const st_mtensor *t, const st_mshard *s)
{
    return (st_region){t->ndim, s->off, s->len, s->fs, s->fe};
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

/* Pairs of entries whose spans (sorted by lo) intersect: the work of a sweep along them. */
static uint64_t sweep_pairs(const span0 *v, size_t n)
{
    uint64_t pairs = 0;
    for (size_t i = 0; i < n; i++) {
        size_t lo = i + 1, hi = n; /* first j > i with v[j].lo >= v[i].hi */
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (v[mid].lo < v[i].hi)
                lo = mid + 1;
            else
                hi = mid;
        }
        pairs += lo - i - 1;
    }
    return pairs;
}

static int overlap_error(const st_mtensor *t, size_t a, size_t b)
{
    return st_fail(STRATA_EOVERLAP, "tensor '%s': shards %zu and %zu overlap", t->name,
                   ST_MIN(a, b), ST_MAX(a, b));
}

static int same_box(const st_mtensor *t, const st_mshard *a, const st_mshard *b)
{
    for (int d = 0; d < t->ndim; d++)
        if (a->off[d] != b->off[d] || a->len[d] != b->len[d])
            return 0;
    return 1;
}

static int cmp_box_fs(const void *pa, const void *pb, void *ctx)
{
    const st_mtensor *t = ctx;
    const st_mshard *a = &t->shards[*(const size_t *)pa], *b = &t->shards[*(const size_t *)pb];
    for (int d = 0; d < t->ndim; d++) {
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

/* The spans along dim d of the hulls of box groups g[0..ng) (a box, with the flat range
 * of all its shards), sorted into v. */
static void group_spans(const st_mtensor *t, const size_t *idx, const box_group *g, size_t ng,
                        int d, span0 *v)
{
    for (size_t k = 0; k < ng; k++) {
        const st_mshard *s = &t->shards[idx[g[k].start]];
        st_region r = {t->ndim, s->off, s->len, g[k].fs, g[k].fe};
        v[k].idx = k;
        span_of(&r, d, &v[k].lo, &v[k].hi);
    }
    qsort(v, ng, sizeof *v, cmp_span0);
}

/* Shards idx[0..n) that no dim separates. v, groups: scratch of n. */
static int check_leaf(const st_mtensor *t, size_t *idx, size_t n, span0 *v, box_group *g)
{
    qsort_r(idx, n, sizeof *idx, cmp_box_fs, (void *)t);
    size_t ng = 0;
    for (size_t i = 0; i < n; i++) {
        const st_mshard *s = &t->shards[idx[i]];
        if (s->fe <= s->fs)
            continue; /* empty: overlaps nothing */
        if (ng && same_box(t, &t->shards[idx[g[ng - 1].start]], s)) {
            box_group *c = &g[ng - 1];
            if (s->fs < c->fe) /* sorted by fs: it starts inside an earlier range */
                for (size_t k = c->start; k < i; k++) {
                    const st_mshard *o = &t->shards[idx[k]];
                    if (o->fe > s->fs && o->fe > o->fs)
                        return overlap_error(t, idx[k], idx[i]);
                }
            c->end = i + 1;
            c->fe = ST_MAX(c->fe, s->fe);
        } else {
            g[ng++] = (box_group){i, i + 1, s->fs, s->fe};
        }
    }
    if (ng < 2)
        return 0;
    /* box groups against each other: along the dim where their hulls intersect least */
    int best = 0;
    uint64_t best_pairs = UINT64_MAX;
    for (int d = 0; d < t->ndim && best_pairs > 0; d++) {
        group_spans(t, idx, g, ng, d, v);
        uint64_t pairs = sweep_pairs(v, ng);
        if (pairs < best_pairs) {
            best_pairs = pairs;
            best = d;
        }
    }
    group_spans(t, idx, g, ng, best, v);
    for (size_t i = 0; i < ng; i++) {
        const box_group *a = &g[v[i].idx];
        const st_mshard *as = &t->shards[idx[a->start]];
        st_region ha = {t->ndim, as->off, as->len, a->fs, a->fe};
        for (size_t j = i + 1; j < ng && v[j].lo < v[i].hi; j++) {
            const box_group *b = &g[v[j].idx];
            const st_mshard *bs = &t->shards[idx[b->start]];
            st_region hb = {t->ndim, bs->off, bs->len, b->fs, b->fe};
            if (!st_region_runs(&ha, &hb, stop_at_first, NULL))
                continue; /* the hulls do not meet */
            for (size_t x = a->start; x < a->end; x++)
                for (size_t y = b->start; y < b->end; y++) {
                    st_region rx = region_of(t, &t->shards[idx[x]]);
                    st_region ry = region_of(t, &t->shards[idx[y]]);
                    if (st_region_runs(&rx, &ry, stop_at_first, NULL))
                        return overlap_error(t, idx[x], idx[y]);
                }
        }
    }
    return 0;
}

/* Splits idx[0..n) into clusters along dim d and checks each (idx is reordered). */
static int check_split(const st_mtensor *t, size_t *idx, size_t n, int d, span0 *v,
                       box_group *g)
{
    if (n < 2)
        return 0;
    if (d >= t->ndim)
        return check_leaf(t, idx, n, v, g);
    for (size_t i = 0; i < n; i++) {
        st_region r = region_of(t, &t->shards[idx[i]]);
        v[i].idx = idx[i];
        span_of(&r, d, &v[i].lo, &v[i].hi);
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

int st_meta_check_overlap(const st_mtensor *t)
{
    if (t->nshards < 2)
        return 0;
    size_t n = t->nshards, *idx = malloc(n * sizeof *idx);
    span0 *v = malloc(n * sizeof *v);
    box_group *g = malloc(n * sizeof *g);
    int rc = 0;
    if (!idx || !v || !g)
        rc = st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; !rc && i < n; i++)
        idx[i] = i;
    if (!rc)
        rc = check_split(t, idx, n, 0, v, g);
    free(idx);
    free(v);
    free(g);
    return rc;
}

static int check_header(const unsigned char *buf, size_t len)
{
    if (len < ST_META_HEADER + ST_META_TRAILER)
        return st_fail(STRATA_EFORMAT, "metadata is truncated (%zu bytes)", len);
    if (memcmp(buf, ST_META_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "metadata has a bad magic number");
    uint32_t ver = st_get_u32(buf + 8);
    if (ver != ST_META_VERSION)
        return st_fail(STRATA_EFORMAT, "metadata format version %u is not supported (want %u)",
                       ver, ST_META_VERSION);
    if (st_get_u32(buf + 12) != 0)
        return st_fail(STRATA_EFORMAT, "metadata has unknown header flags");
    uint64_t body = st_get_u64(buf + 16);
    if (body != len - ST_META_HEADER - ST_META_TRAILER)
        return st_fail(STRATA_EFORMAT,
                       "metadata is truncated or padded: header says %llu body bytes, file has %zu",
                       (unsigned long long)body, len - ST_META_HEADER - ST_META_TRAILER);
    return 0;
}

static int parse(st_meta **out, const unsigned char *buf, size_t len)
{
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory");
    m->step = st_get_u64(buf + 24);
    st_rd r = {.p = buf + ST_META_HEADER, .end = buf + len - ST_META_TRAILER, .base = buf};
    if (decode_body(&r, m) != 0) {
        st_meta_free(m);
        return st_fail(STRATA_EFORMAT, "metadata is malformed: %s", r.what);
    }
    char why[STRATA_MAX_NAME + 64];
    int rc = check_unique(m, why, sizeof why);
    if (rc) {
        st_meta_free(m);
        return rc == STRATA_ENOMEM ? st_fail(rc, "out of memory")
                                   : st_fail(STRATA_EFORMAT, "metadata is malformed: %s", why);
    }
    for (size_t i = 0; i < m->ntensors; i++) {
        rc = st_meta_check_overlap(&m->tensors[i]);
        if (rc) {
            st_meta_free(m);
            return rc == STRATA_EOVERLAP ? st_wrap(STRATA_EFORMAT, "metadata is malformed") : rc;
        }
    }
    *out = m;
    return 0;
}

int st_meta_decode(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len);
    if (rc)
        return rc;
    if (st_hash(buf, len - ST_META_TRAILER) != st_get_u64(buf + len - ST_META_TRAILER))
        return st_fail(STRATA_EFORMAT, "metadata checksum mismatch: the file is corrupt");
    return parse(out, buf, len);
}

int st_meta_decode_unchecked(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len);
    return rc ? rc : parse(out, buf, len);
}

void st_meta_free(st_meta *m)
{
    if (!m)
        return;
    st_arena_free(&m->arena);
    free(m);
}

/* ---- commit record ---- */

void st_commit_encode(const st_commit *c, unsigned char out[ST_COMMIT_SIZE])
{
    st_buf b = {.p = out, .cap = ST_COMMIT_SIZE};
    st_buf_put(&b, ST_COMMIT_MAGIC, 8);
    st_buf_u32(&b, ST_COMMIT_VERSION);
    st_buf_u32(&b, 0);
    st_buf_u64(&b, c->step);
    st_buf_u64(&b, c->meta_size);
    st_buf_u64(&b, c->meta_hash);
    st_buf_u64(&b, c->time_ns);
    st_buf_u64(&b, c->data_bytes);
    st_buf_u64(&b, st_hash(out, ST_COMMIT_SIZE - 8));
}

int st_commit_decode(st_commit *c, const unsigned char *buf, size_t len)
{
    if (len != ST_COMMIT_SIZE)
        return st_fail(STRATA_EFORMAT, "commit record has %zu bytes, want %u", len,
                       ST_COMMIT_SIZE);
    if (memcmp(buf, ST_COMMIT_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "commit record has a bad magic number");
    if (st_get_u32(buf + 8) != ST_COMMIT_VERSION || st_get_u32(buf + 12) != 0)
        return st_fail(STRATA_EFORMAT, "commit record version %u is not supported",
                       st_get_u32(buf + 8));
    if (st_hash(buf, ST_COMMIT_SIZE - 8) != st_get_u64(buf + ST_COMMIT_SIZE - 8))
        return st_fail(STRATA_EFORMAT, "commit record checksum mismatch");
    c->step = st_get_u64(buf + 16);
    c->meta_size = st_get_u64(buf + 24);
    c->meta_hash = st_get_u64(buf + 32);
    c->time_ns = st_get_u64(buf + 40);
    c->data_bytes = st_get_u64(buf + 48);
    return 0;
}

void st_data_file_name(char out[ST_DATA_FILE_BYTES], int rank)
{
    snprintf(out, ST_DATA_FILE_BYTES, "data-%06d.bin", rank);
}

long st_data_file_rank(const char *name)
{
    size_t n = strlen(name);
    if (n < 15 || n > 24 || strncmp(name, "data-", 5) != 0 || strcmp(name + n - 4, ".bin") != 0)
        return -1;
    long r = 0;
    for (size_t i = 5; i < n - 4; i++) {
        if (name[i] < '0' || name[i] > '9')
            return -1;
        if (r > (LONG_MAX - 9) / 10)
            return -1;
        r = r * 10 + (name[i] - '0');
    }
    return r;
}
