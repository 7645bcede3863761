/* safetensors.c - the validating parser of a safetensors file's header (safetensors.h). */
#include "safetensors.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../core/error.h"
#include "../core/utf8.h"

static const struct {
    const char *name;
    strata_dtype dt;
} st_dtypes[] = {
    {"F64", STRATA_F64},         {"F32", STRATA_F32},         {"F16", STRATA_F16},
    {"BF16", STRATA_BF16},       {"F8_E4M3", STRATA_FP8_E4M3}, {"F8_E5M2", STRATA_FP8_E5M2},
    {"I64", STRATA_I64},         {"I32", STRATA_I32},         {"I16", STRATA_I16},
    {"I8", STRATA_I8},           {"U8", STRATA_U8},           {"BOOL", STRATA_BOOL},
};
#define ST_NDTYPES (sizeof st_dtypes / sizeof st_dtypes[0])

const char *st_st_dtype_name(strata_dtype dt)
{
    for (size_t i = 0; i < ST_NDTYPES; i++)
        if (st_dtypes[i].dt == dt)
            return st_dtypes[i].name;
    return NULL;
}

int st_st_dtype_parse(strata_dtype *out, const char *name, size_t len)
{
    for (size_t i = 0; i < ST_NDTYPES; i++)
        if (strlen(st_dtypes[i].name) == len && memcmp(st_dtypes[i].name, name, len) == 0) {
            *out = st_dtypes[i].dt;
            return 0;
        }
    return STRATA_EINVAL;
}

static int hlen(const unsigned char first8[8], uint64_t file_size, uint64_t *n,
                const char *file)
{
    if (file_size < 8)
        return st_fail(STRATA_EFORMAT, "%s: not a safetensors file: %llu bytes, shorter than "
                       "the 8-byte header length", file, (unsigned long long)file_size);
    uint64_t v = st_get_u64(first8);
    if (v > ST_ST_MAX_HEADER)
        return st_fail(STRATA_EFORMAT, "%s: safetensors header length %llu is over the "
                       "limit of %llu bytes", file, (unsigned long long)v, ST_ST_MAX_HEADER);
    if (v > file_size - 8)
        return st_fail(STRATA_EFORMAT, "%s: safetensors header length %llu runs past the "
                       "end of the file (%llu bytes)", file, (unsigned long long)v,
                       (unsigned long long)file_size);
    *n = v;
    return 0;
}

int st_st_header_len(const unsigned char first8[8], uint64_t file_size, uint64_t *n)
{
    return hlen(first8, file_size, n, "safetensors file");
}

/* ---- a strict, bounded JSON reader over the header ---- */

typedef struct {
    const unsigned char *s, *p, *end;
    const char *file;
    const char *kind; /* "header" or "index", for messages */
    char *scratch; /* N + 1 bytes: the decoded string (never longer than its source) */
    size_t slen;
} sj;

__attribute__((format(printf, 2, 3))) static int sj_fail(sj *j, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return st_fail(STRATA_EFORMAT, "%s: bad safetensors %s at byte %zu of its JSON: %s",
                   j->file, j->kind, (size_t)(j->p - j->s), msg);
}

/* A printable excerpt of a (decoded) name for messages. */
static const char *sj_show(const char *s, size_t n, char out[72])
{
    size_t k = 0;
    for (size_t i = 0; i < n && k < 64; i++) {
        unsigned char c = (unsigned char)s[i];
        out[k++] = c < 0x20 || c == 0x7f ? '?' : (char)c;
    }
    if (n > 64)
        out[k++] = '.', out[k++] = '.', out[k++] = '.';
    out[k] = 0;
    return out;
}

static void sj_ws(sj *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

/* After whitespace: is the next byte c? (consumed if so) */
static int sj_eat(sj *j, unsigned char c)
{
    sj_ws(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return 1;
    }
    return 0;
}

static int sj_expect(sj *j, unsigned char c, const char *where)
{
    if (sj_eat(j, c))
        return 0;
    if (j->p >= j->end)
        return sj_fail(j, "the JSON ends early (expected '%c' %s)", c, where);
    return sj_fail(j, "expected '%c' %s", c, where);
}

static int hex4(const unsigned char *p, unsigned *v)
{
    unsigned x = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return -1;
        x = x << 4 | d;
    }
    *v = x;
    return 0;
}

static void put_utf8(char *o, size_t *k, unsigned cp)
{
    if (cp < 0x80) {
        o[(*k)++] = (char)cp;
    } else if (cp < 0x800) {
        o[(*k)++] = (char)(0xC0 | cp >> 6);
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        o[(*k)++] = (char)(0xE0 | cp >> 12);
        o[(*k)++] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        o[(*k)++] = (char)(0xF0 | cp >> 18);
        o[(*k)++] = (char)(0x80 | (cp >> 12 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[(*k)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* Reads a string into j->scratch (j->slen bytes, NUL-terminated; may hold NULs). */
static int sj_string(sj *j, const char *what)
{
    if (!sj_eat(j, '"'))
        return j->p >= j->end ? sj_fail(j, "the JSON ends early (expected %s)", what)
                              : sj_fail(j, "expected a string (%s)", what);
    size_t k = 0;
    for (;;) {
        if (j->p >= j->end)
            return sj_fail(j, "unterminated string");
        unsigned c = *j->p;
        if (c == '"') {
            j->p++;
            break;
        }
        if (c < 0x20)
            return sj_fail(j, "control character 0x%02x in a string", c);
        if (c >= 0x80) {
            int ok;
            size_t n = st_utf8_seq(j->p, (size_t)(j->end - j->p), &ok);
            if (!ok)
                return sj_fail(j, "invalid UTF-8 in a string");
            memcpy(j->scratch + k, j->p, n);
            k += n;
            j->p += n;
            continue;
        }
        if (c != '\\') {
            j->scratch[k++] = (char)c;
            j->p++;
            continue;
        }
        if (j->end - j->p < 2)
            return sj_fail(j, "unterminated string");
        unsigned e = j->p[1];
        const char *simple = strchr("\"\\/bfnrt", (int)e);
        if (e && simple) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            j->scratch[k++] = to[simple - "\"\\/bfnrt"];
            j->p += 2;
            continue;
        }
        if (e != 'u')
            return sj_fail(j, "bad escape '\\%c' in a string", e >= 0x20 && e < 0x7f ? e : '?');
        unsigned cp, lo;
        if (j->end - j->p < 6 || hex4(j->p + 2, &cp))
            return sj_fail(j, "bad \\u escape in a string");
        if (cp >= 0xDC00 && cp <= 0xDFFF)
            return sj_fail(j, "lone low surrogate \\u%04X in a string", cp);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (j->end - j->p < 12 || j->p[6] != '\\' || j->p[7] != 'u' ||
                hex4(j->p + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                return sj_fail(j, "high surrogate \\u%04X not followed by a low one", cp);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            j->p += 12;
        } else
            j->p += 6;
        put_utf8(j->scratch, &k, cp);
    }
    j->scratch[k] = 0;
    j->slen = k;
    return 0;
}

/* Does the string just read equal lit? */
static int sj_is(const sj *j, const char *lit)
{
    return j->slen == strlen(lit) && memcmp(j->scratch, lit, j->slen) == 0;
}

/* A non-negative integer below 2^64 (what safetensors' numbers must be). */
static int sj_uint(sj *j, uint64_t *v, const char *what)
{
    sj_ws(j);
    if (j->p >= j->end)
        return sj_fail(j, "the JSON ends early (expected %s)", what);
    if (*j->p == '-')
        return sj_fail(j, "negative number for %s", what);
    if (*j->p < '0' || *j->p > '9')
        return sj_fail(j, "expected a number for %s", what);
    if (*j->p == '0' && j->end - j->p > 1 && j->p[1] >= '0' && j->p[1] <= '9')
        return sj_fail(j, "number with a leading zero for %s", what);
    uint64_t x = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        if (__builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, *j->p - '0', &x))
            return sj_fail(j, "number too large for %s", what);
        j->p++;
    }
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
        return sj_fail(j, "non-integer number for %s", what);
    *v = x;
    return 0;
}

/* Skips one JSON value of any kind, checking its syntax; depth: of the value. */
static int sj_skip(sj *j, int depth)
{
    if (depth > ST_ST_MAX_DEPTH)
        return sj_fail(j, "JSON nested deeper than %d", ST_ST_MAX_DEPTH);
    sj_ws(j);
    if (j->p >= j->end)
        return sj_fail(j, "the JSON ends early (expected a value)");
    unsigned c = *j->p;
    int rc;
    if (c == '"')
        return sj_string(j, "a string");
    if (c == '{' || c == '[') {
        unsigned close = c == '{' ? '}' : ']';
        j->p++;
        if (sj_eat(j, (unsigned char)close))
            return 0;
        do {
            if (c == '{') {
                if ((rc = sj_string(j, "a key")) || (rc = sj_expect(j, ':', "after a key")))
                    return rc;
            }
            if ((rc = sj_skip(j, depth + 1)))
                return rc;
        } while (sj_eat(j, ','));
        return sj_expect(j, (unsigned char)close, c == '{' ? "to close an object"
                                                            : "to close an array");
    }
    static const char *const words[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i]);
        if ((size_t)(j->end - j->p) >= n && memcmp(j->p, words[i], n) == 0) {
            j->p += n;
            return 0;
        }
    }
    /* a number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
    const unsigned char *q = j->p;
    if (q < j->end && *q == '-')
        q++;
    if (q >= j->end || *q < '0' || *q > '9')
        return sj_fail(j, "expected a JSON value");
    if (*q == '0')
        q++;
    else
        while (q < j->end && *q >= '0' && *q <= '9')
            q++;
    if (q < j->end && *q == '.') {
        q++;
        if (q >= j->end || *q < '0' || *q > '9')
            return sj_fail(j, "bad number");
        while (q < j->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (q < j->end && (*q == 'e' || *q == 'E')) {
        q++;
        if (q < j->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= j->end || *q < '0' || *q > '9')
            return sj_fail(j, "bad number");
        while (q < j->end && *q >= '0' && *q <= '9')
            q++;
    }
    j->p = q;
    return 0;
}

/* An array of at most max non-negative integers; *n gets the count. */
static int sj_uints(sj *j, uint64_t *v, int max, int *n, const char *what, const char *name)
{
    int rc;
    if ((rc = sj_expect(j, '[', what)))
        return rc;
    *n = 0;
    if (sj_eat(j, ']'))
        return 0;
    do {
        if (*n == max)
            return sj_fail(j, "tensor '%s': %s has more than %d entries", name, what, max);
        if ((rc = sj_uint(j, &v[*n], what)))
            return rc;
        ++*n;
    } while (sj_eat(j, ','));
    return sj_expect(j, ']', what);
}

typedef struct {
    st_st_tensor *t;
    size_t n, cap;
    st_st_kv *kv;
    size_t nkv, kvcap;
} sj_out;

static int sj_tensor(sj *j, st_st_tensor *t, st_arena *a)
{
    char show[72];
    sj_show(j->scratch, j->slen, show);
    if (j->slen == 0)
    return sj_fail(j, "a tensor has an empty name");
    if (j->slen > STRATA_MAX_NAME)
    return sj_fail(j, "tensor name '%s' is longer than %d bytes", show, STRATA_MAX_NAME);
    if (memchr(j->scratch, 0, j->slen))
    return sj_fail(j, "tensor name '%s' holds a NUL character", show);
    memset(t, 0, sizeof *t);
    if (!(t->name = st_arena_strndup(a, j->scratch, j->slen)))
    return st_fail(STRATA_ENOMEM, "%s: out of memory reading the safetensors header",
                   j->file);
    int rc, have_dt = 0, have_shape = 0, have_off = 0;
    uint64_t off[2];
    if ((rc = sj_expect(j, '{', "to open a tensor's entry")))
    return rc;
    if (sj_eat(j, '}'))
    return sj_fail(j, "tensor '%s' has no dtype", show);
    do {
        if ((rc = sj_string(j, "a field name")) || (rc = sj_expect(j, ':', "after a key")))
            return rc;
        if (sj_is(j, "dtype")) {
            if (have_dt++)
                return sj_fail(j, "tensor '%s': dtype given twice", show);
            if ((rc = sj_string(j, "a dtype")))
                return rc;
            if (st_st_dtype_parse(&t->dtype, j->scratch, j->slen)) {
                char d[72];
                return sj_fail(j, "tensor '%s': unknown dtype '%s'", show,
                               sj_show(j->scratch, j->slen, d));
            }
        } else if (sj_is(j, "shape")) {
            if (have_shape++)
                return sj_fail(j, "tensor '%s': shape given twice", show);
            if ((rc = sj_uints(j, t->shape, STRATA_MAX_DIMS, &t->ndim, "shape", show)))
                return rc;
        } else if (sj_is(j, "data_offsets")) {
            int n;
            if (have_off++)
                return sj_fail(j, "tensor '%s': data_offsets given twice", show);
            if ((rc = sj_uints(j, off, 2, &n, "data_offsets", show)))
                return rc;
            if (n != 2)
                return sj_fail(j, "tensor '%s': data_offsets has %d entries, not 2", show, n);
        } else if ((rc = sj_skip(j, 3))) /* top object, tensor object, this value */
            return rc;
    } while (sj_eat(j, ','));
    if ((rc = sj_expect(j, '}', "to close a tensor's entry")))
        return rc;
    if (!have_dt || !have_shape || !have_off)
        return sj_fail(j, "tensor '%s' has no %s", show,
                       !have_dt ? "dtype" : !have_shape ? "shape" : "data_offsets");
    t->begin = off[0];
    t->end = off[1];
    return 0;
}

static int sj_metadata(sj *j, sj_out *o, st_arena *a)
{
    int rc;
    if ((rc = sj_expect(j, '{', "to open __metadata__")))
        return rc;
    if (sj_eat(j, '}'))
        return 0;
    do {
        if ((rc = sj_string(j, "a __metadata__ key")))
            return rc;
        if (st_grow(&o->kv, &o->kvcap, o->nkv + 1, sizeof *o->kv))
            return st_fail(STRATA_ENOMEM, "%s: out of memory reading the safetensors header",
                           j->file);
        st_st_kv *kv = &o->kv[o->nkv];
        kv->key_len = j->slen;
        if (!(kv->key = st_arena_strndup(a, j->scratch, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        if ((rc = sj_expect(j, ':', "after a key")))
            return rc;
        sj_ws(j);
        if (j->p < j->end && *j->p != '"') {
            char show[72];
            return sj_fail(j, "__metadata__ value of '%s' is not a string",
                           sj_show(kv->key, kv->key_len, show));
        }
        if ((rc = sj_string(j, "a __metadata__ value")))
            return rc;
        kv->value_len = j->slen;
        if (!(kv->value = st_arena_strndup(a, j->scratch, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        o->nkv++;
    } while (sj_eat(j, ','));
    return sj_expect(j, '}', "to close __metadata__");
}

static int cmp_kv(const void *a, const void *b)
{
    const st_st_kv *x = a, *y = b;
    size_t n = ST_MIN(x->key_len, y->key_len);
    int c = memcmp(x->key, y->key, n);
    return c ? c : (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp((*(st_st_tensor *const *)a)->name, (*(st_st_tensor *const *)b)->name);
}

static int cmp_offset(const void *a, const void *b)
{
    const st_st_tensor *x = a, *y = b;
    if (x->begin != y->begin)
    return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
    return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* The checks after parsing: duplicates, sizes, bounds, tiling. Offsets still relative. */
static int st_check(const char *file, sj_out *o, uint64_t data_len)
{
    char show[72], show2[72];
    for (size_t i = 0; i < o->n; i++) {
    st_st_tensor *t = &o->t[i];
    uint64_t numel = 1, bytes;
    sj_show(t->name, strlen(t->name), show);
    for (int d = 0; d < t->ndim; d++)
        if (__builtin_mul_overflow(numel, t->shape[d], &numel))
            return st_fail(STRATA_EFORMAT, "%s: safetensors tensor '%s': the element count "
                           "of its shape overflows", file, show);
    if (__builtin_mul_overflow(numel, (uint64_t)strata_dtype_size(t->dtype), &bytes) ||
        bytes > (UINT64_MAX >> 2))
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensor '%s': the byte size of its "
                       "shape overflows", file, show);
    if (t->begin > t->end)
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensor '%s': data_offsets begin "
                       "%llu is after end %llu", file, show, (unsigned long long)t->begin,
                       (unsigned long long)t->end);
    if (t->end > data_len)
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensor '%s': data_offsets end %llu "
                       "is past the end of the data (%llu bytes)", file, show,
                       (unsigned long long)t->end, (unsigned long long)data_len);
    if (t->end - t->begin != bytes)
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensor '%s': %llu bytes of data "
                       "(data_offsets) but its dtype and shape need %llu", file, show,
                       (unsigned long long)(t->end - t->begin), (unsigned long long)bytes);
    }
    if (o->n > 1) {
    st_st_tensor **by = malloc(o->n * sizeof *by);
    if (!by)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    for (size_t i = 0; i < o->n; i++)
        by[i] = &o->t[i];
    qsort(by, o->n, sizeof *by, cmp_name);
    for (size_t i = 1; i < o->n; i++)
        if (strcmp(by[i - 1]->name, by[i]->name) == 0) {
            sj_show(by[i]->name, strlen(by[i]->name), show);
            free(by);
            return st_fail(STRATA_EFORMAT, "%s: safetensors header names tensor '%s' "
                           "twice", file, show);
        }
    free(by);
    }
    if (o->nkv > 1) {
    qsort(o->kv, o->nkv, sizeof *o->kv, cmp_kv);
    for (size_t i = 1; i < o->nkv; i++)
        if (cmp_kv(&o->kv[i - 1], &o->kv[i]) == 0)
            return st_fail(STRATA_EFORMAT, "%s: safetensors __metadata__ has the key '%s' "
                           "twice", file, sj_show(o->kv[i].key, o->kv[i].key_len, show));
    }
    if (o->n > 1)
        qsort(o->t, o->n, sizeof *o->t, cmp_offset);
    uint64_t pos = 0;
    for (size_t i = 0; i < o->n; i++) {
    const st_st_tensor *t = &o->t[i];
    if (t->begin != pos) {
        sj_show(t->name, strlen(t->name), show);
        if (t->begin > pos)
            return st_fail(STRATA_EFORMAT, "%s: safetensors data has a gap: bytes "
                           "[%llu, %llu) belong to no tensor (before '%s')", file,
                           (unsigned long long)pos, (unsigned long long)t->begin, show);
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensors '%s' and '%s' overlap "
                       "(data_offsets)", file, sj_show(o->t[i - 1].name,
                       strlen(o->t[i - 1].name), show2), show);
    }
    pos = t->end;
    }
    if (pos != data_len)
    return st_fail(STRATA_EFORMAT, "%s: safetensors data has a gap: bytes [%llu, %llu) at "
                   "the end belong to no tensor", file, (unsigned long long)pos,
                   (unsigned long long)data_len);
    return 0;
}

void st_st_free(st_st_index *ix)
{
    if (ix) {
    st_arena_free(&ix->arena);
    memset(ix, 0, sizeof *ix);
    }
}

int st_st_parse(st_st_index *out, const unsigned char *file_head, size_t head_len,
            uint64_t file_size, const char *file_name)
{
    const char *file = file_name ? file_name : "safetensors file";
    memset(out, 0, sizeof *out);
    uint64_t n;
    int rc;
    if (head_len < 8 && file_size >= 8)
    return st_fail(STRATA_EINVAL, "%s: %zu bytes of the file passed, need 8", file,
                   head_len);
    if ((rc = hlen(file_head, file_size, &n, file)))
    return rc;
    if (head_len - 8 < n)
    return st_fail(STRATA_EINVAL, "%s: %zu bytes of the file passed, its header needs "
                   "%llu", file, head_len, (unsigned long long)(8 + n));
    sj j = {file_head + 8, file_head + 8, file_head + 8 + n, file, "header", malloc(n + 1), 0};
    sj_out o = {0};
    st_arena a = {0};
    if (!j.scratch)
    return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    int have_meta = 0;
    if ((rc = sj_expect(&j, '{', "to open the header")))
    goto out;
    if (sj_eat(&j, '}'))
    goto closed;
    do {
        if ((rc = sj_string(&j, "a tensor name")) || (rc = sj_expect(&j, ':', "after a key")))
            goto out;
        if (sj_is(&j, "__metadata__")) {
            if (have_meta++) {
                rc = sj_fail(&j, "__metadata__ given twice");
                goto out;
            }
            if ((rc = sj_metadata(&j, &o, &a)))
                goto out;
            continue;
        }
        if (st_grow(&o.t, &o.cap, o.n + 1, sizeof *o.t)) {
            rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
            goto out;
        }
        if ((rc = sj_tensor(&j, &o.t[o.n], &a)))
            goto out;
        o.n++;
    } while (sj_eat(&j, ','));
    if ((rc = sj_expect(&j, '}', "to close the header")))
        goto out;
closed:
    sj_ws(&j);
    if (j.p != j.end) {
        rc = sj_fail(&j, "bytes after the header's JSON object");
        goto out;
    }
    if ((rc = st_check(file, &o, file_size - 8 - n)))
        goto out;
    out->tensors = st_arena_alloc(&a, (o.n ? o.n : 1) * sizeof *o.t);
    out->meta = st_arena_alloc(&a, (o.nkv ? o.nkv : 1) * sizeof *o.kv);
    if (!out->tensors || !out->meta) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
        goto out;
    }
    for (size_t i = 0; i < o.n; i++) {
        o.t[i].begin += 8 + n;
        o.t[i].end += 8 + n;
    }
    if (o.n)
        memcpy(out->tensors, o.t, o.n * sizeof *o.t);
    if (o.nkv)
        memcpy(out->meta, o.kv, o.nkv * sizeof *o.kv);
    out->ntensors = o.n;
    out->nmeta = o.nkv;
    out->header_len = n;
    out->data_begin = 8 + n;
    out->file_size = file_size;
    out->arena = a;
    a.head = NULL;
out:
    free(j.scratch);
    free(o.t);
    free(o.kv);
    st_arena_free(&a);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

/* ---- the index of a sharded set ---- */

static int cmp_wm(const void *a, const void *b)
{
    return strcmp(((const st_st_wm *)a)->name, ((const st_st_wm *)b)->name);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

void st_st_map_free(st_st_map *m)
{
    if (m) {
        st_arena_free(&m->arena);
        memset(m, 0, sizeof *m);
    }
}

static int sj_weight_map(sj *j, st_st_wm **e, size_t *n, size_t *cap, st_arena *a)
{
    int rc;
    char show[72];
    if ((rc = sj_expect(j, '{', "to open weight_map")))
        return rc;
    if (sj_eat(j, '}'))
        return 0;
    do {
        if ((rc = sj_string(j, "a tensor name")))
            return rc;
        sj_show(j->scratch, j->slen, show);
        if (j->slen == 0 || j->slen > STRATA_MAX_NAME || memchr(j->scratch, 0, j->slen))
            return sj_fail(j, "weight_map has a bad tensor name '%s' (empty, longer than %d "
                           "bytes, or holding a NUL)", show, STRATA_MAX_NAME);
        if (st_grow(e, cap, *n + 1, sizeof **e))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        st_st_wm *w = &(*e)[*n];
        if (!(w->name = st_arena_strndup(a, j->scratch, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        if ((rc = sj_expect(j, ':', "after a key")))
            return rc;
        sj_ws(j);
        if (j->p < j->end && *j->p != '"')
            return sj_fail(j, "weight_map value of '%s' is not a string", show);
        if ((rc = sj_string(j, "a file name")))
            return rc;
        if (!st_plain_name(j->scratch, j->slen) || j->slen > 255) {
            char f[72];
            return sj_fail(j, "weight_map maps '%s' to '%s', not a plain file name in the "
                           "directory", show, sj_show(j->scratch, j->slen, f));
        }
        if (!(w->file = st_arena_strndup(a, j->scratch, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        ++*n;
    } while (sj_eat(j, ','));
    return sj_expect(j, '}', "to close weight_map");
}

int st_st_parse_index(st_st_map *out, const unsigned char *json, size_t len,
                      const char *file_name)
{
    const char *file = file_name ? file_name : ST_ST_INDEX_FILE;
    memset(out, 0, sizeof *out);
    if (len > ST_ST_MAX_HEADER)
        return st_fail(STRATA_EFORMAT, "%s: %zu bytes, over the limit of %llu for an index",
                       file, len, ST_ST_MAX_HEADER);
    sj j = {json, json, json + len, file, "index", malloc(len + 1), 0};
    st_arena a = {0};
    st_st_wm *e = NULL;
    size_t n = 0, cap = 0;
    int rc, have_map = 0;
    if (!j.scratch)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", file);
    if ((rc = sj_expect(&j, '{', "to open the index")))
        goto out;
    if (!sj_eat(&j, '}')) {
        do {
            if ((rc = sj_string(&j, "a key")) || (rc = sj_expect(&j, ':', "after a key")))
                goto out;
            if (sj_is(&j, "weight_map")) {
                if (have_map++) {
                    rc = sj_fail(&j, "weight_map given twice");
                    goto out;
                }
                if ((rc = sj_weight_map(&j, &e, &n, &cap, &a)))
                    goto out;
            } else if ((rc = sj_skip(&j, 1))) { /* "metadata" and anything else */
                goto out;
            }
        } while (sj_eat(&j, ','));
        if ((rc = sj_expect(&j, '}', "to close the index")))
            goto out;
    }
    sj_ws(&j);
    if (j.p != j.end) {
        rc = sj_fail(&j, "bytes after the index's JSON object");
        goto out;
    }
    if (!have_map) {
        rc = st_fail(STRATA_EFORMAT, "%s: the safetensors index has no weight_map", file);
        goto out;
    }
    if (n > 1)
        qsort(e, n, sizeof *e, cmp_wm);
    for (size_t i = 1; i < n; i++)
        if (strcmp(e[i - 1].name, e[i].name) == 0) {
            char show[72];
            rc = st_fail(STRATA_EFORMAT, "%s: weight_map names tensor '%s' twice", file,
                         sj_show(e[i].name, strlen(e[i].name), show));
            goto out;
        }
    out->e = st_arena_alloc(&a, (n ? n : 1) * sizeof *e);
    out->files = st_arena_alloc(&a, (n ? n : 1) * sizeof *out->files);
    if (!out->e || !out->files) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
        goto out;
    }
    if (n)
        memcpy(out->e, e, n * sizeof *e);
    for (size_t i = 0; i < n; i++)
        out->files[i] = e[i].file;
    if (n > 1)
        qsort(out->files, n, sizeof *out->files, cmp_str);
    size_t nf = 0;
    for (size_t i = 0; i < n; i++)
        if (!nf || strcmp(out->files[nf - 1], out->files[i]) != 0)
            out->files[nf++] = out->files[i];
    out->n = n;
    out->nfiles = nf;
    out->arena = a;
    a.head = NULL;
out:
    free(j.scratch);
    free(e);
    st_arena_free(&a);
    if (rc)
        memset(out, 0, sizeof *out);
    return rc;
}

/* ---- a source's headers in one buffer, and the metadata built from them ---- */

#define SRC_MAGIC "STSAFE02"

void st_st_src_begin(st_buf *b, uint32_t nfiles)
{
    st_buf_put(b, SRC_MAGIC, 8);
    st_buf_var(b, nfiles);
}

void st_st_src_put(st_buf *b, const char *name, uint64_t file_size, const st_mident *id,
                   const unsigned char *head, size_t head_len)
{
    st_buf_str(b, name);
    st_buf_var(b, file_size);
    st_buf_var(b, id->ino);
    st_buf_var(b, id->mtime_ns);
    st_buf_var(b, id->ctime_ns);
    st_buf_var(b, head_len);
    st_buf_put(b, head, head_len);
}

typedef struct {
    const st_st_tensor *t;
    uint32_t file;
} src_tensor;

static int cmp_src_tensor(const void *a, const void *b)
{
    return strcmp(((const src_tensor *)a)->t->name, ((const src_tensor *)b)->t->name);
}

/* The tensor named `name` in the sorted list, or NULL. */
static const src_tensor *find_tensor(const src_tensor *all, size_t n, const char *name)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(all[mid].t->name, name);
        if (!c)
            return &all[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Checks the tensors of the files against the index: each weight_map entry names a
 * tensor held by the file it names, and each tensor is in weight_map. */
static int check_map(const st_st_map *map, const src_tensor *all, size_t n,
                     const st_meta *m, const char *where)
{
    char show[72];
    for (size_t i = 0; i < map->n; i++) {
        const st_st_wm *w = &map->e[i];
        const src_tensor *t = find_tensor(all, n, w->name);
        sj_show(w->name, strlen(w->name), show);
        if (!t)
            return st_fail(STRATA_EFORMAT, "%s: %s maps tensor '%s' to '%s', which does not "
                           "hold it", where, ST_ST_INDEX_FILE, show, w->file);
        if (strcmp(m->files[t->file].name, w->file) != 0)
            return st_fail(STRATA_EFORMAT, "%s: %s maps tensor '%s' to '%s', but it is in "
                           "'%s'", where, ST_ST_INDEX_FILE, show, w->file,
                           m->files[t->file].name);
    }
    if (map->n != n) /* every entry matched a distinct tensor: some tensor is unlisted */
        for (size_t i = 0; i < n; i++) {
            size_t lo = 0, hi = map->n;
            while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (strcmp(map->e[mid].name, all[i].t->name) < 0)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo == map->n || strcmp(map->e[lo].name, all[i].t->name) != 0)
                return st_fail(STRATA_EFORMAT, "%s: tensor '%s' of '%s' is not in the "
                               "weight_map of %s", where,
                               sj_show(all[i].t->name, strlen(all[i].t->name), show),
                               m->files[all[i].file].name, ST_ST_INDEX_FILE);
        }
    return 0;
}

int st_st_meta(st_meta **out, const unsigned char *src, size_t len, const st_st_map *map,
               const char *where)
{
    *out = NULL;
    st_rd r = {src, src + len, src, 0, ""};
    const unsigned char *magic = st_rd_take(&r, 8);
    if (!magic || memcmp(magic, SRC_MAGIC, 8) != 0)
        return st_fail(STRATA_EFORMAT, "%s: not a safetensors source description", where);
    uint64_t nf = st_rd_count(&r, 3, "too many files");
    if (r.err || nf == 0 || nf > UINT32_MAX)
        return st_fail(STRATA_EFORMAT, "%s: bad safetensors source description (%s)", where,
                       r.err ? r.what : "no files");
    st_meta *m = calloc(1, sizeof *m);
    st_st_index *ix = calloc(nf, sizeof *ix);
    src_tensor *all = NULL;
    int rc = 0;
    if (!m || !ix) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    m->foreign = 1;
    m->chunk = 1;
    m->nfiles = (uint32_t)nf;
    if (!(m->files = st_arena_alloc(&m->arena, nf * sizeof *m->files)) ||
        !(m->idents = st_arena_alloc(&m->arena, nf * sizeof *m->idents))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    size_t nt = 0;
    for (uint64_t f = 0; f < nf; f++) {
        char *name = st_rd_str(&r, &m->arena, 255);
        uint64_t size = st_rd_var(&r), ino = st_rd_var(&r), mt = st_rd_var(&r);
        uint64_t ct = st_rd_var(&r), hl = st_rd_var(&r);
        const unsigned char *head = r.err || hl > st_rd_left(&r) ? NULL : st_rd_take(&r, hl);
        if (r.err || !head || !st_plain_name(name, strlen(name))) {
            rc = st_fail(STRATA_EFORMAT, "%s: bad safetensors source description (%s)", where,
                         r.err ? r.what : "bad file entry");
            goto out;
        }
        m->files[f] = (st_mfile){name, size};
        m->idents[f] = (st_mident){ino, mt, ct};
        char shown[PATH_MAX + 300];
        snprintf(shown, sizeof shown, "%s/%s", where, name);
        if ((rc = st_st_parse(&ix[f], head, hl, size, shown)))
            goto out;
        nt += ix[f].ntensors;
    }
    if (st_rd_left(&r)) {
        rc = st_fail(STRATA_EFORMAT, "%s: bad safetensors source description (trailing bytes)",
                     where);
        goto out;
    }
    if (!(all = malloc((nt ? nt : 1) * sizeof *all))) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    size_t k = 0;
    for (uint64_t f = 0; f < nf; f++)
        for (size_t i = 0; i < ix[f].ntensors; i++)
            all[k++] = (src_tensor){&ix[f].tensors[i], (uint32_t)f};
    if (nt > 1)
        qsort(all, nt, sizeof *all, cmp_src_tensor);
    for (size_t i = 1; i < nt; i++)
        if (strcmp(all[i - 1].t->name, all[i].t->name) == 0) {
            char show[72];
            rc = st_fail(STRATA_EFORMAT, "%s: tensor '%s' is in both '%s' and '%s'", where,
                         sj_show(all[i].t->name, strlen(all[i].t->name), show),
                         m->files[all[i - 1].file].name, m->files[all[i].file].name);
            goto out;
        }
    if (map && (rc = check_map(map, all, nt, m, where)))
        goto out;
    m->tensors = st_arena_alloc(&m->arena, (nt ? nt : 1) * sizeof *m->tensors);
    if (!m->tensors) {
        rc = st_fail(STRATA_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < nt; i++) {
        const st_st_tensor *t = all[i].t;
        st_mtensor *mt = &m->tensors[i];
        st_mshard *sh = st_arena_alloc(&m->arena, sizeof *sh);
        size_t dims = (size_t)(t->ndim ? t->ndim : 1) * sizeof(uint64_t);
        memset(mt, 0, sizeof *mt);
        mt->name = st_arena_strndup(&m->arena, t->name, strlen(t->name));
        if (!sh || !mt->name || !(sh->off = st_arena_alloc(&m->arena, dims)) ||
            !(sh->len = st_arena_alloc(&m->arena, dims))) {
            rc = st_fail(STRATA_ENOMEM, "out of memory");
            goto out;
        }
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            mt->shape[d] = sh->len[d] = t->shape[d];
            sh->off[d] = 0;
            numel *= t->shape[d];
        }
        mt->dtype = t->dtype;
        mt->ndim = t->ndim;
        mt->nshards = 1;
        mt->shards = sh;
        mt->bytes = t->end - t->begin;
        sh->fs = 0;
        sh->fe = numel;
        sh->flat = 0;
        sh->ext = (st_extent){all[i].file, t->begin, t->end - t->begin, NULL};
        m->data_bytes += mt->bytes;
    }
    m->ntensors = nt;
out:
    for (uint64_t f = 0; ix && f < nf; f++)
        st_st_free(&ix[f]);
    free(ix);
    free(all);
    if (rc) {
        st_meta_free(m);
        return rc;
    }
    *out = m;
    return 0;
}
