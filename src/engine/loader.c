/* loader.c - the front door of loads: strata_loader (a checkpoint opened once - the first tier
 * that opens, its index read by one rank and agreed on with one broadcast - and loaded as
 * often as the caller wants, the last plan kept), and strata_load (open + load + free).
 * A loader is used by one thread at a time; with a communicator its open and loads are
 * collectives. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/error.h"
#include "../io/pool.h"
#include "dist.h"

struct strata_loader {
    strata_comm *comm; /* borrowed; NULL: ranks in this process */
    int ntiers, tier;  /* tier: the one open now (-1: none) */
    char uri[ST_MAX_TIERS][PATH_MAX];
    strata_ckpt ck;    /* tier's index: what strata_loader_index hands out */
    st_load_cache cache;
    int crc_later;          /* st_loader_crc_later: loads keep the CRC-32s of parts */
    st_crc_ledger *ledger;  /* of the tier open now */
    uint64_t meta_reads, meta_bcasts;
    char why[2048]; /* the tiers passed over, "uri: reason; ..." */
    size_t nwhy;
};

/* What rank 0 sends when it has opened (or failed to open) a tier: the outcome, and the
 * index (its source's description: for a strata checkpoint its metadata and commit
 * record), inline when it fits, else in a second broadcast. */
typedef struct {
    int32_t tier;    /* the tier opened; -1: none (st: the last failure, why: every one's) */
    uint32_t source; /* st_source_id of the source that opened it */
    uint64_t meta_len;
    st_status st;
    char why[ST_ERR_BYTES];
    unsigned char meta[STRATA_LOADER_INLINE_BYTES];
} open_block;

static void add_why(strata_loader *ld, const char *uri, const char *msg)
{
    if (ld->nwhy >= sizeof ld->why - 1)
        return;
    int k = snprintf(ld->why + ld->nwhy, sizeof ld->why - ld->nwhy, "%s%s: %s",
                     ld->nwhy ? "; " : "", uri, msg);
    if (k > 0)
        ld->nwhy = ST_MIN(sizeof ld->why - 1, ld->nwhy + (size_t)k);
}

/* The error of a loader that has no tier left: the one tier's own, or every tier's. */
static int no_tier_left(strata_loader *ld, int rc)
{
    if (ld->ntiers == 1)
        return rc; /* its message stands */
    return st_fail(rc, "no copy could be loaded: %s", ld->why);
}

static void close_tier(strata_loader *ld)
{
    st_load_cache_clear(&ld->cache); /* a plan of another index */
    st_crc_ledger_free(ld->ledger);   /* checks of another index */
    ld->ledger = NULL;
    if (ld->tier >= 0)
        st_dir_close(&ld->ck.d);
    ld->tier = -1;
}

/* Opens the first tier from `from` on that opens, in this process. */
static int open_local(strata_loader *ld, int from)
{
    int rc = STRATA_ENOENT;
    for (int t = from; t < ld->ntiers; t++) {
        ld->meta_reads++;
        if (!(rc = st_dir_open(&ld->ck.d, ld->uri[t], 0))) {
            ld->tier = t;
            return 0;
        }
        add_why(ld, ld->uri[t], strata_error_last());
    }
    return no_tier_left(ld, rc);
}

/* Rank 0's part of a distributed open: tries the tiers from `from` on into ob; *meta gets
 * the index bytes (ob->meta_len of them). */
static void open_root(strata_loader *ld, int from, open_block *ob, unsigned char **meta)
{
    size_t n0 = ld->nwhy;
    ob->tier = -1;
    for (int t = from; t < ld->ntiers; t++) {
        size_t mlen = 0;
        ld->meta_reads++;
        int rc = st_dir_open_raw(&ld->ck.d, ld->uri[t], 0, meta, &mlen);
        if (!rc) {
            ob->tier = t;
            ob->source = st_source_id(ld->ck.d.src);
            ob->meta_len = mlen;
            memcpy(ob->meta, *meta, ST_MIN(mlen, sizeof ob->meta));
            ld->tier = t;
            return;
        }
        st_status_set(&ob->st, rc, ST_ROOT);
        add_why(ld, ld->uri[t], strata_error_last());
    }
    snprintf(ob->why, sizeof ob->why, "%s", ld->why + n0 + (n0 ? 2 : 0));
}

/* A distributed open, a collective: rank 0 opens the first tier from `from` on that opens
 * and broadcasts the outcome and the index; the others adopt it (no I/O); every rank
 * learns whether all did. */
static int open_dist(strata_loader *ld, int from)
{
    strata_comm *comm = ld->comm;
    const int me = comm->rank;
    open_block *ob = calloc(1, sizeof *ob);
    unsigned char *meta = NULL;
    int rc = 0, all = 0;
    if (!ob)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    if (me == ST_ROOT)
        open_root(ld, from, ob, &meta);
    if ((rc = st_bcast(comm, ob, sizeof *ob, ST_ROOT)))
        goto out;
    ld->meta_bcasts++;
    if (ob->tier < 0) { /* no tier opened: every rank fails with rank 0's reasons */
        if (me != ST_ROOT && ob->why[0] && ld->nwhy < sizeof ld->why - 1) {
            snprintf(ld->why + ld->nwhy, sizeof ld->why - ld->nwhy, "%s%s",
                     ld->nwhy ? "; " : "", ob->why);
            ld->nwhy = strlen(ld->why);
        }
        rc = no_tier_left(ld, st_status_raise(&ob->st, me));
        goto out;
    }
    if (ob->meta_len > sizeof ob->meta) { /* the rest of a large index */
        if (me != ST_ROOT && !(meta = malloc(ob->meta_len))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
            goto out;
        }
        size_t inl = sizeof ob->meta;
        if ((rc = st_bcast(comm, meta + inl, ob->meta_len - inl, ST_ROOT)))
            goto out;
        ld->meta_bcasts++;
        if (me != ST_ROOT)
            memcpy(meta, ob->meta, inl);
    }
    int local = 0;
    if (me != ST_ROOT) {
        const unsigned char *m = meta ? meta : ob->meta;
        local = st_dir_adopt(&ld->ck.d, ld->uri[ob->tier], m, ob->meta_len, ob->source);
        if (!local)
            ld->tier = ob->tier;
    }
    char msg[ST_ERR_BYTES];
    st_err_keep(msg, local);
    if ((rc = st_all_true(comm, local == 0, &all)))
        goto out;
    if (local)
        rc = st_err_restore(local, msg);
    else if (!all)
        rc = st_fail(STRATA_EABORTED, "another rank could not take the index of '%s'",
                     ld->uri[ob->tier]);
out:
    if (rc)
        close_tier(ld);
    free(meta);
    free(ob);
    return rc;
}

static int open_from(strata_loader *ld, int from)
{
    close_tier(ld);
    return ld->comm ? open_dist(ld, from) : open_local(ld, from);
}

int strata_loader_open(strata_loader **out, strata_comm *comm, const char *const *uris, int nuris,
                       const strata_loader_opts *opts)
{
    st_clear_error();
    if (!out)
        return st_fail(STRATA_EINVAL, "strata_loader_open: out is NULL");
    *out = NULL;
    int rc = st_check_where("load", comm, uris, nuris, NULL, -1);
    if (rc)
        return rc;
    if ((rc = st_loader_opts_check(opts)))
        return rc;
    strata_loader *ld = calloc(1, sizeof *ld);
    if (!ld)
        return st_fail(STRATA_ENOMEM, "out of memory");
    ld->comm = comm;
    ld->ntiers = nuris;
    ld->tier = -1;
    for (int t = 0; t < nuris; t++)
        snprintf(ld->uri[t], sizeof ld->uri[t], "%s", uris[t]);
    if ((rc = open_from(ld, 0))) {
        free(ld);
        return rc;
    }
    *out = ld;
    return 0;
}

const strata_ckpt *strata_loader_index(const strata_loader *ld)
{
    return ld->tier >= 0 ? &ld->ck : NULL;
}

int strata_loader_tier(const strata_loader *ld) { return ld->tier; }

void strata_loader_free(strata_loader *ld)
{
    if (!ld)
        return;
    close_tier(ld);
    free(ld);
}

uint32_t st_default_read_bytes(const st_dir *d)
{
    return strcmp(d->vfs->scheme, "file") == 0 ? (uint32_t)st_read_bytes_for(d->path)
                                                : ST_DEFAULT_MAX_IO;
}

/* One load from the tier open now; with a communicator every rank ends with the same
 * outcome (the distributed load's last collective is every rank's status). */
static int load_here(strata_loader *ld, strata_state *const *states, int nstates,
                     const strata_load_opts *o, strata_stats *full)
{
    strata_load_opts eff = *o;
    if (!eff.max_io_bytes)
        eff.max_io_bytes = st_default_read_bytes(&ld->ck.d);
    if (!ld->comm) {
        const st_meta *m = ld->ck.d.meta;
        int rc = ld->crc_later && m->nchecks && !ld->ledger &&
                         !(o->flags & STRATA_LOAD_SKIP_CRC)
                     ? st_crc_ledger_new(&ld->ledger, m) : 0;
        return rc ? rc : st_load_local(&ld->ck.d, &ld->cache, states, nstates, &eff,
                                       o->flags & STRATA_LOAD_SKIP_CRC ? NULL : ld->ledger,
                                       full);
    }
    return st_load_dist(ld->comm, &ld->ck.d, &ld->cache, states[0], &eff, full);
}

/* strata_loader_load with checked options (full) and stats (full; put by the caller). */
static int loader_load(strata_loader *ld, strata_state *const *states, int nstates,
                       const strata_load_opts *o, strata_stats *full)
{
    if (ld->tier < 0) /* a fallback that found no tier left: nothing open */
        return st_fail(STRATA_EINVAL, "strata_loader_load: the loader has no tier left to "
                       "load from (%s)", ld->nwhy ? ld->why : "none opened");
    for (;;) {
        *full = (strata_stats)STRATA_STATS_INIT;
        int rc = load_here(ld, states, nstates, o, full);
        if (rc == 0) {
            full->tier = ld->tier;
            full->meta_reads = ld->meta_reads;
            full->meta_bcasts = ld->meta_bcasts;
            return 0;
        }
        if (ld->ntiers == 1)
            return rc;
        if (ld->comm && ld->comm->broken) /* the ranks can no longer agree on a next tier */
            return st_fail(rc, "%s: %s", ld->uri[ld->tier], strata_error_last());
        /* the destinations may hold a part of this copy: the next one overwrites all */
        add_why(ld, ld->uri[ld->tier], strata_error_last());
        if (ld->tier + 1 >= ld->ntiers) {
            close_tier(ld);
            return no_tier_left(ld, rc);
        }
        if ((rc = open_from(ld, ld->tier + 1)))
            return rc;
    }
}

int st_loader_crc_later(strata_loader *ld)
{
    if (ld->comm)
        return st_fail(STRATA_EINVAL, "a loader with a communicator checks each load's "
                       "entries whole");
    ld->crc_later = 1;
    return 0;
}

int st_loader_crc_finish(strata_loader *ld, uint64_t *checked, uint64_t *bytes)
{
    int rc = ld->ledger && ld->tier >= 0 ? st_crc_ledger_finish(ld->ledger, &ld->ck.d) : 0;
    st_crc_ledger_counts(ld->ledger, checked, bytes);
    return rc;
}

int strata_loader_load(strata_stats *stats, strata_loader *ld, strata_state *const *states,
                       int nstates, const strata_load_opts *opts)
{
    st_clear_error();
    strata_load_opts o;
    strata_stats full;
    int rc = st_stats_check(stats);
    if (!rc && !ld)
        rc = st_fail(STRATA_EINVAL, "strata_loader_load: the loader is NULL");
    if (!rc)
        rc = st_load_opts_get(&o, opts);
    if (!rc)
        rc = st_check_states("load", ld->comm, states, nstates);
    if (!rc && !(rc = loader_load(ld, states, nstates, &o, &full)))
        st_stats_put(stats, &full);
    return rc;
}

int strata_load(strata_stats *stats, strata_comm *comm, const char *const *uris, int nuris,
                strata_state *const *states, int nstates, const strata_load_opts *opts)
{
    st_clear_error();
    strata_load_opts o;
    strata_stats full;
    strata_loader *ld = NULL;
    int rc = st_stats_check(stats);
    if (!rc)
        rc = st_load_opts_get(&o, opts);
    if (!rc)
        rc = st_check_where("load", comm, uris, nuris, states, nstates);
    if (!rc)
        rc = strata_loader_open(&ld, comm, uris, nuris, NULL);
    if (!rc && !(rc = loader_load(ld, states, nstates, &o, &full)))
        st_stats_put(stats, &full);
    strata_loader_free(ld);
    return rc;
}
