/* zip.c - the bounded zip reader (zip.h). */
#include "zip.h"

#include <stdarg.h>
#include <zlib.h>

#include "../core/error.h"

#define ZIP_EOCD_SIG 0x06054b50u
#define ZIP_Z64LOC_SIG 0x07064b50u
#define ZIP_Z64EOCD_SIG 0x06064b50u
#define ZIP_CDH_SIG 0x02014b50u
#define ZIP_LFH_SIG 0x04034b50u
#define ZIP_EOCD_LEN 22
#define ZIP_CDH_LEN 46
#define ZIP_LFH_LEN 30
#define ZIP_MAX_COMMENT 65535

static uint16_t g16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }

static const char *zname(const char *file) { return file ? file : "zip file"; }

/* The name rules: 1..ST_ZIP_MAX_NAME bytes, no NUL or backslash, relative, no "." or ".."
 * component. NULL if it passes, else what is wrong. */
static const char *bad_name(const unsigned char *s, size_t n)
{
    if (n == 0)
        return "an empty name";
    if (n > ST_ZIP_MAX_NAME)
        return "a name over the length limit";
    if (memchr(s, 0, n))
        return "a name holding a NUL byte";
    if (memchr(s, '\\', n))
        return "a name holding a backslash";
    if (s[0] == '/')
        return "an absolute name";
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && s[j] != '/')
            j++;
        if ((j - i == 1 && s[i] == '.') || (j - i == 2 && s[i] == '.' && s[i + 1] == '.'))
            return "a name with a '.' or '..' component";
        i = j + 1;
    }
    return NULL;
}

/* The ZIP64 extra field (id 1) of a central directory entry: replaces the fields that are
 * 0xFFFFFFFF, in the order usize, csize, local header offset. */
static int z64_extra(st_zip_entry *e, const unsigned char *x, size_t xn, int need_u, int need_c,
                     int need_o, const char *file)
{
    while (xn >= 4) {
        uint16_t id = g16(x), len = g16(x + 2);
        if ((size_t)len > xn - 4)
            return st_fail(STRATA_EFORMAT, "%s: entry '%s': an extra field runs past its "
                           "header", file, e->name);
        if (id == 1) {
            const unsigned char *p = x + 4;
            size_t left = len;
            uint64_t *f[3] = {need_u ? &e->usize : NULL, need_c ? &e->csize : NULL,
                              need_o ? &e->header_off : NULL};
            for (int i = 0; i < 3; i++) {
                if (!f[i])
                    continue;
                if (left < 8)
                    return st_fail(STRATA_EFORMAT, "%s: entry '%s': the ZIP64 extra field is "
                                   "too short", file, e->name);
                *f[i] = st_get_u64(p);
                p += 8;
                left -= 8;
            }
            return 0;
        }
        x += 4 + len;
        xn -= 4 + (size_t)len;
    }
    if (need_u || need_c || need_o)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s': sizes or offset say ZIP64 but there "
                       "is no ZIP64 extra field", file, e->name);
    return 0;
}

/* Finds the end records; sets *cd_off, *cd_size, *count. */
static int find_end(st_zip *z, st_zip_read_fn rd, void *ctx, const char *file, uint64_t *cd_off,
                    uint64_t *cd_size, uint64_t *count, uint64_t *cd_limit)
{
    uint64_t size = z->file_size;
    if (size < ZIP_EOCD_LEN)
        return st_fail(STRATA_EFORMAT, "%s: not a zip archive: %llu bytes, shorter than an end "
                       "of central directory record", file, (unsigned long long)size);
    size_t tail = (size_t)ST_MIN(size, (uint64_t)(ZIP_EOCD_LEN + ZIP_MAX_COMMENT));
    unsigned char *buf = malloc(tail);
    if (!buf)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    uint64_t base = size - tail;
    int rc = rd(ctx, buf, tail, base);
    if (rc) {
        free(buf);
        return rc;
    }
    /* backwards: the last record whose comment runs exactly to the end */
    size_t at = SIZE_MAX;
    for (size_t i = tail - ZIP_EOCD_LEN + 1; i-- > 0;)
        if (st_get_u32(buf + i) == ZIP_EOCD_SIG &&
            i + ZIP_EOCD_LEN + g16(buf + i + 20) == tail) {
            at = i;
            break;
        }
    if (at == SIZE_MAX) {
        free(buf);
        return st_fail(STRATA_EFORMAT, "%s: not a zip archive: no end of central directory "
                       "record", file);
    }
    const unsigned char *e = buf + at;
    uint64_t eocd = base + at;
    uint16_t disk = g16(e + 4), cd_disk = g16(e + 6), n_here = g16(e + 8), n_all = g16(e + 10);
    *cd_size = st_get_u32(e + 12);
    *cd_off = st_get_u32(e + 16);
    *count = n_all;
    *cd_limit = eocd;
    free(buf);
    unsigned char loc[20];
    if (eocd >= 20) {
        if ((rc = rd(ctx, loc, 20, eocd - 20)) != 0)
            return rc;
    }
    if (eocd >= 20 && st_get_u32(loc) == ZIP_Z64LOC_SIG) {
        uint64_t rec = st_get_u64(loc + 8);
        if (st_get_u32(loc + 4) != 0 || st_get_u32(loc + 16) != 1)
            return st_fail(STRATA_EFORMAT, "%s: a multi-disk archive (not supported)", file);
        if (rec > eocd - 20 || eocd - 20 - rec < 56)
            return st_fail(STRATA_EFORMAT, "%s: the ZIP64 end record offset %llu is past the "
                           "locator", file, (unsigned long long)rec);
        unsigned char r[56];
        if ((rc = rd(ctx, r, 56, rec)) != 0)
            return rc;
        if (st_get_u32(r) != ZIP_Z64EOCD_SIG)
            return st_fail(STRATA_EFORMAT, "%s: no ZIP64 end record where the locator points "
                           "(byte %llu)", file, (unsigned long long)rec);
        if (st_get_u32(r + 16) != 0 || st_get_u32(r + 20) != 0 ||
            st_get_u64(r + 24) != st_get_u64(r + 32))
            return st_fail(STRATA_EFORMAT, "%s: a multi-disk archive (not supported)", file);
        *count = st_get_u64(r + 32);
        *cd_size = st_get_u64(r + 40);
        *cd_off = st_get_u64(r + 48);
        *cd_limit = rec;
        z->zip64 = 1;
    } else if (disk != 0 || cd_disk != 0 || n_here != n_all) {
        return st_fail(STRATA_EFORMAT, "%s: a multi-disk archive (not supported)", file);
    }
    if (*cd_off > *cd_limit || *cd_size > *cd_limit - *cd_off)
        return st_fail(STRATA_EFORMAT, "%s: the central directory (%llu bytes at %llu) runs "
                       "past its end record", file, (unsigned long long)*cd_size,
                       (unsigned long long)*cd_off);
    if (*cd_size > ST_ZIP_MAX_CD)
        return st_fail(STRATA_EFORMAT, "%s: central directory of %llu bytes is over the limit "
                       "of %llu", file, (unsigned long long)*cd_size, ST_ZIP_MAX_CD);
    if (*count > *cd_size / ZIP_CDH_LEN)
        return st_fail(STRATA_EFORMAT, "%s: %llu entries cannot fit in a central directory of "
                       "%llu bytes", file, (unsigned long long)*count,
                       (unsigned long long)*cd_size);
    return 0;
}

/* One central directory entry at p (left bytes): fills e, returns its length in *len. */
static int parse_cdh(st_zip *z, st_zip_entry *e, const unsigned char *p, size_t left,
                     size_t *len, const char *file, size_t idx)
{
    if (left < ZIP_CDH_LEN || st_get_u32(p) != ZIP_CDH_SIG)
        return st_fail(STRATA_EFORMAT, "%s: central directory entry %zu is truncated or has a "
                       "bad signature", file, idx);
    size_t nl = g16(p + 28), xl = g16(p + 30), cl = g16(p + 32);
    if (ZIP_CDH_LEN + nl + xl + cl > left)
        return st_fail(STRATA_EFORMAT, "%s: central directory entry %zu runs past the "
                       "directory", file, idx);
    const char *why = bad_name(p + ZIP_CDH_LEN, nl);
    if (why)
        return st_fail(STRATA_EFORMAT, "%s: central directory entry %zu has %s", file, idx, why);
    e->name = st_arena_strndup(&z->arena, (const char *)p + ZIP_CDH_LEN, nl);
    if (!e->name)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    e->flags = g16(p + 8);
    e->method = g16(p + 10);
    e->crc = st_get_u32(p + 16);
    uint32_t cs = st_get_u32(p + 20), us = st_get_u32(p + 24), off = st_get_u32(p + 42);
    e->csize = cs;
    e->usize = us;
    e->header_off = off;
    if (g16(p + 34) != 0 && g16(p + 34) != 0xFFFF)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s' is on another disk", file, e->name);
    if (e->flags & 1)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s' is encrypted", file, e->name);
    int rc = z64_extra(e, p + ZIP_CDH_LEN + nl, xl, us == UINT32_MAX, cs == UINT32_MAX,
                       off == UINT32_MAX, file);
    if (rc)
        return rc;
    if (e->method == 0 && e->csize != e->usize)
        return st_fail(STRATA_EFORMAT, "%s: stored entry '%s' says %llu bytes stored but %llu "
                       "uncompressed", file, e->name, (unsigned long long)e->csize,
                       (unsigned long long)e->usize);
    *len = ZIP_CDH_LEN + nl + xl + cl;
    return 0;
}

/* The local header of e: agrees with the central directory; sets e->data_off. */
static int check_local(st_zip_entry *e, st_zip_read_fn rd, void *ctx, uint64_t limit,
                       const char *file)
{
    size_t nl = strlen(e->name);
    if (e->header_off > limit || limit - e->header_off < ZIP_LFH_LEN + nl)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s': local header offset %llu is past the "
                       "central directory", file, e->name, (unsigned long long)e->header_off);
    unsigned char *h = malloc(ZIP_LFH_LEN + nl);
    if (!h)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    int rc = rd(ctx, h, ZIP_LFH_LEN + nl, e->header_off);
    if (rc) {
        free(h);
        return rc;
    }
    const char *why = NULL;
    uint32_t lcs = st_get_u32(h + 18), lus = st_get_u32(h + 22);
    if (st_get_u32(h) != ZIP_LFH_SIG)
        why = "has no local header signature";
    else if (g16(h + 26) != nl || memcmp(h + ZIP_LFH_LEN, e->name, nl) != 0)
        why = "has another name in its local header";
    else if (g16(h + 8) != e->method)
        why = "has another method in its local header";
    else if (!(e->flags & 8) && st_get_u32(h + 14) != e->crc)
        why = "has another CRC-32 in its local header";
    else if (!(e->flags & 8) && lcs != UINT32_MAX && (lcs != e->csize || lus != e->usize))
        why = "has other sizes in its local header";
    uint64_t data = e->header_off + ZIP_LFH_LEN + nl + g16(h + 28);
    free(h);
    if (why)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s' %s", file, e->name, why);
    if (data > limit || e->csize > limit - data)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s': %llu bytes at %llu run past the "
                       "central directory (byte %llu)", file, e->name,
                       (unsigned long long)e->csize, (unsigned long long)data,
                       (unsigned long long)limit);
    e->data_off = data;
    return 0;
}

static int by_off(const void *a, const void *b)
{
    const st_zip_entry *x = *(st_zip_entry *const *)a, *y = *(st_zip_entry *const *)b;
    return x->header_off < y->header_off ? -1 : x->header_off > y->header_off;
}

static int by_name(const void *a, const void *b)
{
    return strcmp((*(st_zip_entry *const *)a)->name, (*(st_zip_entry *const *)b)->name);
}

/* No two entries share a name or overlap (header to end of data). */
static int check_disjoint(st_zip *z, const char *file)
{
    if (z->n < 2)
        return 0;
    st_zip_entry **v = malloc(z->n * sizeof *v);
    if (!v)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    for (size_t i = 0; i < z->n; i++)
        v[i] = &z->e[i];
    int rc = 0;
    qsort(v, z->n, sizeof *v, by_name);
    for (size_t i = 1; i < z->n && !rc; i++)
        if (strcmp(v[i - 1]->name, v[i]->name) == 0)
            rc = st_fail(STRATA_EFORMAT, "%s: entry '%s' appears twice", file, v[i]->name);
    qsort(v, z->n, sizeof *v, by_off);
    for (size_t i = 1; i < z->n && !rc; i++)
        if (v[i - 1]->data_off + v[i - 1]->csize > v[i]->header_off)
            rc = st_fail(STRATA_EFORMAT, "%s: entries '%s' and '%s' overlap", file,
                         v[i - 1]->name, v[i]->name);
    free(v);
    return rc;
}

int st_zip_open(st_zip *z, uint64_t file_size, st_zip_read_fn rd, void *ctx, const char *file)
{
    memset(z, 0, sizeof *z);
    file = zname(file);
    z->file_size = file_size;
    uint64_t cd_off = 0, cd_size = 0, count = 0, limit = 0;
    int rc = find_end(z, rd, ctx, file, &cd_off, &cd_size, &count, &limit);
    if (rc)
        return rc;
    z->cd_off = cd_off;
    unsigned char *cd = malloc(cd_size ? (size_t)cd_size : 1);
    if (!cd)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    if (cd_size && (rc = rd(ctx, cd, (size_t)cd_size, cd_off)) != 0)
        goto out;
    z->e = count ? st_arena_alloc(&z->arena, (size_t)count * sizeof *z->e) : NULL;
    if (count && !z->e) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
        goto out;
    }
    size_t pos = 0;
    for (size_t i = 0; i < count; i++) {
        size_t len = 0;
        memset(&z->e[i], 0, sizeof z->e[i]);
        if ((rc = parse_cdh(z, &z->e[i], cd + pos, (size_t)cd_size - pos, &len, file, i)) != 0)
            goto out;
        pos += len;
        z->n = i + 1;
        if ((rc = check_local(&z->e[i], rd, ctx, cd_off, file)) != 0)
            goto out;
    }
    if (pos != cd_size) {
        rc = st_fail(STRATA_EFORMAT, "%s: the central directory holds %llu bytes after its "
                     "%llu entries", file, (unsigned long long)(cd_size - pos),
                     (unsigned long long)count);
        goto out;
    }
    rc = check_disjoint(z, file);
out:
    free(cd);
    if (rc)
        st_zip_free(z);
    return rc;
}

void st_zip_free(st_zip *z)
{
    st_arena_free(&z->arena);
    memset(z, 0, sizeof *z);
}

const st_zip_entry *st_zip_find(const st_zip *z, const char *name)
{
    for (size_t i = 0; i < z->n; i++)
        if (strcmp(z->e[i].name, name) == 0)
            return &z->e[i];
    return NULL;
}

int st_zip_read(const st_zip *z, const st_zip_entry *e, void *buf, st_zip_read_fn rd, void *ctx,
                const char *file)
{
    (void)z;
    file = zname(file);
    if (e->method != 0)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s' is compressed (method %u%s); only "
                       "stored entries are read", file, e->name, e->method,
                       e->method == 8 ? ", deflate" : "");
    int rc = e->usize ? rd(ctx, buf, (size_t)e->usize, e->data_off) : 0;
    if (rc)
        return rc;
    /* zlib's crc32 takes a uInt length: feed it in pieces */
    uLong crc = crc32(0L, Z_NULL, 0);
    const unsigned char *p = buf;
    for (uint64_t left = e->usize; left;) {
        uInt k = (uInt)ST_MIN(left, (uint64_t)(1u << 30));
        crc = crc32(crc, p, k);
        p += k;
        left -= k;
    }
    if ((uint32_t)crc != e->crc)
        return st_fail(STRATA_ECHECKSUM, "%s: entry '%s': CRC-32 %08x, the archive says %08x",
                       file, e->name, (unsigned)crc, (unsigned)e->crc);
    return 0;
}

int st_check_add_zip(st_check_set *s, const st_zip *z, uint32_t file, uint64_t base)
{
    for (size_t i = 0; i < z->n; i++) {
        const st_zip_entry *e = &z->e[i];
        if (e->method != 0 || e->usize == 0)
            continue;
        char *name = st_arena_strndup(&s->arena, e->name, strlen(e->name));
        if (!name || st_grow(&s->v, &s->cap, s->n + 1, sizeof *s->v))
            return st_fail(STRATA_ENOMEM, "out of memory");
        s->v[s->n++] = (st_mcheck){file, e->crc, base + e->data_off, e->usize, name};
    }
    return 0;
}
