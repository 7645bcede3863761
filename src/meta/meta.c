/* meta.c - encoder and validating decoder of the metadata file and the commit record. */
#include "meta.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/geom.h"
#include "checks.h"

/* ---- encoding ---- */

static void put_extent(st_buf *b, const st_extent *e, uint32_t chunk, int with_bytes,
                       int foreign, int sums2)
{
    st_buf_var(b, e->file);
    st_buf_var(b, foreign ? e->offset : e->offset / ST_ALIGN);
    if (with_bytes)
        st_buf_var(b, e->bytes);
    if (foreign) /* no checksums */
        return;
    uint64_t n = st_nchunks(e->bytes, chunk);
    for (uint64_t i = 0; i < n; i++)
        st_buf_u64(b, e->sums[i]);
    for (uint64_t i = 0; sums2 && i < n; i++)
        st_buf_u64(b, e->sums[n + i]);
}

int st_meta_encode(const st_meta *m, unsigned char **out, size_t *len)
{
    st_buf b = {0};
    const int v2 = !m->foreign && m->version == ST_META_VERSION_INCR;
    st_buf_put(&b, ST_META_MAGIC, 8);
    st_buf_u32(&b, v2 ? ST_META_VERSION_INCR : ST_META_VERSION);
    st_buf_u32(&b, m->foreign ? ST_META_FOREIGN : 0);
    st_buf_u64(&b, 0); /* body length, patched below */
    st_buf_u64(&b, m->step);
    st_buf_var(&b, m->chunk);
    if (v2) { /* the base */
        st_buf_u8(&b, m->base != NULL);
        if (m->base) {
            st_buf_str(&b, m->base);
            st_buf_u64(&b, m->base_id);
        }
    }
    st_buf_var(&b, m->nfiles);
    for (uint32_t i = 0; i < m->nfiles; i++) {
        st_buf_str(&b, m->files[i].name);
        st_buf_var(&b, m->files[i].bytes);
        if (v2)
            st_buf_u8(&b, (uint8_t)st_file_linked(m, i));
    }
    if (m->foreign) { /* each file's identity, when the source took it */
        st_buf_u8(&b, m->idents != NULL);
        for (uint32_t i = 0; m->idents && i < m->nfiles; i++) {
            st_buf_var(&b, m->idents[i].ino);
            st_buf_var(&b, m->idents[i].mtime_ns);
            st_buf_var(&b, m->idents[i].ctime_ns);
        }
        st_checks_put(&b, m); /* the ranges its format checks */
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
            st_buf_u8(&b, (uint8_t)((sh->flat ? 1 : 0) | (v2 && sh->has2 ? 2 : 0)));
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->off[d]);
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->len[d]);
            if (sh->flat) {
                st_buf_var(&b, sh->fs);
                st_buf_var(&b, sh->fe - sh->fs);
            }
            put_extent(&b, &sh->ext, m->chunk, 0, m->foreign, v2 && sh->has2);
        }
    }
    st_buf_var(&b, m->nblobs);
    for (size_t i = 0; i < m->nblobs; i++) {
        st_buf_str(&b, m->blobs[i].name);
        st_buf_var(&b, (uint64_t)(m->blobs[i].owner + 1));
        put_extent(&b, &m->blobs[i].ext, m->chunk, 1, m->foreign, 0);
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

static void rd_extent(st_rd *r, st_meta *m, st_extent *e, uint64_t bytes, int with_bytes,
                      int sums2)
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
    if (!m->foreign && blk > UINT64_MAX / ST_ALIGN) {
        st_rd_fail(r, "extent offset overflows");
        return;
    }
    e->offset = m->foreign ? blk : blk * ST_ALIGN;
    e->bytes = bytes;
    /* shards always hold bytes (their boxes and ranges are non-empty); a blob may be empty */
    if ((bytes == 0 && !with_bytes) || e->offset > m->files[e->file].bytes ||
        bytes > m->files[e->file].bytes - e->offset) {
        st_rd_fail(r, "extent lies outside its data file");
        return;
    }
    e->sums = NULL;
    if (m->foreign) /* no checksums */
        return;
    uint64_t n = st_nchunks(bytes, m->chunk);
    if (n > st_rd_left(r) / (sums2 ? 16 : 8)) {
        st_rd_fail(r, "truncated checksum list");
        return;
    }
    e->sums = st_arena_alloc(&m->arena, n * (sums2 ? 16 : 8));
    if (!e->sums) {
        st_rd_fail(r, "out of memory");
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        e->sums[i] = st_rd_u64(r);
    for (uint64_t i = 0; sums2 && i < n; i++)
        e->sums[n + i] = st_rd_u64(r);
}

static int decode_body(st_rd *r, st_meta *m)
{
    uint64_t chunk = st_rd_var(r);
    if (r->err || (m->foreign ? chunk != 1
                              : chunk < 4096 || chunk > (64u << 20) || (chunk & (chunk - 1))))
        return st_rd_fail(r, "bad checksum chunk size"), -1;
    m->chunk = (uint32_t)chunk;
    const int v2 = m->version == ST_META_VERSION_INCR;
    if (v2) {
        uint8_t has = st_rd_u8(r);
        if (!r->err && has > 1)
            return st_rd_fail(r, "bad base flag"), -1;
        if (has) {
            m->base = rd_str(r, &m->arena, 1);
            m->base_id = st_rd_u64(r);
            if (!r->err && !m->base_id)
                return st_rd_fail(r, "base save id is 0"), -1;
        }
        if (r->err)
            return -1;
    }

    uint64_t nf = st_rd_count(r, 2, "file count exceeds the metadata size");
    if (r->err || nf > UINT32_MAX)
        return st_rd_fail(r, "bad file count"), -1;
    m->nfiles = (uint32_t)nf;
    m->files = st_arena_alloc(&m->arena, (nf ? nf : 1) * sizeof *m->files);
    if (v2)
        m->linked = st_arena_alloc(&m->arena, nf ? nf : 1);
    if (!m->files || (v2 && !m->linked))
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nf && !r->err; i++) {
        m->files[i].name = rd_str(r, &m->arena, 1);
        m->files[i].bytes = st_rd_var(r);
        if (v2) {
            uint8_t l = st_rd_u8(r);
            if (!r->err && (l > 1 || (l && !m->base)))
                st_rd_fail(r, l > 1 ? "bad file origin" : "a linked file without a base");
            m->linked[i] = l;
        }
    }
    if (m->foreign && !r->err) {
        uint8_t has = st_rd_u8(r);
        if (has > 1)
            return st_rd_fail(r, "bad file identity flag"), -1;
        if (has && !(m->idents = st_arena_alloc(&m->arena, (nf ? nf : 1) * sizeof *m->idents)))
            return st_rd_fail(r, "out of memory"), -1;
        for (uint64_t i = 0; has && i < nf && !r->err; i++) {
            m->idents[i].ino = st_rd_var(r);
            m->idents[i].mtime_ns = st_rd_var(r);
            m->idents[i].ctime_ns = st_rd_var(r);
        }
        if (!r->err && st_checks_read(r, m))
            return -1;
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
        size_t min_shard = 1 + 2 * (size_t)t->ndim + 2 + (m->foreign ? 0 : 8); /* sums */
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
            if (fl > (v2 ? 3 : 1)) {
                st_rd_fail(r, "unknown shard flags");
                break;
            }
            sh->flat = fl & 1;
            sh->has2 = fl >> 1;
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
            rd_extent(r, m, &sh->ext, (sh->fe - sh->fs) * esz, 0, sh->has2);
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
        rd_extent(r, m, &b->ext, 0, 1, 0);
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
 * Exact, and near-linear on every input. Two stages:
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

uint64_t st_meta_overlap_work(void)
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
static void ov_cut(ov_reg *r, uint32_t ri, const st_mshard *s, size_t shard, int nd,
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
static int check_boxes(const st_mtensor *t, const size_t *idx, size_t n, uint64_t *work)
{
    int nd = t->ndim;
    if (nd < 1) /* (not reached: a scalar's shards all have one box) */
        return n > 1 ? overlap_error(t, idx[0], idx[1]) : 0;
    size_t cap = n * (size_t)(2 * nd - 1);
    if (cap / (size_t)(2 * nd - 1) != n || cap > UINT32_MAX)
        return st_fail(STRATA_ENOMEM, "tensor '%s': too many shards to check", t->name);
    ov_reg *reg = malloc(n * sizeof *reg);
    uint64_t *pq = malloc(n * 2 * (size_t)nd * sizeof *pq);
    ov_box *box = malloc(cap * sizeof *box);
    uint32_t *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y);
    uint64_t *mark = calloc(cap, sizeof *mark);
    int rc = 0;
    if (!reg || !pq || !box || !x || !y || !mark) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        ov_cut(&reg[i], (uint32_t)i, &t->shards[idx[i]], idx[i], nd, pq + i * 2 * (size_t)nd,
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
        rc = overlap_error(t, reg[box[c.a].reg].shard, reg[box[c.b].reg].shard);
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
static int check_leaf(const st_mtensor *t, size_t *idx, size_t n, box_group *g)
{
    qsort_r(idx, n, sizeof *idx, cmp_box_fs, (void *)t);
    ov_work += n * (64 - (uint64_t)__builtin_clzll(n));
    size_t ng = 0, ne = 0;
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
    for (size_t i = 0; i < n; i++) /* the non-empty ones */
        if (t->shards[idx[i]].fe > t->shards[idx[i]].fs)
            idx[ne++] = idx[i];
    return check_boxes(t, idx, ne, &ov_work);
}

/* Splits idx[0..n) into clusters along dim d and checks each (idx is reordered). */
static int check_split(const st_mtensor *t, size_t *idx, size_t n, int d, span0 *v,
                       box_group *g)
{
    if (n < 2)
        return 0;
    if (d >= t->ndim)
        return check_leaf(t, idx, n, g);
    ov_work += n * (64 - (uint64_t)__builtin_clzll(n));
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
    ov_work = 0;
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

static int check_header(const unsigned char *buf, size_t len, uint32_t flags)
{
    if (len < ST_META_HEADER + ST_META_TRAILER)
        return st_fail(STRATA_EFORMAT, "metadata is truncated (%zu bytes)", len);
    if (memcmp(buf, ST_META_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "metadata has a bad magic number");
    uint32_t ver = st_get_u32(buf + 8);
    if (ver != ST_META_VERSION && !(ver == ST_META_VERSION_INCR && !flags))
        return st_fail(STRATA_EFORMAT, "metadata format version %u is not supported (this "
                       "strata reads versions %u and %u)", ver, ST_META_VERSION,
                       ST_META_VERSION_INCR);
    if (st_get_u32(buf + 12) != flags)
        return st_fail(STRATA_EFORMAT, flags || st_get_u32(buf + 12) != ST_META_FOREIGN
                                           ? "metadata has unknown header flags"
                                           : "metadata describes another format's files (it "
                                             "is never stored)");
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
    m->foreign = st_get_u32(buf + 12) == ST_META_FOREIGN;
    m->version = st_get_u32(buf + 8);
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
    int rc = check_header(buf, len, 0);
    if (rc)
        return rc;
    if (st_hash(buf, len - ST_META_TRAILER) != st_get_u64(buf + len - ST_META_TRAILER))
        return st_fail(STRATA_EFORMAT, "metadata checksum mismatch: the file is corrupt");
    return parse(out, buf, len);
}

int st_meta_decode_unchecked(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len, len >= 16 ? st_get_u32(buf + 12) & ST_META_FOREIGN : 0);
    return rc ? rc : parse(out, buf, len);
}

int st_meta_decode_foreign(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len, ST_META_FOREIGN);
    if (rc)
        return rc;
    if (st_hash(buf, len - ST_META_TRAILER) != st_get_u64(buf + len - ST_META_TRAILER))
        return st_fail(STRATA_EFORMAT, "metadata checksum mismatch: corrupt in transit");
    return parse(out, buf, len);
}

void st_meta_free(st_meta *m)
{
    if (!m)
        return;
    st_arena_free(&m->arena);
    free(m);
}

/* ---- commit record ---- */

static void put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

size_t st_commit_encode(const st_commit *c, unsigned char out[ST_COMMIT_SIZE])
{
    const int v1 = c->version == 1;
    const size_t size = v1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE;
    memcpy(out, ST_COMMIT_MAGIC, 8);
    put_le(out + 8, v1 ? 1 : ST_COMMIT_VERSION, 4);
    put_le(out + 12, 0, 4);
    const uint64_t f[6] = {c->step, c->meta_size, c->meta_hash, c->time_ns, c->data_bytes,
                           c->save_id};
    for (int i = 0; i < (v1 ? 5 : 6); i++)
        put_le(out + 16 + 8 * i, f[i], 8);
    put_le(out + size - 8, st_hash(out, size - 8), 8);
    return size;
}

int st_commit_decode(st_commit *c, const unsigned char *buf, size_t len)
{
    if (len < 16 || memcmp(buf, ST_COMMIT_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "commit record %s",
                       len < 16 ? "is too short" : "has a bad magic number");
    uint32_t version = st_get_u32(buf + 8);
    if ((version != 1 && version != ST_COMMIT_VERSION) || st_get_u32(buf + 12) != 0)
        return st_fail(STRATA_EFORMAT, "commit record version %u is not supported", version);
    size_t size = version == 1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE;
    if (len != size)
        return st_fail(STRATA_EFORMAT, "commit record version %u has %zu bytes, want %zu",
                       version, len, size);
    if (st_hash(buf, size - 8) != st_get_u64(buf + size - 8))
        return st_fail(STRATA_EFORMAT, "commit record checksum mismatch");
    c->version = version;
    c->step = st_get_u64(buf + 16);
    c->meta_size = st_get_u64(buf + 24);
    c->meta_hash = st_get_u64(buf + 32);
    c->time_ns = st_get_u64(buf + 40);
    c->data_bytes = st_get_u64(buf + 48);
    c->save_id = version == 1 ? 0 : st_get_u64(buf + 56);
    return 0;
}

int st_commit_same(const st_commit *a, const st_commit *b)
{
    return a->version == b->version && a->step == b->step && a->meta_size == b->meta_size &&
           a->meta_hash == b->meta_hash && a->time_ns == b->time_ns &&
           a->data_bytes == b->data_bytes && a->save_id == b->save_id;
}

void st_data_file_name(char out[ST_DATA_FILE_BYTES], int rank)
{
    snprintf(out, ST_DATA_FILE_BYTES, "data-%06d.bin", rank);
}

void st_ref_file_name(char out[ST_REF_FILE_BYTES], uint64_t save_id, long rank)
{
    snprintf(out, ST_REF_FILE_BYTES, "ref-%016llx-%06ld.bin", (unsigned long long)save_id, rank);
}

int st_is_ref_file(const char *name)
{
    size_t n = strlen(name);
    if (n < 31 || n > 40 || strncmp(name, "ref-", 4) != 0 || name[20] != '-' ||
        strcmp(name + n - 4, ".bin") != 0)
        return 0;
    for (size_t i = 4; i < n - 4; i++)
        if (i != 20 && !((name[i] >= '0' && name[i] <= '9') ||
                         (i < 20 && name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    return 1;
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

int st_is_strata_file(const char *name)
{
    if (strcmp(name, ST_COMMIT_FILE) == 0 || strcmp(name, ST_META_FILE) == 0 ||
        strcmp(name, ST_COMMIT_FILE ".tmp") == 0 || strcmp(name, ST_META_FILE ".tmp") == 0 ||
        strcmp(name, ST_LOCK_FILE) == 0)
        return 1;
    return st_data_file_rank(name) >= 0 || st_is_ref_file(name);
}
