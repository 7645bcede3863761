/* opts.c - the one place for option defaults and version checks: every public entry
 * copies its options into a full, current-version struct with defaults filled in, and
 * writes its results back through the version the caller gave. */
#include <stddef.h>
#include <string.h>

#include "../core/error.h"
#include "engine.h"

/* Bytes of each version of a struct: the offset of the first field added after it. */
static const size_t save_opts_size[] = {0, offsetof(strata_save_opts, bg_nice),
                                        offsetof(strata_save_opts, base),
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
    if (!out->chunk_bytes)
        out->chunk_bytes = STRATA_DEFAULT_CHUNK;
    return st_check_chunk(out->chunk_bytes);
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
