/* dist_cache.c - a saver's cached save plan: the coordinator's global plan, each rank's
 * part of it as sent over the wire, and the hash that tells whether a layout changed. */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

void st_plan_cache_release(st_plan_cache *c)
{
    if (!c || atomic_fetch_sub(&c->refs, 1) > 1)
        return;
    free(c->mine);
    st_save_plan_free(&c->sp);
    free(c->by_rank);
    free(c->rank0);
    free(c);
}

/* Coordinator: groups the plan's pieces by writer and encodes each rank's part. */
int st_cache_encode(st_plan_cache *c, int P, unsigned char **out, size_t *counts)
{
    const st_save_plan *sp = &c->sp;
    c->rank0 = calloc((size_t)P + 1, sizeof *c->rank0);
    c->by_rank = malloc((sp->npieces + 1) * sizeof *c->by_rank);
    if (!c->rank0 || !c->by_rank)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++)
        c->rank0[sp->pieces[i].writer + 1]++;
    for (int r = 0; r < P; r++)
        c->rank0[r + 1] += c->rank0[r];
    size_t *fill = calloc((size_t)P, sizeof *fill);
    if (!fill)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < sp->npieces; i++) {
        int w = sp->pieces[i].writer;
        c->by_rank[c->rank0[w] + fill[w]++] = i;
    }
    free(fill);
    st_buf b = {0};
    for (int r = 0; r < P; r++) {
        size_t start = b.n;
        int f = sp->writer_file[r];
        st_buf_var(&b, f < 0 ? 0 : sp->meta->files[f].bytes);
        st_buf_var(&b, c->rank0[r + 1] - c->rank0[r]);
        for (size_t k = c->rank0[r]; k < c->rank0[r + 1]; k++) {
            const st_piece *pc = &sp->pieces[c->by_rank[k]];
            st_buf_var(&b, pc->local);
            st_buf_var(&b, pc->src_off);
            st_buf_var(&b, pc->offset);
            st_buf_var(&b, pc->bytes);
        }
        counts[r] = b.n - start;
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    *out = b.p;
    return 0;
}

int st_cache_decode(st_plan_cache *c, const unsigned char *p, size_t n)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    c->file_bytes = st_rd_var(&r);
    uint64_t k = st_rd_count(&r, 4, "piece count");
    c->mine = malloc((k + 1) * sizeof *c->mine);
    if (!c->mine)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (uint64_t i = 0; i < k && !r.err; i++) {
        c->mine[i].local = (uint32_t)st_rd_var(&r);
        c->mine[i].src_off = st_rd_var(&r);
        c->mine[i].offset = st_rd_var(&r);
        c->mine[i].bytes = st_rd_var(&r);
    }
    c->nmine = (size_t)k;
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "the coordinator's plan is malformed: %s", r.what);
    return 0;
}

/* This rank's part of the save as a one-file plan: its data file, its pieces, their
 * extents, and one array of checksums in piece order (ext[0].sums). Owns its memory. */
int st_cache_mine(const st_plan_cache *c, const st_rank_view *v, int me, st_save_plan *out)
{
    memset(out, 0, sizeof *out);
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory");
    out->meta = m;
    out->nranks = 1;
    m->chunk = c->chunk;
    size_t total = 0;
    for (size_t i = 0; i < c->nmine; i++)
        total += (size_t)st_nchunks(c->mine[i].bytes, c->chunk);
    char name[ST_DATA_FILE_BYTES];
    st_data_file_name(name, me);
    st_extent *ext = st_arena_alloc(&m->arena, (c->nmine + 1) * sizeof *ext);
    uint64_t *sums = st_arena_alloc(&m->arena, (total + 1) * 8);
    m->files = st_arena_alloc(&m->arena, sizeof *m->files);
    char *fname = st_arena_strndup(&m->arena, name, strlen(name));
    out->pieces = calloc(c->nmine + 1, sizeof *out->pieces);
    if (!ext || !sums || !m->files || !fname || !out->pieces) {
        st_save_plan_free(out);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    if (c->nmine) {
        m->nfiles = 1;
        m->files[0] = (st_mfile){fname, c->file_bytes};
    }
    size_t at = 0;
    for (size_t i = 0; i < c->nmine; i++) {
        const st_my_piece *q = &c->mine[i];
        if (q->local >= v->nsh + v->nbl) {
            st_save_plan_free(out);
            return st_fail(STRATA_EINVAL, "the coordinator assigned an unknown registration");
        }
        int shard = q->local < v->nsh;
        const void *data = shard ? v->sh[q->local].data : v->bl[q->local - v->nsh].data;
        ext[i] = (st_extent){0, q->offset, q->bytes, sums + at};
        at += (size_t)st_nchunks(q->bytes, c->chunk);
        out->pieces[i] = (st_piece){0, q->local, q->src_off, q->offset, q->bytes,
                                    (const char *)data + q->src_off, &ext[i],
                                    shard ? v->sh[q->local].name : v->bl[q->local - v->nsh].name,
                                    shard && v->sh[q->local].device,
                                    0 /* STRATA_SHARD_UNCHANGED: not across ranks yet */};
        m->data_bytes += q->bytes;
    }
    out->npieces = c->nmine;
    return 0;
}

/* The checksums of a rank's part, in piece order. */
const uint64_t *st_mine_sums(const st_save_plan *mine, size_t *n)
{
    *n = 0;
    for (size_t i = 0; i < mine->npieces; i++)
        *n += (size_t)st_nchunks(mine->pieces[i].bytes, mine->meta->chunk);
    return mine->npieces ? mine->pieces[0].ext->sums : NULL;
}

uint64_t st_plan_hash(const unsigned char *p, size_t n, int P, uint32_t chunk)
{
    return st_hash(p, n) ^ st_mix64((uint64_t)P * 0x100000001b3ULL + chunk);
}
