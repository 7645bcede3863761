/* checks.c - the check table of a foreign index (checks.h). */
#include "checks.h"

#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"

void st_check_set_free(st_check_set *s)
{
    st_arena_free(&s->arena);
    free(s->v);
    memset(s, 0, sizeof *s);
}

static int cmp_check(const void *pa, const void *pb)
{
    const st_mcheck *a = pa, *b = pb;
    if (a->file != b->file)
        return a->file < b->file ? -1 : 1;
    if (a->offset != b->offset)
        return a->offset < b->offset ? -1 : 1;
    return (a->bytes > b->bytes) - (a->bytes < b->bytes);
}

/* A byte range of a file that the index reads: [off, end). */
typedef struct {
    uint32_t file;
    uint64_t off, end, maxend; /* maxend: the largest end of this one and those before it in
                                  its file */
} span;

static int cmp_span(const void *pa, const void *pb)
{
    const span *a = pa, *b = pb;
    if (a->file != b->file)
        return a->file < b->file ? -1 : 1;
    return (a->off > b->off) - (a->off < b->off);
}

/* Every extent of m holding bytes, sorted, with the running largest end per file. */
static span *spans_of(const st_meta *m, size_t *n)
{
    size_t cap = m->nblobs;
    for (size_t t = 0; t < m->ntensors; t++)
        cap += m->tensors[t].nshards;
    span *v = malloc((cap + 1) * sizeof *v);
    if (!v)
        return NULL;
    size_t k = 0;
    for (size_t t = 0; t < m->ntensors; t++)
        for (size_t s = 0; s < m->tensors[t].nshards; s++) {
            const st_extent *e = &m->tensors[t].shards[s].ext;
            if (e->bytes)
                v[k++] = (span){e->file, e->offset, e->offset + e->bytes, 0};
        }
    for (size_t b = 0; b < m->nblobs; b++) {
        const st_extent *e = &m->blobs[b].ext;
        if (e->bytes)
            v[k++] = (span){e->file, e->offset, e->offset + e->bytes, 0};
    }
    qsort(v, k, sizeof *v, cmp_span);
    for (size_t i = 0; i < k; i++)
        v[i].maxend = i && v[i - 1].file == v[i].file ? ST_MAX(v[i - 1].maxend, v[i].end)
                                                      : v[i].end;
    *n = k;
    return v;
}

/* Does some span hold a byte of [off, end) of file f? */
static int read_by_index(const span *v, size_t n, uint32_t f, uint64_t off, uint64_t end)
{
    size_t lo = 0, hi = n; /* the first span at or after (f, end) */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid].file < f || (v[mid].file == f && v[mid].off < end))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && v[lo - 1].file == f && v[lo - 1].maxend > off;
}

int st_meta_set_checks(st_meta *m, const st_check_set *s, const char *where)
{
    size_t n = m->nchecks + (s ? s->n : 0), ns = 0, k = 0;
    st_mcheck *all = malloc((n + 1) * sizeof *all);
    span *sp = spans_of(m, &ns);
    int rc = 0;
    if (!all || !sp) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    if (m->nchecks)
        memcpy(all, m->checks, m->nchecks * sizeof *all);
    if (s && s->n)
        memcpy(all + m->nchecks, s->v, s->n * sizeof *all);
    qsort(all, n, sizeof *all, cmp_check);
    for (size_t i = 0; i < n && !rc; i++) {
        const st_mcheck *c = &all[i];
        if (!read_by_index(sp, ns, c->file, c->offset, c->offset + c->bytes))
            continue;
        if (c->file >= m->nfiles || c->offset > m->files[c->file].bytes ||
            c->bytes > m->files[c->file].bytes - c->offset) {
            rc = st_fail(STRATA_EFORMAT, "%s: zip entry '%s' (%llu bytes at %llu) runs past "
                         "the end of '%s'", where, c->name, (unsigned long long)c->bytes,
                         (unsigned long long)c->offset,
                         c->file < m->nfiles ? m->files[c->file].name : "?");
            break;
        }
        const st_mcheck *p = k ? &all[k - 1] : NULL;
        if (p && p->file == c->file && p->offset == c->offset && p->bytes == c->bytes &&
            p->crc == c->crc)
            continue; /* the same entry twice (two items of one archive) */
        if (p && p->file == c->file && p->offset + p->bytes > c->offset) {
            rc = st_fail(STRATA_EFORMAT, "%s: zip entries '%s' and '%s' of '%s' overlap", where,
                         p->name, c->name, m->files[c->file].name);
            break;
        }
        all[k] = *c;
        if (!(all[k].name = st_arena_strndup(&m->arena, c->name, strlen(c->name)))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            break;
        }
        k++;
    }
    if (!rc) {
        st_mcheck *t = st_arena_alloc(&m->arena, (k + 1) * sizeof *t);
        if (!t) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
        } else {
            memcpy(t, all, k * sizeof *t);
            m->checks = t;
            m->nchecks = k;
        }
    }
out:
    free(all);
    free(sp);
    return rc;
}

size_t st_check_find(const st_meta *m, uint32_t f, uint64_t off)
{
    size_t lo = 0, hi = m->nchecks;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const st_mcheck *c = &m->checks[mid];
        if (c->file < f || (c->file == f && c->offset + c->bytes <= off))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

void st_checks_put(st_buf *b, const st_meta *m)
{
    st_buf_var(b, m->nchecks);
    for (size_t i = 0; i < m->nchecks; i++) {
        const st_mcheck *c = &m->checks[i];
        st_buf_var(b, c->file);
        st_buf_var(b, c->offset);
        st_buf_var(b, c->bytes);
        st_buf_u32(b, c->crc);
        st_buf_str(b, c->name);
    }
}

int st_checks_read(st_rd *r, st_meta *m)
{
    uint64_t n = st_rd_count(r, 9, "check count exceeds the metadata size");
    if (r->err)
        return -1;
    m->checks = st_arena_alloc(&m->arena, (n ? n : 1) * sizeof *m->checks);
    if (!m->checks)
        return st_rd_fail(r, "out of memory"), -1;
    for (uint64_t i = 0; i < n && !r->err; i++) {
        st_mcheck *c = &m->checks[i];
        uint64_t f = st_rd_var(r);
        c->offset = st_rd_var(r);
        c->bytes = st_rd_var(r);
        c->crc = st_rd_u32(r);
        c->name = st_rd_str(r, &m->arena, ST_CHECK_MAX_NAME);
        if (r->err)
            break;
        if (f >= m->nfiles || c->bytes == 0 || c->offset > m->files[f].bytes ||
            c->bytes > m->files[f].bytes - c->offset) {
            st_rd_fail(r, "check range outside its file");
            break;
        }
        c->file = (uint32_t)f;
        const st_mcheck *p = i ? &m->checks[i - 1] : NULL;
        if (p && (p->file > c->file || (p->file == c->file && p->offset + p->bytes > c->offset))) {
            st_rd_fail(r, "check ranges not sorted and disjoint");
            break;
        }
    }
    m->nchecks = r->err ? 0 : n;
    return r->err ? -1 : 0;
}
