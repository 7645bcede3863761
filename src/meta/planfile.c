/* planfile.c - plan.bin: encoder and validating decoders (docs/FORMAT.md, "The stored
 * save plan"). Pure. */
#include "planfile.h"

#include <stdlib.h>
#include <string.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "../core/util.h"
#include "meta.h"

/* The checksum of part r: XXH3-64 of the header's first 40 bytes, r (u32) and the part. */
static uint64_t part_sum(const unsigned char *hdr, uint32_t r, const unsigned char *p, size_t n)
{
    XXH3_state_t *s = XXH3_createState();
    unsigned char rb[4] = {(unsigned char)r, (unsigned char)(r >> 8), (unsigned char)(r >> 16),
                           (unsigned char)(r >> 24)};
    uint64_t h = 0;
    if (s && XXH3_64bits_reset(s) == XXH_OK && XXH3_64bits_update(s, hdr, 40) == XXH_OK &&
        XXH3_64bits_update(s, rb, 4) == XXH_OK && XXH3_64bits_update(s, p, n) == XXH_OK)
        h = XXH3_64bits_digest(s);
    XXH3_freeState(s);
    return h;
}

static size_t var_size(uint64_t v)
{
    size_t n = 1;
    while (v >>= 7)
        n++;
    return n;
}

/* The encoded bytes of every part. */
static size_t parts_size(const st_phead *h, const st_ppart *parts)
{
    size_t n = 0;
    for (uint32_t r = 0; r < h->ranks; r++) {
        const st_ppart *p = &parts[r];
        n += 16 + var_size(p->file_bytes) + var_size(p->n);
        for (size_t i = 0; i < p->n; i++)
            n += var_size(p->p[i].meta_index) + var_size(p->p[i].local) +
                 var_size(p->p[i].src_off) + var_size(p->p[i].offset) + var_size(p->p[i].bytes);
    }
    return n;
}

int st_planfile_encode(const st_phead *h, const st_ppart *parts, unsigned char **out,
                       size_t *len)
{
    st_buf b = {0};
    st_buf_put(&b, ST_PLAN_MAGIC, 8);
    st_buf_u32(&b, ST_PLAN_VERSION);
    st_buf_u32(&b, h->ranks);
    st_buf_u32(&b, h->chunk);
    st_buf_u32(&b, 0);
    st_buf_u64(&b, h->save_id);
    st_buf_u64(&b, 0); /* the file's size, below */
    st_buf_u64(&b, 0); /* the header's checksum, below */
    size_t idx = b.n;
    for (uint32_t r = 0; r <= h->ranks; r++)
        st_buf_u64(&b, 0); /* filled below */
    for (int k = 0; !b.oom && k < 8; k++)
        b.p[32 + k] = (unsigned char)((uint64_t)(idx + 8ull * (h->ranks + 1) +
                                                 parts_size(h, parts)) >> (8 * k));
    if (!b.oom) {
        uint64_t hs = st_hash(b.p, 40);
        for (int k = 0; k < 8; k++)
            b.p[40 + k] = (unsigned char)(hs >> (8 * k));
    }
    for (uint32_t r = 0; r < h->ranks && !b.oom; r++) {
        const st_ppart *p = &parts[r];
        size_t at = b.n;
        st_buf_u64(&b, p->hash);
        st_buf_var(&b, p->file_bytes);
        st_buf_var(&b, p->n);
        for (size_t i = 0; i < p->n; i++) {
            st_buf_var(&b, p->p[i].meta_index);
            st_buf_var(&b, p->p[i].local);
            st_buf_var(&b, p->p[i].src_off);
            st_buf_var(&b, p->p[i].offset);
            st_buf_var(&b, p->p[i].bytes);
        }
        if (!b.oom)
            st_buf_u64(&b, part_sum(b.p, r, b.p + at, b.n - at));
        if (!b.oom) {
            unsigned char *e = b.p + idx + 8ull * r;
            for (int k = 0; k < 8; k++)
                e[k] = (unsigned char)((uint64_t)at >> (8 * k));
        }
    }
    if (!b.oom)
        for (int k = 0; k < 8; k++)
            b.p[idx + 8ull * h->ranks + (size_t)k] = (unsigned char)((uint64_t)b.n >> (8 * k));
    if (!b.oom && st_get_u64(b.p + 32) != b.n) {
        free(b.p);
        return st_fail(STRATA_EINVAL, "internal: %s size", ST_PLAN_FILE);
    }
    if (b.oom) {
        free(b.p);
        return st_fail(STRATA_ENOMEM, "out of memory");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

static int bad(const char *what) { return st_fail(STRATA_EFORMAT, "%s: %s", ST_PLAN_FILE, what); }

int st_planfile_header(st_phead *h, const unsigned char *buf, size_t len)
{
    if (len < ST_PLAN_HEADER || memcmp(buf, ST_PLAN_MAGIC, 8) != 0)
        return bad("not a stored save plan (bad magic or truncated)");
    if (st_get_u64(buf + 40) != st_hash(buf, 40))
        return bad("header checksum mismatch");
    if (st_get_u32(buf + 8) != ST_PLAN_VERSION)
        return st_fail(STRATA_EFORMAT, "%s: format version %u is not supported", ST_PLAN_FILE,
                       st_get_u32(buf + 8));
    h->ranks = st_get_u32(buf + 12);
    h->chunk = st_get_u32(buf + 16);
    h->save_id = st_get_u64(buf + 24);
    h->size = st_get_u64(buf + 32);
    if (h->ranks == 0 || h->ranks > INT32_MAX || st_get_u32(buf + 20) != 0)
        return bad("bad header");
    return 0;
}

int st_planfile_span(uint64_t *off, uint64_t *len, const st_phead *h, uint32_t r,
                     const unsigned char idx[16], uint64_t file_size)
{
    uint64_t a = st_get_u64(idx), b = st_get_u64(idx + 8);
    uint64_t first = st_planfile_index_at(h->ranks + 1);
    if (file_size != h->size)
        return bad("not of the size its header says");
    if (r >= h->ranks || a < first || b < a || b > file_size || b - a < 8)
        return bad("bad index");
    *off = a;
    *len = b - a;
    return 0;
}

void st_ppart_free(st_ppart *p)
{
    free(p->p);
    memset(p, 0, sizeof *p);
}

int st_planfile_part(st_ppart *out, const unsigned char *hdr, uint32_t r,
                     const unsigned char *buf, size_t len)
{
    memset(out, 0, sizeof *out);
    if (len < 8 || st_get_u64(buf + len - 8) != part_sum(hdr, r, buf, len - 8))
        return st_fail(STRATA_EFORMAT, "%s: rank %u's part fails its checksum", ST_PLAN_FILE, r);
    st_rd rd = {.p = buf, .end = buf + len - 8, .base = buf};
    out->hash = st_rd_u64(&rd);
    out->file_bytes = st_rd_var(&rd);
    uint64_t n = st_rd_count(&rd, 5, "piece count");
    out->p = malloc((n + 1) * sizeof *out->p);
    if (!out->p)
        return st_fail(STRATA_ENOMEM, "out of memory");
    uint64_t end = 0;
    for (uint64_t i = 0; i < n && !rd.err; i++) {
        st_ppiece *q = &out->p[i];
        q->meta_index = st_rd_var(&rd);
        uint64_t local = st_rd_var(&rd);
        q->src_off = st_rd_var(&rd);
        q->offset = st_rd_var(&rd);
        q->bytes = st_rd_var(&rd);
        q->local = (uint32_t)local;
        if (rd.err)
            break;
        if (local > UINT32_MAX || (i && q->meta_index <= out->p[i - 1].meta_index))
            st_rd_fail(&rd, "bad piece");
        else if (q->offset % ST_ALIGN || q->offset < end || q->bytes > out->file_bytes ||
                 q->offset > out->file_bytes - q->bytes)
            st_rd_fail(&rd, "piece outside its place in the data file");
        end = q->offset + q->bytes;
    }
    out->n = (size_t)n;
    if (!rd.err && rd.p != rd.end)
        st_rd_fail(&rd, "trailing bytes");
    if (rd.err) {
        int rc = st_fail(STRATA_EFORMAT, "%s: rank %u's part: %s", ST_PLAN_FILE, r, rd.what);
        st_ppart_free(out);
        return rc;
    }
    return 0;
}

void st_planfile_free(st_ppart *parts, uint32_t n)
{
    for (uint32_t r = 0; parts && r < n; r++)
        st_ppart_free(&parts[r]);
    free(parts);
}

int st_planfile_decode(st_phead *h, st_ppart **parts, const unsigned char *buf, size_t len)
{
    *parts = NULL;
    int rc = st_planfile_header(h, buf, len);
    if (rc)
        return rc;
    if (h->size != len)
        return bad("not of the size its header says");
    if ((len - ST_PLAN_HEADER) / 8 <= h->ranks)
        return bad("truncated index");
    st_ppart *p = calloc(h->ranks, sizeof *p);
    if (!p)
        return st_fail(STRATA_ENOMEM, "out of memory");
    uint64_t prev = st_planfile_index_at(h->ranks + 1);
    for (uint32_t r = 0; r < h->ranks && !rc; r++) {
        uint64_t off, n;
        rc = st_planfile_span(&off, &n, h, r, buf + st_planfile_index_at(r), len);
        if (!rc && off != prev)
            rc = bad("parts are not consecutive");
        if (!rc)
            rc = st_planfile_part(&p[r], buf, r, buf + off, (size_t)n);
        prev = off + n;
    }
    if (!rc && prev != len)
        rc = bad("trailing bytes");
    if (rc) {
        st_planfile_free(p, h->ranks);
        return rc;
    }
    *parts = p;
    return 0;
}
