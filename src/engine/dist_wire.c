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

/* ---- local plans on the wire ---- */

void st_encode_state(st_buf *b, const st_rank_view *v)
{
    st_buf_var(b, v->nsh);
    for (size_t i = 0; i < v->nsh; i++) {
        const st_entry *e = &v->sh[i];
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

/* Decodes a peer's state (data pointers NULL) into arena memory. */
static int decode_state(st_arena *a, const unsigned char *p, size_t n, st_rank_view *v)
{
    st_rd r = {.p = p, .end = p + n, .base = p};
    memset(v, 0, sizeof *v);
    uint64_t ns = st_rd_count(&r, 4, "shard count");
    st_entry *sh = st_arena_alloc(a, (ns + 1) * sizeof *sh);
    for (uint64_t i = 0; sh && i < ns && !r.err; i++) {
        st_entry *e = &sh[i];
        memset(e, 0, sizeof *e);
        e->name = st_rd_str(&r, a, STRATA_MAX_NAME);
        e->dtype = (strata_dtype)st_rd_u8(&r);
        e->ndim = st_rd_u8(&r);
        if (e->ndim > STRATA_MAX_DIMS || !strata_dtype_size(e->dtype)) {
            st_rd_fail(&r, "bad shard");
            break;
        }
        for (int d = 0; d < e->ndim; d++) {
            e->shape[d] = st_rd_var(&r);
            e->off[d] = st_rd_var(&r);
            e->len[d] = st_rd_var(&r);
        }
        e->fs = st_rd_var(&r);
        e->fe = st_rd_var(&r);
        e->bytes = (e->fe - e->fs) * strata_dtype_size(e->dtype);
    }
    uint64_t nb = st_rd_count(&r, 3, "blob count");
    st_blobent *bl = st_arena_alloc(a, (nb + 1) * sizeof *bl);
    for (uint64_t i = 0; bl && i < nb && !r.err; i++) {
        bl[i].name = st_rd_str(&r, a, STRATA_MAX_NAME);
        bl[i].local = st_rd_u8(&r);
        bl[i].owner = (int)st_rd_var(&r) - 1;
        bl[i].size = st_rd_var(&r);
        bl[i].data = NULL;
    }
    int cast = st_rd_u8(&r);
    if (!sh || !bl)
        return st_fail(STRATA_ENOMEM, "out of memory");
    if (!r.err && cast > ST_CAST_ANY)
        st_rd_fail(&r, "bad cast flag");
    if (r.err || r.p != r.end)
        return st_fail(STRATA_EINVAL, "a peer's plan is malformed: %s", r.what);
    *v = (st_rank_view){sh, (size_t)ns, bl, (size_t)nb, cast};
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
