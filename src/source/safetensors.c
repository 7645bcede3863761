/* safetensors.c - the validating parser of a safetensors file's header (safetensors.h). */
#include "safetensors.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "../core/error.h"
#include "json.h"

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

/* ---- the header: its JSON read strictly (json.h) ---- */

/* An array of at most max non-negative integers; *n gets the count. */
static int read_uints(st_json *j, uint64_t *v, int max, int *n, const char *what, const char *name)
{
    int rc;
    if ((rc = st_json_expect(j, '[', what)))
        return rc;
    *n = 0;
    if (st_json_eat(j, ']'))
        return 0;
    do {
        if (*n == max)
            return st_json_fail(j, "tensor '%s': %s has more than %d entries", name, what, max);
        if ((rc = st_json_uint(j, &v[*n], what)))
            return rc;
        ++*n;
    } while (st_json_eat(j, ','));
    return st_json_expect(j, ']', what);
}

typedef struct {
    st_st_tensor *t;
    size_t n, cap;
    st_st_kv *kv;
    size_t nkv, kvcap;
} st_hdr;

static int read_tensor(st_json *j, st_st_tensor *t, st_arena *a)
{
    char show[72];
    st_json_show(j->str, j->slen, show);
    if (j->slen == 0)
    return st_json_fail(j, "a tensor has an empty name");
    if (j->slen > STRATA_MAX_NAME)
    return st_json_fail(j, "tensor name '%s' is longer than %d bytes", show, STRATA_MAX_NAME);
    if (memchr(j->str, 0, j->slen))
    return st_json_fail(j, "tensor name '%s' holds a NUL character", show);
    memset(t, 0, sizeof *t);
    if (!(t->name = st_arena_strndup(a, j->str, j->slen)))
    return st_fail(STRATA_ENOMEM, "%s: out of memory reading the safetensors header",
                   j->file);
    int rc, have_dt = 0, have_shape = 0, have_off = 0;
    uint64_t off[2];
    if ((rc = st_json_expect(j, '{', "to open a tensor's entry")))
    return rc;
    if (st_json_eat(j, '}'))
    return st_json_fail(j, "tensor '%s' has no dtype", show);
    do {
        if ((rc = st_json_string(j, "a field name")) || (rc = st_json_expect(j, ':', "after a key")))
            return rc;
        if (st_json_is(j, "dtype")) {
            if (have_dt++)
                return st_json_fail(j, "tensor '%s': dtype given twice", show);
            if ((rc = st_json_string(j, "a dtype")))
                return rc;
            if (st_st_dtype_parse(&t->dtype, j->str, j->slen)) {
                char d[72];
                return st_json_fail(j, "tensor '%s': unknown dtype '%s'", show,
                               st_json_show(j->str, j->slen, d));
            }
        } else if (st_json_is(j, "shape")) {
            if (have_shape++)
                return st_json_fail(j, "tensor '%s': shape given twice", show);
            if ((rc = read_uints(j, t->shape, STRATA_MAX_DIMS, &t->ndim, "shape", show)))
                return rc;
        } else if (st_json_is(j, "data_offsets")) {
            int n;
            if (have_off++)
                return st_json_fail(j, "tensor '%s': data_offsets given twice", show);
            if ((rc = read_uints(j, off, 2, &n, "data_offsets", show)))
                return rc;
            if (n != 2)
                return st_json_fail(j, "tensor '%s': data_offsets has %d entries, not 2", show, n);
        } else if ((rc = st_json_skip(j, 3))) /* top object, tensor object, this value */
            return rc;
    } while (st_json_eat(j, ','));
    if ((rc = st_json_expect(j, '}', "to close a tensor's entry")))
        return rc;
    if (!have_dt || !have_shape || !have_off)
        return st_json_fail(j, "tensor '%s' has no %s", show,
                       !have_dt ? "dtype" : !have_shape ? "shape" : "data_offsets");
    t->begin = off[0];
    t->end = off[1];
    return 0;
}

static int read_metadata(st_json *j, st_hdr *o, st_arena *a)
{
    int rc;
    if ((rc = st_json_expect(j, '{', "to open __metadata__")))
        return rc;
    if (st_json_eat(j, '}'))
        return 0;
    do {
        if ((rc = st_json_string(j, "a __metadata__ key")))
            return rc;
        if (st_grow(&o->kv, &o->kvcap, o->nkv + 1, sizeof *o->kv))
            return st_fail(STRATA_ENOMEM, "%s: out of memory reading the safetensors header",
                           j->file);
        st_st_kv *kv = &o->kv[o->nkv];
        kv->key_len = j->slen;
        if (!(kv->key = st_arena_strndup(a, j->str, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        if ((rc = st_json_expect(j, ':', "after a key")))
            return rc;
        st_json_ws(j);
        if (j->p < j->end && *j->p != '"') {
            char show[72];
            return st_json_fail(j, "__metadata__ value of '%s' is not a string",
                           st_json_show(kv->key, kv->key_len, show));
        }
        if ((rc = st_json_string(j, "a __metadata__ value")))
            return rc;
        kv->value_len = j->slen;
        if (!(kv->value = st_arena_strndup(a, j->str, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        o->nkv++;
    } while (st_json_eat(j, ','));
    return st_json_expect(j, '}', "to close __metadata__");
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
static int st_check(const char *file, st_hdr *o, uint64_t data_len)
{
    char show[72], show2[72];
    for (size_t i = 0; i < o->n; i++) {
    st_st_tensor *t = &o->t[i];
    uint64_t numel = 1, bytes;
    st_json_show(t->name, strlen(t->name), show);
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
            st_json_show(by[i]->name, strlen(by[i]->name), show);
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
                           "twice", file, st_json_show(o->kv[i].key, o->kv[i].key_len, show));
    }
    if (o->n > 1)
        qsort(o->t, o->n, sizeof *o->t, cmp_offset);
    uint64_t pos = 0;
    for (size_t i = 0; i < o->n; i++) {
    const st_st_tensor *t = &o->t[i];
    if (t->begin != pos) {
        st_json_show(t->name, strlen(t->name), show);
        if (t->begin > pos)
            return st_fail(STRATA_EFORMAT, "%s: safetensors data has a gap: bytes "
                           "[%llu, %llu) belong to no tensor (before '%s')", file,
                           (unsigned long long)pos, (unsigned long long)t->begin, show);
        return st_fail(STRATA_EFORMAT, "%s: safetensors tensors '%s' and '%s' overlap "
                       "(data_offsets)", file, st_json_show(o->t[i - 1].name,
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
    st_json j;
    st_hdr o = {0};
    st_arena a = {0};
    if ((rc = st_json_init(&j, file_head + 8, n, file, "safetensors header")))
        return rc;
    int have_meta = 0;
    if ((rc = st_json_expect(&j, '{', "to open the header")))
    goto out;
    if (st_json_eat(&j, '}'))
    goto closed;
    do {
        if ((rc = st_json_string(&j, "a tensor name")) || (rc = st_json_expect(&j, ':', "after a key")))
            goto out;
        if (st_json_is(&j, "__metadata__")) {
            if (have_meta++) {
                rc = st_json_fail(&j, "__metadata__ given twice");
                goto out;
            }
            if ((rc = read_metadata(&j, &o, &a)))
                goto out;
            continue;
        }
        if (st_grow(&o.t, &o.cap, o.n + 1, sizeof *o.t)) {
            rc = st_fail(STRATA_ENOMEM, "%s: out of memory", file);
            goto out;
        }
        if ((rc = read_tensor(&j, &o.t[o.n], &a)))
            goto out;
        o.n++;
    } while (st_json_eat(&j, ','));
    if ((rc = st_json_expect(&j, '}', "to close the header")))
        goto out;
closed:
    st_json_ws(&j);
    if (j.p != j.end) {
        rc = st_json_fail(&j, "bytes after the header's JSON object");
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
    st_json_free(&j);
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

static int read_weight_map(st_json *j, st_st_wm **e, size_t *n, size_t *cap, st_arena *a)
{
    int rc;
    char show[72];
    if ((rc = st_json_expect(j, '{', "to open weight_map")))
        return rc;
    if (st_json_eat(j, '}'))
        return 0;
    do {
        if ((rc = st_json_string(j, "a tensor name")))
            return rc;
        st_json_show(j->str, j->slen, show);
        if (j->slen == 0 || j->slen > STRATA_MAX_NAME || memchr(j->str, 0, j->slen))
            return st_json_fail(j, "weight_map has a bad tensor name '%s' (empty, longer than %d "
                           "bytes, or holding a NUL)", show, STRATA_MAX_NAME);
        if (st_grow(e, cap, *n + 1, sizeof **e))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        st_st_wm *w = &(*e)[*n];
        if (!(w->name = st_arena_strndup(a, j->str, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        if ((rc = st_json_expect(j, ':', "after a key")))
            return rc;
        st_json_ws(j);
        if (j->p < j->end && *j->p != '"')
            return st_json_fail(j, "weight_map value of '%s' is not a string", show);
        if ((rc = st_json_string(j, "a file name")))
            return rc;
        if (!st_plain_name(j->str, j->slen) || j->slen > 255) {
            char f[72];
            return st_json_fail(j, "weight_map maps '%s' to '%s', not a plain file name in the "
                           "directory", show, st_json_show(j->str, j->slen, f));
        }
        if (!(w->file = st_arena_strndup(a, j->str, j->slen)))
            return st_fail(STRATA_ENOMEM, "%s: out of memory", j->file);
        ++*n;
    } while (st_json_eat(j, ','));
    return st_json_expect(j, '}', "to close weight_map");
}

int st_st_parse_index(st_st_map *out, const unsigned char *json, size_t len,
                      const char *file_name)
{
    const char *file = file_name ? file_name : ST_ST_INDEX_FILE;
    memset(out, 0, sizeof *out);
    if (len > ST_ST_MAX_HEADER)
        return st_fail(STRATA_EFORMAT, "%s: %zu bytes, over the limit of %llu for an index",
                       file, len, ST_ST_MAX_HEADER);
    st_json j;
    st_arena a = {0};
    st_st_wm *e = NULL;
    size_t n = 0, cap = 0;
    int rc, have_map = 0;
    if ((rc = st_json_init(&j, json, len, file, "safetensors index")))
        return rc;
    if ((rc = st_json_expect(&j, '{', "to open the index")))
        goto out;
    if (!st_json_eat(&j, '}')) {
        do {
            if ((rc = st_json_string(&j, "a key")) || (rc = st_json_expect(&j, ':', "after a key")))
                goto out;
            if (st_json_is(&j, "weight_map")) {
                if (have_map++) {
                    rc = st_json_fail(&j, "weight_map given twice");
                    goto out;
                }
                if ((rc = read_weight_map(&j, &e, &n, &cap, &a)))
                    goto out;
            } else if ((rc = st_json_skip(&j, 1))) { /* "metadata" and anything else */
                goto out;
            }
        } while (st_json_eat(&j, ','));
        if ((rc = st_json_expect(&j, '}', "to close the index")))
            goto out;
    }
    st_json_ws(&j);
    if (j.p != j.end) {
        rc = st_json_fail(&j, "bytes after the index's JSON object");
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
                         st_json_show(e[i].name, strlen(e[i].name), show));
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
    st_json_free(&j);
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
        st_json_show(w->name, strlen(w->name), show);
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
                               st_json_show(all[i].t->name, strlen(all[i].t->name), show),
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
                         st_json_show(all[i].t->name, strlen(all[i].t->name), show),
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
