/* plan_save.c - the global save plan: dedup of replicated shards, balanced writers, layout
 * of each writer's data file, and the metadata skeleton. Linear in the registrations and
 * n log n in the distinct pieces (DESIGN.md, "Planning at scale"). Pure; single-threaded. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/geom.h"
#include "../core/overlap.h"
#include "../core/util.h"
#include "plan_save.h"

/* ---- keys ---- */

/* The fixed encodings keys hash, little-endian on every host strata builds on: a tensor's
 * name, NUL, dtype, ndim and shape (u64 each); a piece's ndim, off and len per dim, fs, fe
 * (u64 each). */
uint64_t st_tensor_key(const st_entry *e)
{
    unsigned char buf[STRATA_MAX_NAME + 3 + STRATA_MAX_DIMS * 8];
    size_t n = strlen(e->name) + 1;
    memcpy(buf, e->name, n);
    buf[n] = (unsigned char)e->dtype;
    buf[n + 1] = (unsigned char)e->ndim;
    memcpy(buf + n + 2, e->shape, (size_t)e->ndim * 8);
    return st_hash(buf, n + 2 + (size_t)e->ndim * 8);
}

uint64_t st_piece_key(const st_entry *e, uint64_t tkey)
{
    uint64_t v[2 * STRATA_MAX_DIMS + 3], k = 0;
    v[k++] = (uint64_t)e->ndim;
    for (int d = 0; d < e->ndim; d++) {
        v[k++] = e->off[d];
        v[k++] = e->len[d];
    }
    v[k++] = e->fs;
    v[k++] = e->fe;
    return XXH3_64bits_withSeed(v, k * 8, tkey);
}

st_ref st_ref_of(const st_entry *e, uint32_t local)
{
    uint64_t t = st_tensor_key(e);
    return (st_ref){t, st_piece_key(e, t), local, (uint32_t)e->unchanged};
}

/* ---- tables ---- */

uint64_t st_plan_save_work(void)
{
    return st_save_work;
}

int st_imap_init(st_imap *m, size_t n)
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

/* A piece for messages: its box (offsets + lengths) and, if narrowed, its flat range. */
static void describe_piece(char *out, size_t cap, const st_entry *e, uint64_t fs, uint64_t fe)
{
    int n = snprintf(out, cap, "box [");
    for (int d = 0; d < e->ndim && n > 0 && (size_t)n < cap; d++)
        n += snprintf(out + n, cap - (size_t)n, d ? ", %llu+%llu" : "%llu+%llu",
                      (unsigned long long)e->off[d], (unsigned long long)e->len[d]);
    if (n > 0 && (size_t)n < cap)
        snprintf(out + n, cap - (size_t)n, fs || fe != st_box_numel(e->ndim, e->len, NULL)
                                               ? "] elements [%llu, %llu)" : "]",
                 (unsigned long long)fs, (unsigned long long)fe);
}

static int cmp_tinfo_name(const void *a, const void *b, void *ctx)
{
    const st_tinfo *t = ctx;
    return strcmp(t[*(const size_t *)a].e->name, t[*(const size_t *)b].e->name);
}

typedef struct {
    const st_item *it;
    const st_tinfo *ti;
} order_ctx;

/* Metadata order: shards by (tensor name, box offsets, flat start), then blobs by
 * (name, owner). */
static int cmp_items(const void *pa, const void *pb, void *ctx)
{
    const order_ctx *c = ctx;
    const st_item *a = &c->it[*(const size_t *)pa], *b = &c->it[*(const size_t *)pb];
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

void st_save_plan_free(st_save_plan *p)
{
    st_meta_free(p->meta);
    free(p->pieces);
    free(p->writer_file);
    free(p->writer_bytes);
    memset(p, 0, sizeof *p);
}

/* ---- the plan, step by step ---- */

static int oom(void) { return st_fail(STRATA_ENOMEM, "out of memory planning the save"); }

static int save_ctx_init(st_save_ctx *c, st_save_plan *out, const st_rank_view *ranks,
                         int nranks, uint32_t chunk)
{
    memset(c, 0, sizeof *c);
    memset(out, 0, sizeof *out);
    c->ranks = ranks;
    c->nranks = nranks;
    c->chunk = chunk;
    c->out = out;
    if (nranks < 1)
        return st_fail(STRATA_EINVAL, "save needs at least one rank");
    size_t nmain = 0;
    for (int r = 0; r < nranks; r++) {
        c->nent += ranks[r].nsh;
        c->nref += ranks[r].nref;
        c->nblob += ranks[r].nbl;
        for (size_t i = 0; i < ranks[r].nsh; i++)
            nmain += !ranks[r].sh[i].replica;
    }
    c->ndesc = c->nent + c->nref + c->nblob;
    if (c->ndesc >= UINT32_MAX)
        return st_fail(STRATA_EINVAL, "too many registrations (%zu) for one save plan",
                       c->ndesc);
    c->tcap = 64;
    c->ti = malloc(c->tcap * sizeof *c->ti);
    c->it = malloc((nmain + c->nblob + 1) * sizeof *c->it);
    c->ids = malloc((c->ndesc + 1) * sizeof *c->ids);
    if (!c->ti || !c->it || !c->ids || st_imap_init(&c->tm, c->tcap / 2) ||
        st_imap_init(&c->im, nmain + c->nblob))
        return oom();
    return 0;
}

/* Frees the working state; on failure (rc) the plan's arrays too. */
static int save_ctx_free(st_save_ctx *c, int rc)
{
    st_meta_free(c->m);
    free(c->ti);
    free(c->it);
    free(c->ids);
    free(c->tm.slot);
    free(c->im.slot);
    free(c->km.slot);
    free(c->tk.slot);
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

/* Doubles the tensor table (tensors are few, registrations many: it grows with them). */
static int grow_tensors(st_save_ctx *c)
{
    st_imap n;
    st_tinfo *ti = realloc(c->ti, 2 * c->tcap * sizeof *ti);
    if (!ti)
        return oom();
    c->ti = ti;
    c->tcap *= 2;
    if (st_imap_init(&n, c->tcap / 2))
        return oom();
    for (size_t t = 0; t < c->nt; t++) {
        size_t h = (size_t)st_strhash(c->ti[t].e->name) & (n.cap - 1);
        while (n.slot[h] != SIZE_MAX)
            h = (h + 1) & (n.cap - 1);
        n.slot[h] = t;
    }
    free(c->tm.slot);
    c->tm = n;
    return 0;
}

/* The tensor named by e (added if new); STRATA_EMISMATCH if it was registered with another
 * dtype or shape. */
static int find_tensor(st_save_ctx *c, const st_entry *e, int r, size_t *out)
{
    st_imap *tm = &c->tm;
    size_t h = (size_t)st_strhash(e->name) & (tm->cap - 1), t;
    while ((t = tm->slot[h]) != SIZE_MAX && strcmp(c->ti[t].e->name, e->name) != 0) {
        h = (h + 1) & (tm->cap - 1);
        st_save_work++;
    }
    st_save_work++;
    if (t == SIZE_MAX) {
        t = c->nt++;
        c->ti[t] = (st_tinfo){.e = e, .rank = r, .whole_rank = -1};
        tm->slot[h] = t;
        if (c->nt == c->tcap && grow_tensors(c))
            return STRATA_ENOMEM;
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

/* The main piece of tensor t with e's geometry, or SIZE_MAX; *slot: where to add it. */
static size_t find_piece(const st_save_ctx *c, size_t t, const st_entry *e, size_t *slot)
{
    const st_imap *im = &c->im;
    size_t hh = (size_t)shard_hash(t, e) & (im->cap - 1), j;
    while ((j = im->slot[hh]) != SIZE_MAX &&
           (c->it[j].blob || c->it[j].tensor != t || !same_geometry(c->it[j].e, e))) {
        hh = (hh + 1) & (im->cap - 1);
        st_save_work++;
    }
    st_save_work++;
    *slot = hh;
    return j;
}

/* A tensor whose marked shard (registration `local` of rank r) is a copy of no main piece:
 * its main pieces must hold the whole tensor (checked in build_meta). */
static void need_whole(st_save_ctx *c, size_t t, int r, uint32_t local)
{
    if (c->ti[t].whole_rank < 0) {
        c->ti[t].whole_rank = r;
        c->ti[t].whole_local = local;
    }
}

/* Step 1a: the tensors, and the distinct main pieces with their holder counts. Numbering
 * of registrations (ids): rank by rank its shards then its refs, then every rank's blobs. */
static int collect_mains(st_save_ctx *c)
{
    size_t k = 0;
    for (int r = 0; r < c->nranks; k += c->ranks[r].nref, r++)
        for (size_t i = 0; i < c->ranks[r].nsh; i++, k++) {
            const st_entry *e = &c->ranks[r].sh[i];
            size_t t = 0, slot;
            c->ids[k] = UINT32_MAX;
            if (e->replica)
                continue; /* step 1c */
            int rc = find_tensor(c, e, r, &t);
            if (rc)
                return rc;
            if (e->bytes == 0)
                continue; /* an empty piece of an uneven split: nothing to save */
            size_t j = find_piece(c, t, e, &slot);
            if (j == SIZE_MAX) {
                j = c->ni++;
                c->it[j] = (st_item){.tensor = t, .e = e, .fs = e->fs, .fe = e->fe,
                                     .bytes = e->bytes, .writer = -1, .main_rank = r};
                c->im.slot[slot] = j;
            }
            c->it[j].nh++;
            c->ids[k] = (uint32_t)j;
        }
    return 0;
}

/* Step 1b: the distinct blobs (global ones by name, per-rank ones by name and owner). */
static int collect_blobs(st_save_ctx *c)
{
    size_t k = c->nent + c->nref;
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nbl; i++, k++) {
            const st_blobent *b = &c->ranks[r].bl[i];
            int64_t owner = b->local ? r : -1;
            st_imap *im = &c->im;
            size_t hh = (size_t)(st_strhash(b->name) ^ st_mix64((uint64_t)owner + 7)) &
                        (im->cap - 1), j;
            while ((j = im->slot[hh]) != SIZE_MAX &&
                   (!c->it[j].blob || c->it[j].owner != owner ||
                    strcmp(c->it[j].b->name, b->name) != 0))
                hh = (hh + 1) & (im->cap - 1);
            if (j == SIZE_MAX) {
                j = c->ni++;
                c->it[j] = (st_item){.blob = 1, .b = b, .owner = owner, .bytes = b->size,
                                     .writer = -1, .main_rank = r};
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
            c->ids[k] = (uint32_t)j;
        }
    return 0;
}

/* Key tables for refs, built only when some view has refs: tensors by st_tensor_key, main
 * pieces by their tensor and st_piece_key. A key two tensors (or two pieces of a tensor)
 * share is marked ambiguous. */
static int index_keys(st_save_ctx *c)
{
    if (!c->nref)
        return 0;
    if (st_imap_init(&c->km, c->ni) || st_imap_init(&c->tk, c->nt))
        return oom();
    for (size_t t = 0; t < c->nt; t++) {
        c->ti[t].tkey = st_tensor_key(c->ti[t].e);
        size_t h = (size_t)c->ti[t].tkey & (c->tk.cap - 1), u;
        while ((u = c->tk.slot[h]) != SIZE_MAX && c->ti[u].tkey != c->ti[t].tkey)
            h = (h + 1) & (c->tk.cap - 1);
        if (u == SIZE_MAX)
            c->tk.slot[h] = t;
        else
            c->ti[u].ambiguous = 1;
    }
    for (size_t j = 0; j < c->ni; j++) {
        st_item *x = &c->it[j];
        if (x->blob)
            continue;
        x->pkey = st_piece_key(x->e, c->ti[x->tensor].tkey);
        size_t h = (size_t)st_mix64(x->pkey ^ x->tensor) & (c->km.cap - 1), u;
        while ((u = c->km.slot[h]) != SIZE_MAX &&
               (c->it[u].tensor != x->tensor || c->it[u].pkey != x->pkey))
            h = (h + 1) & (c->km.cap - 1);
        if (u == SIZE_MAX)
            c->km.slot[h] = j;
        else
            c->it[u].ambiguous = 1;
    }
    return 0;
}

/* The main piece and the tensor a ref names (*j SIZE_MAX: a copy of no main piece). */
static int match_ref(st_save_ctx *c, const st_ref *f, int r, size_t *t, size_t *j)
{
    size_t h = (size_t)f->tkey & (c->tk.cap - 1), u;
    while ((u = c->tk.slot[h]) != SIZE_MAX && c->ti[u].tkey != f->tkey)
        h = (h + 1) & (c->tk.cap - 1);
    if (u == SIZE_MAX)
        return st_fail(STRATA_EUNFILLED, "rank %d: its shard %u is marked STRATA_SHARD_REPLICA, "
                       "but no rank registers that tensor (name, dtype and shape) unmarked",
                       r, f->local);
    h = (size_t)st_mix64(f->pkey ^ u) & (c->km.cap - 1);
    while ((*j = c->km.slot[h]) != SIZE_MAX &&
           (c->it[*j].tensor != u || c->it[*j].pkey != f->pkey)) {
        h = (h + 1) & (c->km.cap - 1);
        st_save_work++;
    }
    st_save_work++;
    if (c->ti[u].ambiguous || (*j != SIZE_MAX && c->it[*j].ambiguous))
        return st_fail(STRATA_EINVAL, "rank %d: its shard %u (marked STRATA_SHARD_REPLICA) has "
                       "the key of two pieces: it cannot be told which it copies", r, f->local);
    *t = u;
    return 0;
}

/* Step 1c: the marked shards. A copy of a main piece is one more holder of it; any other
 * is not saved, and its tensor's main pieces must hold the whole tensor. */
static int collect_replicas(st_save_ctx *c)
{
    int rc = index_keys(c);
    size_t k = 0;
    for (int r = 0; r < c->nranks && !rc; r++) {
        const st_rank_view *v = &c->ranks[r];
        for (size_t i = 0; i < v->nsh && !rc; i++, k++) {
            const st_entry *e = &v->sh[i];
            size_t t = 0, slot, j;
            if (!e->replica || (rc = find_tensor(c, e, r, &t)) || e->bytes == 0)
                continue;
            if ((j = find_piece(c, t, e, &slot)) == SIZE_MAX) {
                need_whole(c, t, r, v->reg ? v->reg[i] : (uint32_t)i);
                continue;
            }
            c->it[j].nh++;
            c->ids[k] = (uint32_t)j;
        }
        for (size_t i = 0; i < v->nref && !rc; i++, k++) {
            size_t t = 0, j = SIZE_MAX;
            c->ids[k] = UINT32_MAX;
            if ((rc = match_ref(c, &v->ref[i], r, &t, &j)))
                break;
            if (j == SIZE_MAX) {
                need_whole(c, t, r, v->ref[i].local);
                continue;
            }
            c->it[j].nh++;
            c->ids[k] = (uint32_t)j;
        }
    }
    return rc;
}

/* Step 2: each item's holders, in rank order (a rank's shards, then its refs, then the
 * blobs), with their marks of STRATA_SHARD_UNCHANGED. */
static int list_holders(st_save_ctx *c)
{
    uint32_t *fill = calloc(c->ni + 1, sizeof *fill);
    c->hold = malloc((c->ndesc + 1) * sizeof *c->hold);
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
    for (int r = 0; r < c->nranks; r++) {
        const st_rank_view *v = &c->ranks[r];
        for (size_t i = 0; i < v->nsh + v->nref; i++, k++) {
            uint32_t j = c->ids[k];
            if (j == UINT32_MAX)
                continue;
            int ref = i >= v->nsh;
            uint32_t local = ref ? v->ref[i - v->nsh].local : v->reg ? v->reg[i] : (uint32_t)i;
            c->hold[c->it[j].h0 + fill[j]++] = (st_holder){
                r, local, ref ? v->ref[i - v->nsh].unchanged != 0 : v->sh[i].unchanged != 0};
        }
    }
    for (int r = 0; r < c->nranks; r++)
        for (size_t i = 0; i < c->ranks[r].nbl; i++, k++) {
            uint32_t j = c->ids[k];
            c->hold[c->it[j].h0 + fill[j]++] =
                (st_holder){r, st_blob_local(&c->ranks[r], i), 0};
        }
    free(fill);
    st_save_work += 2 * k;
    /* a replica's mark holds only if every holder's does */
    for (size_t j = 0; j < c->ni; j++) {
        st_item *x = &c->it[j];
        x->unchanged = !x->blob;
        for (size_t h = 0; x->unchanged && h < x->nh; h++)
            x->unchanged = c->hold[x->h0 + h].unchanged;
    }
    return 0;
}

/* Step 4: metadata order (tensors by name; items as cmp_items), into meta_pos. */
static void order_items(st_save_ctx *c)
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

/* The registration of holder w, where its view has it (a view with refs or reg is a
 * coordinator's, whose peers' data it never sees): NULL otherwise. */
static const st_entry *holder_entry(const st_save_ctx *c, const st_holder *w)
{
    const st_rank_view *v = &c->ranks[w->rank];
    return v->nref || v->reg || w->local >= v->nsh ? NULL : &v->sh[w->local];
}

static const void *holder_data(const st_save_ctx *c, const st_holder *w)
{
    const st_rank_view *v = &c->ranks[w->rank];
    if (v->nref || v->reg)
        return NULL;
    return w->local < v->nsh ? v->sh[w->local].data : v->bl[w->local - v->nsh].data;
}

/* Step 5b: each item's source in its writer's registration. */
static void take_sources(st_save_ctx *c)
{
    st_save_work += c->ni;
    for (size_t j = 0; j < c->ni; j++) {
        st_item *x = &c->it[j];
        const st_holder *w = &c->hold[x->wh];
        const st_entry *we = x->blob ? NULL : holder_entry(c, w);
        const void *data = holder_data(c, w);
        x->local = w->local;
        if (!x->blob) /* a piece starts inside the holder's buffer */
            x->src_off = (x->fs - x->e->fs) * strata_dtype_size(x->e->dtype);
        x->src = data ? (const char *)data + x->src_off : NULL;
        x->device = we && we->device;
    }
}

/* Step 6a: the metadata's files, one per writer in rank order. */
static int name_files(st_save_ctx *c)
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
        return oom();
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
            return oom();
        nw++;
    }
    out->nwriters = nw;
    return 0;
}

/* Step 6b: the metadata's tensors in name order, with room for their shards, and room
 * for the blobs. */
static int describe_tensors(st_save_ctx *c)
{
    st_meta *m = c->m;
    m->ntensors = c->nt;
    m->tensors = st_arena_alloc(&m->arena, (c->nt ? c->nt : 1) * sizeof *m->tensors);
    if (!m->tensors)
        return oom();
    for (size_t t = 0; t < c->nt; t++) {
        st_mtensor *mt = &m->tensors[c->ti[t].pos];
        const st_entry *e = c->ti[t].e;
        memset(mt, 0, sizeof *mt);
        mt->name = st_arena_strndup(&m->arena, e->name, strlen(e->name));
        mt->dtype = e->dtype;
        mt->ndim = e->ndim;
        memcpy(mt->shape, e->shape, sizeof mt->shape);
        if (!mt->name)
            return oom();
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
            return oom();
        mt->nshards = 0;
    }
    m->blobs = st_arena_alloc(&m->arena, (m->nblobs ? m->nblobs : 1) * sizeof *m->blobs);
    if (!m->blobs)
        return oom();
    m->nblobs = 0;
    return 0;
}

/* The metadata entry of item x (its shard or blob, appended); *ext its extent, *object
 * its name. */
static int add_entry(st_save_ctx *c, const st_item *x, st_extent **ext, const char **object)
{
    st_meta *m = c->m;
    if (x->blob) {
        st_mblob *b = &m->blobs[m->nblobs++];
        b->name = st_arena_strndup(&m->arena, x->b->name, strlen(x->b->name));
        b->owner = x->owner;
        *ext = &b->ext;
        *object = b->name;
        return b->name ? 0 : oom();
    }
    st_mtensor *mt = &m->tensors[c->ti[x->tensor].pos];
    st_mshard *s = &mt->shards[mt->nshards++];
    const st_entry *e = x->e;
    s->off = st_arena_alloc(&m->arena, 2 * (size_t)(e->ndim ? e->ndim : 1) * 8);
    if (!s->off)
        return oom();
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
static int lay_out(st_save_ctx *c)
{
    st_save_plan *out = c->out;
    st_meta *m = c->m;
    out->pieces = malloc((c->ni ? c->ni : 1) * sizeof *out->pieces);
    if (!out->pieces)
        return oom();
    for (size_t j = 0; j < c->ni; j++)
        c->order[c->it[j].meta_pos] = j;
    for (size_t q = 0; q < c->ni; q++) {
        const st_item *x = &c->it[c->order[q]];
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
            return oom();
        f->bytes = ST_ALIGN_UP(f->bytes + x->bytes, ST_ALIGN);
        m->data_bytes += x->bytes;
        out->pieces[out->npieces++] =
            (st_piece){x->writer, x->local,  x->src_off, ext->offset, x->bytes,
                       x->src,    ext,       object,      x->device, x->unchanged};
    }
    return 0;
}

/* STRATA_EOVERLAP for tensor t (metadata order) whose shards a, b overlap, naming the ranks
 * that registered them. */
static int overlap_error(const st_save_ctx *c, size_t t, size_t a, size_t b)
{
    size_t first = 0;
    for (size_t u = 0; u < t; u++)
        first += c->m->tensors[u].nshards;
    const st_item *x = &c->it[c->order[first + a]], *y = &c->it[c->order[first + b]];
    char da[160], db[160];
    describe_piece(da, sizeof da, x->e, x->fs, x->fe);
    describe_piece(db, sizeof db, y->e, y->fs, y->fe);
    return st_fail(STRATA_EOVERLAP, "tensor '%s': rank %d's %s and rank %d's %s overlap without "
                   "being the same piece (a copy of another rank's piece is marked "
                   "STRATA_SHARD_REPLICA)", c->m->tensors[t].name, x->main_rank, da,
                   y->main_rank, db);
}

/* The overlap check of tensor t (metadata order): core's search over its shards. */
static int check_overlap(const st_save_ctx *c, size_t t)
{
    const st_mtensor *mt = &c->m->tensors[t];
    st_region *r = malloc((mt->nshards + 1) * sizeof *r);
    if (!r)
        return oom();
    for (size_t s = 0; s < mt->nshards; s++) {
        const st_mshard *x = &mt->shards[s];
        r[s] = (st_region){mt->ndim, x->off, x->len, x->fs, x->fe};
    }
    size_t a = 0, b = 0;
    int found = st_overlap_find(r, mt->nshards, &a, &b);
    st_save_work += st_overlap_work();
    free(r);
    return found < 0 ? oom() : found ? overlap_error(c, t, a, b) : 0;
}

/* A tensor some marked shard copies without a main piece identical to it must be held
 * whole by its main pieces (which do not overlap: their elements add up). */
static int check_whole(const st_save_ctx *c)
{
    for (size_t t = 0; t < c->nt; t++) {
        const st_tinfo *ti = &c->ti[t];
        if (ti->whole_rank < 0)
            continue;
        const st_mtensor *mt = &c->m->tensors[ti->pos];
        uint64_t held = 0, all = st_box_numel(mt->ndim, mt->shape, NULL);
        for (size_t s = 0; s < mt->nshards; s++)
            held += mt->shards[s].fe - mt->shards[s].fs;
        if (held != all)
            return st_fail(STRATA_EUNFILLED, "tensor '%s': rank %d marks its shard %u "
                           "STRATA_SHARD_REPLICA, a copy of no unmarked shard, and the unmarked "
                           "shards hold %llu of the tensor's %llu elements (a copy needs a main "
                           "copy)", mt->name, ti->whole_rank, ti->whole_local,
                           (unsigned long long)held, (unsigned long long)all);
    }
    return 0;
}

/* Step 6: the metadata skeleton (complete but for the checksums) and the pieces. */
static int build_meta(st_save_ctx *c, uint64_t step)
{
    if (!(c->m = calloc(1, sizeof *c->m)))
        return oom();
    c->m->step = step;
    c->m->chunk = c->chunk;
    int rc = name_files(c);
    if (!rc)
        rc = describe_tensors(c);
    if (!rc)
        rc = lay_out(c);
    for (size_t t = 0; t < c->nt && !rc; t++)
        rc = check_overlap(c, t);
    return rc ? rc : check_whole(c);
}

int st_plan_save(st_save_plan *out, const st_rank_view *ranks, int nranks, uint32_t chunk,
                 uint64_t step)
{
    st_save_ctx c;
    st_save_work = 0;
    int rc = save_ctx_init(&c, out, ranks, nranks, chunk);
    if (!rc)
        rc = collect_mains(&c);
    if (!rc)
        rc = collect_blobs(&c);
    if (!rc)
        rc = collect_replicas(&c);
    if (!rc)
        rc = list_holders(&c);
    if (!rc)
        out->writer_bytes_bound = st_balance_bound(&c);
    /* 3. split large replicated shards into flat pieces, one per holder at most, so that
     * no single item is big enough to unbalance the writers (list scheduling ends within
     * one item of the mean) */
    if (!rc)
        rc = st_split_large(&c);
    if (!rc && !(c.order = malloc((c.ni + c.nt + 1) * sizeof *c.order)))
        rc = oom();
    if (!rc) {
        order_items(&c);
        rc = st_balance_writers(&c);
    }
    if (!rc) {
        take_sources(&c);
        rc = build_meta(&c, step);
    }
    if (!rc) {
        for (int r = 0; r < nranks; r++)
            out->max_writer_bytes = ST_MAX(out->max_writer_bytes, out->writer_bytes[r]);
        out->meta = c.m;
        c.m = NULL;
    }
    return save_ctx_free(&c, rc);
}
