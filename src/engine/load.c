/* load.c - strata_load (any saved layout into any requested layout) and
 * strata_ckpt_verify (every chunk of every extent). */
#include <stdlib.h>

#include "../core/error.h"
#include "engine.h"

#define LOAD_MAX_IO (16u << 20)


int strata_load(const char *uri, strata_state *const *ranks, int nranks,
                const strata_load_opts *opts, strata_stats *stats)
{
    strata_load_opts def = STRATA_LOAD_OPTS_INIT;
    if (!opts)
        opts = &def;
    if (opts->version != STRATA_LOAD_OPTS_VERSION)
        return st_fail(STRATA_EINVAL, "strata_load_opts.version %d is not %d", opts->version,
                       STRATA_LOAD_OPTS_VERSION);
    if (nranks < 1 || !ranks)
        return st_fail(STRATA_EINVAL, "load needs at least one rank state");
    st_clear_error();
    double t0 = st_now();
    uint64_t max_io = opts->max_io_bytes ? opts->max_io_bytes : LOAD_MAX_IO;
    st_rank_view *rv = calloc((size_t)nranks, sizeof *rv);
    if (!rv)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (int r = 0; r < nranks; r++) {
        if (!ranks[r]) {
            free(rv);
            return st_fail(STRATA_EINVAL, "state of rank %d is NULL", r);
        }
        rv[r] = (st_rank_view){ranks[r]->sh, ranks[r]->nsh, ranks[r]->bl, ranks[r]->nbl};
    }
    st_dir d;
    int rc = st_dir_open(&d, uri, 0);
    if (rc) {
        free(rv);
        return rc;
    }
    st_load_plan p;
    rc = st_plan_load(&p, d.meta, rv, nranks, max_io);
    uint64_t got = 0;
    if (!rc) {
        rc = st_exec_reads(&d, &p, opts->io_threads, opts->no_direct, max_io, NULL, NULL, &got);
        if (!rc && stats) {
            *stats = (strata_stats){.data_bytes = d.meta->data_bytes, .bytes = got,
                                    .io_calls = p.nreads};
            stats->seconds = st_now() - t0;
        }
        st_load_plan_free(&p);
    }
    free(rv);
    st_dir_close(&d);
    return rc;
}

int strata_load_tiers(const char *const *uris, int ntiers, strata_state *const *ranks,
                      int nranks, const strata_load_opts *opts, strata_stats *stats,
                      int *used)
{
    if (ntiers < 1 || !uris)
        return st_fail(STRATA_EINVAL, "a load needs at least one source");
    char why[2048] = "";
    size_t n = 0;
    int rc = 0;
    for (int t = 0; t < ntiers; t++) {
        rc = strata_load(uris[t], ranks, nranks, opts, stats);
        if (rc == 0) {
            if (used)
                *used = t;
            return 0;
        }
        /* the destinations may hold a part of this copy: the next one overwrites all */
        int k = snprintf(why + n, sizeof why - n, "%s%s: %s", t ? "; " : "", uris[t],
                         strata_error_last());
        if (k > 0)
            n = ST_MIN(sizeof why - 1, n + (size_t)k);
    }
    return st_fail(rc, "no copy could be loaded: %s", why);
}

static void ignore_report(void *ctx, const char *o, const char *f, const char *m)
{
    (void)ctx, (void)o, (void)f, (void)m;
}

int strata_ckpt_verify(const strata_ckpt *ck, strata_verify_cb report, void *ctx)
{
    st_clear_error();
    const st_dir *d = st_ckpt_dir(ck);
    st_load_plan p;
    int rc = st_plan_verify_all(&p, d->meta, LOAD_MAX_IO);
    if (rc)
        return rc;
    rc = st_exec_reads(d, &p, 0, 0, LOAD_MAX_IO, report ? report : ignore_report, ctx, NULL);
    st_load_plan_free(&p);
    return rc;
}
