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

/* ---- the plan, step by step ---- */

/* One save plan in the making: its inputs, the tensors and distinct items found, their
 * holders, and the plan and metadata being built. */
typedef struct {
    const st_rank_view *ranks;
    int nranks;
    uint32_t chunk;
    st_save_plan *out;
    size_t nent, nblob; /* registrations: shards, blobs */
    tinfo *ti;          /* tensors, in order of first registration */
    size_t nt;
    item *it;           /* distinct items */
    size_t ni;
    size_t *ids;        /* per registration (shards, then blobs): its item, or SIZE_MAX */
    imap tm, im;        /* tensors by name; items by tensor and geometry or blob and owner */
    holder *hold;       /* item j's holders: hold[it[j].h0 .. + nh) */
    size_t *order;      /* scratch: ni + nt indices */
    st_meta *m;
} save_ctx;

static int oom(void) { return st_fail(STRATA_ENOMEM, "out of memory planning the save"); }

static int save_ctx_init(save_ctx *c, st_save_plan *out, const st_rank_view *ranks, int nranks,
                         uint32_t chunk)
{
    memset(c, 0, sizeof *c);
    memset(out, 0, sizeof *out);
    c->ranks = ranks;
    c->nranks = nranks;
    c->chunk = chunk;
    c->out = out;
    if (nranks < 1)
        return st_fail(STRATA_EINVAL, "save needs at least one rank");
    for (int r = 0; r < nranks; r++) {
        c->nent += ranks[r].nsh;
        c->nblob += ranks[r].nbl;
    }
    c->ti = malloc((c->nent + 1) * sizeof *c->ti);
    c->it = malloc((c->nent + c->nblob + 1) * sizeof *c->it);
    c->ids = malloc((c->nent + c->nblob + 1) * sizeof *c->ids);
    if (!c->ti || !c->it || !c->ids || imap_init(&c->tm, c->nent) ||
        imap_init(&c->im, c->nent + c->nblob))
        return oom();
    return 0;
}

/* Frees the working state; on failure (rc) the plan's arrays too. */
static int save_ctx_free(save_ctx *c, int rc)
{
    st_meta_free(c->m);
    free(c->ti);
    free(c->it);
    free(c->ids);
    free(c->tm.slot);
    free(c->im.slot);
    free(c->hold);
    free(c->order);
    if (rc) {
        free(c->out->pieces);
        free(c->out->writer_file);
        free(c->out->writer_bytes);
        memset(c->out, 0, sizeof *c->out);
    }
    return rc;
}

/* The tensor named by e (added if new); STRATA_EMISMATCH if it was registered with another
 * dtype or shape. */
static int find_tensor(save_ctx *c, const st_entry *e, int r, size_t *out)
{
    imap *tm = &c->tm;
    size_t h = (size_t)st_strhash(e->name) & (tm->cap - 1), t;
    while ((t = tm->slot[h]) != SIZE_MAX && strcmp(c->ti[t].e->name, e->name) != 0)
        h = (h + 1) & (tm->cap - 1);
    if (t == SIZE_MAX) {
        t = c->nt++;
        c->ti[t] = (tinfo){e, r, 0};
        tm->slot[h] = t;
    } else if (!same_tensor(c->ti[t].e, e)) {
        char a[256], b[256];
        describe(a, sizeof a, c->ti[t].e);
        describe(b, sizeof b, e);
        return st_fail(STRATA_EMISMATCH, "tensor '%s' is %s on rank %d but %s on rank %d",
                       e->name, a, c->ti[t].rank, b, r);
    }
    *out = t;
    return 0;
}

/* Step 1a: the tensors, and the distinct shards with their holder counts. */
static int collect_shards(save_ctx *c)
{
    size_t k = 0;
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nsh; i++, k++) {
            const st_entry *e = &c->ranks[r].sh[i];
            size_t t = 0;
            int rc = find_tensor(c, e, r, &t);
            if (rc)
                return rc;
            c->ids[k] = SIZE_MAX;
            if (e->bytes == 0)
                continue; /* an empty piece of an uneven split: nothing to save */
            imap *im = &c->im;
            size_t hh = (size_t)shard_hash(t, e) & (im->cap - 1), j;
            while ((j = im->slot[hh]) != SIZE_MAX &&
                   (c->it[j].blob || c->it[j].tensor != t || !same_geometry(c->it[j].e, e)))
                hh = (hh + 1) & (im->cap - 1);
            if (j == SIZE_MAX) {
                j = c->ni++;
                c->it[j] = (item){.tensor = t, .e = e, .fs = e->fs, .fe = e->fe,
                                  .bytes = e->bytes, .writer = -1};
                im->slot[hh] = j;
            }
            c->it[j].nh++;
            c->ids[k] = j;
        }
    return 0;
}

/* Step 1b: the distinct blobs (global ones by name, per-rank ones by name and owner). */
static int collect_blobs(save_ctx *c)
{
    size_t k = c->nent;
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nbl; i++, k++) {
            const st_blobent *b = &c->ranks[r].bl[i];
            int64_t owner = b->local ? r : -1;
            imap *im = &c->im;
            size_t hh = (size_t)(st_strhash(b->name) ^ st_mix64((uint64_t)owner + 7)) &
                        (im->cap - 1), j;
            while ((j = im->slot[hh]) != SIZE_MAX &&
                   (!c->it[j].blob || c->it[j].owner != owner ||
                    strcmp(c->it[j].b->name, b->name) != 0))
                hh = (hh + 1) & (im->cap - 1);
            if (j == SIZE_MAX) {
                j = c->ni++;
                c->it[j] = (item){.blob = 1, .b = b, .owner = owner, .bytes = b->size,
                                  .writer = -1};
                im->slot[hh] = j;
            } else if (b->local) {
                return st_fail(STRATA_EINVAL, "blob '%s' is registered twice on rank %d",
                               b->name, r);
            } else if (c->it[j].bytes != b->size) {
                return st_fail(STRATA_EMISMATCH, "global blob '%s' has %llu bytes on one rank "
                               "and %llu on rank %d", b->name,
                               (unsigned long long)c->it[j].bytes,
                               (unsigned long long)b->size, r);
            }
            c->it[j].nh++;
            c->ids[k] = j;
        }
    return 0;
}

/* Step 2: each item's holders, in rank order. */
static int list_holders(save_ctx *c)
{
    size_t *fill = calloc(c->ni + 1, sizeof *fill);
    c->hold = malloc((c->nent + c->nblob + 1) * sizeof *c->hold);
    if (!fill || !c->hold) {
        free(fill);
        return oom();
    }
    size_t acc = 0;
    for (size_t j = 0; j < c->ni; j++) {
        c->it[j].h0 = acc;
        acc += c->it[j].nh;
    }
    size_t k = 0;
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nsh; i++, k++)
            if (c->ids[k] != SIZE_MAX) {
                item *x = &c->it[c->ids[k]];
                c->hold[x->h0 + fill[c->ids[k]]++] = (holder){r, (uint32_t)i, c->ranks[r].sh[i].data};
            }
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nbl; i++, k++) {
            item *x = &c->it[c->ids[k]];
            c->hold[x->h0 + fill[c->ids[k]]++] =
                (holder){r, (uint32_t)(c->ranks[r].nsh + i), c->ranks[r].bl[i].data};
        }
    free(fill);
    return 0;
}

/* Step 4: metadata order (tensors by name; items as cmp_items), into meta_pos. */
static void order_items(save_ctx *c)
{
    size_t *order = c->order;
    for (size_t t = 0; t < c->nt; t++)
        order[t] = t;
    qsort_r(order, c->nt, sizeof *order, cmp_tinfo_name, c->ti);
    for (size_t t = 0; t < c->nt; t++)
        c->ti[order[t]].pos = t;
    for (size_t j = 0; j < c->ni; j++)
        order[j] = j;
    order_ctx oc = {c->it, c->ti};
    qsort_r(order, c->ni, sizeof *order, cmp_items, &oc);
    for (size_t j = 0; j < c->ni; j++)
        c->it[order[j]].meta_pos = j;
}

/* Step 5a: single-holder items are fixed; the rest go largest first to the least loaded
 * holder. */
static int balance_writers(save_ctx *c)
{
    st_save_plan *out = c->out;
    item *it = c->it;
    out->nranks = c->nranks;
    out->writer_bytes = calloc((size_t)c->nranks, sizeof *out->writer_bytes);
    out->writer_file = malloc((size_t)c->nranks * sizeof *out->writer_file);
    if (!out->writer_bytes || !out->writer_file)
        return oom();
    size_t nmulti = 0;
    for (size_t j = 0; j < c->ni; j++) {
        if (it[j].nh == 1) {
            it[j].writer = c->hold[it[j].h0].rank;
            out->writer_bytes[it[j].writer] += it[j].bytes;
        } else {
            c->order[nmulti++] = j;
        }
    }
    qsort_r(c->order, nmulti, sizeof *c->order, cmp_size_desc, it);
    for (size_t q = 0; q < nmulti; q++) {
        item *x = &it[c->order[q]];
        int best = c->hold[x->h0].rank;
        for (size_t h = 1; h < x->nh; h++) {
            int r = c->hold[x->h0 + h].rank;
            if (out->writer_bytes[r] < out->writer_bytes[best] ||
                (out->writer_bytes[r] == out->writer_bytes[best] && r < best))
                best = r;
        }
        x->writer = best;
        out->writer_bytes[best] += x->bytes;
    }
    return 0;
}

/* Step 5b: each item's source in its writer's registration, and whether every holder
 * marked it unchanged. */
static void take_sources(save_ctx *c)
{
    for (size_t j = 0; j < c->ni; j++) {
        item *x = &c->it[j];
        for (size_t h = 0; h < x->nh; h++)
            if (c->hold[x->h0 + h].rank == x->writer) {
                const holder *w = &c->hold[x->h0 + h];
                x->local = w->local;
                if (!x->blob) /* a piece starts inside the holder's buffer */
                    x->src_off = (x->fs - x->e->fs) * strata_dtype_size(x->e->dtype);
                x->src = w->data ? (const char *)w->data + x->src_off : NULL;
                x->device = !x->blob && c->ranks[w->rank].sh[w->local].device;
                break;
            }
        /* a replica's mark holds only if every holder's does */
        x->unchanged = !x->blob;
        for (size_t h = 0; x->unchanged && h < x->nh; h++)
            x->unchanged = c->ranks[c->hold[x->h0 + h].rank].sh[c->hold[x->h0 + h].local].unchanged;
    }
}

/* Step 6a: the metadata's files, one per writer in rank order. */
static int name_files(save_ctx *c)
{
    st_save_plan *out = c->out;
    st_meta *m = c->m;
    int nw = 0;
    for (int r = 0; r < c->nranks; r++)
        out->writer_file[r] = -1;
    for (size_t j = 0; j < c->ni; j++)
        if (out->writer_file[c->it[j].writer] < 0)
            out->writer_file[c->it[j].writer] = 0, nw++;
    m->nfiles = (uint32_t)nw;
    m->files = st_arena_alloc(&m->arena, (size_t)(nw ? nw : 1) * sizeof *m->files);
    if (!m->files)
        return st_fail(STRATA_ENOMEM, "out of memory");
    nw = 0;
    for (int r = 0; r < c->nranks; r++) {
        if (out->writer_file[r] < 0)
            continue;
        char name[ST_DATA_FILE_BYTES];
        st_data_file_name(name, r);
        out->writer_file[r] = nw;
        m->files[nw].name = st_arena_strndup(&m->arena, name, strlen(name));
        m->files[nw].bytes = 0;
        if (!m->files[nw].name)
            return st_fail(STRATA_ENOMEM, "out of memory");
        nw++;
    }
    out->nwriters = nw;
    return 0;
}

/* Step 6b: the metadata's tensors in name order, with room for their shards, and room
 * for the blobs. */
static int describe_tensors(save_ctx *c)
{
    st_meta *m = c->m;
    m->ntensors = c->nt;
    m->tensors = st_arena_alloc(&m->arena, (c->nt ? c->nt : 1) * sizeof *m->tensors);
    if (!m->tensors)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t t = 0; t < c->nt; t++) {
        st_mtensor *mt = &m->tensors[c->ti[t].pos];
        const st_entry *e = c->ti[t].e;
        memset(mt, 0, sizeof *mt);
        mt->name = st_arena_strndup(&m->arena, e->name, strlen(e->name));
        mt->dtype = e->dtype;
        mt->ndim = e->ndim;
        memcpy(mt->shape, e->shape, sizeof mt->shape);
        if (!mt->name)
            return st_fail(STRATA_ENOMEM, "out of memory");
    }
    for (size_t j = 0; j < c->ni; j++)
        if (!c->it[j].blob)
            m->tensors[c->ti[c->it[j].tensor].pos].nshards++;
        else
            m->nblobs++;
    for (size_t t = 0; t < c->nt; t++) {
        st_mtensor *mt = &m->tensors[t];
        mt->shards = st_arena_alloc(&m->arena, (mt->nshards ? mt->nshards : 1) * sizeof *mt->shards);
        if (!mt->shards)
            return st_fail(STRATA_ENOMEM, "out of memory");
        mt->nshards = 0;
    }
    m->blobs = st_arena_alloc(&m->arena, (m->nblobs ? m->nblobs : 1) * sizeof *m->blobs);
    if (!m->blobs)
        return st_fail(STRATA_ENOMEM, "out of memory");
    m->nblobs = 0;
    return 0;
}

/* The metadata entry of item x (its shard or blob, appended); *ext its extent, *object
 * its name. */
static int add_entry(save_ctx *c, const item *x, st_extent **ext, const char **object)
{
    st_meta *m = c->m;
    if (x->blob) {
        st_mblob *b = &m->blobs[m->nblobs++];
        b->name = st_arena_strndup(&m->arena, x->b->name, strlen(x->b->name));
        b->owner = x->owner;
        *ext = &b->ext;
        *object = b->name;
        return b->name ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
    }
    st_mtensor *mt = &m->tensors[c->ti[x->tensor].pos];
    st_mshard *s = &mt->shards[mt->nshards++];
    const st_entry *e = x->e;
    s->off = st_arena_alloc(&m->arena, 2 * (size_t)(e->ndim ? e->ndim : 1) * 8);
    if (!s->off)
        return st_fail(STRATA_ENOMEM, "out of memory");
    s->len = s->off + e->ndim;
    memcpy(s->off, e->off, (size_t)e->ndim * 8);
    memcpy(s->len, e->len, (size_t)e->ndim * 8);
    s->fs = x->fs;
    s->fe = x->fe;
    s->flat = !(x->fs == 0 && x->fe == st_box_numel(e->ndim, e->len, NULL));
    mt->bytes += x->bytes;
    *ext = &s->ext;
    *object = mt->name;
    return 0;
}

/* Step 6c: the items in metadata order, each laid out in its writer's file (which follows
 * the same order), as metadata entries and plan pieces. */
static int lay_out(save_ctx *c)
{
    st_save_plan *out = c->out;
    st_meta *m = c->m;
    out->pieces = malloc((c->ni ? c->ni : 1) * sizeof *out->pieces);
    if (!out->pieces)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t j = 0; j < c->ni; j++)
        c->order[c->it[j].meta_pos] = j;
    for (size_t q = 0; q < c->ni; q++) {
        const item *x = &c->it[c->order[q]];
        st_extent *ext = NULL;
        const char *object = NULL;
        int rc = add_entry(c, x, &ext, &object);
        if (rc)
            return rc;
        st_mfile *f = &m->files[out->writer_file[x->writer]];
        ext->file = (uint32_t)out->writer_file[x->writer];
        ext->offset = f->bytes;
        ext->bytes = x->bytes;
        uint64_t nc = st_nchunks(x->bytes, c->chunk);
        ext->sums = st_arena_alloc(&m->arena, (size_t)(nc ? nc : 1) * 8);
        if (!ext->sums)
            return st_fail(STRATA_ENOMEM, "out of memory");
        f->bytes = ST_ALIGN_UP(f->bytes + x->bytes, ST_ALIGN);
        m->data_bytes += x->bytes;
        out->pieces[out->npieces++] =
            (st_piece){x->writer, x->local,  x->src_off, ext->offset, x->bytes,
                       x->src,    ext,       object,      x->device, x->unchanged};
    }
    return 0;
}

/* Step 6: the metadata skeleton (complete but for the checksums) and the pieces. */
static int build_meta(save_ctx *c, uint64_t step)
{
    if (!(c->m = calloc(1, sizeof *c->m)))
        return st_fail(STRATA_ENOMEM, "out of memory");
    c->m->step = step;
    c->m->chunk = c->chunk;
    int rc = name_files(c);
    if (!rc)
        rc = describe_tensors(c);
    if (!rc)
        rc = lay_out(c);
    for (size_t t = 0; t < c->nt && !rc; t++)
        rc = st_meta_check_overlap(&c->m->tensors[t]);
    return rc;
}

int st_plan_save(st_save_plan *out, const st_rank_view *ranks, int nranks, uint32_t chunk,
                 uint64_t step)
{
    save_ctx c;
    int rc = save_ctx_init(&c, out, ranks, nranks, chunk);
    if (!rc)
        rc = collect_shards(&c);
    if (!rc)
        rc = collect_blobs(&c);
    if (!rc)
        rc = list_holders(&c);
    /* 3. split large replicated shards into flat pieces, one per holder at most, so that
     * no single item is big enough to unbalance the writers (list scheduling ends within
     * one item of the mean) */
    if (!rc)
        rc = split_large(&c.it, &c.ni, c.hold, nranks);
    if (!rc && !(c.order = malloc((c.ni + c.nt + 1) * sizeof *c.order)))
        rc = oom();
    if (!rc) {
        order_items(&c);
        rc = balance_writers(&c);
    }
    if (!rc) {
        take_sources(&c);
        rc = build_meta(&c, step);
    }
    if (!rc) {
        for (int r = 0; r < nranks; r++)
            out->max_writer_bytes = ST_MAX(out->max_writer_bytes, out->writer_bytes[r]);
        out->writer_bytes_bound = balance_bound(c.it, c.ni, c.hold, nranks);
        out->meta = c.m;
        c.m = NULL;
    }
    return save_ctx_free(&c, rc);
}
