/* plan_check.c - a load plan's checks (st_plan_checks): where a format's check covers more
 * than a load needs (a zip entry's CRC-32 covers the whole entry), the reads are widened to
 * whole checks, and each checked byte is given to the one read that takes it into the
 * check's CRC-32. Pure; single-threaded. */
#include <stdlib.h>

#include "../core/error.h"
#include "../meta/checks.h"
#include "plan.h"

/* A range of one file to cover: [off, end); gap: no read covers it yet. */
typedef struct {
    uint64_t off, end;
    int gap;
    size_t io; /* not a gap: the read */
} item;

typedef struct {
    st_io *v;
    size_t n, cap;
} io_vec;

static int push_io(io_vec *o, st_io r)
{
    if (st_grow(&o->v, &o->cap, o->n + 1, sizeof *o->v))
        return -1;
    o->v[o->n++] = r;
    return 0;
}

/* [*s, *e) grown by every check of file f that it overlaps. */
static void grow_to_checks(const st_meta *m, uint32_t f, uint64_t *s, uint64_t *e)
{
    for (size_t k = st_check_find(m, f, *s);
         k < m->nchecks && m->checks[k].file == f && m->checks[k].offset < *e; k++) {
        const st_mcheck *c = &m->checks[k];
        *s = ST_MIN(*s, c->offset);
        *e = ST_MAX(*e, c->offset + c->bytes);
    }
}

/* The reads of file f (p->ios[a, b)), with the gaps of the checks they touch, packed into
 * reads of at most max_io: a read continues the one before where it touches or overlaps it
 * and the two fit one read; a gap fills the read before it, then reads of its own. */
static int widen_file(const st_io_plan *p, size_t a, size_t b, uint64_t max_io, io_vec *o,
                      uint64_t *added)
{
    const st_meta *m = p->meta;
    const uint32_t f = p->ios[a].file;
    int have = 0;
    st_io cur = {0};
    for (size_t i = a; i < b;) {
        /* one span of covered bytes: reads and the checks they touch, merged */
        uint64_t S = p->ios[i].off, E = S + p->ios[i].len, hw;
        grow_to_checks(m, f, &S, &E);
        size_t j = i + 1;
        for (; j < b && p->ios[j].off <= E; j++) {
            uint64_t s = p->ios[j].off, e = s + p->ios[j].len;
            grow_to_checks(m, f, &s, &e);
            E = ST_MAX(E, e);
        }
        hw = S;
        for (size_t k = i; k <= j; k++) {
            /* the gap before read k (k == j: the span's tail) */
            uint64_t ge = k < j ? p->ios[k].off : E;
            while (hw < ge) {
                if (have && cur.off + cur.len == hw && cur.len < max_io) {
                    uint64_t t = ST_MIN(ge - hw, max_io - cur.len);
                    cur.len += t;
                    hw += t;
                    *added += t;
                    continue;
                }
                if (have && push_io(o, cur))
                    return -1;
                size_t sg = have ? cur.seg1 : p->ios[i].seg0;
                cur = (st_io){f, hw, ST_MIN(ge - hw, max_io), sg, sg, 0, 0, 0};
                have = 1;
                hw += cur.len;
                *added += cur.len;
            }
            if (k == j)
                break;
            const st_io *r = &p->ios[k];
            uint64_t re = r->off + r->len;
            if (have && r->off <= cur.off + cur.len &&
                ST_MAX(cur.off + cur.len, re) - cur.off <= max_io) {
                cur.len = ST_MAX(cur.off + cur.len, re) - cur.off;
                cur.seg1 = r->seg1;
            } else {
                if (have && push_io(o, cur))
                    return -1;
                cur = *r;
                have = 1;
            }
            hw = ST_MAX(hw, re);
        }
        i = j;
    }
    return have ? push_io(o, cur) : 0;
}

/* Gives each checked byte to the first read that reads it: the parts of the checks (in
 * file order, so a check's parts are consecutive). */
static int assign_parts(st_io_plan *p)
{
    const st_meta *m = p->meta;
    size_t cap = 0;
    uint64_t hw = 0;
    for (size_t i = 0; i < p->nios; i++) {
        st_io *r = &p->ios[i];
        if (i == 0 || p->ios[i - 1].file != r->file)
            hw = 0;
        uint64_t s = ST_MAX(r->off, hw), e = ST_MAX(r->off + r->len, hw);
        hw = e;
        r->cp0 = r->cp1 = p->ncparts;
        for (size_t k = st_check_find(m, r->file, s);
             s < e && k < m->nchecks && m->checks[k].file == r->file &&
             m->checks[k].offset < e;
             k++) {
            const st_mcheck *c = &m->checks[k];
            if (st_grow(&p->cparts, &cap, p->ncparts + 1, sizeof *p->cparts))
                return -1;
            p->cparts[p->ncparts++] =
                (st_cpart){(uint32_t)k, ST_MAX(s, c->offset) - c->offset,
                           ST_MIN(e, c->offset + c->bytes) - c->offset};
        }
        r->cp1 = p->ncparts;
    }
    /* whole: each check's parts run from its first byte to its last without a gap */
    p->crc_whole = 1;
    for (size_t i = 0; i < p->ncparts && p->crc_whole; i++) {
        const st_cpart *c = &p->cparts[i];
        int first = i == 0 || p->cparts[i - 1].check != c->check;
        int last = i + 1 == p->ncparts || p->cparts[i + 1].check != c->check;
        if (c->lo != (first ? 0 : p->cparts[i - 1].hi) ||
            (last && c->hi != m->checks[c->check].bytes))
            p->crc_whole = 0;
    }
    return 0;
}

int st_plan_checks(st_io_plan *p, uint64_t max_io, int widen)
{
    const st_meta *m = p->meta;
    if (!m->nchecks || !p->nios)
        return 0;
    max_io = st_plan_max_io(m, max_io);
    io_vec o = {0};
    uint64_t added = 0;
    for (size_t a = 0; widen && a < p->nios;) {
        size_t b = a + 1;
        while (b < p->nios && p->ios[b].file == p->ios[a].file)
            b++;
        if (widen_file(p, a, b, max_io, &o, &added)) {
            free(o.v);
            return st_fail(STRATA_ENOMEM, "out of memory planning the load's checks");
        }
        a = b;
    }
    if (widen) {
        free(p->ios);
        p->ios = o.v;
        p->nios = o.n;
        p->crc_bytes = added;
    }
    if (assign_parts(p)) {
        free(p->cparts);
        p->cparts = NULL;
        p->ncparts = 0;
        for (size_t i = 0; i < p->nios; i++)
            p->ios[i].cp0 = p->ios[i].cp1 = 0;
        return st_fail(STRATA_ENOMEM, "out of memory planning the load's checks");
    }
    return 0;
}

uint64_t st_io_crc_bytes(const st_io_plan *p, size_t i)
{
    const st_io *r = &p->ios[i];
    const uint64_t C = p->meta->chunk;
    uint64_t covered = 0, hw = r->off; /* segments in file order: a sweep of their union */
    for (size_t si = r->seg0; si < r->seg1; si++) {
        const st_seg *s = &p->segs[si];
        const st_extent *e = p->ext[s->piece];
        uint64_t lo = e->offset + s->c0 * C, hi = e->offset + ST_MIN(s->c1 * C, e->bytes);
        lo = ST_MAX(lo, hw);
        if (hi > lo) {
            covered += hi - lo;
            hw = hi;
        }
    }
    return r->len - covered;
}
