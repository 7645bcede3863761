/* meta.c - encoder and validating decoder of the metadata file and the commit record. */
#include "meta.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/geom.h"
#include "../core/overlap.h"
#include "checks.h"

/* ---- encoding ---- */

static void put_extent(st_buf *b, const st_extent *e, uint32_t chunk, int with_bytes,
                       int foreign, int sums2)
{
    st_buf_var(b, e->file);
    st_buf_var(b, foreign ? e->offset : e->offset / ST_ALIGN);
    if (with_bytes)
        st_buf_var(b, e->bytes);
    if (foreign) /* no checksums */
        return;
    uint64_t n = st_nchunks(e->bytes, chunk);
    for (uint64_t i = 0; i < n; i++)
        st_buf_u64(b, e->sums[i]);
    for (uint64_t i = 0; sums2 && i < n; i++)
        st_buf_u64(b, e->sums[n + i]);
}

int st_meta_encode(const st_meta *m, unsigned char **out, size_t *len)
{
    st_buf b = {0};
    const int v2 = !m->foreign && m->version == ST_META_VERSION_INCR;
    st_buf_put(&b, ST_META_MAGIC, 8);
    st_buf_u32(&b, v2 ? ST_META_VERSION_INCR : ST_META_VERSION);
    st_buf_u32(&b, m->foreign ? ST_META_FOREIGN : 0);
    st_buf_u64(&b, 0); /* body length, patched below */
    st_buf_u64(&b, m->step);
    st_buf_var(&b, m->chunk);
    if (v2) { /* the base */
        st_buf_u8(&b, m->base != NULL);
        if (m->base) {
            st_buf_str(&b, m->base);
            st_buf_u64(&b, m->base_id);
        }
    }
    st_buf_var(&b, m->nfiles);
    for (uint32_t i = 0; i < m->nfiles; i++) {
        st_buf_str(&b, m->files[i].name);
        st_buf_var(&b, m->files[i].bytes);
        if (v2)
            st_buf_u8(&b, (uint8_t)st_file_linked(m, i));
    }
    if (m->foreign) { /* each file's identity, when the source took it */
        st_buf_u8(&b, m->idents != NULL);
        for (uint32_t i = 0; m->idents && i < m->nfiles; i++) {
            st_buf_var(&b, m->idents[i].ino);
            st_buf_var(&b, m->idents[i].mtime_ns);
            st_buf_var(&b, m->idents[i].ctime_ns);
        }
        st_checks_put(&b, m); /* the ranges its format checks */
    }
    st_buf_var(&b, m->ntensors);
    for (size_t i = 0; i < m->ntensors; i++) {
        const st_mtensor *t = &m->tensors[i];
        st_buf_str(&b, t->name);
        st_buf_u8(&b, (uint8_t)t->dtype);
        st_buf_u8(&b, (uint8_t)t->ndim);
        for (int d = 0; d < t->ndim; d++)
            st_buf_var(&b, t->shape[d]);
        st_buf_var(&b, t->nshards);
        for (size_t s = 0; s < t->nshards; s++) {
            const st_mshard *sh = &t->shards[s];
            st_buf_u8(&b, (uint8_t)((sh->flat ? 1 : 0) | (v2 && sh->has2 ? 2 : 0)));
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->off[d]);
            for (int d = 0; d < t->ndim; d++)
                st_buf_var(&b, sh->len[d]);
            if (sh->flat) {
                st_buf_var(&b, sh->fs);
                st_buf_var(&b, sh->fe - sh->fs);
            }
            put_extent(&b, &sh->ext, m->chunk, 0, m->foreign, v2 && sh->has2);
        }
    }
    st_buf_var(&b, m->nblobs);
    for (size_t i = 0; i < m->nblobs; i++) {
        st_buf_str(&b, m->blobs[i].name);
        st_buf_var(&b, (uint64_t)(m->blobs[i].owner + 1));
        put_extent(&b, &m->blobs[i].ext, m->chunk, 1, m->foreign, 0);
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory encoding metadata");
    }
    uint64_t body = b.n - ST_META_HEADER;
    for (int i = 0; i < 8; i++)
        b.p[16 + i] = (unsigned char)(body >> (8 * i));
    st_buf_u64(&b, st_hash(b.p, b.n));
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory encoding metadata");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

/* ---- decoding ---- */

static char *rd_str(st_rd *r, st_arena *a, int plain)
{
    char *s = st_rd_str(r, a, STRATA_MAX_NAME);
    if (s && plain && !st_plain_name(s, strlen(s))) {
        st_rd_fail(r, "file name is not a plain name inside the checkpoint directory");
        return NULL;
    }
    return s;
}

int st_plain_name(const char *name, size_t len)
{
    if (len == 0 || (len == 1 && name[0] == '.') || (len == 2 && name[0] == '.' && name[1] == '.'))
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        if (c == '/' || c == '\\' || c < 0x20 || c == 0x7f)
            return 0;
    }
    return 1;
}

static void rd_extent(st_rd *r, st_meta *m, st_extent *e, uint64_t bytes, int with_bytes,
                      int sums2)
{
    uint64_t file = st_rd_var(r); /* checked before narrowing: 2^32 must not alias file 0 */
    uint64_t blk = st_rd_var(r);
    if (with_bytes)
        bytes = st_rd_var(r);
    if (r->err)
        return;
    if (file >= m->nfiles) {
        st_rd_fail(r, "extent names a file index out of range");
        return;
    }
    e->file = (uint32_t)file;
    if (!m->foreign && blk > UINT64_MAX / ST_ALIGN) {
        st_rd_fail(r, "extent offset overflows");
        return;
    }
    e->offset = m->foreign ? blk : blk * ST_ALIGN;
    e->bytes = bytes;
    /* shards always hold bytes (their boxes and ranges are non-empty); a blob may be empty */
    if ((bytes == 0 && !with_bytes) || e->offset > m->files[e->file].bytes ||
        bytes > m->files[e->file].bytes - e->offset) {
        st_rd_fail(r, "extent lies outside its data file");
        return;
    }
    e->sums = NULL;
    if (m->foreign) /* no checksums */
        return;
    uint64_t n = st_nchunks(bytes, m->chunk);
    if (n > st_rd_left(r) / (sums2 ? 16 : 8)) {
        st_rd_fail(r, "truncated checksum list");
        return;
    }
    e->sums = st_arena_alloc(&m->arena, n * (sums2 ? 16 : 8));
    if (!e->sums) {
        st_rd_fail(r, "out of memory");
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        e->sums[i] = st_rd_u64(r);
    for (uint64_t i = 0; sums2 && i < n; i++)
        e->sums[n + i] = st_rd_u64(r);
}

/* The body's head: the checksum chunk and (an incremental save's) base. */
static int rd_head(st_rd *r, st_meta *m)
{
    uint64_t chunk = st_rd_var(r);
    if (r->err || (m->foreign ? chunk != 1
                              : chunk < 4096 || chunk > (64u << 20) || (chunk & (chunk - 1))))
        return st_rd_fail(r, "bad checksum chunk size"), -1;
    m->chunk = (uint32_t)chunk;
    if (m->version != ST_META_VERSION_INCR)
        return 0;
    uint8_t has = st_rd_u8(r);
    if (!r->err && has > 1)
        return st_rd_fail(r, "bad base flag"), -1;
    if (has) {
        m->base = rd_str(r, &m->arena, 1);
        m->base_id = st_rd_u64(r);
        if (!r->err && !m->base_id)
            return st_rd_fail(r, "base save id is 0"), -1;
    }
    return r->err ? -1 : 0;
}

/* The file table; a foreign index's file identities and check units after it. */
static int rd_files(st_rd *r, st_meta *m)
{
    const int v2 = m->version == ST_META_VERSION_INCR;
    uint64_t nf = st_rd_count(r, 2, "file count exceeds the metadata size");
    if (r->err || nf > UINT32_MAX)
        return st_rd_fail(r, "bad file count"), -1;
    m->nfiles = (uint32_t)nf;
    m->files = st_arena_alloc(&m->arena, (nf ? nf : 1) * sizeof *m->files);
    if (v2)
        m->linked = st_arena_alloc(&m->arena, nf ? nf : 1);
    if (!m->files || (v2 && !m->linked))
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nf && !r->err; i++) {
        m->files[i].name = rd_str(r, &m->arena, 1);
        m->files[i].bytes = st_rd_var(r);
        if (v2) {
            uint8_t l = st_rd_u8(r);
            if (!r->err && (l > 1 || (l && !m->base)))
                st_rd_fail(r, l > 1 ? "bad file origin" : "a linked file without a base");
            m->linked[i] = l;
        }
    }
    if (!m->foreign || r->err)
        return r->err ? -1 : 0;
    uint8_t has = st_rd_u8(r);
    if (has > 1)
        return st_rd_fail(r, "bad file identity flag"), -1;
    if (has && !(m->idents = st_arena_alloc(&m->arena, (nf ? nf : 1) * sizeof *m->idents)))
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; has && i < nf && !r->err; i++) {
        m->idents[i].ino = st_rd_var(r);
        m->idents[i].mtime_ns = st_rd_var(r);
        m->idents[i].ctime_ns = st_rd_var(r);
    }
    return r->err || st_checks_read(r, m) ? -1 : 0;
}

/* Shard sh of tensor t: flags, box, flat range, extent. */
static int rd_shard(st_rd *r, st_meta *m, st_mtensor *t, st_mshard *sh)
{
    uint8_t fl = st_rd_u8(r);
    if (fl > (m->version == ST_META_VERSION_INCR ? 3 : 1))
        return st_rd_fail(r, "unknown shard flags"), -1;
    sh->flat = fl & 1;
    sh->has2 = fl >> 1;
    for (int d = 0; d < t->ndim; d++)
        sh->off[d] = st_rd_var(r);
    for (int d = 0; d < t->ndim; d++)
        sh->len[d] = st_rd_var(r);
    if (r->err)
        return -1;
    for (int d = 0; d < t->ndim; d++)
        if (sh->len[d] == 0 || sh->off[d] > t->shape[d] || sh->len[d] > t->shape[d] - sh->off[d])
            return st_rd_fail(r, "shard box outside the tensor"), -1;
    uint64_t bn = st_box_numel(t->ndim, sh->len, NULL);
    sh->fs = 0;
    sh->fe = bn;
    if (sh->flat) {
        uint64_t fs = st_rd_var(r), n = st_rd_var(r);
        if (r->err || n == 0 || fs > bn || n > bn - fs)
            return st_rd_fail(r, "flat range outside the shard box"), -1;
        sh->fs = fs;
        sh->fe = fs + n;
    }
    rd_extent(r, m, &sh->ext, (sh->fe - sh->fs) * strata_dtype_size(t->dtype), 0, sh->has2);
    t->bytes += sh->ext.bytes;
    return r->err ? -1 : 0;
}

/* Tensor t: name, dtype, shape, then its shards. */
static int rd_tensor(st_rd *r, st_meta *m, st_mtensor *t)
{
    memset(t, 0, sizeof *t);
    t->name = rd_str(r, &m->arena, 0);
    t->dtype = (strata_dtype)st_rd_u8(r);
    t->ndim = st_rd_u8(r);
    if (r->err)
        return -1;
    if ((unsigned)t->dtype >= STRATA_DTYPE_COUNT)
        return st_rd_fail(r, "unknown dtype"), -1;
    if (t->ndim > STRATA_MAX_DIMS)
        return st_rd_fail(r, "too many dims"), -1;
    int of = 0;
    for (int d = 0; d < t->ndim; d++)
        t->shape[d] = st_rd_var(r);
    uint64_t numel = st_box_numel(t->ndim, t->shape, &of), tb;
    if (!r->err && (of || !st_mul_ok(numel, strata_dtype_size(t->dtype), &tb) ||
                    tb > (UINT64_MAX >> 2)))
        return st_rd_fail(r, "tensor size overflows"), -1;
    size_t min_shard = 1 + 2 * (size_t)t->ndim + 2 + (m->foreign ? 0 : 8); /* sums */
    t->nshards = st_rd_count(r, min_shard, "shard count exceeds the metadata size");
    if (r->err)
        return -1;
    t->shards = st_arena_alloc(&m->arena, (t->nshards ? t->nshards : 1) * sizeof *t->shards);
    uint64_t *dims = st_arena_alloc(&m->arena, (t->nshards * 2 * (size_t)t->ndim + 1) * 8);
    if (!t->shards || !dims)
        return st_rd_fail(r, "out of memory"), -1;
    for (size_t s = 0; s < t->nshards; s++) {
        st_mshard *sh = &t->shards[s];
        sh->off = dims + s * 2 * (size_t)t->ndim;
        sh->len = sh->off + t->ndim;
        if (rd_shard(r, m, t, sh))
            return -1;
    }
    m->data_bytes += t->bytes;
    return 0;
}

static int rd_blobs(st_rd *r, st_meta *m)
{
    uint64_t nb = st_rd_count(r, 4, "blob count exceeds the metadata size");
    if (r->err)
        return -1;
    m->nblobs = nb;
    m->blobs = st_arena_alloc(&m->arena, (nb ? nb : 1) * sizeof *m->blobs);
    if (!m->blobs)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nb && !r->err; i++) {
        st_mblob *b = &m->blobs[i];
        b->name = rd_str(r, &m->arena, 0);
        uint64_t o = st_rd_var(r);
        if (!r->err && o > INT32_MAX)
            st_rd_fail(r, "bad blob owner");
        b->owner = (int64_t)o - 1;
        rd_extent(r, m, &b->ext, 0, 1, 0);
        m->data_bytes += b->ext.bytes;
    }
    return r->err ? -1 : 0;
}

/* The body after the header: head, files, tensors, blobs, nothing after. */
static int decode_body(st_rd *r, st_meta *m)
{
    if (rd_head(r, m) || rd_files(r, m))
        return -1;
    uint64_t nt = st_rd_count(r, 4, "tensor count exceeds the metadata size");
    if (r->err)
        return -1;
    m->ntensors = nt;
    m->tensors = st_arena_alloc(&m->arena, (nt ? nt : 1) * sizeof *m->tensors);
    if (!m->tensors)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < nt; i++)
        if (rd_tensor(r, m, &m->tensors[i]))
            return -1;
    if (rd_blobs(r, m))
        return -1;
    if (r->p != r->end)
        st_rd_fail(r, "trailing bytes after the blob table");
    return r->err ? -1 : 0;
}

/* Names must be unique: tensors by name, blobs by (name, owner). Sort-free check with an
 * open-addressing table of indices. */
/* Item i of the names that must be unique: tensors (kind -2), blobs (kind = owner, so
 * unique per owner), files (kind -3). */
static const char *unique_item(const st_meta *m, size_t i, int64_t *kind)
{
    if (i < m->ntensors) {
        *kind = -2;
        return m->tensors[i].name;
    }
    i -= m->ntensors;
    if (i < m->nblobs) {
        *kind = m->blobs[i].owner;
        return m->blobs[i].name;
    }
    *kind = -3;
    return m->files[i - m->nblobs].name;
}

/* Names must be unique: one hash set over all of them (linear time). */
static int check_unique(st_meta *m, char *why, size_t whylen)
{
    size_t n = m->ntensors + m->nblobs + m->nfiles, cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    size_t *tab = malloc(cap * sizeof *tab);
    if (!tab)
        return STRATA_ENOMEM;
    for (size_t i = 0; i < cap; i++)
        tab[i] = SIZE_MAX;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        int64_t kind, jk;
        const char *name = unique_item(m, i, &kind);
        size_t h = (size_t)(st_strhash(name) ^ st_mix64((uint64_t)kind)) & (cap - 1);
        while (tab[h] != SIZE_MAX) {
            const char *jn = unique_item(m, tab[h], &jk);
            if (jk == kind && strcmp(jn, name) == 0) {
                snprintf(why, whylen, "duplicate %s name '%s'",
                         kind == -2 ? "tensor" : kind == -3 ? "file" : "blob", name);
                rc = STRATA_EFORMAT;
                break;
            }
            h = (h + 1) & (cap - 1);
        }
        tab[h] = i;
    }
    free(tab);
    return rc;
}

/* ---- the overlap check: the search is core's (overlap.h) ---- */

int st_meta_check_overlap(const st_mtensor *t)
{
    size_t n = t->nshards, a, b;
    if (n < 2)
        return st_overlap_find(NULL, 0, &a, &b); /* none; the work counter reset */
    st_region *r = malloc(n * sizeof *r);
    if (!r)
        return st_fail(STRATA_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        r[i] = (st_region){t->ndim, t->shards[i].off, t->shards[i].len, t->shards[i].fs,
                           t->shards[i].fe};
    int found = st_overlap_find(r, n, &a, &b);
    free(r);
    if (found < 0)
        return st_fail(STRATA_ENOMEM, "tensor '%s': out of memory checking its shards for "
                       "overlap", t->name);
    return found ? st_fail(STRATA_EOVERLAP, "tensor '%s': shards %zu and %zu overlap", t->name,
                           a, b)
                 : 0;
}

static int check_header(const unsigned char *buf, size_t len, uint32_t flags)
{
    if (len < ST_META_HEADER + ST_META_TRAILER)
        return st_fail(STRATA_EFORMAT, "metadata is truncated (%zu bytes)", len);
    if (memcmp(buf, ST_META_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "metadata has a bad magic number");
    uint32_t ver = st_get_u32(buf + 8);
    if (ver != ST_META_VERSION && !(ver == ST_META_VERSION_INCR && !flags))
        return st_fail(STRATA_EFORMAT, "metadata format version %u is not supported (this "
                       "strata reads versions %u and %u)", ver, ST_META_VERSION,
                       ST_META_VERSION_INCR);
    if (st_get_u32(buf + 12) != flags)
        return st_fail(STRATA_EFORMAT, flags || st_get_u32(buf + 12) != ST_META_FOREIGN
                                           ? "metadata has unknown header flags"
                                           : "metadata describes another format's files (it "
                                             "is never stored)");
    uint64_t body = st_get_u64(buf + 16);
    if (body != len - ST_META_HEADER - ST_META_TRAILER)
        return st_fail(STRATA_EFORMAT,
                       "metadata is truncated or padded: header says %llu body bytes, file has %zu",
                       (unsigned long long)body, len - ST_META_HEADER - ST_META_TRAILER);
    return 0;
}

static int parse(st_meta **out, const unsigned char *buf, size_t len)
{
    st_meta *m = calloc(1, sizeof *m);
    if (!m)
        return st_fail(STRATA_ENOMEM, "out of memory");
    m->foreign = st_get_u32(buf + 12) == ST_META_FOREIGN;
    m->version = st_get_u32(buf + 8);
    m->step = st_get_u64(buf + 24);
    st_rd r = {.p = buf + ST_META_HEADER, .end = buf + len - ST_META_TRAILER, .base = buf};
    if (decode_body(&r, m) != 0) {
        st_meta_free(m);
        return st_fail(STRATA_EFORMAT, "metadata is malformed: %s", r.what);
    }
    char why[STRATA_MAX_NAME + 64];
    int rc = check_unique(m, why, sizeof why);
    if (rc) {
        st_meta_free(m);
        return rc == STRATA_ENOMEM ? st_fail(rc, "out of memory")
                                   : st_fail(STRATA_EFORMAT, "metadata is malformed: %s", why);
    }
    for (size_t i = 0; i < m->ntensors; i++) {
        rc = st_meta_check_overlap(&m->tensors[i]);
        if (rc) {
            st_meta_free(m);
            return rc == STRATA_EOVERLAP ? st_wrap(STRATA_EFORMAT, "metadata is malformed") : rc;
        }
    }
    *out = m;
    return 0;
}

int st_meta_decode(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len, 0);
    if (rc)
        return rc;
    if (st_hash(buf, len - ST_META_TRAILER) != st_get_u64(buf + len - ST_META_TRAILER))
        return st_fail(STRATA_EFORMAT, "metadata checksum mismatch: the file is corrupt");
    return parse(out, buf, len);
}

int st_meta_decode_unchecked(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len, len >= 16 ? st_get_u32(buf + 12) & ST_META_FOREIGN : 0);
    return rc ? rc : parse(out, buf, len);
}

int st_meta_decode_foreign(st_meta **out, const unsigned char *buf, size_t len)
{
    *out = NULL;
    int rc = check_header(buf, len, ST_META_FOREIGN);
    if (rc)
        return rc;
    if (st_hash(buf, len - ST_META_TRAILER) != st_get_u64(buf + len - ST_META_TRAILER))
        return st_fail(STRATA_EFORMAT, "metadata checksum mismatch: corrupt in transit");
    return parse(out, buf, len);
}

void st_meta_free(st_meta *m)
{
    if (!m)
        return;
    st_arena_free(&m->arena);
    free(m);
}

/* ---- commit record ---- */

static void put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

size_t st_commit_encode(const st_commit *c, unsigned char out[ST_COMMIT_SIZE])
{
    const int v1 = c->version == 1;
    const size_t size = v1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE;
    memcpy(out, ST_COMMIT_MAGIC, 8);
    put_le(out + 8, v1 ? 1 : ST_COMMIT_VERSION, 4);
    put_le(out + 12, 0, 4);
    const uint64_t f[6] = {c->step, c->meta_size, c->meta_hash, c->time_ns, c->data_bytes,
                           c->save_id};
    for (int i = 0; i < (v1 ? 5 : 6); i++)
        put_le(out + 16 + 8 * i, f[i], 8);
    put_le(out + size - 8, st_hash(out, size - 8), 8);
    return size;
}

int st_commit_decode(st_commit *c, const unsigned char *buf, size_t len)
{
    if (len < 16 || memcmp(buf, ST_COMMIT_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "commit record %s",
                       len < 16 ? "is too short" : "has a bad magic number");
    uint32_t version = st_get_u32(buf + 8);
    if ((version != 1 && version != ST_COMMIT_VERSION) || st_get_u32(buf + 12) != 0)
        return st_fail(STRATA_EFORMAT, "commit record version %u is not supported", version);
    size_t size = version == 1 ? ST_COMMIT_V1_SIZE : ST_COMMIT_SIZE;
    if (len != size)
        return st_fail(STRATA_EFORMAT, "commit record version %u has %zu bytes, want %zu",
                       version, len, size);
    if (st_hash(buf, size - 8) != st_get_u64(buf + size - 8))
        return st_fail(STRATA_EFORMAT, "commit record checksum mismatch");
    c->version = version;
    c->step = st_get_u64(buf + 16);
    c->meta_size = st_get_u64(buf + 24);
    c->meta_hash = st_get_u64(buf + 32);
    c->time_ns = st_get_u64(buf + 40);
    c->data_bytes = st_get_u64(buf + 48);
    c->save_id = version == 1 ? 0 : st_get_u64(buf + 56);
    return 0;
}

int st_commit_same(const st_commit *a, const st_commit *b)
{
    return a->version == b->version && a->step == b->step && a->meta_size == b->meta_size &&
           a->meta_hash == b->meta_hash && a->time_ns == b->time_ns &&
           a->data_bytes == b->data_bytes && a->save_id == b->save_id;
}

void st_data_file_name(char out[ST_DATA_FILE_BYTES], int rank)
{
    snprintf(out, ST_DATA_FILE_BYTES, "data-%06d.bin", rank);
}

void st_ref_file_name(char out[ST_REF_FILE_BYTES], uint64_t save_id, long rank)
{
    snprintf(out, ST_REF_FILE_BYTES, "ref-%016llx-%06ld.bin", (unsigned long long)save_id, rank);
}

int st_is_ref_file(const char *name)
{
    size_t n = strlen(name);
    if (n < 31 || n > 40 || strncmp(name, "ref-", 4) != 0 || name[20] != '-' ||
        strcmp(name + n - 4, ".bin") != 0)
        return 0;
    for (size_t i = 4; i < n - 4; i++)
        if (i != 20 && !((name[i] >= '0' && name[i] <= '9') ||
                         (i < 20 && name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    return 1;
}

long st_data_file_rank(const char *name)
{
    size_t n = strlen(name);
    if (n < 15 || n > 24 || strncmp(name, "data-", 5) != 0 || strcmp(name + n - 4, ".bin") != 0)
        return -1;
    long r = 0;
    for (size_t i = 5; i < n - 4; i++) {
        if (name[i] < '0' || name[i] > '9')
            return -1;
        if (r > (LONG_MAX - 9) / 10)
            return -1;
        r = r * 10 + (name[i] - '0');
    }
    return r;
}

int st_is_strata_file(const char *name)
{
    if (strcmp(name, ST_COMMIT_FILE) == 0 || strcmp(name, ST_META_FILE) == 0 ||
        strcmp(name, ST_COMMIT_FILE ".tmp") == 0 || strcmp(name, ST_META_FILE ".tmp") == 0 ||
        strcmp(name, ST_LOCK_FILE) == 0 || strcmp(name, ST_PEER_FILE) == 0 ||
        strcmp(name, ST_PEER_FILE ".tmp") == 0 || strcmp(name, ST_PLAN_FILE) == 0 ||
        strcmp(name, ST_PLAN_FILE ".tmp") == 0)
        return 1;
    size_t n = strlen(name); /* a peer copy's parity block: PEER-<digits>.par */
    if (n > 9 && strncmp(name, ST_PEER_FILE "-", 5) == 0 && strcmp(name + n - 4, ".par") == 0 &&
        strspn(name + 5, "0123456789") == n - 9)
        return 1;
    return st_data_file_rank(name) >= 0 || st_is_ref_file(name);
}
