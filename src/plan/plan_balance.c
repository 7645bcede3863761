/* plan_balance.c - who writes what in a save plan: the bound on the best balance, the split
 * of large replicated pieces, and the writers chosen by list scheduling (largest first to
 * the least-loaded holder), each replicated piece's holders kept in a heap so that no
 * piece compares all of its holders. Pure; single-threaded. */
#include <stdlib.h>

#include "../core/error.h"
#include "../core/util.h"
#include "plan_save.h"

_Thread_local uint64_t st_save_work; /* st_plan_save_work: here, below plan_save.c */

static int uf_find(int *parent, int x)
{
    while (parent[x] != x)
        x = parent[x] = parent[parent[x]];
    return x;
}

/* Union-find over ranks linked by shared items, and each rank's own single-holder bytes.
 * Before the split (a split piece's holders are its item's: the groups and bytes are the
 * same). */
uint64_t st_balance_bound(const st_save_ctx *c)
{
    const st_item *it = c->it;
    const st_holder *hold = c->hold;
    const int nranks = c->nranks;
    int *parent = malloc((size_t)nranks * sizeof *parent), *count = calloc((size_t)nranks, sizeof *count);
    uint64_t *bytes = calloc((size_t)nranks, sizeof *bytes), best = 0;
    if (!parent || !count || !bytes)
        goto out;
    for (int r = 0; r < nranks; r++)
        parent[r] = r;
    /* tensor items only: global blobs are held everywhere but are too small to move work,
     * and leaving them out keeps the bound valid (it only omits bytes) */
    for (size_t j = 0; j < c->ni; j++)
        for (size_t h = 1; h < it[j].nh && !it[j].blob; h++) {
            int a = uf_find(parent, hold[it[j].h0].rank), b = uf_find(parent, hold[it[j].h0 + h].rank);
            if (a != b)
                parent[a] = b;
        }
    for (size_t j = 0; j < c->ni; j++) {
        st_save_work += it[j].nh;
        if (!it[j].blob)
            bytes[uf_find(parent, hold[it[j].h0].rank)] += it[j].bytes;
    }
    for (int r = 0; r < nranks; r++)
        count[uf_find(parent, r)]++;
    for (int r = 0; r < nranks; r++)
        if (bytes[r] && (bytes[r] + (uint64_t)count[r] - 1) / (uint64_t)count[r] > best)
            best = (bytes[r] + (uint64_t)count[r] - 1) / (uint64_t)count[r];
    /* and no rank writes less than what only it holds */
    memset(bytes, 0, (size_t)nranks * sizeof *bytes);
    for (size_t j = 0; j < c->ni; j++)
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
 * of the data; the pieces keep the item's holder list, and the item names its other
 * pieces (x0, nx), which follow every item. */
int st_split_large(st_save_ctx *c)
{
    size_t ni = c->ni, extra = 0;
    uint64_t total = 0;
    int writers = 0;
    unsigned char *holds = calloc((size_t)c->nranks, 1);
    if (!holds)
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    for (size_t j = 0; j < ni; j++) {
        total += c->it[j].bytes;
        st_save_work += c->it[j].nh;
        for (size_t h = 0; h < c->it[j].nh; h++)
            if (!holds[c->hold[c->it[j].h0 + h].rank]++)
                writers++;
    }
    free(holds);
    uint64_t limit = writers ? total / (uint64_t)writers / 10 : 0;
    if (limit < SPLIT_MIN_BYTES)
        limit = SPLIT_MIN_BYTES;
    for (size_t j = 0; j < ni; j++)
        if (!c->it[j].blob && c->it[j].nh > 1 && c->it[j].bytes > limit)
            extra += ST_MIN(c->it[j].nh, (c->it[j].bytes + limit - 1) / limit) - 1;
    if (!extra)
        return 0;
    st_item *n = realloc(c->it, (ni + extra + 1) * sizeof *n);
    if (!n)
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    st_item *it = c->it = n;
    size_t end = ni;
    for (size_t j = 0; j < ni; j++) {
        if (it[j].blob || it[j].nh <= 1 || it[j].bytes <= limit)
            continue;
        uint64_t pieces = ST_MIN(it[j].nh, (it[j].bytes + limit - 1) / limit);
        uint64_t esz = strata_dtype_size(it[j].e->dtype), grain = 4096 / esz;
        uint64_t fs = it[j].fs, fe = it[j].fe, count = fe - fs, prev = fs;
        it[j].x0 = end;
        for (uint64_t k = 1; k <= pieces; k++) {
            uint64_t cut = k == pieces ? fe : fs + (count * k / pieces) / grain * grain;
            if (cut <= prev)
                continue;
            st_item *x = k == 1 ? &it[j] : &it[end++];
            if (k > 1) {
                *x = it[j];
                x->nx = 0;
                x->extra = 1;
            }
            x->fs = prev;
            x->fe = cut;
            x->bytes = (cut - prev) * esz;
            prev = cut;
        }
        it[j].nx = end - it[j].x0;
    }
    c->ni = end;
    return 0;
}

/* ---- list scheduling ---- */

typedef struct {
    uint64_t load;
    int32_t rank;
    uint32_t h; /* holder index, relative to the item's h0 */
} slot;

static int before(const slot *a, const slot *b)
{
    return a->load != b->load ? a->load < b->load : a->rank < b->rank;
}

static void sift_down(slot *s, size_t n, size_t i)
{
    for (;; st_save_work++) {
        size_t l = 2 * i + 1, m = i;
        if (l < n && before(&s[l], &s[m]))
            m = l;
        if (l + 1 < n && before(&s[l + 1], &s[m]))
            m = l + 1;
        if (m == i)
            return;
        slot t = s[i];
        s[i] = s[m];
        s[m] = t;
        i = m;
    }
}

/* Replicated items, largest first. */
static int cmp_size_desc(const void *pa, const void *pb, void *ctx)
{
    const st_item *it = ctx;
    const st_item *a = &it[*(const size_t *)pa], *b = &it[*(const size_t *)pb];
    if (a->bytes != b->bytes)
        return a->bytes < b->bytes ? 1 : -1;
    return (a->meta_pos > b->meta_pos) - (a->meta_pos < b->meta_pos);
}

/* The pieces of replicated item j (itself and its split pieces), largest first, each to
 * the least-loaded of its holders (by bytes, then rank): a heap of the holders, built once,
 * so that k pieces of n holders cost n + k log n. A rank holding it twice has two slots;
 * a slot whose load is stale is refreshed when it comes to the top. */
static void assign_item(st_save_ctx *c, size_t j, slot *heap, size_t *pieces)
{
    st_item *x = &c->it[j];
    uint64_t *wb = c->out->writer_bytes;
    size_t n = x->nh, np = 0;
    st_save_work += n;
    for (size_t h = 0; h < n; h++) {
        int32_t r = c->hold[x->h0 + h].rank;
        heap[h] = (slot){wb[r], r, (uint32_t)h};
    }
    for (size_t i = n / 2; i-- > 0;)
        sift_down(heap, n, i);
    pieces[np++] = j;
    for (size_t q = 0; q < x->nx; q++)
        pieces[np++] = x->x0 + q;
    if (np > 1)
        qsort_r(pieces, np, sizeof *pieces, cmp_size_desc, c->it);
    for (size_t q = 0; q < np; q++) {
        while (heap[0].load != wb[heap[0].rank]) { /* stale: the rank's other slot took work */
            heap[0].load = wb[heap[0].rank];
            sift_down(heap, n, 0);
        }
        st_item *p = &c->it[pieces[q]];
        p->writer = heap[0].rank;
        p->wh = x->h0 + heap[0].h;
        wb[p->writer] += p->bytes;
        heap[0].load = wb[p->writer];
        sift_down(heap, n, 0);
    }
}

/* Single-holder items are fixed; the replicated ones go largest first (an item with its
 * split pieces at once) to their least-loaded holders. */
int st_balance_writers(st_save_ctx *c)
{
    st_save_plan *out = c->out;
    st_item *it = c->it;
    out->nranks = c->nranks;
    out->writer_bytes = calloc((size_t)c->nranks, sizeof *out->writer_bytes);
    out->writer_file = malloc((size_t)c->nranks * sizeof *out->writer_file);
    if (!out->writer_bytes || !out->writer_file)
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    size_t nmulti = 0, maxh = 0;
    for (size_t j = 0; j < c->ni; j++) {
        if (it[j].nh == 1) {
            it[j].writer = c->hold[it[j].h0].rank;
            it[j].wh = it[j].h0;
            out->writer_bytes[it[j].writer] += it[j].bytes;
        } else if (!it[j].extra) { /* its split pieces go with it */
            c->order[nmulti++] = j;
            maxh = ST_MAX(maxh, it[j].nh);
        }
    }
    slot *heap = malloc((maxh + 1) * sizeof *heap);
    size_t *pieces = malloc((maxh + 1) * sizeof *pieces);
    if (!heap || !pieces) {
        free(heap);
        free(pieces);
        return st_fail(STRATA_ENOMEM, "out of memory planning the save");
    }
    qsort_r(c->order, nmulti, sizeof *c->order, cmp_size_desc, it);
    for (size_t q = 0; q < nmulti; q++)
        assign_item(c, c->order[q], heap, pieces);
    free(heap);
    free(pieces);
    return 0;
}
