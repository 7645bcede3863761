/* dist_wire.c - the first-failure status every rank learns, sums over ranks, and the
 * wire encoding of a rank's registered shards and blobs (its local plan, or its requests). */
#include <stdio.h>
#include <stdlib.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

void st_status_set(st_status *s, int rc, int rank)
{
    s->rc = rc;
    s->rank = rank;
    st_err_keep(s->msg, rc);
}

/* Makes a status received from another rank this thread's error. */
int st_status_raise(const st_status *s, int me)
{
    if (s->rank == me)
        return st_err_restore(s->rc, s->msg);
    return st_fail(s->rc, "rank %d: %s", s->rank, s->msg);
}

/* For the stats: the sum, maximum (may be NULL) and count of nonzero (may be NULL) of v
 * over all ranks (an allgather); left 0 if that fails. */
void st_over_ranks(strata_comm *comm, uint64_t v, uint64_t *sum, uint64_t *max,
                   uint64_t *nonzero)
{
    uint64_t *every = malloc((size_t)comm->size * 8);
    if (every && st_allgather(comm, &v, 8, every) == 0)
        for (int r = 0; r < comm->size; r++) {
            *sum += every[r];
            if (max)
                *max = ST_MAX(*max, every[r]);
            if (nonzero)
                *nonzero += every[r] > 0;
        }
    free(every);
}

/* ---- local plans on the wire ----
 * varint nsh, per shard its description (name, dtype, ndim, shape/off/len per dim, fs, fe),
 * its registration index and flags (bit 0: STRATA_SHARD_REPLICA); varint nref, per ref its
 * tensor's and piece's keys (u64 each) and a varint of its registration index times 2 plus
 * its unchanged mark; varint nbl, per blob its name,
 * rank-local flag, owner + 1 and size; the cast level. */

static void encode(st_buf *b, const st_rank_view *v, int refs)
{
    size_t nref = 0;
    for (size_t i = 0; refs && i < v->nsh; i++)
        nref += v->sh[i].replica && v->sh[i].bytes;
    st_buf_var(b, v->nsh - nref);
    for (size_t i = 0; i < v->nsh; i++) {
        const st_entry *e = &v->sh[i];
        if (refs && e->replica && e->bytes)
            continue;
        st_buf_str(b, e->name);
        st_buf_u8(b, (uint8_t)e->dtype);
        st_buf_u8(b, (uint8_t)e->ndim);
        for (int d = 0; d < e->ndim; d++) {
            st_buf_var(b, e->shape[d]);
            st_buf_var(b, e->off[d]);
            st_buf_var(b, e->len[d]);
        }
        st_buf_var(b, e->fs);
        st_buf_var(b, e->fe);
        st_buf_var(b, i);
        st_buf_u8(b, (uint8_t)(e->replica != 0));
    }
    st_buf_var(b, nref);
    for (size_t i = 0; nref && i < v->nsh; i++)
        if (v->sh[i].replica && v->sh[i].bytes) {
            st_ref f = st_ref_of(&v->sh[i], (uint32_t)i);
            st_buf_u64(b, f.tkey);
            st_buf_u64(b, f.pkey);
            st_buf_var(b, (uint64_t)f.local << 1 | (f.unchanged != 0));
        }
    st_buf_var(b, v->nbl);
    for (size_t i = 0; i < v->nbl; i++) {
        st_buf_str(b, v->bl[i].name);
        st_buf_u8(b, (uint8_t)v->bl[i].local);
        st_buf_var(b, (uint64_t)(v->bl[i].owner + 1));
        st_buf_var(b, v->bl[i].size);
    }
    st_buf_u8(b, (uint8_t)v->cast);
}

void st_encode_state(st_buf *b, const st_rank_view *v) { encode(b, v, 0); }

void st_encode_local_plan(st_buf *b, const st_rank_view *v) { encode(b, v, 1); }

/* The shards of a peer's state (data pointers NULL), their registration indices into *reg
 * (NULL when shard i is registration i). */
static st_entry *decode_shards(st_rd *r, st_arena *a, uint64_t *ns, uint32_t **reg)
{
    *ns = st_rd_count(r, 6, "shard count");
    st_entry *sh = st_arena_alloc(a, (*ns + 1) * sizeof *sh);
    uint32_t *lx = st_arena_alloc(a, (*ns + 1) * sizeof *lx);
    int identity = 1;
    for (uint64_t i = 0; sh && lx && i < *ns && !r->err; i++) {
        st_entry *e = &sh[i];
        memset(e, 0, sizeof *e);
        e->name = st_rd_str(r, a, STRATA_MAX_NAME);
        e->dtype = (strata_dtype)st_rd_u8(r);
        e->ndim = st_rd_u8(r);
        if (e->ndim > STRATA_MAX_DIMS || !strata_dtype_size(e->dtype)) {
            st_rd_fail(r, "bad shard");
            break;
        }
        for (int d = 0; d < e->ndim; d++) {
            e->shape[d] = st_rd_var(r);
            e->off[d] = st_rd_var(r);
            e->len[d] = st_rd_var(r);
        }
        e->fs = st_rd_var(r);
        e->fe = st_rd_var(r);
        uint64_t local = st_rd_var(r);
        e->replica = st_rd_u8(r) & 1;
        if (!r->err && (e->fe < e->fs || local > UINT32_MAX || (i && local <= lx[i - 1])))
            st_rd_fail(r, "bad shard");
        lx[i] = (uint32_t)local;
        identity &= local == i;
        e->bytes = (e->fe - e->fs) * strata_dtype_size(e->dtype);
    }
    *reg = identity ? NULL : lx;
    return sh && lx ? sh : NULL;
}

static st_ref *decode_refs(st_rd *r, st_arena *a, uint64_t *nr)
{
    *nr = st_rd_count(r, 17, "ref count");
    st_ref *f = st_arena_alloc(a, (*nr + 1) * sizeof *f);
    for (uint64_t i = 0; f && i < *nr && !r->err; i++) {
        f[i].tkey = st_rd_u64(r);
        f[i].pkey = st_rd_u64(r);
        uint64_t local = st_rd_var(r);
        f[i].unchanged = local & 1;
        local >>= 1;
        if (!r->err && (local > UINT32_MAX || (i && local <= f[i - 1].local)))
            st_rd_fail(r, "bad ref");
        f[i].local = (uint32_t)local;
    }
    return f;
}

/* Decodes a peer's state into arena memory. */
static int decode_state(st_arena *a, const unsigned char *p, size_t n, st_rank_view *v)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    memset(v, 0, sizeof *v);
    uint64_t ns = 0, nr = 0;
    uint32_t *reg = NULL;
    st_entry *sh = decode_shards(&r, a, &ns, &reg);
    st_ref *ref = r.err ? NULL : decode_refs(&r, a, &nr);
    for (uint64_t i = 0; !r.err && ref && i < nr; i++)
        if (ref[i].local >= ns + nr)
            st_rd_fail(&r, "bad ref");
    for (uint64_t i = 0; !r.err && sh && reg && i < ns; i++)
        if (reg[i] >= ns + nr)
            st_rd_fail(&r, "bad shard");
    uint64_t nb = r.err ? 0 : st_rd_count(&r, 3, "blob count");
    st_blobent *bl = st_arena_alloc(a, (nb + 1) * sizeof *bl);
    for (uint64_t i = 0; bl && i < nb && !r.err; i++) {
        bl[i].name = st_rd_str(&r, a, STRATA_MAX_NAME);
        bl[i].local = st_rd_u8(&r);
        bl[i].owner = (int)st_rd_var(&r) - 1;
        bl[i].size = st_rd_var(&r);
        bl[i].data = NULL;
    }
    int cast = st_rd_u8(&r);
    if (!r.err && (!sh || !ref || !bl))
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (!r.err && cast > ST_CAST_ANY)
        st_rd_fail(&r, "bad cast flag");
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "a peer's plan is malformed: %s", r.what);
    *v = (st_rank_view){.sh = sh, .nsh = (size_t)ns, .bl = bl, .nbl = (size_t)nb,
                        .cast = cast, .ref = ref, .nref = (size_t)nr, .reg = reg};
    return 0;
}

/* Every rank's state: this rank's own view, the others decoded from the gathered bytes. */
int st_decode_all(st_arena *a, const unsigned char *all, const size_t *counts, int P,
                      int me, const st_rank_view *mine, st_rank_view *out)
{
    size_t off = 0;
    for (int r = 0; r < P; r++) {
        int rc = r == me && mine ? (out[r] = *mine, 0) : decode_state(a, all + off, counts[r], &out[r]);
        if (rc)
            return rc;
        off += counts[r];
    }
    return 0;
}
