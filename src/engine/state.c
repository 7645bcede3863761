/* state.c - a rank's registered shards and blobs (strata_state). */
#include <stdlib.h>

#include "../core/error.h"
#include "../core/geom.h"
#include "../core/utf8.h"
#include "../io/cuda.h"
#include "engine.h"

int strata_state_new(strata_state **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? 0 : st_fail(STRATA_ENOMEM, "out of memory");
}

void strata_state_free(strata_state *st)
{
    if (!st)
        return;
    st_arena_free(&st->names);
    free(st->sh);
    free(st->bl);
    free(st);
}

/* name for a message: printable ASCII as is, every other byte as \xNN; cut with "..." to
 * fit out (so that the message itself stays valid UTF-8). */
static void escape_name(char *out, size_t cap, const char *name)
{
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        if (o + 8 >= cap) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (*p >= 0x20 && *p < 0x7f && *p != '\\')
            out[o++] = (char)*p;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", *p);
    }
    out[o] = 0;
}

static int check_name(const char *name, const char *what)
{
    if (!name || !*name)
        return st_fail(STRATA_EINVAL, "%s name is empty", what);
    size_t n = strlen(name), bad;
    if (n > STRATA_MAX_NAME)
        return st_fail(STRATA_EINVAL, "%s name is longer than %d bytes", what, STRATA_MAX_NAME);
    if ((bad = st_utf8_invalid_at(name, n)) < n) {
        char shown[200];
        escape_name(shown, sizeof shown, name);
        return st_fail(STRATA_EINVAL,
                       "%s name \"%s\" is not valid UTF-8 (byte 0x%02x at offset %zu); names "
                       "must be UTF-8",
                       what, shown, (unsigned char)name[bad], bad);
    }
    return 0;
}

/* Validates and normalises a shard description into e (name not copied). */
static int normalise(st_entry *e, const strata_shard *s)
{
    int rc = check_name(s->name, "tensor");
    if (rc)
        return rc;
    size_t esz = strata_dtype_size(s->dtype);
    if (!esz)
        return st_fail(STRATA_EINVAL, "tensor '%s': unknown dtype %d", s->name, (int)s->dtype);
    if (s->ndim < 0 || s->ndim > STRATA_MAX_DIMS)
        return st_fail(STRATA_EINVAL, "tensor '%s': ndim %d is outside 0..%d", s->name, s->ndim,
                       STRATA_MAX_DIMS);
    if (s->ndim > 0 && !s->global_shape)
        return st_fail(STRATA_EINVAL, "tensor '%s': global_shape is NULL", s->name);
    memset(e, 0, sizeof *e);
    e->dtype = s->dtype;
    e->ndim = s->ndim;
    for (int d = 0; d < s->ndim; d++) {
        e->shape[d] = s->global_shape[d];
        e->off[d] = s->offsets ? s->offsets[d] : 0;
        e->len[d] = s->lengths ? s->lengths[d] : e->shape[d];
        if (e->off[d] > e->shape[d] || e->len[d] > e->shape[d] - e->off[d])
            return st_fail(STRATA_EINVAL,
                           "tensor '%s': dim %d: offset %llu + length %llu exceeds the global "
                           "size %llu",
                           s->name, d, (unsigned long long)e->off[d],
                           (unsigned long long)e->len[d], (unsigned long long)e->shape[d]);
    }
    int of = 0;
    uint64_t total = st_box_numel(e->ndim, e->shape, &of), tb;
    if (of || !st_mul_ok(total, esz, &tb) || tb > (UINT64_MAX >> 2))
        return st_fail(STRATA_EINVAL, "tensor '%s': global shape times element size overflows",
                       s->name);
    uint64_t n = st_box_numel(e->ndim, e->len, NULL);
    e->fs = 0;
    e->fe = n;
    if (s->flat) {
        if (s->flat_start > s->flat_end || s->flat_end > n)
            return st_fail(STRATA_EINVAL,
                           "tensor '%s': flat range [%llu, %llu) is outside the box of %llu "
                           "elements",
                           s->name, (unsigned long long)s->flat_start,
                           (unsigned long long)s->flat_end, (unsigned long long)n);
        e->fs = s->flat_start;
        e->fe = s->flat_end;
    }
    e->bytes = (e->fe - e->fs) * esz;
    e->data = s->data;
    e->device = s->device != 0;
    const unsigned known = STRATA_SHARD_UNCHANGED | STRATA_SHARD_REPLICA;
    if (s->flags & ~known)
        return st_fail(STRATA_EINVAL, "tensor '%s': unknown shard flags 0x%x", s->name,
                       s->flags & ~known);
    e->unchanged = (s->flags & STRATA_SHARD_UNCHANGED) != 0;
    e->replica = (s->flags & STRATA_SHARD_REPLICA) != 0;
    if (e->device && e->bytes) {
        int rc = st_cuda_check();
        if (rc)
            return st_wrap(rc, "tensor '%s'", s->name);
    }
    if (e->bytes && !e->data)
        return st_fail(STRATA_EINVAL, "tensor '%s': data is NULL", s->name);
    return 0;
}

uint64_t strata_shard_numel(const strata_shard *s)
{
    st_entry e;
    return normalise(&e, s) ? 0 : e.fe - e.fs;
}

int strata_state_add_shard(strata_state *st, const strata_shard *s)
{
    if (!st || !s)
        return st_fail(STRATA_EINVAL, "NULL state or shard");
    st_entry e;
    int rc = normalise(&e, s);
    if (rc)
        return rc;
    if (st_grow(&st->sh, &st->capsh, st->nsh + 1, sizeof *st->sh))
        return st_fail(STRATA_ENOMEM, "out of memory");
    e.name = st_arena_strndup(&st->names, s->name, strlen(s->name));
    if (!e.name)
        return st_fail(STRATA_ENOMEM, "out of memory");
    st->sh[st->nsh++] = e;
    return 0;
}

int strata_state_add_blob(strata_state *st, const char *name, unsigned flags, int owner,
                          void *data, uint64_t size)
{
    if (!st)
        return st_fail(STRATA_EINVAL, "NULL state");
    if (flags & ~(unsigned)STRATA_BLOB_RANK_LOCAL)
        return st_fail(STRATA_EINVAL, "blob: unknown flags 0x%x", flags);
    int rc = check_name(name, "blob");
    if (rc)
        return rc;
    if (size && !data)
        return st_fail(STRATA_EINVAL, "blob '%s': data is NULL", name);
    if (owner < -1)
        return st_fail(STRATA_EINVAL, "blob '%s': owner %d is not a rank or -1", name, owner);
    if (st_grow(&st->bl, &st->capbl, st->nbl + 1, sizeof *st->bl))
        return st_fail(STRATA_ENOMEM, "out of memory");
    const char *n = st_arena_strndup(&st->names, name, strlen(name));
    if (!n)
        return st_fail(STRATA_ENOMEM, "out of memory");
    st->bl[st->nbl++] = (st_blobent){n, (flags & STRATA_BLOB_RANK_LOCAL) != 0, owner, data, size};
    return 0;
}
