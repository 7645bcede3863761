/* plan_rank.c - one rank's reads in a load by several ranks (dist_load.c), from the global
 * plan every rank made the same. Within a node no bytes move between ranks: each rank reads
 * the chunks it needs itself, and a chunk that other ranks of its node need too is read
 * through the page cache (ST_IO_SHARED), so that the device reads it once; one of those
 * ranks, in turns a read's worth at a time, is counted as reading it (ST_IO_FIRST) and reads
 * it before its other reads. Only a read that ranks of other
 * nodes need too has a reader (chosen by the caller), which reads it whole (ST_IO_SEND) and
 * sends their bytes; its node's other ranks still read their own parts, counted as the
 * reader's. A plan with checks (a zip entry's CRC-32, st_plan_checks) is read in units
 * (st_io_unit_end): a rank that needs any byte of a unit reads all of it, as the global plan
 * has it, so that it compares each check before its bytes reach the caller; the unit is
 * shared and counted for one rank the same way. Pure; single-threaded. */
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../core/util.h"
#include "plan.h"

typedef struct {
    uint64_t pos;
    int loc;   /* the rank's index among its node's ranks (ascending by rank) */
    int delta; /* +1 at the start of its chunks, -1 at the end */
} event;

static int cmp_event(const void *a, const void *b)
{
    const event *x = a, *y = b;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

typedef struct {
    st_io_plan *out;
    size_t scap, icap;
    uint64_t max_io, align;
    event *ev;
    size_t nev, evcap;
    int *cnt;          /* per node-local rank: its runs covering the current position */
    int *sel;          /* the node-local ranks covering it */
    const int *loc;    /* per rank: its node-local index, or -1 on another node */
    int me_loc, nloc;
    uint64_t block;    /* chunks per read: shared chunks are counted for a rank per block */
    size_t seg_first;  /* the first of out's segments cut from the current global segment */
} rank_ctx;

/* Appends chunks [c0, c1) of piece with flags: to the last segment where they continue it
 * (within one global segment: those are at most max_io), else as a new one. */
static int add_seg(rank_ctx *c, uint32_t piece, uint64_t c0, uint64_t c1, uint32_t flags,
                   uint32_t **seg_flags, size_t *sfcap)
{
    st_io_plan *o = c->out;
    if (o->nsegs > c->seg_first && o->segs[o->nsegs - 1].c1 == c0 &&
        (*seg_flags)[o->nsegs - 1] == flags) {
        o->segs[o->nsegs - 1].c1 = c1;
        return 0;
    }
    if (st_grow(&o->segs, &c->scap, o->nsegs + 1, sizeof *o->segs) ||
        st_grow(seg_flags, sfcap, o->nsegs + 1, sizeof **seg_flags))
        return -1;
    o->segs[o->nsegs] = (st_seg){piece, c0, c1};
    (*seg_flags)[o->nsegs++] = flags;
    return 0;
}

/* Runs of piece `piece` overlapping its bytes [lo, hi), as st_walk_read finds them. */
static void runs_in(const st_io_plan *g, uint32_t piece, uint64_t lo, size_t *a, size_t *b)
{
    *a = st_io_first_run(g, piece, lo);
    *b = g->run0[piece + 1];
}

/* The chunks of global segment s that this rank needs, split where the set of its node's
 * ranks that need them changes. mate_reads: a rank of this node reads the whole segment (a
 * read with a reader): every chunk is shared and that rank's. */
static int split_seg(rank_ctx *c, const st_io_plan *g, const st_seg *s, int mate_reads,
                     uint32_t **seg_flags, size_t *sfcap)
{
    const uint64_t C = g->meta->chunk;
    const st_extent *e = g->ext[s->piece];
    uint64_t lo = s->c0 * C, hi = ST_MIN(s->c1 * C, e->bytes);
    size_t a, b;
    int mine = 0;
    c->nev = 0;
    c->seg_first = c->out->nsegs;
    runs_in(g, s->piece, lo, &a, &b);
    for (size_t r = a; r < b && g->runs[r].src < hi; r++) {
        const st_run *run = &g->runs[r];
        uint64_t x0 = ST_MAX(run->src, lo), x1 = ST_MIN(run->src + run->n, hi);
        if (x0 >= x1 || run->rank < 0 || c->loc[run->rank] < 0)
            continue;
        if (st_grow(&c->ev, &c->evcap, c->nev + 2, sizeof *c->ev))
            return -1;
        int l = c->loc[run->rank];
        c->ev[c->nev++] = (event){x0 / C, l, +1};
        c->ev[c->nev++] = (event){(x1 - 1) / C + 1, l, -1};
        mine |= l == c->me_loc;
    }
    if (!mine)
        return 0;
    qsort(c->ev, c->nev, sizeof *c->ev, cmp_event);
    int other = 0; /* node-mates covering */
    for (size_t k = 0; k < c->nev;) {
        uint64_t pos = c->ev[k].pos;
        for (; k < c->nev && c->ev[k].pos == pos; k++) {
            int l = c->ev[k].loc, was = c->cnt[l] > 0;
            c->cnt[l] += c->ev[k].delta;
            int now = c->cnt[l] > 0;
            if (l != c->me_loc && was != now)
                other += now - was;
        }
        if (k == c->nev || c->cnt[c->me_loc] <= 0)
            continue;
        if (mate_reads || !other) {
            if (add_seg(c, s->piece, pos, c->ev[k].pos, mate_reads ? ST_IO_SHARED : 0,
                        seg_flags, sfcap))
                return -1;
            continue;
        }
        /* shared: counted for one of the ranks that need it, in turns block by block (a
         * read's worth), the same choice on each of them */
        int n = 0;
        for (int l = 0; l < c->nloc; l++)
            if (c->cnt[l] > 0)
                c->sel[n++] = l;
        for (uint64_t b0 = pos, end = c->ev[k].pos; b0 < end;) {
            uint64_t blk = b0 / c->block, b1 = ST_MIN(end, (blk + 1) * c->block);
            int first = c->sel[(st_mix64(s->piece) + blk) % (uint64_t)n] == c->me_loc;
            if (add_seg(c, s->piece, b0, b1, ST_IO_SHARED | (first ? ST_IO_FIRST : 0), seg_flags,
                        sfcap))
                return -1;
            b0 = b1;
        }
    }
    return 0;
}

static uint64_t seg_payload(const st_io_plan *p, const st_seg *s)
{
    uint64_t C = p->meta->chunk;
    return ST_MIN(s->c1 * C, p->ext[s->piece]->bytes) - s->c0 * C;
}

/* Coalesces segments [s0, s1) of out (file order) into reads: same file and flags, separated
 * by alignment padding only, at most max_io bytes. */
static int coalesce(rank_ctx *c, size_t s0, size_t s1, const uint32_t *seg_flags)
{
    st_io_plan *o = c->out;
    const uint64_t C = o->meta->chunk;
    for (size_t i = s0; i < s1;) {
        const st_extent *e = o->ext[o->segs[i].piece];
        uint64_t off = e->offset + o->segs[i].c0 * C;
        uint64_t end = ST_ALIGN_UP(e->offset + ST_MIN(o->segs[i].c1 * C, e->bytes), c->align);
        size_t j = i + 1;
        for (; j < s1 && seg_flags[j] == seg_flags[i]; j++) {
            const st_extent *n = o->ext[o->segs[j].piece];
            uint64_t noff = n->offset + o->segs[j].c0 * C;
            uint64_t nend = ST_ALIGN_UP(n->offset + ST_MIN(o->segs[j].c1 * C, n->bytes), c->align);
            if (n->file != e->file || noff != end || nend - off > c->max_io)
                break;
            end = nend;
        }
        if (st_grow(&o->ios, &c->icap, o->nios + 1, sizeof *o->ios))
            return -1;
        o->ios[o->nios++] = (st_io){e->file, off, end - off, i, j, 0, 0, seg_flags[i]};
        for (size_t k = i; k < j; k++)
            o->payload_bytes += seg_payload(o, &o->segs[k]);
        i = j;
    }
    return 0;
}

size_t st_io_unit_end(const st_io_plan *g, size_t i)
{
    size_t j = i + 1;
    if (!g->ncparts)
        return j;
    uint64_t hw = g->ios[i].off + g->ios[i].len;
    for (; j < g->nios; j++) {
        const st_io *r = &g->ios[j];
        if (!st_io_joined(g, j) && (r->file != g->ios[i].file || r->off >= hw))
            break;
        hw = ST_MAX(hw, r->off + r->len);
    }
    return j;
}

/* Appends read i of g as it is (its segments copied) with flags. */
static int add_whole(rank_ctx *c, const st_io_plan *g, size_t i, uint32_t flags)
{
    st_io_plan *o = c->out;
    size_t s0 = o->nsegs;
    for (size_t si = g->ios[i].seg0; si < g->ios[i].seg1; si++) {
        if (st_grow(&o->segs, &c->scap, o->nsegs + 1, sizeof *o->segs))
            return -1;
        o->segs[o->nsegs++] = g->segs[si];
        o->payload_bytes += seg_payload(o, &g->segs[si]);
    }
    if (st_grow(&o->ios, &c->icap, o->nios + 1, sizeof *o->ios))
        return -1;
    o->ios[o->nios] = g->ios[i];
    o->ios[o->nios].seg0 = s0;
    o->ios[o->nios].seg1 = o->nsegs;
    o->ios[o->nios++].flags = flags;
    return 0;
}

/* Marks need[loc[r]] for each rank r of this node with a run in read k of g. */
static void mark_local(const st_io_plan *g, size_t k, const int *loc, unsigned char *need)
{
    const uint64_t C = g->meta->chunk;
    for (size_t si = g->ios[k].seg0; si < g->ios[k].seg1; si++) {
        const st_seg *s = &g->segs[si];
        uint64_t lo = s->c0 * C, hi = ST_MIN(s->c1 * C, g->ext[s->piece]->bytes);
        size_t a, b;
        runs_in(g, s->piece, lo, &a, &b);
        for (size_t r = a; r < b && g->runs[r].src < hi; r++)
            if (g->runs[r].src + g->runs[r].n > lo && g->runs[r].rank >= 0 &&
                loc[g->runs[r].rank] >= 0)
                need[loc[g->runs[r].rank]] = 1;
    }
}

/* The checked unit [i, j) of g, read whole where this rank needs any of it (rd: its reader
 * for other nodes, -1 if none; one of this node: it is counted for the unit). */
static int add_unit(rank_ctx *c, const st_io_plan *g, size_t i, size_t j, int rd,
                    unsigned char *need)
{
    memset(need, 0, (size_t)c->nloc);
    for (size_t k = i; k < j; k++)
        mark_local(g, k, c->loc, need);
    if (!need[c->me_loc])
        return 0;
    int n = 0, pick = 0;
    for (int l = 0; l < c->nloc; l++)
        if (need[l])
            c->sel[n++] = l;
    if (rd < 0) /* in turns, by unit */
        pick = c->sel[st_mix64(i) % (uint64_t)n] == c->me_loc;
    uint32_t flags = n > 1 ? ST_IO_SHARED | (pick ? ST_IO_FIRST : 0) : rd < 0 ? 0 : ST_IO_SHARED;
    for (size_t k = i; k < j; k++)
        if (add_whole(c, g, k, flags))
            return -1;
    return 0;
}

/* Order of a rank's reads: the shared ones it is counted for first (the node's other readers
 * then find them in the page cache), its private ones, the shared ones of others, then the
 * reads it sends. */
static int io_class(uint32_t f)
{
    return f & ST_IO_SEND ? 3 : !(f & ST_IO_SHARED) ? 1 : f & ST_IO_FIRST ? 0 : 2;
}

int st_plan_rank_reads(st_io_plan *out, const st_io_plan *g, int me, const int *node,
                       const int *reader, uint64_t max_io)
{
    *out = *g; /* the runs, extents and views are the global plan's */
    out->segs = NULL;
    out->ios = NULL;
    out->nsegs = out->nios = 0;
    out->payload_bytes = 0;
    const int P = g->nranks;
    const uint64_t C = g->meta->chunk;
    rank_ctx c = {.out = out, .align = st_meta_align(g->meta)};
    c.max_io = st_plan_max_io(g->meta, max_io);
    int *loc = malloc(((size_t)P + 1) * sizeof *loc);
    uint32_t *seg_flags = NULL;
    size_t sfcap = 0, ns = 0;
    st_io *sorted = NULL;
    unsigned char *unit_need_buf = NULL, *unit = NULL;
    int nloc = 0, rc = 0;
    if (!loc)
        goto oom;
    for (int r = 0; r < P; r++)
        loc[r] = node[r] == node[me] ? nloc++ : -1;
    c.loc = loc;
    c.me_loc = loc[me];
    c.nloc = nloc;
    c.block = c.max_io / C;
    if (!(c.cnt = calloc((size_t)nloc, sizeof *c.cnt)) ||
        !(c.sel = calloc((size_t)nloc, sizeof *c.sel)) ||
        !(unit_need_buf = calloc((size_t)nloc, 1)) || !(unit = calloc(g->nios + 1, 1)))
        goto oom;
    /* reads this node does: the chunks this rank needs, split by who else needs them; the
     * checked units after, whole */
    for (size_t i = 0, j; g->ncparts && i < g->nios; i = j) { /* unit[k]: k's is checked */
        j = st_io_unit_end(g, i);
        unsigned char chk = j > i + 1 || g->ios[i].cp0 < g->ios[i].cp1;
        memset(unit + i, chk, j - i);
    }
    for (size_t i = 0; i < g->nios; i++) {
        int rd = reader[i];
        if ((rd >= 0 && (rd == me || node[rd] != node[me])) || unit[i])
            continue; /* sent whole, below; another node's reader sends what I need; checked */
        for (size_t si = g->ios[i].seg0; si < g->ios[i].seg1; si++)
            if (split_seg(&c, g, &g->segs[si], rd >= 0, &seg_flags, &sfcap))
                goto oom;
    }
    ns = out->nsegs;
    if (coalesce(&c, 0, ns, seg_flags))
        goto oom;
    for (size_t i = 0, j; g->ncparts && i < g->nios; i = j) {
        int rd = reader[i];
        j = st_io_unit_end(g, i);
        if (unit[i] && !(rd >= 0 && (rd == me || node[rd] != node[me])) &&
            add_unit(&c, g, i, j, rd, unit_need_buf))
            goto oom;
    }
    /* the reads this rank sends to other nodes: whole, shared where node-mates need some */
    for (size_t i = 0; i < g->nios; i++) {
        if (reader[i] != me)
            continue;
        int mates = 0;
        memset(unit_need_buf, 0, (size_t)nloc);
        mark_local(g, i, loc, unit_need_buf);
        for (int l = 0; l < nloc; l++)
            mates |= l != c.me_loc && unit_need_buf[l];
        if (add_whole(&c, g, i, ST_IO_SEND | ST_IO_FIRST | (mates ? ST_IO_SHARED : 0)))
            goto oom;
    }
    /* the local reads in the order above (stable), the sent ones last in plan order */
    if (!(sorted = malloc((out->nios + 1) * sizeof *sorted)))
        goto oom;
    size_t k = 0;
    for (int cls = 0; cls < 4; cls++)
        for (size_t i = 0; i < out->nios; i++)
            if (io_class(out->ios[i].flags) == cls)
                sorted[k++] = out->ios[i];
    free(out->ios);
    out->ios = sorted;
    goto done;
oom:
    rc = st_fail(STRATA_ENOMEM, "out of memory planning this rank's reads");
    st_rank_reads_free(out);
done:
    free(loc);
    free(c.cnt);
    free(c.sel);
    free(c.ev);
    free(seg_flags);
    free(unit_need_buf);
    free(unit);
    return rc;
}

void st_rank_reads_free(st_io_plan *p)
{
    free(p->segs);
    free(p->ios);
    p->segs = NULL;
    p->ios = NULL;
    p->nsegs = p->nios = 0;
}
