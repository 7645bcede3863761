/* load.c - loading ranks in this process from one source (any saved layout into any
 * requested layout), and strata_ckpt_verify (every chunk of every extent). */
#include <stdlib.h>

#include "../core/error.h"
#include "../io/pool.h"
#include "engine.h"
#include "source.h"


int st_load_local(const char *uri, strata_state *const *ranks, int nranks,
                  const strata_load_opts *o, strata_stats *stats)
{
    double t0 = st_now();
    uint64_t max_io = o->max_io_bytes;
    st_rank_view *rv = calloc((size_t)nranks, sizeof *rv);
    if (!rv)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < nranks; r++) {
        rv[r] = st_state_view(ranks[r]);
        rv[r].cast = (o->flags & STRATA_LOAD_CAST) != 0;
    }
    st_dir d;
    int rc = st_dir_open(&d, uri, 0);
    if (rc) {
        free(rv);
        return rc;
    }
    st_io_plan p;
    rc = st_plan_load(&p, d.meta, rv, nranks, max_io);
    uint64_t got = 0;
    if (!rc) {
        rc = st_exec_reads(&d, &p, o->io_threads, o->flags & STRATA_LOAD_NO_DIRECT, max_io, NULL,
                           NULL, &got);
        if (!rc) {
            *stats = (strata_stats){.data_bytes = d.meta->data_bytes, .bytes = got,
                                    .io_calls = p.nios, .io_threads = st_io_threads(o->io_threads),
                                    .max_io_bytes = o->max_io_bytes};
            stats->seconds = st_now() - t0;
        }
        st_io_plan_free(&p);
    }
    free(rv);
    st_dir_close(&d);
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
    if (d->src && d->src->verify)
        return d->src->verify(d, report ? report : ignore_report, ctx);
    st_io_plan p;
    int rc = st_plan_verify_all(&p, d->meta, ST_DEFAULT_MAX_IO);
    if (rc)
        return rc;
    rc = st_exec_reads(d, &p, 0, 0, ST_DEFAULT_MAX_IO, report ? report : ignore_report, ctx, NULL);
    st_io_plan_free(&p);
    return rc;
}
