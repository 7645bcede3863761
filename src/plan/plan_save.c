/* plan_save.c - the global save plan: dedup of replicated shards, balanced writers, layout
 * of each writer's data file, and the metadata skeleton. Pure; single-threaded. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../core/geom.h"
#include "../core/util.h"
#include "plan.h"

typedef struct {
    const st_entry *e; /* first registration: name, dtype, shape */
    int rank;
    size_t pos; /* position in name order */
} tinfo;

typedef struct {
    int rank;
    uint32_t local; /* registration index on that rank: shards, then nsh + blob */
    const void *data;
} holder;

typedef struct {
    int blob;
    size_t tensor;         /* shards */
    const st_entry *e;     /* shards: first registration */
    const st_blobent *b;   /* blobs: first registration */
    int64_t owner;         /* blobs: -1 global, else the rank */
    uint64_t fs, fe;       /* shards: the flat range saved (a piece of e's when split) */
    uint64_t bytes;
    size_t h0, nh;
    int writer;
    uint32_t local;   /* the writer's registration index */
    uint64_t src_off; /* bytes into that registration's data */
    const void *src;
    int device;       /* src is CUDA device memory */
    int unchanged;    /* every holder marked it STRATA_SHARD_UNCHANGED */
    size_t meta_pos;
} item;

typedef struct {
    size_t *slot;
    size_t cap;
} imap; /* open addressing over indices; SIZE_MAX = empty */

static int imap_init(imap *m, size_t n)
{
    m->cap = 16;
    while (m->cap < 2 * n + 2)
        m->cap *= 2;
    m->slot = malloc(m->cap * sizeof *m->slot);
    if (!m->slot)
        return -1;
    for (size_t i = 0; i < m->cap; i++)
        m->slot[i] = SIZE_MAX;
    return 0;
}

static uint64_t shard_hash(size_t tensor, const st_entry *e)
{
    uint64_t h = st_mix64(tensor + 0x9e3779b97f4a7c15ULL);
    for (int d = 0; d < e->ndim; d++)
        h = st_mix64(h ^ e->off[d]) ^ st_mix64(h + e->len[d]);
    return st_mix64(h ^ e->fs) ^ st_mix64(h + e->fe + 1);
}

static int same_geometry(const st_entry *a, const st_entry *b)
{
    if (a->fs != b->fs || a->fe != b->fe)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->off[d] != b->off[d] || a->len[d] != b->len[d])
            return 0;
    return 1;
}

static int same_tensor(const st_entry *a, const st_entry *b)
{
    if (a->dtype != b->dtype || a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return 1;
}

static void describe(char *out, size_t cap, const st_entry *e)
{
    int n = snprintf(out, cap, "%s[", strata_dtype_name(e->dtype));
    for (int d = 0; d < e->ndim && n > 0 && (size_t)n < cap; d++)
        n += snprintf(out + n, cap - (size_t)n, d ? ",%llu" : "%llu",
                      (unsigned long long)e->shape[d]);
    if (n > 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, "]");
}

static int cmp_tinfo_name(const void *a, const void *b, void *ctx)
{
    const tinfo *t = ctx;
    return strcmp(t[*(const size_t *)a].e->name, t[*(const size_t *)b].e->name);
}

typedef struct {
    const item *it;
    const tinfo *ti;
} order_ctx;

/* Metadata order: shards by (tensor name, box offsets, flat start), then blobs by
 * (name, owner). */
static int cmp_items(const void *pa, const void *pb, void *ctx)
{
    const order_ctx *c = ctx;
    const item *a = &c->it[*(const size_t *)pa], *b = &c->it[*(const size_t *)pb];
    if (a->blob != b->blob)
        return a->blob - b->blob;
    if (a->blob) {
        int r = strcmp(a->b->name, b->b->name);
        return r ? r : (a->owner > b->owner) - (a->owner < b->owner);
    }
    size_t ta = c->ti[a->tensor].pos, tb = c->ti[b->tensor].pos;
    if (ta != tb)
        return ta < tb ? -1 : 1;
    for (int d = 0; d < a->e->ndim; d++)
        if (a->e->off[d] != b->e->off[d])
            return a->e->off[d] < b->e->off[d] ? -1 : 1;
    return (a->fs > b->fs) - (a->fs < b->fs);
}

/* Replicated items, largest first. */
static int cmp_size_desc(const void *pa, const void *pb, void *ctx)
{
    const item *it = ctx;
    const item *a = &it[*(const size_t *)pa], *b = &it[*(const size_t *)pb];
    if (a->bytes != b->bytes)
        return a->bytes < b->bytes ? 1 : -1;
    return (a->meta_pos > b->meta_pos) - (a->meta_pos < b->meta_pos);
}

static int uf_find(int *parent, int x)
{
    while (parent[x] != x)
        x = parent[x] = parent[parent[x]];
    return x;
}

/* The balance bound (see st_save_plan.writer_bytes_bound): union-find over ranks, and
 * each rank's own single-holder bytes. */
static uint64_t balance_bound(const item *it, size_t ni, const holder *hold, int nranks)
{
    int *parent = malloc((size_t)nranks * sizeof *parent), *count = calloc((size_t)nranks, sizeof *count);
    uint64_t *bytes = calloc((size_t)nranks, sizeof *bytes), best = 0;
    if (!parent || !count || !bytes)
        goto out;
    for (int r = 0; r < nranks; r++)
        parent[r] = r;
    /* tensor items only: global blobs are held everywhere but are too small to move work,
     * and leaving them out keeps the bound valid (it only omits bytes) */
    for (size_t j = 0; j < ni; j++)
        for (size_t h = 1; h < it[j].nh && !it[j].blob; h++) {
            int a = uf_find(parent, hold[it[j].h0].rank), b = uf_find(parent, hold[it[j].h0 + h].rank);
            if (a != b)
                parent[a] = b;
        }
    for (size_t j = 0; j < ni; j++)
        if (!it[j].blob)
            bytes[uf_find(parent, hold[it[j].h0].rank)] += it[j].bytes;
    for (int r = 0; r < nranks; r++)
        count[uf_find(parent, r)]++;
    for (int r = 0; r < nranks; r++)
        if (bytes[r] && (bytes[r] + (uint64_t)count[r] - 1) / (uint64_t)count[r] > best)
            best = (bytes[r] + (uint64_t)count[r] - 1) / (uint64_t)count[r];
    /* and no rank writes less than what only it holds */
    memset(bytes, 0, (size_t)nranks * sizeof *bytes);
    for (size_t j = 0; j < ni; j++)
        if (it[j].nh == 1)
            bytes[hold[it[j].h0].rank] += it[j].bytes;
    for (int r = 0; r < nranks; r++)
        best = ST_MAX(best, bytes[r]);
out:
    free(parent);
    free(count);
    free(bytes);
    return best;
}

/* Items smaller than this are never split: pieces cost metadata and I/O calls. */
#define SPLIT_MIN_BYTES ((uint64_t)64 << 10)

/* Splits each replicated shard larger than a tenth of the mean writer load (and than
 * SPLIT_MIN_BYTES) into up to nh flat pieces of about that size, cut at 4 KiB boundaries
 * of the data; the pieces keep the item's holder list. */
static int split_large(item **itp, size_t *nip, const holder *hold, int nranks)
{
    item *it = *itp;
    size_t ni = *nip, extra = 0;
    uint64_t total = 0;
    int writers = 0;
    unsigned char *holds = calloc((size_t)nranks, 1);
    if (!holds)
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    for (size_t j = 0; j < ni; j++) {
        total += it[j].bytes;
        for (size_t h = 0; h < it[j].nh; h++)
            if (!holds[hold[it[j].h0 + h].rank]++)
                writers++;
    }
    free(holds);
    uint64_t limit = writers ? total / (uint64_t)writers / 10 : 0;
    if (limit < SPLIT_MIN_BYTES)
        limit = SPLIT_MIN_BYTES;
    for (size_t j = 0; j < ni; j++)
        if (!it[j].blob && it[j].nh > 1 && it[j].bytes > limit)
            extra += ST_MIN(it[j].nh, (it[j].bytes + limit - 1) / limit) - 1;
    if (!extra)
        return 0;
    item *n = realloc(it, (ni + extra + 1) * sizeof *n);
    if (!n)
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    *itp = it = n;
    size_t end = ni;
    for (size_t j = 0; j < ni; j++) {
        if (it[j].blob || it[j].nh <= 1 || it[j].bytes <= limit)
            continue;
        uint64_t pieces = ST_MIN(it[j].nh, (it[j].bytes + limit - 1) / limit);
        uint64_t esz = strata_dtype_size(it[j].e->dtype), grain = 4096 / esz;
        uint64_t fs = it[j].fs, fe = it[j].fe, count = fe - fs, prev = fs;
        for (uint64_t k = 1; k <= pieces; k++) {
            uint64_t cut = k == pieces ? fe : fs + (count * k / pieces) / grain * grain;
            if (cut <= prev)
                continue;
            item *x = k == 1 ? &it[j] : &it[end++];
            if (k > 1)
                *x = it[j];
            x->fs = prev;
            x->fe = cut;
            x->bytes = (cut - prev) * esz;
            prev = cut;
        }
    }
    *nip = end;
    return 0;
}

void st_save_plan_free(st_save_plan *p)
{
    st_meta_free(p->meta);
    free(p->pieces);
    free(p->writer_file);
    free(p->writer_bytes);
    memset(p, 0, sizeof *p);
}

int st_plan_save(st_save_plan *out, const st_rank_view *ranks, int nranks, uint32_t chunk,
                 uint64_t step)
{
    memset(out, 0, sizeof *out);
    if (nranks < 1)
        return st_fail(STRATA_EINVAL, "save needs at least one rank");
    size_t nent = 0, nblob = 0;
    for (int r = 0; r < nranks; r++) {
        nent += ranks[r].nsh;
        nblob += ranks[r].nbl;
    }
    int rc = 0;
    tinfo *ti = malloc((nent + 1) * sizeof *ti);
    item *it = malloc((nent + nblob + 1) * sizeof *it);
    size_t *ids = malloc((nent + nblob + 1) * sizeof *ids);
    imap tm = {0}, im = {0};
    holder *hold = NULL;
    size_t *order = NULL, *fill = NULL;
    st_meta *m = NULL;
    size_t nt = 0, ni = 0;
    if (!ti || !it || !ids || imap_init(&tm, nent) || imap_init(&im, nent + nblob)) {
        rc = st_fail(STRATA_ENOMEM, "out of memory planning the save");
        goto done;
    }

    /* 1. tensors and distinct items, with holder counts */
    size_t k = 0;
    for (int r = 0; r < nranks && !rc; r++) {
        for (size_t i = 0; i < ranks[r].nsh; i++, k++) {
            const st_entry *e = &ranks[r].sh[i];
            ids[k] = SIZE_MAX;
            size_t h = (size_t)st_strhash(e->name) & (tm.cap - 1), t;
            while ((t = tm.slot[h]) != SIZE_MAX && strcmp(ti[t].e->name, e->name) != 0)
                h = (h + 1) & (tm.cap - 1);
            if (t == SIZE_MAX) {
                t = nt++;
                ti[t] = (tinfo){e, r, 0};
                tm.slot[h] = t;
            } else if (!same_tensor(ti[t].e, e)) {
                char a[256], b[256];
                describe(a, sizeof a, ti[t].e);
                describe(b, sizeof b, e);
                rc = st_fail(STRATA_EMISMATCH, "tensor '%s' is %s on rank %d but %s on rank %d",
                             e->name, a, ti[t].rank, b, r);
                break;
            }
            if (e->bytes == 0)
                continue; /* an empty piece of an uneven split: nothing to save */
            size_t hh = (size_t)shard_hash(t, e) & (im.cap - 1), j;
            while ((j = im.slot[hh]) != SIZE_MAX &&
                   (it[j].blob || it[j].tensor != t || !same_geometry(it[j].e, e)))
                hh = (hh + 1) & (im.cap - 1);
            if (j == SIZE_MAX) {
                j = ni++;
                it[j] = (item){.tensor = t, .e = e, .fs = e->fs, .fe = e->fe, .bytes = e->bytes,
                               .writer = -1};
                im.slot[hh] = j;
            }
            it[j].nh++;
            ids[k] = j;
        }
    }
    for (int r = 0; r < nranks && !rc; r++) {
        for (size_t i = 0; i < ranks[r].nbl; i++, k++) {
            const st_blobent *b = &ranks[r].bl[i];
            int64_t owner = b->local ? r : -1;
            size_t hh = (size_t)(st_strhash(b->name) ^ st_mix64((uint64_t)owner + 7)) & (im.cap - 1), j;
            while ((j = im.slot[hh]) != SIZE_MAX &&
                   (!it[j].blob || it[j].owner != owner || strcmp(it[j].b->name, b->name) != 0))
                hh = (hh + 1) & (im.cap - 1);
            if (j == SIZE_MAX) {
                j = ni++;
                it[j] = (item){.blob = 1, .b = b, .owner = owner, .bytes = b->size, .writer = -1};
                im.slot[hh] = j;
            } else if (b->local) {
                rc = st_fail(STRATA_EINVAL, "blob '%s' is registered twice on rank %d", b->name, r);
                break;
            } else if (it[j].bytes != b->size) {
                rc = st_fail(STRATA_EMISMATCH, "global blob '%s' has %llu bytes on one rank and "
                             "%llu on rank %d", b->name, (unsigned long long)it[j].bytes,
                             (unsigned long long)b->size, r);
                break;
            }
            it[j].nh++;
            ids[k] = j;
        }
    }
    if (rc)
        goto done;

    /* 2. holder lists */
    hold = malloc((nent + nblob + 1) * sizeof *hold);
    fill = calloc(ni + 1, sizeof *fill);
    order = malloc((ni + nt + 1) * sizeof *order);
    if (!hold || !fill || !order) {
        rc = st_fail(STRATA_ENOMEM, "out of memory planning the save");
        goto done;
    }
    size_t acc = 0;
    for (size_t j = 0; j < ni; j++) {
        it[j].h0 = acc;
        acc += it[j].nh;
    }
    k = 0;
    for (int r = 0; r < nranks; r++)
        for (size_t i = 0; i < ranks[r].nsh; i++, k++)
            if (ids[k] != SIZE_MAX)
                hold[it[ids[k]].h0 + fill[ids[k]]++] = (holder){r, (uint32_t)i, ranks[r].sh[i].data};
    for (int r = 0; r < nranks; r++)
        for (size_t i = 0; i < ranks[r].nbl; i++, k++)
            hold[it[ids[k]].h0 + fill[ids[k]]++] =
                (holder){r, (uint32_t)(ranks[r].nsh + i), ranks[r].bl[i].data};

    /* 3. split large replicated shards into flat pieces, one per holder at most, so that
     * no single item is big enough to unbalance the writers (list scheduling ends within
     * one item of the mean) */
    if ((rc = split_large(&it, &ni, hold, nranks)))
        goto done;
    free(order);
    if (!(order = malloc((ni + nt + 1) * sizeof *order))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory planning the save");
        goto done;
    }

    /* 4. metadata order */
    for (size_t t = 0; t < nt; t++)
        order[t] = t;
    qsort_r(order, nt, sizeof *order, cmp_tinfo_name, ti);
    for (size_t t = 0; t < nt; t++)
        ti[order[t]].pos = t;
    for (size_t j = 0; j < ni; j++)
        order[j] = j;
    order_ctx oc = {it, ti};
    qsort_r(order, ni, sizeof *order, cmp_items, &oc);
    for (size_t j = 0; j < ni; j++)
        it[order[j]].meta_pos = j;

    /* 5. balance: single-holder items are fixed; the rest largest first to the least
     * loaded holder */
    out->nranks = nranks;
    out->writer_bytes = calloc((size_t)nranks, sizeof *out->writer_bytes);
    out->writer_file = malloc((size_t)nranks * sizeof *out->writer_file);
    if (!out->writer_bytes || !out->writer_file) {
        rc = st_fail(STRATA_ENOMEM, "out of memory planning the save");
        goto done;
    }
    size_t nmulti = 0;
    for (size_t j = 0; j < ni; j++) {
        if (it[j].nh == 1) {
            it[j].writer = hold[it[j].h0].rank;
            out->writer_bytes[it[j].writer] += it[j].bytes;
        } else {
            order[nmulti++] = j;
        }
    }
    qsort_r(order, nmulti, sizeof *order, cmp_size_desc, it);
    for (size_t q = 0; q < nmulti; q++) {
        item *x = &it[order[q]];
        int best = hold[x->h0].rank;
        for (size_t h = 1; h < x->nh; h++) {
            int r = hold[x->h0 + h].rank;
            if (out->writer_bytes[r] < out->writer_bytes[best] ||
                (out->writer_bytes[r] == out->writer_bytes[best] && r < best))
                best = r;
        }
        x->writer = best;
        out->writer_bytes[best] += x->bytes;
    }
    for (size_t j = 0; j < ni; j++)
        for (size_t h = 0; h < it[j].nh; h++)
            if (hold[it[j].h0 + h].rank == it[j].writer) {
                const holder *w = &hold[it[j].h0 + h];
                it[j].local = w->local;
                if (!it[j].blob) /* a piece starts inside the holder's buffer */
                    it[j].src_off = (it[j].fs - it[j].e->fs) * strata_dtype_size(it[j].e->dtype);
                it[j].src = w->data ? (const char *)w->data + it[j].src_off : NULL;
                it[j].device = !it[j].blob && ranks[w->rank].sh[w->local].device;
                break;
            }
    for (size_t j = 0; j < ni; j++) { /* a replica's mark holds only if every holder's does */
        it[j].unchanged = !it[j].blob;
        for (size_t h = 0; it[j].unchanged && h < it[j].nh; h++)
            it[j].unchanged = ranks[hold[it[j].h0 + h].rank].sh[hold[it[j].h0 + h].local].unchanged;
    }

    /* 6. metadata skeleton */
    m = calloc(1, sizeof *m);
    if (!m) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    m->step = step;
    m->chunk = chunk;
    int nw = 0;
    for (int r = 0; r < nranks; r++)
        out->writer_file[r] = -1;
    for (size_t j = 0; j < ni; j++)
        if (out->writer_file[it[j].writer] < 0)
            out->writer_file[it[j].writer] = 0, nw++;
    m->nfiles = (uint32_t)nw;
    m->files = st_arena_alloc(&m->arena, (size_t)(nw ? nw : 1) * sizeof *m->files);
    m->ntensors = nt;
    m->tensors = st_arena_alloc(&m->arena, (nt ? nt : 1) * sizeof *m->tensors);
    out->pieces = malloc((ni ? ni : 1) * sizeof *out->pieces);
    if (!m->files || !m->tensors || !out->pieces) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    nw = 0;
    for (int r = 0; r < nranks; r++) {
        if (out->writer_file[r] < 0)
            continue;
        char name[ST_DATA_FILE_BYTES];
        st_data_file_name(name, r);
        out->writer_file[r] = nw;
        m->files[nw].name = st_arena_strndup(&m->arena, name, strlen(name));
        m->files[nw].bytes = 0;
        if (!m->files[nw].name) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto done;
        }
        nw++;
    }
    out->nwriters = nw;
    for (size_t t = 0; t < nt; t++) {
        st_mtensor *mt = &m->tensors[ti[t].pos];
        const st_entry *e = ti[t].e;
        memset(mt, 0, sizeof *mt);
        mt->name = st_arena_strndup(&m->arena, e->name, strlen(e->name));
        mt->dtype = e->dtype;
        mt->ndim = e->ndim;
        memcpy(mt->shape, e->shape, sizeof mt->shape);
        if (!mt->name) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto done;
        }
    }
    for (size_t j = 0; j < ni; j++)
        if (!it[j].blob)
            m->tensors[ti[it[j].tensor].pos].nshards++;
        else
            m->nblobs++;
    for (size_t t = 0; t < nt; t++) {
        st_mtensor *mt = &m->tensors[t];
        mt->shards = st_arena_alloc(&m->arena, (mt->nshards ? mt->nshards : 1) * sizeof *mt->shards);
        if (!mt->shards) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto done;
        }
        mt->nshards = 0;
    }
    m->blobs = st_arena_alloc(&m->arena, (m->nblobs ? m->nblobs : 1) * sizeof *m->blobs);
    if (!m->blobs) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto done;
    }
    m->nblobs = 0;
    /* items in metadata order; the layout of each file follows the same order */
    for (size_t j = 0; j < ni; j++)
        order[it[j].meta_pos] = j;
    for (size_t q = 0; q < ni; q++) {
        item *x = &it[order[q]];
        st_extent *ext;
        const char *object;
        if (x->blob) {
            st_mblob *b = &m->blobs[m->nblobs++];
            b->name = st_arena_strndup(&m->arena, x->b->name, strlen(x->b->name));
            b->owner = x->owner;
            ext = &b->ext;
            object = b->name;
            if (!b->name) {
                rc = st_fail(STRATA_ENOMEM, "out of memory");
                goto done;
            }
        } else {
            st_mtensor *mt = &m->tensors[ti[x->tensor].pos];
            st_mshard *s = &mt->shards[mt->nshards++];
            const st_entry *e = x->e;
            s->off = st_arena_alloc(&m->arena, 2 * (size_t)(e->ndim ? e->ndim : 1) * 8);
            if (!s->off) {
                rc = st_fail(STRATA_ENOMEM, "out of memory");
                goto done;
            }
            s->len = s->off + e->ndim;
            memcpy(s->off, e->off, (size_t)e->ndim * 8);
            memcpy(s->len, e->len, (size_t)e->ndim * 8);
            s->fs = x->fs;
            s->fe = x->fe;
            s->flat = !(x->fs == 0 && x->fe == st_box_numel(e->ndim, e->len, NULL));
            mt->bytes += x->bytes;
            ext = &s->ext;
            object = mt->name;
        }
        st_mfile *f = &m->files[out->writer_file[x->writer]];
        ext->file = (uint32_t)out->writer_file[x->writer];
        ext->offset = f->bytes;
        ext->bytes = x->bytes;
        uint64_t nc = st_nchunks(x->bytes, chunk);
        ext->sums = st_arena_alloc(&m->arena, (size_t)(nc ? nc : 1) * 8);
        if (!ext->sums) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto done;
        }
        f->bytes = ST_ALIGN_UP(f->bytes + x->bytes, ST_ALIGN);
        m->data_bytes += x->bytes;
        out->pieces[out->npieces++] =
            (st_piece){x->writer, x->local,  x->src_off, ext->offset, x->bytes,
                       x->src,    ext,       object,      x->device, x->unchanged};
    }
    for (size_t t = 0; t < nt && !rc; t++)
        rc = st_meta_check_overlap(&m->tensors[t]);
    if (rc)
        goto done;
    for (int r = 0; r < nranks; r++)
        if (out->writer_bytes[r] > out->max_writer_bytes)
            out->max_writer_bytes = out->writer_bytes[r];
    out->writer_bytes_bound = balance_bound(it, ni, hold, nranks);
    out->meta = m;
    m = NULL;

done:
    st_meta_free(m);
    free(ti);
    free(it);
    free(ids);
    free(tm.slot);
    free(im.slot);
    free(hold);
    free(order);
    free(fill);
    if (rc) {
        free(out->pieces);
        free(out->writer_file);
        free(out->writer_bytes);
        memset(out, 0, sizeof *out);
    }
    return rc;
}
