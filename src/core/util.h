/* util.h - small helpers shared by every layer: growable arrays, an arena, LEB128 varints,
 * string hashing, monotonic time. Header-only; not thread-safe objects. */
#ifndef STRATA_UTIL_H
#define STRATA_UTIL_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

#define ST_MIN(a, b) ((a) < (b) ? (a) : (b))
#define ST_MAX(a, b) ((a) > (b) ? (a) : (b))
#define ST_ALIGN_UP(x, a) (((x) + ((a)-1)) & ~((uint64_t)(a)-1))

/* Grows *p (elements of size esz) so that it holds at least need elements. 0 or -1. */
static inline int st_grow(void *pp, size_t *cap, size_t need, size_t esz)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap : 8;
    while (nc < need)
        nc *= 2;
    void *np = realloc(*(void **)pp, nc * esz);
    if (!np)
        return -1;
    *(void **)pp = np;
    *cap = nc;
    return 0;
}

/* Arena: bump allocator freed all at once. Blocks are malloc'd; no alignment beyond 16. */
typedef struct st_arena_blk {
    struct st_arena_blk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} st_arena_blk;
typedef struct {
    st_arena_blk *head;
} st_arena;

static inline void *st_arena_alloc(st_arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    st_arena_blk *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > (64u << 10) ? n : (64u << 10);
        b = malloc(sizeof *b + cap);
        if (!b)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    void *p = b->data + b->used;
    b->used += n;
    return p;
}

static inline char *st_arena_strndup(st_arena *a, const char *s, size_t n)
{
    char *p = st_arena_alloc(a, n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

static inline void st_arena_free(st_arena *a)
{
    while (a->head) {
        st_arena_blk *n = a->head->next;
        free(a->head);
        a->head = n;
    }
}

/* FNV-1a style string hash with a final mix; good enough for in-memory tables. */
static inline uint64_t st_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}
static inline uint64_t st_strhash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ULL;
    return st_mix64(h);
}

static inline double st_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- byte buffer with LEB128 varints (for metadata encoding) ---- */
typedef struct {
    unsigned char *p;
    size_t n, cap;
    int oom;
} st_buf;

static inline void st_buf_put(st_buf *b, const void *src, size_t n)
{
    if (b->oom || st_grow(&b->p, &b->cap, b->n + n, 1)) {
        b->oom = 1;
        return;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static inline void st_buf_u8(st_buf *b, uint8_t v) { st_buf_put(b, &v, 1); }
static inline void st_buf_u32(st_buf *b, uint32_t v)
{
    unsigned char t[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    st_buf_put(b, t, 4);
}
static inline void st_buf_u64(st_buf *b, uint64_t v)
{
    st_buf_u32(b, (uint32_t)v);
    st_buf_u32(b, (uint32_t)(v >> 32));
}
static inline void st_buf_var(st_buf *b, uint64_t v)
{
    unsigned char t[10];
    int n = 0;
    do {
        t[n] = (unsigned char)(v & 0x7f);
        v >>= 7;
        if (v)
            t[n] |= 0x80;
        n++;
    } while (v);
    st_buf_put(b, t, (size_t)n);
}
static inline void st_buf_str(st_buf *b, const char *s)
{
    size_t n = strlen(s);
    st_buf_var(b, n);
    st_buf_put(b, s, n);
}

static inline uint32_t st_get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t st_get_u64(const unsigned char *p)
{
    return (uint64_t)st_get_u32(p) | (uint64_t)st_get_u32(p + 4) << 32;
}

/* ---- bounds-checked reader of the above (first error sticks; reads then return 0) ---- */
typedef struct {
    const unsigned char *p, *end, *base;
    int err;
    char what[160];
} st_rd;

static inline void st_rd_fail(st_rd *r, const char *what)
{
    if (!r->err) {
        r->err = 1;
        snprintf(r->what, sizeof r->what, "%s at byte %zu", what, (size_t)(r->p - r->base));
    }
}

static inline uint64_t st_rd_var(st_rd *r)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end) {
            st_rd_fail(r, "truncated varint");
            return 0;
        }
        unsigned char c = *r->p++;
        if (shift == 63 && (c & 0x7e)) {
            st_rd_fail(r, "varint overflows 64 bits");
            return 0;
        }
        v |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80))
            return v;
    }
    st_rd_fail(r, "varint too long");
    return 0;
}

static inline size_t st_rd_left(const st_rd *r) { return (size_t)(r->end - r->p); }

/* A count of items each taking at least min_bytes: bounded by the bytes left. */
static inline uint64_t st_rd_count(st_rd *r, size_t min_bytes, const char *what)
{
    uint64_t n = st_rd_var(r);
    if (!r->err && n > st_rd_left(r) / min_bytes) {
        st_rd_fail(r, what);
        return 0;
    }
    return n;
}

static inline uint8_t st_rd_u8(st_rd *r)
{
    if (r->p >= r->end) {
        st_rd_fail(r, "truncated");
        return 0;
    }
    return *r->p++;
}

/* The next n bytes (NULL if fewer are left: the reader fails). */
static inline const unsigned char *st_rd_take(st_rd *r, size_t n)
{
    if (st_rd_left(r) < n) {
        st_rd_fail(r, "truncated");
        return NULL;
    }
    const unsigned char *p = r->p;
    r->p += n;
    return p;
}

static inline uint32_t st_rd_u32(st_rd *r)
{
    const unsigned char *p = st_rd_take(r, 4);
    return p ? st_get_u32(p) : 0;
}

static inline uint64_t st_rd_u64(st_rd *r)
{
    const unsigned char *p = st_rd_take(r, 8);
    return p ? st_get_u64(p) : 0;
}

/* A string of 1..max bytes with no NUL, copied into the arena (NULL on error). */
static inline char *st_rd_str(st_rd *r, st_arena *a, size_t max)
{
    uint64_t n = st_rd_var(r);
    if (r->err)
        return NULL;
    if (n == 0 || n > max || n > st_rd_left(r)) {
        st_rd_fail(r, "bad name length");
        return NULL;
    }
    if (memchr(r->p, 0, n)) {
        st_rd_fail(r, "NUL byte in name");
        return NULL;
    }
    char *s = st_arena_strndup(a, (const char *)r->p, n);
    if (!s)
        st_rd_fail(r, "out of memory");
    else
        r->p += n;
    return s;
}

#endif
