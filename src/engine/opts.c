/* opts.c - the one place for option defaults and version checks: every public entry
 * copies its options into a full, current-version struct with defaults filled in, and
 * writes its results back through the version the caller gave. */
#include <limits.h>
#include <stddef.h>
#include <string.h>

#include "../core/error.h"
#include "engine.h"

/* Bytes of each version of a struct: the offset of the first field added after it. */
static const size_t save_opts_size[] = {0, offsetof(strata_save_opts, bg_nice),
                                        offsetof(strata_save_opts, base),
                                        offsetof(strata_save_opts, peer_replicas),
                                        sizeof(strata_save_opts)};
static const size_t load_opts_size[] = {0, sizeof(strata_load_opts)};
static const size_t stats_size[] = {0, offsetof(strata_stats, io_threads),
                                     offsetof(strata_stats, meta_reads),
                                     offsetof(strata_stats, crc_checked), sizeof(strata_stats)};

static int check_version(int v, int current, const char *what)
{
    if (v < 1 || v > current)
        return st_fail(STRATA_EINVAL, "%s.version %d is not one of 1..%d", what, v, current);
    return 0;
}

int st_save_opts_get(strata_save_opts *out, const strata_save_opts *in)
{
    *out = (strata_save_opts)STRATA_SAVE_OPTS_INIT;
    if (in) {
        int rc = check_version(in->version, STRATA_SAVE_OPTS_VERSION, "strata_save_opts");
        if (rc)
            return rc;
        memcpy(out, in, save_opts_size[in->version]);
        out->version = STRATA_SAVE_OPTS_VERSION;
    }
    const unsigned known = STRATA_SAVE_NO_SYNC | STRATA_SAVE_NO_DIRECT | STRATA_SAVE_REPLACE |
                           STRATA_SAVE_INCREMENTAL;
    if (out->flags & ~known)
        return st_fail(STRATA_EINVAL, "strata_save_opts.flags 0x%x has unknown bits", out->flags);
    if (out->peer_replicas < 0 || out->peer_k < 0 || out->peer_m < 0 ||
        !out->peer_k != !out->peer_m || (out->peer_replicas && out->peer_k))
        return st_fail(STRATA_EINVAL, "strata_save_opts: peer_replicas %d, peer_k %d, peer_m %d "
                       "(replicas, or k and m both > 0, not both)", out->peer_replicas,
                       out->peer_k, out->peer_m);
    if (!out->chunk_bytes)
        out->chunk_bytes = STRATA_DEFAULT_CHUNK;
    return st_check_chunk(out->chunk_bytes);
}

int st_check_chunk(uint32_t chunk)
{
    if (chunk < 4096 || chunk > (64u << 20) || (chunk & (chunk - 1)))
        return st_fail(STRATA_EINVAL, "chunk_bytes %u is not a power of two in 4 KiB..64 MiB",
                       chunk);
    return 0;
}

int st_loader_opts_check(const strata_loader_opts *o)
{
    if (!o)
        return 0;
    int rc = check_version(o->version, STRATA_LOADER_OPTS_VERSION, "strata_loader_opts");
    if (!rc && o->flags)
        rc = st_fail(STRATA_EINVAL, "strata_loader_opts.flags 0x%x has unknown bits", o->flags);
    return rc;
}

/* The checks every save and load shares: destinations, and ranks (states NULL with
 * nstates -1: not checked, for an open). */
int st_check_peer(const strata_save_opts *o, const strata_comm *comm)
{
    if ((o->peer_replicas || o->peer_k) && !comm)
        return st_fail(STRATA_EINVAL, "peer replicas need a saver with a communicator");
    return 0;
}

int st_check_where(const char *what, strata_comm *comm, const char *const *uris, int nuris,
                   strata_state *const *states, int nstates)
{
    if (!uris || nuris < 1 || nuris > ST_MAX_TIERS)
        return st_fail(STRATA_EINVAL, "a %s needs 1 to %d URIs (got %d)", what, ST_MAX_TIERS,
                       uris ? nuris : 0);
    for (int t = 0; t < nuris; t++)
        if (!uris[t] || !uris[t][0] || strlen(uris[t]) >= PATH_MAX)
            return st_fail(STRATA_EINVAL, "%s: URI %d is missing, empty or too long", what, t);
    return nstates == -1 && !states ? 0 : st_check_states(what, comm, states, nstates);
}

int st_check_states(const char *what, strata_comm *comm, strata_state *const *states,
                    int nstates)
{
    if (!states || nstates < 1)
        return st_fail(STRATA_EINVAL, "a %s needs at least one rank state", what);
    if (comm && nstates != 1)
        return st_fail(STRATA_EINVAL, "with a communicator a %s takes this rank's one state, "
                       "not %d", what, nstates);
    for (int r = 0; r < nstates; r++)
        if (!states[r])
            return st_fail(STRATA_EINVAL, "state of rank %d is NULL", r);
    return 0;
}

int st_load_opts_get(strata_load_opts *out, const strata_load_opts *in)
{
    *out = (strata_load_opts)STRATA_LOAD_OPTS_INIT;
    if (in) {
        int rc = check_version(in->version, STRATA_LOAD_OPTS_VERSION, "strata_load_opts");
        if (rc)
            return rc;
        memcpy(out, in, load_opts_size[in->version]);
        out->version = STRATA_LOAD_OPTS_VERSION;
    }
    if (out->flags & ~(unsigned)(STRATA_LOAD_NO_DIRECT | STRATA_LOAD_CAST | STRATA_LOAD_WIDEN |
                                 STRATA_LOAD_SKIP_CRC))
        return st_fail(STRATA_EINVAL, "strata_load_opts.flags 0x%x has unknown bits", out->flags);
    return 0; /* max_io_bytes 0: the loader's st_default_read_bytes, for the tier it loads */
}

int st_cast_level(unsigned flags)
{
    return flags & STRATA_LOAD_CAST    ? ST_CAST_ANY
           : flags & STRATA_LOAD_WIDEN ? ST_CAST_EXACT
                                       : ST_CAST_NONE;
}

int strata_load_converts(strata_dtype saved, strata_dtype requested, unsigned flags)
{
    return st_cast_allows(st_cast_level(flags), saved, requested);
}

int st_stats_check(const strata_stats *s)
{
    return s ? check_version(s->version, STRATA_STATS_VERSION, "strata_stats") : 0;
}

void st_stats_put(strata_stats *out, const strata_stats *full)
{
    if (!out || out->version < 1 || out->version > STRATA_STATS_VERSION)
        return;
    int v = out->version;
    memcpy(out, full, stats_size[v]);
    out->version = v;
}
