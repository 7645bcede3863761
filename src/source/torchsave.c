/* torchsave.c - torch.save archives read as state dicts of tensors (torchsave.h): the
 * tensors of a restricted pickle's tree, their storages in the zip, and the foreign metadata
 * of a set of archives. */
#include "torchsave.h"

#include <stdio.h>
#include <stdlib.h>

#include "../core/error.h"
#include "../core/geom.h"
#include "../meta/checks.h"

/* ---- the tensors of a pickle ---- */

/* 0 (*dt set) or -1; *complex: a complex dtype (which strata does not hold). */
static int storage_dtype(pk_global g, strata_dtype *dt, int *complex)
{
    int r = pk_torch_dtype(g, dt);
    *complex = r == 2;
    return r == 0 ? 0 : -1;
}

const pk_val *st_ts_tensor_call(const pk_val *v)
{
    if (v->kind != PK_CALL)
        return NULL;
    if (v->g == PK_G_REBUILD_PARAMETER && v->args->kind == PK_TUPLE && v->args->n >= 1)
        v = v->args->items[0];
    if (v->kind == PK_CALL && v->g == PK_G_REBUILD_FROM_TYPE_V2) {
        /* (func, type, args, state): a plain tensor's rebuild with attributes (state, left) */
        const pk_val *a = v->args;
        return a->kind == PK_TUPLE && a->n == 4 && a->items[0]->kind == PK_GLOBAL &&
                       a->items[0]->g == PK_G_REBUILD_TENSOR_V2 &&
                       a->items[1]->kind == PK_GLOBAL && a->items[1]->g == PK_G_TORCH_TENSOR &&
                       a->items[2]->kind == PK_TUPLE
                   ? v
                   : NULL;
    }
    return v->kind == PK_CALL && (v->g == PK_G_REBUILD_TENSOR_V2 ||
                                  v->g == PK_G_REBUILD_TENSOR_V3) ? v : NULL;
}

int st_ts_key_part(const pk_val *key, char *buf, size_t cap)
{
    int n;
    if (key->kind == PK_STR) {
        if (key->len >= cap || strlen((const char *)key->s) != key->len)
            return -1;
        memcpy(buf, key->s, key->len + 1);
        return (int)key->len;
    }
    if (key->kind != PK_INT && key->kind != PK_BOOL)
        return -1;
    n = snprintf(buf, cap, "%lld", (long long)key->i);
    return n < 0 || (size_t)n >= cap ? -1 : n;
}

typedef struct {
    st_ts_doc *d;
    const char *file;
    size_t tcap, scap;
    char name[STRATA_MAX_NAME + 1];
} walk_t;

static int push_tensor(walk_t *w, const st_ts_tensor *t)
{
    st_ts_doc *d = w->d;
    if (d->n == w->tcap) {
        size_t cap = w->tcap ? 2 * w->tcap : 16;
        st_ts_tensor *p = realloc(d->t, cap * sizeof *p);
        if (!p)
            return st_fail(STRATA_ENOMEM, "%s: out of memory", w->file);
        d->t = p;
        w->tcap = cap;
    }
    d->t[d->n++] = *t;
    return 0;
}

/* Records the storage (key, dtype, bytes) a tensor uses (checked and deduplicated once all
 * are known: st_ts_tensors). */
static int use_storage(walk_t *w, const char *key, strata_dtype dt, uint64_t bytes)
{
    st_ts_doc *d = w->d;
    if (d->nstorages == w->scap) {
        size_t cap = w->scap ? 2 * w->scap : 16;
        st_ts_storage *p = realloc(d->s, cap * sizeof *p);
        if (!p)
            return st_fail(STRATA_ENOMEM, "%s: out of memory", w->file);
        d->s = p;
        w->scap = cap;
    }
    d->s[d->nstorages++] = (st_ts_storage){key, dt, bytes, NULL};
    return 0;
}

static int dims(const pk_val *v, uint64_t *out, int *n)
{
    if (v->kind != PK_TUPLE || v->n > STRATA_MAX_DIMS)
        return -1;
    for (size_t i = 0; i < v->n; i++) {
        int64_t x;
        if (pk_int64(v->items[i], &x) || x < 0) {
            st_clear_error();
            return -1;
        }
        out[i] = (uint64_t)x;
    }
    *n = (int)v->n;
    return 0;
}

int st_ts_tensor_info(st_ts_tensor *out, uint64_t *storage_bytes, const pk_val *call,
                      const char *nm, const char *file)
{
    const pk_val *a = call->g == PK_G_REBUILD_FROM_TYPE_V2 ? call->args->items[2] : call->args;
    int v3 = call->g == PK_G_REBUILD_TENSOR_V3;
    if (a->kind != PK_TUPLE || a->n < (v3 ? 7u : 6u) || a->n > (v3 ? 8u : 7u) ||
        a->items[0]->kind != PK_PID)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': %s takes (storage, offset, size, "
                       "stride, ...), not what the pickle gives", file, nm,
                       pk_global_name(call->g));
    const pk_val *pid = a->items[0]->args;
    int64_t off, numel_st;
    st_ts_tensor t = {0};
    uint64_t stride[STRATA_MAX_DIMS];
    int nstride = 0, cplx = 0;
    if (pid->kind != PK_TUPLE || pid->n != 5 || pid->items[0]->kind != PK_STR ||
        strcmp((const char *)pid->items[0]->s, "storage") != 0 ||
        pid->items[1]->kind != PK_GLOBAL || pid->items[2]->kind != PK_STR ||
        pk_int64(pid->items[4], &numel_st) || numel_st < 0)
        return st_clear_error(), st_fail(STRATA_EFORMAT, "%s: tensor '%s': its storage is not "
                                         "('storage', type, key, location, numel)", file, nm);
    const char *key = (const char *)pid->items[2]->s;
    if (!st_plain_name(key, pid->items[2]->len) || strlen(key) != pid->items[2]->len)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': bad storage key", file, nm);
    pk_global sg = pid->items[1]->g;
    int untyped = sg == PK_G_STORAGE_UNTYPED;
    if (!pk_is_storage(sg))
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': %s.%s is not a storage type", file, nm,
                       pk_global_module(sg), pk_global_name(sg));
    if (untyped && !v3)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': an untyped storage without a dtype",
                       file, nm);
    if (!untyped && storage_dtype(sg, &t.dtype, &cplx) && !cplx)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': %s.%s is not a storage type", file, nm,
                       pk_global_module(sg), pk_global_name(sg));
    if (v3 && !cplx) {
        strata_dtype vd;
        const pk_val *dv = a->items[6];
        if (dv->kind != PK_GLOBAL || (storage_dtype(dv->g, &vd, &cplx) && !cplx) ||
            pk_is_storage(dv->g))
            return st_fail(STRATA_EFORMAT, "%s: tensor '%s': _rebuild_tensor_v3's dtype is not "
                           "a dtype", file, nm);
        if (!cplx && !untyped && vd != t.dtype)
            return st_fail(STRATA_EFORMAT, "%s: tensor '%s': dtype %s on a storage of %s", file,
                           nm, strata_dtype_name(vd), strata_dtype_name(t.dtype));
        t.dtype = vd;
    }
    if (cplx)
        return st_fail(STRATA_ENOTSUP, "%s: tensor '%s' is complex, a dtype strata does not "
                       "have", file, nm);
    if (pk_int64(a->items[1], &off) || off < 0 || dims(a->items[2], t.shape, &t.ndim) ||
        dims(a->items[3], stride, &nstride) || nstride != t.ndim)
        return st_clear_error(), st_fail(STRATA_EFORMAT, "%s: tensor '%s': bad storage offset, "
                                         "size or stride (tuples of at most %d ints >= 0)",
                                         file, nm, STRATA_MAX_DIMS);
    uint64_t esz = strata_dtype_size(t.dtype), numel = 1, sbytes, want = 1;
    int of = 0;
    for (int d = 0; d < t.ndim; d++)
        of |= !st_mul_ok(numel, t.shape[d], &numel);
    if (of) { /* numel wrapped: say so, never a wrapped count */
        char sh[24 * STRATA_MAX_DIMS] = "";
        for (int d = 0; d < t.ndim; d++)
            snprintf(sh + strlen(sh), sizeof sh - strlen(sh), "%s%llu", d ? ", " : "",
                     (unsigned long long)t.shape[d]);
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': its shape (%s) holds 2^64 elements "
                       "or more, which no storage holds", file, nm, sh);
    }
    for (int d = t.ndim - 1; d >= 0 && numel && !of; d--) { /* an empty tensor: any stride */
        if (t.shape[d] > 1 && stride[d] != want)
            return st_fail(STRATA_ENOTSUP, "%s: tensor '%s' is not contiguous in its storage "
                           "(stride %llu on dim %d, not %llu): strata reads each tensor as one "
                           "run of bytes; save tensor.contiguous()", file, nm,
                           (unsigned long long)stride[d], d, (unsigned long long)want);
        want *= t.shape[d];
    }
    if (of || !st_mul_ok(numel, esz, &t.bytes) || t.bytes > (UINT64_MAX >> 2) ||
        !st_mul_ok((uint64_t)numel_st, untyped ? 1 : esz, &sbytes) || sbytes > (UINT64_MAX >> 2) ||
        !st_mul_ok((uint64_t)off, esz, &t.offset) || t.offset > sbytes ||
        t.bytes > sbytes - t.offset)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': its %llu elements at offset %lld lie "
                       "outside its storage '%s' of %llu bytes", file, nm,
                       (unsigned long long)numel, (long long)off, key,
                       (unsigned long long)(untyped ? (uint64_t)numel_st : numel_st * esz));
    if (untyped && sbytes % esz)
        return st_fail(STRATA_EFORMAT, "%s: tensor '%s': storage '%s' of %llu bytes is not "
                       "whole elements of %s", file, nm, key, (unsigned long long)sbytes,
                       strata_dtype_name(t.dtype));
    t.storage = key;
    *out = t;
    *storage_bytes = sbytes;
    return 0;
}

static int tensor(walk_t *w, const pk_val *call, size_t len)
{
    st_ts_tensor t;
    uint64_t sbytes;
    if (len == 0)
        return st_fail(STRATA_ENOTSUP, "%s: the archive's root is a tensor, not a state dict "
                       "(strata reads state dicts: dicts, lists and tuples of tensors)",
                       w->file);
    int rc = st_ts_tensor_info(&t, &sbytes, call, w->name, w->file);
    if (!rc)
        rc = use_storage(w, t.storage, t.dtype, sbytes);
    if (rc)
        return rc;
    if (!(t.name = st_arena_strndup(&w->d->arena, w->name, len)))
        return st_fail(STRATA_ENOMEM, "%s: out of memory", w->file);
    return push_tensor(w, &t);
}

/* A dict's keys compared as Python would for the kinds that can repeat (str, int and bool,
 * bytes, None); other kinds compare as unequal. */
static int key_rank(const pk_val *k)
{
    return k->kind == PK_STR ? 1 : k->kind == PK_INT || k->kind == PK_BOOL ? 2
         : k->kind == PK_BYTES ? 3 : k->kind == PK_NONE ? 4 : 0;
}

static int cmp_key(const void *pa, const void *pb)
{
    const pk_val *a = *(const pk_val *const *)pa, *b = *(const pk_val *const *)pb;
    int ra = key_rank(a), rb = key_rank(b);
    if (ra != rb || ra == 0)
        return ra != rb ? (ra < rb ? -1 : 1) : (a < b ? -1 : a > b);
    if (ra == 2)
        return a->i < b->i ? -1 : a->i > b->i;
    if (ra == 4)
        return 0;
    size_t n = a->len < b->len ? a->len : b->len;
    int c = memcmp(a->s, b->s, n);
    return c ? c : a->len < b->len ? -1 : a->len > b->len;
}

static int no_dup_keys(walk_t *w, const pk_val *d, size_t len)
{
    if (d->n < 2)
        return 0;
    const pk_val **k = malloc(d->n * sizeof *k);
    if (!k)
        return st_fail(STRATA_ENOMEM, "%s: out of memory", w->file);
    for (size_t i = 0; i < d->n; i++)
        k[i] = d->items[2 * i];
    qsort(k, d->n, sizeof *k, cmp_key);
    int rc = 0;
    for (size_t i = 1; i < d->n && !rc; i++)
        if (key_rank(k[i]) && cmp_key(&k[i - 1], &k[i]) == 0) {
            char part[80];
            int n = st_ts_key_part(k[i], part, sizeof part);
            rc = st_fail(STRATA_EFORMAT, "%s: the dict at '%.*s' holds the key %s%s%s twice",
                         w->file, (int)len, len ? w->name : "<root>", n < 0 ? "" : "'",
                         n < 0 ? "(not a str or int)" : part, n < 0 ? "" : "'");
        }
    free(k);
    return rc;
}

/* Walks v at the name w->name[0..len); bad: why the name cannot name a tensor (or NULL). */
static int walk(walk_t *w, const pk_val *v, size_t len, const char *bad)
{
    const pk_val *call = st_ts_tensor_call(v);
    if (call) {
        w->name[len] = 0;
        if (bad)
            return st_fail(STRATA_EFORMAT, "%s: a tensor under '%s' %s", w->file,
                           len ? w->name : "<root>", bad);
        return tensor(w, call, len);
    }
    if (v->kind != PK_DICT && v->kind != PK_LIST && v->kind != PK_TUPLE)
        return 0;
    int rc = v->kind == PK_DICT ? no_dup_keys(w, v, len) : 0;
    for (size_t i = 0; i < v->n && !rc; i++) {
        const pk_val *key = v->kind == PK_DICT ? v->items[2 * i] : NULL;
        const pk_val *child = v->kind == PK_DICT ? v->items[2 * i + 1] : v->items[i];
        char part[STRATA_MAX_NAME + 2];
        int n = key ? st_ts_key_part(key, part, sizeof part)
                    : snprintf(part, sizeof part, "%zu", i);
        const char *why = bad;
        size_t at = len ? len + 1 : 0, nl = len;
        if (!why && n < 0) {
            why = "has a key that is not a str or an int";
        } else if (!why && at + (size_t)n > STRATA_MAX_NAME) {
            why = "makes a name longer than STRATA_MAX_NAME bytes";
        } else if (!why) {
            if (len)
                w->name[len] = '.';
            memcpy(w->name + at, part, (size_t)n);
            nl = at + (size_t)n;
        }
        rc = walk(w, child, nl, why);
        w->name[len] = 0;
    }
    return rc;
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp(((const st_ts_tensor *)a)->name, ((const st_ts_tensor *)b)->name);
}

static int cmp_storage(const void *a, const void *b)
{
    return strcmp(((const st_ts_storage *)a)->key, ((const st_ts_storage *)b)->key);
}

int st_ts_tensors(st_ts_doc *d, const char *file)
{
    walk_t w = {d, file ? file : "torch.save archive", 0, 0, {0}};
    int rc = walk(&w, d->pk.root, 0, NULL);
    if (rc)
        return rc;
    if (d->n > 1)
        qsort(d->t, d->n, sizeof *d->t, cmp_tensor);
    if (d->nstorages > 1)
        qsort(d->s, d->nstorages, sizeof *d->s, cmp_storage);
    size_t k = 0;
    for (size_t i = 0; i < d->nstorages; i++) {
        const st_ts_storage *s = &d->s[i];
        if (k && strcmp(d->s[k - 1].key, s->key) == 0) {
            if (d->s[k - 1].dtype != s->dtype || d->s[k - 1].bytes != s->bytes)
                return st_fail(STRATA_EFORMAT, "%s: storage '%s' is used as %s of %llu bytes "
                               "and as %s of %llu bytes", w.file, s->key,
                               strata_dtype_name(d->s[k - 1].dtype),
                               (unsigned long long)d->s[k - 1].bytes,
                               strata_dtype_name(s->dtype), (unsigned long long)s->bytes);
            continue;
        }
        d->s[k++] = *s;
    }
    d->nstorages = k;
    for (size_t i = 1; i < d->n; i++)
        if (strcmp(d->t[i - 1].name, d->t[i].name) == 0)
            return st_fail(STRATA_EFORMAT, "%s: two entries name tensor '%s' (keys joined with "
                           "'.')", w.file, d->t[i].name);
    for (size_t i = 0; i < d->n; i++)
        if (!d->t[i].name[0])
            return st_fail(STRATA_EFORMAT, "%s: a tensor with an empty name", w.file);
    return 0;
}

void st_ts_doc_free(st_ts_doc *d)
{
    pk_free(&d->pk);
    free(d->t);
    free(d->s);
    st_arena_free(&d->arena);
    memset(d, 0, sizeof *d);
}

const st_ts_tensor *st_ts_find(const st_ts_doc *d, const char *name)
{
    size_t lo = 0, hi = d->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(d->t[mid].name, name);
        if (!c)
            return &d->t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* ---- an archive ---- */

void st_ts_close(st_ts_archive *a)
{
    st_ts_doc_free(&a->doc);
    free(a->pkl_bytes);
    st_zip_free(&a->zip);
    memset(a, 0, sizeof *a);
}

/* The unique <dir>/data.pkl entry; its <dir>/ into prefix. */
static int find_pkl(st_ts_archive *a, const char *file, char *prefix, size_t cap)
{
    for (size_t i = 0; i < a->zip.n; i++) {
        const char *n = a->zip.e[i].name, *slash = strchr(n, '/');
        if (!slash || strcmp(slash, "/data.pkl") != 0)
            continue;
        if (a->pkl)
            return st_fail(STRATA_EFORMAT, "%s: two pickles, '%s' and '%s'", file,
                           a->pkl->name, n);
        a->pkl = &a->zip.e[i];
    }
    if (!a->pkl)
        return st_fail(STRATA_EFORMAT, "%s: a zip archive without a <dir>/data.pkl entry: not "
                       "a torch.save file", file);
    size_t n = (size_t)(strchr(a->pkl->name, '/') - a->pkl->name) + 1;
    if (n + 256 > cap)
        return st_fail(STRATA_EFORMAT, "%s: entry '%s': its directory name is too long", file,
                       a->pkl->name);
    memcpy(prefix, a->pkl->name, n);
    prefix[n] = 0;
    return 0;
}

static int stored(const st_zip_entry *e, const char *file)
{
    if (e->method != 0)
        return st_fail(STRATA_ENOTSUP, "%s: entry '%s' is compressed (zip method %u): strata "
                       "reads stored entries only, as torch.save writes them", file, e->name,
                       e->method);
    return 0;
}

int st_ts_open(st_ts_archive *a, uint64_t file_size, st_zip_read_fn rd, void *ctx,
               const char *file)
{
    memset(a, 0, sizeof *a);
    file = file ? file : "torch.save archive";
    char prefix[ST_ZIP_MAX_NAME + 8], name[ST_ZIP_MAX_NAME + 8 + 256];
    int rc = st_zip_open(&a->zip, file_size, rd, ctx, file);
    if (!rc)
        rc = find_pkl(a, file, prefix, sizeof prefix);
    if (rc)
        goto fail;
    snprintf(name, sizeof name, "%sbyteorder", prefix);
    const st_zip_entry *bo = st_zip_find(&a->zip, name);
    if (bo) {
        char b[8] = {0};
        if ((rc = stored(bo, file)))
            goto fail;
        if (bo->usize > 7 || (rc = st_zip_read(&a->zip, bo, b, rd, ctx, file)))
            rc = rc ? rc : st_fail(STRATA_EFORMAT, "%s: entry '%s' is not 'little' or 'big'",
                                   file, name);
        else if (strcmp(b, "little") != 0)
            rc = st_fail(strcmp(b, "big") ? STRATA_EFORMAT : STRATA_ENOTSUP, "%s: byteorder "
                         "'%s': strata reads little-endian archives", file, b);
        if (rc)
            goto fail;
    }
    if ((rc = stored(a->pkl, file)))
        goto fail;
    if (a->pkl->usize > ST_TS_MAX_PKL) {
        rc = st_fail(STRATA_EFORMAT, "%s: '%s' of %llu bytes is over the limit of %llu", file,
                     a->pkl->name, (unsigned long long)a->pkl->usize, ST_TS_MAX_PKL);
        goto fail;
    }
    if (!(a->pkl_bytes = malloc(a->pkl->usize ? a->pkl->usize : 1))) {
        rc = st_fail(STRATA_ENOMEM, "%s: out of memory for '%s'", file, a->pkl->name);
        goto fail;
    }
    snprintf(name, sizeof name, "%s: %s", file, a->pkl->name);
    if ((rc = st_zip_read(&a->zip, a->pkl, a->pkl_bytes, rd, ctx, file)) ||
        (rc = pk_parse(&a->doc.pk, a->pkl_bytes, a->pkl->usize, name)) ||
        (rc = st_ts_tensors(&a->doc, file)))
        goto fail;
    for (size_t i = 0; i < a->doc.nstorages; i++) {
        st_ts_storage *s = &a->doc.s[i];
        snprintf(name, sizeof name, "%sdata/%s", prefix, s->key);
        if (!(s->entry = st_zip_find(&a->zip, name))) {
            rc = st_fail(STRATA_EFORMAT, "%s: storage '%s' has no entry '%s'", file, s->key,
                         name);
            goto fail;
        }
        if ((rc = stored(s->entry, file)))
            goto fail;
        if (s->entry->usize != s->bytes) {
            rc = st_fail(STRATA_EFORMAT, "%s: entry '%s' holds %llu bytes, its storage %llu",
                         file, name, (unsigned long long)s->entry->usize,
                         (unsigned long long)s->bytes);
            goto fail;
        }
    }
    for (size_t i = 0; i < a->doc.n; i++) {
        st_ts_tensor *t = &a->doc.t[i];
        st_ts_storage k = {.key = t->storage};
        const st_ts_storage *s = bsearch(&k, a->doc.s, a->doc.nstorages, sizeof k, cmp_storage);
        t->at = s->entry->data_off + t->offset;
    }
    return 0;
fail:
    st_ts_close(a);
    return rc;
}

/* ---- the metadata of a set of archives ---- */

typedef struct {
    const st_ts_tensor *t;
    uint32_t file;
} src_tensor;

static int cmp_src(const void *a, const void *b)
{
    return strcmp(((const src_tensor *)a)->t->name, ((const src_tensor *)b)->t->name);
}

static int check_map(const st_st_map *map, const src_tensor *all, size_t n,
                     const st_ts_file *files, const char *where)
{
    size_t j = 0; /* both sorted by name */
    for (size_t i = 0; i < map->n; i++) {
        const st_st_wm *w = &map->e[i];
        while (j < n && strcmp(all[j].t->name, w->name) < 0)
            j++;
        if (j == n || strcmp(all[j].t->name, w->name) != 0)
            return st_fail(STRATA_EFORMAT, "%s: %s maps tensor '%s' to '%s', which does not "
                           "hold it", where, ST_TS_INDEX_FILE, w->name, w->file);
        if (strcmp(files[all[j].file].name, w->file) != 0)
            return st_fail(STRATA_EFORMAT, "%s: %s maps tensor '%s' to '%s', but it is in "
                           "'%s'", where, ST_TS_INDEX_FILE, w->name, w->file,
                           files[all[j].file].name);
    }
    for (size_t i = 0, k = 0; i < n; i++) {
        while (k < map->n && strcmp(map->e[k].name, all[i].t->name) < 0)
            k++;
        if (k == map->n || strcmp(map->e[k].name, all[i].t->name) != 0)
            return st_fail(STRATA_EFORMAT, "%s: tensor '%s' of '%s' is not in the weight_map "
                           "of %s", where, all[i].t->name, files[all[i].file].name,
                           ST_TS_INDEX_FILE);
    }
    return 0;
}

static int fill_tensor(st_meta *m, st_mtensor *mt, const st_ts_tensor *t, uint32_t file)
{
    memset(mt, 0, sizeof *mt);
    mt->name = st_arena_strndup(&m->arena, t->name, strlen(t->name));
    mt->dtype = t->dtype;
    mt->ndim = t->ndim;
    mt->bytes = t->bytes;
    memcpy(mt->shape, t->shape, sizeof mt->shape);
    if (!mt->name)
        return STRATA_ENOMEM;
    size_t dl = (size_t)(t->ndim ? t->ndim : 1) * sizeof(uint64_t);
    st_mshard *sh = st_arena_alloc(&m->arena, sizeof *sh);
    if (!sh || !(sh->off = st_arena_alloc(&m->arena, dl)) ||
        !(sh->len = st_arena_alloc(&m->arena, dl)))
        return STRATA_ENOMEM;
    for (int d = 0; d < t->ndim; d++) {
        sh->off[d] = 0;
        sh->len[d] = t->shape[d];
    }
    sh->fs = 0;
    sh->fe = t->bytes / strata_dtype_size(t->dtype);
    sh->flat = 0;
    sh->ext = (st_extent){file, t->at, t->bytes, NULL};
    mt->nshards = 1;
    mt->shards = sh;
    return 0;
}

int st_ts_zip_checks(st_meta *m, const st_ts_file *files, size_t nfiles, const char *where)
{
    st_check_set cs = {0};
    int rc = 0;
    for (size_t f = 0; f < nfiles && !rc; f++)
        rc = st_check_add_zip(&cs, &files[f].a->zip, (uint32_t)f, 0);
    if (!rc)
        rc = st_meta_set_checks(m, &cs, where);
    st_check_set_free(&cs);
    return rc;
}

int st_ts_meta(st_meta **out, const st_ts_file *files, size_t nfiles, const st_st_map *map,
               const char *where)
{
    *out = NULL;
    size_t nt = 0;
    for (size_t f = 0; f < nfiles; f++)
        nt += files[f].a->doc.n;
    st_meta *m = calloc(1, sizeof *m);
    src_tensor *all = malloc((nt ? nt : 1) * sizeof *all);
    int rc = 0;
    if (!m || !all || nfiles > UINT32_MAX)
        goto oom;
    m->foreign = 1;
    m->chunk = 1;
    m->nfiles = (uint32_t)nfiles;
    m->files = st_arena_alloc(&m->arena, (nfiles ? nfiles : 1) * sizeof *m->files);
    m->idents = st_arena_alloc(&m->arena, (nfiles ? nfiles : 1) * sizeof *m->idents);
    m->blobs = st_arena_alloc(&m->arena, (nfiles ? nfiles : 1) * sizeof *m->blobs);
    m->tensors = st_arena_alloc(&m->arena, (nt ? nt : 1) * sizeof *m->tensors);
    if (!m->files || !m->idents || !m->blobs || !m->tensors)
        goto oom;
    size_t k = 0;
    for (size_t f = 0; f < nfiles; f++) {
        const st_ts_archive *a = files[f].a;
        char *fname = st_arena_strndup(&m->arena, files[f].name, strlen(files[f].name));
        size_t bl = strlen(files[f].name) + 1 + strlen(a->pkl->name);
        char *bname = st_arena_alloc(&m->arena, bl + 1);
        if (!fname || !bname)
            goto oom;
        snprintf(bname, bl + 1, "%s/%s", files[f].name, a->pkl->name);
        m->files[f] = (st_mfile){fname, files[f].size};
        m->idents[f] = files[f].id;
        m->blobs[f] = (st_mblob){bname, -1,
                                 {(uint32_t)f, a->pkl->data_off, a->pkl->usize, NULL}};
        m->data_bytes += a->pkl->usize;
        for (size_t i = 0; i < a->doc.n; i++)
            all[k++] = (src_tensor){&a->doc.t[i], (uint32_t)f};
    }
    m->nblobs = nfiles;
    if (nt > 1)
        qsort(all, nt, sizeof *all, cmp_src);
    for (size_t i = 1; i < nt; i++)
        if (strcmp(all[i - 1].t->name, all[i].t->name) == 0) {
            rc = st_fail(STRATA_EFORMAT, "%s: tensor '%s' is in both '%s' and '%s'", where,
                         all[i].t->name, files[all[i - 1].file].name, files[all[i].file].name);
            goto out;
        }
    if (map && (rc = check_map(map, all, nt, files, where)))
        goto out;
    for (size_t i = 0; i < nt; i++) {
        if (!all[i].t->bytes) /* an empty tensor: not in the index */
            continue;
        if (fill_tensor(m, &m->tensors[m->ntensors++], all[i].t, all[i].file))
            goto oom;
        m->data_bytes += all[i].t->bytes;
    }
    rc = st_ts_zip_checks(m, files, nfiles, where);
    goto out;
oom:
    rc = st_fail(STRATA_ENOMEM, "%s: out of memory", where);
out:
    free(all);
    if (rc) {
        st_meta_free(m);
        return rc;
    }
    *out = m;
    return 0;
}
