/* load.c - loading ranks in this process from an opened source (any saved layout into any
 * requested layout, the plan kept for a load that repeats the request), and
 * strata_ckpt_verify (every chunk of every extent). */
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"


void st_load_cache_clear(st_load_cache *c)
{
    if (c->have)
        st_io_plan_free(&c->plan);
    free(c->key);
    free(c->views);
    st_arena_free(&c->arena);
    memset(c, 0, sizeof *c);
}

int st_load_cache_hit(const st_load_cache *c, const unsigned char *key, size_t n)
{
    return c->have && c->keylen == n && memcmp(c->key, key, n) == 0;
}

/* The key of an in-process request: every rank's encoded request (data addresses left
 * out), the largest read and the checks (skipped, whole or ledger's), which shape the plan. */
static int local_key(st_buf *b, const st_rank_view *rv, int nranks, uint64_t max_io, int crc)
{
    st_buf_u64(b, max_io);
    st_buf_u8(b, (uint8_t)crc);
    st_buf_u32(b, (uint32_t)nranks);
    for (int r = 0; r < nranks; r++)
        st_encode_state(b, &rv[r]);
    return b->oom ? st_fail(STRATA_ENOMEM, "out of memory") : 0;
}

int st_load_local(const st_dir *d, st_load_cache *c, strata_state *const *ranks, int nranks,
                  const strata_load_opts *o, st_crc_ledger *later, strata_stats *stats)
{
    double t0 = st_now();
    uint64_t max_io = o->max_io_bytes;
    st_rank_view *rv = calloc((size_t)nranks, sizeof *rv);
    st_buf key = {0};
    if (!rv)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < nranks; r++) {
        rv[r] = st_state_view(ranks[r]);
        rv[r].cast = st_cast_level(o->flags);
    }
    /* a format's CRC-32s: skipped (0), each entry read whole (1), or the ledger's (2) */
    int skip = (o->flags & STRATA_LOAD_SKIP_CRC) && d->meta->nchecks;
    int crc_mode = skip ? 0 : later ? 2 : 1;
    int rc = local_key(&key, rv, nranks, max_io, crc_mode), cached = 0;
    if (!rc && st_load_cache_hit(c, key.p, key.n)) {
        /* the same request: the same plan, with this load's data addresses */
        memcpy((st_rank_view *)c->plan.ranks, rv, (size_t)nranks * sizeof *rv);
        cached = 1;
    } else if (!rc) {
        st_load_cache_clear(c);
        if (!(rc = st_plan_load(&c->plan, d->meta, rv, nranks, max_io)) && crc_mode &&
            (rc = st_plan_checks(&c->plan, max_io, crc_mode == 1)))
            st_io_plan_free(&c->plan);
        if (!rc) {
            c->have = 1;
            c->key = key.p;
            c->keylen = key.n;
            key.p = NULL;
        }
    }
    uint64_t got = 0;
    st_crc_run *crc = NULL;
    if (!rc)
        rc = st_crc_run_new(&crc, &c->plan, later);
    if (!rc)
        rc = st_exec_reads(d, &c->plan, o->io_threads, o->flags & STRATA_LOAD_NO_DIRECT, max_io,
                           NULL, NULL, crc, &got);
    if (!rc)
        rc = st_crc_run_end(crc, d);
    if (!rc) {
        *stats = (strata_stats){.data_bytes = d->meta->data_bytes, .bytes = got,
                                .io_calls = c->plan.nios, .plan_cached = cached,
                                .io_threads = st_io_threads(o->io_threads),
                                .max_io_bytes = o->max_io_bytes,
                                .crc_checked = st_crc_run_checked(crc),
                                .crc_bytes = c->plan.crc_bytes, .crc_skipped = skip};
        stats->seconds = st_now() - t0;
    }
    st_crc_run_free(crc);
    free(key.p);
    free(rv);
    return rc;
}

static void ignore_report(void *ctx, const char *o, const char *f, const char *m)
{
    (void)ctx, (void)o, (void)f, (void)m;
}

int strata_ckpt_verify(const strata_ckpt *ck, strata_verify_cb report, void *ctx)
{
    st_clear_error();
    const st_dir *d = st_ckpt_dir(ck);
    if (d->src->verify)
        return d->src->verify(d, report ? report : ignore_report, ctx);
    st_io_plan p;
    int rc = st_plan_verify_all(&p, d->meta, ST_DEFAULT_MAX_IO);
    if (rc)
        return rc;
    rc = st_exec_reads(d, &p, 0, 0, ST_DEFAULT_MAX_IO, report ? report : ignore_report, ctx,
                       NULL, NULL);
    st_io_plan_free(&p);
    return rc;
}
